"""One worker of ``lta train``: trains the char GPT with the sharded optimizer, run after run.

A worker process serves the parent's commands: ``("run", RunSpec)`` binds a fresh LTA worker for that
run's job and reports its address; ``("go",)`` trains it, streaming progress and parameter snapshots;
``("exit",)`` ends the process. Every run starts from the same initial weights and sees the same batches
(seeded by run seed and rank, not by drop rate or method), so runs compare paired.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import asdict, dataclass
from multiprocessing.queues import Queue
from typing import Any

import numpy as np
import torch

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
    exp_copies: int = 6  # exponent packets gate a whole reduce: send them often enough to survive 40% loss

    def gpt(self, vocab: int) -> GptConfig:
        return GptConfig(
            vocab=vocab, context=self.context, width=self.width, layers=self.layers, heads=self.heads
        )


@dataclass(frozen=True)
class RunSpec:
    name: str
    method: str
    drop: float
    seed: int
    job_id: int


def transport_config(method: str, cfg: TrainConfig, seed: int) -> TransportConfig:
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    return TransportConfig(
        elems_per_packet=cfg.elems_per_packet, exp_copies=cfg.exp_copies, seed=seed, **METHODS[method]
    )


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
    """Process entry point (spawned by the parent)."""
    torch.set_num_threads(1)  # N workers share a few cores with the switch thread
    extras = extras or WorkerExtras()
    try:
        exporter = extras.start_exporter(rank)  # one endpoint per process, for every run it trains
        corpus = CharCorpus()
        while True:
            command = commands.get()
            if command[0] == "exit":
                return
            spec: RunSpec = command[1]
            with LtaWorker(
                spec.job_id,
                rank,
                n_workers,
                switch_addr,
                config=transport_config(spec.method, cfg, spec.seed),
            ) as worker:
                events.put(("addr", rank, worker.address))
                go = commands.get()
                if go[0] != "go":
                    return
                summary = train_run(worker, corpus, cfg, spec, events, extras, exporter)
            events.put(("done", rank, summary))
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))


def train_run(
    worker: LtaWorker,
    corpus: CharCorpus,
    cfg: TrainConfig,
    spec: RunSpec,
    events: Queue,
    extras: WorkerExtras | None = None,
    exporter: Any = None,
) -> dict[str, Any]:
    rank = worker.worker_id
    extras = extras or WorkerExtras()
    torch.manual_seed(spec.seed)  # identical initial weights on every worker and in every run
    model = CharGpt(cfg.gpt(corpus.vocab))
    adamw = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    privacy = extras.privacy(worker, spec.job_id, spec.seed)
    opt = ShardedOptimizer(adamw, worker, stale_bound=cfg.stale_bound, privacy=privacy)
    telemetry = extras.telemetry(spec.name, rank)
    meter = None
    if telemetry is not None:
        from hostlib.torch_ext.metrics import StepMeter

        meter = StepMeter(opt, telemetry)
        if exporter is not None:
            exporter.track(telemetry)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    batches = torch.Generator().manual_seed(spec.seed * 1000 + rank)
    losses = np.zeros(cfg.steps)
    for step in range(cfg.steps):
        x, y = corpus.batch("train", cfg.batch, cfg.context, batches)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses[step] = loss.item()
        if meter is not None:
            meter.step(tokens=cfg.batch * cfg.context)
        events.put(("step", rank, step, losses[step]))
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
    opt.synchronize()  # evaluate the owners' parameters, as a checkpoint would hold them
    val_sum, val_count = evaluate(model, corpus, cfg, rank, worker.n_workers)
    summary = {
        "losses": losses.tolist(),
        "val_sum": val_sum,
        "val_count": val_count,
        "stats": opt.drift_stats(spec.drop),
        "transport": worker.stats.as_dict(),
        "numel": opt.flat.numel,
    }
    if telemetry is not None:
        summary["telemetry"] = telemetry.snapshot()
    if privacy is not None:
        summary["privacy"] = privacy.stats.as_dict()
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
        x, y = corpus.batch("val", cfg.batch, cfg.context, batches)
        if i % n_workers == rank:
            total += float(model(x, y)) * y.numel()
            count += y.numel()
    model.train()
    return total, count


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    return asdict(cfg)
