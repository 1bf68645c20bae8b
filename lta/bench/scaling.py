"""``lta bench scaling``: the cost of a reduce against worker count and tensor size, with real worker
processes through the softswitch and, for worker counts one machine cannot run, the in-process drop
simulator."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator

import numpy as np

from hostlib import argtypes
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.jobconfig import MAX_POOL_SIZE
from hostlib.protocol import MAX_ELEMS_PER_PACKET, MAX_LEAVES, MAX_WORKERS
from hostlib.transport import LtaWorker, TransportConfig
from lta.bench.allreduce import grad_loss
from lta.bench.flags import add_elems_per_packet, add_iters, add_workers, bench_command
from lta.bench.summary import report
from lta.launch import JobSpec, run_jobs
from lta.progress import Status
from softswitch.hierarchy import leaf_blocks

SCHEMA = "lta.bench.scaling/1"
_CONFIG_KEYS = (
    "workers leaves own_leaf sim_workers kib loss spine_loss iters elems_per_packet pool_size switches plot"
).split()


def bench_scaling(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> dict:
    """Cost of a reduce against workers and tensor size: real processes through the softswitch, and
    the in-process drop simulator for worker counts the machine cannot run as processes.
    ``progress`` hears of each measurement as it starts."""
    from hostlib.emulation.simulate import simulate_reduce

    say = progress or (lambda text: None)
    rows = []
    for kib in args.kib:
        n_values = kib * 256
        for n in args.workers:
            trees = [lv for lv in args.leaves if lv <= n]
            tree = f", and behind {'/'.join(map(str, trees))} leaves and a spine in turn" if trees else ""
            say(f"{kib} KiB, {n} worker processes{tree}")
            p50s, cpu_ms, loss = _p50s_s(args, n, n_values, trees)
            for mode, t, cpu, lost in zip(
                ["processes", *(f"leaves={leaves}" for leaves in trees)], p50s, cpu_ms, loss, strict=True
            ):
                row = _scaling_row(mode, n, kib, t, n_values)
                row["switch_cpu_ms"] = cpu
                row.update(lost)
                rows.append(row)
        for n in args.sim_workers:
            x = np.random.default_rng(n).standard_normal((n, n_values)).astype(np.float32)
            for leaves in [0, *(lv for lv in args.leaves if lv <= n)]:
                tree = f" behind {leaves} leaves and a spine" if leaves else ""
                say(f"{kib} KiB, {n} simulated workers{tree}")
                leaf_of = None
                if leaves:
                    leaf_of = np.concatenate(
                        [np.full(len(b), j) for j, b in enumerate(leaf_blocks(n, leaves))]
                    )
                times, counted = [], []
                for i in range(args.iters):
                    t0 = time.perf_counter()
                    out = simulate_reduce(
                        x, elems_per_packet=args.elems_per_packet, up=DropPolicy(p=args.loss), seed=i,
                        leaf_of=leaf_of, spine_up=DropPolicy(p=_spine_loss(args)),
                    )  # fmt: skip
                    times.append(time.perf_counter() - t0)
                    counted.append(float(out.count.mean()) / n)
                mode = f"sim leaves={leaves}" if leaves else "simulator"
                row = _scaling_row(mode, n, kib, float(np.median(times)), n_values)
                row["counted"] = float(np.mean(counted))
                rows.append(row)
    if args.plot:
        _plot_scaling(rows, args.plot)
    config = {key: getattr(args, key) for key in _CONFIG_KEYS}
    return {
        "config": config,
        "rows": rows,
        "hierarchy": hierarchy_ratios(rows),
        "sim_hierarchy": sim_ratios(rows),
    }


def _spine_loss(args: argparse.Namespace) -> float:
    """The drop probability of partials at the spine: ``--spine-loss``, else ``--loss``."""
    return args.loss if args.spine_loss is None else args.spine_loss


def _p50s_s(
    args: argparse.Namespace, n: int, n_values: int, trees: list[int]
) -> tuple[list[float], list[list[float]], list[dict]]:
    """Median over ``args.iters`` reduces of the slowest worker's time, through one switch and through
    each leaf-spine tree of ``trees`` leaves (``args.loss`` drops GRADs at the leaves, ``--spine-loss``,
    by default the same, partials at the spine). The same ``n`` worker processes reduce through all of
    them, the switches serving at once, one reduce each in turn (the first of a turn rotating), so that
    the tree and the one switch it is compared with run under the same load. Also each switch's CPU per
    reduce in ms (its serving thread's CPU over the job's reduces, warm-up included; leaves first, then
    the spine), and what loss cost each job (:func:`_loss_costs`)."""
    drop = {"up": DropPolicy(p=args.loss)}
    spine_drop = {"up": DropPolicy(p=_spine_loss(args))}
    specs = [
        JobSpec(
            n_workers=n,
            job_id=1 + j,
            transport=TransportConfig(
                elems_per_packet=args.elems_per_packet,
                pool_size=args.pool_size,
                own_leaf=args.own_leaf and leaves > 0,
            ),
            drop=drop,
            leaves=leaves,
            spine_drop=spine_drop if leaves else {},
            switch_processes=args.switches == "processes",
        )
        for j, leaves in enumerate([0, *trees])
    ]
    warmup = 1
    cpu_s: list[list[float]] = []
    switches: list[list] = []
    results = run_jobs(
        specs, reduce_in_turn, n_values, args.iters, warmup, switches=switches, switch_cpu_s=cpu_s
    )
    times = np.array([r["times_s"] for r in results])  # (rank, job, iteration)
    cpu_ms = [[1e3 * c / (args.iters + warmup) for c in job] for job in cpu_s]
    costs = _loss_costs(results, switches, args.iters, warmup)
    return [float(t) for t in np.median(np.max(times, axis=0), axis=1)], cpu_ms, costs


def _loss_costs(results: list[dict], switches: list[list], iters: int, warmup: int) -> list[dict]:
    """Per job, what its packet loss cost a reduce: packets its switches' drop policies dropped
    (``drops_per_reduce``, warm-up included), and per worker and measured reduce (the mean over ranks)
    the FLUSHes sent and the time its sending was held by its own span (its oldest unsettled unit, in
    practice a lost one still being recovered: ``span_held_ms``) or by its peers' progress
    (``peers_held_ms``; hostlib/transport/reuse.py)."""
    out = []
    for j, job_switches in enumerate(switches):
        drops = sum(sw.read_counters(1 + j)["drop_policy_up"] for sw in job_switches)
        per_rank = [r["loss_costs"][j] for r in results]
        out.append(
            {
                "drops_per_reduce": drops / (iters + warmup),
                **{key: float(np.mean([c[key] for c in per_rank])) / iters for key in per_rank[0]},
            }
        )
    return out


def reduce_in_turn(workers: list[LtaWorker], rank: int, n_values: int, iters: int, warmup: int) -> dict:
    """The body of :func:`_p50s_s`: each iteration one reduce through each job's worker, the job that
    goes first rotating with the iteration (every rank uses the same order, so they stay in step).
    Returns ``times_s[job][iteration]`` and ``loss_costs[job]``: the FLUSHes this worker sent and the ms
    its sending was held by its own span and by its peers, summed over the measured reduces."""
    x = np.random.default_rng(rank).standard_normal(n_values).astype(np.float32)
    y = np.empty_like(x)  # reduced in place, as gloo's all_reduce(y) and DDP's buckets are
    times: list[list[float]] = [[] for _ in workers]
    costs = [{"flushes_per_reduce": 0.0, "span_held_ms": 0.0, "peers_held_ms": 0.0} for _ in workers]
    for i in range(warmup + iters):
        for j in np.roll(np.arange(len(workers)), -i).tolist():
            st = workers[j].stats
            before = (st.flushes_sent, st.held_by_span_s, st.held_by_peers_s)
            y[:] = x
            t0 = time.perf_counter()
            workers[j].allreduce(y, step=i, out=y)
            if i >= warmup:
                times[j].append(time.perf_counter() - t0)
                costs[j]["flushes_per_reduce"] += st.flushes_sent - before[0]
                costs[j]["span_held_ms"] += 1e3 * (st.held_by_span_s - before[1])
                costs[j]["peers_held_ms"] += 1e3 * (st.held_by_peers_s - before[2])
    return {"times_s": times, "loss_costs": costs}


def hierarchy_ratios(rows: list[dict]) -> list[dict]:
    """For each tree row, its p50 against the one-switch row of the same workers and size (same worker
    processes, reduces in turn)."""
    flat = {(r["workers"], r["kib"]): r["ms"] for r in rows if r["mode"] == "processes"}
    cpu = {(r["workers"], r["kib"]): r.get("switch_cpu_ms") for r in rows if r["mode"] == "processes"}
    one_row = {(r["workers"], r["kib"]): r for r in rows if r["mode"] == "processes"}
    out = []
    for r in rows:
        if r["mode"].startswith("leaves=") and (r["workers"], r["kib"]) in flat:
            one = flat[(r["workers"], r["kib"])]
            out.append(
                {
                    "leaves": int(r["mode"].split("=")[1]),
                    "workers": r["workers"],
                    "kib": r["kib"],
                    "one_level_p50_ms": one,
                    "two_level_p50_ms": r["ms"],
                    "ratio": r["ms"] / one,
                    "one_level_switch_cpu_ms": cpu[(r["workers"], r["kib"])],
                    "two_level_switch_cpu_ms": r.get("switch_cpu_ms"),
                    **{
                        f"{level}_{key}": row.get(key)
                        for level, row in (("one_level", one_row[(r["workers"], r["kib"])]), ("two_level", r))
                        for key in _LOSS_KEYS
                    },
                }
            )
    return out


_LOSS_KEYS = ("drops_per_reduce", "flushes_per_reduce", "span_held_ms", "peers_held_ms")
_LOSS_NAMES = ("dropped", "FLUSHes", "held by span", "held by peers")


def sim_ratios(rows: list[dict]) -> list[dict]:
    """For each simulated tree row: the fraction of contributions counted, and the model's compute time,
    against the simulated one-switch row of the same workers and size (same run, same drops at the
    workers)."""
    flat = {(r["workers"], r["kib"]): r for r in rows if r["mode"] == "simulator"}
    out = []
    for r in rows:
        if r["mode"].startswith("sim leaves=") and (r["workers"], r["kib"]) in flat:
            one = flat[(r["workers"], r["kib"])]
            out.append(
                {
                    "leaves": int(r["mode"].split("=")[1]),
                    "workers": r["workers"],
                    "kib": r["kib"],
                    "one_level_counted": one["counted"],
                    "two_level_counted": r["counted"],
                    "one_level_ms": one["ms"],
                    "two_level_ms": r["ms"],
                }
            )
    return out


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
    for mode, marker in (("processes", "o-"), ("simulator", "s--"), *((m, "^:") for m in _tree_modes(rows))):
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


def _tree_modes(rows: list[dict]) -> list[str]:
    return sorted({r["mode"] for r in rows if r["mode"].startswith("leaves=")})


def _counts(item: Callable[[str], int], what: str) -> Callable[[str], list[int]]:
    """A comma list of counts, each checked by ``item``; the empty string is the empty list (skip)."""
    parse_list = argtypes.csv_of(item, what)

    def parse(text: str) -> list[int]:
        return parse_list(text) if text.strip() else []

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    sc = bench_command(
        sub,
        "scaling",
        _run_scaling,
        help="reduce cost against workers (processes, then the simulator) and size",
        description="Time one reduce against worker count and tensor size: real worker processes "
        "through a softswitch on loopback, then the in-process drop simulator for counts one machine "
        "cannot run as processes.",
    )
    add_workers(
        sc,
        [2, 4, 8, 16],
        f"worker counts run as real processes, each 1..{MAX_WORKERS} ('' for none)",
        type=_counts(argtypes.workers, "worker counts"),
    )
    sc.add_argument(
        "--leaves",
        type=_counts(argtypes.int_range(1, MAX_LEAVES, "leaves"), "leaf counts"),
        default=[],
        help="also run each process worker count through a leaf-spine tree of L leaves and a spine "
        "(--loss at the leaves, --spine-loss at the spine), and print its p50 against one switch's at "
        "the same worker count, with what loss cost each (drops, FLUSHes, time held by a lost unit); "
        "the simulator runs each --sim-workers count as such a tree too (L <= workers) and prints the "
        "fraction of contributions counted at one and two levels",
    )
    sc.add_argument(
        "--sim-workers",
        type=_counts(argtypes.int_range(1, what="simulated worker count"), "simulated worker counts"),
        default=[2, 16, 64, 256, 1024],
        help="worker counts run in the simulator, each >= 1 ('' for none)",
    )
    sc.add_argument(
        "--kib",
        type=argtypes.csv_of(argtypes.int_range(1, what="size in KiB"), "sizes"),
        default=[64, 256],
        help="tensor sizes in KiB of float32, each >= 1",
    )
    sc.add_argument("--loss", type=grad_loss, default=0.01, help="drop probability of GRAD packets, [0, 1)")
    sc.add_argument(
        "--spine-loss",
        type=grad_loss,
        default=None,
        help="drop probability of a leaf's partials at the spine, [0, 1) (default: --loss, so that a tree "
        "has two lossy links per worker where the one switch has one and loses about twice the units; "
        "0 compares the two at the same loss per worker)",
    )
    sc.add_argument(
        "--own-leaf",
        action="store_true",
        help="in a tree, a worker alone in its block has no leaf switch and joins the spine as its own "
        "leaf (docs/protocol.md, 'A worker as its own leaf'); the simulator's trees are not changed",
    )
    add_iters(sc, 5, "reduces per point (median)")
    add_elems_per_packet(sc, 64, f"K, values per packet, 1..{MAX_ELEMS_PER_PACKET}")
    sc.add_argument(
        "--pool-size",
        type=argtypes.int_range(2, MAX_POOL_SIZE, "pool size"),
        default=0,
        help=f"slots of each job (2..{MAX_POOL_SIZE}; default: 2048, 512 above 1024 values a packet); a "
        "worker's own units in flight stay within half of "
        "them of its oldest unsettled one (hostlib/transport/reuse.py), so a larger pool lets the "
        "pipeline run on while a lost unit is recovered",
    )
    sc.add_argument(
        "--switches",
        choices=("threads", "processes"),
        default="threads",
        help="run every softswitch (the one switch, every leaf and the spine) as a thread of this process "
        "(they share its interpreter lock), or each in a process of its own, as separate switches are "
        "(docs/results.md: no better p50 ratio measured)",
    )
    sc.add_argument("--plot", default="scaling.png", help="PNG to write ('' for none)")


def _run_scaling(args: argparse.Namespace) -> int:
    title = (
        f"lta bench scaling: {len(args.kib)} sizes x ({len(args.workers)} process and "
        f"{len(args.sim_workers)} simulator worker counts), {args.iters} reduces each"
    )
    with Status(title) as status:
        out = bench_scaling(args, status.update)

    def table() -> Iterator[str]:
        yield (
            f"{'mode':14s} {'workers':>7s} {'KiB':>6s} {'ms':>9s} {'ns/elem':>9s} {'ns/(elem*worker)':>17s}"
        )
        for r in out["rows"]:
            yield (
                f"{r['mode']:14s} {r['workers']:7d} {r['kib']:6d} {r['ms']:9.1f} {r['ns_per_element']:9.1f} "
                f"{r['ns_per_contribution']:17.2f}"
            )
        if out["hierarchy"]:
            yield (
                "\nleaf-spine against one switch, same workers and size (p50 of the slowest worker's reduce):"
            )
            heads = (
                ("leaves", 6),
                ("workers", 7),
                ("KiB", 6),
                ("1 level ms", 10),
                ("2 levels ms", 11),
                ("ratio", 6),
            )
            yield " ".join(f"{name:>{width}s}" for name, width in heads)
            for h in out["hierarchy"]:
                yield (
                    f"{h['leaves']:6d} {h['workers']:7d} {h['kib']:6d} {h['one_level_p50_ms']:10.1f} "
                    f"{h['two_level_p50_ms']:11.1f} {h['ratio']:6.2f}"
                )
            yield (
                "what loss cost a reduce, one switch -> tree: packets dropped (all links); per worker: "
                "FLUSHes, ms its sending was held by its own oldest unsettled unit (a lost one being "
                "recovered: the span rule) and by its peers (reuse.py):"
            )
            for h in out["hierarchy"]:
                if h.get("one_level_drops_per_reduce") is not None:
                    yield (
                        f"  {h['workers']} workers / {h['leaves']} leaves, {h['kib']} KiB: "
                        + ", ".join(
                            f"{name} {h['one_level_' + key]:.1f} -> {h['two_level_' + key]:.1f}"
                            for name, key in zip(_LOSS_NAMES, _LOSS_KEYS, strict=True)
                        )
                    )
            yield "switch CPU per reduce, ms (one switch; a tree's leaves, then its spine):"
            for h in out["hierarchy"]:
                one, two = h["one_level_switch_cpu_ms"], h["two_level_switch_cpu_ms"]
                if one and two:
                    # (--own-leaf: leaves of one worker have no switch)
                    leaf_cpu = " ".join(f"{c:.2f}" for c in two[:-1]) or "none with a switch"
                    if 0 < len(two) - 1 < h["leaves"]:
                        leaf_cpu += f" ({len(two) - 1} with a switch)"
                    yield (
                        f"  {h['workers']} workers, {h['kib']} KiB: one switch {sum(one):.2f}; {h['leaves']} "
                        f"leaves {leaf_cpu}, spine {two[-1]:.2f} (sum {sum(two):.2f})"
                    )
        if out["sim_hierarchy"]:
            yield (
                f"\nsimulator, leaf-spine against one switch (loss {args.loss:g} on worker links, "
                f"{_spine_loss(args):g} on leaf uplinks; counted = mean count / workers; ms = the model's "
                "compute time, not a latency):"
            )
            yield (f"{'leaves':>6s} {'workers':>7s} {'KiB':>6s} {'1 level counted':>15s} "
                  f"{'2 levels counted':>16s} {'1 level ms':>10s} {'2 levels ms':>11s}")  # fmt: skip
            for h in out["sim_hierarchy"]:
                yield (
                    f"{h['leaves']:6d} {h['workers']:7d} {h['kib']:6d} {h['one_level_counted']:15.4f} "
                    f"{h['two_level_counted']:16.4f} {h['one_level_ms']:10.1f} {h['two_level_ms']:11.1f}"
                )
        if args.plot:
            yield f"plot: {args.plot}"

    return report(args.json, SCHEMA, out, table)
