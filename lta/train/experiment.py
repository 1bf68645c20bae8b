"""One worker of ``lta train``: trains the char GPT with the sharded optimizer, run after run.

A worker process serves the parent's commands: ``("run", RunSpec, CheckpointPlan | None)`` binds a fresh
LTA worker for that run's job, builds the model and the sharded optimizer (restoring them from the run's
checkpoint when resuming) and only then reports its address, so that every worker is ready when
``("go",)`` starts them together; ``go`` trains, streaming progress, parameter snapshots and the
checkpoints it writes; ``("exit",)`` ends the process. Every run starts from the same initial weights
and sees the same batches (seeded by run seed and rank, not by drop rate or method), so runs compare
paired.

Reproducibility: with the same seeds a run repeats bit for bit at any drop rate (exact runs:
``TrainConfig.exact`` says how), and so does one restored from a checkpoint.
"""

from __future__ import annotations

import math
import queue
import traceback
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from multiprocessing.queues import Queue
from typing import Any

import numpy as np
import torch

from hostlib.errors import TrainingDiverged
from hostlib.torch_ext.checkpoint import load_shard, read_manifest, save_shard
from hostlib.torch_ext.sharded import ShardedOptimizer
from hostlib.transport import LtaWorker, TransportConfig
from lta.train.extras import WorkerExtras
from lta.train.gpt import CharCorpus, CharGpt, GptConfig

# What a baseline method means on the wire (see TransportConfig.renormalize / fallback).
METHODS: dict[str, dict[str, str]] = {
    "renorm": {"renormalize": "count", "fallback": "prev"},  # ours: divide by the arrival count
    "prev": {"renormalize": "none", "fallback": "prev"},  # the paper's simulation: reuse the last value
    "zero": {"renormalize": "none", "fallback": "zero"},  # lost contributions count as zeros (sum / N)
}


@dataclass(frozen=True)
class TrainConfig:
    width: int = 64
    layers: int = 2
    heads: int = 4
    context: int = 64
    batch: int = 16  # sequences per worker per step
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    elems_per_packet: int = 1024  # jumbo datagrams on loopback: 4x fewer packets than 256
    stale_bound: int = 8
    drift_every: int = 10
    val_batches: int = 32
    # Sequences per validation batch: the validation set (val_batches of them, seeded) does not follow
    # `batch`, so runs trained with another batch (lta train --batch) are evaluated on the same set.
    val_batch: int = 16
    exp_copies: int = 6  # exponent packets gate a whole reduce: send them often enough to survive 40% loss
    # Exact runs (TransportConfig.exact): a round closes by the switch's seeded drop decisions alone,
    # never by a timer, so two runs with the same seed repeat bit for bit at any drop rate and the
    # loss the workers see is the configured one. With timers, a deadline mistakes a late worker (N
    # workers share a few cores; one is descheduled between two sends) for lost packets: its
    # contribution is dropped or its parameter copy goes stale, at 0% too (1.25% of gradients "lost"
    # in a 0% row before this). Exact runs still arm every deadline (the transport's sync and lag
    # deadlines and its RTO, the parameter exchange's collect deadline), at exact_wait_ms: a safety
    # net that TransportStats.flushes_on_timer counts. exact=False: the transport's default deadlines,
    # as on a real network (the fault demo: a dead worker must cost a deadline, not 20 s).
    exact: bool = True
    exact_wait_ms: float = 20_000.0
    optimizer: str = "adamw"  # or "sgd": SGD with momentum 0.9 at sgd_lr, no weight decay
    sgd_lr: float = 0.2  # the best of 0.05..0.5 on the default model (lta/train/simulated.py)
    loss_model: str = "bernoulli"  # or "ge": Gilbert-Elliott bursts at the same mean rate

    def gpt(self, vocab: int) -> GptConfig:
        return GptConfig(
            vocab=vocab, context=self.context, width=self.width, layers=self.layers, heads=self.heads
        )


