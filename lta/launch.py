"""Run N worker processes against a softswitch on loopback: the harness behind ``lta demo`` and the
benchmarks.

The parent runs the softswitch in a thread (or, with ``JobSpec.switch_processes``, each switch in a
process of its own). Each worker process binds its UDP socket, reports the
address, waits until the parent has added the job (the switch must know every worker's address before
the first packet), runs ``body(worker, rank, *args)`` and sends back what it returns. A body may call
:func:`report_progress` to tell the parent how far it got.

A worker that fails with a user error (:class:`hostlib.errors.LtaError`, e.g. a health check) has it
raised again in the parent, one line naming the rank; any other failure is a bug and comes back with
the worker's traceback. Workers ignore Ctrl-C: the parent gets it, stops them and exits quietly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hostlib.batchio import gro_coalesces
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.errors import LtaError
from hostlib.lifetime import spawn_context
from hostlib.protocol import packet_bytes
from hostlib.transport import LtaWorker, TransportConfig
from softswitch.hierarchy import leaf_blocks, leaf_job, spine_job
from softswitch.pipeline import JobConfig, SoftSwitch
from softswitch.process import SoftSwitchProcess
from softswitch.server import SoftSwitchServer


@dataclass
class JobSpec:
    n_workers: int
    transport: TransportConfig = field(default_factory=TransportConfig)
    job_id: int = 1
    quorum: int | None = None
    drop: dict[str, DropPolicy] = field(default_factory=dict)  # direction -> policy (all workers)
    switch_seed: int = 0
    timeout_s: float = 600.0
    # A leaf-spine tree instead of one switch (docs/protocol.md, "Hierarchy"): 0 = one flat switch; L > 0:
    # L leaf softswitches (contiguous blocks of workers, softswitch.hierarchy.leaf_blocks) and a spine.
    # ``drop`` applies at the leaves (worker <-> leaf), ``spine_drop`` at the spine (leaf <-> spine).
    leaves: int = 0
    spine_drop: dict[str, DropPolicy] = field(default_factory=dict)
    # Each softswitch in a process of its own (softswitch.process) instead of a thread of this one: the
    # switches of a tree then share no interpreter lock (``lta bench scaling --switches processes``;
    # on the 2-core host it did not lower a tree's p50 against one switch, docs/results.md). The switches
    # run_job hands back still read as the ones that served (counters, slot registers).
    switch_processes: bool = False


# In a worker process: where report_progress sends (the queue to the parent, this worker's rank).
_progress_channel: tuple[Any, int] | None = None


def report_progress(done: int, total: int) -> None:
    """From a job body: ``done`` of ``total`` units of work are finished. Goes to the parent's
    ``on_progress``; does nothing outside a worker of :func:`run_job`."""
    if _progress_channel is not None:
        queue, rank = _progress_channel
        queue.put(("progress", rank, (done, total)))


def _worker_main(
    specs: list[JobSpec], rank: int, switch_addrs, body, args, to_parent, go, log_level: int
) -> None:
    """Worker process ``rank``: one LtaWorker per job of ``specs`` (each to its own switch), then
    ``body(workers, rank, *args)``."""
    global _progress_channel
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops every worker
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=log_level, format=f"%(levelname)s worker {rank} %(name)s: %(message)s")
    _progress_channel = (to_parent, rank)
    try:
        workers = [
            LtaWorker(spec.job_id, rank, spec.n_workers, addr, config=spec.transport)
            for spec, addr in zip(specs, switch_addrs, strict=True)
        ]
        to_parent.put(("addr", rank, [worker.address for worker in workers]))
        go.wait()
        to_parent.put(("done", rank, body(workers, rank, *args)))
        for worker in workers:
            worker.close()
    except LtaError as exc:
        to_parent.put(("user_error", rank, _with_rank(exc, rank)))
    except BaseException:
        to_parent.put(("error", rank, traceback.format_exc()))


@contextlib.contextmanager
def sigint_ignored_by_children() -> Iterator[None]:
    """Processes started inside ignore Ctrl-C from their first instruction: a spawned interpreter
    inherits an ignored SIGINT, so a Ctrl-C while it is still importing prints no traceback. This
    process ignores it only for as long as the block (starting the processes) takes."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change signal handlers; the workers still ignore it later
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def running(procs: Sequence[Any], join_s: float = 5.0, kill: bool = True) -> Iterator[None]:
    """Start ``procs`` (Ctrl-C ignored by them, see :func:`sigint_ignored_by_children`) and end them
    with the block: if it fails or is interrupted they are killed at once (they would only wait for
    each other), otherwise each gets ``join_s`` seconds to exit before it is killed. ``kill=False``
    (threads standing in for processes) only joins."""
    with sigint_ignored_by_children():
        for p in procs:
            p.start()
    try:
        yield
    except BaseException:
        if kill:
            for p in procs:
                p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=join_s)
            if kill and p.is_alive():
                p.kill()


