"""``TransportStats.account`` on hand-built plans: every per-chunk class counted by hand (settled or not,
count 0, partial, N, over N, SATURATED, withheld, no exponent, the fallbacks), with and without chunks
another worker owns (left out: no RESULT was due), and the window of reduce times."""

from __future__ import annotations

import numpy as np

from hostlib.protocol import Flag
from hostlib.transport import result
from hostlib.transport.config import Fallback
from hostlib.transport.plan import DONE, GAVE_UP, IN_FLIGHT, ReducePlan
from hostlib.transport.result import TransportStats

K, N = 8, 3


def _plan(elsewhere: list[int]) -> ReducePlan:
    plan = ReducePlan(8 * K, K)  # 8 chunks, one exponent unit
    plan.state[plan.exp_units :] = [DONE, DONE, DONE, DONE, DONE, DONE, GAVE_UP, IN_FLIGHT]
    plan.count[:] = [3, 2, 0, 3, 1, 4, 0, 0]  # chunk 5: over N (a switch that counts wrong)
    sat = int(Flag.SATURATED)
    plan.result_flags[:] = [0, sat, 0, 0, 0, 0, sat, 0]  # chunk 6's flag is on no RESULT it settled
    plan.exp_known[:] = [True, True, False, True, True, True, True, False]
    plan.quantized[:] = True
    plan.own_exp[:] = [True, True, True, True, False, True, True, True]  # chunk 4 withheld
    plan.elsewhere[elsewhere] = True
    plan.any_owned = bool(elsewhere)
    return plan


FALLBACK = np.array([0, 0, Fallback.PREV, 0, 0, 0, Fallback.PREV, Fallback.ZERO], dtype=np.int8)


def test_every_chunk_is_counted_in_its_class():
    stats = TransportStats()
    no_aggregate = stats.account(_plan([]), FALLBACK, N, 0.002)
    assert no_aggregate == 3  # chunk 2 (count 0), chunks 6 and 7 (no RESULT)
    assert (stats.reduces, stats.chunks) == (1, 8)
    assert (stats.chunks_full, stats.chunks_partial, stats.chunks_empty) == (2, 2, 1)  # 0, 3 | 1, 4 | 2
    assert stats.chunks_no_result == 2
    assert stats.saturated_results == 1
    assert (stats.chunks_no_exponent, stats.withheld_chunks) == (2, 1)
    assert (stats.fallback_prev, stats.fallback_zero, stats.fallback_local) == (2, 1, 0)
    assert list(stats.reduce_ms) == [2.0] and stats.as_dict()["reduce_ms"] == {
        "p50": 2.0,
        "p99": 2.0,
        "max": 2.0,
    }


def test_chunks_another_worker_owns_are_left_out():
    stats = TransportStats()
    no_aggregate = stats.account(_plan([3, 7]), FALLBACK, N, 0.002)
    assert no_aggregate == 2  # chunk 2 (count 0) and chunk 6 (no RESULT)
    assert stats.chunks == 6
    assert (stats.chunks_full, stats.chunks_partial, stats.chunks_empty) == (1, 2, 1)
    assert stats.chunks_no_result == 1
    assert stats.saturated_results == 1


def test_counts_add_up_over_reduces():
    stats = TransportStats()
    for _ in range(3):
        stats.account(_plan([]), FALLBACK, N, 0.001)
    assert (stats.reduces, stats.chunks, stats.chunks_full, stats.chunks_no_result) == (3, 24, 6, 6)
    assert stats.fallback_prev == 6


def test_reduce_times_keep_a_window_and_the_longest_of_all(monkeypatch):
    """A worker runs for days: the per-reduce times are the last REDUCE_MS_WINDOW, not one per reduce forever;
    p50 and p99 are of that window, max of every reduce."""
    monkeypatch.setattr(result, "REDUCE_MS_WINDOW", 100)
    stats = TransportStats()
    plan = _plan([])
    stats.account(plan, FALLBACK, N, 1.0)  # 1000 ms, the longest, long out of the window below
    for i in range(300):
        stats.account(plan, FALLBACK, N, (i % 10) / 1000)  # 0..9 ms
    assert len(stats.reduce_ms) == 100 and stats.reduces == 301
    summary = stats.as_dict()["reduce_ms"]
    assert summary["max"] == 1000.0
    assert summary["p50"] == 4.5 and summary["p99"] == 9.0  # 10 of each of 0..9 ms in the window
