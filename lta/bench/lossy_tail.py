"""Why lta's slowest allreduces are slow: one ``lta bench lossy`` point, traced per reduce.

Runs the lossy bench's lta half (same namespaces, links, softswitch and transport settings:
see :mod:`lta.bench.netns_harness`) with every worker recording, per allreduce, what its transport did:
the FLUSHes it sent (when, of which units, the how-manyth FLUSH of each, fast or on a timer), exponent probes,
results resent by the switch, units overtaken, the RTO before and after, when its last unit went out
and when its last RESULT came. It then relates the slowest allreduces (by the slowest rank, as the
bench times them) to those events.

This is a diagnostic, not a benchmark: the tracer (an ``EngineTrace`` on each worker's engine) costs a
few µs per call, so its times are a little above the bench's. Run as root::

    python -m lta.bench.lossy_tail run --rate 1gbit --loss 0.01 --iters 2000 --out /tmp/tail.json
    python -m lta.bench.lossy_tail analyse /tmp/tail.json    # the saved run again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hostlib.transport.engine import ReduceEngine
from hostlib.transport.plan import GAVE_UP, ReducePlan
from hostlib.transport.result import ReduceResult
from hostlib.transport.trace import EngineTrace
from lta.bench import netns_harness as harness
from lta.bench.flags import add_workers
from lta.bench.summary import collective_times, slowest_rank, time_stats

_STAT_KEYS = ("flushes_sent", "flushes_on_timer", "results_retx", "units_overtaken", "packets_sent")


# ---- worker side ---------------------------------------------------------------------------------
class _Tracer(EngineTrace):
    """Per-reduce events of one LtaWorker, through its engine's trace hook."""

    def __init__(self) -> None:
        self.reduces: list[dict[str, Any]] = []
        self.cur: dict[str, Any] | None = None
        self.t0 = 0.0
        self._before: dict[str, Any] = {}
        self._ru0: Any = None

    def _ms(self) -> float:
        return round((time.perf_counter() - self.t0) * 1e3, 3)

    def on_reduce_start(self, engine: ReduceEngine, plan: ReducePlan) -> None:
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self._before = engine.stats.as_dict()
        self.t0 = time.perf_counter()
        self.cur = {
            "flushes": [], "first_result_ms": None, "last_result_ms": None, "all_sent_ms": None,
            "exp_deadlines": 0, "rto0_ms": round(engine.deadlines.rto_s() * 1e3, 3),
            "srtt0_ms": engine.deadlines.srtt_ms, "rttvar0_ms": round(engine.deadlines.rttvar_ms, 3),
            "max_oversleep_ms": 0.0, "max_busy_ms": 0.0, "max_wait_ms": 0.0, "max_wait_at_ms": 0.0,
            "_last_out": None,
        }  # fmt: skip

    def on_flushes(self, engine: ReduceEngine, plan: ReducePlan, units: np.ndarray) -> None:
        if self.cur is None:
            return
        now = time.perf_counter()
        self.cur["flushes"].append(
            {
                "t_ms": self._ms(),
                "n": int(len(units)),
                "units": [int(u) for u in units[:8]],
                "nth": int(plan.flushes[units].max()),  # already incremented by the caller
                "exp": int(np.count_nonzero(units < plan.exp_units)),
                "timer": int(np.count_nonzero(units >= plan.frontier.min())),
                "waited_ms": round(float((now - plan.sent_at[units]).max()) * 1e3, 3),
                "all_sent": bool(plan.all_sent),
                "synced": bool(plan.synced),
                "rto_ms": round(engine.deadlines.rto_s() * 1e3, 3),
            }
        )

    def on_settled(self, engine: ReduceEngine, plan: ReducePlan, units: np.ndarray) -> None:
        if self.cur is None:
            return
        self.cur["last_result_ms"] = self._ms()
        if self.cur["first_result_ms"] is None:
            self.cur["first_result_ms"] = self.cur["last_result_ms"]

    def on_sent(self, engine: ReduceEngine, plan: ReducePlan) -> None:
        if self.cur is not None and plan.next_unit == plan.units and self.cur["all_sent_ms"] is None:
            self.cur["all_sent_ms"] = self._ms()

    def on_deadlines(self, engine: ReduceEngine, plan: ReducePlan, due: np.ndarray) -> None:
        if self.cur is None:
            return
        exp = due[due < plan.exp_units]
        if exp.size and not plan.synced:
            self.cur["exp_deadlines"] += int(exp.size)

    def on_recv(self, engine: ReduceEngine, timeout_s: float, n: int, t_in: float, t_out: float) -> None:
        cur = self.cur
        if cur is None:
            return
        # oversleep: returned later than asked with nothing (or late with something): the process was not
        # running; busy: time between two receives spent outside recv
        late = (t_out - t_in) - timeout_s if n == 0 else 0.0
        cur["max_oversleep_ms"] = max(cur["max_oversleep_ms"], round(late * 1e3, 3))
        if cur["_last_out"] is not None:
            busy = (t_in - cur["_last_out"]) * 1e3
            cur["max_busy_ms"] = max(cur["max_busy_ms"], round(busy, 3))
        cur["_last_out"] = t_out
        wait = (t_out - t_in) * 1e3
        if wait > cur["max_wait_ms"]:
            cur["max_wait_ms"], cur["max_wait_at_ms"] = round(wait, 3), self._ms()

    def on_reduce_end(self, engine: ReduceEngine, plan: ReducePlan, result: ReduceResult) -> None:
        rec, self.cur = self.cur, None
        if rec is None:
            return
        after = engine.stats.as_dict()
        ru0, ru1 = self._ru0, resource.getrusage(resource.RUSAGE_SELF)
        rec.pop("_last_out")
        rec["cpu_ms"] = round((ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) * 1e3, 2)
        rec["nivcsw"] = ru1.ru_nivcsw - ru0.ru_nivcsw
        rec |= {key: after[key] - self._before[key] for key in _STAT_KEYS}
        rec |= {
            "elapsed_ms": round(result.elapsed_s * 1e3, 3),
            "rto1_ms": round(engine.deadlines.rto_s() * 1e3, 3),
            "srtt1_ms": engine.deadlines.srtt_ms,
            "max_flushes": int(plan.flushes.max()),
            "units_flushed_twice": int(np.count_nonzero(plan.flushes >= 2)),
            "exp_flushes": int(plan.flushes[: plan.exp_units].sum()),
            "exp_probes": int(plan.probes[: plan.exp_units].sum()),
            "gave_up": int(np.count_nonzero(plan.state == GAVE_UP)),
            "partial": int(np.count_nonzero((result.count > 0) & (result.count < engine.n_workers))),
            "missing": int(np.count_nonzero(result.count == 0)),
        }
        self.reduces.append(rec)


