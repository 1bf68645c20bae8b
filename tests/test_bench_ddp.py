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
    cmd = [sys.executable, "-m", "lta.cli", "bench", "ddp", "--steps", "3", "--warmup", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["config"] == {"workers": 2, "steps": 3, "warmup": 1}
    for backend in ("gloo", "lta"):
        r = doc[backend]
        assert r["p50_ms"] > 0 and r["params"] == 4_208_650
        assert len(r["cpu_ms_per_step"]) == 2 and all(c >= 0 for c in r["cpu_ms_per_step"])
    assert doc["gloo"]["first_loss"] == doc["lta"]["first_loss"]  # the same model and batch, before any step
    assert doc["ratio_lta_over_gloo_p50"] == doc["lta"]["p50_ms"] / doc["gloo"]["p50_ms"]
    total = [sum(doc[b]["cpu_ms_per_step"]) for b in ("lta", "gloo")]
    assert doc["ratio_lta_over_gloo_cpu"] == (total[0] / total[1] if total[1] > 0 else None)