def quick_config() -> TrainConfig:
    """``lta train --quick``: a tiny model and few steps, under a minute (for tests)."""
    return TrainConfig(
        width=32,
        layers=1,
        heads=2,
        context=32,
        batch=8,
        steps=40,
        warmup=5,
        drift_every=5,
        val_batches=8,
        val_batch=8,
        elems_per_packet=256,  # ~17k parameters: 67 chunks rather than 17
    )


@dataclass(frozen=True)
class RunSpec:
    name: str
    method: str
    drop: float
    seed: int
    job_id: int
    # What runs on top of plain Algorithm 1 ("none"): see MECHANISMS.
    mechanism: str = "none"


# Mechanisms beyond Algorithm 1 (``lta train --mechanism NAME``), each a row of the table:
# feedback: lost-contribution feedback (a worker whose contribution to a chunk was lost, by the RESULT's
#   bitmap, adds it to its next gradient for that chunk: delayed, not dropped; no extra traffic). Its
#   chunks are divided by N, not renormalized (see aggregation());
# stale1 / stale2: tight staleness, S = 1 or 2 (the reliable resend of copies older than S);
# retrieve: a parameter copy lost on the way is asked for and resent within the step (no stale copy;
#   one resend per lost copy, ParamExchange's retrieval).
# rotate: the gradient is rotated by a seeded randomized Hadamard transform
#   (hostlib/emulation/rotation.py, the seed shared by run, step and tensor) before quantization and
#   packetization and rotated back after renormalization: a lost packet costs a little of every value of its
#   block instead of K neighbours.
# Mechanisms combine with "+" (``retrieve+feedback``): see mechanism_parts() for which do.
MECHANISMS = ("none", "feedback", "stale1", "stale2", "retrieve", "rotate")


@dataclass(frozen=True)
class MechanismSettings:
    """What a mechanism sets in the sharded optimizer (the simulated workers read the same)."""

    feedback: (
        bool  # lost-contribution feedback (ShardedOptimizer(feedback=True), hostlib/emulation/feedback.py)
    )
    stale_bound: int  # S: a copy older than S steps is resent reliably, so none is older than S+1
    retrieve: bool = False  # lost parameter copies resent within the step (ShardedOptimizer(retrieve=True))
    rotate: bool = False  # gradients reduced in a rotated basis (ShardedOptimizer(rotate=True))


def mechanism_parts(mechanism: str) -> frozenset[str]:
    """The mechanisms a name combines: ``retrieve+feedback`` → {retrieve, feedback}; ``none`` → {}.
    Refused (ValueError, one line): an unknown part, a part twice, ``none`` in a combination, stale1
    with stale2 (one bound), a stale bound with retrieve (retrieve leaves no stale copy to bound), and
    feedback with rotate (the residual lives in the original basis; ShardedOptimizer refuses it too)."""
    parts = mechanism.split("+")
    unknown = [p for p in parts if p not in MECHANISMS]
    if unknown:  # "" too: its one part is unknown
        raise ValueError(
            f"mechanism must be one of {', '.join(MECHANISMS)} or a '+' combination, got {mechanism!r}"
        )
    if mechanism == "none":
        return frozenset()
    chosen = frozenset(parts) - {"none"}
    clashes = [
        (len(chosen) != len(parts), "a mechanism is named twice or 'none' is combined"),
        ({"stale1", "stale2"} <= chosen, "stale1 and stale2 set the same bound"),
        (bool({"stale1", "stale2"} & chosen) and "retrieve" in chosen, "retrieve leaves no copy to bound"),
        ({"feedback", "rotate"} <= chosen, "feedback does not combine with rotate"),
    ]
    for clash, why in clashes:
        if clash:
            raise ValueError(f"mechanism {mechanism!r}: {why}")
    return chosen


def aggregation(spec: RunSpec) -> str:
    """The METHODS entry a run's reduces use: its method, except under lost-contribution feedback,
    which divides by N (zero fill). A contribution lost at step t is added at t+1: renormalizing over
    the survivors as well would count it twice in expectation (E[aggregate] = g/(1-p), measured in
    tests/test_feedback.py); with sum/N each contribution counts once, late."""
    return "zero" if "feedback" in mechanism_parts(spec.mechanism) else spec.method