def worker_cli(argv: list[str]) -> int:
    tracer = _Tracer()

    def traced_main(args: argparse.Namespace) -> dict[str, Any]:
        args.trace = tracer
        out = harness.lta_worker_main(args)
        out["trace"] = tracer.reduces[args.warmup :]
        return out

    return harness.worker_cli(argv, lta_main=traced_main, prog="python -m lta.bench.lossy_tail")


# ---- orchestration -------------------------------------------------------------------------------
def run_traced(cfg: harness.LossyConfig, loss: float) -> list[dict[str, Any]]:
    """The lossy bench's lta run at one loss rate, every worker traced; each rank's result."""
    from mininet_topos.netns import remove_stale

    remove_stale()
    with (
        cfg.network(loss, cfg.worker_timeout_s(loss) + 60.0) as net,
        tempfile.TemporaryDirectory(prefix="lta-tail-") as tmp,
    ):
        addrs, switch_addr = harness.lta_endpoints(net)
        module = "lta.bench.lossy_tail"  # its workers trace (worker_cli below)
        argvs = harness.lta_worker_argvs(net, cfg, cfg.units_in_flight, cfg.deadline_ms, module=module)
        with harness.softswitch_in(net, cfg, addrs, switch_addr, Path(tmp)) as switch:
            ranks = harness.WorkerGroup(net, argvs, cfg.worker_timeout_s(loss), print, "lta").run()
            fields = Path(f"/proc/{switch.pid}/stat").read_text().rpartition(")")[2].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
            ranks[0]["switch_cpu_ms_per_reduce"] = cpu_s * 1e3 / (cfg.iters + cfg.warmup)
            return ranks


