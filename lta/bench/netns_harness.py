"""The network-namespace harness every shaped-link benchmark runs on (``lta bench lossy``, ``ltp``,
``lossy-train``, the ``lossy_tail`` study).

For each loss rate a :class:`LossyConfig` builds a fresh :class:`~mininet_topos.netns.NetnsNetwork`:
N worker namespaces and an aggregator on a bridge, every worker link shaped by tbf in both directions
and losing a fraction ``p`` of TCP/UDP packets in each direction (nftables ``numgen random`` in the
bridge's forward path, invisible to both ends). The aggregator's own link is unshaped and lossless: it
stands in for a switch whose ports are not the bottleneck. Over it a benchmark starts, one after the
other, a softswitch (:func:`softswitch_in`) in the aggregator namespace and one worker process per
worker namespace (:class:`WorkerGroup`, :func:`run_lta_workers`).

**Link limit** = the bytes one worker must put on its link in one direction ÷ the link rate, with
every header tbf counts (Ethernet 14 + IPv4 20, no preamble or FCS):

- lta: every GRAD (data units and exponent units, each once: the least a worker sends, as it does on a
  quiet network, ``TransportConfig.quiet_units``; under loss its copies are extra) is one frame of
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

Worker processes run ``python -m lta.bench.netns_harness {gloo,lta}-worker`` (:func:`worker_cli`; a
benchmark with its own worker names its module in :func:`worker_argv`); they print ``ready``, wait
for ``go`` on stdin (so every rank starts together, :func:`wait_for_go`), print ``progress DONE TOTAL``
lines (rank 0, :func:`report_progress`) and end with one JSON line. Their stdout and stderr are read as
they come, so a chatty worker cannot stall on a full pipe.
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
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hostlib.errors import LtaError
from hostlib.protocol import HEADER_BYTES, LTA_PORT, MAX_ELEMS_PER_PACKET
from lta.bench.summary import time_stats

if TYPE_CHECKING:
    from hostlib.transport import TransportConfig
    from mininet_topos.linkshape import LinkSpec
    from mininet_topos.netns import NetnsNetwork

log = logging.getLogger(__name__)
Progress = Callable[[str], None]  # where progress lines go (the CLI: stderr)

ETH_BYTES = 14  # what tbf counts besides the IP packet
IPV4_BYTES = 20
UDP_BYTES = 8
TCP_BYTES = 32  # 20 + the 12-byte timestamp option Linux puts on every segment
TCP_ACK_FRAME_BYTES = ETH_BYTES + IPV4_BYTES + TCP_BYTES
DEFAULT_MTU = 9000
DEFAULT_WINDOW = 16  # the window lta bench ltp and lossy-train keep (lta bench lossy: window_for_rate)
WINDOW_RTT_MS = 2.0  # round trip of a unit through softswitch and workers with no queue (window_for_rate)
DEFAULT_RATE = "200mbit"
TBF_QUEUE_MS = 50.0  # tbf latency: the queue holds this long at the rate, on top of the bucket
TBF_BUCKET_MS = 1.0  # the bucket holds this long at the rate (see tbf_burst_bytes) ...
TBF_MIN_BURST_BYTES = 32 * 1024  # ... but at least this much ...
TBF_MIN_BURST_FRAMES = 2  # ... and at least this many full frames
WORKER_PORT_BASE = 41000  # worker w binds <its ip>:WORKER_PORT_BASE + w
GLOO_PORT = 29500
JOB_ID = 1
INPUT_ROUNDS = 4  # distinct seeded inputs, cycled: enough to vary the values, cheap to regenerate
WORKER_MODULE = "lta.bench.netns_harness"  # what worker_argv runs by default (worker_cli)
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


def lta_wire_bytes(n_values: int, k: int, exp_copies: int = 1) -> int:
    """Bytes one worker sends up per allreduce: every data GRAD and ``exp_copies`` of each exponent GRAD
    (the default, one: the link limit counts what a worker must send)."""
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


def summarize_times(times_s: Sequence[float] | np.ndarray, limit_ms: float) -> dict[str, float]:
    """mean / p50 / p99 / p99.9 / max in ms (:func:`lta.bench.summary.time_stats`), the link limit, and
    p50 ÷ limit."""
    out = time_stats(times_s, ("mean", "p50", "p99", "p99_9", "max"))
    return out | {"link_limit_ms": limit_ms, "p50_over_limit": out["p50_ms"] / limit_ms}


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


def wait_for_go() -> None:
    print("ready", flush=True)
    line = sys.stdin.readline().strip()
    if line != "go":
        raise SystemExit(f"expected 'go' on stdin, got {line!r}")


def report_progress(rank: int, done: int, total: int) -> None:
    """Rank 0 prints ``progress DONE TOTAL`` every tenth of the run (the orchestrator relays it)."""
    if rank == 0 and (done % max(1, total // PROGRESS_STEPS) == 0 or done == total):
        print(f"progress {done} {total}", flush=True)


def report_event(rank: int, name: str) -> None:
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
    from hostlib.verify import InputCheck, slack_bits

    config = transport_config(args)
    inputs = worker_inputs(args.seed, args.workers, args.values)
    slack = slack_bits(config)
    checks = [InputCheck(x, args.elems_per_packet, slack=slack) for x in inputs]  # each round's, once
    switch_host, _, switch_port = args.switch.rpartition(":")
    bind_host, _, bind_port = args.bind.rpartition(":")
    times, starts, worst, checked = [], [], 0.0, 0
    chunks = {"full": 0, "partial": 0, "fallback": 0, "critical": 0, "critical_full": 0}
    n_chunks = math.ceil(args.values / args.elems_per_packet)
    every = getattr(args, "critical_every", 0)
    critical = np.arange(n_chunks) % every == 0 if every else None
    with LtaWorker(
        JOB_ID, args.rank, args.workers, (switch_host, int(switch_port)), config=config,
        bind=(bind_host, int(bind_port)), trace=getattr(args, "trace", None),
    ) as worker:  # fmt: skip
        wait_for_go()
        window_s = [0.0, 0.0]  # wall-clock bounds of the timed allreduces (TCP competitor's window)
        stats_before = worker.stats.as_dict()
        for i in range(args.warmup + args.iters):
            x = inputs[i % INPUT_ROUNDS]
            if i == args.warmup:
                report_event(args.rank, "timed-start")
                window_s[0] = time.time()
                stats_before = worker.stats.as_dict()
            t0 = time.monotonic()
            result = worker.allreduce(x[args.rank], step=i, critical=critical)
            elapsed = time.monotonic() - t0
            if i < args.warmup:
                continue
            starts.append(t0)
            times.append(elapsed)
            report_progress(args.rank, len(times), args.iters)
            n_checked, err = checks[i % INPUT_ROUNDS](result)
            checked, worst = checked + n_checked, max(worst, err)
            chunks["full"] += int(np.sum(result.count == args.workers))
            chunks["partial"] += int(np.sum((result.count > 0) & (result.count < args.workers)))
            chunks["fallback"] += int(np.sum(result.fallback != 0))
            if critical is not None:
                chunks["critical"] += int(critical.sum())
                chunks["critical_full"] += int(np.sum(result.count[critical] == args.workers))
        window_s[1] = time.time()
        report_event(args.rank, "timed-end")
        stats = worker.stats.as_dict()
    stats.pop("reduce_ms")
    before = {key: value for key, value in stats_before.items() if isinstance(value, int | float)}
    return {
        "rank": args.rank,
        "times_s": times,
        "starts_s": starts,
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
    wait_for_go()
    dist.barrier()
    times, starts = [], []
    for i in range(args.warmup + args.iters):
        y = inputs[i % INPUT_ROUNDS].clone()
        t0 = time.monotonic()
        dist.all_reduce(y)
        elapsed = time.monotonic() - t0
        if i >= args.warmup:
            starts.append(t0)
            times.append(elapsed)
            report_progress(args.rank, len(times), args.iters)
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": args.rank, "times_s": times, "starts_s": starts}


def add_worker_process_flags(
    parser: argparse.ArgumentParser,
    master_required: bool = False,
    elems_per_packet: int | None = None,
    window: int | None = None,
    min_deadline_ms: float | None = None,
) -> None:
    """The flags every worker process on the harness takes (this module's and ``lossy_train``'s): who
    it is (``--rank``, ``--workers``, ``--seed``), where gloo's store (``--master``), the softswitch
    (``--switch``) and its own socket (``--bind``) are, and lta's K, window and deadline floor."""
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--master", required=master_required, help="gloo: IP:PORT of rank 0's store")
    parser.add_argument("--switch", help="lta: IP:PORT of the softswitch")
    parser.add_argument("--bind", help="lta: IP:PORT this worker sends from")
    parser.add_argument("--elems-per-packet", type=int, default=elems_per_packet)
    parser.add_argument("--window", type=int, default=window)
    parser.add_argument("--min-deadline-ms", type=float, default=min_deadline_ms)


