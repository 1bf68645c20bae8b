"""``lta bench``: lta against torch.distributed gloo, measured in the same run on the same machine.

busbw follows nccl-tests: ``algbw = bytes / time`` and ``busbw = algbw · 2(N-1)/N`` (the ring
allreduce factor) for both systems, so ``ratio_busbw`` is simply gloo's mean time over lta's. With
in-network aggregation each worker moves only ``bytes`` each way, so lta's busbw by that factor
overstates its link use for N > 2; we keep one factor so the two numbers compare.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import numpy as np

from hostlib import bench_lossy, bench_lossy_train
from hostlib.dropmodels import DropPolicy
from hostlib.launch import JobSpec, run_job
from hostlib.transport import LtaWorker, TransportConfig


def lta_bench_worker(worker: LtaWorker, rank: int, n_values: int, iters: int, warmup: int) -> dict:
    x = np.random.default_rng(rank).standard_normal(n_values).astype(np.float32)
    for i in range(warmup):
        worker.allreduce(x, step=i)
    times = []
    counts = []
    for i in range(iters):
        t0 = time.perf_counter()
        r = worker.allreduce(x, step=warmup + i)
        times.append(time.perf_counter() - t0)
        counts.append(float(r.count.mean()))
    return {"times_s": times, "mean_count": float(np.mean(counts)), "stats": worker.stats.as_dict()}


def gloo_bench_worker(rank: int, n: int, port: int, n_values: int, iters: int, warmup: int, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    x = torch.from_numpy(np.random.default_rng(rank).standard_normal(n_values).astype(np.float32))
    for _ in range(warmup):
        dist.all_reduce(x.clone())
    times = []
    for _ in range(iters):
        y = x.clone()
        t0 = time.perf_counter()
        dist.all_reduce(y)
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    queue.put((rank, times))


def run_gloo(n: int, n_values: int, iters: int, warmup: int) -> list[float]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:  # a free port for the TCP store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=gloo_bench_worker, args=(r, n, port, n_values, iters, warmup, queue))
        for r in range(n)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in range(n))
    for p in procs:
        p.join(timeout=30)
    # An allreduce is over when the slowest rank is done.
    return list(np.max(np.array([results[r] for r in range(n)]), axis=0))


def summarize(times_s: list[float], n_bytes: int, n: int) -> dict:
    t = np.array(times_s)
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    return {
        "busbw_gbps": n_bytes / t.mean() * factor * 8 / 1e9,
        "algbw_gbps": n_bytes / t.mean() * 8 / 1e9,
        "mean_ms": float(t.mean() * 1e3),
        "p50_ms": float(np.percentile(t, 50) * 1e3),
        "p99_ms": float(np.percentile(t, 99) * 1e3),
    }


def bench_allreduce(args: argparse.Namespace) -> dict:
    n, n_values = args.workers, int(args.mib * (1 << 20) / 4)
    n_bytes = 4 * n_values
    transport = TransportConfig(elems_per_packet=args.elems_per_packet, seed=0)
    spec = JobSpec(n_workers=n, transport=transport, drop={"up": DropPolicy(p=args.loss)})
    lta_results, switch = run_job(spec, lta_bench_worker, n_values, args.iters, args.warmup)
    lta_times = list(np.max(np.array([r["times_s"] for r in lta_results]), axis=0))
    gloo_times = run_gloo(n, n_values, args.iters, args.warmup)
    lta, gloo = summarize(lta_times, n_bytes, n), summarize(gloo_times, n_bytes, n)
    lta["mean_count"] = float(np.mean([r["mean_count"] for r in lta_results]))
    lta["flushes_per_reduce"] = lta_results[0]["stats"]["flushes_sent"] / (args.iters + args.warmup)
    return {
        "config": {
            "workers": n,
            "mib": args.mib,
            "loss": args.loss,
            "elems_per_packet": args.elems_per_packet,
            "iters": args.iters,
            "busbw_factor": "2(N-1)/N for both",
        },
        "lta": lta,
        "gloo": gloo,
        "ratio_busbw": lta["busbw_gbps"] / gloo["busbw_gbps"],
    }


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


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: lta against gloo, measured in the same run")
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    a = sub.add_parser("allreduce", help="allreduce time and busbw on loopback, lta (softswitch) vs gloo")
    a.add_argument("--workers", type=int, default=2)
    a.add_argument("--mib", type=float, default=4.0)
    a.add_argument("--loss", type=float, default=0.0, help="softswitch drop probability of GRAD packets")
    a.add_argument("--iters", type=int, default=20)
    a.add_argument("--warmup", type=int, default=3)
    a.add_argument(
        "--elems-per-packet",
        type=int,
        default=64,
        help="K; 64 is the P4 wire default, up to 16367 fits one loopback datagram",
    )
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=_run_allreduce)
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
    bench_lossy.register(sub)
    bench_lossy_train.register(sub)


def _run_allreduce(args: argparse.Namespace) -> int:
    out = bench_allreduce(args)
    if args.json:
        print(json.dumps(out))
    else:
        for system in ("lta", "gloo"):
            s = out[system]
            print(
                f"{system:5s} busbw {s['busbw_gbps']:.3f} Gbit/s  "
                f"p50 {s['p50_ms']:.1f} ms  p99 {s['p99_ms']:.1f} ms"
            )
        print(f"ratio_busbw (lta/gloo) {out['ratio_busbw']:.3f}")
    return 0


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
