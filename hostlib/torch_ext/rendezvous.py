"""Joining an LTA job from torch.distributed: find the switch, bind, register worker addresses.

Workers meet through torch.distributed's store (``env://``, torchrun, a FileStore...). Two modes:

- **self-hosted** (no switch address given): rank 0 runs a softswitch in a thread on ``listen`` (loopback
  by default) and configures the job itself. One machine only; what tests and demos use.
- **external switch** (``LTA_SWITCH=host:port``): every rank binds ``bind_host`` (port ``bind_port_base +
  rank``, or an ephemeral port when the base is 0) and publishes its address; rank 0 calls
  ``register_job(JobRequest)`` if given (e.g. the control plane's job table), else the job must already
  be configured on the switch with exactly these worker addresses.

Environment variables (read by :meth:`LtaOptions.from_env`; options passed in code win):

| variable | meaning | default |
| --- | --- | --- |
| ``LTA_SWITCH`` | switch ``host:port`` | unset: rank 0 hosts a softswitch |
| ``LTA_JOB_ID`` | job id on the switch (1..63) | 1 |
| ``LTA_BIND_HOST`` / ``LTA_BIND_PORT_BASE`` | worker UDP address | 127.0.0.1 / 0 |
| ``LTA_ELEMS_PER_PACKET`` | K (must match the switch's job) | self-hosted: path MTU's (16367); else 64 |
| ``LTA_POOL_SIZE`` | P (must match the switch's job) | 2048; 512 above K = 1024 |
| ``LTA_FALLBACK``, ``LTA_RENORMALIZE`` | transport policies | prev / count |
| ``LTA_DROP_UP``, ``LTA_DROP_DOWN``, ``LTA_DROP_PARAM`` | Bernoulli loss, self-hosted switch only | 0 |
| ``LTA_SEED`` | seeds rounding and emulated loss | 0 |
| ``LTA_SPECULATE_BITS`` | speculated exponents' margin m (0: off; docs/protocol.md) | TransportConfig's |
| ``LTA_HEALTH_TIMEOUT`` | seconds to wait for the switch to answer the join probe (0: skip) | 5 |
| ``LTA_ON_UNHEALTHY`` | reduces that keep getting nothing: ``raise``, ``warn`` or ``ignore`` | raise |
| ``LTA_LOSSY_OPS`` | the group's collectives that go through the switch (below) | allreduce,reduce_scatter |
| ``LTA_STALE_BOUND`` | S: no all-gather copy older than S calls of its key (then a resync) | 8 |
| ``LTA_LIVENESS_TIMEOUT`` | self-hosted: silent seconds until a worker is offline (0: off) | 3 |
| ``LTA_SWITCH_SOCKETS`` | self-hosted: switch receive sockets (rank w: socket w mod n) | one a rank, ≤ 64 |
| ``LTA_LOCAL_UPLINK`` | self-hosted: rank 0's packets enter its switch by a call (1) or loopback (0) | 1 |

``LTA_EXACT_MS=W`` (self-hosted, emulated loss): no round is closed by a timer, only by the softswitch's
seeded drop decisions (``TransportConfig.exact``); every transport deadline is W ms, a safety net. Runs
then match a lossless reference however the ranks are scheduled (tests on a loaded machine use it).

``LTA_LOSSY_OPS`` is a comma list of ``allreduce``, ``reduce_scatter``, ``all_gather``, or ``none``.

In code, ``LtaOptions(quorum=Q)`` closes every round once Q workers contributed (the self-hosted switch,
or ``register_job``; an external switch keeps the quorum it was configured with), and
``LtaOptions(transport=TransportConfig(reduce_timeout_s=S))`` bounds a step's wait for its reduce. Seed
003's names are accepted for both: ``window_size`` (= ``quorum``) and ``max_wait_s`` (= the step
deadline, ``reduce_timeout_s``); giving a name and its alias with different values is an error.

Joining ends with a health probe (:meth:`LtaWorker.check_switch`): a switch that does not answer, or
does not know this job with this rank's address, raises ``HealthCheckError`` instead of training on
fallbacks.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from hostlib.emulation.dropmodels import DIRECTIONS, DropPolicy
from hostlib.errors import HealthCheckError, UsageError
from hostlib.job import MAX_POOL_SIZE, MIN_WORKER_POOL_SIZE, Job, pool_size
from hostlib.liveness import DEFAULT_TIMEOUT_S as DEFAULT_LIVENESS_TIMEOUT_S
from hostlib.protocol import (
    DEFAULT_ELEMS_PER_PACKET,
    MAX_ELEMS_PER_PACKET,
    MAX_JOBS,
    packet_bytes,
    parse_address,
)
from hostlib.torch_ext.envparse import EnvReader
from hostlib.transport import FALLBACK_POLICIES, LtaWorker, TransportConfig, elems_for_path

log = logging.getLogger(__name__)

SELF_HOSTED_LISTEN = ("127.0.0.1", 0)  # loopback, any port
_FIXED_PORTS_HINT = (
    "This rank bound port {port}, one the system chose (LTA_BIND_PORT_BASE is unset): a jobs file "
    "cannot name it. Set LTA_BIND_PORT_BASE=B (and LTA_BIND_HOST) so that rank r binds B + r, and list "
    'worker r as "HOST:B+r" in the switch\'s jobs file (docs/jobs_file.md)'
)
LOSSY_OPS = ("allreduce", "reduce_scatter", "all_gather")  # the collectives that may go through the switch
DEFAULT_LOSSY_OPS = frozenset({"allreduce", "reduce_scatter"})  # gradients; parameters stay reliable


def parse_lossy_ops(text: str) -> frozenset[str]:
    """``"allreduce,reduce_scatter"`` -> that set; ``"none"`` or ``""`` -> none; ValueError on a typo."""
    names = {part.strip() for part in text.split(",") if part.strip()} - {"none"}
    unknown = names - set(LOSSY_OPS)
    if unknown:
        raise ValueError(
            f"LTA_LOSSY_OPS: unknown collective(s) {sorted(unknown)}; choose among {', '.join(LOSSY_OPS)} "
            "(comma separated) or none"
        )
    return frozenset(names)


_DEFAULT_STEP_DEADLINE_S = TransportConfig.reduce_timeout_s


@dataclass(frozen=True)
class JobRequest:
    """The job a switch must hold for this group: worker ``w`` sends from ``workers[w]``."""

    job_id: int
    workers: list[tuple[str, int]]
    pool_size: int
    elems_per_packet: int
    quorum: int | None = None  # close a round at this count; None: all workers

    def __post_init__(self) -> None:
        self.as_job()  # checked as every job is

    def as_job(self) -> Job:
        """This request as the one job type (hostlib.job)."""
        return Job.of(
            self.job_id,
            self.workers,
            quorum=self.quorum,
            pool_size=self.pool_size,
            elems_per_packet=self.elems_per_packet,
        )


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """The value given under ``name`` or its ``alias``; both given must agree."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(
            f"{name}={value!r} and {alias}={alias_value!r} disagree: {alias} is another name for {name} "
            "(seed 003's); give one of them"
        )
    return value if value is not None else alias_value


