"""``lta bench stragglers``: waiting for every micro-batch against DropCompute's automatic threshold, with
emulated compute stragglers, training a small model through a softswitch.

**The run.** ``--workers`` processes (4) train a tanh MLP on the teacher-labelled problem of
:mod:`lta.bench.ps_train` (16 inputs, 32 hidden units, 4 classes: 676 parameters) with gradient
accumulation over ``--micro-batches`` (M = 8) micro-batches of ``--batch`` samples. Each micro-batch's
compute time is emulated (:mod:`hostlib.emulation.stragglers`): a sleep of ``--micro-batch-ms`` that, with
probability ``--straggle-prob`` (q = 4 %), lasts ``--straggle-factor`` (k = 3) times longer, and
optionally one ``--slow-host`` that is always k times slower; then the real forward and backward pass.
The gradients go through a softswitch on loopback (``renormalize="weight"``: the per-sample mean) and
the workers apply SGD with momentum. The workers meet on a gloo group (a FileStore) for the reliable
exchange of Algorithm 2.

**The two systems, same seeds.** Per seed both runs start from the same weights and see the same
micro-batches and the same stragglers (the emulator is a function of (seed, worker, step, micro-batch)):

- ``baseline``: every worker computes all M micro-batches; the step waits for the slowest;
- ``dropcompute``: :class:`hostlib.torch_ext.dropcompute.DropComputeAccumulator`: ``--warmup`` (I)
  steps like the baseline, then the workers exchange their micro-batch latencies and each computes the
  same tau* (Algorithm 2); from then on a worker stops at tau (a straggling micro-batch is cut at the
  threshold: the emulated sleep is interrupted) and sends what it has with its sample count as weight.
  After ``--steps`` steps it runs extra steps until it has processed as many samples as the baseline
  (the paper's compensation, section 4.5), so the final losses compare at equal samples.

**What is reported.** Over the steps after the warm-up (the same step indices, so the same stragglers,
in both runs): ``speedup`` = baseline mean step time / DropCompute mean step time; ``s_eff_measured`` =
DropCompute samples/s / baseline samples/s (Equation 6's effective speedup, measured);
``s_eff_predicted`` = Algorithm 2's value at tau*, from the warm-up samples only; ``dropped_fraction`` =
micro-batches not computed / all. A step's time is the slowest worker's start-to-end of the step.
Final loss: cross-entropy of the final weights on a fixed evaluation set, per seed, the spread being
the baseline's over seeds (2 standard deviations).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from hostlib import argtypes
from hostlib.emulation.stragglers import StragglerEmulator, StragglerModel
from hostlib.errors import UsageError
from hostlib.lifetime import spawn_context
from hostlib.protocol import MAX_WORKERS
from lta.bench.flags import add_batch, add_lr, add_momentum, add_seeds, add_steps, add_workers, bench_command
from lta.bench.ps_train import make_problem, seed_summary
from lta.bench.summary import report, slowest_rank, time_stats
from lta.progress import Status

SCHEMA = "lta.bench.stragglers/1"
SPREAD_SIGMAS = 2.0  # "within the seed spread": |DropCompute mean - baseline mean| <= this many baseline stds
TARGETS = {"speedup": 1.3, "dropped_fraction": 0.06, "s_eff_relative_error": 0.10}
JOB_ID = 1
ELEMS_PER_PACKET = 256
START_TIMEOUT_S = 120.0
# Every worker reduces after its own compute, and the baseline waits for the slowest by design: the
# transport must not flush a round for a peer that is only late (a whole straggling step, seconds with
# --slow-host), so its wait for peers is far above any step here.
PEER_WAIT_MS = 30_000.0

FULL = {"steps": 150, "warmup": 20, "seeds": 3, "micro_batch_ms": 20.0}
QUICK = {"steps": 16, "warmup": 6, "seeds": 1, "micro_batch_ms": 6.0}


@dataclass(frozen=True)
class Spec:
    """One bench run, as every worker process sees it."""

    workers: int
    micro_batches: int
    batch: int
    micro_batch_s: float
    straggle_prob: float
    straggle_factor: float
    slow_host: int | None
    lognormal: bool
    steps: int
    warmup: int
    seeds: list[int]
    lr: float
    momentum: float
    max_drop: float | None
    d_in: int = 16
    hidden: int = 32
    classes: int = 4


# ---- one worker process ----------------------------------------------------------------------------
def _worker_main(
    spec_dict: dict[str, Any], rank: int, switch: tuple[str, int], store: str, conn: Connection
) -> None:
    """A worker process: report the UDP address, wait for the job, train every seed in both modes."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        from hostlib.transport import LtaWorker, TransportConfig

        torch.set_num_threads(1)
        spec = Spec(**spec_dict)
        config = TransportConfig(
            elems_per_packet=ELEMS_PER_PACKET,
            renormalize="weight",
            sync_deadline_ms=PEER_WAIT_MS,
            lag_deadline_ms=PEER_WAIT_MS,
            reduce_timeout_s=2 * PEER_WAIT_MS / 1000.0,
        )
        worker = LtaWorker(JOB_ID, rank, spec.workers, switch, config=config)
        conn.send(("address", worker.address))
        if conn.recv() != "go":
            return
        from datetime import timedelta

        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=spec.workers,
            timeout=timedelta(seconds=START_TIMEOUT_S),
        )
        worker.check_switch()
        problem = make_problem(d_in=spec.d_in, hidden=spec.hidden, classes=spec.classes)
        # One reduce before anything is timed: the transport's first round measures the RTT.
        worker.allreduce(np.zeros(ELEMS_PER_PACKET, dtype=np.float32), step=0, key="prime", weight=0)
        runs = []
        for seed in spec.seeds:
            for mode in ("baseline", "dropcompute"):
                runs.append(_train(spec, problem, worker, rank, seed, mode))
        conn.send(("done", runs))
        dist.destroy_process_group()
        worker.close()
    except BaseException as exc:  # reported to the parent, which turns it into one line
        conn.send(("error", f"worker {rank}: {type(exc).__name__}: {exc}"))