def _with_rank(exc: LtaError, rank: int) -> LtaError:
    """The same error, its message led by the worker's rank (the error itself if it cannot be rebuilt)."""
    try:
        return type(exc)(f"worker {rank}: {exc}")
    except Exception:
        return exc


def leaf_ids(spec: JobSpec) -> list[int]:
    """The leaves of ``spec``'s tree that have a switch, by id (none for one flat switch): all of them,
    but with ``transport.own_leaf`` a block of one worker, who joins the spine itself."""
    if not spec.leaves:
        return []
    blocks = leaf_blocks(spec.n_workers, spec.leaves)
    return [j for j, block in enumerate(blocks) if len(block) > 1 or not spec.transport.own_leaf]


class _Fabric:
    """The softswitches of a job, serving on loopback: one flat switch, or L leaves and a spine; threads of
    this process, or with ``spec.switch_processes`` a process each."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.switches: list[SoftSwitch] = []  # leaves first, then the spine (or the one flat switch)
        self.servers: list[SoftSwitchServer | SoftSwitchProcess] = []
        self.blocks = (
            leaf_blocks(spec.n_workers, spec.leaves) if spec.leaves else [list(range(spec.n_workers))]
        )
        self.leaf_of = {w: j for j, block in enumerate(self.blocks) for w in block}
        # Leaf j's switch (its index in servers), or None where its worker is its own leaf.
        switched = {j: i for i, j in enumerate(leaf_ids(spec))}
        self.leaf_switch = [switched.get(j) for j in range(spec.leaves)]
        n_switches = len(switched) + 1
        try:
            if spec.switch_processes:
                procs = [SoftSwitchProcess(seed=spec.switch_seed + 7919 * i) for i in range(n_switches)]
                self.servers.extend(procs)
                with sigint_ignored_by_children():
                    for proc in procs:
                        proc.start()
                self.switches = [proc.switch for proc in procs]
            else:
                # (datagrams too large to coalesce go straight into the switch's rows: batchio)
                gro = gro_coalesces(packet_bytes(spec.transport.elems_per_packet))
                for i in range(n_switches):
                    switch = SoftSwitch(seed=spec.switch_seed + 7919 * i)
                    self.switches.append(switch)
                    self.servers.append(SoftSwitchServer(switch, gro=gro).start())
        except BaseException:
            self.stop()
            raise

    @property
    def top(self) -> SoftSwitch:
        """The flat switch, or the spine."""
        return self.switches[-1]

    def entry(self, rank: int) -> tuple[str, int]:
        """The address worker ``rank`` sends to: the flat switch, its leaf, or the spine (its own leaf)."""
        if not self.spec.leaves:
            return self.servers[0].address
        i = self.leaf_switch[self.leaf_of[rank]]
        return self.servers[-1 if i is None else i].address

    def install(self, addrs: dict[int, Any]) -> None:
        spec, cfg = self.spec, self.spec.transport
        kw = dict(pool_size=cfg.pool_size, elems_per_packet=cfg.elems_per_packet)
        if not spec.leaves:
            flat = JobConfig(spec.job_id, [addrs[r] for r in range(spec.n_workers)], spec.quorum, **kw)
            self._configure(0, flat, spec.drop)
            return
        spine_address = self.servers[-1].address
        contributors = []  # the spine's: each leaf's switch, or the worker that is its own leaf
        for j, (block, i) in enumerate(zip(self.blocks, self.leaf_switch, strict=True)):
            if i is None:
                contributors.append(addrs[block[0]])
                continue
            ports = {w: addrs[w] for w in block}
            leaf = leaf_job(spec.job_id, ports, spec.n_workers, spine_address, j, **kw)
            self._configure(i, leaf, spec.drop)
            contributors.append(self.servers[i].address)
        spine = spine_job(spec.job_id, contributors, **kw)
        self._configure(len(self.servers) - 1, spine, spec.spine_drop)

    def _configure(self, i: int, job: JobConfig, drop: dict[str, DropPolicy]) -> None:
        """Switch ``i`` gets ``job`` and its drop policies (a switch process through its pipe)."""
        server = self.servers[i]
        target = server if isinstance(server, SoftSwitchProcess) else self.switches[i]
        target.add_job(job)
        for direction, policy in drop.items():
            target.set_drop_policy(job.job_id, direction, policy)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def cpu_s(self) -> list[float]:
        """CPU seconds each switch's serving thread used (leaves first), once stopped."""
        return [server.cpu_s for server in self.servers]