def mechanism_settings(mechanism: str, cfg: TrainConfig) -> MechanismSettings:
    """``none``: plain Algorithm 1 at ``cfg.stale_bound``; ``feedback``: the same with lost-contribution
    feedback; ``stale1`` / ``stale2``: S = 1 / 2 instead of ``cfg.stale_bound``; ``retrieve``: lost
    parameter copies asked for and resent within the step; ``rotate``: gradients reduced in a seeded
    randomized Hadamard basis (hostlib/emulation/rotation.py); a ``+`` combination sets each of its parts."""
    parts = mechanism_parts(mechanism)
    bounds = {"stale1": 1, "stale2": 2}
    bound = next((bounds[p] for p in parts if p in bounds), cfg.stale_bound)
    return MechanismSettings(
        feedback="feedback" in parts,
        stale_bound=bound,
        retrieve="retrieve" in parts,
        rotate="rotate" in parts,
    )


@dataclass(frozen=True)
class CheckpointPlan:
    """Where one run keeps its checkpoints (hostlib/torch_ext/checkpoint.py) and what to do with them."""

    directory: str  # the run's own folder: one file per rank and a manifest
    every: int | None = None  # save after every this many steps (never after the last)
    resume_step: int = 0  # > 0: restore the checkpoint committed at this step, train on from there
    stop_after: int | None = None  # end the run after this step, saving a checkpoint there


def transport_config(method: str, cfg: TrainConfig, seed: int) -> TransportConfig:
    """The transport of one run: exact (``cfg.exact``: fenced reduces, ``cfg.exact_wait_ms`` at every
    deadline), or with the default deadlines."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    config = TransportConfig(
        elems_per_packet=cfg.elems_per_packet, exp_copies=cfg.exp_copies, seed=seed, **METHODS[method]
    )
    if cfg.exact:  # every wait of the transport: for a late peer, before a FLUSH, at the tail (the RTO)
        wait = cfg.exact_wait_ms
        config = replace(
            config,
            exact=True,
            sync_deadline_ms=wait,
            lag_deadline_ms=wait,
            min_deadline_ms=wait,
            max_deadline_ms=wait,
        )
    return config


def make_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: TrainConfig, *, momentum: float = 0.9
) -> torch.optim.Optimizer:
    """The run's optimizer, before the sharded wrapper: AdamW (the paper's) or SGD with ``momentum``
    at ``cfg.sgd_lr``, no weight decay (the simulated workers build theirs here too)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.sgd_lr, momentum=momentum)
    if cfg.optimizer != "adamw":
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {cfg.optimizer!r}")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def model_numel(cfg: TrainConfig, corpus: CharCorpus | None = None) -> int:
    """Parameters of the run's model (what a checkpoint's manifest must match)."""
    corpus = corpus or CharCorpus()
    return sum(p.numel() for p in CharGpt(cfg.gpt(corpus.vocab)).parameters())


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def worker_main(
    rank: int,
    n_workers: int,
    switch_addr: tuple[str, int],
    cfg: TrainConfig,
    commands: Queue,
    events: Queue,
    extras: WorkerExtras | None = None,
) -> None:
    """Process entry point (spawned by the parent). A replacement for a killed worker (the fault demo,
    lta/train/fault.py) says ``("spawned", rank)`` once it is up and waits for ``("rejoin", ...)``."""
    torch.set_num_threads(1)  # N workers share a few cores with the switch thread
    extras = extras or WorkerExtras()
    try:
        exporter = extras.start_exporter(rank)  # one endpoint per process, for every run it trains
        corpus = CharCorpus()
        events.put(("spawned", rank))
        while True:
            command = commands.get()
            if command[0] == "exit":
                return
            if command[0] == "rejoin":
                events.put(
                    ("done", rank, rejoin(rank, n_workers, switch_addr, cfg, command, commands, events))
                )
                continue
            spec: RunSpec = command[1]
            plan: CheckpointPlan | None = command[2] if len(command) > 2 else None
            with LtaWorker(
                spec.job_id,
                rank,
                n_workers,
                switch_addr,
                config=transport_config(aggregation(spec), cfg, spec.seed),
            ) as worker:
                run = TrainingRun(worker, corpus, cfg, spec, extras, exporter, plan)
                events.put(("addr", rank, worker.address))  # ready: model built, checkpoint loaded
                go = commands.get()
                if go[0] != "go":
                    return
                summary = run.train(events, commands)
            events.put(("done", rank, summary))
    except TrainingDiverged as exc:  # a result of the run, not a bug: the parent says it in one line
        events.put(("diverged", rank, exc.args))
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))