def _train(spec: Spec, problem: Any, worker: Any, rank: int, seed: int, mode: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from hostlib.torch_ext.dropcompute import DropComputeAccumulator, gloo_exchange

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(spec.d_in, spec.hidden), torch.nn.Tanh(), torch.nn.Linear(spec.hidden, spec.classes)
    )
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
    emulator = StragglerEmulator(
        StragglerModel(
            base_s=spec.micro_batch_s,
            prob=spec.straggle_prob,
            factor=spec.straggle_factor,
            slow_host=spec.slow_host,
            lognormal=spec.lognormal,
            seed=seed,
        )
    )
    auto = mode == "dropcompute"
    acc = DropComputeAccumulator(
        spec.micro_batches,
        params=model.parameters(),
        warmup_steps=spec.warmup if auto else 0,
        exchange=gloo_exchange() if auto else None,
        max_drop=spec.max_drop,
    )
    x_train = torch.from_numpy(problem.x_train)
    y_train = torch.from_numpy(problem.y_train)
    n_train = len(y_train)
    loss_fn = torch.nn.functional.cross_entropy
    target_samples = spec.steps * spec.workers * spec.micro_batches * spec.batch  # the baseline's total
    losses: list[float] = []

    def step_once(step: int) -> None:
        acc.start_step()
        total = 0.0
        for m in range(spec.micro_batches):
            if not acc.should_continue():
                break
            if not emulator.sleep(rank, step, m, until=acc.deadline):
                break  # preempted at the threshold: this micro-batch does not count
            pick = np.random.default_rng([seed, rank, step, m, 7]).integers(0, n_train, spec.batch)
            idx = torch.from_numpy(pick)
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()
            acc.mark_done(samples=spec.batch)
            total += float(loss.detach())
        acc.reduce(worker, step=step, key="grad")
        opt.step()
        acc.end_step()
        losses.append(total / max(acc.computed, 1))

    dist.barrier()
    t0 = time.perf_counter()
    for step in range(spec.steps):
        step_once(step)
    loop_s = time.perf_counter() - t0
    equal_steps_loss = _eval_loss(model, problem)
    extra = 0
    if auto:
        # Compensate the dropped samples (section 4.5): extra steps until the global sample count
        # reaches the baseline's; every worker derives the same count from the same all-reduced sum.
        step = spec.steps
        while True:
            done = torch.tensor([float(sum(r.samples for r in acc.records))], dtype=torch.float64)
            dist.all_reduce(done)
            missing = target_samples - float(done.item())
            if missing <= 0:
                break
            per_step = float(done.item()) / len(acc.records)
            for _ in range(max(1, math.ceil(missing / per_step))):
                step_once(step)
                step += 1
                extra += 1
    choice = acc.choice
    return {
        "mode": mode,
        "seed": seed,
        "rank": rank,
        "iteration_s": [r.iteration_s for r in acc.records],
        "compute_s": [r.compute_s for r in acc.records],
        "micro_batches": [r.micro_batches for r in acc.records],
        "samples": [r.samples for r in acc.records],
        "train_loss": losses,
        "loop_s": loop_s,
        "extra_steps": extra,
        "exchange_s": acc.exchange_s,
        "choice": None if choice is None else {**asdict(choice), "dropped_fraction": choice.dropped_fraction},
        "final_loss": _eval_loss(model, problem),
        "equal_steps_loss": equal_steps_loss,
    }


