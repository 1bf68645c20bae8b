"""``lta bench ddp``: what a user of stock DDP sees. The same unchanged training step (an MLP of about
4.1M parameters, torch's DistributedDataParallel with its default buckets) on N ranks on loopback, once
with ``init_process_group("gloo")`` and once with ``init_process_group("lta")`` with the defaults (no
``LTA_*`` variables: rank 0 hosts the softswitch, packet size from the path), in the same run. Reports
step-time percentiles, each rank's process CPU per step (rank 0's includes the softswitch it hosts) and
the lta/gloo ratios of both.

``--rounds R`` runs the pair R times, gloo first in odd rounds and lta first in even ones, fresh processes
each time: this machine's speed drifts by 10% and more between runs a minute apart, so one pair's ratio
moved between 1.1 and 1.8 for the same code. Each round's ratio is reported, with their median
(``ratio_lta_over_gloo_p50_median``: two runs seconds apart see the same machine); the per-backend figures
pool every round's steps."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from hostlib import argtypes
from hostlib.errors import LtaError
from lta.bench.flags import add_steps, add_warmup, add_workers, bench_command
from lta.bench.ranks import raise_rank_errors, run_ranks
from lta.bench.summary import median_known, pool_runs, ratio, report, slowest_rank, time_stats
from lta.progress import Status

SCHEMA = "lta.bench.ddp/2"  # /2: --rounds (the figures pool every round; rounds, the median)

WIDTH, IN_FEATURES = 1024, 1024  # 1024 -> 4 x 1024 -> 10: 4.2M parameters


def ddp_worker(backend: str, rank: int, world: int, port: int, steps: int, warmup: int, queue: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in [v for v in os.environ if v.startswith("LTA_")]:
        del os.environ[name]  # "the defaults": nothing configured
    try:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        if backend == "lta":
            from hostlib.torch_ext import register_backend

            register_backend()

        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Linear(IN_FEATURES, WIDTH), torch.nn.ReLU()]
        for _ in range(3):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        x, y = torch.randn(32, IN_FEATURES, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        times, losses = [], []
        cpu0 = os.times()
        for i in range(warmup + steps):
            if i == warmup:
                cpu0 = os.times()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        cpu1 = os.times()  # the process's CPU: every thread, rank 0's softswitch thread included
        cpu_ms = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / steps * 1e3
        params = sum(p.numel() for p in model.parameters())
        dist.destroy_process_group()
        queue.put(
            (
                rank,
                {
                    "times_s": times,
                    "cpu_ms_per_step": cpu_ms,
                    "first_loss": losses[0],
                    "last_loss": losses[-1],
                    "params": params,
                },
            )
        )
    except LtaError as exc:  # a user error (e.g. a health check): the parent says it in one line
        queue.put((rank, {"error": str(exc), "user_error": True}))
    except BaseException as exc:  # reported by the parent as one line
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def run_backend(backend: str, world: int, steps: int, warmup: int, timeout_s: float = 600.0) -> dict:
    results = run_ranks(
        world, ddp_worker, lambda r, port, q: (backend, r, world, port, steps, warmup, q), timeout_s
    )
    raise_rank_errors(backend, results)
    step = slowest_rank([results[r]["times_s"] for r in range(world)])
    return {
        **time_stats(step),
        # CPU seconds of each rank's process per timed step (os.times(), 10 ms ticks: read it over 50+ steps)
        "cpu_ms_per_step": [results[r]["cpu_ms_per_step"] for r in range(world)],
        "first_loss": results[0]["first_loss"],
        "last_loss": results[0]["last_loss"],
        "params": results[0]["params"],
        "steps_s": step.tolist(),  # (pooled over rounds by combine_rounds, then dropped)
    }


def combine_rounds(rounds: Sequence[dict[str, dict]]) -> dict[str, Any]:
    """The report of R rounds (each ``{backend: run_backend's dict}``): per backend, the step-time stats of
    every round's steps pooled and each rank's CPU per step averaged over the rounds (losses: the first
    round's); per round, both p50s and their ratio; the median of those ratios."""
    out: dict[str, Any] = {backend: pool_runs([r[backend] for r in rounds]) for backend in ("gloo", "lta")}
    per_round = [
        {"gloo_p50_ms": r["gloo"]["p50_ms"], "lta_p50_ms": r["lta"]["p50_ms"],
         "ratio_p50": ratio(r["lta"]["p50_ms"], r["gloo"]["p50_ms"])}
        for r in rounds
    ]  # fmt: skip
    out["rounds"] = per_round
    out["ratio_lta_over_gloo_p50"] = ratio(out["lta"]["p50_ms"], out["gloo"]["p50_ms"])
    out["ratio_lta_over_gloo_p50_median"] = median_known(r["ratio_p50"] for r in per_round)
    out["ratio_lta_over_gloo_cpu"] = ratio(
        sum(out["lta"]["cpu_ms_per_step"]), sum(out["gloo"]["cpu_ms_per_step"])
    )
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_command(
        sub,
        "ddp",
        _run,
        help="stock DDP step time: init_process_group('lta') with the defaults vs 'gloo', same run",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_workers(p, 2, "ranks (processes), 1..64")
    add_steps(p, 50, "timed training steps per backend and round")
    add_warmup(p, 5, "untimed steps first")
    p.add_argument(
        "--rounds",
        type=argtypes.positive_int,
        default=3,
        help="runs of the pair, gloo first in odd rounds, lta first in even ones (the machine drifts)",
    )


def _run(args: argparse.Namespace) -> int:
    config = {"workers": args.workers, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
    title = f"lta bench ddp: {args.workers} ranks, {args.rounds} rounds of {args.steps} timed steps a backend"
    rounds = []
    with Status(title) as status:
        for i in range(args.rounds):
            got = {}
            for backend in ("gloo", "lta") if i % 2 == 0 else ("lta", "gloo"):
                status.update(f"round {i + 1}/{args.rounds}, {backend}: {args.warmup} + {args.steps} steps")
                got[backend] = run_backend(backend, args.workers, args.steps, args.warmup)
            rounds.append(got)
    out: dict[str, Any] = {"config": config, **combine_rounds(rounds)}

    def table() -> Iterator[str]:
        yield (
            f"stock DDP, {args.workers} ranks, {out['gloo']['params']:,} parameters, "
            f"{args.rounds} x {args.steps} steps a backend"
        )
        for backend in ("gloo", "lta"):
            r = out[backend]
            cpu = ", ".join(f"{c:.1f}" for c in r["cpu_ms_per_step"])
            yield (
                f"  {backend:5s} step p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  "
                f"CPU/step per rank {cpu} ms  loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}"
            )
        p50, cpu = out["ratio_lta_over_gloo_p50"], out["ratio_lta_over_gloo_cpu"]
        yield f"  lta/gloo step p50, every round's steps: {p50:.2f}" if p50 is not None else "  lta/gloo: n/a"
        each = ", ".join("n/a" if r["ratio_p50"] is None else f"{r['ratio_p50']:.2f}" for r in out["rounds"])
        median = out["ratio_lta_over_gloo_p50_median"]
        yield f"  lta/gloo step p50 by round: {each}" + ("" if median is None else f" (median {median:.2f})")
        yield f"  lta/gloo CPU per step, all ranks: {cpu:.2f}" if cpu is not None else "  lta/gloo CPU: n/a"

    return report(args.json, SCHEMA, out, table)
