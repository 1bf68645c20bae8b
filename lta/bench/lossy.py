"""``lta bench lossy``: lta against gloo on rate-limited links where the kernel really drops packets.

For each loss rate a fresh :class:`~mininet_topos.netns.NetnsNetwork` is built: N worker namespaces and
an aggregator on a bridge, every worker link shaped by tbf in both directions and losing a fraction
``p`` of TCP/UDP packets in each direction (nftables ``numgen random`` in the bridge's forward path,
invisible to both ends). Over the same links, one after the other:

- **gloo**: ``torch.distributed`` allreduce, ``init_method=tcp://`` at worker 0, one process per
  worker namespace (TCP between workers: a ring packet crosses two lossy worker links);
- **lta**: the softswitch daemon (``lta softswitch``) in the aggregator namespace, one
  :class:`~hostlib.transport.LtaWorker` process per worker namespace (UDP: a GRAD crosses its
  worker's up link, a RESULT its worker's down link). The aggregator's own link is unshaped and
  lossless: it stands in for a switch whose ports are not the bottleneck.

**Link limit** = the bytes one worker must put on its link in one direction ÷ the link rate, with
every header tbf counts (Ethernet 14 + IPv4 20, no preamble or FCS):

- lta: every GRAD (data units, and ``exp_copies`` copies of each exponent unit) is one frame of
  14 + 20 + 8 (UDP) + 36 (LTA header) + 4K bytes; RESULTs use the down direction, which is as long;
- gloo: the ring allreduce sends ``2(N-1)/N`` times the tensor over TCP (reduce-scatter, then
  allgather); segments carry MTU - 52 bytes (IPv4 20 + TCP 20 + timestamps 12) in MTU + 14 byte
  frames, and the same direction carries one 66-byte delayed ACK per two segments of the peer's
  stream. The round trips of either protocol are not in the limit.

**Rate.** ``--rate`` (``200mbit``, ``1gbit``, ``2500mbit``, ``500kbit``, or a plain number of Mbit/s)
shapes every worker link in both directions; the link limits and the deadline floor below use it.
The tbf bucket is sized for it and for jumbo frames (:func:`tbf_burst_bytes`), and tbf's queue holds
``TBF_QUEUE_MS`` at the rate on top of the bucket.

**Window and deadlines.** A jumbo-frame link at 200 Mbit/s serializes a frame in 0.33 ms and the
namespaces' own round trip is below a millisecond, so lta's default 20 ms floor on its FLUSH deadline
(made for loaded loopback) would dominate the tail of every reduce that loses a packet. The bench caps
the units in flight at the link's bandwidth-delay product (``--window``, default
:func:`window_for_rate`): the frames the link carries in ``WINDOW_RTT_MS`` (2 ms, the round trip of a
unit through the Python softswitch and workers on this harness when tbf holds no queue), plus the
unit's own frame: 8 at 200 Mbit/s, 32 at 1 Gbit/s. A larger window adds only a queue of the worker's
own frames in tbf, which every RTT sample, and so every RTO and every FLUSH, then waits through; a
smaller one idles the link for part of each round trip. (A fixed 16 was 5.3 ms of frames at 200
Mbit/s but 1.1 ms at 1 Gbit/s, where lta then ran at 2.4-2.8x the link limit.) ``min_deadline_ms`` is
one window serialized at the link rate plus 1 ms for the softswitch (``W · frame_time + 1``: 3.6 ms
at 200 Mbit/s, 3.1 ms at 1 Gbit/s). The RTO above that floor is the transport's own
``srtt + 4 · rttvar``. Losses inside a reduce are flushed at once from the other workers' progress
(the transport's fast flush); only a loss among the last units of a reduce waits for the RTO.

**Scheduling.** The softswitch runs at nice ``SWITCH_NICE`` (see :func:`softswitch_in`).

**Iterations.** p99.9 needs ``--iters 2000`` or more per point (two samples above it; with 500 it is
interpolated between the two slowest allreduces). A run keeps one float per allreduce and rank, and
rank 0 reports its progress every tenth of the run, which the CLI shows on stderr.

Worker processes run ``python -m lta.bench.lossy {gloo,lta}-worker``; they print ``ready``, wait
for ``go`` on stdin (so every rank starts together), print ``progress DONE TOTAL`` lines (rank 0)
and end with one JSON line. Their stdout and stderr are read as they come, so a chatty worker cannot
stall on a full pipe.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hostlib import argtypes
from hostlib.errors import LtaError, UsageError
from hostlib.protocol import HEADER_BYTES, LTA_PORT, MAX_ELEMS_PER_PACKET, MAX_WORKERS
from lta.jsonout import emit
from lta.progress import Status

if TYPE_CHECKING:
    from hostlib.transport import TransportConfig
    from mininet_topos.linkshape import LinkSpec
    from mininet_topos.netns import NetnsNetwork

log = logging.getLogger(__name__)
SCHEMA = "lta.bench.lossy/1"
Progress = Callable[[str], None]  # where progress lines go (the CLI: stderr)

ETH_BYTES = 14  # what tbf counts besides the IP packet
IPV4_BYTES = 20
UDP_BYTES = 8
TCP_BYTES = 32  # 20 + the 12-byte timestamp option Linux puts on every segment
TCP_ACK_FRAME_BYTES = ETH_BYTES + IPV4_BYTES + TCP_BYTES
DEFAULT_LOSSES = "0,0.001,0.01,0.05"
DEFAULT_MTU = 9000
DEFAULT_WINDOW = 16  # the window lta bench ltp and lossy-train keep (this bench: window_for_rate)
WINDOW_RTT_MS = 2.0  # round trip of a unit through softswitch and workers with no queue (window_for_rate)
DEFAULT_RATE = "200mbit"
TBF_QUEUE_MS = 50.0  # tbf latency: the queue holds this long at the rate, on top of the bucket
TBF_BUCKET_MS = 1.0  # the bucket holds this long at the rate (see tbf_burst_bytes) ...
TBF_MIN_BURST_BYTES = 32 * 1024  # ... but at least this much ...
TBF_MIN_BURST_FRAMES = 2  # ... and at least this many full frames
P99_9_MIN_ITERS = 2000  # allreduces per point for a p99.9 that is not just the max
WORKER_PORT_BASE = 41000  # worker w binds <its ip>:WORKER_PORT_BASE + w
GLOO_PORT = 29500
JOB_ID = 1
PERCENTILES = (("p50_ms", 50.0), ("p99_ms", 99.0), ("p99_9_ms", 99.9))
INPUT_ROUNDS = 4  # distinct seeded inputs, cycled: enough to vary the values, cheap to regenerate
REPO = Path(__file__).resolve().parents[1]
HOST_DEV = "eth0"  # each worker namespace's one interface (mininet_topos.netns)
START_TIMEOUT_S = 60.0  # from launch to "ready": imports, binding, gloo's rendezvous
STDERR_KEEP_BYTES = 64 * 1024  # the tail of each worker's stderr kept for error messages
PROGRESS_STEPS = 10  # rank 0 reports its progress this many times per run
SWITCH_NICE = -10  # the softswitch's scheduling priority (see softswitch_in)
SWITCH_NICE_ARGV = ("nice", "-n", str(SWITCH_NICE))


# ---- link rate -----------------------------------------------------------------------------------
_RATE_UNITS_MBIT = {"": 1.0, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}
_RATE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(kbit|mbit|gbit)?\s*", re.IGNORECASE)
RATE_HELP = "e.g. --rate 1gbit, --rate 2500mbit, --rate 500kbit or --rate 200 (Mbit/s)"


def parse_rate_mbit(text: str) -> float:
    """A link rate as tc writes it (``200mbit``, ``1gbit``, ``1.5gbit``, ``500kbit``; any case; SI units,
    as tc's) or a plain number of Mbit/s, in Mbit/s. Raises ValueError with a one-line message."""
    match = _RATE_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"--rate: cannot read {text!r} as a link rate ({RATE_HELP})")
    rate = float(match[1]) * _RATE_UNITS_MBIT[(match[2] or "").lower()]
    if not rate > 0:
        raise ValueError(f"--rate must be positive, got {text!r} ({RATE_HELP})")
    return rate


