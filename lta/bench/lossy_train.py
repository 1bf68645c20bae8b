"""``lta bench lossy-train``: a training step under loss, stock DDP over gloo against DDP with the lta
comm hook, on the same rate-limited, lossy namespace links as ``lta bench lossy``.

The model is a 265k-parameter MLP (about 1 MiB of float32 gradients, one DDP bucket pair per step)
learning a fixed random teacher's labels (synthetic, seeded, different samples on every rank): small
enough that the gradient exchange, not the arithmetic, sets the step time. Both systems start from the
same weights (DDP broadcasts rank 0's) and see the same samples.

- **gloo**: ``DistributedDataParallel`` with its own allreduce (TCP between the worker namespaces);
- **lta**: the same DDP with :func:`hostlib.torch_ext.ddp_hook.lta_hook` registered: each bucket is
  reduced through the softswitch in the aggregator namespace and renormalized by its arrival count,
  with the owners' parameter re-broadcast every ``--rebroadcast-every`` steps. DDP still needs a
  process group (gloo, for its start-up broadcast); no gradient goes through it.

Reported per system and loss rate: time per step (the slowest rank's, p50/p99/mean), the training loss
(the ranks' mean minibatch loss, smoothed by an exponential moving average with weight 0.1) at the end,
and the steps and seconds until it first reached ``--target-loss``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from hostlib import argtypes
from hostlib.protocol import MAX_WORKERS
from lta.bench import netns_harness as harness
from lta.bench.flags import add_loss_rates, add_mtu, add_steps, add_workers, bench_command
from lta.bench.summary import report, slowest_rank, time_stats
from lta.progress import Status

log = logging.getLogger(__name__)
SCHEMA = "lta.bench.lossy-train/1"

EMA_WEIGHT = 0.1
BATCH = 64
IN_FEATURES, HIDDEN, CLASSES = 256, 512, 10


# ---- the training job (inside the namespaces) -----------------------------------------------------
def build_model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, CLASSES),
    )


def build_teacher() -> Any:
    import torch

    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 64), torch.nn.Tanh(), torch.nn.Linear(64, CLASSES)
    )


def train_worker_main(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", harness.HOST_DEV)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.workers,
        timeout=timedelta(seconds=harness.START_TIMEOUT_S),
    )
    model = DDP(build_model())
    state = None
    if args.system == "lta":
        state = _register_lta_hook(model, args)
    teacher = build_teacher()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    samples = torch.Generator().manual_seed(1000 + args.rank)
    harness.wait_for_go()
    dist.barrier()
    times, losses = [], []
    for _ in range(args.steps):
        x = torch.randn(BATCH, IN_FEATURES, generator=samples)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP reduces the gradients here (gloo, or the lta hook)
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    out: dict[str, Any] = {"rank": args.rank, "times_s": times, "losses": losses}
    if state is not None:
        out["hook"] = state.stats.as_dict()
        state.worker.close()
    dist.barrier()
    dist.destroy_process_group()
    return out


def _register_lta_hook(model: Any, args: argparse.Namespace) -> Any:
    from hostlib.torch_ext.ddp_hook import LtaHookState, lta_hook
    from hostlib.transport import LtaWorker

    config = harness.transport_config(args)
    switch_host, _, switch_port = args.switch.rpartition(":")
    bind_host, _, bind_port = args.bind.rpartition(":")
    worker = LtaWorker(
        harness.JOB_ID, args.rank, args.workers, (switch_host, int(switch_port)), config=config,
        bind=(bind_host, int(bind_port)),
    )  # fmt: skip
    state = LtaHookState(worker, rebroadcast_every=args.rebroadcast_every)
    model.register_comm_hook(state, lta_hook)
    if args.rebroadcast_every:
        state.attach(model.module)
    return state


def worker_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lta.bench.lossy_train", description="one train rank")
    parser.add_argument("system", choices=["gloo", "lta"])
    harness.add_worker_process_flags(
        parser,
        master_required=True,
        elems_per_packet=2048,
        window=harness.DEFAULT_WINDOW,
        min_deadline_ms=5.0,
    )
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--rebroadcast-every", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(train_worker_main(args)), flush=True)
    return 0


# ---- orchestration --------------------------------------------------------------------------------
def smoothed(losses: Sequence[float], weight: float = EMA_WEIGHT) -> list[float]:
    out, ema = [], None
    for v in losses:
        ema = v if ema is None else (1 - weight) * ema + weight * v
        out.append(ema)
    return out


def summarize_training(ranks: list[dict[str, Any]], target_loss: float) -> dict[str, Any]:
    step_s = slowest_rank([r["times_s"] for r in ranks])
    loss = smoothed(np.mean(np.array([r["losses"] for r in ranks]), axis=0).tolist())
    reached = next((i for i, v in enumerate(loss) if v <= target_loss), None)
    out: dict[str, Any] = time_stats(step_s, ("mean", "p50", "p99", "max"), prefix="step_") | {
        "final_loss": loss[-1],
        "steps_to_target": None if reached is None else reached + 1,
        "seconds_to_target": None if reached is None else float(step_s[: reached + 1].sum()),
    }
    if "hook" in ranks[0]:
        keys = ("chunks", "chunks_full", "chunks_partial", "chunks_fallback", "rebroadcasts")
        out["hook"] = {k: sum(r["hook"][k] for r in ranks) for k in keys}
    return out


@dataclass(frozen=True)
class TrainConfig:
    lossy: harness.LossyConfig
    steps: int = 400
    lr: float = 0.05
    rebroadcast_every: int = 50

    def timeout_s(self, loss: float) -> float:
        """A generous bound on one system's run: start-up plus 0.3 s a step, more under loss."""
        return 120.0 + self.steps * (0.3 + 4 * loss)


