"""Worker side of LTA over UDP: reduce a float32 tensor through a switch, renormalize, fall back.

``LtaWorker.allreduce(x)`` returns the mean over the workers whose contribution reached the switch,
chunk by chunk (sum · 2^-exp / count), together with each chunk's count, bitmap and the fallback used
where nothing arrived. It never waits without a deadline: a unit (one packet's worth) that gets no
RESULT is FLUSHed at its deadline, up to ``max_flushes`` times, then given up.

The protocol pieces (header, slots, exponent rounds) are described in docs/protocol.md.
"""

from __future__ import annotations

import enum
import heapq
import math
import select
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hostlib import codec
from hostlib.protocol import (
    DEFAULT_ELEMS_PER_PACKET,
    HEADER_BYTES,
    HEADER_STRUCT,
    INT32_MIN,
    MAX_WORKERS,
    VERSION,
    Flag,
    Op,
    batch_rows,
    check_elems_per_packet,
    empty_batch,
    packet_bytes,
)


class Fallback(enum.IntEnum):
    NONE = 0  # the chunk was renormalized from a RESULT with count > 0
    PREV = 1  # the value this worker returned for the chunk last time (paper's Algorithm 1)
    ZERO = 2  # zero ("bubble filling", LTP)
    LOCAL = 3  # this worker's own contribution


FALLBACK_POLICIES = {"prev": Fallback.PREV, "zero": Fallback.ZERO, "local": Fallback.LOCAL}

_DEAD_AFTER_RESULTS = 64  # see LtaWorker._track_absent
_QUANTIZE_BLOCK_VALUES = 1 << 16  # values quantized at once when a data packet needs them

# Unit states
_PENDING, _IN_FLIGHT, _DONE, _GAVE_UP = 0, 1, 2, 3


@dataclass
class TransportConfig:
    elems_per_packet: int = DEFAULT_ELEMS_PER_PACKET  # K
    pool_size: int = 512  # P, must equal the job's pool size on the switch
    window: int | None = None  # units in flight; None: as many as the socket buffers hold
    # Until the first RESULT of a reduce shows that every worker has started it, units wait this long:
    # workers reach a reduce at different times (skew), and flushing then would throw their data away.
    sync_deadline_ms: float = 200.0
    # A unit some peer has not reached yet (by the bitmaps, see LtaWorker._fast_flush) waits this long
    # for it: a late peer is not a lost packet. Units every peer has passed are flushed at once.
    lag_deadline_ms: float = 200.0
    # Exponent packets are 1/K of the traffic and gate every data packet: send each this many times
    # (the switch ignores duplicates), so one is lost with probability p**copies instead of p.
    exp_copies: int = 2
    # FLUSHes too: a lost FLUSH (or its answer) costs a doubled RTO; a duplicate costs one packet.
    flush_copies: int = 2
    initial_deadline_ms: float = 50.0  # the RTO before any round trip was measured
    min_deadline_ms: float = 20.0  # lower it on quiet, low-RTT networks (lta bench lossy does)
    max_deadline_ms: float = 500.0
    max_flushes: int = 3
    fallback: str = "prev"  # prev | zero | local
    # count: divide each chunk's sum by its arrival count (unbiased). weight: by the summed sample
    # weights. none: divide by N, as systems without counts do; a chunk missing contributions then
    # takes the fallback, except `zero`, which keeps sum/N (the lost ones count as zeros, LTP's
    # bubble filling). `none` exists for baselines.
    renormalize: str = "count"
    reduce_timeout_s: float = 60.0
    socket_buffer_bytes: int = 8 << 20
    seed: int = 0

    def __post_init__(self) -> None:
        check_elems_per_packet(self.elems_per_packet)
        if self.fallback not in FALLBACK_POLICIES:
            raise ValueError(f"fallback must be one of {sorted(FALLBACK_POLICIES)}, got {self.fallback!r}")
        if self.renormalize not in ("count", "weight", "none"):
            raise ValueError(f"renormalize must be 'count', 'weight' or 'none', got {self.renormalize!r}")
        if not 1 <= self.pool_size <= 65535:
            raise ValueError(f"pool_size must be in 1..65535, got {self.pool_size}")
        if self.exp_copies < 1 or self.flush_copies < 1:
            raise ValueError(
                f"exp_copies and flush_copies must be >= 1, got {self.exp_copies}, {self.flush_copies}"
            )
        if self.window is not None and not 1 <= self.window <= self.pool_size:
            raise ValueError(f"window must be in 1..pool_size={self.pool_size}, got {self.window}")
        if not 0 < self.min_deadline_ms <= self.max_deadline_ms:
            raise ValueError("need 0 < min_deadline_ms <= max_deadline_ms")