def _eval_loss(model: Any, problem: Any) -> float:
    import torch

    with torch.no_grad():
        logits = model(torch.from_numpy(problem.x_eval))
        return float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(problem.y_eval)))


# ---- orchestration ---------------------------------------------------------------------------------
def run_workers(spec: Spec, progress: Callable[[str], None]) -> list[list[dict[str, Any]]]:
    """Start the softswitch and the worker processes; returns each rank's runs."""
    from softswitch.pipeline import JobConfig, SoftSwitch
    from softswitch.server import SoftSwitchServer

    ctx = spawn_context()
    server = SoftSwitchServer(SoftSwitch(seed=0)).start()
    procs: list[Any] = []
    conns: list[Connection] = []
    try:
        with tempfile.TemporaryDirectory(prefix="lta-stragglers-") as tmp:
            store = str(Path(tmp) / "store")
            for rank in range(spec.workers):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=_worker_main,
                    args=(asdict(spec), rank, server.address, store, child),
                    name=f"stragglers-worker-{rank}",
                    daemon=True,
                )
                p.start()
                procs.append(p)
                conns.append(parent)
            progress(f"starting {spec.workers} workers")
            addresses = [tuple(_receive(c, "address", START_TIMEOUT_S)) for c in conns]
            server.switch.add_job(
                JobConfig(JOB_ID, addresses, elems_per_packet=ELEMS_PER_PACKET)  # type: ignore[arg-type]
            )
            for c in conns:
                c.send("go")
            progress(f"training {len(spec.seeds)} seed(s) x (baseline, dropcompute), {spec.steps} steps each")
            budget = START_TIMEOUT_S + len(spec.seeds) * 2 * spec.steps * _step_bound_s(spec) * 1.5
            return [_receive(c, "done", budget) for c in conns]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        server.stop()


def _step_bound_s(spec: Spec) -> float:
    """A generous bound on one step: every micro-batch at its slowest, plus a second of communication."""
    factor = spec.straggle_factor * (spec.straggle_factor if spec.slow_host is not None else 1.0)
    noise = 6.5 if spec.lognormal else 1.0
    return spec.micro_batches * spec.micro_batch_s * factor * noise + 1.0


def _receive(conn: Connection, kind: str, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"a worker sent no {kind!r} within {timeout_s:.0f} s")
    what, payload = conn.recv()
    if what == "error":
        raise RuntimeError(payload)
    if what != kind:
        raise RuntimeError(f"a worker sent {what!r} where {kind!r} was expected")
    return payload