def format_rate(rate_mbit: float) -> str:
    """``1 Gbit/s``, ``200 Mbit/s``, ``500 kbit/s``."""
    if rate_mbit >= 1000:
        return f"{rate_mbit / 1000:g} Gbit/s"
    if rate_mbit >= 1:
        return f"{rate_mbit:g} Mbit/s"
    return f"{rate_mbit * 1000:g} kbit/s"


def tbf_burst_bytes(rate_mbit: float, mtu: int) -> int:
    """The tbf bucket of a worker link: ``TBF_BUCKET_MS`` at the rate, at least 32 KiB and two frames.

    tc-tbf(8) asks for a bucket of at least rate/HZ bytes: with a jiffy timer tbf can only be woken
    once a tick, and each wake-up sends at most one bucket, so a smaller bucket caps the link at
    ``burst × HZ``. tbf's watchdog has been an hrtimer for years (CONFIG_HIGH_RES_TIMERS, which every
    mainstream kernel sets): it wakes when the next frame's tokens are due, and the bucket only has to
    absorb the wake-up latency. One millisecond of line rate (rate/1000: the rule for HZ=1000, a
    quarter of it for this machine's HZ=250) does so with room to spare; measured here (HZ=250,
    high-res timers, jumbo frames, Python TCP sender): at 1 Gbit/s 992 Mbit/s of TCP payload with
    this bucket (125 kB), 986 with 32 KiB; at 2.5 Gbit/s 32 KiB held the stream to 1.5-1.9 Gbit/s
    where 1 ms (312 kB) reached the sender's own ceiling (~2.2 Gbit/s, unshaped).

    A larger bucket is not free: after an idle gap, a full bucket crosses the link at veth speed,
    and the link goes idle for a round trip between two allreduces. rate/250 (4 ms: 500 kB at
    1 Gbit/s) could take up to 4 ms off an 8.6 ms reduce (1 MiB at 1 Gbit/s), and the link limit would
    no longer bound what is measured; this bucket bounds that error at ``burst / rate`` per direction
    (1 ms from 262 Mbit/s up).

    The floors: below 262 Mbit/s 1 ms is less than 32 KiB (the floor
    :class:`~mininet_topos.linkshape.LinkSpec` uses too), and a frame larger than the bucket is never
    sent (tbf drops it): two full frames leave one frame of slack for a late wake-up. tbf's queue
    (``limit``, which tc derives from ``latency`` as rate × TBF_QUEUE_MS + burst) is then always at
    least two jumbo frames too: 1.28 MB (142 frames of 9014 bytes) at 200 Mbit/s, 6.4 MB at 1 Gbit/s."""
    bucket = math.ceil(rate_mbit * 1e6 / 8 * TBF_BUCKET_MS / 1e3)
    return max(bucket, TBF_MIN_BURST_BYTES, TBF_MIN_BURST_FRAMES * (mtu + ETH_BYTES))


def tbf_limit_bytes(rate_mbit: float, burst: int, queue_ms: float = TBF_QUEUE_MS) -> int:
    """tbf's queue in bytes, as tc computes it from ``latency``: rate × latency + burst."""
    return int(rate_mbit * 1e6 / 8 * queue_ms / 1e3) + burst


# ---- what a worker must move ---------------------------------------------------------------------
def elems_for_mtu(mtu: int) -> int:
    """The largest power-of-two K whose GRAD fits one IPv4 packet of ``mtu`` bytes."""
    room = (mtu - IPV4_BYTES - UDP_BYTES - HEADER_BYTES) // 4
    if room < 1:
        raise ValueError(f"an MTU of {mtu} bytes leaves no room for an LTA payload")
    return min(1 << (room.bit_length() - 1), MAX_ELEMS_PER_PACKET)


