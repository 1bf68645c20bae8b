"""``python -m lta.bench.lossy_tail``'s analysis: which allreduces it calls slow and what it counts in
them, checked on a hand-built two-rank trace (the traced run itself needs root and namespaces)."""

from __future__ import annotations

import pytest

from lta.bench.lossy_tail import analyse


def _rec(**kw):
    """One rank's record of one allreduce, as the traced worker writes it (defaults: nothing happened)."""
    rec = {
        "flushes": [], "all_sent_ms": 10.0, "last_result_ms": 12.0, "exp_flushes": 0, "exp_probes": 0,
        "exp_deadlines": 0, "results_retx": 0, "units_overtaken": 0, "partial": 0, "missing": 0,
        "rto0_ms": 5.0, "max_flushes": 0, "cpu_ms": 8.0, "nivcsw": 0, "max_oversleep_ms": 0.0,
        "max_busy_ms": 1.0, "max_wait_ms": 1.0, "max_wait_at_ms": 3.0,
    }  # fmt: skip
    return rec | kw


def _flush(n, timer, nth=1):
    return {"t_ms": 11.0, "n": n, "nth": nth, "exp": 0, "timer": timer, "waited_ms": 4.0, "rto_ms": 5.0}


def test_slowest_allreduces_are_taken_by_the_slowest_rank_and_their_events_counted():
    n = 400  # 0.5%: the 2 slowest
    rank0 = {"times_s": [0.010] * n, "trace": [_rec() for _ in range(n)]}
    rank1 = {"times_s": [0.011] * n, "trace": [_rec() for _ in range(n)]}
    # allreduce 7: rank 0 is slow (a FLUSH chain on a timer and a lost exponent RESULT probed twice)
    rank0["times_s"][7] = 0.050
    rank0["trace"][7] = _rec(flushes=[_flush(1, 1), _flush(1, 1, nth=2)], max_flushes=2, exp_probes=2,
                             all_sent_ms=40.0, last_result_ms=48.0)  # fmt: skip
    # allreduce 100: rank 1 is slow, with two fast-flushed units and a long wait for nothing
    rank1["times_s"][100] = 0.030
    rank1["trace"][100] = _rec(flushes=[_flush(2, 0)], max_wait_ms=15.0, all_sent_ms=25.0,
                               last_result_ms=28.0)  # fmt: skip
    # elsewhere, one fast flush in a quarter of the allreduces (not slow)
    for i in range(0, n, 4):
        if i not in (100,):
            rank1["trace"][i]["flushes"] = [_flush(1, 0)]

    report = analyse([rank0, rank1], limit_ms=8.0)
    assert report["n"] == n and report["max_ms"] == pytest.approx(50.0)
    slowest = report["slowest"]
    assert [s["ms"] for s in slowest[:2]] == pytest.approx([50.0, 30.0])
    assert [s["slowest_rank"] for s in slowest[:2]] == [0, 1]
    first, second = slowest[0], slowest[1]
    assert (first["timer_flushes"], first["fast_flushes"], first["chain"], first["exp_hit"]) == (2, 0, 2, 2)
    assert (second["timer_flushes"], second["fast_flushes"], second["chain"]) == (0, 2, 0)
    shares = report["share_with_event"]
    assert shares["flush_chain>=2"] == {"slow": 0.5, "rest": 0.0}
    assert shares["timer_flush"] == {"slow": 0.5, "rest": 0.0}
    assert shares["recv_wait>10ms"] == {"slow": 0.5, "rest": 0.0}
    # 100 of the 398 others had a fast flush (every 4th, allreduce 100 excepted, 0 included)
    assert shares["any_loss_event"]["rest"] == pytest.approx(99 / 398, abs=1e-3)
    # the top bucket (the 2 slowest) averages their send phase: (40 + 25) / 2
    assert report["buckets"]["99.5-100%"]["send_ms"] == pytest.approx(32.5)
    assert report["correlation_with_time"]["send_ms"] > 0.9


def test_with_start_times_an_allreduce_is_timed_from_its_last_entry():
    n = 200  # 0.5%: the slowest one
    rank0 = {
        "times_s": [0.010] * n,
        "starts_s": [float(i) for i in range(n)],
        "trace": [_rec() for _ in range(n)],
    }
    rank1 = {
        "times_s": [0.010] * n,
        "starts_s": [float(i) for i in range(n)],
        "trace": [_rec() for _ in range(n)],
    }
    # allreduce 3: rank 0 entered 20 ms early and waited (its own 30 ms); the allreduce itself took 10 ms
    rank0["starts_s"][3], rank0["times_s"][3] = 2.980, 0.030
    # allreduce 9: both entered together and it took 25 ms
    rank0["times_s"][9] = rank1["times_s"][9] = 0.025
    report = analyse([rank0, rank1], limit_ms=8.0)
    assert report["max_ms"] == pytest.approx(25.0)
    assert report["slowest"][0]["ms"] == pytest.approx(25.0)
    assert report["p50_ms"] == pytest.approx(10.0)
