"""``lta.bench.summary``: percentiles against hand-interpolated values, the slowest rank, ratios and the
JSON-or-table ending, each checked against what a reader computes by hand."""

from __future__ import annotations

import json

import pytest

from lta.bench.summary import collective_times, ratio, report, slowest_rank, time_stats


def test_time_stats_are_in_ms_in_the_order_asked_with_linear_interpolation():
    times_s = [0.004, 0.001, 0.003, 0.002]  # sorted: 1, 2, 3, 4 ms
    # the q-th percentile sits at position q/100 * (n - 1) = q * 0.03 of the sorted samples
    stats = time_stats(times_s, ("max", "p50", "mean", "p99", "p99_9"), prefix="step_")
    assert list(stats) == ["step_max_ms", "step_p50_ms", "step_mean_ms", "step_p99_ms", "step_p99_9_ms"]
    assert stats["step_max_ms"] == pytest.approx(4.0)
    assert stats["step_p50_ms"] == pytest.approx(2.5)  # position 1.5: halfway from 2 to 3
    assert stats["step_mean_ms"] == pytest.approx(2.5)
    assert stats["step_p99_ms"] == pytest.approx(3.97)  # position 2.97
    assert stats["step_p99_9_ms"] == pytest.approx(3.997)  # position 2.997
    assert time_stats([0.010]) == pytest.approx({"p50_ms": 10.0, "p99_ms": 10.0, "mean_ms": 10.0})


def test_an_unknown_statistic_is_one_line_naming_it():
    with pytest.raises(ValueError, match="unknown statistic 'median'") as exc:
        time_stats([0.001], ("median",))
    assert "\n" not in str(exc.value)


def test_slowest_rank_is_the_per_iteration_max_over_ranks():
    ranks = [[0.010, 0.030, 0.020], [0.015, 0.005, 0.025]]
    assert slowest_rank(ranks).tolist() == [0.015, 0.030, 0.025]


def test_a_collective_runs_from_its_last_entry_to_its_last_exit():
    # iteration 0: rank 0 enters at 5.000 and waits 7 ms for rank 1, which enters at 5.004 and takes 3 ms;
    # iteration 1: both enter at 6.000, rank 1 leaves last after 4 ms;
    # iteration 2: rank 1 enters 1 ms late and leaves first; rank 0 leaves 2 ms after rank 1 entered
    starts = [[5.000, 6.000, 7.000], [5.004, 6.000, 7.001]]
    times = [[0.007, 0.002, 0.003], [0.003, 0.004, 0.0005]]
    assert collective_times(starts, times) == pytest.approx([0.003, 0.004, 0.002])
    assert slowest_rank(times) == pytest.approx([0.007, 0.004, 0.003])  # the skew counted in


def test_ratio_is_none_where_the_divisor_measured_nothing():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(3.0, 0.0) is None


def test_report_writes_one_json_document_or_the_table(capsys):
    out = {"p50_ms": 1.5}
    assert report(True, "lta.bench.x/1", out, lambda: ["never asked"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "lta.bench.x/1" and doc["p50_ms"] == 1.5
    assert report(False, "lta.bench.x/1", out, lambda: ["a", "b"]) == 0
    assert capsys.readouterr().out == "a\nb\n"