@dataclass
class ReduceResult:
    """What one allreduce returned, chunk by chunk (chunk c covers values [c·K, (c+1)·K))."""

    values: np.ndarray  # float32, the input's length: renormalized mean, or the fallback
    count: np.ndarray  # contributions summed per chunk (0 where no RESULT came)
    bitmap: np.ndarray  # uint64, bit w = worker w contributed
    fallback: np.ndarray  # Fallback code per chunk
    withheld: np.ndarray  # bool per chunk: this worker's values exceeded the agreed exponent (its
    # proposal was lost), so it sent nothing rather than a clamped, biased value
    saturated: np.ndarray  # bool per chunk: the RESULT carried SATURATED (some sender clamped)
    shift: np.ndarray  # per chunk fixed-point shift used (error bound 2^-shift)
    elapsed_s: float

    def contributors(self, chunk: int) -> list[int]:
        bits = int(self.bitmap[chunk])
        return [w for w in range(MAX_WORKERS) if bits >> w & 1]


@dataclass
class TransportStats:
    """Running totals over every allreduce of a worker."""

    reduces: int = 0
    chunks: int = 0
    chunks_full: int = 0  # count == N
    chunks_partial: int = 0  # 0 < count < N
    chunks_empty: int = 0  # a RESULT with count 0
    chunks_no_result: int = 0  # no RESULT at all, after every FLUSH
    chunks_no_exponent: int = 0  # this worker lost the exponent RESULT and sent nothing
    fallback_prev: int = 0
    fallback_zero: int = 0
    fallback_local: int = 0
    withheld_chunks: int = 0  # would have saturated: withheld instead of clamped
    saturated_results: int = 0  # RESULTs flagged SATURATED by some sender
    flushes_sent: int = 0
    packets_sent: int = 0
    packets_received: int = 0
    results_retx: int = 0
    packets_ignored: int = 0  # not ours, stale, or malformed
    units_overtaken: int = 0  # given up because their slot already moved to a later round
    params_received: int = 0
    elapsed_s: float = 0.0
    reduce_ms: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        times = np.array(self.reduce_ms) if self.reduce_ms else np.zeros(1)
        out["reduce_ms"] = {
            "p50": float(np.percentile(times, 50)),
            "p99": float(np.percentile(times, 99)),
            "max": float(times.max()),
        }
        return out


class _Plan:
    """Preallocated buffers for reduces of one length (reused every step)."""

    def __init__(self, n: int, k: int) -> None:
        self.n = n
        self.chunks_count = max(1, math.ceil(n / k))
        c = self.chunks_count
        self.exp_units = math.ceil(c / k)
        self.units = self.exp_units + c
        self.chunks = np.zeros((c, k), dtype=np.float32)
        self.exp_batch = empty_batch(self.exp_units, k)
        self.data_batch = empty_batch(c, k)
        self.exp_rows = batch_rows(self.exp_batch)
        self.data_rows = batch_rows(self.data_batch)
        self.sums = np.zeros((c, k), dtype=np.int32)
        self.count = np.zeros(c, dtype=np.int64)
        self.bitmap = np.zeros(c, dtype=np.uint64)
        self.weight = np.zeros(c, dtype=np.int64)
        self.shift = np.zeros(c, dtype=np.int32)
        self.has_exp = np.zeros(c, dtype=bool)  # quantized, within range: will be sent
        self.exp_known = np.zeros(c, dtype=bool)  # the agreed exponent arrived
        self.quantized = np.zeros(c, dtype=bool)
        self.saturated = np.zeros(c, dtype=bool)
        self.state = np.zeros(self.units, dtype=np.int8)
        self.sent_at = np.zeros(self.units, dtype=np.float64)
        self.flushes = np.zeros(self.units, dtype=np.int64)
        self.probes = np.zeros(self.units, dtype=np.int64)
        self.deadline_at = np.zeros(self.units, dtype=np.float64)
        self.result_flags = np.zeros(c, dtype=np.int64)
        self.base = 0  # global index of this reduce's first unit
        self.synced = False  # a RESULT of this reduce arrived: every worker is in it
        self.low = 0  # every unit below this index is done or given up
        self.frontier = np.full(0, -1, dtype=np.int64)  # per worker: highest unit it is known to have sent
        self.fast_flushed_to = 0  # units below this were already checked against the frontier
        self.all_sent = False  # this worker sent every unit of the reduce
        self.finished = 0  # units done or given up
        self.slots = np.zeros(self.units, dtype=np.int64)
        self.seqs = np.zeros(self.units, dtype=np.int64)


