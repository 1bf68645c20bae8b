"""``lta bench lossy``: lta against gloo on rate-limited links where the kernel really drops packets.

For each loss rate a fresh network of namespaces is built (:mod:`lta.bench.netns_harness`: N worker
namespaces and an aggregator on a bridge, every worker link shaped by tbf and losing a fraction ``p``
of TCP/UDP packets in each direction). Over the same links, one after the other:

- **gloo**: ``torch.distributed`` allreduce, ``init_method=tcp://`` at worker 0, one process per
  worker namespace (TCP between workers: a ring packet crosses two lossy worker links);
- **lta**: the softswitch daemon (``lta softswitch``) in the aggregator namespace, one
  :class:`~hostlib.transport.LtaWorker` process per worker namespace (UDP: a GRAD crosses its
  worker's up link, a RESULT its worker's down link).

An allreduce's time runs from the last rank's entry to the last rank's exit
(:func:`lta.bench.summary.collective_times`): lta's workers check every result against numpy between
allreduces and gloo's do not, and timing each by its slowest rank counted the skew that check leaves
between the ranks' entries as lta's (``slowest_rank_p50_ms`` keeps that figure). Each system's times are
reported against its **link limit** (the bytes one worker must put on its
link in one direction ÷ the link rate); how that is counted, how ``--rate`` shapes the links, and
how the window and the FLUSH deadline floor follow the rate are told in
:mod:`lta.bench.netns_harness`.

**Iterations.** p99.9 needs ``--iters 2000`` or more per point (two samples above it; with 500 it is
interpolated between the two slowest allreduces). A run keeps one float per allreduce and rank, and
rank 0 reports its progress every tenth of the run, which the CLI shows on stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hostlib import argtypes
from hostlib.errors import UsageError
from hostlib.protocol import HEADER_BYTES, MAX_ELEMS_PER_PACKET, MAX_WORKERS
from lta.bench.flags import (
    add_iters,
    add_loss_rates,
    add_mtu,
    add_seed,
    add_warmup,
    add_workers,
    bench_command,
)
from lta.bench.netns_harness import (
    DEFAULT_MTU,
    IPV4_BYTES,
    TBF_QUEUE_MS,
    UDP_BYTES,
    WINDOW_RTT_MS,
    LossyConfig,
    Progress,
    add_rate,
    counter_totals,
    format_rate,
    gloo_wire_bytes,
    link_limit_ms,
    lta_frame_bytes,
    lta_wire_bytes,
    measured_loss,
    require_root_or_say,
    run_gloo_workers,
    run_lta_workers,
    summarize_times,
    tbf_limit_bytes,
    worker_cli,
)

# the harness's names this module held before it had its own module, still reachable here
from lta.bench.netns_harness import WorkerGroup as WorkerGroup
from lta.bench.netns_harness import deadline_floor_ms as deadline_floor_ms
from lta.bench.netns_harness import elems_for_mtu as elems_for_mtu
from lta.bench.netns_harness import parse_rate_mbit as parse_rate_mbit
from lta.bench.netns_harness import softswitch_in as softswitch_in
from lta.bench.netns_harness import tbf_burst_bytes as tbf_burst_bytes
from lta.bench.netns_harness import window_for_rate as window_for_rate
from lta.bench.netns_harness import worker_argv as _worker_argv  # noqa: F401
from lta.bench.summary import collective_times, report, slowest_rank, time_stats
from lta.progress import Status

log = logging.getLogger(__name__)
SCHEMA = "lta.bench.lossy/1"
DEFAULT_LOSSES = "0,0.001,0.01,0.05"
P99_9_MIN_ITERS = 2000  # allreduces per point for a p99.9 that is not just the max


# ---- summaries -----------------------------------------------------------------------------------
def ratios(gloo: dict[str, float], lta: dict[str, float]) -> dict[str, float]:
    return {f"gloo_over_lta_{name[:-3]}": gloo[name] / lta[name] for name in ("p50_ms", "p99_ms", "p99_9_ms")}


# ---- orchestration (in the root namespace) -------------------------------------------------------
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
            before = counter_totals(net)
            if system == "gloo":
                ranks = run_gloo_workers(net, cfg, loss, progress)
            else:
                ranks = run_lta_workers(net, cfg, loss, Path(tmp), progress=progress)
            point[system] = summarize_system(system, cfg, ranks)
            point[system]["measured_loss"] = measured_loss(before, counter_totals(net))
    if "gloo" in point and "lta" in point:
        point["ratios"] = ratios(point["gloo"], point["lta"])
    return point


def summarize_system(system: str, cfg: LossyConfig, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's point: its allreduces' times (:func:`lta.bench.summary.collective_times`: from the
    last rank's entry to the last rank's exit, so the skew left by a rank's own work between allreduces
    is not counted; lta's workers check each result, gloo's do not) against its link limit, and the
    slowest rank's own p50 as earlier runs reported it (``slowest_rank_p50_ms``)."""
    times = collective_times([r["starts_s"] for r in ranks], [r["times_s"] for r in ranks])
    skewed = time_stats(slowest_rank([r["times_s"] for r in ranks]), ("p50",), prefix="slowest_rank_")
    if system == "gloo":
        wire = gloo_wire_bytes(4 * cfg.n_values, cfg.workers, cfg.mtu)
    else:
        wire = lta_wire_bytes(cfg.n_values, cfg.k)
    out = (
        summarize_times(times, link_limit_ms(wire, cfg.rate_mbit)) | skewed | {"wire_bytes_per_worker": wire}
    )
    if system == "gloo":
        return out
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
def systems_arg(text: str) -> list[str]:
    """``--systems``: gloo and/or lta, comma-separated, in the order given."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(systems) - {"gloo", "lta"})
    if unknown or not systems:
        raise argparse.ArgumentTypeError(f"takes gloo and/or lta (e.g. gloo,lta), got {text!r}")
    return systems


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_command(
        sub,
        "lossy",
        run_cli,
        help="lta vs gloo on rate-limited, lossy links in network namespaces (root)",
        description="lta against gloo allreduce on rate-limited links in network namespaces, where "
        "the kernel drops packets (nftables) at each loss rate. Needs root.",
    )
    add_workers(p, 2, f"worker namespaces, 1..{MAX_WORKERS}")
    p.add_argument(
        "--mib",
        type=argtypes.float_range(0.0, low_open=True, what="MiB"),
        default=1.0,
        help="tensor size in MiB of float32 (> 0)",
    )
    add_loss_rates(p, [float(v) for v in DEFAULT_LOSSES.split(",")])
    add_rate(p, "tbf rate of every worker link, both directions", "--rate-mbit")
    add_iters(p, 500, f"timed allreduces per system and loss rate (p99.9 needs >= {P99_9_MIN_ITERS})")
    add_warmup(p, 10, "untimed allreduces first")
    add_mtu(p, DEFAULT_MTU, "link MTU in bytes, 68..65535 (9000: jumbo frames)")
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
    add_seed(p)
    p.add_argument("--plot", default="", help="PNG of the time percentiles against loss ('' for none)")


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
    return report(args.json, SCHEMA, out, lambda: [format_table(out, args.systems)])


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