@dataclass
class LtaOptions:
    switch: tuple[str, int] | None = None
    job_id: int = 1
    bind_host: str = "127.0.0.1"
    bind_port_base: int = 0
    listen: tuple[str, int] = SELF_HOSTED_LISTEN  # where a self-hosted softswitch listens
    transport: TransportConfig = field(default_factory=TransportConfig)
    drop: dict[str, DropPolicy] = field(default_factory=dict)  # direction -> policy (self-hosted only)
    register_job: Callable[[JobRequest], None] | None = None
    seed: int = 0
    quorum: int | None = None  # close a round at this count (None: all workers)
    window_size: int | None = None  # seed 003's name for quorum
    max_wait_s: float | None = None  # seed 003's name for the step deadline, transport.reduce_timeout_s
    # The process group's collectives that go through the switch (the others: reliable, over gloo).
    lossy_ops: frozenset[str] = DEFAULT_LOSSY_OPS
    stale_bound: int = 8  # S of the lossy all-gather: no copy older than S calls of its key
    # Self-hosted switch: a worker silent this long is offline and the quorum drops (hostlib/liveness.py).
    liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S
    # Self-hosted switch: receive sockets, each with its own kernel buffer (softswitch/server.py). None:
    # one per rank (up to 64), so no rank's window shrinks to share net.core.rmem_max with the others.
    switch_sockets: int | None = None
    # Self-hosted switch: rank 0's packets to the switch it hosts go in by a call in its own thread, not
    # through the kernel (SoftSwitchServer.local_port); the replies still come on its socket.
    local_uplink: bool = True

    def __post_init__(self) -> None:
        self.lossy_ops = frozenset(self.lossy_ops)
        if not self.lossy_ops <= set(LOSSY_OPS):
            parse_lossy_ops(",".join(self.lossy_ops))  # raises with the names
        if self.liveness_timeout_s < 0:
            raise ValueError(f"liveness_timeout_s must be >= 0 s (0: off), got {self.liveness_timeout_s}")
        if self.stale_bound < 1:
            raise ValueError(f"stale_bound (S) must be >= 1 call, got {self.stale_bound}")
        if self.switch_sockets is not None and not 1 <= self.switch_sockets <= 64:
            raise ValueError(f"switch_sockets must be 1..64, got {self.switch_sockets}")
        self.quorum = self.window_size = _one_of("quorum", self.quorum, "window_size", self.window_size)
        if self.quorum is not None and self.quorum < 1:
            raise ValueError(f"quorum (window_size) must be >= 1 worker, got {self.quorum}")
        if self.max_wait_s is not None:
            if not self.max_wait_s > 0:
                raise ValueError(f"max_wait_s (the step deadline) must be > 0 seconds, got {self.max_wait_s}")
            given = self.transport.reduce_timeout_s
            if given != _DEFAULT_STEP_DEADLINE_S and given != self.max_wait_s:
                _one_of("transport.reduce_timeout_s", given, "max_wait_s", self.max_wait_s)
            self.transport = replace(self.transport, reduce_timeout_s=self.max_wait_s)
        unknown = set(self.drop) - set(DIRECTIONS)
        if unknown:
            raise ValueError(f"drop directions must be among {DIRECTIONS}, got {sorted(unknown)}")
        if self.drop and self.switch is not None:
            raise ValueError(
                "emulated drops are set on a self-hosted softswitch only; "
                "with LTA_SWITCH, set them on that switch (lta ctl)"
            )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> LtaOptions:
        """The options the ``LTA_*`` variables give (table above). A bad value raises one
        :class:`~hostlib.errors.UsageError` (a ValueError) naming the variable and what it accepts."""
        read = EnvReader(dict(os.environ if env is None else env))
        seed = read.integer("LTA_SEED", 0, 0)
        switch = read.address("LTA_SWITCH")
        # Packet size follows the path for the self-hosted softswitch (one 64 KiB datagram on loopback);
        # an external switch may be a P4 program compiled for K=64, so that stays its default.
        default_k = DEFAULT_ELEMS_PER_PACKET if switch else elems_for_path(SELF_HOSTED_LISTEN)
        k = read.integer("LTA_ELEMS_PER_PACKET", default_k, 1, MAX_ELEMS_PER_PACKET)
        transport = TransportConfig(
            elems_per_packet=k,
            pool_size=read.integer("LTA_POOL_SIZE", pool_size(None, k), MIN_WORKER_POOL_SIZE, MAX_POOL_SIZE),
            fallback=read.choice("LTA_FALLBACK", "prev", FALLBACK_POLICIES),
            renormalize=read.choice("LTA_RENORMALIZE", "count", ("count", "weight", "none")),
            seed=seed,
            health_timeout_s=read.real("LTA_HEALTH_TIMEOUT", 5.0, 0.0),
            on_unhealthy=read.choice("LTA_ON_UNHEALTHY", "raise", ("raise", "warn", "ignore")),
            speculate_bits=read.integer("LTA_SPECULATE_BITS", TransportConfig.speculate_bits, 0, 8),
        )
        exact_ms = read.real("LTA_EXACT_MS", 0.0, 0.0)
        if exact_ms:  # rounds close by the drop policy's decisions, never by a timer (TransportConfig.exact)
            transport = replace(
                transport,
                exact=True,
                sync_deadline_ms=exact_ms,
                lag_deadline_ms=exact_ms,
                min_deadline_ms=exact_ms,
                max_deadline_ms=exact_ms,
            )
        drop = {}
        for direction in DIRECTIONS:
            p = read.probability(f"LTA_DROP_{direction.upper()}")
            if p:
                drop[direction] = DropPolicy(p=p)
        try:
            lossy_ops = parse_lossy_ops(read.env.get("LTA_LOSSY_OPS", ",".join(sorted(DEFAULT_LOSSY_OPS))))
        except ValueError as exc:  # names the variable and the accepted values
            raise UsageError(str(exc)) from None
        return cls(
            switch=switch,
            job_id=read.integer("LTA_JOB_ID", 1, 1, MAX_JOBS - 1),
            bind_host=read.env.get("LTA_BIND_HOST", "127.0.0.1"),
            bind_port_base=read.integer("LTA_BIND_PORT_BASE", 0, 0, 65535),
            transport=transport,
            drop=drop,
            seed=seed,
            lossy_ops=lossy_ops,
            stale_bound=read.integer("LTA_STALE_BOUND", 8, 1),
            liveness_timeout_s=read.real("LTA_LIVENESS_TIMEOUT", DEFAULT_LIVENESS_TIMEOUT_S, 0.0),
            switch_sockets=read.integer("LTA_SWITCH_SOCKETS", 0, 0, 64) or None,
            local_uplink=bool(read.integer("LTA_LOCAL_UPLINK", 1, 0, 1)),
        )