def lta_frame_bytes(k: int) -> int:
    return ETH_BYTES + IPV4_BYTES + UDP_BYTES + HEADER_BYTES + 4 * k


def lta_wire_bytes(n_values: int, k: int, exp_copies: int) -> int:
    """Bytes one worker sends up per allreduce: every data GRAD and every copy of the exponent GRADs."""
    chunks = max(1, math.ceil(n_values / k))
    exp_units = math.ceil(chunks / k)
    return (chunks + exp_copies * exp_units) * lta_frame_bytes(k)


def gloo_wire_bytes(n_bytes: int, n_workers: int, mtu: int) -> int:
    """Bytes one worker sends per ring allreduce: 2(N-1)/N of the tensor in full TCP segments, plus
    the delayed ACKs (one per two segments) for the stream it receives."""
    payload = n_bytes * 2 * (n_workers - 1) / n_workers
    segments = math.ceil(payload / (mtu - IPV4_BYTES - TCP_BYTES))
    return int(payload + segments * (ETH_BYTES + IPV4_BYTES + TCP_BYTES) + segments / 2 * TCP_ACK_FRAME_BYTES)


def link_limit_ms(wire_bytes: float, rate_mbit: float) -> float:
    return wire_bytes * 8 / (rate_mbit * 1e6) * 1e3


def window_for_rate(rate_mbit: float, k: int) -> int:
    """Units in flight per worker for a link of ``rate_mbit``: its bandwidth-delay product over a
    ``WINDOW_RTT_MS`` round trip, in frames of K values, plus the frame being serialized.

    The round trip: rtprop (the smallest RTT a worker saw) is 0.1-0.3 ms here, but a unit's RESULT
    comes back only when the softswitch and then the worker have woken up for their batches; the
    smoothed RTT was 1.3-1.5 ms at 1 Gbit/s with a window of 16 frames queueing 1.06 ms, and 2.4 ms at
    200 Mbit/s with 8 frames queueing 2.6 ms. Measured (2 workers, 1 MiB, 1% loss, 1000 allreduces):
    at 200 Mbit/s a window of 8 gave p50 47.5 ms and p99.9 67.3 ms, 16 gave 49.3 and 79.4; at
    1 Gbit/s 16 gave 24.4 and 58.6, 32 gave 21.2 and 40.0, 48 gave 32.9 and 140, 64 gave 33.7 and 101
    (the larger windows queue their own frames: smoothed RTT 5-7 ms)."""
    frame_ms = link_limit_ms(lta_frame_bytes(k), rate_mbit)
    return math.ceil(WINDOW_RTT_MS / frame_ms - 1e-9) + 1


def deadline_floor_ms(k: int, window: int, rate_mbit: float) -> float:
    """min_deadline_ms for the link: one window of frames serialized at the link rate, plus 1 ms."""
    return window * link_limit_ms(lta_frame_bytes(k), rate_mbit) + 1.0


# ---- summaries -----------------------------------------------------------------------------------
def summarize_times(times_s: Sequence[float], limit_ms: float) -> dict[str, float]:
    """mean / p50 / p99 / p99.9 / max in ms (linear interpolation between samples), and p50 ÷ limit."""
    t = np.asarray(times_s, dtype=np.float64) * 1e3
    out = {"mean_ms": float(t.mean())}
    out |= {name: float(np.percentile(t, q)) for name, q in PERCENTILES}
    out |= {
        "max_ms": float(t.max()),
        "link_limit_ms": limit_ms,
        "p50_over_limit": float(np.median(t)) / limit_ms,
    }
    return out


def slowest_rank(per_rank_times: Sequence[Sequence[float]]) -> list[float]:
    """An allreduce is over when its slowest rank returns: the per-iteration max over ranks."""
    return [float(t) for t in np.max(np.array(per_rank_times, dtype=np.float64), axis=0)]


def ratios(gloo: dict[str, float], lta: dict[str, float]) -> dict[str, float]:
    return {f"gloo_over_lta_{name[:-3]}": gloo[name] / lta[name] for name in ("p50_ms", "p99_ms", "p99_9_ms")}


# ---- worker processes (run inside the namespaces) ------------------------------------------------
def worker_inputs(seed: int, n_workers: int, n_values: int) -> np.ndarray:
    """(rounds, workers, values) float32: every worker can rebuild every worker's input to check."""
    from hostlib.verify import seeded_input as worker_input

    return np.stack(
        [
            np.stack([worker_input(seed, r, w, n_values) for w in range(n_workers)])
            for r in range(INPUT_ROUNDS)
        ]
    )


def _wait_for_go() -> None:
    print("ready", flush=True)
    line = sys.stdin.readline().strip()
    if line != "go":
        raise SystemExit(f"expected 'go' on stdin, got {line!r}")


