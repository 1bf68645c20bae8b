"""``lta train --quick``: the main job end to end (4 worker processes, a softswitch, 13 runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest

from hostlib.torch_ext.drift import iid_drift, paper_drift

ROW_FIELDS = {"drop", "train_loss", "train_ppl", "val_loss", "val_ppl"}
CHANGES = {f"{m}_change_pct" for m in ("train_loss", "train_ppl", "val_loss", "val_ppl")}
DRIFT_FIELDS = {"p", "measured", "sigma2", "paper", "iid", "max_stale_age", "stale_bound"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lta-train")
    proc = subprocess.run(
        [sys.executable, "-m", "lta.cli", "train", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_quick_train_writes_every_field(quick_run):
    out, proc = quick_run
    results = json.loads((out / "results.json").read_text())
    drops = [0.0, 0.1, 0.2, 0.3, 0.4]
    assert [r["drop"] for r in results["rows"]] == drops
    for row in results["rows"]:
        assert ROW_FIELDS | CHANGES <= set(row)
        assert row["train_ppl"] == pytest.approx(2.718281828 ** row["train_loss"], rel=1e-9)
        assert row["val_ppl"] == pytest.approx(2.718281828 ** row["val_loss"], rel=1e-9)
        assert 0.5 < row["val_loss"] < 4.7  # below the uniform guess ln(103) = 4.63: it learned
    assert all(results["rows"][0][c] == 0.0 for c in CHANGES)
    for method in ("prev", "zero"):
        baseline = results["baselines"][method]
        assert [r["drop"] for r in baseline] == drops
        assert all(ROW_FIELDS | CHANGES <= set(r) for r in baseline)
    assert [d["p"] for d in results["drift"]] == drops
    for d in results["drift"]:
        assert DRIFT_FIELDS <= set(d)
        assert d["paper"] == pytest.approx(paper_drift(d["p"], d["sigma2"]))
        assert d["iid"] == pytest.approx(iid_drift(d["p"], d["sigma2"]))
        assert d["max_stale_age"] <= d["stale_bound"] + 1
    lossless, lossy = results["drift"][0], results["drift"][-1]
    assert lossless["measured"] == 0.0  # nothing lost: every replica identical
    assert lossy["measured"] > 0.0 and lossy["sigma2"] > 0.0
    assert lossy["p_effective"] == pytest.approx(0.4, abs=0.08)
    assert "| Metric | 0% | 10% | 20% | 30% | 40% |" in (out / "table.md").read_text()
    assert "| Metric |" in proc.stdout
    assert "run 1/" not in proc.stdout and "run 1/" in proc.stderr  # progress goes to stderr only


def test_quick_train_plots(quick_run):
    out, _ = quick_run
    for name in ("loss_curves.png", "drift.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name


def test_train_json_is_one_document_on_stdout_and_progress_on_stderr(tmp_path):
    argv = [sys.executable, "-m", "lta.cli", "train", "--quick", "--workers", "3", "--drops", "0.3",
            "--methods", "renorm", "--steps", "10", "--json", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # the whole of stdout is one JSON document
    assert doc["schema"] == "lta.train/1"
    assert doc["lta_version"] == metadata.version("lta")
    assert doc["torch_version"] == metadata.version("torch")
    assert [r["drop"] for r in doc["rows"]] == [0.0, 0.3]  # 0 is always run: the lossless reference
    assert [d["p"] for d in doc["drift"]] == [0.0, 0.3]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert doc["rows"] == saved["rows"]
    # the progress (one line per run when stderr is not a terminal) and the files written: stderr
    assert "run 1/2" in proc.stderr and "run 2/2" in proc.stderr and "results.json" in proc.stderr


def test_emulated_stragglers_slow_every_step_they_hit(tmp_path):
    """--straggle-prob 1: every step of every worker sleeps (K-1) x base more; the run records the model."""
    out = tmp_path / "strag"
    cmd = [sys.executable, "-m", "lta", "-q", "train", "--quick", "--steps", "8", "--drops", "0"]
    cmd += ["--straggle-prob", "1", "--straggle-factor", "3", "--straggle-base-ms", "100", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["stragglers"] == {
        "base_s": 0.1,
        "prob": 1.0,
        "factor": 3.0,
        "slow_host": None,
        "lognormal": False,
        "seed": 0,
    }
    assert results["runs"][0]["wall_s"] >= 8 * 0.2  # 8 steps, each at least 200 ms of emulated straggling


def test_simulated_workers_sgd_and_bursty_loss_run_through_the_cli(tmp_path):
    """--simulate-workers 16 --optimizer sgd --loss-model ge: the sweep runs in-process and results.json
    says so; the loss the workers saw matches the configured mean rate; simulation refuses what it
    does not model in one line."""
    out = tmp_path / "sim"
    cmd = [sys.executable, "-m", "lta", "-q", "train", "--quick", "--simulate-workers", "16"]
    cmd += ["--drops", "0.2", "--methods", "renorm", "--optimizer", "sgd", "--loss-model", "ge"]
    cmd += ["--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    config = results["config"]
    assert (config["workers"], config["simulated"], config["optimizer"], config["loss_model"]) == (
        16,
        True,
        "sgd",
        "ge",
    )
    lossy = next(r for r in results["rows"] if r["drop"] == 0.2)
    assert abs(lossy["grad_loss_seen"] - 0.2) < 0.05  # 16 workers x 67 chunks x 40 steps, bursty
    bad = subprocess.run(
        [sys.executable, "-m", "lta", "train", "--quick", "--simulate-workers", "16", "--kill-worker", "1@5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--kill-worker needs worker processes" in bad.stderr
