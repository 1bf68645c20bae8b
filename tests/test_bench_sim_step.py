"""lta.bench.sim_step_cost: both gradient paths step the same spec and the table reads their samples
(no timed assertion: the figures are for docs/results.md, measured in the same run)."""

from __future__ import annotations

import statistics

from lta.bench import sim_step_cost


def test_sim_step_cost_reports_the_median_of_each_paths_samples(capsys):
    r = sim_step_cost.measure(("none",), drop=0.1, blocks=3, block=1)
    (row,) = r["rows"]
    assert row["mechanism"] == "none" and len(r["load"]) == 3
    for path in sim_step_cost.PATHS:
        samples = row["samples"][path]
        assert len(samples) == 3 and all(s > 0 for s in samples)
        assert row[f"{path}_ms"] == statistics.median(samples)
    assert row["ratio"] == row["vmap_ms"] / row["stacked_ms"]
    assert sim_step_cost.main(["--mechanisms", "none", "--blocks", "1", "--block", "1"]) == 0
    out = capsys.readouterr().out
    assert "| none |" in out and "vmap (reference)" in out