def worker_cli(
    argv: list[str] | None = None,
    lta_main: Callable[[argparse.Namespace], dict[str, Any]] | None = None,
    prog: str = f"python -m {WORKER_MODULE}",
) -> int:
    """One bench worker: its flags from ``argv``, its result as one JSON line on stdout. ``lta_main``
    (default :func:`lta_worker_main`) runs an ``lta-worker``: a study that traces one passes its own."""
    parser = argparse.ArgumentParser(prog=prog, description="one bench worker")
    parser.add_argument("system", choices=["lta-worker", "gloo-worker"])
    add_worker_process_flags(parser)
    parser.add_argument("--values", type=int, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--critical-every", type=int, default=0, help="lta: every Nth chunk critical (0: none)"
    )
    parser.add_argument("--pace-gbps", type=float, default=0.0, help="lta: pacing rate (0: unpaced)")
    parser.add_argument("--pace-learn", action="store_true", help="lta: learn the pacing rate")
    parser.add_argument("--early-close-theta", type=float, help="lta: adaptive early close's theta")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main = (lta_main or lta_worker_main) if args.system == "lta-worker" else gloo_worker_main
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


def worker_argv(
    system: str, cfg: LossyConfig, rank: int, *extra: str, module: str = WORKER_MODULE
) -> list[str]:
    """The command line of worker ``rank`` (``lta-worker`` or ``gloo-worker``): ``python -m module``."""
    return [
        sys.executable, "-m", module, system, "--rank", str(rank),
        "--workers", str(cfg.workers), "--values", str(cfg.n_values), "--iters", str(cfg.iters),
        "--warmup", str(cfg.warmup), "--seed", str(cfg.seed), *extra,
    ]  # fmt: skip


