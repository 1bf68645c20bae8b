"""``lta bench fsdp --rounds R``: the variants' order alternates between rounds, each variant's steps are
pooled over the rounds, and every round's ratios to gloo and their median are reported. Checked on
hand-made runs (``run_variant`` replaced), against numpy medians worked out here."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lta.bench import fsdp
from lta.cli import main

VARIANTS = ["gloo", "lta", "lta_grads_only", "lta_lossy"]
# per round, each variant's three slowest-rank steps in ms
STEPS = {
    0: {"gloo": [100, 101, 102], "lta": [150, 151, 152], "lta_grads_only": [120, 121, 122],
        "lta_lossy": [160, 161, 162]},
    1: {"gloo": [80, 81, 82], "lta": [140, 141, 142], "lta_grads_only": [90, 91, 92],
        "lta_lossy": [150, 151, 152]},
    2: {"gloo": [90, 91, 92], "lta": [100, 101, 102], "lta_grads_only": [95, 96, 97],
        "lta_lossy": [110, 111, 112]},
}  # fmt: skip


def test_rounds_alternate_the_order_pool_the_steps_and_report_each_ratio_and_the_median(monkeypatch, capsys):
    calls: list[str] = []

    def fake_run_variant(backend, env, world, steps, warmup, timeout_s=900.0, seed=0):
        round_ = len(calls) // len(VARIANTS)
        name = {
            ("gloo", ""): "gloo",
            ("lta", "allreduce,reduce_scatter,all_gather"): "lta_lossy" if "LTA_DROP_UP" in env else "lta",
            ("lta", "allreduce,reduce_scatter"): "lta_grads_only",
        }[(backend, env.get("LTA_LOSSY_OPS", ""))]
        calls.append(name)
        t = np.array(STEPS[round_][name], dtype=np.float64) / 1e3
        run = {"p50_ms": float(np.median(t) * 1e3), "p99_ms": 0.0, "mean_ms": 0.0, "steps_s": t.tolist(),
               "cpu_ms_per_step": 10.0 * (round_ + 1), "first_loss": 2.0 + round_, "final_loss": 1.0 + round_,
               "params": 7}  # fmt: skip
        if backend == "lta":
            run["summary"] = {"round": round_}
        return run

    monkeypatch.setattr(fsdp, "run_variant", fake_run_variant)
    assert main(["bench", "fsdp", "--rounds", "3", "--steps", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert calls == VARIANTS + VARIANTS[::-1] + VARIANTS  # reversed in the second round
    assert doc["config"]["rounds"] == 3
    for name in VARIANTS:
        pooled = [v for r in STEPS.values() for v in r[name]]
        assert doc[name]["p50_ms"] == pytest.approx(np.median(pooled))
        assert doc[name]["cpu_ms_per_step"] == pytest.approx(20.0)  # the mean of 10, 20, 30
        assert "steps_s" not in doc[name]
        assert (doc[name]["first_loss"], doc[name]["final_loss"]) == (2.0, 1.0)  # the first round's
    assert doc["lta"]["summary"] == {"round": 0}
    each = [r["ratio_lta_over_gloo_p50"] for r in doc["rounds"]]
    assert each == pytest.approx([151 / 101, 141 / 81, 101 / 91])
    assert doc["ratio_lta_over_gloo_p50_median"] == pytest.approx(151 / 101)
    grads = [r["ratio_lta_grads_only_over_gloo_p50"] for r in doc["rounds"]]
    assert doc["ratio_lta_grads_only_over_gloo_p50_median"] == pytest.approx(np.median(grads))
    assert doc["ratio_lta_over_gloo_p50"] == pytest.approx(doc["lta"]["p50_ms"] / doc["gloo"]["p50_ms"])
    assert doc["rounds"][1]["gloo_p50_ms"] == pytest.approx(81)


def test_the_table_names_each_rounds_ratio(monkeypatch, capsys):
    def fake_run_variant(backend, env, world, steps, warmup, timeout_s=900.0, seed=0):
        t = [0.1, 0.1] if backend == "gloo" else [0.15, 0.15]
        return {"p50_ms": t[0] * 1e3, "p99_ms": 0.0, "mean_ms": 0.0, "steps_s": t, "cpu_ms_per_step": 1.0,
                "first_loss": 2.0, "final_loss": 1.0, "params": 7}  # fmt: skip

    monkeypatch.setattr(fsdp, "run_variant", fake_run_variant)
    assert main(["bench", "fsdp", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 x 30 steps a variant" in out
    assert "lta/gloo step p50 by round: 1.50, 1.50 (median 1.50)" in out
