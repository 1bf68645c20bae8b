"""``lta demo``: N worker processes reduce tensors through a softswitch on loopback, with loss.

Every worker can regenerate every other worker's (seeded) input, so each one checks its own results:
every chunk must equal the exact mean over the workers in its bitmap, within the codec's bound.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hostlib import argtypes
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.errors import UsageError
from hostlib.protocol import MAX_ELEMS_PER_PACKET, MAX_LEAVES
from hostlib.transport import LtaWorker, TransportConfig
from hostlib.verify import check_result, seeded_input, slack_bits
from lta.jsonout import emit
from lta.launch import JobSpec, leaf_ids, report_progress, run_job
from lta.progress import Status

SCHEMA = "lta.demo/1"


def demo_worker(worker: LtaWorker, rank: int, n_values: int, rounds: int, seed: int) -> dict:
    worst, checked = 0.0, 0
    for step in range(rounds):
        result = worker.allreduce(seeded_input(seed, step, rank, n_values), step=step)
        inputs = np.stack([seeded_input(seed, step, r, n_values) for r in range(worker.n_workers)])
        slack = slack_bits(worker.config)
        n_checked, err = check_result(result, inputs, worker.config.elems_per_packet, slack=slack)
        checked += n_checked
        worst = max(worst, err)
        report_progress(step + 1, rounds)
    return {"stats": worker.stats.as_dict(), "checked_chunks": checked, "worst_error_over_bound": worst}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="N workers reduce through a lossy softswitch; results verified",
        description="N worker processes reduce seeded tensors through a softswitch on loopback that "
        "drops packets; every worker checks each chunk against the exact mean over the workers the "
        "switch counted.",
    )
    p.add_argument("--workers", type=argtypes.workers, default=4, help="worker processes, 1..64")
    p.add_argument(
        "--leaves",
        type=argtypes.int_range(0, MAX_LEAVES, "leaves"),
        default=0,
        help="0: one switch; L > 0: a leaf-spine tree of L leaf softswitches (the workers in contiguous "
        "blocks) and a spine, --loss and --down-loss on both levels (docs/protocol.md, 'Hierarchy')",
    )
    p.add_argument(
        "--own-leaf",
        action="store_true",
        help="with --leaves L: a worker alone in its block has no leaf switch and joins the spine as its "
        "own leaf (docs/protocol.md, 'A worker as its own leaf')",
    )
    p.add_argument(
        "--mib",
        type=argtypes.float_range(0.0, low_open=True, what="MiB"),
        default=1.0,
        help="tensor size per reduce, MiB of float32 (> 0)",
    )
    p.add_argument("--rounds", type=argtypes.positive_int, default=10, help="reduces per worker")
    p.add_argument(
        "--loss",
        type=argtypes.loss_below_one,
        default=0.1,
        help="drop probability of GRAD packets (up), [0, 1)",
    )
    p.add_argument(
        "--down-loss",
        type=argtypes.loss_below_one,
        default=0.0,
        help="drop probability of RESULT replicas, [0, 1)",
    )
    p.add_argument(
        "--fallback",
        choices=["prev", "zero", "local"],
        default="prev",
        help="what a chunk that no worker's GRAD reached becomes",
    )
    p.add_argument(
        "--elems-per-packet",
        type=argtypes.int_range(1, MAX_ELEMS_PER_PACKET, "elements per packet"),
        default=64,
        help=f"K: float32 values per packet, 1..{MAX_ELEMS_PER_PACKET}",
    )
    p.add_argument("--seed", type=argtypes.nonnegative_int, default=0, help="seed of inputs and drops")
    p.add_argument(
        "--netns",
        action="store_true",
        help="with --leaves L: the tree in network namespaces (root), each switch a softswitch process in "
        "its own, --loss/--down-loss dropped by the kernel (nftables) on every worker link and leaf uplink",
    )
    p.add_argument(
        "--netns-prefix",
        type=_netns_prefix,
        default="lta",
        help="--netns: the namespaces' names start with it (default lta)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.set_defaults(func=run)


def memory_needed(workers: int, n_values: int) -> int:
    """Bytes the demo holds at once, about: every worker regenerates every worker's input to check its
    result (``workers`` arrays), beside its own input, result and transport buffers (4 more)."""
    return workers * (workers + 4) * n_values * 4


def memory_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(workers: int, mib: float, n_values: int) -> None:
    """Refuse, before any process starts, a size this machine cannot hold (one line, not a MemoryError
    in every worker)."""
    need, have = memory_needed(workers, n_values), memory_available()
    if have is not None and need > have:
        gib = 1 << 30
        raise UsageError(
            f"--mib {mib:g} with {workers} workers needs about {need / gib:.1f} GiB (each worker checks "
            f"every worker's input) and {have / gib:.1f} GiB is available: lower --mib or --workers"
        )


def run(args: argparse.Namespace) -> int:
    n_values = max(1, int(args.mib * (1 << 20) / 4))
    check_fits(args.workers, args.mib, n_values)
    if args.leaves > args.workers:
        raise UsageError(
            f"--leaves {args.leaves} is more than --workers {args.workers}: every leaf needs a worker"
        )
    if args.own_leaf and not args.leaves:
        raise UsageError("--own-leaf is for a leaf-spine tree: give --leaves L")
    if args.netns:
        return _run_netns(args, n_values)
    drop = {"up": DropPolicy(p=args.loss), "down": DropPolicy(p=args.down_loss)}
    spec = JobSpec(
        n_workers=args.workers,
        transport=TransportConfig(
            elems_per_packet=args.elems_per_packet,
            fallback=args.fallback,
            seed=args.seed,
            own_leaf=args.own_leaf,
        ),
        drop=drop,
        switch_seed=args.seed,
        leaves=args.leaves,
        spine_drop=drop,
    )
    tree = f" behind {args.leaves} leaves and a spine" if args.leaves else ""
    title = (
        f"lta demo: {args.workers} workers{tree}, {args.mib:g} MiB x {args.rounds} rounds, "
        f"up loss {args.loss:.0%}, down loss {args.down_loss:.0%}, fallback {args.fallback}"
    )
    t0 = time.perf_counter()
    with Status(title) as status:
        status.update(f"starting {args.workers} worker processes")

        def progress(rank: int, done: int, total: int) -> None:
            if rank == 0:
                status.update(f"round {done}/{total} done (worker 0)")

        switches: list = []
        results, switch = run_job(
            spec, demo_worker, n_values, args.rounds, args.seed, on_progress=progress, switches=switches
        )
    wall = time.perf_counter() - t0
    counters = switch.read_counters(spec.job_id)
    leaves = {j: sw.read_counters(spec.job_id) for j, sw in zip(leaf_ids(spec), switches[:-1], strict=True)}
    ok = all(r["worst_error_over_bound"] < 1.0 for r in results)
    if args.json:
        doc = {"workers": results, "switch": counters, "wall_s": wall, "exact": ok}
        if args.leaves:
            doc["leaves"] = list(leaves.values())
            doc["leaf_ids"] = list(leaves)
        emit(SCHEMA, doc)
        return 0 if ok else 1
    _print_tables(args, results, counters, wall, ok, leaves)
    return 0 if ok else 1


def _netns_prefix(text: str) -> str:
    if not text.isalnum() or len(text) > 8:
        raise argparse.ArgumentTypeError(f"a prefix is 1..8 letters or digits, got {text!r}")
    return text


def _run_netns(args: argparse.Namespace, n_values: int) -> int:
    """``--netns``: the tree in network namespaces (lta/tree_netns.py)."""
    from lta.bench.netns_harness import require_root_or_say
    from lta.tree_netns import TreeDemoConfig, format_report, run_tree_demo

    if not args.leaves:
        raise UsageError("--netns builds a leaf-spine tree: give --leaves L (one switch: lta mininet)")
    if args.own_leaf:
        raise UsageError("--netns gives every leaf a switch: drop --own-leaf")
    if args.elems_per_packet != 64 or args.fallback != "prev":
        raise UsageError(
            "--netns runs the workers with the transport's defaults: drop --elems-per-packet/--fallback"
        )
    require_root_or_say("lta demo --netns")
    config = TreeDemoConfig(
        workers=args.workers, leaves=args.leaves, loss=args.loss, down_loss=args.down_loss, elems=n_values,
        rounds=args.rounds, seed=args.seed, prefix=args.netns_prefix,
    )  # fmt: skip
    with Status(f"lta demo --netns: {args.workers} workers, {args.leaves} leaves") as status:
        report = run_tree_demo(config, status.update)
    if args.json:
        emit(SCHEMA, report.as_dict())
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def _print_tables(args, results, counters, wall, ok, leaves) -> None:
    from rich.console import Console
    from rich.table import Table

    # 12 columns, 122 characters: a narrower console (a pipe's 80) would fold the headers ("max err/bound")
    console = Console(width=max(Console().width, 130))
    tree = f" behind {args.leaves} leaves and a spine (loss on both levels)" if args.leaves else ""
    console.print(
        f"[bold]lta demo[/]: {args.workers} workers{tree}, {args.mib} MiB x {args.rounds} rounds, "
        f"up loss {args.loss:.0%}, down loss {args.down_loss:.0%}, fallback {args.fallback}"
    )
    table = Table()
    for header in (
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
    ):
        table.add_column(header, no_wrap=True)
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
    for j, leaf in leaves.items():
        shown = {k: v for k, v in leaf.items() if v}
        console.print(
            f"leaf {j} counters: " + ", ".join(f"{k}={v}" for k, v in shown.items()), soft_wrap=True
        )
    shown = {k: v for k, v in counters.items() if v}
    name = "spine" if args.leaves else "switch"
    console.print(f"{name} counters: " + ", ".join(f"{k}={v}" for k, v in shown.items()), soft_wrap=True)
    verdict = (
        "[green]every chunk equals the mean over its bitmap (within the codec bound)[/]"
        if ok
        else "[red]some chunk differs from the mean over its bitmap by more than the codec bound[/]"
    )
    console.print(f"{verdict}; wall time {wall:.1f} s")