def _one_worker(body: Callable[..., Any], workers: list[LtaWorker], rank: int, *args: Any) -> Any:
    return body(workers[0], rank, *args)


def run_job(
    spec: JobSpec,
    body: Callable[..., Any],
    *args: Any,
    on_progress: Callable[[int, int, int], None] | None = None,
    switches: list[SoftSwitch] | None = None,
) -> tuple[list[Any], SoftSwitch]:
    """Run ``body(worker, rank, *args)`` in ``spec.n_workers`` processes through fresh softswitches
    (one, or with ``spec.leaves`` a leaf-spine tree). Returns each rank's result (in rank order) and the
    switch (the spine of a tree) for its counters; ``switches``, when given, receives every switch
    (leaves first). ``body`` must be picklable (a module-level function). ``on_progress(rank, done,
    total)`` hears the bodies' :func:`report_progress`."""
    fabric_switches: list[list[SoftSwitch]] = []
    results = run_jobs([spec], functools.partial(_one_worker, body), *args, on_progress=on_progress,
                       switches=fabric_switches)  # fmt: skip
    if switches is not None:
        switches.extend(fabric_switches[0])
    return results, fabric_switches[0][-1]


def run_jobs(
    specs: Sequence[JobSpec],
    body: Callable[..., Any],
    *args: Any,
    on_progress: Callable[[int, int, int], None] | None = None,
    switches: list[list[SoftSwitch]] | None = None,
    switch_cpu_s: list[list[float]] | None = None,
) -> list[Any]:
    """Several jobs on the same worker processes: every job of ``specs`` gets fresh softswitches of its
    own (all serving at once), and each of the ``n_workers`` processes (the same for every spec) runs
    ``body(workers, rank, *args)`` with one LtaWorker per job, in the order of ``specs`` (so a benchmark
    can alternate reduces between a flat switch and a tree, both under the same load). Job ids must
    differ. Returns each rank's result; ``switches``, when given, receives each job's switches (leaves
    first, the spine or the flat switch last), and ``switch_cpu_s`` the CPU seconds each of them used
    serving (same order; threads and switch processes alike). As :func:`run_job` otherwise."""
    n = specs[0].n_workers
    if any(spec.n_workers != n for spec in specs) or len({spec.job_id for spec in specs}) < len(specs):
        raise ValueError("jobs that share worker processes need the same worker count and distinct job ids")
    ctx = spawn_context()
    log_level = logging.getLogger().getEffectiveLevel()
    timeout_s = max(spec.timeout_s for spec in specs)
    fabrics: list[_Fabric] = []
    try:
        for spec in specs:
            fabrics.append(_Fabric(spec))
        specs = [_told_the_tree(spec, fabric) for spec, fabric in zip(specs, fabrics, strict=True)]
        if switches is not None:
            switches.extend(fabric.switches for fabric in fabrics)
        queue, go = ctx.Queue(), ctx.Event()
        procs = [
            ctx.Process(
                target=_worker_main,
                args=(specs, r, [f.entry(r) for f in fabrics], body, args, queue, go, log_level),
                daemon=True,
            )
            for r in range(n)
        ]
        with running(procs):
            addrs: dict[int, Any] = {}
            results: dict[int, Any] = {}
            while len(results) < n:
                try:
                    kind, rank, payload = queue.get(timeout=timeout_s)
                except Exception as exc:  # queue.Empty
                    dead = [r for r, p in enumerate(procs) if not p.is_alive()]
                    raise TimeoutError(
                        f"workers gave no answer within {timeout_s:.0f} s (dead ranks: {dead})"
                    ) from exc
                if kind == "error":
                    raise RuntimeError(f"worker {rank} failed:\n{payload}")
                if kind == "user_error":
                    raise payload
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(rank, *payload)
                    continue
                if kind == "addr":
                    addrs[rank] = payload
                    if len(addrs) == n:
                        for j, fabric in enumerate(fabrics):
                            fabric.install({r: addrs[r][j] for r in range(n)})
                        go.set()
                else:
                    results[rank] = payload
    finally:
        for fabric in fabrics:
            fabric.stop()
    if switch_cpu_s is not None:
        switch_cpu_s.extend(fabric.cpu_s() for fabric in fabrics)
    return [results[r] for r in range(n)]


def _told_the_tree(spec: JobSpec, fabric: _Fabric) -> JobSpec:
    """``spec`` with the workers told the tree's flush groups (``TransportConfig.leaf_sizes``)."""
    if not spec.leaves or spec.transport.leaf_sizes:
        return spec
    sizes = tuple(len(block) for block in fabric.blocks)
    return dataclasses.replace(spec, transport=dataclasses.replace(spec.transport, leaf_sizes=sizes))