def rejoin(
    rank: int,
    n_workers: int,
    switch_addr: tuple[str, int],
    cfg: TrainConfig,
    command: tuple,
    commands: Queue,
    events: Queue,
) -> dict[str, Any]:
    """A restarted worker joins its running job (elastic rejoin) and trains it to the end.

    ``command`` is ``("rejoin", spec, plan, address, handover)``: the address the switch knows for this
    rank (the worker binds it again, so no table changes), the run's checkpoint plan (its last committed
    checkpoint, if any, restores this rank's optimizer shard) and a survivor's handover at the step where
    the survivors paused (its full parameter copy, the step counters, the transport's unit counter). Its
    heartbeat starts with its socket, so the liveness monitor restores the job's quorum while everyone is
    paused; ``("resume",)`` then starts all workers at the same step."""
    _, spec, plan, address, handover = command
    corpus = CharCorpus()
    config = transport_config(aggregation(spec), cfg, spec.seed)
    with LtaWorker(spec.job_id, rank, n_workers, switch_addr, config=config, bind=tuple(address)) as worker:
        manifest = None if plan is None else read_manifest(plan.directory)
        restore = None  # this rank's last checkpoint, if one was committed: its optimizer shard's state
        if plan is not None and manifest is not None:
            restore = replace(plan, resume_step=manifest.step)
        run = TrainingRun(worker, corpus, cfg, spec, plan=restore)
        run.plan = plan
        run.adopt(handover)
        events.put(("joined", rank, handover["step"]))
        go = commands.get()
        if go[0] != "resume":
            raise RuntimeError(f"worker {rank} waited to resume, got {go[0]!r}")
        return run.train(events, commands)