def _report_progress(rank: int, done: int, total: int) -> None:
    """Rank 0 prints ``progress DONE TOTAL`` every tenth of the run (the orchestrator relays it)."""
    if rank == 0 and (done % max(1, total // PROGRESS_STEPS) == 0 or done == total):
        print(f"progress {done} {total}", flush=True)


def _report_event(rank: int, name: str) -> None:
    """Rank 0 prints ``event NAME`` (the orchestrator may act on it, e.g. read the qdisc counters)."""
    if rank == 0:
        print(f"event {name}", flush=True)


def transport_config(args: argparse.Namespace) -> TransportConfig:
    """The transport settings both lossy benchmarks use (K, window and deadline fitted to the link)."""
    from hostlib.transport import TransportConfig

    return TransportConfig(
        elems_per_packet=args.elems_per_packet,
        window=args.window,
        min_deadline_ms=args.min_deadline_ms,
        initial_deadline_ms=max(args.min_deadline_ms, 10.0),
        seed=args.seed,
        # LTP's mechanisms (lta bench ltp); other callers' arguments leave them off
        pace_gbps=getattr(args, "pace_gbps", 0.0),
        pace_learn=getattr(args, "pace_learn", False),
        early_close_theta=getattr(args, "early_close_theta", None),
    )


def lta_worker_main(args: argparse.Namespace) -> dict[str, Any]:
    from hostlib.transport import LtaWorker
    from hostlib.verify import check_result, input_bound

    config = transport_config(args)
    inputs = worker_inputs(args.seed, args.workers, args.values)
    means = inputs.astype(np.float64).mean(axis=1)  # (rounds, values): every worker's mean
    bounds = [input_bound(x, args.elems_per_packet) for x in inputs]  # the codec's, per chunk
    switch_host, _, switch_port = args.switch.rpartition(":")
    bind_host, _, bind_port = args.bind.rpartition(":")
    times, worst, checked = [], 0.0, 0
    chunks = {"full": 0, "partial": 0, "fallback": 0, "critical": 0, "critical_full": 0}
    n_chunks = math.ceil(args.values / args.elems_per_packet)
    every = getattr(args, "critical_every", 0)
    critical = np.arange(n_chunks) % every == 0 if every else None
    with LtaWorker(
        JOB_ID, args.rank, args.workers, (switch_host, int(switch_port)), config=config,
        bind=(bind_host, int(bind_port)), trace=getattr(args, "trace", None),
    ) as worker:  # fmt: skip
        _wait_for_go()
        window_s = [0.0, 0.0]  # wall-clock bounds of the timed allreduces (TCP competitor's window)
        stats_before = worker.stats.as_dict()
        for i in range(args.warmup + args.iters):
            x = inputs[i % INPUT_ROUNDS]
            if i == args.warmup:
                _report_event(args.rank, "timed-start")
                window_s[0] = time.time()
                stats_before = worker.stats.as_dict()
            t0 = time.perf_counter()
            result = worker.allreduce(x[args.rank], step=i, critical=critical)
            elapsed = time.perf_counter() - t0
            if i < args.warmup:
                continue
            times.append(elapsed)
            _report_progress(args.rank, len(times), args.iters)
            n_checked, err = check_result(
                result,
                x,
                args.elems_per_packet,
                mean_all=means[i % INPUT_ROUNDS],
                bound=bounds[i % INPUT_ROUNDS],
            )
            checked, worst = checked + n_checked, max(worst, err)
            chunks["full"] += int(np.sum(result.count == args.workers))
            chunks["partial"] += int(np.sum((result.count > 0) & (result.count < args.workers)))
            chunks["fallback"] += int(np.sum(result.fallback != 0))
            if critical is not None:
                chunks["critical"] += int(critical.sum())
                chunks["critical_full"] += int(np.sum(result.count[critical] == args.workers))
        window_s[1] = time.time()
        _report_event(args.rank, "timed-end")
        stats = worker.stats.as_dict()
    stats.pop("reduce_ms")
    before = {key: value for key, value in stats_before.items() if isinstance(value, int | float)}
    return {
        "rank": args.rank,
        "times_s": times,
        "chunks": chunks,
        "chunks_checked": checked,
        "worst_error_over_tolerance": worst,
        "srtt_ms": worker.srtt_ms,
        "rttvar_ms": worker.rttvar_ms,
        "rtprop_ms": worker.deadlines.rtprop_ms,
        "transport": stats,
        # the timed allreduces only (the warm-up subtracted)
        "timed": {key: stats[key] - value for key, value in before.items() if key != "io"},
        "wall_window_s": window_s,
        "units_per_reduce": n_chunks + math.ceil(n_chunks / args.elems_per_packet),
        "pace_rate_bps": worker.pacer.rate_bps,
        "learned_rate_bps": worker.rate_learner.estimate_bps,
    }


def gloo_worker_main(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", HOST_DEV)  # the namespace's link, not the hostname's address
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.workers,
        timeout=timedelta(seconds=START_TIMEOUT_S),
    )
    inputs = torch.from_numpy(worker_inputs(args.seed, args.workers, args.values)[:, args.rank].copy())
    _wait_for_go()
    dist.barrier()
    times = []
    for i in range(args.warmup + args.iters):
        y = inputs[i % INPUT_ROUNDS].clone()
        t0 = time.perf_counter()
        dist.all_reduce(y)
        elapsed = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(elapsed)
            _report_progress(args.rank, len(times), args.iters)
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": args.rank, "times_s": times}


def worker_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lta.bench.lossy", description="one bench worker")
    parser.add_argument("system", choices=["lta-worker", "gloo-worker"])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--values", type=int, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--master", help="gloo: IP:PORT of rank 0's store")
    parser.add_argument("--switch", help="lta: IP:PORT of the softswitch")
    parser.add_argument("--bind", help="lta: IP:PORT this worker sends from")
    parser.add_argument("--elems-per-packet", type=int)
    parser.add_argument("--window", type=int)
    parser.add_argument("--min-deadline-ms", type=float)
    parser.add_argument(
        "--critical-every", type=int, default=0, help="lta: every Nth chunk critical (0: none)"
    )
    parser.add_argument("--pace-gbps", type=float, default=0.0, help="lta: pacing rate (0: unpaced)")
    parser.add_argument("--pace-learn", action="store_true", help="lta: learn the pacing rate")
    parser.add_argument("--early-close-theta", type=float, help="lta: adaptive early close's theta")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main = lta_worker_main if args.system == "lta-worker" else gloo_worker_main
    print(json.dumps(main(args)), flush=True)
    return 0


# ---- orchestration (in the root namespace) -------------------------------------------------------
@dataclass(frozen=True)
class LossyConfig:
    workers: int = 2
    mib: float = 1.0
    rate_mbit: float = 200.0
    iters: int = 500
    warmup: int = 10
    mtu: int = DEFAULT_MTU
    elems_per_packet: int | None = None  # None: fill the MTU (elems_for_mtu)
    window: int | None = None  # None: window_for_rate
    min_deadline_ms: float | None = None  # None: deadline_floor_ms
    seed: int = 0

    @property
    def n_values(self) -> int:
        return int(self.mib * (1 << 20) / 4)

    @property
    def k(self) -> int:
        return self.elems_per_packet or elems_for_mtu(self.mtu)

    @property
    def units_in_flight(self) -> int:
        """lta's window: ``window``, or the link's (:func:`window_for_rate`)."""
        return self.window or window_for_rate(self.rate_mbit, self.k)

    @property
    def deadline_ms(self) -> float:
        if self.min_deadline_ms is not None:
            return self.min_deadline_ms
        return deadline_floor_ms(self.k, self.units_in_flight, self.rate_mbit)

    @property
    def tbf_burst(self) -> int:
        return tbf_burst_bytes(self.rate_mbit, self.mtu)

    def worker_timeout_s(self, loss: float) -> float:
        """A generous bound on one system's run: 1 s per allreduce under loss, plus start-up."""
        return 120.0 + (self.iters + self.warmup) * (0.2 + 4 * loss)

    def link(self, loss: float) -> LinkSpec:
        """A worker link: tbf at the rate (both directions), the bucket sized for it, loss each way."""
        from mininet_topos.linkshape import LinkSpec

        return LinkSpec.symmetric(loss, rate_mbit=self.rate_mbit, burst_bytes=self.tbf_burst,
                                  queue_ms=TBF_QUEUE_MS)  # fmt: skip

    def network(self, loss: float, max_runtime_s: float) -> NetnsNetwork:
        """The namespaces for one loss point (not yet set up: use it as a context manager)."""
        from mininet_topos.netns import NetnsNetwork

        return NetnsNetwork(self.workers, self.link(loss), mtu=self.mtu, loss_backend="nftables",
                            max_runtime_s=max_runtime_s)  # fmt: skip


class _Outputs:
    """Every worker's stdout (split into lines) and stderr (its tail), read as they come: a worker
    blocked on a full pipe would stall every rank's allreduce."""

    def __init__(self, procs: Sequence[subprocess.Popen[bytes]], on_line: Callable[[int, str], None]) -> None:
        self.on_line = on_line
        self.lines: list[list[str]] = [[] for _ in procs]
        self.stderr = [bytearray() for _ in procs]
        self.open_stdout = set(range(len(procs)))
        self.open_stderr = set(range(len(procs)))
        self._partial = [bytearray() for _ in procs]
        self._selector = selectors.DefaultSelector()
        for rank, proc in enumerate(procs):
            assert proc.stdout is not None and proc.stderr is not None
            self._selector.register(proc.stdout, selectors.EVENT_READ, (rank, True))
            self._selector.register(proc.stderr, selectors.EVENT_READ, (rank, False))

    def pump(self, done: Callable[[], bool], deadline: float) -> bool:
        """Read until ``done()`` or every pipe is closed; False if ``deadline`` came first."""
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not self._selector.get_map():
                return done()
            for key, _ in self._selector.select(timeout=min(left, 1.0)):
                rank, is_stdout = key.data
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    self._selector.unregister(key.fileobj)
                    (self.open_stdout if is_stdout else self.open_stderr).discard(rank)
                    if is_stdout:
                        self._line(rank, bytes(self._partial[rank]))
                elif is_stdout:
                    self._partial[rank] += chunk
                    *lines, rest = self._partial[rank].split(b"\n")
                    self._partial[rank] = bytearray(rest)
                    for line in lines:
                        self._line(rank, bytes(line))
                else:
                    self.stderr[rank] += chunk
                    del self.stderr[rank][:-STDERR_KEEP_BYTES]
        return True

    def _line(self, rank: int, raw: bytes) -> None:
        line = raw.decode(errors="replace").strip()
        if line:
            self.lines[rank].append(line)
            self.on_line(rank, line)

    def stderr_tail(self, rank: int, chars: int = 3000) -> str:
        return self.stderr[rank].decode(errors="replace").strip()[-chars:]

    def close(self) -> None:
        self._selector.close()


class WorkerGroup:
    """Worker processes in their namespaces: start, release together, collect one JSON line each.

    ``progress DONE TOTAL`` lines a worker prints go to ``progress`` (default: the log) as
    ``{label} DONE/TOTAL``; the last line a worker prints is its result."""

    def __init__(
        self,
        net: Any,
        argvs: Sequence[tuple[Any, list[str]]],
        timeout_s: float,
        progress: Progress | None = None,
        label: str = "workers",
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.on_event = on_event
        self.progress = progress or log.info
        self.label = label
        self.procs = [
            net.run_in(
                host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO
            )  # fmt: skip
            for host, argv in argvs
        ]
        self.ready = [False] * len(self.procs)

    def run(self) -> list[dict[str, Any]]:
        outputs = _Outputs(self.procs, self._on_line)
        try:
            return self._run(outputs)
        finally:
            outputs.close()

    def _on_line(self, rank: int, line: str) -> None:
        if line == "ready":
            self.ready[rank] = True
        elif line.startswith("progress "):
            done, _, total = line.removeprefix("progress ").partition(" ")
            self.progress(f"  {self.label} {done}/{total}")
        elif line.startswith("event ") and self.on_event is not None:
            self.on_event(line.removeprefix("event "))

    def _run(self, outputs: _Outputs) -> list[dict[str, Any]]:
        def started() -> bool:
            return all(self.ready) or any(
                not ok and r not in outputs.open_stdout for r, ok in enumerate(self.ready)
            )

        outputs.pump(started, time.monotonic() + START_TIMEOUT_S)
        if not all(self.ready):  # name one that ended before "ready", else one that never said it
            waiting = [r for r, ok in enumerate(self.ready) if not ok]
            rank = next((r for r in waiting if r not in outputs.open_stdout), waiting[0])
            self.procs[rank].kill()
            outputs.pump(lambda: rank not in outputs.open_stderr, time.monotonic() + 5.0)  # what it said
            printed = outputs.lines[rank][-1] if outputs.lines[rank] else "(nothing)"
            stderr = outputs.stderr_tail(rank)
            raise RuntimeError(f"bench worker {rank} did not start: printed {printed!r}; stderr:\n{stderr}")
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        deadline = time.monotonic() + self.timeout_s
        if not outputs.pump(lambda: not outputs.open_stdout, deadline):
            stuck = sorted(outputs.open_stdout)
            raise TimeoutError(
                f"bench worker(s) {stuck} gave no result within {self.timeout_s:.0f} s (a hung allreduce?); "
                f"stderr of worker {stuck[0]}:\n{outputs.stderr_tail(stuck[0])}"
            )
        outputs.pump(lambda: not outputs.open_stderr, min(deadline, time.monotonic() + 10.0))  # stderr's end
        results = []
        for rank, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"bench worker {rank} closed its stdout but did not exit") from None
            if proc.returncode != 0:
                raise RuntimeError(
                    f"bench worker {rank} failed ({proc.returncode}):\n{outputs.stderr_tail(rank)}"
                )
            results.append(json.loads(outputs.lines[rank][-1]))
        return results


def _worker_argv(system: str, cfg: LossyConfig, rank: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "lta.bench.lossy", system, "--rank", str(rank),
        "--workers", str(cfg.workers), "--values", str(cfg.n_values), "--iters", str(cfg.iters),
        "--warmup", str(cfg.warmup), "--seed", str(cfg.seed), *extra,
    ]  # fmt: skip


def run_gloo(
    net: Any, cfg: LossyConfig, loss: float, progress: Progress | None = None
) -> list[dict[str, Any]]:
    master = f"{net.workers[0].ip}:{GLOO_PORT}"
    argvs = [(h, _worker_argv("gloo-worker", cfg, r, "--master", master)) for r, h in enumerate(net.workers)]
    return WorkerGroup(net, argvs, cfg.worker_timeout_s(loss), progress, "gloo").run()


def softswitch_toml(cfg: LossyConfig, worker_addrs: Sequence[str]) -> str:
    workers = ", ".join(f'"{a}"' for a in worker_addrs)
    return (
        f"seed = {cfg.seed}\n[[jobs]]\njob_id = {JOB_ID}\nworkers = [{workers}]\nelems_per_packet = {cfg.k}\n"
    )


@contextlib.contextmanager
def softswitch_in(
    net: Any, cfg: LossyConfig, worker_addrs: Sequence[str], listen: str, workdir: Path
) -> Iterator[subprocess.Popen[str]]:
    """``lta softswitch`` in the aggregator namespace with one job for ``worker_addrs``; stopped after.

    It runs at nice ``SWITCH_NICE``: it stands in for a switch, which forwards a packet as it comes, but
    on a host with fewer cores than busy processes (two workers and it on two cores) the kernel's fair
    scheduler let it wait behind a worker's turn: measured at 200 Mbit/s, 1% loss, window 16, 2000
    allreduces, the slowest 0.5% of lta's allreduces had stretches of 10-18 ms in which a worker
    received nothing, and p99.9 was 96 ms against a p50 of 49 (at nice 0) and 73 ms against 50 (at
    nice -10). The workers and gloo keep nice 0, so the two systems' hosts compete alike.

    Its stderr goes to ``workdir/softswitch.log``, not a pipe: nobody reads a pipe during the run, and
    a daemon that logged 64 KiB into one over a long run would block. It is ready once its "listening"
    line is there (the daemon writes it to stderr: its stdout is for stats only)."""
    config = workdir / "softswitch.toml"
    config.write_text(softswitch_toml(cfg, worker_addrs))
    log_path = workdir / "softswitch.log"
    with log_path.open("wb") as stderr:
        switch = net.run_in(
            net.aggregator,
            [*SWITCH_NICE_ARGV, sys.executable, "-m", "lta.cli", "softswitch", "--listen", listen, "--config",
             str(config)],
            stdout=subprocess.DEVNULL, stderr=stderr, text=True, cwd=REPO,
        )  # fmt: skip
    give_up = time.monotonic() + START_TIMEOUT_S
    while "listening" not in log_path.read_text(errors="replace"):
        if switch.poll() is not None or time.monotonic() > give_up:
            switch.kill()
            switch.wait(timeout=10)
            raise RuntimeError(
                f"softswitch did not start in {net.aggregator.netns} within {START_TIMEOUT_S:g} s: "
                f"{log_path.read_text(errors='replace')[-3000:] or '(it printed nothing)'}"
            )
        time.sleep(0.05)
    try:
        yield switch
    finally:
        switch.terminate()
        switch.wait(timeout=10)


def run_lta(
    net: Any, cfg: LossyConfig, loss: float, workdir: Path, progress: Progress | None = None
) -> list[dict[str, Any]]:
    addrs = [f"{h.ip}:{WORKER_PORT_BASE + r}" for r, h in enumerate(net.workers)]
    switch_addr = f"{net.aggregator.ip}:{LTA_PORT}"
    extra = ["--switch", switch_addr, "--elems-per-packet", str(cfg.k), "--window",
             str(cfg.units_in_flight), "--min-deadline-ms", f"{cfg.deadline_ms:g}"]  # fmt: skip
    argvs = [
        (h, _worker_argv("lta-worker", cfg, r, "--bind", addrs[r], *extra)) for r, h in enumerate(net.workers)
    ]
    with softswitch_in(net, cfg, addrs, switch_addr, workdir):
        return WorkerGroup(net, argvs, cfg.worker_timeout_s(loss), progress, "lta").run()


def measured_loss(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Fraction of packets the nftables rules dropped between two counter snapshots, per direction."""
    out: dict[str, float] = {}
    for direction in ("up", "down"):
        seen = after[f"seen_{direction}"] - before[f"seen_{direction}"]
        dropped = after[f"dropped_{direction}"] - before[f"dropped_{direction}"]
        out[f"{direction}_packets"] = seen
        out[f"{direction}_loss"] = dropped / seen if seen else 0.0
    return out


def _counter_totals(net: Any) -> dict[str, int]:
    """nftables counters summed over the worker links (TCP and UDP packets seen and dropped)."""
    counters = [net.loss_counters(h) for h in net.workers]
    names = ("seen_up", "dropped_up", "seen_down", "dropped_down")
    return {name: sum(getattr(c, name) for c in counters) for name in names}


def run_point(
    cfg: LossyConfig, loss: float, systems: Sequence[str], progress: Progress | None = None
) -> dict[str, Any]:
    """One loss rate: a fresh network, each system over it in turn, summarized."""
    bound_s = sum(cfg.worker_timeout_s(loss) for _ in systems) + 60.0
    point: dict[str, Any] = {"loss": loss}
    with (
        cfg.network(loss, bound_s) as net,
        tempfile.TemporaryDirectory(prefix="lta-bench-lossy-") as tmp,
    ):
        for system in systems:
            before = _counter_totals(net)
            if system == "gloo":
                ranks = run_gloo(net, cfg, loss, progress)
            else:
                ranks = run_lta(net, cfg, loss, Path(tmp), progress)
            point[system] = summarize_system(system, cfg, ranks)
            point[system]["measured_loss"] = measured_loss(before, _counter_totals(net))
    if "gloo" in point and "lta" in point:
        point["ratios"] = ratios(point["gloo"], point["lta"])
    return point


def summarize_system(system: str, cfg: LossyConfig, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    times = slowest_rank([r["times_s"] for r in ranks])
    if system == "gloo":
        wire = gloo_wire_bytes(4 * cfg.n_values, cfg.workers, cfg.mtu)
        return summarize_times(times, link_limit_ms(wire, cfg.rate_mbit)) | {"wire_bytes_per_worker": wire}
    wire = lta_wire_bytes(cfg.n_values, cfg.k, exp_copies=2)
    out = summarize_times(times, link_limit_ms(wire, cfg.rate_mbit)) | {"wire_bytes_per_worker": wire}
    chunks = {key: sum(r["chunks"][key] for r in ranks) for key in ("full", "partial", "fallback")}
    transport = {key: sum(r["transport"][key] for r in ranks) for key in ("flushes_sent", "results_retx")}
    return out | {
        "chunks": chunks,
        "chunks_checked": sum(r["chunks_checked"] for r in ranks),
        "worst_error_over_tolerance": max(r["worst_error_over_tolerance"] for r in ranks),
        "exact": all(r["worst_error_over_tolerance"] < 1.0 for r in ranks),
        "srtt_ms": [r["srtt_ms"] for r in ranks],
        "transport": transport,
    }


def bench_lossy(
    cfg: LossyConfig,
    losses: Sequence[float],
    systems: Sequence[str],
    plot: str | None,
    progress: Progress | None = None,
) -> dict:
    """Every loss point in turn; ``progress`` (default: the log) hears of each point and of rank 0's
    progress through each system's run."""
    from mininet_topos.netns import remove_stale

    report = progress or log.info
    remove_stale()
    points = []
    for i, loss in enumerate(losses):
        report(f"[{i + 1}/{len(losses)}] loss {loss:g}, {format_rate(cfg.rate_mbit)}")
        points.append(run_point(cfg, loss, systems, report))
    out = {
        "config": {
            "workers": cfg.workers,
            "mib": cfg.mib,
            "rate_mbit": cfg.rate_mbit,
            "rate": format_rate(cfg.rate_mbit),
            "tbf_burst_bytes": cfg.tbf_burst,
            "tbf_latency_ms": TBF_QUEUE_MS,
            "tbf_limit_bytes": tbf_limit_bytes(cfg.rate_mbit, cfg.tbf_burst),
            "iters": cfg.iters,
            "warmup": cfg.warmup,
            "mtu": cfg.mtu,
            "elems_per_packet": cfg.k,
            "window": cfg.units_in_flight,
            "min_deadline_ms": cfg.deadline_ms,
            "loss_applied": "nftables, per worker link, each direction",
            "gloo_wire": "ring: 2(N-1)/N x tensor in MTU-52-byte TCP segments + 1 ACK per 2 segments",
            "lta_wire": f"(chunks + 2 x exponent units) x {lta_frame_bytes(cfg.k)}-byte frames",
        },
        "points": points,
    }
    if plot:
        plot_percentiles(points, systems, plot)
        out["plot"] = plot
    return out


def plot_percentiles(points: list[dict[str, Any]], systems: Sequence[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.arange(len(points))
    styles = {"p50_ms": ("o", "-"), "p99_ms": ("s", "--"), "p99_9_ms": ("^", ":")}
    colors = {"gloo": "tab:red", "lta": "tab:blue"}
    for system in systems:
        for name, (marker, line) in styles.items():
            label = f"{system} {name[:-3].replace('_', '.')}"
            ax.plot(x, [p[system][name] for p in points], marker=marker, linestyle=line, color=colors[system],
                    label=label)  # fmt: skip
        ax.plot(x, [p[system]["link_limit_ms"] for p in points], color=colors[system], alpha=0.3, linewidth=4,
                label=f"{system} link limit")  # fmt: skip
    ax.set_xticks(x, [f"{p['loss'] * 100:g}%" for p in points])
    ax.set_yscale("log")
    ax.set_xlabel("packet loss per link and direction")
    ax.set_ylabel("time per allreduce (ms)")
    ax.set_title("allreduce time under kernel-applied loss: lta vs gloo")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- CLI -----------------------------------------------------------------------------------------
def rate_arg(text: str) -> float:
    """``--rate`` for argparse: :func:`parse_rate_mbit`, its error as argparse's."""
    try:
        return parse_rate_mbit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--rate: ")) from None


def systems_arg(text: str) -> list[str]:
    """``--systems``: gloo and/or lta, comma-separated, in the order given."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(systems) - {"gloo", "lta"})
    if unknown or not systems:
        raise argparse.ArgumentTypeError(f"takes gloo and/or lta (e.g. gloo,lta), got {text!r}")
    return systems


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lossy",
        help="lta vs gloo on rate-limited, lossy links in network namespaces (root)",
        description="lta against gloo allreduce on rate-limited links in network namespaces, where "
        "the kernel drops packets (nftables) at each loss rate. Needs root.",
    )
    p.add_argument("--workers", type=argtypes.workers, default=2, help=f"worker namespaces, 1..{MAX_WORKERS}")
    p.add_argument(
        "--mib",
        type=argtypes.float_range(0.0, low_open=True, what="MiB"),
        default=1.0,
        help="tensor size in MiB of float32 (> 0)",
    )
    p.add_argument(
        "--loss",
        type=argtypes.csv_of(argtypes.probability, "loss rates"),
        default=[float(v) for v in DEFAULT_LOSSES.split(",")],
        help="comma-separated loss rates per link and direction, each in [0, 1]",
    )
    p.add_argument(
        "--rate",
        "--rate-mbit",
        dest="rate",
        type=rate_arg,
        default=DEFAULT_RATE,
        metavar="RATE",
        help=f"tbf rate of every worker link, both directions ({RATE_HELP}; default {DEFAULT_RATE})",
    )
    p.add_argument(
        "--iters",
        type=argtypes.positive_int,
        default=500,
        help=f"timed allreduces per system and loss rate (p99.9 needs >= {P99_9_MIN_ITERS})",
    )
    p.add_argument("--warmup", type=argtypes.nonnegative_int, default=10, help="untimed allreduces first")
    p.add_argument(
        "--mtu",
        type=argtypes.int_range(68, 65535, "MTU"),
        default=DEFAULT_MTU,
        help="link MTU in bytes, 68..65535 (9000: jumbo frames)",
    )
    p.add_argument(
        "--elems-per-packet",
        type=argtypes.int_range(1, MAX_ELEMS_PER_PACKET, "elements per packet"),
        help="K (default: the largest power of two the MTU fits)",
    )
    p.add_argument(
        "--window",
        type=argtypes.positive_int,
        help=f"lta units in flight per worker (default: the frames the link carries in {WINDOW_RTT_MS:g} ms, "
        "+ 1: 8 at 200 Mbit/s, 32 at 1 Gbit/s)",
    )
    p.add_argument(
        "--min-deadline-ms",
        type=argtypes.float_range(0.0, low_open=True, what="deadline"),
        help="lta FLUSH deadline floor, ms (default: one window at the link rate + 1 ms)",
    )
    p.add_argument("--systems", type=systems_arg, default=["gloo", "lta"], help="which systems to run")
    p.add_argument("--seed", type=argtypes.nonnegative_int, default=0, help="seed of the inputs")
    p.add_argument("--plot", default="", help="PNG of the time percentiles against loss ('' for none)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=run_cli)


def config_from_args(args: argparse.Namespace) -> LossyConfig:
    """The run's settings from parsed arguments (ranges checked by the parser's types); UsageError
    (one line) for a combination that cannot be used."""
    cfg = LossyConfig(
        workers=args.workers, mib=args.mib, rate_mbit=args.rate, iters=args.iters, warmup=args.warmup,
        mtu=args.mtu, elems_per_packet=args.elems_per_packet, window=args.window,
        min_deadline_ms=args.min_deadline_ms, seed=args.seed,
    )  # fmt: skip
    if IPV4_BYTES + UDP_BYTES + HEADER_BYTES + 4 * cfg.k > cfg.mtu:
        raise UsageError(f"lossy --elems-per-packet {cfg.k} does not fit an MTU of {cfg.mtu} bytes")
    return cfg


def require_root_or_say(command: str = "lta bench lossy") -> None:
    """Namespaces need root, iproute2 and nftables: a one-line user error otherwise (not a traceback from
    inside ``ip netns exec``)."""
    from mininet_topos.netns import missing_tools, require_root

    try:
        require_root()
    except PermissionError as exc:
        raise LtaError(str(exc)) from None
    missing = missing_tools()
    if missing:
        raise LtaError(
            f"{command} needs {', '.join(missing)} (not installed): apt-get install -y iproute2 nftables"
        )


def run_cli(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # every flag is checked before anything is built
    require_root_or_say()
    title = (
        f"lta bench lossy: {cfg.workers} workers, {cfg.mib:g} MiB, {format_rate(cfg.rate_mbit)}, "
        f"loss {','.join(f'{p:g}' for p in args.loss)}: {' and '.join(args.systems)}, "
        f"{cfg.iters} allreduces per point"
    )
    with Status(title) as status:
        out = bench_lossy(cfg, args.loss, args.systems, args.plot or None, status.update)
    if args.json:
        emit(SCHEMA, out)
    else:
        print(format_table(out, args.systems))
    return 0


def format_table(out: dict[str, Any], systems: Sequence[str]) -> str:
    c = out["config"]
    few = f" (p99.9 needs >= {P99_9_MIN_ITERS})" if c["iters"] < P99_9_MIN_ITERS else ""
    lines = [
        f"{c['workers']} workers, {c['mib']:g} MiB, {format_rate(c['rate_mbit'])} per link and direction "
        f"(tbf burst {c['tbf_burst_bytes']} B), MTU {c['mtu']}, K={c['elems_per_packet']}, "
        f"window {c['window']}, min deadline {c['min_deadline_ms']:.2f} ms, {c['iters']} allreduces per "
        f"point{few}",
        f"{'loss':>6s} {'system':6s} {'mean':>7s} {'p50':>7s} {'p99':>7s} {'p99.9':>7s} {'max':>7s} "
        f"{'limit':>6s} {'p50/lim':>7s}  (ms)",
    ]
    for p in out["points"]:
        for system in systems:
            s = p[system]
            lines.append(
                f"{p['loss']:6.3f} {system:6s} {s['mean_ms']:7.1f} {s['p50_ms']:7.1f} {s['p99_ms']:7.1f} "
                f"{s['p99_9_ms']:7.1f} {s['max_ms']:7.1f} {s['link_limit_ms']:6.1f} "
                f"{s['p50_over_limit']:7.2f}"
            )
        if "ratios" in p:
            r = p["ratios"]
            lines.append(
                f"{'':6s} gloo/lta  p50 {r['gloo_over_lta_p50']:.2f}  p99 {r['gloo_over_lta_p99']:.2f}  "
                f"p99.9 {r['gloo_over_lta_p99_9']:.2f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(worker_cli())
