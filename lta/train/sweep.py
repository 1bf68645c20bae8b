"""The parent side of ``lta train``: a softswitch thread, N worker processes, one job per run.

For each run the parent asks every worker to bind a fresh UDP socket (127.0.0.1, any port), adds the job
with those addresses and the run's drop policies to the softswitch, then lets the workers train. It
gathers per-step losses, parameter snapshots (to measure drift across replicas) and final summaries.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hostlib.dropmodels import DropPolicy
from hostlib.torch_ext.drift import receiver_pair_drift
from hostlib.torch_ext.layout import ShardLayout
from lta.launch import sigint_ignored_by_children
from lta.train.experiment import RunSpec, TrainConfig, worker_main
from lta.train.extras import WorkerExtras
from softswitch.pipeline import JobConfig, SoftSwitch
from softswitch.server import SoftSwitchServer

SILENCE_LIMIT_S = 300.0  # a worker that sends nothing for this long is reported as hung


@dataclass
class RunResult:
    spec: RunSpec
    curve: list[float]  # per step, mean train loss over workers
    train_loss: float  # mean over workers of the last 10% of steps
    val_loss: float
    wall_s: float
    drift_steps: list[int] = field(default_factory=list)
    drift_measured: list[float] = field(default_factory=list)  # E[D²] over receiver pairs
    drift_sigma2: list[float] = field(default_factory=list)  # owners' E[Δθ²] per step
    drift_predicted: list[float] = field(default_factory=list)  # owners' momentum-aware prediction
    workers: list[dict[str, Any]] = field(default_factory=list)


class WorkerFailed(RuntimeError):
    pass


class LocalCluster:
    """N spawned training processes and a softswitch thread in this process."""

    def __init__(
        self, n_workers: int, cfg: TrainConfig, switch_seed: int = 0, extras: WorkerExtras | None = None
    ) -> None:
        self.n_workers, self.cfg = n_workers, cfg
        self.switch = SoftSwitch(seed=switch_seed)
        self.server = SoftSwitchServer(self.switch).start()
        ctx = mp.get_context("spawn")
        self.events = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n_workers)]
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(rank, n_workers, self.server.address, cfg, self.commands[rank], self.events, extras),
                name=f"lta-train-worker-{rank}",
                daemon=True,
            )
            for rank in range(n_workers)
        ]
        with sigint_ignored_by_children():  # Ctrl-C reaches this process only; close() stops them
            for proc in self.procs:
                proc.start()

    def close(self, *, now: bool = False) -> None:
        """Stop the workers: after their current run, or ``now`` (a failed or interrupted sweep)."""
        if now:
            for proc in self.procs:
                proc.kill()
        else:
            for commands in self.commands:
                commands.put(("exit",))
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        self.server.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(now=kind is not None)

    def _next_event(self, job_id: int) -> tuple:
        try:
            event = self.events.get(timeout=SILENCE_LIMIT_S)
        except queue.Empty:
            dead = [p.name for p in self.procs if not p.is_alive()]
            raise WorkerFailed(
                f"no word from any worker for {SILENCE_LIMIT_S:.0f} s (dead: {dead or 'none'}); "
                f"switch counters of job {job_id}: {self.switch.read_counters(job_id)}"
            ) from None
        if event[0] == "error":
            raise WorkerFailed(f"worker {event[1]} failed:\n{event[2]}")
        return event

    def run(
        self,
        spec: RunSpec,
        directions: tuple[str, ...],
        on_step: Callable[[int], None] | None = None,
    ) -> RunResult:
        """Train one run to the end; ``on_step(step)`` is called as worker 0 progresses."""
        t0 = time.perf_counter()
        for commands in self.commands:
            commands.put(("run", spec))
        addresses: dict[int, tuple[str, int]] = {}
        while len(addresses) < self.n_workers:
            event = self._next_event(spec.job_id)
            if event[0] == "addr":
                addresses[event[1]] = tuple(event[2])
        job = JobConfig(
            spec.job_id,
            [addresses[r] for r in range(self.n_workers)],
            elems_per_packet=self.cfg.elems_per_packet,
        )
        self.switch.add_job(job)
        try:
            for direction in directions:
                if spec.drop > 0:
                    self.switch.set_drop_policy(spec.job_id, direction, DropPolicy(p=spec.drop))
            for commands in self.commands:
                commands.put(("go",))
            return self._gather(spec, t0, on_step)
        finally:
            self.switch.remove_job(spec.job_id)

    def _gather(self, spec: RunSpec, t0: float, on_step: Callable[[int], None] | None) -> RunResult:
        n = self.n_workers
        summaries: dict[int, dict[str, Any]] = {}
        snapshots: dict[int, dict[int, tuple]] = {}
        result = RunResult(spec, [], 0.0, 0.0, 0.0)
        while len(summaries) < n:
            event = self._next_event(spec.job_id)
            kind, rank = event[0], event[1]
            if kind == "step":
                if rank == 0 and on_step is not None:
                    on_step(event[2])
            elif kind == "snapshot":
                step = event[2]
                snapshots.setdefault(step, {})[rank] = event[3:]
                if len(snapshots[step]) == n:
                    self._measure_drift(result, step, snapshots.pop(step))
            elif kind == "done":
                summaries[rank] = event[2]
        losses = np.array([summaries[r]["losses"] for r in range(n)])
        tail = max(1, losses.shape[1] // 10)
        result.curve = losses.mean(axis=0).tolist()
        result.train_loss = float(losses[:, -tail:].mean())
        result.val_loss = sum(s["val_sum"] for s in summaries.values()) / sum(
            s["val_count"] for s in summaries.values()
        )
        result.workers = [
            {
                "stats": summaries[r]["stats"],
                "transport": summaries[r]["transport"],
                # only with --metrics-port / --dp-sigma: the final telemetry and the clipping statistics
                **{k: summaries[r][k] for k in ("telemetry", "privacy") if k in summaries[r]},
            }
            for r in range(n)
        ]
        result.wall_s = time.perf_counter() - t0
        return result

    def _measure_drift(self, result: RunResult, step: int, snaps: dict[int, tuple]) -> None:
        replicas = np.stack([snaps[r][0] for r in range(self.n_workers)])
        layout = ShardLayout.contiguous(replicas.shape[1], self.cfg.elems_per_packet, self.n_workers)
        sizes = np.array([snaps[r][1] for r in range(self.n_workers)], dtype=np.float64)
        sigma2 = np.array([snaps[r][2] for r in range(self.n_workers)])
        predicted = np.array([snaps[r][3] for r in range(self.n_workers)])
        result.drift_steps.append(step)
        result.drift_measured.append(receiver_pair_drift(replicas, layout))
        result.drift_sigma2.append(float(np.dot(sizes, sigma2) / sizes.sum()))
        result.drift_predicted.append(float(np.dot(sizes, predicted) / sizes.sum()))