# ---- the numbers -------------------------------------------------------------------------------------
def _per_step(runs: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step time (the slowest rank's), global samples and global micro-batches per step."""
    t = slowest_rank([r["iteration_s"] for r in runs])
    samples = np.sum(np.array([r["samples"] for r in runs]), axis=0)
    mbs = np.sum(np.array([r["micro_batches"] for r in runs]), axis=0)
    return t, samples, mbs


def _system(t: np.ndarray, samples: np.ndarray, serial: np.ndarray) -> dict[str, float]:
    return time_stats(t, ("p50", "mean", "p99"), prefix="step_") | {
        "samples_per_s": float(samples.sum() / t.sum()),
        **time_stats(serial, ("p50",), prefix="serial_"),
    }


def _serial(runs: list[dict[str, Any]]) -> np.ndarray:
    """Per step, T^c as Algorithm 2 measures it: the smallest over the workers of step time minus
    compute time (the last worker to reach the reduce waits for no one)."""
    it = np.array([r["iteration_s"] for r in runs])
    return np.min(it - np.array([r["compute_s"] for r in runs]), axis=0)


def speedup_ceiling(spec: Spec, seed: int, steps: range) -> float:
    """The step-time speedup of a perfect DropCompute on these stragglers: tau = M x the base time
    exactly (no micro-batch that did not straggle is dropped), no communication and no compute outside
    the emulated sleeps. Mean slowest-worker step over mean M x base."""
    emulator = StragglerEmulator(
        StragglerModel(
            base_s=1.0,
            prob=spec.straggle_prob,
            factor=spec.straggle_factor,
            slow_host=spec.slow_host,
            lognormal=spec.lognormal,
            seed=seed,
        )
    )
    slowest = [
        max(sum(emulator.multiplier(w, i, m) for m in range(spec.micro_batches)) for w in range(spec.workers))
        for i in steps
    ]
    return float(np.mean(slowest)) / spec.micro_batches


def summarize(spec: Spec, ranks: list[list[dict[str, Any]]]) -> dict[str, Any]:
    by_run: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for runs in ranks:
        for r in runs:
            by_run.setdefault((r["seed"], r["mode"]), []).append(r)
    window = slice(spec.warmup, spec.steps)  # after the warm-up: the same steps, the same stragglers
    full_mbs = spec.workers * spec.micro_batches
    per_seed = []
    for seed in spec.seeds:
        base, dc = by_run[(seed, "baseline")], by_run[(seed, "dropcompute")]
        bt, bs, _ = _per_step(base)
        dt, ds, dm = _per_step(dc)
        b_win = _system(bt[window], bs[window], _serial(base)[window])
        d_win = _system(dt[window], ds[window], _serial(dc)[window])
        choice = dc[0]["choice"]
        if any(r["choice"] != choice for r in dc):
            raise RuntimeError(
                f"seed {seed}: the workers chose different thresholds (Algorithm 2 must agree)"
            )
        win_mbs = dm[window]
        # Stragglers as drawn (the emulator's own record): the share of micro-batches that were slowed.
        row = {
            "seed": seed,
            "tau_s": None if choice is None or math.isinf(choice["tau_s"]) else choice["tau_s"],
            "s_eff_predicted": None if choice is None else choice["s_eff"],
            "step_speedup_predicted": None if choice is None else choice["step_speedup"],
            "dropped_fraction_predicted": None if choice is None else choice["dropped_fraction"],
            "s_eff_measured": d_win["samples_per_s"] / b_win["samples_per_s"],
            "speedup": b_win["step_mean_ms"] / d_win["step_mean_ms"],
            "speedup_p50": b_win["step_p50_ms"] / d_win["step_p50_ms"],
            "speedup_ceiling": speedup_ceiling(spec, seed, range(spec.warmup, spec.steps)),
            "dropped_fraction": float(1.0 - win_mbs.sum() / (full_mbs * len(win_mbs))),
            "dropped_fraction_all_steps": float(1.0 - dm.sum() / (full_mbs * len(dm))),
            "baseline": {
                **b_win,
                "final_loss": base[0]["final_loss"],
                "samples": int(bs.sum()),
                "steps": len(bt),
            },
            "dropcompute": {
                **d_win,
                "final_loss": dc[0]["final_loss"],
                "loss_at_equal_steps": dc[0]["equal_steps_loss"],
                "samples": int(ds.sum()),
                "steps": len(dt),
                "extra_steps": dc[0]["extra_steps"],
                "exchange_ms": 1e3 * max(r["exchange_s"] for r in dc),
                "samples_per_s_all_steps": float(ds.sum() / dt.sum()),
            },
            "baseline_samples_per_s_all_steps": float(bs.sum() / bt.sum()),
            "final_loss_replicas_agree": len({r["final_loss"] for r in base}) == 1
            and len({r["final_loss"] for r in dc}) == 1,
        }
        per_seed.append(row)

    def mean_of(key: str, where: str | None = None) -> float | None:
        values = [(r[where][key] if where else r[key]) for r in per_seed]
        if any(v is None for v in values):
            return None
        return float(np.mean(values))

    base_loss = seed_summary([r["baseline"]["final_loss"] for r in per_seed])
    dc_loss = seed_summary([r["dropcompute"]["final_loss"] for r in per_seed])
    within = None
    if len(per_seed) > 1 and base_loss["mean"] is not None and dc_loss["mean"] is not None:
        within = abs(dc_loss["mean"] - base_loss["mean"]) <= SPREAD_SIGMAS * base_loss["std"]
    s_pred, s_meas = mean_of("s_eff_predicted"), mean_of("s_eff_measured")
    rel_err = None if s_pred is None or s_meas is None else abs(s_pred - s_meas) / s_meas
    speedup, dropped = mean_of("speedup"), mean_of("dropped_fraction")
    ceiling = mean_of("speedup_ceiling")
    assert speedup is not None and dropped is not None
    taus = [r["tau_s"] for r in per_seed]
    return {
        "config": {
            **{k: v for k, v in asdict(spec).items() if k not in ("micro_batch_s",)},
            "micro_batch_ms": spec.micro_batch_s * 1e3,
            "model": f"tanh MLP {spec.d_in}-{spec.hidden}-{spec.classes}",
            "samples_per_step": spec.workers * spec.micro_batches * spec.batch,
            "measured_window": f"steps {spec.warmup}..{spec.steps - 1} (after the warm-up)",
            "speedup": "baseline mean step time / dropcompute mean step time, same steps",
            "speedup_ceiling": "the same ratio for tau = M x base time, no communication, no overhead: "
            "the most DropCompute gives without dropping micro-batches that did not straggle",
            "s_eff_measured": "dropcompute samples/s / baseline samples/s, same steps",
            "spread": f"{SPREAD_SIGMAS:g} x baseline std over seeds",
        },
        "baseline": {
            "step_p50_ms": mean_of("step_p50_ms", "baseline"),
            "step_mean_ms": mean_of("step_mean_ms", "baseline"),
            "step_p99_ms": mean_of("step_p99_ms", "baseline"),
            "samples_per_s": mean_of("samples_per_s", "baseline"),
            "serial_p50_ms": mean_of("serial_p50_ms", "baseline"),
            "final_loss": base_loss["mean"],
            "final_loss_seeds": base_loss,
        },
        "dropcompute": {
            "step_p50_ms": mean_of("step_p50_ms", "dropcompute"),
            "step_mean_ms": mean_of("step_mean_ms", "dropcompute"),
            "step_p99_ms": mean_of("step_p99_ms", "dropcompute"),
            "samples_per_s": mean_of("samples_per_s", "dropcompute"),
            "serial_p50_ms": mean_of("serial_p50_ms", "dropcompute"),
            "final_loss": dc_loss["mean"],
            "final_loss_seeds": dc_loss,
            "tau_s": None if any(t is None for t in taus) else float(np.mean(taus)),  # type: ignore[arg-type]
            "dropped_fraction": dropped,
            "dropped_fraction_predicted": mean_of("dropped_fraction_predicted"),
        },
        "speedup": speedup,
        "speedup_ceiling": ceiling,
        "s_eff_predicted": s_pred,
        "s_eff_measured": s_meas,
        "s_eff_relative_error": rel_err,
        "final_loss_within_spread": within,
        "targets": {
            "speedup_at_least": TARGETS["speedup"],
            "speedup_met": speedup >= TARGETS["speedup"],
            "dropped_at_most": TARGETS["dropped_fraction"],
            "dropped_met": dropped <= TARGETS["dropped_fraction"],
            "s_eff_error_at_most": TARGETS["s_eff_relative_error"],
            "s_eff_met": None if rel_err is None else rel_err <= TARGETS["s_eff_relative_error"],
            "loss_within_spread_met": within,
        },
        "per_seed": per_seed,
    }


def bench_stragglers(spec: Spec, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = progress or (lambda text: None)
    return summarize(spec, run_workers(spec, say))


# ---- command line ----------------------------------------------------------------------------------
def register(sub: argparse._SubParsersAction) -> None:
    p = bench_command(
        sub,
        "stragglers",
        _run,
        help="DropCompute (compute threshold) against waiting for all micro-batches, under stragglers",
        description="Synchronous training with gradient accumulation under emulated compute stragglers: "
        "waiting for every micro-batch against DropCompute with its automatic threshold (Algorithm 2), "
        "same seeds, through a softswitch on loopback. Reports step times, samples/s, the speedup, the "
        "predicted and measured effective speedup, dropped micro-batches and the final loss.",
    )
    add_workers(p, 4, "workers", type=argtypes.int_range(2, MAX_WORKERS, "worker count"))
    p.add_argument(
        "--micro-batches", type=argtypes.int_range(1, 1024, "micro-batches"), default=8, help="M per step"
    )
    add_batch(p, 8, "samples per micro-batch")
    p.add_argument(
        "--micro-batch-ms",
        type=argtypes.float_range(0.0, low_open=True, what="micro-batch time"),
        default=None,
        help=f"emulated base compute time of one micro-batch (default {FULL['micro_batch_ms']:g}, "
        f"--quick {QUICK['micro_batch_ms']:g})",
    )
    p.add_argument(
        "--straggle-prob", type=argtypes.probability, default=0.04, help="q: chance a micro-batch straggles"
    )
    p.add_argument(
        "--straggle-factor",
        type=argtypes.float_range(1.0, 100.0, what="straggle factor"),
        default=3.0,
        help="k: a straggling micro-batch takes k times its base time",
    )
    p.add_argument(
        "--slow-host",
        type=argtypes.nonnegative_int,
        default=None,
        help="this worker is always k times slower (one slow host)",
    )
    p.add_argument(
        "--lognormal-noise",
        action="store_true",
        help="add the paper's bounded log-normal compute noise (appendix B.1) to every micro-batch",
    )
    add_steps(p, None, f"steps per run (default {FULL['steps']}, --quick {QUICK['steps']})")
    p.add_argument(
        "--warmup",
        type=argtypes.positive_int,
        default=None,
        help=f"I: warm-up steps before tau* (default {FULL['warmup']}, --quick {QUICK['warmup']})",
    )
    add_seeds(
        p, None, f"seeds 0..N-1, each run by both systems (default {FULL['seeds']}, --quick {QUICK['seeds']})"
    )
    add_lr(p, 0.05, "SGD learning rate")
    add_momentum(p, 0.9)
    p.add_argument(
        "--max-drop",
        type=argtypes.float_range(0.0, 0.99, what="drop cap"),
        default=None,
        help="cap on the dropped share Algorithm 2 may predict (default: none, the paper's argmax)",
    )
    p.add_argument("--quick", action="store_true", help="a small, fast run (for tests)")


def spec_from_args(args: argparse.Namespace) -> Spec:
    sizes = QUICK if args.quick else FULL

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return sizes[name] if value is None else value

    steps, warmup = pick("steps"), pick("warmup")
    if warmup >= steps:
        raise UsageError(
            f"--warmup ({warmup}) must be below --steps ({steps}): DropCompute needs steps after it"
        )
    if args.slow_host is not None and args.slow_host >= args.workers:
        raise UsageError(f"--slow-host {args.slow_host} is not a worker: ids are 0..{args.workers - 1}")
    return Spec(
        workers=args.workers,
        micro_batches=args.micro_batches,
        batch=args.batch,
        micro_batch_s=pick("micro_batch_ms") / 1000.0,
        straggle_prob=args.straggle_prob,
        straggle_factor=args.straggle_factor,
        slow_host=args.slow_host,
        lognormal=args.lognormal_noise,
        steps=steps,
        warmup=warmup,
        seeds=list(range(pick("seeds"))),
        lr=args.lr,
        momentum=args.momentum,
        max_drop=args.max_drop,
    )


def _run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    title = (
        f"lta bench stragglers: {spec.workers} workers, M={spec.micro_batches}, q={spec.straggle_prob:g} "
        f"at {spec.straggle_factor:g}x, {spec.steps} steps, {len(spec.seeds)} seed(s)"
    )
    with Status(title) as status:
        out = bench_stragglers(spec, status.update)

    def table() -> Iterator[str]:
        b, d = out["baseline"], out["dropcompute"]
        yield f"{'system':12s} {'p50 ms':>8s} {'mean ms':>8s} {'samples/s':>10s} {'final loss':>10s}"
        for name, s in (("baseline", b), ("dropcompute", d)):
            yield (
                f"{name:12s} {s['step_p50_ms']:8.1f} {s['step_mean_ms']:8.1f} {s['samples_per_s']:10.1f} "
                f"{s['final_loss']:10.4f}"
            )
        tau = "none" if d["tau_s"] is None else f"{d['tau_s'] * 1e3:.1f} ms"
        pred = "-" if out["s_eff_predicted"] is None else f"{out['s_eff_predicted']:.3f}"
        yield (
            f"tau* {tau}, dropped {d['dropped_fraction']:.1%}, speedup {out['speedup']:.3f}, "
            f"S_eff predicted {pred}, measured {out['s_eff_measured']:.3f}"
        )

    return report(args.json, SCHEMA, out, table)
