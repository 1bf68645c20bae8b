"""The parent side of ``lta train``: a softswitch thread, N worker processes, one job per run.

For each run the parent asks every worker to bind a fresh UDP socket (127.0.0.1, any port), adds the job
with those addresses and the run's drop policies to the softswitch, then lets the workers train. It
gathers per-step losses, parameter snapshots (to measure drift across replicas) and final summaries.

With a :class:`~lta.train.experiment.CheckpointPlan` the workers save their checkpoints into the run's
folder and the parent commits each one (the manifest) once every rank's file is in, recording its own
part of the run so far (drift measured, wall time) in the manifest; a resumed run starts from that.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from hostlib.emulation.simulate import loss_policy
from hostlib.errors import TrainingDiverged
from hostlib.lifetime import spawn_context
from hostlib.liveness import LivenessEvent, LivenessMonitor
from hostlib.torch_ext.checkpoint import ShardFile, commit, read_manifest
from hostlib.torch_ext.drift import receiver_pair_drift
from hostlib.torch_ext.layout import ShardLayout
from lta.launch import sigint_ignored_by_children
from lta.train.experiment import CheckpointPlan, RunSpec, TrainConfig, worker_main
from lta.train.extras import WorkerExtras
from lta.train.fault import PAUSE_MARGIN_STEPS, FaultDriver, FaultPlan
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
    worker_curves: list[list[float]] = field(default_factory=list)  # per worker, per step train loss
    resumed_from: list[int] = field(default_factory=list)  # steps the run was restored at (checkpoints)
    step_ms_median: float = 0.0  # median time between consecutive steps of one worker (this run)
    fault: dict[str, Any] = field(default_factory=dict)  # --kill-worker: timeline and step times (fault.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        known = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in data.items() if k in known}, "spec": RunSpec(**data["spec"])})


class WorkerFailed(RuntimeError):
    pass


class RunStopped(Exception):
    """A run ended at ``CheckpointPlan.stop_after`` with its checkpoint committed (not a failure)."""

    def __init__(self, name: str, step: int) -> None:
        super().__init__(f"{name} stopped after step {step}")
        self.name, self.step = name, step


class LocalCluster:
    """N spawned training processes and a softswitch thread in this process."""

    def __init__(
        self, n_workers: int, cfg: TrainConfig, switch_seed: int = 0, extras: WorkerExtras | None = None
    ) -> None:
        self.n_workers, self.cfg = n_workers, cfg
        self.switch = SoftSwitch(seed=switch_seed)
        self.server = SoftSwitchServer(self.switch).start()
        self.extras = extras
        self._ctx = spawn_context()
        self.events = self._ctx.Queue()
        self.commands: list[Any] = [None] * n_workers
        self.procs: list[Any] = [None] * n_workers
        for rank in range(n_workers):
            self._spawn(rank)

    def _spawn(self, rank: int) -> None:
        """Start worker ``rank``'s process (again, after a kill: a fresh command queue too)."""
        self.commands[rank] = self._ctx.Queue()
        self.procs[rank] = self._ctx.Process(
            target=worker_main,
            args=(
                rank,
                self.n_workers,
                self.server.address,
                self.cfg,
                self.commands[rank],
                self.events,
                self.extras,
            ),
            name=f"lta-train-worker-{rank}",
            daemon=True,
        )
        with sigint_ignored_by_children():  # Ctrl-C reaches this process only; close() stops them
            self.procs[rank].start()

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

    def _next_event(self, job_id: int, timeout_s: float | None = None) -> tuple | None:
        """The next worker event; None after ``timeout_s`` (when given) without one."""
        try:
            event = self.events.get(timeout=SILENCE_LIMIT_S if timeout_s is None else timeout_s)
        except queue.Empty:
            if timeout_s is not None:
                return None
            dead = [p.name for p in self.procs if not p.is_alive()]
            raise WorkerFailed(
                f"no word from any worker for {SILENCE_LIMIT_S:.0f} s (dead: {dead or 'none'}); "
                f"switch counters of job {job_id}: {self.switch.read_counters(job_id)}"
            ) from None
        if event[0] == "error":
            raise WorkerFailed(f"worker {event[1]} failed:\n{event[2]}")
        if event[0] == "diverged":
            raise TrainingDiverged(*event[2])
        return event

    def run(
        self,
        spec: RunSpec,
        directions: tuple[str, ...],
        on_step: Callable[[int], None] | None = None,
        checkpoint: CheckpointPlan | None = None,
        fault: FaultPlan | None = None,
    ) -> RunResult:
        """Train one run to the end; ``on_step(step)`` is called as worker 0 progresses. With
        ``checkpoint``: save and commit checkpoints, resume from one; RunStopped at ``stop_after``.
        With ``fault``: kill a worker, watch liveness, restart it and let it rejoin (lta/train/fault.py)."""
        t0 = time.perf_counter()
        for commands in self.commands:
            commands.put(("run", spec, checkpoint))
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
                    policy = loss_policy(self.cfg.loss_model, spec.drop)
                    self.switch.set_drop_policy(spec.job_id, direction, policy)
            driver = None
            if fault is not None:
                driver = FaultDriver(fault, self.n_workers)
                monitor = LivenessMonitor(
                    self.switch,
                    spec.job_id,
                    self.n_workers,
                    timeout_s=fault.liveness_timeout_s,
                    poll_s=min(0.1, fault.liveness_timeout_s / 4),
                    on_event=lambda e: self._on_liveness(driver, e),
                ).start()
            for commands in self.commands:
                commands.put(("go",))
            try:
                return self._gather(spec, t0, on_step, checkpoint, driver, addresses)
            finally:
                if driver is not None:
                    monitor.stop()
        finally:
            self.switch.remove_job(spec.job_id)

    @staticmethod
    def _on_liveness(driver: FaultDriver, event: LivenessEvent) -> None:
        driver.note(event.state, worker=event.worker, quorum=event.quorum)
        if event.state == "offline" and driver.offline_at is None:
            driver.offline_at = time.perf_counter()
        elif event.state == "online" and driver.online_at is None:
            driver.online_at = time.perf_counter()

    def _drive_fault(
        self,
        driver: FaultDriver,
        event: tuple | None,
        spec: RunSpec,
        checkpoint: CheckpointPlan | None,
        addresses: dict[int, tuple[str, int]],
        last_step: int,
    ) -> None:
        """One move of the fault demo's state machine (see lta/train/fault.py)."""
        plan, now = driver.plan, time.perf_counter()
        kind = None if event is None else event[0]
        if (
            driver.state == "armed"
            and kind == "step"
            and event[1] == driver.progress_rank
            and event[2] >= plan.step
        ):
            self.procs[plan.rank].kill()
            self.procs[plan.rank].join(timeout=10)
            driver.killed_at, driver.state = now, "dead"
            driver.note("killed", worker=plan.rank, step=event[2])
        elif driver.state == "dead" and now - driver.killed_at >= plan.restart_after_s:
            self._spawn(plan.rank)
            driver.state = "spawning"
            driver.note("restarted", worker=plan.rank)
        elif driver.state == "spawning" and kind == "spawned" and event[1] == plan.rank:
            driver.spawned_at = now
            driver.join_step = last_step + PAUSE_MARGIN_STEPS
            for r in driver.survivors:
                self.commands[r].put(("pause_at", driver.join_step))
            driver.state = "pausing"
        elif driver.state == "pausing" and kind == "paused":
            driver.handovers[event[1]] = event[3]
            if len(driver.handovers) == len(driver.survivors):
                handover = driver.handovers[min(driver.handovers)]
                self.commands[plan.rank].put(("rejoin", spec, checkpoint, addresses[plan.rank], handover))
                driver.handovers.clear()
                driver.state = "joining"
        elif driver.state == "joining" and kind == "joined":
            for r in range(self.n_workers):
                self.commands[r].put(("resume",))
            driver.resumed_at, driver.state = now, "resumed"
            driver.note("rejoined", worker=plan.rank, step=event[2])

    def _gather(
        self,
        spec: RunSpec,
        t0: float,
        on_step: Callable[[int], None] | None,
        checkpoint: CheckpointPlan | None,
        driver: FaultDriver | None = None,
        addresses: dict[int, tuple[str, int]] | None = None,
    ) -> RunResult:
        n = self.n_workers
        seen: dict[int, dict[int, float]] = {r: {} for r in range(n)}  # losses by rank and step, as reported
        last_step = -1
        progress_rank = 0 if driver is None else driver.progress_rank
        quiet_since = time.perf_counter()
        step_times: list[tuple[float, int]] = []  # (time, step) as the progress rank reported them
        summaries: dict[int, dict[str, Any]] = {}
        snapshots: dict[int, dict[int, tuple]] = {}
        saved: dict[int, dict[int, ShardFile]] = {}
        result = RunResult(spec, [], 0.0, 0.0, 0.0)
        wall_before = 0.0  # the run's wall time before the checkpoint it resumed from
        if checkpoint is not None and checkpoint.resume_step > 0:
            manifest = read_manifest(checkpoint.directory)
            assert manifest is not None and manifest.step == checkpoint.resume_step
            earlier = manifest.extra
            result.drift_steps, result.drift_measured = earlier["drift_steps"], earlier["drift_measured"]
            result.drift_sigma2, result.drift_predicted = earlier["drift_sigma2"], earlier["drift_predicted"]
            result.resumed_from = [*earlier["resumed_from"], manifest.step]
            wall_before = float(earlier["wall_s"])
        while len(summaries) < n:
            if driver is None or driver.state == "resumed":
                event = self._next_event(spec.job_id)
            else:  # the fault demo moves on timers too: look every 50 ms
                event = self._next_event(spec.job_id, timeout_s=0.05)
                if event is None and time.perf_counter() - quiet_since > SILENCE_LIMIT_S:
                    raise WorkerFailed(
                        f"no word from any worker for {SILENCE_LIMIT_S:.0f} s (fault: {driver.state})"
                    )
            if driver is not None:
                assert addresses is not None
                self._drive_fault(driver, event, spec, checkpoint, addresses, last_step)
                if (
                    driver.state != "resumed"
                    and len(summaries) == n - 1
                    and driver.plan.rank not in summaries
                ):
                    raise WorkerFailed(
                        f"the run ended before worker {driver.plan.rank} could rejoin ({driver.state}); "
                        f"kill it earlier or restart it sooner (--restart-after)"
                    )
            if event is None:
                continue
            quiet_since = time.perf_counter()
            kind, rank = event[0], event[1]
            if kind == "step":
                seen[rank][event[2]] = event[3]
                last_step = max(last_step, event[2])
                if rank == progress_rank:
                    step_times.append((time.perf_counter(), event[2]))
                    if driver is not None:
                        driver.step_times.append(step_times[-1])
                    if on_step is not None:
                        on_step(event[2])
            elif kind == "snapshot":
                step = event[2]
                snapshots.setdefault(step, {})[rank] = event[3:]
                if len(snapshots[step]) == n:
                    self._measure_drift(result, step, snapshots.pop(step))
            elif kind == "checkpoint":
                record: ShardFile = event[2]
                saved.setdefault(record.step, {})[rank] = record
                if len(saved[record.step]) == n:
                    # Every rank's file is in; a worker's snapshots precede its checkpoint on the queue,
                    # so the drift measured so far covers every step before this one.
                    state = {
                        "drift_steps": result.drift_steps,
                        "drift_measured": result.drift_measured,
                        "drift_sigma2": result.drift_sigma2,
                        "drift_predicted": result.drift_predicted,
                        "resumed_from": result.resumed_from,
                        "wall_s": wall_before + time.perf_counter() - t0,
                    }
                    assert checkpoint is not None
                    commit(checkpoint.directory, list(saved.pop(record.step).values()), extra=state)
            elif kind == "done":
                summaries[rank] = event[2]
        stopped = [s["stopped"] for s in summaries.values() if "stopped" in s]
        if stopped:
            raise RunStopped(spec.name, min(stopped))
        losses = np.array([summaries[r]["losses"] for r in range(n)], dtype=np.float64)
        if driver is not None:  # the restarted rank: its first process's steps, as they were reported
            r = driver.plan.rank
            for step, loss in seen[r].items():
                if np.isnan(losses[r, step]):
                    losses[r, step] = loss
            result.fault = driver.report(t0)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(step_times) if b[1] == a[1] + 1]
        result.step_ms_median = float(np.median(gaps) * 1000) if gaps else 0.0
        tail = max(1, losses.shape[1] // 10)
        # NaN where the killed worker trained no step (between its kill and its rejoin)
        result.worker_curves = [[None if np.isnan(v) else float(v) for v in row] for row in losses]
        result.curve = np.nanmean(losses, axis=0).tolist()
        result.train_loss = float(np.nanmean(losses[:, -tail:]))
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
        result.wall_s = wall_before + time.perf_counter() - t0
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
