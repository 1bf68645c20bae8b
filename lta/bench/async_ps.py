"""``lta bench async``: synchronous windows against asynchronous bounded staleness, with a straggler.

Four workers (``--workers``) train the small teacher problem of :mod:`lta.bench.ps_train` through the
parameter server; each step takes an emulated compute time (a seeded, log-normally jittered sleep of
``--compute-ms``) and the last worker's is ``--straggler-factor`` times longer. Three ways to aggregate:

- ``sync``: a window of all workers per step (every step waits for the straggler), learning rate
  ``--lr`` on the mean of the N gradients;
- ``async-fixed``: every push applied at once if its staleness is at most ``--max-staleness``, with
  ``--async-lr`` (default ``--lr / N``: N async updates move the parameters as far per sample as one
  sync step);
- ``async-adaptive``: the same with per-worker bounds ``max_staleness / speed`` from smoothed submission
  intervals, clamped to ``[--min-staleness, max_staleness x --max-staleness-multiplier]``.

A monitor evaluates the server's parameters every 20 ms; a run stops once they reach ``--target-loss``
(or after ``--time-limit`` seconds). Reported per variant, over seeds: wall-clock time to the target
loss, speed-up against ``sync``, rejection rate and mean staleness of the accepted pushes (what the
server exports), pushes and applied steps.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hostlib import argtypes
from lta.bench.flags import add_batch, add_lr, add_momentum, add_seeds, add_workers, bench_command
from lta.bench.ps_train import (
    TrainSpec,
    add_common_args,
    make_problem,
    run_trainer_bench,
    run_training,
    seed_summary,
)
from lta.bench.summary import report

SCHEMA = "lta.bench.async/1"
VARIANTS = ("sync", "async-fixed", "async-adaptive")
TARGET_SPEEDUP = 1.5
TARGET_REJECTION = 0.10


def _variant(text: str) -> str:
    if text not in VARIANTS:
        raise argparse.ArgumentTypeError(f"unknown variant {text!r}; choose from {', '.join(VARIANTS)}")
    return text


def bench_async(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = progress or (lambda text: None)
    problem = make_problem(d_in=args.d_in, hidden=args.hidden, classes=args.classes)
    rows = []
    for variant in args.variants:
        runs = []
        for seed in range(args.seeds):
            say(f"{variant}, seed {seed}")
            spec = TrainSpec(
                workers=args.workers,
                mode="sync" if variant == "sync" else "async",
                steps=1 << 30,
                batch=args.batch,
                lr=args.lr if variant == "sync" else async_lr(args),
                momentum=args.momentum,
                max_wait_s=args.max_wait_s,
                max_staleness=args.max_staleness,
                adaptive=variant == "async-adaptive",
                min_staleness=args.min_staleness,
                max_staleness_multiplier=args.max_staleness_multiplier,
                compute_s=args.compute_ms / 1e3,
                straggler_factor=args.straggler_factor,
                target_loss=args.target_loss,
                time_limit_s=args.time_limit,
                elems_per_packet=args.elems_per_packet,
                seed=seed,
                trainer=args.trainer,
            )
            runs.append(run_training(spec, problem))
        times = [r["time_to_target_s"] for r in runs]
        rows.append(
            {
                "variant": variant,
                "time_to_target_s": seed_summary(times),
                "reached": sum(t is not None for t in times),
                "rejection_rate": float(np.mean([r["rejection_rate"] for r in runs])),
                "rejection_rates": [r["rejection_rate"] for r in runs],
                "mean_staleness": float(np.mean([r["mean_staleness"] for r in runs])),
                "mean_staleness_submitted": float(np.mean([r["mean_staleness_submitted"] for r in runs])),
                "staleness_bounds": runs[-1]["staleness_bounds"] if variant != "sync" else None,
                "pushes": float(np.mean([r["pushes"] for r in runs])),
                "server_steps": float(np.mean([r["server_steps"] for r in runs])),
                "final_loss": seed_summary([r["final_loss"] for r in runs]),
            }
        )
    return {"config": _config(args), "rows": rows, "targets": _targets(rows)}


def async_lr(args: argparse.Namespace) -> float:
    """The async variants' learning rate: ``--async-lr``, else ``--lr / workers``: a sync step applies the
    mean of N gradients with ``lr``, N async updates apply one gradient each with ``lr / N``, so both move
    the parameters by the same step per sample."""
    return args.async_lr if args.async_lr is not None else args.lr / args.workers


def _config(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "variants", "workers", "straggler_factor", "compute_ms", "target_loss", "time_limit", "seeds",
        "batch", "lr", "momentum", "max_wait_s", "max_staleness", "min_staleness", "max_staleness_multiplier",
        "elems_per_packet", "trainer", "d_in", "hidden", "classes",
    )  # fmt: skip
    return {key: getattr(args, key) for key in keys} | {"async_lr": async_lr(args)}


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Speed-up of each async variant over sync, and adaptive's rejection rate against the fixed bound's."""
    by = {r["variant"]: r for r in rows}
    out: dict[str, Any] = {}
    sync_time = by.get("sync", {}).get("time_to_target_s", {}).get("mean")
    for variant in ("async-fixed", "async-adaptive"):
        mine = by.get(variant, {}).get("time_to_target_s", {}).get("mean")
        if variant in by:
            speedup = sync_time / mine if sync_time and mine else None
            out[f"speedup_{variant}"] = speedup
            out[f"speedup_{variant}_met"] = speedup is not None and speedup >= TARGET_SPEEDUP
    if "async-adaptive" in by:
        rate = by["async-adaptive"]["rejection_rate"]
        out["rejection_rate_adaptive"] = rate
        out["rejection_rate_fixed"] = by.get("async-fixed", {}).get("rejection_rate")
        out["rejection_adaptive_met"] = rate < TARGET_REJECTION
    return out


