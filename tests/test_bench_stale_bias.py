"""lta.bench.stale_bias: with nothing lost both errors are exactly zero (the same aggregate as every copy
fresh and every contribution counted); with loss both are positive and the sampling noise is measured."""

from __future__ import annotations

from lta.bench import stale_bias


def test_errors_vanish_without_loss_and_appear_with_it(capsys):
    none = stale_bias.measure(steps=(2,), drop=1e-12, draws=2, n_workers=4)
    row = none["rows"][0]
    assert row["stale_error"] == 0.0 and row["lost_error"] == 0.0 and row["noise"] > 0
    lossy = stale_bias.measure(steps=(2,), drop=0.5, draws=2, n_workers=4)["rows"][0]
    assert lossy["stale_error"] > 0 and lossy["lost_error"] > 0
    assert lossy["stale_mean_error"] <= lossy["stale_error"] + 1e-12
    assert lossy["noise"] == row["noise"]  # the same lossless run and batches whatever the drop
    assert stale_bias.main(["--steps", "1", "--workers", "4", "--draws", "2"]) == 0
    assert "| 1 |" in capsys.readouterr().out
