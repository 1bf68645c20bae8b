"""Run N worker processes against a softswitch on loopback: the harness behind ``lta demo`` and the
benchmarks.

The parent runs the softswitch in a thread. Each worker process binds its UDP socket, reports the
address, waits until the parent has added the job (the switch must know every worker's address before
the first packet), runs ``body(worker, rank, *args)`` and sends back what it returns.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hostlib.dropmodels import DropPolicy
from hostlib.transport import LtaWorker, TransportConfig
from softswitch.pipeline import JobConfig, SoftSwitch
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


def _worker_main(spec: JobSpec, rank: int, switch_addr, body, args, to_parent, go) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        worker = LtaWorker(spec.job_id, rank, spec.n_workers, switch_addr, config=spec.transport)
        to_parent.put(("addr", rank, worker.address))
        go.wait()
        to_parent.put(("done", rank, body(worker, rank, *args)))
        worker.close()
    except BaseException:
        to_parent.put(("error", rank, traceback.format_exc()))


def run_job(spec: JobSpec, body: Callable[..., Any], *args: Any) -> tuple[list[Any], SoftSwitch]:
    """Run ``body`` in ``spec.n_workers`` processes through a fresh softswitch. Returns each rank's
    result (in rank order) and the switch (for its counters). ``body`` must be picklable (a
    module-level function)."""
    ctx = mp.get_context("spawn")
    switch = SoftSwitch(seed=spec.switch_seed)
    with SoftSwitchServer(switch) as server:
        queue, go = ctx.Queue(), ctx.Event()
        procs = [
            ctx.Process(
                target=_worker_main, args=(spec, r, server.address, body, args, queue, go), daemon=True
            )
            for r in range(spec.n_workers)
        ]
        for p in procs:
            p.start()
        try:
            addrs: dict[int, Any] = {}
            results: dict[int, Any] = {}
            while len(results) < spec.n_workers:
                try:
                    kind, rank, payload = queue.get(timeout=spec.timeout_s)
                except Exception as exc:  # queue.Empty
                    dead = [r for r, p in enumerate(procs) if not p.is_alive()]
                    raise TimeoutError(
                        f"workers gave no answer within {spec.timeout_s:.0f} s (dead ranks: {dead})"
                    ) from exc
                if kind == "error":
                    raise RuntimeError(f"worker {rank} failed:\n{payload}")
                if kind == "addr":
                    addrs[rank] = payload
                    if len(addrs) == spec.n_workers:
                        cfg = spec.transport
                        switch.add_job(
                            JobConfig(
                                spec.job_id,
                                [addrs[r] for r in range(spec.n_workers)],
                                quorum=spec.quorum,
                                pool_size=cfg.pool_size,
                                elems_per_packet=cfg.elems_per_packet,
                            )
                        )
                        for direction, policy in spec.drop.items():
                            switch.set_drop_policy(spec.job_id, direction, policy)
                        go.set()
                else:
                    results[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(spec.n_workers)], switch