class TrainingRun:
    """One worker's part of one run: built (and restored) by the constructor, trained by :meth:`train`."""

    def __init__(
        self,
        worker: LtaWorker,
        corpus: CharCorpus,
        cfg: TrainConfig,
        spec: RunSpec,
        extras: WorkerExtras | None = None,
        exporter: Any = None,
        plan: CheckpointPlan | None = None,
    ) -> None:
        self.worker, self.corpus, self.cfg, self.spec, self.plan = worker, corpus, cfg, spec, plan
        rank = worker.worker_id
        extras = extras or WorkerExtras()
        torch.manual_seed(spec.seed)  # identical initial weights on every worker and in every run
        self.model = CharGpt(cfg.gpt(corpus.vocab))
        adamw = make_optimizer(self.model.parameters(), cfg)
        self.privacy = extras.privacy(worker, spec.job_id, spec.seed)
        patience: dict[str, Any] = {"collect_deadline_ms": cfg.exact_wait_ms} if cfg.exact else {}
        settings = mechanism_settings(spec.mechanism, cfg)
        self.opt = ShardedOptimizer(
            adamw,
            worker,
            stale_bound=settings.stale_bound,
            feedback=settings.feedback,
            retrieve=settings.retrieve,
            rotate_seed=spec.seed if settings.rotate else None,
            privacy=self.privacy,
            **patience,
        )
        self.stragglers = extras.straggler_emulator(spec.seed)
        self.telemetry = extras.telemetry(spec.name, rank)
        self.meter = None
        if self.telemetry is not None:
            from hostlib.torch_ext.metrics import StepMeter

            self.meter = StepMeter(self.opt, self.telemetry)
            if exporter is not None:
                exporter.track(self.telemetry)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, cfg))
        self.batches = torch.Generator().manual_seed(spec.seed * 1000 + rank)
        self.losses = np.zeros(cfg.steps)
        self.start = 0
        self._pause_at: int | None = None
        if plan is not None and plan.resume_step > 0:
            restored = load_shard(
                plan.directory, model=self.model, optimizer=self.opt, generators={"batches": self.batches}
            )
            if restored.step != plan.resume_step:
                raise RuntimeError(
                    f"{plan.directory} holds step {restored.step}, the parent resumes step {plan.resume_step}"
                )
            self.schedule.load_state_dict(restored.extra["scheduler"])
            saved = np.asarray(restored.extra["losses"], dtype=np.float64)
            self.losses[: len(saved)] = saved[: cfg.steps]
            self.start = restored.step

    def _save(self, step: int, events: Queue) -> None:
        assert self.plan is not None
        extra = {
            "scheduler": self.schedule.state_dict(),
            "losses": torch.from_numpy(self.losses[:step].copy()),  # float64: the curve so far, exactly
        }
        record = save_shard(
            self.plan.directory,
            step=step,
            model=self.model,
            optimizer=self.opt,
            generators={"batches": self.batches},
            extra=extra,
        )
        events.put(("checkpoint", self.worker.worker_id, record))

    def handover(self, step: int) -> dict[str, Any]:
        """What a restarted worker needs to join at ``step`` (taken between two steps, while paused)."""
        state = self.worker.codec_state()
        return {
            "step": step,
            "lta_step": self.opt.lta_step,
            "replica": self.opt.replica(),
            "next_unit": state["next_unit"],
            "prev": state["prev"],
        }

    def adopt(self, handover: dict[str, Any]) -> None:
        """Join at ``handover["step"]``: take the survivor's parameter copy (its copy of this rank's own
        shard is the last one this rank broadcast before it died: nobody steps a dead owner's shard),
        its step counters and unit counter; move the data stream and the LR schedule to that step."""
        step = int(handover["step"])
        self.opt.adopt(handover["replica"], lta_step=int(handover["lta_step"]))
        own = self.worker.codec_state()  # keep this worker's own rounding stream
        self.worker.load_codec_state({**own, "next_unit": handover["next_unit"], "prev": handover["prev"]})
        cfg = self.cfg
        self.batches.manual_seed(self.spec.seed * 1000 + self.worker.worker_id)
        for _ in range(step):  # the batches the survivors' schedule assigned to this rank so far
            self.corpus.batch("train", cfg.batch, cfg.context, self.batches)
        self.schedule.last_epoch = step
        for group, base in zip(self.opt.param_groups, self.schedule.base_lrs, strict=True):
            group["lr"] = base * lr_factor(step, cfg)
        self.losses[:] = np.nan  # steps before the rejoin: the parent has them from the first process
        self.start = step

    def _between_steps(self, step: int, events: Queue, commands: Queue | None) -> None:
        """The fault demo's pause: at ``("pause_at", t)`` the worker stops before step t, hands over
        its state and waits for ``("resume",)`` while a restarted peer joins."""
        if commands is None:
            return
        if self._pause_at is None:
            try:
                command = commands.get_nowait()
            except queue.Empty:
                return
            if command[0] != "pause_at":
                raise RuntimeError(f"unexpected command {command[0]!r} during training")
            self._pause_at = int(command[1])
            if step > self._pause_at:
                raise RuntimeError(f"asked to pause at step {self._pause_at}, already at {step}")
        if step == self._pause_at:
            events.put(("paused", self.worker.worker_id, step, self.handover(step)))
            command = commands.get()
            if command[0] != "resume":
                raise RuntimeError(f"paused at step {step}, got {command[0]!r} instead of resume")
            self._pause_at = None

    def train(self, events: Queue, commands: Queue | None = None) -> dict[str, Any]:
        """Train from ``start`` to ``cfg.steps`` (or to ``plan.stop_after``); the summary the parent
        reports, or ``{"stopped": step}`` when the run stopped early. ``commands``: the parent's queue,
        looked at between steps (the fault demo's pause)."""
        cfg, spec, plan, opt = self.cfg, self.spec, self.plan, self.opt
        rank = self.worker.worker_id
        end = cfg.steps
        if plan is not None and plan.stop_after is not None and self.start < plan.stop_after < end:
            end = plan.stop_after
        for step in range(self.start, end):
            self._between_steps(step, events, commands)
            x, y = self.corpus.batch("train", cfg.batch, cfg.context, self.batches)
            loss = self.model(x, y)
            loss.backward()
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if not (torch.isfinite(loss) and all(bool(torch.isfinite(g).all()) for g in grads)):
                raise diverged(spec.name, step, f"worker {rank}'s")
            if self.stragglers is not None:  # what a slow step adds to the real compute
                self.stragglers.sleep(rank, step, 0, extra_only=True)
            opt.step()
            opt.zero_grad()
            self.schedule.step()
            self.losses[step] = loss.item()
            if self.meter is not None:
                self.meter.step(tokens=cfg.batch * cfg.context)
            events.put(("step", rank, step, self.losses[step]))
            if (step + 1) % cfg.drift_every == 0:
                lo, hi = opt.shard
                events.put(
                    (
                        "snapshot",
                        rank,
                        step,
                        opt.replica(),
                        hi - lo,
                        opt.drift.sigma2,
                        opt.drift.predicted(spec.drop),
                    )
                )
            done = step + 1
            if (
                plan is not None
                and done < cfg.steps
                and (done == end or (plan.every and done % plan.every == 0))
            ):
                self._save(done, events)
        if end < cfg.steps:
            return {"stopped": end}
        opt.synchronize()  # evaluate the owners' parameters, as a checkpoint would hold them
        val_sum, val_count = evaluate(self.model, self.corpus, cfg, rank, self.worker.n_workers)
        summary = {
            "losses": self.losses.tolist(),
            "val_sum": val_sum,
            "val_count": val_count,
            # what the run's mechanism cost: stats["exchange"] (resend_requests, resends_served: S)
            # and stats["feedback_*"] (residual chunks carried; no extra packets)
            "stats": opt.drift_stats(spec.drop),
            "transport": self.worker.stats.as_dict(),
            "numel": opt.flat.numel,
        }
        if self.telemetry is not None:
            summary["telemetry"] = self.telemetry.snapshot()
        if self.privacy is not None:
            summary["privacy"] = self.privacy.stats.as_dict()
        return summary


