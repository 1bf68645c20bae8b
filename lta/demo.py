"""``lta demo``: N worker processes reduce tensors through a softswitch on loopback, with loss.

Every worker can regenerate every other worker's (seeded) input, so each one checks its own results:
every chunk must equal the exact mean over the workers in its bitmap, within the codec's bound.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hostlib.dropmodels import DropPolicy
from hostlib.transport import LtaWorker, TransportConfig
from hostlib.verify import check_result, seeded_input
from lta.launch import JobSpec, run_job


def demo_worker(worker: LtaWorker, rank: int, n_values: int, rounds: int, seed: int) -> dict:
    worst, checked = 0.0, 0
    for step in range(rounds):
        result = worker.allreduce(seeded_input(seed, step, rank, n_values), step=step)
        inputs = np.stack([seeded_input(seed, step, r, n_values) for r in range(worker.n_workers)])
        n_checked, err = check_result(result, inputs, worker.config.elems_per_packet)
        checked += n_checked
        worst = max(worst, err)
    return {"stats": worker.stats.as_dict(), "checked_chunks": checked, "worst_error_over_bound": worst}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="N workers reduce through a lossy softswitch; results verified")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mib", type=float, default=1.0, help="tensor size per reduce, MiB of float32")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--loss", type=float, default=0.1, help="drop probability of GRAD packets (up)")
    p.add_argument("--down-loss", type=float, default=0.0, help="drop probability of RESULT replicas")
    p.add_argument("--fallback", choices=["prev", "zero", "local"], default="prev")
    p.add_argument("--elems-per-packet", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    n_values = max(1, int(args.mib * (1 << 20) / 4))
    spec = JobSpec(
        n_workers=args.workers,
        transport=TransportConfig(
            elems_per_packet=args.elems_per_packet, fallback=args.fallback, seed=args.seed
        ),
        drop={"up": DropPolicy(p=args.loss), "down": DropPolicy(p=args.down_loss)},
        switch_seed=args.seed,
    )
    t0 = time.perf_counter()
    results, switch = run_job(spec, demo_worker, n_values, args.rounds, args.seed)
    wall = time.perf_counter() - t0
    counters = switch.read_counters(spec.job_id)
    ok = all(r["worst_error_over_bound"] < 1.0 for r in results)
    if args.json:
        print(json.dumps({"workers": results, "switch": counters, "wall_s": wall, "exact": ok}))
        return 0 if ok else 1
    _print_tables(args, results, counters, wall, ok)
    return 0 if ok else 1


def _print_tables(args, results, counters, wall, ok) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    console.print(
        f"[bold]lta demo[/]: {args.workers} workers, {args.mib} MiB x {args.rounds} rounds, "
        f"up loss {args.loss:.0%}, down loss {args.down_loss:.0%}, fallback {args.fallback}"
    )
    table = Table(
        "worker",
        "chunks",
        "full",
        "partial",
        "count 0",
        "no result",
        "no exp.",
        "fallbacks",
        "flushes",
        "p50 ms",
        "p99 ms",
        "max err/bound",
    )
    for rank, r in enumerate(results):
        s = r["stats"]
        table.add_row(
            str(rank),
            str(s["chunks"]),
            str(s["chunks_full"]),
            str(s["chunks_partial"]),
            str(s["chunks_empty"]),
            str(s["chunks_no_result"]),
            str(s["chunks_no_exponent"]),
            str(s["fallback_prev"] + s["fallback_zero"] + s["fallback_local"]),
            str(s["flushes_sent"]),
            f"{s['reduce_ms']['p50']:.1f}",
            f"{s['reduce_ms']['p99']:.1f}",
            f"{r['worst_error_over_bound']:.2f}",
        )
    console.print(table)
    shown = {k: v for k, v in counters.items() if v}
    console.print("switch counters: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    verdict = (
        "[green]every chunk equals the mean over its bitmap (within the codec bound)[/]"
        if ok
        else "[red]some chunk differs from the mean over its bitmap by more than the codec bound[/]"
    )
    console.print(f"{verdict}; wall time {wall:.1f} s")
