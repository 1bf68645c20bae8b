"""``lta train``: the main job. Trains a small char-level GPT under packet loss (the paper's Table 1).

N worker processes (default 4) train with the sharded optimizer (Algorithm 1) through a softswitch that
runs in this process on loopback UDP. Every drop rate p (default 0, 10, 20, 30, 40%) is applied by the
softswitch to gradients (``up``: GRAD packets) and parameters (``param``: PARAM replicas); add ``down``
to lose RESULTs as well. Each rate runs with renormalized aggregation (ours) and with the baselines
``prev`` (reuse the last value, no renormalization: what the paper's simulation does) and ``zero``.

Writes to ``--out``: results.json (rows, drift, per-run curves), table.md, loss_curves.png, drift.png,
val_ppl_change.png. Only this module's ``register`` runs at ``lta`` start-up; torch is imported when training.

``--mechanism NAME`` (repeatable, or comma-separated): mechanisms beyond Algorithm 1 for the renorm runs,
each a row of the tables: none (plain Algorithm 1), feedback (lost contributions added to the next
gradient), stale1 / stale2 (staleness bound S = 1 or 2), retrieve (lost parameter copies resent
within the step), rotate (gradients reduced in a seeded randomized Hadamard basis), or a combination
joined by "+" (retrieve+feedback, stale1+rotate; feedback does not combine with rotate, nor a stale bound
with retrieve); prev and zero always run plain. Every seed
(default 0,1,2; with --quick 0) repeats the whole sweep: the tables give the mean paired change vs 0%
and its 95% t interval over seeds (lta/train/report.py documents results.json). Feedback runs divide
each chunk's sum by N rather than renormalize (a lost contribution arrives a step late: renormalizing
too would count it twice in expectation).

Runs are exact: a round that lost a packet closes by the switch's seeded drop decisions alone, never
by a timer (each reduce ends with a fence chunk the emulated loss spares: TransportConfig.exact), so
the same seed gives the same losses bit for bit at any drop rate. ``--timed-close`` uses the
transport's deadlines instead, as on a real network; so do runs with ``down`` in ``--directions``.

``--metrics-port PORT``: worker r serves Prometheus metrics (``lta_*``, EWMA weight from
``TELEMETRY_ALPHA``, default 0.1) on PORT+r; ``lta metrics watch HOST:PORT-LAST`` shows them.
``--dp-sigma S --dp-clip C``: each worker clips its whole gradient to C and the aggregate carries
Gaussian noise of std S·C whatever count arrived (hostlib/torch_ext/dp.py); results.json's ``privacy``
gives ε at ``--dp-delta`` for one worker's data over the run (dp-accounting's RDP accountant).

Checkpoints: ``--checkpoint-dir DIR --checkpoint-every N`` saves every run every N steps into
DIR/<run-name>/ (one file per worker and a manifest: model, optimizer shard, stale-copy tables, drift
monitor, RNG states, step) and marks finished runs with DIR/<run-name>/result.json. ``--resume DIR``
(the same command, with --resume in place of --checkpoint-dir) reports the finished runs from their
saved results, restores the interrupted one at its last checkpoint and trains it on to ``--steps``, and
starts the runs not begun; a run at 0% drop resumed this way repeats the uninterrupted run bit for
bit. ``--stop-after K`` interrupts on purpose: it checkpoints the current run at step K and ends the
sweep. results.json's runs carry every worker's per-step loss (``worker_curves``, the full curve for
a resumed run) so runs can be compared. Details: lta/train/resume.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from hostlib import argtypes
from hostlib.emulation.dropmodels import DIRECTIONS
from hostlib.errors import UsageError
from hostlib.protocol import MAX_WORKERS
from lta.cliparse import LtaRawHelpFormatter, plain_text
from lta.jsonout import document, emit
from lta.progress import is_quiet

SCHEMA = "lta.train/2"
DEFAULT_OUT = "lta-train"
DEFAULT_OUT_QUICK = "lta-train-quick"  # so that a quick try never replaces a full sweep's results
# What a finished sweep leaves in --out (report.write): their presence marks an earlier sweep.
OUTPUT_FILES = ("results.json", "table.md", "loss_curves.png", "drift.png", "val_ppl_change.png")

log = logging.getLogger(__name__)


def _kill(text: str) -> tuple[int, int]:
    from lta.train.fault import parse_kill

    try:
        return parse_kill(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if any(not 0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"drop rates must be in [0, 1): {text}")
    return values


def _split(text: str) -> list[str]:
    """A comma list's non-empty names."""
    return [v.strip() for v in text.split(",") if v.strip()]


