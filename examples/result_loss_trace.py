"""Where a reduce's time goes under RESULT loss: the run of ``lta demo --loss UP_LOSS --down-loss D`` (4
workers, 1 MiB, K = 64, 10 reduces; UP_LOSS 0 unless given) with an
:class:`~hostlib.transport.trace.EngineTrace` on every worker.

    python examples/result_loss_trace.py 0.2 SEED [UP_LOSS]

Prints, per worker and reduce (the first, with start-up, left out): wall and CPU ms, wake-ups (those
with no packet, woken by a deadline; those with fewer than 20 packets), the passes over due deadlines,
the send system calls, the send phase and the tail (after the last unit went), the time the span and
the peer rule held sending, FLUSHes sent and units FLUSHed, and for the FLUSHed units the wait from send
to the first FLUSH (detection) and from it to the answer (recovery). docs/results.md has the figures of
28 and 29 Nov 2026.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time

import numpy as np

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.transport import TransportConfig
from hostlib.transport.trace import EngineTrace
from lta import demo
from lta.launch import JobSpec, run_job


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class WhereTheTimeGoes(EngineTrace):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_reduce_start(self, engine, plan) -> None:
        s = engine.stats
        self.t0, self.cpu0, self.wakes, self.all_sent_at = time.perf_counter(), _cpu_s(), 0, None
        self.settled_at = np.full(plan.units, np.nan)
        self.before = (s.held_by_span_s, s.held_by_peers_s, s.flushes_sent)
        self.empty_wakes, self.small_wakes, self.deadline_calls = 0, 0, 0
        self.send_calls0 = engine.io.batch.stats.syscalls_send

    def on_recv(self, engine, timeout_s, n, t_in, t_out) -> None:
        self.wakes += 1
        self.empty_wakes += n == 0  # woken by a deadline alone
        self.small_wakes += 0 < n < 20

    def on_deadlines(self, engine, plan, due) -> None:
        self.deadline_calls += 1

    def on_sent(self, engine, plan) -> None:
        if self.all_sent_at is None and plan.next_unit == plan.units:
            self.all_sent_at = time.perf_counter()

    def on_settled(self, engine, plan, units) -> None:
        self.settled_at[units] = time.perf_counter()

    def on_reduce_end(self, engine, plan, result) -> None:
        end, s = time.perf_counter(), engine.stats
        sent_all = self.all_sent_at or end
        flushed = plan.flushes > 0
        detect = (plan.first_flush_at[flushed] - plan.sent_at[flushed]) * 1e3
        recover = (self.settled_at[flushed] - plan.first_flush_at[flushed]) * 1e3
        self.rows.append(
            {
                "ms": (end - self.t0) * 1e3,
                "cpu_ms": (_cpu_s() - self.cpu0) * 1e3,
                "wakes": self.wakes,
                "wakes_no_packet": self.empty_wakes,
                "wakes_under_20": self.small_wakes,
                "deadline_passes": self.deadline_calls,
                "send_calls": engine.io.batch.stats.syscalls_send - self.send_calls0,
                "send_ms": (sent_all - self.t0) * 1e3,
                "tail_ms": (end - sent_all) * 1e3,
                "span_ms": (s.held_by_span_s - self.before[0]) * 1e3,
                "peers_ms": (s.held_by_peers_s - self.before[1]) * 1e3,
                "flushes": s.flushes_sent - self.before[2],
                "units_flushed": int(flushed.sum()),
                "detect_p50_ms": float(np.nanmedian(detect)) if detect.size else 0.0,
                "recover_p50_ms": float(np.nanmedian(recover)) if recover.size else 0.0,
            }
        )


def traced_worker(worker, rank: int, n_values: int, rounds: int, seed: int) -> dict:
    trace = WhereTheTimeGoes()
    worker.engine.trace = trace
    out = demo.demo_worker(worker, rank, n_values, rounds, seed)
    out["trace"] = trace.rows[1:]
    return out


def main() -> None:
    down, seed = float(sys.argv[1]), int(sys.argv[2])
    up = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    drop = {"up": DropPolicy(p=up), "down": DropPolicy(p=down)}
    spec = JobSpec(
        n_workers=4, transport=TransportConfig(elems_per_packet=64, seed=seed), drop=drop, switch_seed=seed
    )
    results, _ = run_job(spec, traced_worker, 1 << 18, 10, seed)
    rows = [row for r in results for row in r["trace"]]
    p50 = max(r["stats"]["reduce_ms"]["p50"] for r in results)
    print(f"down loss {down:g}, seed {seed}: p50 (slowest worker) {p50:.1f} ms")
    print("medians over workers and reduces:")
    for key in rows[0]:
        print(f"  {key:16s} {statistics.median(row[key] for row in rows):8.1f}")


if __name__ == "__main__":
    main()
