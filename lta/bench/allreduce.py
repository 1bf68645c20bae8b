"""``lta bench allreduce``: lta against torch.distributed gloo and against the kernel's own limit, all
measured in the same run on the same machine.

Four measurements per (workers, MiB) pair:

``lta``
    N worker processes reduce through a softswitch on loopback (:func:`lta.launch.run_job`).
``gloo``
    N processes run ``torch.distributed.all_reduce`` with the gloo backend over TCP on loopback.
``raw``
    the datagrams of one lta reduce (as many, as large) echoed by a server that does no LTA work: N
    sender processes each send their reduce's datagram count through :class:`hostlib.batchio.BatchSocket`
    in windows of lta's size, and one echo server (a thread of this process, where the softswitch runs
    too) sends every datagram straight back to its sender. That is what the kernel and the batched I/O
    allow with one datagram per message (``recvmmsg``/``sendmmsg``, the ``mmsg-c`` path);
    ``ratio_lta_over_raw_pps`` says how much of it lta reaches.
``raw_gso``
    the same echo with UDP segmentation offload on both ends (``gso-c``: GSO trains out, GRO buffers in),
    the kernel's best here; ``ratio_lta_over_raw_gso_pps``. Absent (null) where the kernel has no UDP GSO.

busbw follows nccl-tests: ``algbw = bytes / time`` and ``busbw = algbw · 2(N-1)/N`` (the ring
allreduce factor) for both systems, so ``ratio_busbw`` is simply gloo's mean time over lta's. With
in-network aggregation each worker moves only ``bytes`` each way, so lta's busbw by that factor
overstates its link use for N > 2; we keep one factor so the two numbers compare.

pps, for lta and raw alike, is the datagrams that reached the switch (the echo server) during the timed
iterations over the sum of those iterations' times (each iteration timed by its slowest worker). lta's
count is the workers' ``stats.packets_sent`` over the timed iterations (GRADs, exponent copies and
FLUSHes; the softswitch receives all of them on loopback, emulated loss drops them after receipt); raw's
is counted by the echo server itself.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hostlib import argtypes
from hostlib.batchio import IO_MODES, available_modes
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.errors import UsageError
from hostlib.protocol import MAX_ELEMS_PER_PACKET, MAX_WORKERS, packet_bytes
from hostlib.transport import LtaWorker, TransportConfig
from lta.bench.flags import add_elems_per_packet, add_iters, add_warmup, add_workers, bench_command
from lta.bench.ranks import run_ranks
from lta.bench.raw_echo import RAW_DATAGRAM_OVERHEAD as RAW_DATAGRAM_OVERHEAD  # still importable here
from lta.bench.raw_echo import RawSpec, run_raw
from lta.bench.raw_echo import echo_window as echo_window  # still importable here
from lta.bench.summary import ratio, report, slowest_rank, time_stats
from lta.demo import memory_available
from lta.launch import JobSpec, run_job
from lta.progress import Status

log = logging.getLogger(__name__)

SCHEMA = "lta.bench.allreduce/1"
IO_CHOICES = ("auto", *IO_MODES)
PPS_DEFINITION = (
    "datagrams into the switch during the timed iterations (lta: the workers' stats.packets_sent; "
    "raw: counted by the echo server) / the sum of the timed iterations' times (slowest worker each)"
)
RAW_DEFINITION = (
    "N sender processes each send lta's datagram count per reduce (data + exponent copies) of "
    "packet_bytes(K) bytes through hostlib.batchio.BatchSocket, window as lta's; one echo server "
    "(a BatchSocket in a thread) returns every datagram to its sender"
)
# What the JSON keeps of each measurement (the rest stays in the Python result).
LTA_KEYS = (
    "p50_ms",
    "p99_ms",
    "mean_ms",
    "pps",
    "busbw_gbps",
    "algbw_gbps",
    "mean_count",
    "flushes_per_reduce",
    "packets_per_reduce",
)
GLOO_KEYS = ("p50_ms", "p99_ms", "mean_ms", "busbw_gbps", "algbw_gbps")
RAW_KEYS = (
    "p50_ms",
    "p99_ms",
    "mean_ms",
    "pps",
    "datagrams_per_reduce",
    "window",
    "timeouts",
    "lost",
    "io",
)


# ---------------------------------------------------------------------------------------------------
# lta


def lta_bench_worker(worker: LtaWorker, rank: int, n_values: int, iters: int, warmup: int) -> dict:
    x = np.random.default_rng(rank).standard_normal(n_values).astype(np.float32)
    y = np.empty_like(x)  # reduced in place, as gloo's all_reduce(y) and DDP's buckets are
    for i in range(warmup):
        y[:] = x
        worker.allreduce(y, step=i, out=y)
    packets0, flushes0 = worker.stats.packets_sent, worker.stats.flushes_sent
    times = []
    counts = []
    for i in range(iters):
        y[:] = x
        t0 = time.perf_counter()
        r = worker.allreduce(y, step=warmup + i, out=y)
        times.append(time.perf_counter() - t0)
        counts.append(float(r.count.mean()))
    return {
        "times_s": times,
        "mean_count": float(np.mean(counts)),
        "packets_timed": worker.stats.packets_sent - packets0,
        "flushes_timed": worker.stats.flushes_sent - flushes0,
        "stats": worker.stats.as_dict(),
    }


def lta_datagrams_per_reduce(n_values: int, elems_per_packet: int, exp_copies: int) -> int:
    """Datagrams one lta worker sends per reduce of ``n_values`` when nothing is lost: one per chunk of
    K values, plus ``exp_copies`` of each exponent unit (one per K chunks)."""
    chunks = max(1, math.ceil(n_values / elems_per_packet))
    return chunks + exp_copies * math.ceil(chunks / elems_per_packet)


# ---------------------------------------------------------------------------------------------------
# gloo


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
    def args_of(rank: int, port: int, queue: Any) -> tuple[Any, ...]:
        return (rank, n, port, n_values, iters, warmup, queue)

    results = run_ranks(n, gloo_bench_worker, args_of, timeout_s=600, join_s=30, daemon=None)
    # An allreduce is over when the slowest rank is done.
    return list(slowest_rank([results[r] for r in range(n)]))


# ---------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------
# One (workers, MiB) pair, and the command


@dataclass(frozen=True)
class BenchOptions:
    workers: tuple[int, ...]
    mibs: tuple[float, ...]
    loss: float
    iters: int
    warmup: int
    elems_per_packet: int
    io: str | None  # None: auto


def mib_size(text: str) -> float:
    """``--mib`` items: a size in MiB of float32 that holds at least one value."""
    mib = argtypes.float_range(0.0, low_open=True, what="MiB")(text)
    if int(mib * (1 << 20) / 4) < 1:
        raise argparse.ArgumentTypeError(f"{text} MiB is less than one float32 (4 bytes)")
    return mib


grad_loss = argtypes.loss_below_one  # ``--loss``: at 1 nothing would be aggregated to measure


def parse_options(args: argparse.Namespace) -> BenchOptions:
    """The run's settings from parsed arguments (their ranges are checked by the parser's types).

    Raises :class:`UsageError` for what only this machine can say: an I/O path that is not available."""
    if args.io != "auto" and args.io not in available_modes():
        available = ", ".join(available_modes())
        raise UsageError(f"allreduce --io: {args.io} is not available here (available: {available})")
    for n in args.workers:
        for mib in args.mib:
            check_memory(n, mib)
    return BenchOptions(
        workers=tuple(args.workers),
        mibs=tuple(args.mib),
        loss=args.loss,
        iters=args.iters,
        warmup=args.warmup,
        elems_per_packet=args.elems_per_packet,
        io=None if args.io == "auto" else args.io,
    )


# Bytes a worker holds per value at once: its float64 draw (8) and float32 input (4), the tensor reduced
# in place (4), and about as much again in the transport's and gloo's staging.
_BYTES_PER_VALUE = 32


def check_memory(workers: int, mib: float) -> None:
    """Refuse, before any process starts, a size this machine cannot hold (one line, not a MemoryError
    in a worker)."""
    need, have = workers * int(mib * (1 << 20) / 4) * _BYTES_PER_VALUE, memory_available()
    if have is not None and need > have:
        gib = 1 << 30
        raise UsageError(
            f"--mib {mib:g} with {workers} workers needs about {need / gib:.1f} GiB and "
            f"{have / gib:.1f} GiB is available: lower --mib or --workers"
        )


def summarize(times_s: list[float], n_bytes: int, n: int) -> dict:
    t = np.array(times_s)
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    return {
        "busbw_gbps": n_bytes / t.mean() * factor * 8 / 1e9,
        "algbw_gbps": n_bytes / t.mean() * 8 / 1e9,
    } | time_stats(t, ("mean", "p50", "p99"))


Phase = Callable[[str], contextlib.AbstractContextManager]


@contextlib.contextmanager
def _no_progress(label: str) -> Iterator[None]:
    yield


def bench_pair(opts: BenchOptions, n: int, mib: float, phase: Phase = _no_progress) -> dict:
    """lta, gloo and raw for ``n`` workers reducing ``mib`` MiB of float32; the JSON object of one pair."""
    n_values = int(mib * (1 << 20) / 4)
    n_bytes = 4 * n_values
    k = opts.elems_per_packet
    transport = TransportConfig(elems_per_packet=k, seed=0, io=opts.io)
    with phase("lta"):
        spec = JobSpec(n_workers=n, transport=transport, drop={"up": DropPolicy(p=opts.loss)})
        lta_results, _ = run_job(spec, lta_bench_worker, n_values, opts.iters, opts.warmup)
    lta_times = list(np.max(np.array([r["times_s"] for r in lta_results]), axis=0))
    lta = summarize(lta_times, n_bytes, n)
    packets_timed = sum(r["packets_timed"] for r in lta_results)
    lta["pps"] = packets_timed / float(np.sum(lta_times))
    lta["mean_count"] = float(np.mean([r["mean_count"] for r in lta_results]))
    lta["flushes_per_reduce"] = float(np.mean([r["flushes_timed"] for r in lta_results])) / opts.iters
    lta["packets_per_reduce"] = packets_timed / n / opts.iters
    io = ",".join(sorted({r["stats"]["io"] for r in lta_results}))

    with phase("gloo"):
        gloo_times = run_gloo(n, n_values, opts.iters, opts.warmup)
    gloo = summarize(gloo_times, n_bytes, n)

    modes = available_modes()
    raws: dict[str, dict | None] = {}
    # raw: the path --io forces, else one datagram per message; raw_gso: always GSO/GRO trains.
    # As many datagrams a reduce as an lta worker sends in its steady state here, where nothing is lost:
    # each exponent unit once, as it sends them once the network has been quiet (TransportConfig.quiet_units).
    exp_copies = 1 if transport.quiet_units else transport.exp_copies
    for name, io_mode in (("raw", opts.io or "mmsg-c"), ("raw_gso", "gso-c")):
        if io_mode not in modes:  # no C extension: raw is the best path there is; no GSO: no raw_gso
            io_mode = modes[0] if name == "raw" else ""
        if not io_mode:
            raws[name] = None
            continue
        raw_spec = RawSpec(
            n_datagrams=lta_datagrams_per_reduce(n_values, k, exp_copies),
            packet_bytes=packet_bytes(k),
            iters=opts.iters,
            warmup=opts.warmup,
            io=io_mode,
            window=transport.window,
            buffer_bytes=transport.socket_buffer_bytes,
        )
        with phase(name):
            result = run_raw(n, raw_spec)
        if result["timeouts"]:
            log.warning("%s: %d iterations gave up waiting for echoes", name, result["timeouts"])
        raws[name] = {key: result[key] for key in RAW_KEYS}
    raw, raw_gso = raws["raw"], raws["raw_gso"]
    assert raw is not None

    return {
        "config": {
            "workers": n,
            "mib": mib,
            "n_values": n_values,
            "bytes": n_bytes,
            "loss": opts.loss,
            "elems_per_packet": k,
            "packet_bytes": packet_bytes(k),
            "iters": opts.iters,
            "warmup": opts.warmup,
            "io_requested": opts.io or "auto",
            "busbw_factor": "2(N-1)/N for both",
            "pps": PPS_DEFINITION,
            "raw": RAW_DEFINITION,
        },
        "lta": {key: lta[key] for key in LTA_KEYS},
        "gloo": {key: gloo[key] for key in GLOO_KEYS},
        "raw": raw,
        "raw_gso": raw_gso,
        "io": io,
        "ratio_gloo_over_lta_p50": ratio(gloo["p50_ms"], lta["p50_ms"]),
        "ratio_lta_over_raw_pps": ratio(lta["pps"], raw["pps"]),
        "ratio_lta_over_raw_gso_pps": None if raw_gso is None else ratio(lta["pps"], raw_gso["pps"]),
        "ratio_busbw": ratio(lta["busbw_gbps"], gloo["busbw_gbps"]),
    }


def bench_allreduce(opts: BenchOptions, phase_for: Callable[[int, int, float], Phase] | None = None) -> dict:
    """One result per (workers, mib) pair: the object itself for one pair, else under ``results``."""
    pairs = [(n, mib) for n in opts.workers for mib in opts.mibs]
    results = []
    for n, mib in pairs:
        phase = phase_for(len(results), n, mib) if phase_for else _no_progress
        results.append(bench_pair(opts, n, mib, phase))
    if len(results) == 1:
        return results[0]
    return {"results": results}


def register(sub: argparse._SubParsersAction) -> None:
    a = bench_command(
        sub,
        "allreduce",
        _run_allreduce,
        help="allreduce time, busbw and pps on loopback: lta (softswitch) vs gloo vs a raw UDP echo",
        description="Time allreduces on loopback three ways in the same run: lta through a softswitch, "
        "torch.distributed gloo, and the same datagrams echoed by a server that does no LTA work.",
    )
    add_workers(
        a,
        [2],
        f"worker count, or a comma list (e.g. 2,4); each 1..{MAX_WORKERS}",
        type=argtypes.csv_of(argtypes.workers, "worker counts"),
    )
    a.add_argument(
        "--mib",
        type=argtypes.csv_of(mib_size, "sizes"),
        default=[4.0],
        help="tensor size in MiB of float32, or a comma list (e.g. 4,64); each > 0",
    )
    a.add_argument(
        "--loss", type=grad_loss, default=0.0, help="softswitch drop probability of GRAD packets, [0, 1)"
    )
    add_iters(a, 20, "timed allreduces per system")
    add_warmup(a, 3, "untimed allreduces first")
    add_elems_per_packet(
        a, 64, f"K, values per packet: 64 as the P4 program, up to {MAX_ELEMS_PER_PACKET} (one datagram)"
    )
    a.add_argument(
        "--io",
        default="auto",
        choices=IO_CHOICES,
        help="packet I/O path for lta's workers and the raw echo (auto: the fastest available)",
    )


def _progress(status: Status, total: int) -> Callable[[int, int, float], Phase]:
    """Phase reporters for ``status``: each phase is shown as it starts, and logged with its time when
    it ends (``lta -v`` shows those lines)."""

    def phase_for(index: int, n: int, mib: float) -> Phase:
        @contextlib.contextmanager
        def phase(name: str) -> Iterator[None]:
            label = f"[{index + 1}/{total}] {n} workers, {mib:g} MiB: {name}"
            t0 = time.perf_counter()
            status.update(label)
            yield
            log.info("%s done in %.1f s", label, time.perf_counter() - t0)

        return phase

    return phase_for


def format_pair(result: dict) -> list[str]:
    c, lta, gloo, raw = result["config"], result["lta"], result["gloo"], result["raw"]

    def ratio(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    def times(s: dict) -> str:
        return f"p50 {s['p50_ms']:8.2f} ms  p99 {s['p99_ms']:8.2f} ms"

    return [
        f"{c['workers']} workers, {c['mib']:g} MiB, K={c['elems_per_packet']}, io {result['io']}",
        f"  lta   {times(lta)}  busbw {lta['busbw_gbps']:7.3f} Gbit/s  pps {lta['pps']:9.0f}"
        f"  mean count {lta['mean_count']:.2f}",
        f"  gloo  {times(gloo)}  busbw {gloo['busbw_gbps']:7.3f} Gbit/s",
        f"  raw   {times(raw)}  pps {raw['pps']:9.0f}  ({raw['datagrams_per_reduce']} datagrams/reduce,"
        f" window {raw['window']}, {raw['timeouts']} timeouts, io {raw['io']})",
        f"  ratios: gloo/lta p50 {ratio(result['ratio_gloo_over_lta_p50'])}"
        f"  lta/raw pps {ratio(result['ratio_lta_over_raw_pps'])}"
        f"  lta/gloo busbw {ratio(result['ratio_busbw'])}",
    ]


def _run_allreduce(args: argparse.Namespace) -> int:
    opts = parse_options(args)
    pairs = len(opts.workers) * len(opts.mibs)
    sizes = ",".join(f"{m:g}" for m in opts.mibs)
    workers = ",".join(str(n) for n in opts.workers)
    title = (
        f"lta bench allreduce: {workers} workers x {sizes} MiB ({pairs} pair{'s' * (pairs > 1)}), "
        f"{opts.iters} timed allreduces each through lta, gloo and a raw echo"
    )
    with Status(title) as status:
        out = bench_allreduce(opts, _progress(status, pairs))
    return report(
        args.json, SCHEMA, out, lambda: (line for r in out.get("results", [out]) for line in format_pair(r))
    )