def _names(allowed: tuple[str, ...]):  # noqa: ANN202
    def parse(text: str) -> list[str]:
        names = _split(text)
        unknown = set(names) - set(allowed)
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}; got {text!r}")
        return names

    return parse


def _mechanisms(text: str) -> list[str]:
    from lta.train.experiment import mechanism_parts  # imports torch: only when the flag is given

    names = _split(text)
    if not names:
        raise argparse.ArgumentTypeError(f"no mechanism named in {text!r}")
    for name in names:
        try:
            mechanism_parts(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def sweep_specs(seeds: list[int], drops: list[float], methods: list[str], mechanisms: list[str]) -> list[Any]:
    """The runs of a sweep, in order: per seed, the 0% run (renorm, no mechanism: nothing is lost, so it
    serves every method), then per method, mechanism and drop rate > 0 one run. Mechanisms apply to
    renorm; prev and zero run plain. Names are unique (checkpoints are kept by name):
    ``lossless-s0``, ``renorm-p0.10-s0``, ``renorm+feedback-p0.10-s0``, ``prev-p0.10-s0``. Every run of
    a seed has the same job id (runs go one at a time): the switch seeds its drop streams and the
    workers their stochastic rounding by it, so every method and mechanism of a seed meets the same
    drop decisions and rounding, whatever else the sweep holds."""
    from lta.train.experiment import RunSpec

    specs: list[RunSpec] = []
    for seed in seeds:
        job_id = seed % 63 + 1
        specs.append(RunSpec(f"lossless-s{seed}", "renorm", 0.0, seed, job_id))
        for method in methods:
            for mechanism in mechanisms if method == "renorm" else ["none"]:
                group = method if mechanism == "none" else f"{method}+{mechanism}"
                for drop in sorted(set(drops) - {0.0}):
                    specs.append(
                        RunSpec(f"{group}-p{drop:.2f}-s{seed}", method, drop, seed, job_id, mechanism)
                    )
    return specs


def sweep_from_args(args: argparse.Namespace) -> tuple[list[float], list[int], list[str], list[Any]]:
    """(drop rates with 0 added, seeds, mechanisms, run specs) of ``lta train``'s arguments: seeds default
    to 0,1,2 (0 with --quick), mechanisms to none; a mechanism without renorm is a usage error."""
    drops = sorted(set(args.drops) | {0.0})
    seeds = args.seeds if args.seeds is not None else [0] if args.quick else [0, 1, 2]
    mechanisms = list(dict.fromkeys(m for given in args.mechanism or [["none"]] for m in given))
    if mechanisms != ["none"] and "renorm" not in args.methods:
        raise UsageError(
            f"--mechanism {','.join(mechanisms)} applies to renorm runs: add renorm to --methods"
        )
    return drops, seeds, mechanisms, sweep_specs(seeds, drops, args.methods, mechanisms)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a char GPT under packet loss: the paper's Table 1 at small scale",
        description=plain_text(__doc__),
        formatter_class=LtaRawHelpFormatter,
    )
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="output folder (default: lta-train, with --quick lta-train-quick); one that holds an earlier "
        "sweep's results is refused unless --overwrite",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the results an earlier sweep left in --out"
    )
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
        "--mechanism",
        type=_mechanisms,
        action="append",
        metavar="NAME",
        help="mechanism beyond Algorithm 1 for the renorm runs, one more row each: none, feedback, stale1, "
        "stale2, retrieve, rotate, or a '+' combination (retrieve+feedback); repeat the flag or separate "
        "with commas (default: none)",
    )
    p.add_argument(
        "--seeds",
        type=argtypes.csv_of(argtypes.nonnegative_int, "seeds"),
        help="seeds, comma-separated; each one is a full sweep, paired with its own 0%% run "
        "(default: 0,1,2; with --quick 0)",
    )
    p.add_argument(
        "--steps", type=argtypes.positive_int, help="training steps per run (default: 300; with --quick 40)"
    )
    p.add_argument(
        "--batch",
        type=argtypes.positive_int,
        metavar="B",
        help="sequences per worker and step of the 4-worker run (default: 16; with --quick 8); "
        "--simulate-workers N share the same global batch of 4*B sequences",
    )
    p.add_argument(
        "--lr",
        type=argtypes.float_range(0.0, low_open=True, what="learning rate"),
        metavar="LR",
        help="peak learning rate of the warmup + cosine schedule (default: 3e-3 with AdamW, 0.2 with "
        "--optimizer sgd)",
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
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        metavar="DIR",
        help="save checkpoints (one folder per run) and finished runs' results into DIR (a new folder)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=argtypes.positive_int,
        metavar="N",
        help="checkpoint every N steps (with --checkpoint-dir or --resume)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue the sweep checkpointed in DIR: finished runs are reported, the interrupted one "
        "resumes at its last checkpoint and trains on to --steps, the rest start",
    )
    p.add_argument(
        "--stop-after",
        type=argtypes.positive_int,
        metavar="K",
        help="interrupt on purpose: checkpoint the run at step K and end the sweep (resume later)",
    )
    p.add_argument(
        "--simulate-workers",
        type=argtypes.int_range(3, 1024, "simulated worker count"),
        metavar="N",
        help="N simulated workers in this process (the paper's N=64 on one machine) instead of --workers "
        "processes: the same drops, renormalization and stale copies, no sockets (lta/train/simulated.py)",
    )
    p.add_argument(
        "--jobs",
        type=argtypes.positive_int,
        default=1,
        metavar="J",
        help="with --simulate-workers: train J runs at once in J processes (one torch thread each); "
        "finished runs are kept in OUT/runs and reused by a later sweep with the same settings",
    )
    p.add_argument(
        "--optimizer", choices=("adamw", "sgd"), default="adamw", help="AdamW, or SGD with momentum 0.9"
    )
    p.add_argument(
        "--loss-model",
        choices=("bernoulli", "ge"),
        default="bernoulli",
        help="independent losses, or Gilbert-Elliott bursts (4 packets on average) at the same mean rate",
    )
    p.add_argument(
        "--straggle-prob",
        type=argtypes.probability,
        default=0.0,
        metavar="Q",
        help="emulated stragglers: each worker's step is slow with probability Q (seeded per worker, step)",
    )
    p.add_argument(
        "--straggle-factor",
        type=argtypes.float_range(1.0, what="straggle factor"),
        default=3.0,
        metavar="K",
        help="a slow step takes K x --straggle-base-ms longer (with --straggle-prob or --slow-host)",
    )
    p.add_argument(
        "--straggle-base-ms",
        type=argtypes.float_range(0.0, low_open=True, what="straggle base time"),
        default=50.0,
        metavar="MS",
        help="the emulated compute time a straggling step multiplies",
    )
    p.add_argument(
        "--slow-host",
        type=argtypes.int_range(0, MAX_WORKERS - 1, "worker"),
        metavar="RANK",
        help="this worker is slow at every step (one bad node)",
    )
    p.add_argument(
        "--kill-worker",
        type=_kill,
        metavar="RANK@STEP",
        help="the fault demo: SIGKILL worker RANK when the run reaches STEP, restart it later; it rejoins",
    )
    p.add_argument(
        "--restart-after",
        type=argtypes.float_range(0.0, what="restart delay"),
        default=10.0,
        metavar="S",
        help="seconds between the kill and the restart (with --kill-worker)",
    )
    p.add_argument(
        "--liveness-timeout",
        type=argtypes.float_range(1.0, what="liveness timeout"),
        default=1.5,
        metavar="S",
        help="a worker silent this long is offline and the quorum drops (with --kill-worker; at least "
        "1 s: workers heartbeat every 0.5 s, and a busy machine delays beats)",
    )
    p.add_argument(
        "--timed-close",
        action="store_true",
        help="close rounds that lost a packet at the transport's deadlines, as on a real network (not "
        "reproducible; the default closes them by the seeded drop decisions alone: exact runs)",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: under a minute (for tests)")
    p.add_argument("--json", action="store_true", help="print results.json's rows and drift on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lta.train.experiment import TrainConfig, config_dict, model_numel, quick_config
    from lta.train.extras import extras_from_args
    from lta.train.sweep import RunStopped, WorkerFailed

    extras = extras_from_args(args)  # --metrics-port, --dp-*: checked before anything starts

    cfg = quick_config() if args.quick else TrainConfig()
    overrides: dict[str, Any] = {
        "stale_bound": args.stale_bound,
        "optimizer": args.optimizer,
        "loss_model": args.loss_model,
    }
    if args.steps:
        overrides["steps"] = args.steps
    if args.batch:
        overrides["batch"] = args.batch
    if args.lr:
        overrides["sgd_lr" if args.optimizer == "sgd" else "lr"] = args.lr
    # Exact runs need every lost packet to be shown lost by a later one that arrived (the fence); a
    # RESULT lost on the way down (--directions ...,down) has no such witness: timers close those runs.
    if args.timed_close or "down" in args.directions:
        overrides["exact"] = False
    cfg = TrainConfig(**{**config_dict(cfg), **overrides})
    drops, seeds, mechanisms, specs = sweep_from_args(args)
    if args.simulate_workers is not None:
        _check_simulated(args, extras)
    elif args.jobs > 1:
        raise UsageError("--jobs runs simulated workers in parallel: add --simulate-workers N")
    fault = _fault(args, cfg)
    if fault is not None:  # a dead worker must cost deadlines, not 20 s waits: default deadlines at 0% too
        cfg = TrainConfig(**{**config_dict(cfg), "exact": False})
    checkpoints = _checkpoints(args, cfg, extras)  # before anything starts: a mismatch is one line
    starts = {}
    if checkpoints is not None:
        numel = model_numel(cfg)
        for spec in specs:
            starts[spec.name] = checkpoints.start(
                spec, steps=cfg.steps, world_size=args.workers, numel=numel, k=cfg.elems_per_packet
            )
    if args.stop_after is None:  # a sweep stopped on purpose writes checkpoints only, no results
        args.out = check_out(args.out, quick=args.quick, overwrite=args.overwrite)  # the last check

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.perf_counter()
    results = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    console = Console(stderr=True)  # progress on stderr: stdout carries the table or the JSON only
    quiet = is_quiet()

    def say(text: str) -> None:
        if not quiet:
            console.print(text, markup=False, highlight=False, soft_wrap=True)  # paths stay whole

    who = f"{args.simulate_workers} simulated workers" if args.simulate_workers else f"{args.workers} workers"
    where = args.out if args.stop_after is None else f"checkpoints only, until step {args.stop_after}"
    say(f"lta train: {len(specs)} runs of {cfg.steps} steps, {who}, writing to {where}")
    if not cfg.exact and fault is None:
        why = "--timed-close" if args.timed_close else "RESULTs are lost too (down)"
        say(f"rounds with a lost packet close at deadlines ({why}): runs are not reproducible bit for bit")
    if args.jobs > 1:
        results = _run_jobs(args, cfg, specs, say)
        return _finish(args, cfg, extras, drops, seeds, mechanisms, results, t0, say)
    stopped = None
    # Live bars on a terminal only: elsewhere (a log file) rich would print the whole table of runs once
    # more at the end, beside the one line per run written below.
    bars = console.is_terminal and not quiet
    try:
        with (
            _cluster(args, cfg, extras) as cluster,
            Progress(*columns, console=console, transient=False, disable=not bars) as progress,
        ):
            overall = progress.add_task("runs", total=len(specs))
            for spec in specs:
                start = starts.get(spec.name)
                if start is not None and start.result is not None:
                    results.append(start.result)
                    say(f"{spec.name}: finished, results loaded from {checkpoints.root / spec.name}")
                    progress.advance(overall)
                    continue
                plan = None if start is None else start.plan
                first = 0 if plan is None else plan.resume_step
                if plan is not None and first:
                    say(f"resuming {spec.name} at step {first} from {plan.directory}")
                steps = progress.add_task(f"  {spec.name}", total=cfg.steps, completed=first)
                try:
                    result = cluster.run(
                        spec,
                        tuple(args.directions),
                        on_step=lambda s, t=steps: progress.update(t, completed=s + 1),
                        checkpoint=plan,
                        fault=fault,
                    )
                except RunStopped as exc:
                    stopped = exc
                    break
                if checkpoints is not None:
                    checkpoints.finished(result)
                results.append(result)
                done = f"{spec.name} val {result.val_loss:.3f} ({result.wall_s:.0f} s)"
                progress.update(steps, completed=cfg.steps, description=f"  {done}")
                progress.advance(overall)
                if not console.is_terminal:  # a log file: one line per run instead of live bars
                    say(f"run {len(results)}/{len(specs)}: {done}")
    except WorkerFailed as exc:  # a worker's traceback (a bug) or a hang: kept whole for the report
        print(f"lta train: {exc}", file=sys.stderr)
        return 1
    if stopped is not None:
        assert checkpoints is not None
        say(
            f"stopped {stopped.name} after step {stopped.step} (--stop-after); its checkpoint is in "
            f"{checkpoints.root / stopped.name}. Continue with the same command and "
            f"--resume {checkpoints.root}"
        )
        return 0
    return _finish(args, cfg, extras, drops, seeds, mechanisms, results, t0, say)


def _run_jobs(args: argparse.Namespace, cfg: Any, specs: list[Any], say: Any) -> list[Any]:
    """``--jobs J``: the simulated runs in J processes (lta/train/parallel.py), one line per run."""
    from lta.train.experiment import config_dict
    from lta.train.parallel import RunStore, run_parallel

    settings = {
        "workers": args.simulate_workers,
        "directions": list(args.directions),
        "train": config_dict(cfg),
    }
    store = RunStore(args.out, settings)
    done = 0

    def report_run(result: Any, loaded: bool) -> None:
        nonlocal done
        done += 1
        how = f"loaded from {store.root}" if loaded else f"{result.wall_s:.0f} s"
        say(f"run {done}/{len(specs)}: {result.spec.name} val {result.val_loss:.3f} ({how})")

    return run_parallel(
        specs, args.simulate_workers, cfg, tuple(args.directions), args.jobs, store, report_run
    )


def _finish(
    args: argparse.Namespace,
    cfg: Any,
    extras: Any,
    drops: list[float],
    seeds: list[int],
    mechanisms: list[str],
    results: list[Any],
    t0: float,
    say: Any,
) -> int:
    """Write results.json, table.md and the plots of a finished sweep; print the table (or --json)."""
    from lta.train import report
    from lta.train.experiment import config_dict
    from lta.train.extras import privacy_summary

    fault = _fault(args, cfg)
    checkpoints = (
        None if args.checkpoint_dir is None and args.resume is None else args.resume or args.checkpoint_dir
    )
    config = {
        "workers": args.simulate_workers or args.workers,
        "simulated": args.simulate_workers is not None,
        "optimizer": args.optimizer,
        "loss_model": args.loss_model,
        "drops": drops,
        "methods": args.methods,
        "mechanisms": mechanisms,
        "directions": args.directions,
        "seeds": seeds,
        "quick": args.quick,
        "train": config_dict(cfg),
        "model": "char GPT on pydoc_data.topics; AdamW, warmup + cosine; sharded optimizer (Algorithm 1)",
    }
    if args.metrics_port is not None:
        config["metrics"] = {"port": args.metrics_port, "alpha": extras.telemetry_alpha}
    if extras.stragglers is not None:
        config["stragglers"] = vars(extras.stragglers)
    if fault is not None:
        config["fault"] = vars(fault)
    if checkpoints is not None:
        config["checkpoints"] = {"dir": str(checkpoints), "every": args.checkpoint_every}
    if args.jobs > 1:
        config["jobs"] = args.jobs
    # results.json leads with the header every --json document has (lta.jsonout): schema and versions
    out = document(SCHEMA, report.build_results(results, config, time.perf_counter() - t0))
    privacy = privacy_summary(extras, cfg.steps)
    if privacy is not None:
        out["privacy"] = privacy
        eps, delta = privacy["epsilon"], privacy["delta"]
        say(f"privacy: epsilon {eps:.3f} at delta {delta:g} per worker over {cfg.steps} steps (RDP)")
    written = report.write(out, args.out)
    if args.json:
        emit(SCHEMA, {"rows": out["rows"], "drift": out["drift"]}, indent=1)
    else:
        print(report.markdown_table(out))
    say("wrote " + ", ".join(str(p) for p in written))
    return 0


def check_out(out: Path | None, *, quick: bool, overwrite: bool) -> Path:
    """The folder ``lta train`` writes to, made now, so that a sweep never trains for an hour and then
    finds it cannot write: ``out`` None is the default (``lta-train``, with --quick ``lta-train-quick``).
    A file there, a folder that cannot be made or written, or one that holds an earlier sweep's results
    (without ``overwrite``) is a :class:`UsageError`."""
    if out is None:
        out = Path(DEFAULT_OUT_QUICK if quick else DEFAULT_OUT)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file: name a folder for the results (new or empty)")
    earlier = [name for name in OUTPUT_FILES if (out / name).exists()]
    if earlier and not overwrite:
        raise UsageError(
            f"--out {out} already holds the results of an earlier sweep ({', '.join(earlier)}): name "
            f"another folder with --out DIR, or add --overwrite to replace them"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot make the folder: {exc.strerror or exc}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: the folder is not writable")
    if earlier:
        log.warning("replacing the results of an earlier sweep in %s (--overwrite)", out)
    return out


def _cluster(args: argparse.Namespace, cfg: Any, extras: Any) -> Any:
    """Worker processes through a softswitch, or ``--simulate-workers`` in this process."""
    if args.simulate_workers is not None:
        import torch

        from lta.train.simulated import SimulatedCluster

        # One thread, as each --jobs process has: torch's default (one per core) spins on its barriers
        # when anything else holds a core, which made a step about 9x slower at load 6 (measured).
        torch.set_num_threads(1)
        return SimulatedCluster(args.simulate_workers, cfg)
    from lta.train.sweep import LocalCluster

    return LocalCluster(args.workers, cfg, extras=extras)


def _check_simulated(args: argparse.Namespace, extras: Any) -> None:
    """What simulated workers do not model: one line naming the flag."""
    for flag, given in (
        ("--kill-worker", args.kill_worker is not None),
        ("--checkpoint-dir/--resume", args.checkpoint_dir is not None or args.resume is not None),
        ("--metrics-port", args.metrics_port is not None),
        ("--dp-sigma", args.dp_sigma is not None),
        ("--straggle-prob/--slow-host", extras.stragglers is not None),
    ):
        if given:
            raise UsageError(f"{flag} needs worker processes: leave out --simulate-workers")


def _fault(args: argparse.Namespace, cfg: Any) -> Any:
    """The fault demo's FaultPlan (lta/train/fault.py), or None without --kill-worker."""
    from lta.train.fault import FaultPlan

    if args.kill_worker is None:
        return None
    rank, step = args.kill_worker
    if rank >= args.workers:
        raise UsageError(f"--kill-worker {rank}@{step}: there are workers 0..{args.workers - 1}")
    if not 0 <= step < cfg.steps - 1:
        raise UsageError(f"--kill-worker {rank}@{step}: the step must be below --steps - 1 = {cfg.steps - 1}")
    if args.stop_after is not None or args.resume is not None:
        raise UsageError("--kill-worker runs whole runs: leave out --stop-after and --resume")
    return FaultPlan(rank, step, args.restart_after, args.liveness_timeout)


def _checkpoints(args: argparse.Namespace, cfg: Any, extras: Any) -> Any:
    """The sweep's SweepCheckpoints (lta/train/resume.py), or None without --checkpoint-dir/--resume."""
    from lta.train.resume import SweepCheckpoints, sweep_settings

    if args.checkpoint_dir is not None and args.resume is not None:
        raise UsageError("--resume DIR continues the checkpoints in DIR: leave out --checkpoint-dir")
    root = args.resume if args.resume is not None else args.checkpoint_dir
    if root is None:
        for flag, value in (("--checkpoint-every", args.checkpoint_every), ("--stop-after", args.stop_after)):
            if value is not None:
                raise UsageError(
                    f"{flag} needs somewhere to save: add --checkpoint-dir DIR (or --resume DIR)"
                )
        return None
    if args.stop_after is not None and args.stop_after >= cfg.steps:
        raise UsageError(f"--stop-after {args.stop_after} must be below --steps {cfg.steps}")
    settings = sweep_settings(args.workers, args.directions, cfg, extras.dp)
    return SweepCheckpoints(
        root,
        settings,
        resume=args.resume is not None,
        every=args.checkpoint_every,
        stop_after=args.stop_after,
    )