def analyse(ranks: list[dict[str, Any]], limit_ms: float, slow_share: float = 0.005) -> dict[str, Any]:
    """Slowest ``slow_share`` of allreduces against the rest: what happened in them. An allreduce's time
    is the lossy bench's (:func:`lta.bench.summary.collective_times`); a run saved before workers wrote
    their start times (no ``starts_s``) is timed by its slowest rank, as then."""
    if all("starts_s" in r for r in ranks):
        times = collective_times([r["starts_s"] for r in ranks], [r["times_s"] for r in ranks]) * 1e3
    else:
        times = slowest_rank([r["times_s"] for r in ranks]) * 1e3
    n = len(times)
    order = np.argsort(times)[::-1]
    slow = set(order[: max(1, math.ceil(slow_share * n))].tolist())

    def features(i: int) -> dict[str, Any]:
        recs = [r["trace"][i] for r in ranks]
        fl = [f for rec in recs for f in rec["flushes"]]
        return {
            "ms": float(times[i]),
            "slowest_rank": int(np.argmax([r["times_s"][i] for r in ranks])),
            "timer_flushes": sum(f["timer"] for f in fl),
            "fast_flushes": sum(f["n"] - f["timer"] for f in fl),
            "chain": max(rec["max_flushes"] for rec in recs),
            "exp_hit": sum(rec["exp_flushes"] + rec["exp_probes"] + rec["exp_deadlines"] for rec in recs),
            "retx": sum(rec["results_retx"] for rec in recs),
            "overtaken": sum(rec["units_overtaken"] for rec in recs),
            "partial": max(rec["partial"] for rec in recs),
            "missing": max(rec["missing"] for rec in recs),
            "rto0_ms": max(rec["rto0_ms"] for rec in recs),
            "all_sent_ms": max(rec["all_sent_ms"] or 0.0 for rec in recs),
            "last_result_ms": max(rec["last_result_ms"] or 0.0 for rec in recs),
            "first_flush_ms": min((f["t_ms"] for f in fl), default=None),
            "cpu_ms": [rec["cpu_ms"] for rec in recs],
            "nivcsw": [rec["nivcsw"] for rec in recs],
            "max_oversleep_ms": max(rec["max_oversleep_ms"] for rec in recs),
            "max_busy_ms": max(rec["max_busy_ms"] for rec in recs),
            "max_wait_ms": [(rec["max_wait_ms"], rec["max_wait_at_ms"]) for rec in recs],
            "flushes": [
                (r, f["t_ms"], f["n"], f["nth"], f["exp"], f["timer"], f["waited_ms"], f["rto_ms"])
                for r, rec in enumerate(recs)
                for f in rec["flushes"]
            ][:10],
        }

    feats = [features(i) for i in range(n)]
    groups = {"slow": [feats[i] for i in slow], "rest": [feats[i] for i in range(n) if i not in slow]}

    def share(group: list[dict[str, Any]], pred: Any) -> float:
        return sum(1 for f in group if pred(f)) / max(1, len(group))

    preds = {
        "any_loss_event": lambda f: f["timer_flushes"] + f["fast_flushes"] + f["retx"] > 0,
        "timer_flush": lambda f: f["timer_flushes"] > 0,
        "flush_chain>=2": lambda f: f["chain"] >= 2,
        "exponent_hit": lambda f: f["exp_hit"] > 0,
        "results_retx": lambda f: f["retx"] > 0,
        "overtaken": lambda f: f["overtaken"] > 0,
        "oversleep>3ms": lambda f: f["max_oversleep_ms"] > 3,
        "busy>3ms": lambda f: f["max_busy_ms"] > 3,
        "recv_wait>10ms": lambda f: max(w for w, _ in f["max_wait_ms"]) > 10,
        "clean(no flush, no retx)": lambda f: f["timer_flushes"] + f["fast_flushes"] + f["retx"] == 0,
    }
    table = {name: {g: round(share(fs, p), 3) for g, fs in groups.items()} for name, p in preds.items()}
    # Where the time goes, by percentile bucket of the allreduce time: the send phase (until this
    # worker's last unit went out), the tail (last RESULT after that), and what may explain them.
    cols = {
        "send_ms": [f["all_sent_ms"] for f in feats],
        "tail_ms": [f["last_result_ms"] - f["all_sent_ms"] for f in feats],
        "fast_flushes": [f["fast_flushes"] for f in feats],
        "timer_flushes": [f["timer_flushes"] for f in feats],
        "exp_hit": [f["exp_hit"] for f in feats],
        "max_busy_ms": [f["max_busy_ms"] for f in feats],
        "max_recv_wait_ms": [max(w for w, _ in f["max_wait_ms"]) for f in feats],
        "cpu_ms": [sum(f["cpu_ms"]) for f in feats],
        "rto0_ms": [f["rto0_ms"] for f in feats],
    }
    by_time = np.argsort(times)
    buckets = {}
    for lo, hi in ((0, 50), (50, 90), (90, 99), (99, 99.5), (99.5, 100)):
        sel = by_time[int(lo / 100 * n) : max(int(lo / 100 * n) + 1, int(hi / 100 * n))]
        buckets[f"{lo}-{hi}%"] = {"ms": round(float(times[sel].mean()), 2)} | {
            name: round(float(np.mean(np.asarray(v, dtype=np.float64)[sel])), 2) for name, v in cols.items()
        }
    corr = {
        name: round(float(np.corrcoef(times, v)[0, 1]), 2) if np.std(v) > 0 else None
        for name, v in cols.items()
    }
    return {
        "n": n,
        "limit_ms": limit_ms,
        **time_stats(times / 1e3, ("p50", "p99", "p99_9", "max")),
        "share_with_event": table,
        "buckets": buckets,
        "correlation_with_time": corr,
        "mean_nivcsw": {g: float(np.mean([sum(f["nivcsw"]) for f in fs])) for g, fs in groups.items()},
        "mean_cpu_ms": {g: float(np.mean([sum(f["cpu_ms"]) for f in fs])) for g, fs in groups.items()},
        "mean_rto0_ms": {g: float(np.mean([f["rto0_ms"] for f in fs])) for g, fs in groups.items()},
        "slowest": [feats[i] for i in order[:12]],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "lta-worker":
        return worker_cli(argv)
    if len(argv) == 2 and argv[0] == "analyse":  # a saved --out file again
        saved = json.loads(Path(argv[1]).read_text())
        _print(analyse(saved["ranks"], saved["report"]["limit_ms"]))
        return 0
    p = argparse.ArgumentParser(prog="python -m lta.bench.lossy_tail", description=__doc__)
    p.add_argument("run", choices=["run"])
    harness.add_rate(p, "tbf rate of every worker link")
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--iters", type=int, default=2000)
    add_workers(p, 2, "worker namespaces", type=int)
    p.add_argument("--mib", type=float, default=1.0)
    p.add_argument("--window", type=int)
    p.add_argument("--min-deadline-ms", type=float)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    cfg = harness.LossyConfig(workers=args.workers, mib=args.mib, rate_mbit=args.rate, iters=args.iters,
                            window=args.window,
                            min_deadline_ms=args.min_deadline_ms)  # fmt: skip
    ranks = run_traced(cfg, args.loss)
    limit = harness.link_limit_ms(harness.lta_wire_bytes(cfg.n_values, cfg.k), cfg.rate_mbit)
    report = analyse(ranks, limit)
    report["switch_cpu_ms_per_reduce"] = ranks[0].get("switch_cpu_ms_per_reduce")
    report["worker_cpu_ms_per_reduce"] = [float(np.mean([t["cpu_ms"] for t in r["trace"]])) for r in ranks]
    report["config"] = {"rate_mbit": cfg.rate_mbit, "loss": args.loss, "iters": cfg.iters,
                        "window": cfg.units_in_flight, "min_deadline_ms": cfg.deadline_ms}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"report": report, "ranks": ranks}))
    _print(report)
    return 0


def _print(report: dict[str, Any]) -> None:
    print(json.dumps({k: v for k, v in report.items() if k not in ("slowest", "buckets")}, indent=1))
    names = list(next(iter(report["buckets"].values())))
    print(f"{'bucket':>10s} " + " ".join(f"{name:>16s}" for name in names))
    for bucket, row in report["buckets"].items():
        print(f"{bucket:>10s} " + " ".join(f"{row[name]:16.2f}" for name in names))
    for f in report["slowest"]:
        print(json.dumps(f))


if __name__ == "__main__":
    sys.exit(main())
