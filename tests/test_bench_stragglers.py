"""``lta bench stragglers --quick --json``: one JSON document with every key, sane values, the baseline
computing every micro-batch and DropCompute cutting a slow host and catching up to the baseline's
samples. No timing target is asserted (they depend on the machine); the speedup ceiling is checked
against the emulator by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hostlib.emulation.stragglers import StragglerEmulator, StragglerModel
from lta import cli
from lta.bench.stragglers import Spec, speedup_ceiling


def test_quick_run_reports_both_systems(capsys):
    # One host always 3x slow (--slow-host 1): DropCompute must cut it at tau and make up the samples.
    assert cli.main(["bench", "stragglers", "--quick", "--slow-host", "1", "--json"]) == 0
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
    assert cfg["slow_host"] == 1
    base, dc = doc["baseline"], doc["dropcompute"]
    for system in (base, dc):
        assert {"step_p50_ms", "samples_per_s", "final_loss"} <= set(system)
        assert system["step_p50_ms"] > 0 and system["samples_per_s"] > 0
        assert 0 < system["final_loss"] < math.log(4)  # better than chance on 4 classes
    # M sleeps at least, the slow host's at 3x: a step is never shorter than 3 x M x base
    assert base["step_p50_ms"] >= cfg["straggle_factor"] * cfg["micro_batches"] * cfg["micro_batch_ms"]
    # Algorithm 2 chose a finite threshold and it cut the slow host: micro-batches were dropped
    assert dc["tau_s"] is not None and dc["tau_s"] > 0
    assert dc["dropped_fraction"] > 0 and dc["dropped_fraction_predicted"] > 0
    (seed,) = doc["per_seed"]
    # The reported ratios are the ratios of the reported figures (timings themselves are not asserted).
    assert doc["speedup"] == pytest.approx(
        seed["baseline"]["step_mean_ms"] / seed["dropcompute"]["step_mean_ms"]
    )
    assert doc["s_eff_measured"] == pytest.approx(
        seed["dropcompute"]["samples_per_s"] / seed["baseline"]["samples_per_s"]
    )
    # The ceiling from the emulator's draws by hand: mean over the measured steps of the slowest worker's
    # summed multipliers, over M.
    emulator = StragglerEmulator(
        StragglerModel(base_s=1.0, prob=0.04, factor=3.0, slow_host=1, lognormal=cfg["lognormal"], seed=0)
    )
    slowest = [
        max(sum(emulator.multiplier(w, i, m) for m in range(8)) for w in range(4))
        for i in range(cfg["warmup"], cfg["steps"])
    ]
    assert doc["speedup_ceiling"] == pytest.approx(np.mean(slowest) / 8)
    assert doc["speedup_ceiling"] >= 3.0  # the slow host alone makes every step 3x
    samples_per_step = cfg["workers"] * cfg["micro_batches"] * cfg["batch"]
    assert seed["baseline"]["samples"] == cfg["steps"] * samples_per_step  # nothing dropped
    # Compensation: DropCompute dropped samples, so it ran extra steps until it had the baseline's
    # samples (within one step).
    assert seed["dropcompute"]["extra_steps"] > 0
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