def register(sub: argparse._SubParsersAction) -> None:
    a = bench_command(
        sub,
        "async",
        _run,
        help="sync windows vs async bounded staleness (fixed, adaptive) with a straggler: time to a loss",
        description="Synchronous windows against asynchronous bounded staleness (fixed and adaptive "
        "bounds) through the parameter server, with one worker slower than the others: wall-clock time "
        "to a target loss, rejection rate and mean staleness.",
    )
    a.add_argument(
        "--variants", type=argtypes.csv_of(_variant, "variants"), default=list(VARIANTS), help="what to run"
    )
    add_workers(a, 4, "workers", type=argtypes.int_range(2, 64, "worker count"))
    a.add_argument(
        "--straggler-factor",
        type=argtypes.float_range(1.0, what="factor"),
        default=3.0,
        help="the last worker's compute time is this many times longer",
    )
    a.add_argument(
        "--compute-ms", type=argtypes.float_range(0.0, what="ms"), default=10.0, help="compute time per step"
    )
    a.add_argument(
        "--target-loss", type=argtypes.positive_float, default=1.55, help="evaluation loss to reach"
    )
    a.add_argument("--time-limit", type=argtypes.positive_float, default=20.0, help="seconds per run at most")
    add_seeds(a, 3, "seeds per variant")
    add_batch(a, 32)
    add_lr(a, 0.2, "learning rate of a sync step")
    a.add_argument(
        "--async-lr",
        type=argtypes.positive_float,
        help="learning rate of each async update (default: --lr / --workers, the same step per sample)",
    )
    add_momentum(a, 0.5)
    a.add_argument("--max-wait-s", type=argtypes.positive_float, default=2.0, help="sync: window deadline")
    a.add_argument("--max-staleness", type=argtypes.nonnegative_int, default=4, help="async: staleness bound")
    a.add_argument("--min-staleness", type=argtypes.nonnegative_int, default=1, help="adaptive: lower clamp")
    a.add_argument(
        "--max-staleness-multiplier",
        type=argtypes.float_range(1.0, what="multiplier"),
        default=10.0,
        help="adaptive: upper clamp is max_staleness x this",
    )
    add_common_args(a, d_in=32, hidden=64, classes=10)


def _run(args: argparse.Namespace) -> int:
    title = (
        f"lta bench async: {len(args.variants)} variants x {args.seeds} seeds, to loss {args.target_loss:g}"
    )
    out = run_trainer_bench(args, title, bench_async)

    def table() -> Iterator[str]:
        yield (
            f"{'variant':15s} {'to target s':>11s} {'reached':>7s} {'rejected':>8s} {'staleness':>9s} "
            f"{'pushes':>7s}"
        )
        for r in out["rows"]:
            t = r["time_to_target_s"]["mean"]
            shown = "-" if t is None else f"{t:.2f}"
            yield (
                f"{r['variant']:15s} {shown:>11s} {r['reached']:7d} {r['rejection_rate']:8.1%} "
                f"{r['mean_staleness']:9.2f} {r['pushes']:7.0f}"
            )
        for key, value in out["targets"].items():
            yield f"{key}: {value}"

    return report(args.json, SCHEMA, out, table)
