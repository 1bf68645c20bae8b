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

from hostlib.dropmodels import DropPolicy
from hostlib.transport import LtaWorker, TransportConfig
from lta.launch import JobSpec, run_job


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


def register(sub: argparse._SubParsersAction) -> None:
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