def _train_argv(system: str, cfg: TrainConfig, rank: int, master: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "lta.bench.lossy_train", system, "--rank", str(rank),
        "--workers", str(cfg.lossy.workers), "--steps", str(cfg.steps), "--master", master,
        "--lr", str(cfg.lr), "--seed", str(cfg.lossy.seed), *extra,
    ]  # fmt: skip


def run_system(net: Any, cfg: TrainConfig, system: str, loss: float, workdir: Path) -> list[dict[str, Any]]:
    lossy = cfg.lossy
    master = f"{net.workers[0].ip}:{harness.GLOO_PORT}"
    if system == "gloo":
        argvs = [(h, _train_argv("gloo", cfg, r, master)) for r, h in enumerate(net.workers)]
        return harness.WorkerGroup(net, argvs, cfg.timeout_s(loss)).run()
    addrs, switch_addr = harness.lta_endpoints(net)
    with harness.softswitch_in(net, lossy, addrs, switch_addr, workdir):
        extra = ["--switch", switch_addr, "--elems-per-packet", str(lossy.k),
                 "--window", str(lossy.units_in_flight), "--min-deadline-ms", f"{lossy.deadline_ms:g}",
                 "--rebroadcast-every", str(cfg.rebroadcast_every)]  # fmt: skip
        argvs = [
            (h, _train_argv("lta", cfg, r, master, "--bind", addrs[r], *extra))
            for r, h in enumerate(net.workers)
        ]
        return harness.WorkerGroup(net, argvs, cfg.timeout_s(loss)).run()


