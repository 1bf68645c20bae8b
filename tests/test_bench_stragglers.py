"""``lta bench stragglers --quick --json``: one JSON document with every key, sane values, the baseline
computing every micro-batch and DropCompute catching up to the baseline's samples. No timing target is
asserted (they depend on the machine); the speedup ceiling is checked against the emulator by hand."""

from __future__ import annotations

import json
import math

import pytest

from lta import cli
from lta.bench.stragglers import Spec, speedup_ceiling


def test_quick_run_reports_both_systems(capsys):
    assert cli.main(["bench", "stragglers", "--quick", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, "one JSON document on stdout"
    doc = json.loads(out[0])
    assert doc["schema"] == "lta.bench.stragglers/1"
    cfg = doc["config"]
    assert (cfg["workers"], cfg["micro_batches"], cfg["straggle_prob"], cfg["straggle_factor"]) == (
        4,
        8,
        0.04,
        3.0,
    )
    base, dc = doc["baseline"], doc["dropcompute"]
    for system in (base, dc):
        assert {"step_p50_ms", "samples_per_s", "final_loss"} <= set(system)
        assert system["step_p50_ms"] > 0 and system["samples_per_s"] > 0
        assert 0 < system["final_loss"] < math.log(4)  # better than chance on 4 classes
    assert base["step_p50_ms"] >= cfg["micro_batches"] * cfg["micro_batch_ms"]  # M sleeps at least
    assert {"tau_s", "dropped_fraction"} <= set(dc)
    assert dc["tau_s"] is None or 0 < dc["tau_s"] < base["step_p99_ms"] / 1e3
    assert 0.0 <= dc["dropped_fraction"] < 0.5
    for key in ("speedup", "s_eff_predicted", "s_eff_measured", "speedup_ceiling"):
        assert doc[key] is not None and 0.3 < doc[key] < 5.0, key
    (seed,) = doc["per_seed"]
    samples_per_step = cfg["workers"] * cfg["micro_batches"] * cfg["batch"]
    assert seed["baseline"]["samples"] == cfg["steps"] * samples_per_step  # nothing dropped
    # Compensation: DropCompute ran extra steps until it had the baseline's samples (within one step).
    assert 0 <= seed["dropcompute"]["samples"] - seed["baseline"]["samples"] < samples_per_step
    assert seed["dropcompute"]["steps"] == cfg["steps"] + seed["dropcompute"]["extra_steps"]
    assert seed["final_loss_replicas_agree"]
    assert set(doc["targets"]) >= {"speedup_met", "dropped_met", "s_eff_met", "loss_within_spread_met"}


def test_speedup_ceiling_by_hand():
    # One slow host at 3x and no random stragglers: every step waits for 3 x M x base; the ceiling is 3.
    spec = Spec(
        workers=4, micro_batches=8, batch=8, micro_batch_s=0.01, straggle_prob=0.0, straggle_factor=3.0,
        slow_host=2, lognormal=False, steps=10, warmup=2, seeds=[0], lr=0.1, momentum=0.0, max_drop=None,
    )  # fmt: skip
    assert speedup_ceiling(spec, 0, range(2, 10)) == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "5", "--warmup", "5"], "--warmup (5) must be below --steps (5)"),
        (["--slow-host", "4"], "--slow-host 4 is not a worker"),
    ],
)
def test_bad_flags_are_one_line(capsys, argv, message):
    assert cli.main(["bench", "stragglers", "--quick", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
