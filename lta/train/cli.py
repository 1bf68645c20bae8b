"""``lta train``: the main job. Trains a small char-level GPT under packet loss (the paper's Table 1).

N worker processes (default 4) train with the sharded optimizer (Algorithm 1) through a softswitch that
runs in this process on loopback UDP. Every drop rate p (default 0, 10, 20, 30, 40%) is applied by the
softswitch to gradients (``up``: GRAD packets) and parameters (``param``: PARAM replicas); add ``down``
to lose RESULTs as well. Each rate runs with renormalized aggregation (ours) and with the baselines
``prev`` (reuse the last value, no renormalization: what the paper's simulation does) and ``zero``.

Writes to ``--out``: results.json (rows, drift, baselines, per-run curves), table.md, loss_curves.png,
drift.png. Only this module's ``register`` runs at ``lta`` start-up; torch is imported when training.

``--metrics-port PORT``: worker r serves Prometheus metrics (``lta_*``, EWMA weight from
``TELEMETRY_ALPHA``, default 0.1) on PORT+r; ``lta metrics watch HOST:PORT-LAST`` shows them.
``--dp-sigma S --dp-clip C``: each worker clips its whole gradient to C and the aggregate carries
Gaussian noise of std S·C whatever count arrived (hostlib/torch_ext/dp.py); results.json's ``privacy``
gives ε at ``--dp-delta`` for one worker's data over the run (dp-accounting's RDP accountant).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hostlib import argtypes
from hostlib.dropmodels import DIRECTIONS
from hostlib.protocol import MAX_WORKERS
from lta.cliparse import LtaRawHelpFormatter, plain_text
from lta.jsonout import emit
from lta.progress import is_quiet

SCHEMA = "lta.train/1"


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
        description=plain_text(__doc__),
        formatter_class=LtaRawHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("lta-train"), help="output folder")
    p.add_argument(
        "--workers",
        type=argtypes.int_range(3, MAX_WORKERS, "worker count"),
        default=4,
        help=f"worker processes, 3..{MAX_WORKERS} (drift is measured between two receivers of a shard)",
    )
    p.add_argument(
        "--drops", type=_floats, default=[0.0, 0.1, 0.2, 0.3, 0.4], help="drop rates, each in [0, 1)"
    )
    p.add_argument(
        "--methods",
        type=_names(("renorm", "prev", "zero")),
        default=["renorm", "prev", "zero"],
        help="aggregation methods to sweep (renorm, prev, zero)",
    )
    p.add_argument(
        "--directions",
        type=_names(DIRECTIONS),
        default=["up", "param"],
        help=f"where loss applies ({', '.join(DIRECTIONS)})",
    )
    p.add_argument(
        "--seeds",
        type=argtypes.csv_of(argtypes.nonnegative_int, "seeds"),
        default=[0],
        help="seeds, comma-separated; each one is a full sweep",
    )
    p.add_argument(
        "--steps", type=argtypes.positive_int, help="training steps per run (default: 300; with --quick 40)"
    )
    p.add_argument(
        "--stale-bound",
        type=argtypes.nonnegative_int,
        default=8,
        help="S: resend a parameter copy older than S steps",
    )
    p.add_argument(
        "--metrics-port",
        type=argtypes.port,
        metavar="PORT",
        help="serve Prometheus metrics (lta_*), worker r on PORT+r; see them with lta metrics watch",
    )
    p.add_argument("--metrics-addr", default="127.0.0.1", metavar="HOST", help="where the metrics listen")
    p.add_argument(
        "--dp-sigma",
        type=argtypes.float_range(0.0, low_open=True, what="DP noise multiplier"),
        metavar="S",
        help="differential privacy: Gaussian noise of std S*C on the aggregate, whatever count arrived",
    )
    p.add_argument(
        "--dp-clip",
        type=argtypes.float_range(0.0, low_open=True, what="DP clipping norm"),
        metavar="C",
        help="differential privacy: clip each worker's whole gradient to L2 norm C (with --dp-sigma)",
    )
    p.add_argument(
        "--dp-delta",
        type=argtypes.float_range(0.0, 1.0, low_open=True, what="DP delta"),
        default=1e-5,
        metavar="D",
        help="delta of the epsilon that results.json reports",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: under a minute (for tests)")
    p.add_argument("--json", action="store_true", help="print results.json's rows and drift on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lta.train import report
    from lta.train.experiment import RunSpec, TrainConfig, config_dict
    from lta.train.extras import extras_from_args, privacy_summary
    from lta.train.sweep import LocalCluster, WorkerFailed

    extras = extras_from_args(args)  # --metrics-port, --dp-*: checked before anything starts

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

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.perf_counter()
    results = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    console = Console(stderr=True)  # progress on stderr: stdout carries the table or the JSON only
    quiet = is_quiet()

    def say(text: str) -> None:
        if not quiet:
            console.print(text, markup=False, highlight=False)

    say(f"lta train: {len(specs)} runs of {cfg.steps} steps, {args.workers} workers, writing to {args.out}")
    try:
        with (
            LocalCluster(args.workers, cfg, extras=extras) as cluster,
            Progress(*columns, console=console, transient=False, disable=quiet) as progress,
        ):
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
                if not console.is_terminal:  # a log file: one line per run instead of live bars
                    say(f"run {len(results)}/{len(specs)}: {done}")
    except WorkerFailed as exc:  # a worker's traceback (a bug) or a hang: kept whole for the report
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
    if args.metrics_port is not None:
        config["metrics"] = {"port": args.metrics_port, "alpha": extras.telemetry_alpha}
    out = report.build_results(results, config, time.perf_counter() - t0)
    privacy = privacy_summary(extras, cfg.steps)
    if privacy is not None:
        out["privacy"] = privacy
        eps, delta = privacy["epsilon"], privacy["delta"]
        say(f"privacy: epsilon {eps:.3f} at delta {delta:g} per worker over {cfg.steps} steps (RDP)")
    written = report.write(out, args.out)
    if args.json:
        emit(SCHEMA, {"rows": out["rows"], "drift": out["drift"], "baselines": out["baselines"]}, indent=1)
    else:
        print(report.markdown_table(out))
    say("wrote " + ", ".join(str(p) for p in written))
    return 0