@dataclass(eq=False)  # by identity: open sessions are kept in a WeakSet
class LtaSession:
    """One rank's link to its job: the worker, and the softswitch it hosts (if any). Closed by the
    process group's shutdown (``destroy_process_group``) or, for a script that never calls it, by an
    ``atexit`` hook: the heartbeat, liveness and softswitch threads are stopped and joined, and the
    sockets closed, before the interpreter finalizes (a daemon thread still running then is ended by
    the interpreter wherever it stands; "terminate called without an active exception", issue 42)."""

    worker: LtaWorker
    embedded: Any | None  # the softswitch this rank hosts (hostlib.torch_ext.embedded), if any
    closed: bool = False

    def __post_init__(self) -> None:
        _OPEN_SESSIONS.add(self)

    @property
    def switch(self) -> Any | None:
        """The embedded SoftSwitch (for its counters), or None with an external switch."""
        return self.embedded.switch if self.embedded is not None else None

    def close(self) -> None:
        """Stop and join this session's threads, close its sockets; a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        _OPEN_SESSIONS.discard(self)
        self.worker.close()
        if self.embedded is not None:
            self.embedded.stop()


_OPEN_SESSIONS: weakref.WeakSet[LtaSession] = weakref.WeakSet()


@atexit.register
def _close_open_sessions() -> None:
    """Close every session still open at exit, in order, while the interpreter is whole."""
    for session in list(_OPEN_SESSIONS):
        try:
            session.close()
        except Exception:  # noqa: BLE001 - at exit: report and go on closing the others
            log.exception("lta: closing a session at exit failed")


def _key(options: LtaOptions, name: str) -> str:
    return f"lta/job{options.job_id}/{name}"


def _rejoin(store, rank: int, world: int, options: LtaOptions) -> LtaSession:
    """:func:`join_job` for a restarted rank (its ``rejoin``)."""
    if options.switch is None and rank == 0:
        raise HealthCheckError(
            "rank 0 of a self-hosted LTA job cannot rejoin: the softswitch it hosted died with it "
            "(restart the whole job, or run the switch apart: LTA_SWITCH)"
        )
    if not store.check([_key(options, "ready")]):
        raise HealthCheckError(
            f"rank {rank} cannot rejoin job {options.job_id}: no running job in this store (join it)"
        )
    switch_addr = options.switch or parse_address(store.get(_key(options, "switch")).decode())
    address = parse_address(store.get(_key(options, f"worker{rank}")).decode())
    transport = replace(
        options.transport, seed=options.seed, incarnation=_run_incarnation(store, rank, options)
    )
    try:
        worker = LtaWorker(options.job_id, rank, world, switch_addr, config=transport, bind=address)
    except OSError as exc:
        raise OSError(
            f"rank {rank}: cannot bind the LTA worker to {address[0]}:{address[1]} again to rejoin: "
            f"{exc.strerror} (is its first process still running?)"
        ) from exc
    session = LtaSession(worker, None)
    if transport.health_timeout_s > 0:
        try:
            worker.check_switch()
        except BaseException:
            session.close()
            raise
    return session


def _run_incarnation(store, rank: int, options: LtaOptions) -> int:
    """The run's incarnation (docs/protocol.md, "Run after run"): rank 0 draws it once per store, every
    rank (a rank restarted into the same run too) reads that one. A new torchrun has a new store, so a
    new incarnation: its health probes make the switch forget the slots the previous run left."""
    key = _key(options, "incarnation")
    if rank == 0 and not store.check([key]):
        store.set(key, str(int.from_bytes(os.urandom(4), "big") or 1))
    return int(store.get(key).decode())


def join_job(
    store,
    rank: int,
    world: int,
    options: LtaOptions,
    timeout: timedelta | None = None,
    *,
    rejoin: bool = False,
) -> LtaSession:
    """Bind this rank's worker, exchange addresses through ``store`` and wait until the job is ready.

    ``rejoin``: this rank's process was restarted into the running job (same ``store``): it binds the
    address its first process published (the switch knows the rank by it), joins the run's incarnation
    and configures nothing. Rank 0 of a self-hosted job cannot rejoin: its switch died with it."""
    if options.quorum is not None and options.quorum > world:
        raise ValueError(
            f"quorum (window_size) {options.quorum} is more than the {world} workers of the group"
        )
    if timeout is not None:
        store.set_timeout(timeout)
    if rejoin:
        return _rejoin(store, rank, world, options)
    embedded = None
    if options.switch is None:
        if rank == 0:
            from hostlib.torch_ext.embedded import EmbeddedSwitch  # softswitch only when self-hosting

            sockets = options.switch_sockets or world
            packet = packet_bytes(options.transport.elems_per_packet)
            embedded = EmbeddedSwitch(options.seed, options.listen, sockets=sockets, packet_bytes=packet)
            host, port = embedded.address
            store.set(_key(options, "switch_rcvbuf"), f"{embedded.rcvbuf_bytes}:{embedded.sockets}")
            store.set(_key(options, "switch"), f"{host}:{port}")
        switch_addr = parse_address(store.get(_key(options, "switch")).decode())
        rcvbuf, sockets = store.get(_key(options, "switch_rcvbuf")).decode().split(":")
        switch_rcvbuf, switch_sockets = int(rcvbuf), int(sockets)
    else:
        switch_addr = options.switch
        switch_rcvbuf, switch_sockets = 0, 1
    port = options.bind_port_base + rank if options.bind_port_base else 0
    transport = replace(
        options.transport, seed=options.seed, incarnation=_run_incarnation(store, rank, options)
    )
    try:
        worker = LtaWorker(
            options.job_id, rank, world, switch_addr, config=transport, bind=(options.bind_host, port)
        )
    except OSError as exc:
        raise OSError(
            f"rank {rank}: cannot bind the LTA worker to {options.bind_host}:{port}: {exc.strerror} "
            "(set LTA_BIND_HOST / LTA_BIND_PORT_BASE)"
        ) from exc
    if switch_rcvbuf and options.transport.window is None:
        # The softswitch's sockets take every worker's window: size the windows to them.
        full = worker.window
        if worker.fit_window_to_switch(switch_rcvbuf, switch_sockets) < full and rank == 0:
            log.warning(
                "lta: the self-hosted switch's receive buffers (%d KiB per socket) hold a window of %d of %d "
                "units per rank; for full speed raise net.core.rmem_max (e.g. sysctl -w "
                "net.core.rmem_max=33554432) or give rank 0 CAP_NET_ADMIN",
                switch_rcvbuf // 1024,
                worker.window,
                full,
            )
    host, port = worker.address
    worker_port = port
    store.set(_key(options, f"worker{rank}"), f"{host}:{port}")
    if rank == 0:
        addresses = [parse_address(store.get(_key(options, f"worker{r}")).decode()) for r in range(world)]
        job = JobRequest(
            options.job_id, addresses, transport.pool_size, transport.elems_per_packet, options.quorum
        )
        if embedded is not None:
            embedded.add_job(
                job.job_id,
                job.workers,
                pool_size=job.pool_size,
                elems_per_packet=job.elems_per_packet,
                drop=options.drop,
                quorum=job.quorum,
                # Exact mode: rounds close by the drop policy alone, never short of a worker
                # that a loaded host descheduled past the liveness timeout.
                liveness_timeout_s=0.0 if transport.exact else options.liveness_timeout_s,
            )
            if options.local_uplink:
                worker.send_by_call(embedded.uplink(worker.address))
        elif options.register_job is not None:
            options.register_job(job)
        store.set(_key(options, "ready"), "1")
    store.get(_key(options, "ready"))
    session = LtaSession(worker, embedded)
    if transport.health_timeout_s > 0:
        try:
            worker.check_switch()
        except HealthCheckError as exc:
            session.close()
            if embedded is None and not options.bind_port_base and options.register_job is None:
                # The usual cause with a switch configured from a jobs file: the file cannot know a port
                # the system picked at random. Say how to make the ports known.
                raise HealthCheckError(f"{exc}. {_FIXED_PORTS_HINT.format(port=worker_port)}") from None
            raise
        except BaseException:
            session.close()
            raise
    return session