def run_gloo_workers(
    net: Any, cfg: LossyConfig, loss: float, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """gloo allreduces over ``net``: rendezvous at worker 0; each rank's result."""
    master = f"{net.workers[0].ip}:{GLOO_PORT}"
    argvs = [(h, worker_argv("gloo-worker", cfg, r, "--master", master)) for r, h in enumerate(net.workers)]
    return WorkerGroup(net, argvs, cfg.worker_timeout_s(loss), progress, "gloo").run()


def lta_endpoints(net: Any) -> tuple[list[str], str]:
    """Where every lta worker binds (``IP:WORKER_PORT_BASE + rank``) and where the softswitch listens."""
    addrs = [f"{h.ip}:{WORKER_PORT_BASE + r}" for r, h in enumerate(net.workers)]
    return addrs, f"{net.aggregator.ip}:{LTA_PORT}"


def lta_worker_argvs(
    net: Any,
    cfg: LossyConfig,
    window: int,
    deadline_ms: float,
    flags: Sequence[str] = (),
    module: str = WORKER_MODULE,
) -> list[tuple[Any, list[str]]]:
    """Every lta worker's namespace and command line: K from ``cfg``, ``window`` units in flight, the
    FLUSH deadline floor ``deadline_ms``; ``flags`` go to every worker."""
    addrs, switch_addr = lta_endpoints(net)
    extra = ["--switch", switch_addr, "--elems-per-packet", str(cfg.k), "--window", str(window),
             "--min-deadline-ms", f"{deadline_ms:g}", *flags]  # fmt: skip
    return [
        (h, worker_argv("lta-worker", cfg, r, "--bind", addrs[r], *extra, module=module))
        for r, h in enumerate(net.workers)
    ]


def run_lta_workers(
    net: Any,
    cfg: LossyConfig,
    loss: float,
    workdir: Path,
    window: int | None = None,
    deadline_ms: float | None = None,
    flags: Sequence[str] = (),
    progress: Progress | None = None,
    label: str = "lta",
    on_event: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """lta allreduces over ``net`` with a fresh softswitch (stopped after); each rank's result.
    ``window`` and ``deadline_ms`` default to the link's (``cfg.units_in_flight``, ``cfg.deadline_ms``);
    ``on_event`` hears rank 0's ``timed-start`` and ``timed-end``."""
    addrs, switch_addr = lta_endpoints(net)
    window = cfg.units_in_flight if window is None else window
    deadline_ms = cfg.deadline_ms if deadline_ms is None else deadline_ms
    argvs = lta_worker_argvs(net, cfg, window, deadline_ms, flags)
    with softswitch_in(net, cfg, addrs, switch_addr, workdir):
        return WorkerGroup(net, argvs, cfg.worker_timeout_s(loss), progress, label, on_event).run()


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


def measured_loss(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Fraction of packets the nftables rules dropped between two counter snapshots, per direction."""
    out: dict[str, float] = {}
    for direction in ("up", "down"):
        seen = after[f"seen_{direction}"] - before[f"seen_{direction}"]
        dropped = after[f"dropped_{direction}"] - before[f"dropped_{direction}"]
        out[f"{direction}_packets"] = seen
        out[f"{direction}_loss"] = dropped / seen if seen else 0.0
    return out


def counter_totals(net: Any) -> dict[str, int]:
    """nftables counters summed over the worker links (TCP and UDP packets seen and dropped)."""
    counters = [net.loss_counters(h) for h in net.workers]
    names = ("seen_up", "dropped_up", "seen_down", "dropped_down")
    return {name: sum(getattr(c, name) for c in counters) for name in names}


def rate_arg(text: str) -> float:
    """``--rate`` for argparse: :func:`parse_rate_mbit`, its error as argparse's."""
    try:
        return parse_rate_mbit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--rate: ")) from None


def add_rate(parser: argparse.ArgumentParser, help: str, *aliases: str) -> None:
    """``--rate`` (and ``aliases``): the tbf rate of every worker link (:func:`rate_arg`), in Mbit/s once
    parsed; ``help`` says what it shapes, the accepted spellings and the default follow it."""
    parser.add_argument(
        "--rate",
        *aliases,
        dest="rate",
        type=rate_arg,
        default=DEFAULT_RATE,
        metavar="RATE",
        help=f"{help} ({RATE_HELP}; default {DEFAULT_RATE})",
    )


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


if __name__ == "__main__":
    sys.exit(worker_cli())