@torch.no_grad()
def evaluate(
    model: CharGpt, corpus: CharCorpus, cfg: TrainConfig, rank: int, n_workers: int
) -> tuple[float, int]:
    """Summed loss over this worker's share of a fixed set of validation batches (same in every run)."""
    model.eval()
    batches = torch.Generator().manual_seed(12345)
    total, count = 0.0, 0
    for i in range(cfg.val_batches):
        x, y = corpus.batch("val", cfg.val_batch, cfg.context, batches)
        if i % n_workers == rank:
            total += float(model(x, y)) * y.numel()
            count += y.numel()
    model.train()
    return total, count


def diverged(run: str, step: int, whose: str = "a worker's") -> TrainingDiverged:
    """The error of a run (worker processes or simulated workers) whose loss or gradient stopped being
    finite at ``step``."""
    return TrainingDiverged(
        f"run {run} diverged at step {step}: {whose} loss or gradient is not finite (a lower --lr or "
        "drop rate may keep it stable)",
        run,
        step,
    )


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    return asdict(cfg)


def with_new_fields(settings: dict[str, Any]) -> dict[str, Any]:
    """Saved sweep settings (a run store's, a checkpoint folder's) with the TrainConfig fields added
    since they were written filled in, under ``train``, as the code that trained them behaved: at their
    defaults, except ``val_batch``, which was ``batch``. A folder from before a new field stays usable."""
    train = settings.get("train")
    if not isinstance(train, dict):
        return settings
    before = {k: v for k, v in config_dict(TrainConfig()).items() if k != "steps"}
    before["val_batch"] = train.get("batch", before["batch"])
    return {**settings, "train": {**before, **train}}