def bench_lossy_train(
    cfg: TrainConfig,
    losses: Sequence[float],
    target_loss: float,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every loss point in turn; ``progress`` (default: the log) hears of each point and system."""
    from mininet_topos.linkshape import LinkSpec
    from mininet_topos.netns import NetnsNetwork, remove_stale

    report = progress or log.info
    remove_stale()
    points = []
    lossy = cfg.lossy
    for i, loss in enumerate(losses):
        report(f"[{i + 1}/{len(losses)}] loss {loss:g}")
        link = LinkSpec.symmetric(loss, rate_mbit=lossy.rate_mbit)
        point: dict[str, Any] = {"loss": loss}
        with (
            NetnsNetwork(
                lossy.workers,
                link,
                mtu=lossy.mtu,
                loss_backend="nftables",
                max_runtime_s=2 * cfg.timeout_s(loss) + 60,
            ) as net,
            tempfile.TemporaryDirectory(prefix="lta-bench-train-") as tmp,
        ):
            for system in ("gloo", "lta"):
                report(f"[{i + 1}/{len(losses)}] loss {loss:g}: {system}, {cfg.steps} steps")
                point[system] = summarize_training(run_system(net, cfg, system, loss, Path(tmp)), target_loss)
        points.append(point)
    return {
        "config": {
            "workers": lossy.workers,
            "rate_mbit": lossy.rate_mbit,
            "mtu": lossy.mtu,
            "elems_per_packet": lossy.k,
            "window": lossy.units_in_flight,
            "min_deadline_ms": lossy.deadline_ms,
            "steps": cfg.steps,
            "lr": cfg.lr,
            "batch_per_rank": BATCH,
            "target_loss": target_loss,
            "rebroadcast_every": cfg.rebroadcast_every,
            "model": "MLP 256-512-256-10 (265k params)",
            "loss_metric": f"ranks' mean minibatch cross-entropy, EMA weight {EMA_WEIGHT}",
        },
        "points": points,
    }


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_command(
        sub,
        "lossy-train",
        run_cli,
        help="DDP over gloo vs DDP with the lta hook on lossy links (root)",
        description="A training step under loss: stock DDP over gloo against DDP with the lta comm hook, "
        "on the rate-limited, lossy namespace links of 'lta bench lossy'. Needs root.",
    )
    add_workers(p, 2, f"ranks, 1..{MAX_WORKERS}")
    add_loss_rates(p, [0.0, 0.01, 0.05])
    p.add_argument(
        "--rate-mbit",
        type=argtypes.float_range(0.0, low_open=True, what="rate"),
        default=200.0,
        help="tbf rate of every worker link, Mbit/s (> 0)",
    )
    add_mtu(p, harness.DEFAULT_MTU, "link MTU in bytes, 68..65535")
    add_steps(p, 400, "training steps per system")
    p.add_argument(
        "--lr",
        type=argtypes.float_range(0.0, low_open=True, what="learning rate"),
        default=0.05,
        help="SGD learning rate (momentum 0.9)",
    )
    p.add_argument(
        "--target-loss",
        type=argtypes.float_range(0.0, low_open=True, what="target loss"),
        default=0.9,
        help="report the steps and seconds until the smoothed loss first reaches this",
    )
    p.add_argument(
        "--rebroadcast-every",
        type=argtypes.nonnegative_int,
        default=50,
        help="lta owners' parameter re-broadcast period in steps (0: never)",
    )
    p.add_argument(
        "--window",
        type=argtypes.positive_int,
        default=harness.DEFAULT_WINDOW,
        help="lta units in flight per worker",
    )


def run_cli(args: argparse.Namespace) -> int:
    harness.require_root_or_say()
    lossy = harness.LossyConfig(
        workers=args.workers, rate_mbit=args.rate_mbit, mtu=args.mtu, window=args.window
    )
    cfg = TrainConfig(lossy, args.steps, args.lr, args.rebroadcast_every)
    title = (
        f"lta bench lossy-train: {args.workers} ranks, {args.steps} steps, {args.rate_mbit:g} Mbit/s, "
        f"loss {','.join(f'{p:g}' for p in args.loss)}: gloo and lta"
    )
    with Status(title) as status:
        out = bench_lossy_train(cfg, args.loss, args.target_loss, status.update)

    def table() -> Iterator[str]:
        yield (
            f"{'loss':>6s} {'system':6s} {'p50':>7s} {'p99':>7s} {'mean':>7s} {'steps→tgt':>9s} "
            f"{'s→tgt':>7s} {'final':>6s}   (step times in ms)"
        )
        for p in out["points"]:
            for system in ("gloo", "lta"):
                s = p[system]
                steps = "-" if s["steps_to_target"] is None else str(s["steps_to_target"])
                secs = "-" if s["seconds_to_target"] is None else f"{s['seconds_to_target']:.1f}"
                yield (
                    f"{p['loss']:6.3f} {system:6s} {s['step_p50_ms']:7.1f} {s['step_p99_ms']:7.1f} "
                    f"{s['step_mean_ms']:7.1f} {steps:>9s} {secs:>7s} {s['final_loss']:6.3f}"
                )

    return report(args.json, SCHEMA, out, table)


if __name__ == "__main__":
    sys.exit(worker_cli())
