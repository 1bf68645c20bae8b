"""``lta train``: the main job. Trains a small char-level GPT under packet loss (the paper's Table 1).

N worker processes (default 4) train with the sharded optimizer (Algorithm 1) through a softswitch that
runs in this process on loopback UDP. Every drop rate p (default 0, 10, 20, 30, 40%) is applied by the
softswitch to gradients (``up``: GRAD packets) and parameters (``param``: PARAM replicas); add ``down``
to lose RESULTs as well. Each rate runs with renormalized aggregation (ours) and with the baselines
``prev`` (reuse the last value, no renormalization: what the paper's simulation does) and ``zero``.

Writes to ``--out``: results.json (rows, drift, baselines, per-run curves), table.md, loss_curves.png,
drift.png. Only this module's ``register`` runs at ``lta`` start-up; torch is imported when training.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hostlib.dropmodels import DIRECTIONS


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if any(not 0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"drop rates must be in [0, 1): {text}")
    return values


def _names(allowed: tuple[str, ...]):  # noqa: ANN202
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        unknown = set(names) - set(allowed)
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}; got {text!r}")
        return names

    return parse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a char GPT under packet loss: the paper's Table 1 at small scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("lta-train"), help="output folder (default: ./lta-train)")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    p.add_argument(
        "--drops", type=_floats, default=[0.0, 0.1, 0.2, 0.3, 0.4], help="drop rates (default 0,.1,.2,.3,.4)"
    )
    p.add_argument(
        "--methods",
        type=_names(("renorm", "prev", "zero")),
        default=["renorm", "prev", "zero"],
        help="aggregation methods to sweep (default renorm,prev,zero)",
    )
    p.add_argument(
        "--directions",
        type=_names(DIRECTIONS),
        default=["up", "param"],
        help="where loss applies (default up,param)",
    )
    p.add_argument(
        "--seeds", type=lambda s: [int(v) for v in s.split(",")], default=[0], help="seeds (default 0)"
    )
    p.add_argument("--steps", type=int, help="training steps per run (default 300; --quick 40)")
    p.add_argument("--stale-bound", type=int, default=8, help="S: resend a parameter copy older than S steps")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: under a minute (for tests)")
    p.add_argument("--json", action="store_true", help="print results.json's rows and drift on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lta.train import report
    from lta.train.experiment import RunSpec, TrainConfig, config_dict
    from lta.train.sweep import LocalCluster, WorkerFailed

    if not 3 <= args.workers <= 64:
        print(
            "lta train: --workers must be in 3..64 (drift is measured between two receivers of a shard)",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        cfg = TrainConfig(
            width=32,
            layers=1,
            heads=2,
            context=32,
            batch=8,
            steps=40,
            warmup=5,
            drift_every=5,
            val_batches=8,
            elems_per_packet=256,  # ~17k parameters: 67 chunks rather than 17
        )
    else:
        cfg = TrainConfig()
    overrides = {"stale_bound": args.stale_bound}
    if args.steps:
        overrides["steps"] = args.steps
    cfg = TrainConfig(**{**config_dict(cfg), **overrides})
    drops = sorted(set(args.drops) | {0.0})
    specs = []
    for seed in args.seeds:
        for method in args.methods:
            for drop in drops:
                if drop == 0 and method != args.methods[0]:
                    continue  # nothing is lost at 0%: one run serves every method
                job_id = len(specs) % 63 + 1
                name = f"{method}-p{drop:.2f}-s{seed}" if drop else f"lossless-s{seed}"
                specs.append(RunSpec(name, method if drop else "renorm", drop, seed, job_id))

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.perf_counter()
    results = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with LocalCluster(args.workers, cfg) as cluster, Progress(*columns, transient=False) as progress:
            overall = progress.add_task("runs", total=len(specs))
            for spec in specs:
                steps = progress.add_task(f"  {spec.name}", total=cfg.steps)
                result = cluster.run(
                    spec,
                    tuple(args.directions),
                    on_step=lambda s, t=steps: progress.update(t, completed=s + 1),
                )
                results.append(result)
                done = f"{spec.name} val {result.val_loss:.3f} ({result.wall_s:.0f} s)"
                progress.update(steps, completed=cfg.steps, description=f"  {done}")
                progress.advance(overall)
                if not progress.console.is_terminal:  # a log file: one line per run instead of live bars
                    progress.console.print(f"run {len(results)}/{len(specs)}: {done}")
    except WorkerFailed as exc:
        print(f"lta train: {exc}", file=sys.stderr)
        return 1
    config = {
        "workers": args.workers,
        "drops": drops,
        "methods": args.methods,
        "directions": args.directions,
        "seeds": args.seeds,
        "quick": args.quick,
        "train": config_dict(cfg),
        "model": "char GPT on pydoc_data.topics; AdamW, warmup + cosine; sharded optimizer (Algorithm 1)",
    }
    out = report.build_results(results, config, time.perf_counter() - t0)
    written = report.write(out, args.out)
    if args.json:
        print(
            json.dumps({"rows": out["rows"], "drift": out["drift"], "baselines": out["baselines"]}, indent=1)
        )
    else:
        print(report.markdown_table(out))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0
