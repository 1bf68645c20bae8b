"""``lta bench scaling``: the cost of a reduce against worker count and tensor size, with real worker
processes through the softswitch and, for worker counts one machine cannot run, the in-process drop
simulator."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hostlib.dropmodels import DropPolicy
from hostlib.transport import TransportConfig
from lta.bench.allreduce import lta_bench_worker
from lta.launch import JobSpec, run_job


def bench_scaling(args: argparse.Namespace) -> dict:
    """Cost of a reduce against workers and tensor size: real processes through the softswitch, and
    the in-process drop simulator for worker counts the machine cannot run as processes."""
    from hostlib.simulate import simulate_reduce

    rows = []
    sizes = [int(v) for v in args.kib.split(",")]
    for kib in sizes:
        n_values = kib * 256
        for n in [int(v) for v in args.workers.split(",") if v]:
            spec = JobSpec(
                n_workers=n,
                transport=TransportConfig(elems_per_packet=args.elems_per_packet),
                drop={"up": DropPolicy(p=args.loss)},
            )
            results, _ = run_job(spec, lta_bench_worker, n_values, args.iters, 1)
            t = float(np.median(np.max(np.array([r["times_s"] for r in results]), axis=0)))
            rows.append(_scaling_row("processes", n, kib, t, n_values))
        for n in [int(v) for v in args.sim_workers.split(",") if v]:
            x = np.random.default_rng(n).standard_normal((n, n_values)).astype(np.float32)
            times = []
            for i in range(args.iters):
                t0 = time.perf_counter()
                simulate_reduce(x, elems_per_packet=args.elems_per_packet, up=DropPolicy(p=args.loss), seed=i)
                times.append(time.perf_counter() - t0)
            t = float(np.median(times))
            rows.append(_scaling_row("simulator", n, kib, t, n_values))
    if args.plot:
        _plot_scaling(rows, args.plot)
    return {"config": vars(args) | {"func": None}, "rows": rows}


def _scaling_row(mode: str, n: int, kib: int, seconds: float, n_values: int) -> dict:
    return {
        "mode": mode,
        "workers": n,
        "kib": kib,
        "ms": seconds * 1e3,
        "ns_per_element": seconds / n_values * 1e9,
        "ns_per_contribution": seconds / (n * n_values) * 1e9,
    }


def _plot_scaling(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in (("processes", "o-"), ("simulator", "s--")):
        for kib in sorted({r["kib"] for r in rows}):
            pts = sorted(
                (r["workers"], r["ns_per_contribution"])
                for r in rows
                if r["mode"] == mode and r["kib"] == kib
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker, label=f"{mode}, {kib} KiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("time per contributed element (ns)")
    ax.set_title("lta reduce cost per element and worker")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def register(sub: argparse._SubParsersAction) -> None:
    sc = sub.add_parser(
        "scaling", help="reduce cost against workers (processes, then the simulator) and size"
    )
    sc.add_argument("--workers", default="2,4,8,16", help="worker counts run as real processes")
    sc.add_argument("--sim-workers", default="2,16,64,256,1024", help="worker counts run in the simulator")
    sc.add_argument("--kib", default="64,256", help="tensor sizes in KiB of float32")
    sc.add_argument("--loss", type=float, default=0.01)
    sc.add_argument("--iters", type=int, default=5)
    sc.add_argument("--elems-per-packet", type=int, default=64)
    sc.add_argument("--plot", default="scaling.png", help="PNG to write ('' for none)")
    sc.add_argument("--json", action="store_true")
    sc.set_defaults(func=_run_scaling)


def _run_scaling(args: argparse.Namespace) -> int:
    out = bench_scaling(args)
    if args.json:
        print(json.dumps(out, default=str))
        return 0
    print(f"{'mode':10s} {'workers':>7s} {'KiB':>6s} {'ms':>9s} {'ns/elem':>9s} {'ns/(elem*worker)':>17s}")
    for r in out["rows"]:
        print(
            f"{r['mode']:10s} {r['workers']:7d} {r['kib']:6d} {r['ms']:9.1f} {r['ns_per_element']:9.1f} "
            f"{r['ns_per_contribution']:17.2f}"
        )
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