class LtaWorker:
    """One worker of one job: reduces tensors through the switch at ``switch_addr`` over UDP.

    All workers of a job must call :meth:`allreduce` with tensors of the same lengths in the same order
    (as DDP does): the slot and round of every packet follow from that order."""

    def __init__(
        self,
        job_id: int,
        worker_id: int,
        n_workers: int,
        switch_addr: tuple[str, int],
        *,
        config: TransportConfig | None = None,
        bind: tuple[str, int] = ("127.0.0.1", 0),
    ) -> None:
        if not 1 <= n_workers <= MAX_WORKERS:
            raise ValueError(f"n_workers must be in 1..{MAX_WORKERS}, got {n_workers}")
        if not 0 <= worker_id < n_workers:
            raise ValueError(f"worker_id must be in 0..{n_workers - 1}, got {worker_id}")
        self.job_id, self.worker_id, self.n_workers = job_id, worker_id, n_workers
        self.config = config or TransportConfig()
        self.switch_addr = (socket.gethostbyname(switch_addr[0]), switch_addr[1])
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, self.config.socket_buffer_bytes)
        self.sock.bind(bind)
        self.sock.setblocking(False)
        self._poller = select.poll()
        self._poller.register(self.sock, select.POLLIN)
        self.address: tuple[str, int] = self.sock.getsockname()
        k = self.config.elems_per_packet
        self._packet_bytes = packet_bytes(k)
        rcvbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        # Linux reports twice the usable size; keep a window that fits our own receive buffer.
        fit = max(2, rcvbuf // 2 // (self._packet_bytes + 64))
        self.window = min(self.config.window or min(fit, 256), self.config.pool_size)
        self._rx = bytearray(max(self._packet_bytes, 2048) + 64)
        self._rx_view = memoryview(self._rx)
        self._ctrl = empty_batch(1, k)  # scratch packet for FLUSH / PARAM_REQ
        self._next_unit = 0  # global unit counter shared (by construction) with every worker of the job
        self._rng = np.random.default_rng([self.config.seed, job_id, worker_id])
        self._plans: dict[int, _Plan] = {}
        self._prev: dict[Any, np.ndarray] = {}
        self.srtt_ms: float | None = None
        self.rttvar_ms = 0.0
        self._early_close = False  # some worker looks dead: use short deadlines
        self._all_workers = (1 << n_workers) - 1
        self._absent = self._all_workers  # workers missing from every RESULT of the current window
        self._absent_window = 0
        self._update_rto()
        self.stats = TransportStats()
        self._fallback = FALLBACK_POLICIES[self.config.fallback]
        # Parameter broadcasts that arrived (chunk -> (step, float32 values)), and requests for resends.
        self.param_inbox: dict[int, tuple[int, np.ndarray]] = {}
        self.param_requests: set[int] = set()

    # ---- public API ----------------------------------------------------------------------------
    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> LtaWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def allreduce(self, x: Any, *, step: int = 0, key: Any = None, weight: int = 1) -> ReduceResult:
        """Mean of ``x`` over the workers whose packets arrived, renormalized per chunk.

        ``x``: float array or tensor (any shape; flattened). ``key`` names the tensor for the ``prev``
        fallback (default: its length). ``weight``: this worker's sample count, summed by the switch
        and used as the divisor when ``renormalize='weight'``. Unbiased for any drop pattern that is
        independent of the values, up to the codec's error bound (``2^-shift`` per chunk)."""
        t0 = time.perf_counter()
        local = _as_float32(x)
        n = local.size
        plan = self._plan(n)
        k = self.config.elems_per_packet
        chunks = plan.chunks
        chunks.reshape(-1)[:n] = local
        chunks.reshape(-1)[n:] = 0.0
        if self.config.renormalize == "weight":
            chunks *= np.float32(weight)
        proposals = codec.exponent_proposals(chunks)
        self._reset_plan(plan, step, weight, proposals)
        self._run_units(plan, step, t0)

        c = plan.chunks_count
        renorm = self.config.renormalize
        arrived = (plan.state[plan.exp_units :] == _DONE) & (plan.count > 0)
        if renorm == "count":
            got, divisor = arrived, plan.count
        elif renorm == "weight":
            got, divisor = arrived, np.where(plan.weight > 0, plan.weight, plan.count)
        else:
            complete = arrived & (plan.count == self.n_workers)
            got = arrived if self._fallback == Fallback.ZERO else complete
            divisor = np.full(c, self.n_workers)
        out = np.empty((c, k), dtype=np.float32)
        if got.any():
            out[got] = codec.dequantize(plan.sums[got], plan.shift[got], divisor[got])
        missing = ~got
        fallback = np.where(got, Fallback.NONE, self._fallback).astype(np.int8)
        if renorm == "none":  # zero-filled chunks are a fallback too, though they keep sum/N
            fallback[plan.count < self.n_workers] = self._fallback
        if missing.any():
            out[missing] = self._fallback_rows(key, n, missing, chunks)
        values = out.reshape(-1)[:n].copy()
        self._prev[n if key is None else key] = values
        elapsed = time.perf_counter() - t0
        self._account(plan, fallback, elapsed)
        return ReduceResult(
            values=values,
            count=np.where(plan.state[plan.exp_units :] == _DONE, plan.count, 0),
            bitmap=np.where(plan.state[plan.exp_units :] == _DONE, plan.bitmap, np.uint64(0)),
            fallback=fallback,
            withheld=plan.saturated.copy(),
            saturated=(plan.result_flags & Flag.SATURATED).astype(bool),
            shift=plan.shift.copy(),
            elapsed_s=elapsed,
        )

    def broadcast_params(
        self, chunk_ids: np.ndarray, values: np.ndarray, *, step: int = 0, critical: bool = False
    ) -> None:
        """Send absolute float32 values of the given chunks (rows of ``values``, K each) as PARAM; the
        switch replicates them to every other worker. ``critical`` exempts them from emulated loss."""
        k = self.config.elems_per_packet
        values = np.asarray(values, dtype=np.float32).reshape(len(chunk_ids), -1)
        if values.shape[1] > k:
            raise ValueError(f"param rows have {values.shape[1]} values, more than K={k}")
        batch = empty_batch(len(chunk_ids), k)
        self._fill_header(batch, Op.PARAM, step)
        batch["chunk"] = chunk_ids
        batch["nelem"] = values.shape[1]
        batch["flags"] = int(Flag.CRITICAL) if critical else 0
        batch["payload"][:, : values.shape[1]] = values.view(np.int32)
        self._send_rows(batch_rows(batch))

    def request_params(self, chunk_ids: np.ndarray, *, step: int = 0) -> None:
        """Ask the owners of these chunks for a reliable resend (PARAM_REQ, marked critical)."""
        batch = empty_batch(len(chunk_ids), self.config.elems_per_packet)
        self._fill_header(batch, Op.PARAM_REQ, step)
        batch["chunk"] = chunk_ids
        batch["flags"] = int(Flag.CRITICAL)
        self._send_rows(batch_rows(batch))

    def poll(self, timeout_s: float = 0.0) -> None:
        """Receive whatever arrived (parameter broadcasts, requests) for up to ``timeout_s``."""
        deadline = time.perf_counter() + timeout_s
        while True:
            self._receive(max(0.0, deadline - time.perf_counter()), None)
            if time.perf_counter() >= deadline:
                return

    # ---- the unit engine -----------------------------------------------------------------------
    def _plan(self, n: int) -> _Plan:
        if n == 0:
            raise ValueError("cannot allreduce an empty tensor")
        plan = self._plans.get(n)
        if plan is None:
            plan = self._plans[n] = _Plan(n, self.config.elems_per_packet)
        return plan

    def _fill_header(self, batch: np.ndarray, op: Op, step: int) -> None:
        batch["version"] = VERSION
        batch["op"] = op
        batch["job_id"] = self.job_id
        batch["worker_id"] = self.worker_id
        batch["step"] = step

    def _reset_plan(self, plan: _Plan, step: int, weight: int, proposals: np.ndarray) -> None:
        k, p = self.config.elems_per_packet, self.config.pool_size
        base = self._next_unit
        self._next_unit += plan.units
        plan.base = base
        g = base + np.arange(plan.units, dtype=np.int64)
        slots, seqs = g % p, g // p + 1
        for batch, sl in (
            (plan.exp_batch, slice(0, plan.exp_units)),
            (plan.data_batch, slice(plan.exp_units, None)),
        ):
            self._fill_header(batch, Op.GRAD, step)
            batch["slot"] = slots[sl]
            batch["seq"] = seqs[sl]
        e = plan.exp_batch
        e["flags"] = int(Flag.MAX)
        e["exp"] = 0
        e["chunk"] = np.arange(plan.exp_units)
        padded = np.full(plan.exp_units * k, INT32_MIN, dtype=np.int64)
        padded[: plan.chunks_count] = proposals
        e["payload"] = padded.reshape(plan.exp_units, k)
        e["nelem"] = np.minimum(k, plan.chunks_count - k * np.arange(plan.exp_units))
        d = plan.data_batch
        d["chunk"] = np.arange(plan.chunks_count)
        d["nelem"] = np.minimum(k, plan.n - k * np.arange(plan.chunks_count))
        d["weight"] = weight
        for arr in (
            plan.count,
            plan.bitmap,
            plan.weight,
            plan.shift,
            plan.result_flags,
            plan.flushes,
            plan.probes,
        ):
            arr[:] = 0
        plan.has_exp[:] = False
        plan.exp_known[:] = False
        plan.quantized[:] = False
        plan.saturated[:] = False
        plan.state[:] = _PENDING
        plan.synced = False
        plan.low = 0
        plan.frontier = np.full(self.n_workers, -1, dtype=np.int64)
        plan.fast_flushed_to = 0
        plan.all_sent = False
        plan.slots, plan.seqs = slots, seqs

    def _run_units(self, plan: _Plan, step: int, t0: float) -> None:
        p = self.config.pool_size
        deadlines: list[tuple[float, int]] = []
        state = plan.state
        next_unit, in_flight = 0, 0
        plan.finished = 0
        give_up_at = t0 + self.config.reduce_timeout_s
        while plan.finished < plan.units:
            # Send every unit that may go: window room, its slot free, its exponent known.
            while next_unit < plan.units and in_flight < self.window:
                if next_unit >= p and state[next_unit - p] < _DONE:
                    break
                if next_unit >= plan.exp_units:
                    e_unit = (next_unit - plan.exp_units) // self.config.elems_per_packet
                    if state[e_unit] < _DONE:
                        break
                if state[next_unit] == _PENDING:
                    self._send_unit(plan, next_unit)
                    state[next_unit] = _IN_FLIGHT
                    in_flight += 1
                    plan.sent_at[next_unit] = time.perf_counter()
                    self._arm(plan, deadlines, next_unit, plan.sent_at[next_unit])
                next_unit += 1
            plan.frontier[self.worker_id] = next_unit - 1
            if next_unit == plan.units and not plan.all_sent:
                # The tail: nothing more of ours is coming, so units still open wait only the RTO.
                plan.all_sent = True
                self._rearm_shorter(plan, deadlines, time.perf_counter())
            now = time.perf_counter()
            wait = (deadlines[0][0] - now) if deadlines else 0.05
            was_synced = plan.synced
            in_flight -= self._receive(max(0.0, min(wait, give_up_at - now)), plan)
            now = time.perf_counter()
            if plan.synced and not was_synced:
                # Everyone is in this reduce now: units waiting on the sync deadline get the normal one.
                self._rearm_shorter(plan, deadlines, now)
            if plan.frontier.min() > plan.fast_flushed_to:
                self._fast_flush(plan, deadlines, now)
            while deadlines and deadlines[0][0] <= now:
                at, u = heapq.heappop(deadlines)
                if state[u] != _IN_FLIGHT or at != plan.deadline_at[u]:
                    continue  # finished, or re-armed since
                if self._on_deadline(plan, deadlines, u, now, step):
                    state[u] = _GAVE_UP
                    in_flight -= 1
                    plan.finished += 1  # an exponent unit given up leaves its chunks without has_exp
            if now >= give_up_at:
                for u in np.flatnonzero(state < _DONE):
                    state[u] = _GAVE_UP
                    plan.finished += 1
                break

    def _arm(self, plan: _Plan, deadlines: list[tuple[float, int]], u: int, start: float) -> None:
        # Each FLUSH without an answer doubles the wait (RTO backoff, as TCP does). Ranks are staggered
        # (up to +50%) so that one worker's FLUSH, whose RESULT goes to all, usually saves the others'.
        stagger = 1.0 + 0.5 * self.worker_id / self.n_workers
        flushes = int(plan.flushes[u])
        # Once FLUSHed, a unit's round is closed (or its RESULT resent) by the switch within one round
        # trip: a missing answer was lost, so retry on the RTO, not on the sync/lag deadline that waits
        # for late peers (2 x 200 ms there made every lost FLUSH or RESULT of a flush a 400 ms stall).
        base_s = self._rto_s() if flushes else self._deadline_s(plan)
        at = start + base_s * stagger * (1 << flushes)
        if u < plan.exp_units and not plan.synced:
            # Exponent units also get an early probe (see _on_deadline), one RTO after each send.
            at = min(at, start + self._rto_s() * (1 << int(plan.probes[u])))
        plan.deadline_at[u] = at
        heapq.heappush(deadlines, (at, u))

    def _fast_flush(self, plan: _Plan, deadlines: list[tuple[float, int]], now: float) -> None:
        """Every worker sends units in order, so once each worker's bit has shown up in some RESULT at
        or beyond unit v (its frontier), all of them have sent every unit before v: an older unit still
        open lost a packet (up or down), and waiting would only add latency. One worker per unit
        (u mod N) flushes it at once; its RESULT goes to all. Units past some worker's frontier wait
        longer (``lag_deadline_ms``): that worker may simply be late."""
        lo, hi = max(plan.low, plan.fast_flushed_to), int(plan.frontier.min())
        plan.fast_flushed_to = hi
        # The others wait one smoothed RTT for the designated FLUSH's RESULT, then flush themselves:
        # their copy of it, or of the RESULT that closed the round, may have been lost on the way down.
        srtt_s = max(self.srtt_ms or self.config.min_deadline_ms, 1.0) / 1000.0
        for u in np.flatnonzero(plan.state[lo:hi] == _IN_FLIGHT) + lo:
            at = now if u % self.n_workers == self.worker_id else now + srtt_s
            if plan.flushes[u] == 0 and plan.deadline_at[u] > at:
                plan.deadline_at[u] = at
                heapq.heappush(deadlines, (at, int(u)))

    def _on_deadline(
        self, plan: _Plan, deadlines: list[tuple[float, int]], u: int, now: float, step: int
    ) -> bool:
        """A unit's deadline passed. Returns True if the unit is given up."""
        sync_end = plan.sent_at[u] + self.config.sync_deadline_ms / 1000.0
        if u < plan.exp_units and not plan.synced and now < sync_end:
            # Probe: send the exponent GRAD again. While the round is open the switch drops it as a
            # duplicate (or counts it, if the first copies were lost); once the round closed, it
            # answers with the stored RESULT, so a worker that lost the exponent RESULT recovers in
            # one RTO instead of sitting out the whole group. No FLUSH yet: others may be late.
            plan.probes[u] += 1
            self._send_rows(plan.exp_rows[u : u + 1])
            self._arm(plan, deadlines, u, now)
            return False
        if plan.flushes[u] < self.config.max_flushes:
            plan.flushes[u] += 1
            self._send_flush(plan, u, step)
            self._arm(plan, deadlines, u, now)
            return False
        return True

    def _rto_s(self) -> float:
        """Retransmission timeout from the measured round trips (srtt + 4·rttvar), clamped. Cached:
        it changes only with a new RTT sample or the dead-peer mode."""
        return self._rto_cached_s

    def _update_rto(self) -> None:
        cfg = self.config
        if self.srtt_ms is None:
            ms = cfg.initial_deadline_ms
        elif self._early_close:
            ms = 1.5 * self.srtt_ms  # a worker looks dead: don't wait the full RTO for it
        else:
            ms = self.srtt_ms + 4 * self.rttvar_ms
        self._rto_cached_s = min(max(ms, cfg.min_deadline_ms), cfg.max_deadline_ms) / 1000.0

    def _deadline_s(self, plan: _Plan) -> float:
        """How long a unit waits before its first FLUSH (units behind every frontier are flushed
        sooner, by _fast_flush)."""
        if not plan.synced:
            return self.config.sync_deadline_ms / 1000.0
        if self._early_close or plan.all_sent:
            return self._rto_s()  # a peer looks dead, or this is the tail of the reduce
        return max(self._rto_s(), self.config.lag_deadline_ms / 1000.0)

    def _rearm_shorter(self, plan: _Plan, deadlines: list[tuple[float, int]], now: float) -> None:
        """Re-arm in-flight units whose deadline is later than the current rule gives."""
        for u in np.flatnonzero(plan.state == _IN_FLIGHT):
            if plan.flushes[u] == 0 and plan.deadline_at[u] > now + self._deadline_s(plan):
                self._arm(plan, deadlines, int(u), now)

    def _send_unit(self, plan: _Plan, u: int) -> None:
        if u < plan.exp_units:
            for _ in range(self.config.exp_copies):
                self._send_rows(plan.exp_rows[u : u + 1])
            return
        c = u - plan.exp_units
        if plan.exp_known[c] and not plan.quantized[c]:
            self._quantize_block(plan, c)
        if plan.has_exp[c]:
            self._send_rows(plan.data_rows[c : c + 1])
        # else: the exponent RESULT was lost; this worker contributes nothing but still awaits the RESULT.

    def _send_flush(self, plan: _Plan, u: int, step: int) -> None:
        b = self._ctrl
        self._fill_header(b, Op.FLUSH, step)
        b["slot"], b["seq"] = plan.slots[u], plan.seqs[u]
        if u < plan.exp_units:
            b["flags"], b["exp"], b["chunk"], b["nelem"] = int(Flag.MAX), 0, u, 0
        else:
            c = u - plan.exp_units
            b["flags"], b["exp"], b["chunk"], b["nelem"] = 0, plan.shift[c], c, 0
        for _ in range(self.config.flush_copies):
            self._send_rows(batch_rows(b))
        self.stats.flushes_sent += 1

    def _send_rows(self, rows: np.ndarray) -> None:
        sendto, addr = self.sock.sendto, self.switch_addr
        for row in rows:
            while True:
                try:
                    sendto(row, addr)
                    break
                except BlockingIOError:
                    select.select([], [self.sock], [], 0.01)  # send buffer full: wait for room
        self.stats.packets_sent += len(rows)

    def _receive(self, timeout_s: float, plan: _Plan | None) -> int:
        """Wait up to ``timeout_s`` for a packet, then drain what is queued. Returns how many in-flight
        units finished."""
        if not self._poller.poll(timeout_s * 1000.0):
            return 0
        recv_into, buf = self.sock.recv_into, self._rx_view
        finished = 0
        for _ in range(1024):
            try:
                nbytes = recv_into(buf)
            except BlockingIOError:
                break
            except ConnectionRefusedError:
                continue  # ICMP port unreachable from an earlier send: the switch is not up (yet)
            finished += self._handle(buf, nbytes, plan)
        return finished

    def _handle(self, buf: memoryview, nbytes: int, plan: _Plan | None) -> int:
        self.stats.packets_received += 1
        if nbytes != self._packet_bytes:
            self.stats.packets_ignored += 1
            return 0
        (version, op, flags, exp, job_id, _w, count, s, nelem, q, step, chunk, weight, bitmap) = (
            HEADER_STRUCT.unpack_from(buf)
        )
        if version != VERSION or job_id != self.job_id:
            self.stats.packets_ignored += 1
            return 0
        k = self.config.elems_per_packet
        if op == Op.PARAM:
            values = np.frombuffer(buf, dtype=">f4", count=k, offset=HEADER_BYTES)[:nelem]
            self.param_inbox[chunk] = (step, values.astype(np.float32))
            self.stats.params_received += 1
            return 0
        if op == Op.PARAM_REQ:
            self.param_requests.add(chunk)
            return 0
        if op != Op.RESULT or plan is None:
            self.stats.packets_ignored += 1
            return 0
        u = (q - 1) * self.config.pool_size + s - plan.base
        finished = self._drop_overtaken(plan, u)
        if not 0 <= u < plan.units or plan.state[u] == _DONE:
            self.stats.packets_ignored += 1
            return finished
        prior = plan.state[u]
        plan.state[u] = _DONE
        plan.synced = True
        if prior != _GAVE_UP:
            plan.finished += 1
        if flags & Flag.RETX:
            self.stats.results_retx += 1
        if prior == _IN_FLIGHT and (plan.flushes[u] == 0 or (flags & Flag.RETX and count == self.n_workers)):
            # A clean answer is an RTT sample. So is a resent, complete one: the round had closed
            # before our FLUSH (the FLUSH was spurious), and the wait we saw is what the RTO must cover.
            self._rtt_sample((time.perf_counter() - plan.sent_at[u]) * 1000.0)
        self._track_absent(bitmap)
        # A worker's bit in unit u's RESULT proves it has sent every unit up to u (units go in order).
        frontier, bits = plan.frontier, bitmap
        while bits:
            w = (bits & -bits).bit_length() - 1
            if w < self.n_workers and frontier[w] < u:
                frontier[w] = u
            bits &= bits - 1
        payload = np.frombuffer(buf, dtype=">i4", count=k, offset=HEADER_BYTES)
        if u < plan.exp_units:
            if count > 0:
                c0 = u * k
                c1 = min(c0 + k, plan.chunks_count)
                self._on_exponents(plan, c0, c1, payload[: c1 - c0])
        else:
            c = u - plan.exp_units
            plan.sums[c] = payload
            plan.count[c] = count
            plan.bitmap[c] = bitmap
            plan.weight[c] = weight
            plan.result_flags[c] = flags
            plan.shift[c] = exp
        return finished + (1 if prior == _IN_FLIGHT else 0)

    def _drop_overtaken(self, plan: _Plan, u: int) -> int:
        """A RESULT for unit ``u`` means slot ``u mod P`` has moved past every older round: units
        u-P, u-2P, ... of this reduce that are still open can never be answered (the switch drops
        their FLUSHes as stale). Give them up now instead of waiting through every deadline: the
        worker that fell behind falls back for those chunks and catches up. Returns how many of them
        were in flight."""
        p = self.config.pool_size
        finished = 0
        start = u - p
        if start >= plan.units:
            start -= ((start - plan.units) // p + 1) * p
        while plan.low < plan.units and plan.state[plan.low] >= _DONE:
            plan.low += 1  # every unit below `low` is settled: the scan below stops there
        for v in range(start, plan.low - 1, -p):
            state = plan.state[v]
            if state >= _DONE:
                continue
            plan.state[v] = _GAVE_UP
            plan.finished += 1
            self.stats.units_overtaken += 1
            finished += state == _IN_FLIGHT
        return finished

    def _on_exponents(self, plan: _Plan, c0: int, c1: int, agreed: np.ndarray) -> None:
        """The exponent round for chunks [c0, c1) closed: their data-round shifts are known. Chunks are
        quantized lazily, a block at a time as they are sent, so the quantizing overlaps the switch's
        work on the packets already sent."""
        plan.shift[c0:c1] = codec.data_shifts(agreed.astype(np.int64), self.n_workers)
        plan.exp_known[c0:c1] = True

    def _quantize_block(self, plan: _Plan, c: int) -> None:
        k = self.config.elems_per_packet
        c1 = min(c + max(1, _QUANTIZE_BLOCK_VALUES // k), (c // k + 1) * k, plan.chunks_count)
        shifts = plan.shift[c:c1]
        ints, saturated = codec.quantize(plan.chunks[c:c1], shifts, self.n_workers, self._rng)
        d = plan.data_batch
        d["payload"][c:c1] = ints
        d["exp"][c:c1] = shifts
        d["flags"][c:c1] = 0
        # A chunk that would saturate (this worker's exponent proposal was lost and its values exceed
        # the agreed bound) is withheld rather than clamped: a clamp would bias the sum, a missing
        # contribution is renormalized away.
        plan.saturated[c:c1] = saturated
        plan.has_exp[c:c1] = ~saturated
        plan.quantized[c:c1] = True

    def _track_absent(self, bitmap: int) -> None:
        """Presume a worker dead when it is missing from every one of 64 consecutive RESULTs; a worker
        that shows up in any of them is slow or lossy, and is waited for with the normal RTO."""
        self._absent &= ~bitmap
        self._absent_window += 1
        if self._absent_window >= _DEAD_AFTER_RESULTS:
            self._early_close = self._absent != 0
            self._absent, self._absent_window = self._all_workers, 0
            self._update_rto()
        elif self._early_close and bitmap == self._all_workers:
            self._early_close = False  # everyone contributed again
            self._update_rto()

    def _rtt_sample(self, ms: float) -> None:
        if self.srtt_ms is None:
            self.srtt_ms, self.rttvar_ms = ms, ms / 2
        else:
            self.rttvar_ms = 0.75 * self.rttvar_ms + 0.25 * abs(self.srtt_ms - ms)
            self.srtt_ms = 0.875 * self.srtt_ms + 0.125 * ms
        self._update_rto()

    def _fallback_rows(self, key: Any, n: int, missing: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        policy = self._fallback
        if policy == Fallback.LOCAL:
            return chunks[missing]
        prev = self._prev.get(n if key is None else key)
        if policy == Fallback.ZERO or prev is None:
            return np.zeros((int(missing.sum()), chunks.shape[1]), dtype=np.float32)
        padded = np.zeros(chunks.size, dtype=np.float32)
        padded[:n] = prev
        return padded.reshape(chunks.shape)[missing]

    def _account(self, plan: _Plan, fallback: np.ndarray, elapsed: float) -> None:
        st = self.stats
        done = plan.state[plan.exp_units :] == _DONE
        st.reduces += 1
        st.chunks += plan.chunks_count
        st.chunks_full += int(np.sum(done & (plan.count == self.n_workers)))
        st.chunks_partial += int(np.sum(done & (plan.count > 0) & (plan.count < self.n_workers)))
        st.chunks_empty += int(np.sum(done & (plan.count == 0)))
        st.chunks_no_result += int(np.sum(~done))
        st.chunks_no_exponent += int(np.sum(~plan.exp_known))
        st.withheld_chunks += int(plan.saturated.sum())
        st.saturated_results += int(np.sum(done & (plan.result_flags & Flag.SATURATED > 0)))
        used = np.bincount(fallback, minlength=len(Fallback))
        st.fallback_prev += int(used[Fallback.PREV])
        st.fallback_zero += int(used[Fallback.ZERO])
        st.fallback_local += int(used[Fallback.LOCAL])
        st.elapsed_s += elapsed
        st.reduce_ms.append(elapsed * 1000.0)


def _as_float32(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"allreduce needs a numeric array or tensor, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
