"""``LtaWorker``: reduce a float32 tensor through a switch over UDP, renormalize, fall back.

The front that users and the torch layer hold: it checks its arguments, owns the socket, the heartbeat
and the health verdicts (health.py), and hands every reduce to its :class:`ReduceEngine` (engine.py),
the one owner of a reduce's state."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import numpy as np

from hostlib.job import check_worker_count
from hostlib.protocol import HEAL_REQUEST_BASE, packet_bytes
from hostlib.transport.config import TransportConfig, default_window_cap
from hostlib.transport.deadlines import Deadlines
from hostlib.transport.earlyclose import EarlyClose
from hostlib.transport.engine import ReduceEngine
from hostlib.transport.health import HealthMonitor, probe_switch
from hostlib.transport.heartbeat import Heartbeat
from hostlib.transport.inbox import ParamInbox
from hostlib.transport.io import WorkerIO
from hostlib.transport.pacing import RateLearner, TokenBucket
from hostlib.transport.plan import ReducePlan
from hostlib.transport.result import ReduceResult, TransportStats
from hostlib.transport.reuse import SlotReuse
from hostlib.transport.trace import EngineTrace


class LtaWorker:
    """One worker of one job: reduces tensors through the switch at ``switch_addr`` over UDP.

    All workers of a job must call :meth:`allreduce` with tensors of the same lengths in the same order
    (as DDP does): the slot and round of every packet follow from that order. ``trace``: an
    :class:`EngineTrace` told of each step of every reduce (benchmarks)."""

    def __init__(
        self,
        job_id: int,
        worker_id: int,
        n_workers: int,
        switch_addr: tuple[str, int],
        *,
        config: TransportConfig | None = None,
        bind: tuple[str, int] = ("127.0.0.1", 0),
        trace: EngineTrace | None = None,
    ) -> None:
        check_worker_count(job_id, n_workers)
        if not 0 <= worker_id < n_workers:
            raise ValueError(f"worker_id must be in 0..{n_workers - 1}, got {worker_id}")
        self.job_id, self.worker_id, self.n_workers = job_id, worker_id, n_workers
        self.config = cfg = config or TransportConfig()
        self.switch_addr = (socket.gethostbyname(switch_addr[0]), switch_addr[1])
        size = packet_bytes(cfg.elems_per_packet)
        self.io = WorkerIO(bind, self.switch_addr, size, cfg.socket_buffer_bytes, cfg.io)
        self.sock = self.io.sock
        self.address: tuple[str, int] = self.sock.getsockname()
        try:
            rcvbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            # Linux reports twice the usable size; keep a window that fits our own receive buffer.
            fit = max(2, rcvbuf // 2 // (size + 64))
            window = min(cfg.window or min(fit, default_window_cap(size)), cfg.data_slots)
            self.engine = ReduceEngine(job_id, worker_id, n_workers, cfg, self.io, window)
        except BaseException:
            self.io.close()
            raise
        self.engine.trace = trace
        self.health = HealthMonitor(
            cfg, job_id, worker_id, n_workers, self.switch_addr, self.engine.deadlines
        )
        self.heartbeat: Heartbeat | None = None
        if cfg.heartbeat_interval_s > 0:
            self.heartbeat = Heartbeat(
                self.sock,
                self.switch_addr,
                job_id=job_id,
                worker_id=self.engine.switch_id,
                elems_per_packet=cfg.elems_per_packet,
                interval_s=cfg.heartbeat_interval_s,
                relay=not self.engine.own_leaf,
                progress=lambda: self.engine.settled_to,
            ).start()

    # ---- what the engine owns, seen through the front --------------------------------------------
    @property
    def stats(self) -> TransportStats:
        return self.engine.stats

    @property
    def deadlines(self) -> Deadlines:
        return self.engine.deadlines

    @property
    def reuse(self) -> SlotReuse:
        return self.engine.reuse

    @property
    def pacer(self) -> TokenBucket:
        return self.engine.pacer

    @property
    def rate_learner(self) -> RateLearner:
        return self.engine.rate_learner

    @property
    def early(self) -> EarlyClose | None:
        return self.engine.early

    @property
    def window(self) -> int:
        return self.engine.window

    @window.setter
    def window(self, units: int) -> None:
        self.engine.window = units

    @property
    def probe_slot(self) -> int:
        return self.engine.probe_slot

    @property
    def own_leaf(self) -> bool:
        return self.engine.own_leaf

    @property
    def switch_id(self) -> int:
        return self.engine.switch_id

    @property
    def param_inbox(self) -> ParamInbox:
        return self.engine.param_inbox

    @property
    def param_requests(self) -> set[int]:
        return self.engine.param_requests

    @property
    def param_responder(self) -> Any:
        return self.engine.param_responder

    @param_responder.setter
    def param_responder(self, respond: Any) -> None:
        self.engine.param_responder = respond

    @property
    def srtt_ms(self) -> float | None:
        return self.engine.deadlines.srtt_ms

    @property
    def rttvar_ms(self) -> float:
        return self.engine.deadlines.rttvar_ms

    @property
    def last_nothing_fraction(self) -> float:
        return self.health.last_nothing_fraction

    # The engine's receive step, replaceable as a whole (tests make a worker lose a chosen RESULT).
    @property
    def _handle(self) -> Any:
        return self.engine._handle

    @_handle.setter
    def _handle(self, handle: Any) -> None:
        self.engine._handle = handle  # type: ignore[method-assign]

    @property
    def _header(self) -> dict[str, int]:
        return self.engine._header

    def _plan_for(self, n: int) -> ReducePlan:
        return self.engine._plan_for(n)

    # ---- public API ----------------------------------------------------------------------------
    def send_by_call(self, uplink: Callable[[np.ndarray], int]) -> None:
        """Send to a switch that runs in this process by calling ``uplink`` (packet rows in, how many it
        took out; ``SoftSwitchServer.local_port``) instead of through the socket. Replies still come on
        the socket, and the heartbeat keeps it."""
        self.io.uplink = uplink
        self.engine.stats.io = self.io.mode

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.io.close()

    def __enter__(self) -> LtaWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def units_in_buffer(self, rcvbuf_bytes: int, senders: int = 1) -> int:
        """The window (at least 2) with which ``senders`` workers' units in flight fit a receive buffer
        that the kernel reports as ``rcvbuf_bytes`` (twice the usable size; a datagram takes about its
        length plus 64 bytes of it, the rest of the doubling covers the kernel's per-packet overhead)."""
        return max(2, rcvbuf_bytes // 2 // (self.engine.packet_bytes + 64) // max(1, senders))

    def fit_window_to_switch(self, rcvbuf_bytes: int, sockets: int = 1) -> int:
        """Shrink the window so that every worker of the job can have its window in flight at once in a
        switch receive buffer of ``rcvbuf_bytes`` (as the kernel reports it), of which the switch has
        ``sockets`` (worker w steered to socket w mod sockets, softswitch/server.py): a self-hosted
        softswitch's sockets take every worker's window, and an overflow there is real loss (a deadline
        and a FLUSH per datagram). Returns the window now in force; never grows it."""
        senders = -(-self.n_workers // max(1, sockets))
        self.engine.window = min(self.engine.window, self.units_in_buffer(rcvbuf_bytes, senders))
        return self.engine.window

    def check_switch(self, timeout_s: float | None = None) -> float:
        """Ask the switch whether it knows this job and this worker's address, before training: FLUSH
        round ``PROBE_SEQ`` of the reserved slot P-1, resent with backoff (from 50 ms) until a RESULT for
        it comes back or ``timeout_s`` (default ``config.health_timeout_s``) passes. Returns the seconds
        the answer took; raises :class:`HealthCheckError` saying what to check when none came. The probe
        changes no slot that units use, so a worker may run it while the job trains (a rejoin)."""
        timeout = self.config.health_timeout_s if timeout_s is None else timeout_s
        return probe_switch(self.engine, self.switch_addr, self.address, timeout)

    @property
    def healthy(self) -> bool:
        """False while the latest reduces got (almost) nothing from the network, or ended with this worker
        locked out of its peers' rounds (config.on_unhealthy)."""
        return self.health.healthy

    def unhealthy_since_mark(self, reset: bool = True) -> bool:
        """Whether any reduce since the last call (with ``reset``) was unhealthy; the torch layer's
        per-step ``should_commit`` signal."""
        return self.health.unhealthy_since_mark(reset)

    def allreduce(
        self,
        x: Any,
        *,
        step: int = 0,
        key: Any = None,
        weight: int = 1,
        critical: Any = None,
        out: np.ndarray | None = None,
        owners: np.ndarray | None = None,
        scale: float = 1.0,
    ) -> ReduceResult:
        """Mean of ``x`` over the workers whose packets arrived, renormalized per chunk.

        ``x``: float array or tensor (any shape; flattened). ``key`` names the tensor for the ``prev``
        fallback (default: its length). ``weight``: this worker's sample count, summed by the switch
        and used as the divisor when ``renormalize='weight'``. Unbiased for any drop pattern that is
        independent of the values, up to the codec's error bound (``2^-shift`` per chunk): a worker
        whose exponent proposal for a chunk was not counted in the agreed exponent withholds that
        chunk, whatever its values (``ReduceResult.withheld``), so what is missing never depends on them.

        With ``config.exact`` (emulated loss) the reduce ends with a fence chunk (see the config): every
        round closes by the drop policy's decisions, none by a timer.

        ``critical``: chunks that must come back with every worker counted (LTP's critical packets): a
        bool mask with one entry per chunk, or value ranges ``[(start, stop), ...]`` (every chunk holding
        one of their values). Their GRADs are resent on the RTO until the round closes; no worker
        FLUSHes them, so every worker of the job must mark the same chunks (as it passes the same
        lengths). They are flushed like the rest only when a peer looks dead, or after
        ``config.critical_max_resends`` resends (the slot may have moved on: see the config; resends
        made while a live peer had not reached the unit yet, or in the first two ``max_deadline_ms``, do
        not count, for up to ``config.critical_wait_ms``), and given up at ``reduce_timeout_s``;
        ``stats.critical_*`` counts what happened to them.

        ``out``: a C-contiguous float32 array of ``x``'s size to write the result into (it may be ``x``'s
        own memory: a chunk's input is read before its values are written); ``ReduceResult.values`` is
        then ``out`` itself, flattened. Each chunk's values go there as its RESULT arrives, while the
        reduce waits for the others (the rest at the end), so an exception out of the reduce can leave
        ``out`` part written. Without it every call returns a new array, the caller's to change (the
        ``prev`` fallback keeps its own copy either way). Reusing one buffer saves a fresh
        allocation (and its page faults) per reduce.

        ``owners``: one int per chunk, the only worker that needs that chunk's result (-1: every worker),
        the same on every worker (a reduce-scatter). Those chunks go owner-only (Flag.OWNER): the switch
        sends their RESULT to the owner alone; a worker sends the chunks others own and waits for none of
        them, except the last chunk and every ``engine.news_every``-th, which are always every worker's
        (their RESULTs show each worker how far its peers got: docs/protocol.md, "Owner-only units"). In
        the result, a chunk another worker owns has count 0, no fallback, and unspecified values; stats
        and the health check count only the chunks this worker waits for.

        ``scale``: the values come back times this (the world size turns the mean into the estimate of a
        SUM), multiplied in the pass that writes them; the ``prev`` fallback keeps the mean."""
        local = _as_float32(x)
        if out is not None:
            _check_out(out, local.size)
        result, outcome = self.engine.reduce(
            local, step=step, key=key, weight=weight, critical=critical, out=out, owners=owners, scale=scale
        )
        self.health.check(outcome.got_nothing, outcome.chunks, outcome.passed)
        return result

    def broadcast_params(
        self, chunk_ids: np.ndarray, values: np.ndarray, *, step: int = 0, critical: bool = False
    ) -> None:
        """Send absolute float32 values of the given chunks (rows of ``values``, K each) as PARAM; the
        switch replicates them to every other worker. ``critical`` exempts them from emulated loss."""
        self.engine.broadcast_params(chunk_ids, values, step=step, critical=critical)

    def request_params(self, chunk_ids: np.ndarray, *, step: int = 0) -> None:
        """Ask the owners of these chunks for a reliable resend (PARAM_REQ, marked critical)."""
        self.engine.request_params(chunk_ids, step=step)

    @property
    def heal_inbox(self) -> dict[tuple[int, int], dict[int, np.ndarray]]:
        """State streams peers sent to heal a rank behind: per (sender, its step), index -> values."""
        return self.engine.heal_inbox

    @property
    def heal_requests(self) -> set[int]:
        """Ranks that asked this worker for its state (hostlib/torch_ext/heal.py), not answered yet."""
        return self.engine.heal_requests

    def request_heal(self, donor: int) -> None:
        """Ask worker ``donor`` for its state (a PARAM_REQ of chunk ``HEAL_REQUEST_BASE + donor``,
        critical); the switch relays it to every other worker, and only ``donor`` keeps it."""
        self.engine.request_params(np.array([HEAL_REQUEST_BASE + donor], dtype=np.int64))

    def poll(self, timeout_s: float = 0.0) -> None:
        """Receive whatever arrived (parameter broadcasts, requests) for up to ``timeout_s``."""
        self.engine.poll(timeout_s)

    def codec_state(self) -> dict[str, Any]:
        """What the next reduces depend on besides their inputs (copies): the stochastic-rounding
        generator, the unit counter (slot and round of every packet) and the ``prev`` fallback's last
        values. :meth:`load_codec_state` on a fresh worker of the same job makes its next reduces
        round and number their packets exactly as this one's would (checkpoint/restore)."""
        return self.engine.codec_state()

    def load_codec_state(self, state: dict[str, Any]) -> None:
        self.engine.load_codec_state(state)

    def rejoin_at(self, next_unit: int) -> None:
        """After taking a peer's state (torch_ext/heal.py): number the next reduce's units from the peers'
        ``next_unit`` and forget the exponents agreed in reduces before it; rounding stream and ``prev``
        kept (ReduceEngine.rejoin_at)."""
        self.engine.rejoin_at(next_unit)

    def input_buffer(self, n: int) -> np.ndarray:
        """The float32 buffer (``n`` values, C-contiguous) a reduce of ``n`` values stages its input in.
        A caller that writes its input there and passes it as ``x`` to :meth:`allreduce` saves a copy; the
        next reduce of that length overwrites it."""
        return self.engine.input_buffer(n)


def _check_out(out: Any, n: int) -> None:
    if not (
        isinstance(out, np.ndarray)
        and out.dtype == np.float32
        and out.size == n
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        raise ValueError(
            f"out must be a writable C-contiguous float32 array of {n} values, got "
            f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}"
        )


def _as_float32(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"allreduce needs a numeric array or tensor, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
