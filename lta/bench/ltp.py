"""``lta bench ltp``: LTP's three mechanisms in lta, measured where the kernel shapes and drops packets.

The links are those of ``lta bench lossy`` (:class:`~lta.bench.netns_harness.LossyConfig`: N worker
namespaces and an aggregator on a bridge, tbf at ``--rate`` in both directions of every worker link,
nftables loss), the workers its ``lta-worker`` processes, with the transport's LTP options switched on
per run. Each experiment compares runs over the same network, one after the other:

``critical``
    at ``--critical-loss`` (5%): every ``--critical-every``-th chunk marked critical against none. Reports
    the share of critical chunks that came back with every worker counted (the target: all of them) and
    what that costs in step time (p50, p99).
``pacing``
    at 0% configured loss, with a window large enough to overflow tbf's queue (``--pace-window``, the
    transport's default 256): unpaced, paced at the link rate, paced at a learned rate. Reports tbf's
    queue drops (``tc -s qdisc``, both directions of every worker link) and p50 / p99.
``tcp``
    the same three beside one TCP flow (a Python sender in worker 0's namespace, a sink on the
    aggregator) sharing worker 0's up link: each one's throughput over the timed allreduces, and TCP
    alone for reference.
``early-close``
    at each of ``--early-close-loss`` (0, 1, 5%): adaptive early close with ``--theta`` against none.
    Reports the share of units closed early (per worker), the reduces it ended, and the time saved
    (mean, p50, p99 of the slowest rank's allreduce time).

Times are per allreduce of ``--mib`` MiB, the slowest rank's (as ``lta bench lossy``). Needs root.
``python -m lta.bench.ltp tcp-sink|tcp-source`` are the TCP competitor's two ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hostlib import argtypes
from hostlib.protocol import MAX_WORKERS
from lta.bench import netns_harness as harness
from lta.bench.flags import add_iters, add_mtu, add_seed, add_warmup, add_workers, bench_command
from lta.bench.summary import report, slowest_rank
from lta.progress import Status

log = logging.getLogger(__name__)
SCHEMA = "lta.bench.ltp/1"
EXPERIMENTS = ("critical", "pacing", "tcp", "early-close")
Progress = Callable[[str], None]
TCP_PORT = 5201
TCP_RAMP_S = 2.0  # the TCP flow runs this long before lta starts (slow start, a full queue)
TCP_ALONE_S = 4.0
SINK_SAMPLE_S = 0.02  # the sink logs its byte count this often


@dataclass(frozen=True)
class LtpConfig:
    # workers, tensor, rate, window, ...
    links: harness.LossyConfig = field(default_factory=harness.LossyConfig)
    experiments: tuple[str, ...] = EXPERIMENTS
    critical_loss: float = 0.05
    critical_every: int = 20
    pace_window: int = 256
    theta: float = 0.1
    early_close_losses: tuple[float, ...] = (0.0, 0.01, 0.05)
    rounds: int = 1  # runs of each variant, interleaved (see in_rounds)

    @property
    def deadline_ms(self) -> float:
        """The FLUSH deadline floor of every run: lossy's, for its default window of 16 (one window
        serialized at the link rate + 1 ms), whatever window a run uses: with pacing there is no queue
        of a whole window to wait for, and without it the RTO measures the queue anyway."""
        return harness.deadline_floor_ms(self.links.k, harness.DEFAULT_WINDOW, self.links.rate_mbit)


# ---- one run of the lta workers -----------------------------------------------------------------
def run_lta(
    net: Any,
    cfg: LtpConfig,
    loss: float,
    workdir: Path,
    window: int,
    flags: Sequence[str],
    progress: Progress | None,
    label: str,
    on_event: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """The lta workers over ``net`` with a fresh softswitch; ``flags`` go to every worker; ``on_event``
    hears rank 0's ``timed-start`` and ``timed-end``."""
    return harness.run_lta_workers(
        net, cfg.links, loss, workdir, window, cfg.deadline_ms, flags, progress, label, on_event
    )


