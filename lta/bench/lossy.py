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

**Deadlines.** A jumbo-frame link at 200 Mbit/s serializes a frame in 0.33 ms and the namespaces'
own round trip is below a millisecond, so lta's default 20 ms floor on its FLUSH deadline (made for
loaded loopback) would dominate the tail of every reduce that loses a packet. The bench caps the
units in flight (``--window``, default 16: enough to keep the link busy through one softswitch round
trip, few enough that a unit's RTT is not inflated by a queue of its own packets in tbf; measured
smoothed RTT 4-7 ms on this harness, against 20-40 ms with the uncapped window of 256) and sets
``min_deadline_ms`` to one window serialized at the link rate plus 1 ms for the softswitch
(``W · frame_time + 1``: 6.3 ms here). The RTO above that floor is the transport's own
``srtt + 4 · rttvar``. Losses inside a reduce are flushed at once from the other workers' progress
(the transport's fast flush); only a loss among the last units of a reduce waits for the RTO.

Worker processes run ``python -m lta.bench.lossy {gloo,lta}-worker``; they print ``ready``, wait
for ``go`` on stdin (so every rank starts together), and print one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hostlib.protocol import HEADER_BYTES, LTA_PORT, MAX_ELEMS_PER_PACKET

if TYPE_CHECKING:
    from hostlib.transport import TransportConfig

ETH_BYTES = 14  # what tbf counts besides the IP packet
IPV4_BYTES = 20
UDP_BYTES = 8
TCP_BYTES = 32  # 20 + the 12-byte timestamp option Linux puts on every segment
TCP_ACK_FRAME_BYTES = ETH_BYTES + IPV4_BYTES + TCP_BYTES
DEFAULT_LOSSES = "0,0.001,0.01,0.05"
DEFAULT_MTU = 9000
DEFAULT_WINDOW = 16
WORKER_PORT_BASE = 41000  # worker w binds <its ip>:WORKER_PORT_BASE + w
GLOO_PORT = 29500
JOB_ID = 1
PERCENTILES = (("p50_ms", 50.0), ("p99_ms", 99.0), ("p99_9_ms", 99.9))
INPUT_ROUNDS = 4  # distinct seeded inputs, cycled: enough to vary the values, cheap to regenerate
REPO = Path(__file__).resolve().parents[1]
HOST_DEV = "eth0"  # each worker namespace's one interface (mininet_topos.netns)
START_TIMEOUT_S = 60.0  # from launch to "ready": imports, binding, gloo's rendezvous


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


def transport_config(args: argparse.Namespace) -> TransportConfig:
    """The transport settings both lossy benchmarks use (K, window and deadline fitted to the link)."""
    from hostlib.transport import TransportConfig

    return TransportConfig(
        elems_per_packet=args.elems_per_packet,
        window=args.window,
        min_deadline_ms=args.min_deadline_ms,
        initial_deadline_ms=max(args.min_deadline_ms, 10.0),
        seed=args.seed,
    )


def lta_worker_main(args: argparse.Namespace) -> dict[str, Any]:
    from hostlib.transport import LtaWorker
    from hostlib.verify import check_result

    config = transport_config(args)
    inputs = worker_inputs(args.seed, args.workers, args.values)
    switch_host, _, switch_port = args.switch.rpartition(":")
    bind_host, _, bind_port = args.bind.rpartition(":")
    times, worst, checked = [], 0.0, 0
    chunks = {"full": 0, "partial": 0, "fallback": 0}
    with LtaWorker(
        JOB_ID, args.rank, args.workers, (switch_host, int(switch_port)), config=config,
        bind=(bind_host, int(bind_port)),
    ) as worker:  # fmt: skip
        _wait_for_go()
        for i in range(args.warmup + args.iters):
            x = inputs[i % INPUT_ROUNDS]
            t0 = time.perf_counter()
            result = worker.allreduce(x[args.rank], step=i)
            elapsed = time.perf_counter() - t0
            if i < args.warmup:
                continue
            times.append(elapsed)
            n_checked, err = check_result(result, x, args.elems_per_packet)
            checked, worst = checked + n_checked, max(worst, err)
            chunks["full"] += int(np.sum(result.count == args.workers))
            chunks["partial"] += int(np.sum((result.count > 0) & (result.count < args.workers)))
            chunks["fallback"] += int(np.sum(result.fallback != 0))
        stats = worker.stats.as_dict()
    stats.pop("reduce_ms")
    return {
        "rank": args.rank,
        "times_s": times,
        "chunks": chunks,
        "chunks_checked": checked,
        "worst_error_over_tolerance": worst,
        "srtt_ms": worker.srtt_ms,
        "rttvar_ms": worker.rttvar_ms,
        "transport": stats,
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
    window: int = DEFAULT_WINDOW
    min_deadline_ms: float | None = None  # None: deadline_floor_ms
    seed: int = 0

    @property
    def n_values(self) -> int:
        return int(self.mib * (1 << 20) / 4)

    @property
    def k(self) -> int:
        return self.elems_per_packet or elems_for_mtu(self.mtu)

    @property
    def deadline_ms(self) -> float:
        if self.min_deadline_ms is not None:
            return self.min_deadline_ms
        return deadline_floor_ms(self.k, self.window, self.rate_mbit)

    def worker_timeout_s(self, loss: float) -> float:
        """A generous bound on one system's run: 1 s per allreduce under loss, plus start-up."""
        return 120.0 + (self.iters + self.warmup) * (0.2 + 4 * loss)


class WorkerGroup:
    """Worker processes in their namespaces: start, release together, collect one JSON line each."""

    def __init__(self, net: Any, argvs: Sequence[tuple[Any, list[str]]], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.procs = [
            net.run_in(
                host,
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            for host, argv in argvs
        ]

    def run(self) -> list[dict[str, Any]]:
        start_by = time.monotonic() + START_TIMEOUT_S
        for rank, proc in enumerate(self.procs):
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, start_by - time.monotonic()))
            line = proc.stdout.readline().strip() if ready else "(nothing)"
            if line != "ready":
                raise RuntimeError(f"bench worker {rank} did not start: {self._failure(proc, line)}")
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        deadline = time.monotonic() + self.timeout_s
        results = []
        for rank, proc in enumerate(self.procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"bench worker {rank} gave no result within {self.timeout_s:.0f} s (a hung allreduce? "
                    "rerun with fewer --iters to see its stderr)"
                ) from None
            if proc.returncode != 0:
                raise RuntimeError(f"bench worker {rank} failed ({proc.returncode}):\n{err.strip()[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results

    @staticmethod
    def _failure(proc: subprocess.Popen[str], line: str) -> str:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        return f"printed {line!r}; stderr:\n{err.strip()[-3000:]}"


def _worker_argv(system: str, cfg: LossyConfig, rank: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "lta.bench.lossy", system, "--rank", str(rank),
        "--workers", str(cfg.workers), "--values", str(cfg.n_values), "--iters", str(cfg.iters),
        "--warmup", str(cfg.warmup), "--seed", str(cfg.seed), *extra,
    ]  # fmt: skip


def run_gloo(net: Any, cfg: LossyConfig, loss: float) -> list[dict[str, Any]]:
    master = f"{net.workers[0].ip}:{GLOO_PORT}"
    argvs = [(h, _worker_argv("gloo-worker", cfg, r, "--master", master)) for r, h in enumerate(net.workers)]
    return WorkerGroup(net, argvs, cfg.worker_timeout_s(loss)).run()


def softswitch_toml(cfg: LossyConfig, worker_addrs: Sequence[str]) -> str:
    workers = ", ".join(f'"{a}"' for a in worker_addrs)
    return (
        f"seed = {cfg.seed}\n[[jobs]]\njob_id = {JOB_ID}\nworkers = [{workers}]\nelems_per_packet = {cfg.k}\n"
    )


@contextlib.contextmanager
def softswitch_in(
    net: Any, cfg: LossyConfig, worker_addrs: Sequence[str], listen: str, workdir: Path
) -> Iterator[subprocess.Popen[str]]:
    """``lta softswitch`` in the aggregator namespace with one job for ``worker_addrs``; stopped after."""
    config = workdir / "softswitch.toml"
    config.write_text(softswitch_toml(cfg, worker_addrs))
    switch = net.run_in(
        net.aggregator,
        [sys.executable, "-m", "lta.cli", "softswitch", "--listen", listen, "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    assert switch.stdout is not None and switch.stderr is not None
    ready, _, _ = select.select([switch.stdout], [], [], START_TIMEOUT_S)
    line = switch.stdout.readline() if ready else "(nothing)"
    if "listening" not in line:
        switch.kill()
        raise RuntimeError(
            f"softswitch did not start in {net.aggregator.netns}: printed {line!r}; {switch.stderr.read()}"
        )
    try:
        yield switch
    finally:
        switch.terminate()
        switch.wait(timeout=10)


def run_lta(net: Any, cfg: LossyConfig, loss: float, workdir: Path) -> list[dict[str, Any]]:
    addrs = [f"{h.ip}:{WORKER_PORT_BASE + r}" for r, h in enumerate(net.workers)]
    switch_addr = f"{net.aggregator.ip}:{LTA_PORT}"
    extra = ["--switch", switch_addr, "--elems-per-packet", str(cfg.k), "--window", str(cfg.window),
             "--min-deadline-ms", f"{cfg.deadline_ms:g}"]  # fmt: skip
    argvs = [
        (h, _worker_argv("lta-worker", cfg, r, "--bind", addrs[r], *extra)) for r, h in enumerate(net.workers)
    ]
    with softswitch_in(net, cfg, addrs, switch_addr, workdir):
        return WorkerGroup(net, argvs, cfg.worker_timeout_s(loss)).run()


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


def run_point(cfg: LossyConfig, loss: float, systems: Sequence[str]) -> dict[str, Any]:
    """One loss rate: a fresh network, each system over it in turn, summarized."""
    from mininet_topos.linkshape import LinkSpec
    from mininet_topos.netns import NetnsNetwork

    link = LinkSpec.symmetric(loss, rate_mbit=cfg.rate_mbit)
    bound_s = sum(cfg.worker_timeout_s(loss) for _ in systems) + 60.0
    point: dict[str, Any] = {"loss": loss}
    with (
        NetnsNetwork(cfg.workers, link, mtu=cfg.mtu, loss_backend="nftables", max_runtime_s=bound_s) as net,
        tempfile.TemporaryDirectory(prefix="lta-bench-lossy-") as tmp,
    ):
        for system in systems:
            before = _counter_totals(net)
            ranks = run_gloo(net, cfg, loss) if system == "gloo" else run_lta(net, cfg, loss, Path(tmp))
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


def bench_lossy(cfg: LossyConfig, losses: Sequence[float], systems: Sequence[str], plot: str | None) -> dict:
    from mininet_topos.netns import remove_stale

    remove_stale()
    points = [run_point(cfg, p, systems) for p in _progress(losses)]
    out = {
        "config": {
            "workers": cfg.workers,
            "mib": cfg.mib,
            "rate_mbit": cfg.rate_mbit,
            "iters": cfg.iters,
            "warmup": cfg.warmup,
            "mtu": cfg.mtu,
            "elems_per_packet": cfg.k,
            "window": cfg.window,
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


def _progress(losses: Sequence[float]) -> Iterator[float]:
    for i, p in enumerate(losses):
        print(f"[{i + 1}/{len(losses)}] loss {p:g}", file=sys.stderr, flush=True)
        yield p


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
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lossy", help="lta vs gloo on rate-limited, lossy links in network namespaces (root)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mib", type=float, default=1.0, help="tensor size in MiB of float32")
    p.add_argument("--loss", default=DEFAULT_LOSSES, help="comma-separated loss rates per link and direction")
    p.add_argument("--rate-mbit", type=float, default=200.0)
    p.add_argument("--iters", type=int, default=500, help="timed allreduces per system and loss rate")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU, help="link MTU (jumbo frames by default)")
    p.add_argument("--elems-per-packet", type=int, help="K (default: the largest power of two the MTU fits)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="lta units in flight per worker")
    p.add_argument("--min-deadline-ms", type=float, help="lta FLUSH deadline floor (default: from the link)")
    p.add_argument("--systems", default="gloo,lta", help="which systems to run (gloo,lta)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="", help="PNG of the time percentiles against loss")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_cli)


def config_from_args(args: argparse.Namespace) -> LossyConfig:
    return LossyConfig(
        workers=args.workers, mib=args.mib, rate_mbit=args.rate_mbit, iters=args.iters, warmup=args.warmup,
        mtu=args.mtu, elems_per_packet=args.elems_per_packet, window=args.window,
        min_deadline_ms=args.min_deadline_ms, seed=args.seed,
    )  # fmt: skip


def run_cli(args: argparse.Namespace) -> int:
    from mininet_topos.netns import require_root

    require_root()
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - {"gloo", "lta"}
    if unknown or not systems:
        raise SystemExit(f"--systems takes gloo and/or lta, got {args.systems!r}")
    losses = [float(v) for v in args.loss.split(",") if v]
    out = bench_lossy(config_from_args(args), losses, systems, args.plot or None)
    if args.json:
        print(json.dumps(out))
    else:
        print(format_table(out, systems))
    return 0


def format_table(out: dict[str, Any], systems: Sequence[str]) -> str:
    c = out["config"]
    lines = [
        f"{c['workers']} workers, {c['mib']:g} MiB, {c['rate_mbit']:g} Mbit/s, MTU {c['mtu']}, "
        f"K={c['elems_per_packet']}, window {c['window']}, min deadline {c['min_deadline_ms']:.2f} ms, "
        f"{c['iters']} allreduces per point",
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
