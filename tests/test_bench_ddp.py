"""``lta bench ddp``: one short run reports both backends' step times and each rank's CPU per step, and
the two backends train the same model from the same start. No timing is asserted beyond being positive:
timings depend on the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_short_run_reports_steps_and_cpu_per_rank() -> None:
    cmd = [sys.executable, "-m", "lta.cli", "bench", "ddp", "--steps", "3", "--warmup", "1", "--rounds", "1"]
    cmd.append("--json")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["config"] == {"workers": 2, "steps": 3, "warmup": 1, "rounds": 1}
    for backend in ("gloo", "lta"):
        r = doc[backend]
        assert r["p50_ms"] > 0 and r["params"] == 4_208_650
        assert len(r["cpu_ms_per_step"]) == 2 and all(c >= 0 for c in r["cpu_ms_per_step"])
    assert doc["gloo"]["first_loss"] == doc["lta"]["first_loss"]  # the same model and batch, before any step
    assert doc["ratio_lta_over_gloo_p50"] == doc["lta"]["p50_ms"] / doc["gloo"]["p50_ms"]
    total = [sum(doc[b]["cpu_ms_per_step"]) for b in ("lta", "gloo")]
    assert doc["ratio_lta_over_gloo_cpu"] == (total[0] / total[1] if total[1] > 0 else None)
    (only,) = doc["rounds"]
    assert only == {
        "gloo_p50_ms": doc["gloo"]["p50_ms"],
        "lta_p50_ms": doc["lta"]["p50_ms"],
        "ratio_p50": doc["lta"]["p50_ms"] / doc["gloo"]["p50_ms"],
    }
    assert doc["ratio_lta_over_gloo_p50_median"] == only["ratio_p50"] == doc["ratio_lta_over_gloo_p50"]


def test_rounds_pool_their_steps_and_report_each_ratio_and_the_median() -> None:
    """Three hand-built rounds (what run_backend returns): the pooled p50 is numpy's median of all nine
    slowest-rank steps, CPU per rank the mean over rounds, the per-round ratios their p50s' quotients."""
    import numpy as np

    from lta.bench.ddp import combine_rounds

    def run(steps_ms: list[float], cpu: list[float], loss: float) -> dict:
        t = np.array(steps_ms) / 1e3
        return {"p50_ms": float(np.median(t) * 1e3), "steps_s": t.tolist(), "cpu_ms_per_step": cpu,
                "first_loss": loss, "last_loss": loss / 2, "params": 7}  # fmt: skip

    rounds = [
        {"gloo": run([40, 41, 42], [30, 31], 2.0), "lta": run([50, 51, 52], [45, 35], 2.0)},
        {"gloo": run([30, 31, 32], [28, 29], 2.5), "lta": run([45, 46, 47], [44, 34], 2.5)},
        {"gloo": run([35, 36, 37], [29, 30], 3.0), "lta": run([36, 37, 38], [43, 33], 3.0)},
    ]
    out = combine_rounds(rounds)
    assert out["gloo"]["p50_ms"] == np.median([40, 41, 42, 30, 31, 32, 35, 36, 37])
    assert out["lta"]["p50_ms"] == np.median([50, 51, 52, 45, 46, 47, 36, 37, 38])
    assert out["lta"]["cpu_ms_per_step"] == [44.0, 34.0] and out["gloo"]["cpu_ms_per_step"] == [29.0, 30.0]
    assert (out["lta"]["first_loss"], out["lta"]["last_loss"], out["lta"]["params"]) == (2.0, 1.0, 7)
    assert [r["ratio_p50"] for r in out["rounds"]] == [51 / 41, 46 / 31, 37 / 36]
    assert out["ratio_lta_over_gloo_p50_median"] == 51 / 41
    assert out["ratio_lta_over_gloo_p50"] == 46 / 36
    assert out["ratio_lta_over_gloo_cpu"] == 78 / 59