def summarize(cfg: LtpConfig, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One variant over its rounds (each a list of the ranks' results): times of the slowest rank per
    allreduce, pooled, and the LTP counters of the timed allreduces, summed."""
    links = cfg.links
    wire = harness.lta_wire_bytes(links.n_values, links.k)
    times = [t for ranks in runs for t in slowest_rank([r["times_s"] for r in ranks])]
    out: dict[str, Any] = dict(harness.summarize_times(times, harness.link_limit_ms(wire, links.rate_mbit)))
    every = [r for ranks in runs for r in ranks]
    timed = [r["timed"] for r in every]

    def total(key: str) -> float:
        return float(sum(t[key] for t in timed))

    reduces = len(times) * links.workers  # allreduces summed over the ranks
    chunks = {key: sum(r["chunks"][key] for r in every) for key in every[0]["chunks"]}
    unit_slots = links.iters * sum(r["units_per_reduce"] for r in every)
    spans = sum(_span(ranks[0]["wall_window_s"]) for ranks in runs)
    sent = sum(ranks[0]["timed"]["packets_sent"] for ranks in runs)
    closes = total("early_closes_theta") + total("early_closes_deadline")
    out |= {
        "rounds": len(runs),
        "chunks": chunks,
        "exact": all(r["worst_error_over_tolerance"] < 1.0 for r in every),
        "flushes_sent": total("flushes_sent"),
        "critical_resends": total("critical_resends"),
        "early_closes": closes,
        "reduces_closed_early_fraction": closes / reduces,
        "units_closed_early_fraction": total("units_closed_early") / unit_slots,
        "deadline_cut_ms_per_reduce": total("early_close_deadline_cut_ms") / reduces,
        "srtt_ms": [r["srtt_ms"] for r in every],
        "rtprop_ms": [r["rtprop_ms"] for r in every],
        "pace_rate_mbit": [r["pace_rate_bps"] / 1e6 for r in every],
        "learned_rate_mbit": [r["learned_rate_bps"] / 1e6 for r in every],
        "wall_windows_s": [ranks[0]["wall_window_s"] for ranks in runs],
        "tensor_mbit_per_s": len(times) * links.n_values * 4 * 8 / 1e6 / spans,
        "worker0_wire_mbit_per_s": sent * harness.lta_frame_bytes(links.k) * 8 / 1e6 / spans,
    }
    if chunks.get("critical"):
        out["critical_full_fraction"] = chunks["critical_full"] / chunks["critical"]
    return out


def in_rounds(
    cfg: LtpConfig,
    variants: Sequence[tuple[str, list[str]]],
    one_run: Callable[[str, list[str]], list[dict[str, Any]]],
    progress: Progress,
    what: str,
) -> dict[str, list[list[dict[str, Any]]]]:
    """``cfg.rounds`` runs of every variant, the order reversed every other round (A B B A A B ...): on a
    shared machine the load drifts over minutes, and interleaving spreads it over the variants."""
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name, _ in variants}
    for r in range(cfg.rounds):
        for name, flags in variants if r % 2 == 0 else list(reversed(variants)):
            progress(f"{what}: {name}, round {r + 1}/{cfg.rounds}")
            runs[name].append(one_run(name, flags))
    return runs


def _span(window: Sequence[float]) -> float:
    return max(window[1] - window[0], 1e-9)


# ---- tbf's queue drops --------------------------------------------------------------------------
def tbf_drops(net: Any) -> dict[str, int]:
    """Packets tbf dropped so far, summed over the worker links: up (each worker's eth0) and down (its
    bridge port)."""
    totals = {"up": 0, "down": 0}
    for host in net.workers:
        for direction, ns, dev in (("up", host.netns, host.dev), ("down", net.switch_ns, net.port_of(host))):
            listing = json.loads(net.check(ns, ["tc", "-s", "-j", "qdisc", "show", "dev", dev]))
            totals[direction] += sum(int(q.get("drops", 0)) for q in listing if q.get("kind") == "tbf")
    return totals


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in before}


# ---- the TCP competitor -------------------------------------------------------------------------
def tcp_sink_main(listen: str, log_path: str) -> int:
    """Accept one connection on ``listen``, read until it closes (or SIGTERM), logging ``time bytes``
    lines (wall clock, bytes so far) to ``log_path`` every ``SINK_SAMPLE_S``."""
    host, _, port = listen.rpartition(":")
    server = socket.create_server((host, int(port)))
    print("ready", flush=True)
    conn, _ = server.accept()
    buf = bytearray(1 << 20)
    total, next_log = 0, 0.0
    with open(log_path, "w") as out:
        try:
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                total += n
                now = time.time()
                if now >= next_log:
                    out.write(f"{now:.6f} {total}\n")
                    out.flush()
                    next_log = now + SINK_SAMPLE_S
        finally:
            out.write(f"{time.time():.6f} {total}\n")
    return 0


def tcp_source_main(to: str, seconds: float) -> int:
    """Send as fast as TCP allows to ``to`` for ``seconds``."""
    host, _, port = to.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=10)
    block = bytes(1 << 20)
    end = time.monotonic() + seconds
    with contextlib.suppress(OSError):
        while time.monotonic() < end:
            conn.sendall(block)
    conn.close()
    return 0


def tcp_rate_mbit(log_text: str, window: Sequence[float]) -> float:
    """TCP's goodput over ``window`` (wall-clock seconds) from the sink's ``time bytes`` samples."""
    samples = np.array([[float(v) for v in line.split()] for line in log_text.splitlines() if line.strip()])
    if len(samples) < 2:
        return 0.0
    got = np.interp(window, samples[:, 0], samples[:, 1])
    return float((got[1] - got[0]) * 8 / 1e6 / _span(window))


@contextlib.contextmanager
def tcp_flow(net: Any, workdir: Path, seconds: float) -> Iterator[Path]:
    """One TCP flow from worker 0 to the aggregator for up to ``seconds``; yields the sink's log."""
    log_path = workdir / "tcp-sink.log"
    listen = f"{net.aggregator.ip}:{TCP_PORT}"
    here = [sys.executable, "-m", "lta.bench.ltp"]
    sink = net.run_in(net.aggregator, [*here, "tcp-sink", "--listen", listen, "--log", str(log_path)],
                      stdout=subprocess.PIPE, text=True, cwd=harness.REPO)  # fmt: skip
    assert sink.stdout is not None
    ready, _, _ = select.select([sink.stdout], [], [], harness.START_TIMEOUT_S)
    if not ready or "ready" not in sink.stdout.readline():
        sink.kill()
        raise RuntimeError(f"the TCP sink did not start in {net.aggregator.netns}")
    source = net.run_in(net.workers[0], [*here, "tcp-source", "--to", listen, "--seconds", f"{seconds:g}"],
                        cwd=harness.REPO)  # fmt: skip
    try:
        yield log_path
    finally:
        for proc in (source, sink):
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


# ---- the experiments ----------------------------------------------------------------------------
def experiment_critical(cfg: LtpConfig, workdir: Path, progress: Progress) -> dict[str, Any]:
    loss = cfg.critical_loss
    out: dict[str, Any] = {"loss": loss, "critical_every": cfg.critical_every}
    variants = [("none", []), ("critical", ["--critical-every", str(cfg.critical_every)])]
    with cfg.links.network(loss, 2 * cfg.rounds * cfg.links.worker_timeout_s(loss) + 60) as net:

        def one_run(name: str, flags: list[str]) -> list[dict[str, Any]]:
            return run_lta(net, cfg, loss, workdir, cfg.links.units_in_flight, flags, progress, name)

        runs = in_rounds(cfg, variants, one_run, progress, f"critical at loss {loss:g}")
    for name, _ in variants:
        out[name] = summarize(cfg, runs[name])
    base, crit = out["none"], out["critical"]
    out["critical_full_fraction"] = crit.get("critical_full_fraction", 0.0)
    out["critical_chunks"] = crit["chunks"]["critical"]
    out["p50_cost_ms"] = crit["p50_ms"] - base["p50_ms"]
    out["p99_cost_ms"] = crit["p99_ms"] - base["p99_ms"]
    out["p99_ratio"] = crit["p99_ms"] / base["p99_ms"]
    return out


PACE_SHARE = 0.95  # the "paced" run's rate, of the link's: room for the queue to drain after bursts


def _pacing_runs(cfg: LtpConfig) -> list[tuple[str, list[str]]]:
    rate_gbps = PACE_SHARE * cfg.links.rate_mbit / 1000.0
    return [("unpaced", []), ("paced", ["--pace-gbps", f"{rate_gbps:g}"]), ("learned", ["--pace-learn"])]


def experiment_pacing(cfg: LtpConfig, workdir: Path, progress: Progress, tcp: bool) -> dict[str, Any]:
    variants = _pacing_runs(cfg)
    out: dict[str, Any] = {"loss": 0.0, "window": cfg.pace_window}
    per_run = cfg.links.worker_timeout_s(0.0) + TCP_RAMP_S
    extras: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    with cfg.links.network(0.0, cfg.rounds * len(variants) * per_run + TCP_ALONE_S + 120) as net:
        if tcp:
            progress("tcp: alone")
            with tcp_flow(net, workdir, TCP_ALONE_S + 1) as sink_log:
                t0 = time.time() + TCP_RAMP_S / 2
                time.sleep(TCP_ALONE_S)
                out["tcp_alone_mbit_per_s"] = tcp_rate_mbit(sink_log.read_text(), (t0, time.time()))

        def one_run(name: str, flags: list[str]) -> list[dict[str, Any]]:
            before = tbf_drops(net)
            marks: dict[str, dict[str, int]] = {}

            def mark(event: str) -> None:
                marks[event] = tbf_drops(net)

            extra: dict[str, Any] = {}
            if tcp:
                with tcp_flow(net, workdir, per_run) as sink_log:
                    time.sleep(TCP_RAMP_S)
                    ranks = run_lta(net, cfg, 0.0, workdir, cfg.pace_window, flags, progress, name, mark)
                    time.sleep(0.2)
                window = ranks[0]["wall_window_s"]
                extra["tcp_mbit"] = tcp_rate_mbit(sink_log.read_text(), window) * _span(window)
            else:
                ranks = run_lta(net, cfg, 0.0, workdir, cfg.pace_window, flags, progress, name, mark)
            # all of the run (warm-up included), and the timed allreduces only
            extra["drops"] = _delta(before, tbf_drops(net))
            extra["drops_timed"] = _delta(marks["timed-start"], marks["timed-end"])
            extras[name].append(extra)
            return ranks

        runs = in_rounds(cfg, variants, one_run, progress, "tcp" if tcp else "pacing")
    for name, _ in variants:
        summary = summarize(cfg, runs[name])
        for key in ("drops", "drops_timed"):
            summary[f"tbf_{key}"] = {d: sum(e[key][d] for e in extras[name]) for d in ("up", "down")}
        if tcp:
            spans = sum(_span(w) for w in summary["wall_windows_s"])
            summary["tcp_mbit_per_s"] = sum(e["tcp_mbit"] for e in extras[name]) / spans
        out[name] = summary
    if not tcp:
        out["p50_paced_over_unpaced"] = out["paced"]["p50_ms"] / out["unpaced"]["p50_ms"]
        out["p50_learned_over_unpaced"] = out["learned"]["p50_ms"] / out["unpaced"]["p50_ms"]
    return out


def experiment_early_close(cfg: LtpConfig, workdir: Path, progress: Progress) -> list[dict[str, Any]]:
    points = []
    for loss in cfg.early_close_losses:
        point: dict[str, Any] = {"loss": loss, "theta": cfg.theta}
        variants = [("off", []), ("on", ["--early-close-theta", f"{cfg.theta:g}"])]
        with cfg.links.network(loss, 2 * cfg.rounds * cfg.links.worker_timeout_s(loss) + 60) as net:

            def one_run(
                name: str, flags: list[str], net: Any = net, loss: float = loss
            ) -> list[dict[str, Any]]:
                return run_lta(net, cfg, loss, workdir, cfg.links.units_in_flight, flags, progress, name)

            runs = in_rounds(cfg, variants, one_run, progress, f"early close at loss {loss:g}")
        for name, _ in variants:
            point[name] = summarize(cfg, runs[name])
        off, on = point["off"], point["on"]
        point["units_closed_early_fraction"] = on["units_closed_early_fraction"]
        point["reduces_closed_early_fraction"] = on["reduces_closed_early_fraction"]
        for stat in ("mean", "p50", "p99"):
            point[f"{stat}_saved_ms"] = off[f"{stat}_ms"] - on[f"{stat}_ms"]
        point["full_chunks_fraction_off"] = _full_share(off["chunks"])
        point["full_chunks_fraction_on"] = _full_share(on["chunks"])
        points.append(point)
    return points


def _full_share(chunks: dict[str, int]) -> float:
    """Chunks that came back with every worker counted, of all chunks received (every rank's)."""
    return chunks["full"] / max(1, chunks["full"] + chunks["partial"] + chunks["fallback"])


def bench_ltp(cfg: LtpConfig, progress: Progress | None = None) -> dict[str, Any]:
    from mininet_topos.netns import remove_stale

    report = progress or log.info
    remove_stale()
    links = cfg.links
    out: dict[str, Any] = {
        "config": {
            "workers": links.workers,
            "mib": links.mib,
            "rate_mbit": links.rate_mbit,
            "rate": harness.format_rate(links.rate_mbit),
            "mtu": links.mtu,
            "elems_per_packet": links.k,
            "iters": links.iters,
            "warmup": links.warmup,
            "window": links.units_in_flight,
            "pace_window": cfg.pace_window,
            "min_deadline_ms": cfg.deadline_ms,
            "tbf_burst_bytes": links.tbf_burst,
            "tbf_limit_bytes": harness.tbf_limit_bytes(links.rate_mbit, links.tbf_burst),
            "experiments": list(cfg.experiments),
            "rounds": cfg.rounds,
            "loss_applied": "nftables, per worker link, each direction",
        }
    }
    with tempfile.TemporaryDirectory(prefix="lta-bench-ltp-") as tmp:
        workdir = Path(tmp)
        if "critical" in cfg.experiments:
            out["critical"] = experiment_critical(cfg, workdir, report)
        if "pacing" in cfg.experiments:
            out["pacing"] = experiment_pacing(cfg, workdir, report, tcp=False)
        if "tcp" in cfg.experiments:
            out["tcp"] = experiment_pacing(cfg, workdir, report, tcp=True)
        if "early-close" in cfg.experiments:
            out["early_close"] = experiment_early_close(cfg, workdir, report)
    return out


# ---- CLI ----------------------------------------------------------------------------------------
def experiments_arg(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(EXPERIMENTS))
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"takes some of {','.join(EXPERIMENTS)}, got {text!r}")
    return chosen


def theta_arg(text: str) -> float:
    """``--theta``: a share of units in [0, 1)."""
    theta = argtypes.float_range(0.0, 1.0, what="theta")(text)
    if theta >= 1.0:
        raise argparse.ArgumentTypeError(f"theta must be below 1 (1 would close with nothing in), got {text}")
    return theta


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_command(
        sub,
        "ltp",
        run_cli,
        help="LTP's critical data, pacing and early close on shaped, lossy links (root)",
        description="LTP's mechanisms in lta (critical chunks, BDP pacing, adaptive early close), each "
        "against its absence, on tbf-shaped links in network namespaces where the kernel drops packets "
        "(nftables). Needs root.",
    )
    add_workers(p, 2, f"worker namespaces, 1..{MAX_WORKERS}")
    p.add_argument("--mib", type=argtypes.positive_float, default=1.0, help="tensor size in MiB of float32")
    harness.add_rate(p, "tbf rate of every worker link")
    add_iters(p, 200, "timed allreduces per run")
    add_warmup(p, 10, "untimed allreduces first")
    add_mtu(p, harness.DEFAULT_MTU, "link MTU in bytes")
    p.add_argument("--window", type=argtypes.positive_int, default=harness.DEFAULT_WINDOW,
                   help="units in flight in the critical and early-close runs")  # fmt: skip
    p.add_argument("--experiments", type=experiments_arg, default=list(EXPERIMENTS),
                   help=f"comma-separated, among {','.join(EXPERIMENTS)}")  # fmt: skip
    p.add_argument(
        "--critical-loss", type=argtypes.probability, default=0.05, help="loss of the critical runs"
    )
    p.add_argument(
        "--critical-every", type=argtypes.positive_int, default=20, help="every Nth chunk critical"
    )
    p.add_argument("--pace-window", type=argtypes.positive_int, default=256,
                   help="units in flight in the pacing and TCP runs")  # fmt: skip
    p.add_argument(
        "--theta", type=theta_arg, default=0.1, help="early close's loss-tolerant threshold, in [0, 1)"
    )
    p.add_argument("--early-close-loss", type=argtypes.csv_of(argtypes.probability, "loss rates"),
                   default=[0.0, 0.01, 0.05], help="loss rates of the early-close runs")  # fmt: skip
    p.add_argument(
        "--rounds",
        type=argtypes.positive_int,
        default=1,
        help="runs of each variant, interleaved A B B A ... (each --iters allreduces): spreads a shared "
        "machine's load drift over the variants",
    )
    add_seed(p)


def config_from_args(args: argparse.Namespace) -> LtpConfig:
    links = harness.LossyConfig(
        workers=args.workers, mib=args.mib, rate_mbit=args.rate, iters=args.iters, warmup=args.warmup,
        mtu=args.mtu, window=args.window, seed=args.seed,
    )  # fmt: skip
    return LtpConfig(
        links=links,
        experiments=tuple(args.experiments),
        critical_loss=args.critical_loss,
        critical_every=args.critical_every,
        pace_window=args.pace_window,
        theta=args.theta,
        early_close_losses=tuple(args.early_close_loss),
        rounds=args.rounds,
    )


def run_cli(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    harness.require_root_or_say()
    links = cfg.links
    title = (
        f"lta bench ltp: {links.workers} workers, {links.mib:g} MiB, {harness.format_rate(links.rate_mbit)}, "
        f"{links.iters} allreduces per run: {', '.join(cfg.experiments)}"
    )
    with Status(title) as status:
        out = bench_ltp(cfg, status.update)
    return report(args.json, SCHEMA, out, lambda: [format_report(out)])


def format_report(out: dict[str, Any]) -> str:
    c = out["config"]
    lines = [
        f"{c['workers']} workers, {c['mib']:g} MiB, {c['rate']} per link, MTU {c['mtu']}, "
        f"K={c['elems_per_packet']}, {c['iters']} allreduces per run x {c['rounds']} rounds "
        "(times: the slowest rank's, ms)"
    ]

    def row(label: str, s: dict[str, Any], extra: str = "") -> str:
        return (
            f"  {label:10s} p50 {s['p50_ms']:7.1f}  p99 {s['p99_ms']:7.1f}  mean {s['mean_ms']:7.1f}  {extra}"
        )

    if "critical" in out:
        r = out["critical"]
        lines.append(f"critical (every {r['critical_every']}th chunk) at loss {r['loss']:g}:")
        lines.append(row("none", r["none"]))
        lines.append(
            row("critical", r["critical"], f"critical chunks full: {r['critical_full_fraction']:.2%}")
        )
        lines.append(f"  p99 cost {r['p99_cost_ms']:+.1f} ms (x{r['p99_ratio']:.2f})")
    for key in ("pacing", "tcp"):
        if key in out:
            r = out[key]
            head = f"{key} (window {r['window']}, 0% loss)"
            if key == "tcp":
                head += f": TCP alone {r['tcp_alone_mbit_per_s']:.0f} Mbit/s"
            lines.append(head + ":")
            for name in ("unpaced", "paced", "learned"):
                s = r[name]
                timed = s.get("tbf_drops_timed", {"up": "?", "down": "?"})
                extra = (
                    f"tbf drops up {s['tbf_drops']['up']} down {s['tbf_drops']['down']} "
                    f"(timed: {timed['up']}, {timed['down']})"
                )
                if key == "tcp":
                    lta_rate, tcp_rate = s["worker0_wire_mbit_per_s"], s["tcp_mbit_per_s"]
                    extra += f"  lta {lta_rate:.0f} Mbit/s  TCP {tcp_rate:.0f} Mbit/s"
                lines.append(row(name, s, extra))
    for p in out.get("early_close", []):
        lines.append(f"early close (theta {p['theta']:g}) at loss {p['loss']:g}:")
        lines.append(row("off", p["off"]))
        lines.append(
            row("on", p["on"], f"units closed early {p['units_closed_early_fraction']:.2%}, "
                f"reduces {p['reduces_closed_early_fraction']:.0%}, mean saved {p['mean_saved_ms']:+.1f} ms")
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lta.bench.ltp", description="the TCP competitor's ends")
    sub = parser.add_subparsers(dest="role", required=True)
    sink = sub.add_parser("tcp-sink")
    sink.add_argument("--listen", required=True)
    sink.add_argument("--log", required=True)
    source = sub.add_parser("tcp-source")
    source.add_argument("--to", required=True)
    source.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args(argv)
    if args.role == "tcp-sink":
        return tcp_sink_main(args.listen, args.log)
    return tcp_source_main(args.to, args.seconds)


if __name__ == "__main__":
    sys.exit(main())
