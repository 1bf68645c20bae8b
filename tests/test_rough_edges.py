"""What a new user hits first (issue 25): outputs checked before any work, reruns that do not silently
replace results, results on stdout and everything else on stderr, exit codes as the README states them,
sizes and probabilities refused at parse time, and messages that name the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lta import cli


class Started(Exception):
    """Raised by a stand-in cluster: the command got as far as starting work."""


def _no_cluster(*args, **kwargs):
    raise Started


# ---- 1, 2: lta train's --out ---------------------------------------------------------------------------
def test_train_refuses_an_out_that_is_a_file_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)  # starting a run would raise
    target = tmp_path / "results"
    target.write_text("not a folder")
    assert cli.main(["train", "--quick", "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lta train: error: --out ")
    assert "is a file" in err
    assert target.read_text() == "not a folder"


def test_train_refuses_an_out_under_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)
    (tmp_path / "f").write_text("")
    assert cli.main(["train", "--quick", "--out", str(tmp_path / "f" / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot make the folder" in err


def test_train_refuses_to_replace_an_earlier_sweep_unless_told(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)
    out = tmp_path / "lta-train"
    out.mkdir()
    (out / "results.json").write_text('{"earlier": true}')
    assert cli.main(["train", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds the results" in err and "--overwrite" in err
    assert (out / "results.json").read_text() == '{"earlier": true}'
    # --overwrite goes on to train (here: to the stand-in cluster), saying on stderr what it replaces
    with pytest.raises(Started):
        cli.main(["train", "--quick", "--out", str(out), "--overwrite"])
    assert "replacing the results of an earlier sweep" in capsys.readouterr().err


def test_train_accepts_a_folder_without_results(tmp_path, monkeypatch):
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)
    (tmp_path / "notes.txt").write_text("mine")  # other files are not an earlier sweep's
    with pytest.raises(Started):
        cli.main(["train", "--quick", "--out", str(tmp_path)])


def test_quick_train_has_its_own_default_folder(tmp_path, monkeypatch):
    # make run ARGS=--quick must not land on a full sweep's lta-train/
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lta-train").mkdir()
    (tmp_path / "lta-train" / "results.json").write_text("{}")
    with pytest.raises(Started):
        cli.main(["train", "--quick"])
    assert (tmp_path / "lta-train-quick").is_dir()
    assert cli.main(["train"]) == 2  # the full sweep's default folder holds results: refused


def test_simulated_train_log_results_header_and_drift_note(tmp_path):
    """Not on a terminal: each run is listed once on stderr, the 'wrote' line is one line however long,
    stdout has the table only, and results.json leads with the same header as --json documents."""
    out = tmp_path / ("a-folder-name-long-enough-that-the-wrote-line-runs-well-past-eighty-columns" * 2)
    cmd = [sys.executable, "-m", "lta", "train", "--quick", "--simulate-workers", "3", "--drops", "0,0.1"]
    cmd += ["--methods", "renorm", "--steps", "4", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    for name in ("lossless-s0", "renorm-p0.10-s0"):
        assert sum(name in line for line in lines) == 1, proc.stderr
    wrote = [line for line in lines if line.startswith("wrote ")]
    assert len(wrote) == 1
    names = ("results.json", "table.md", "loss_curves.png", "drift.png", "val_ppl_change.png")
    assert wrote[0] == "wrote " + ", ".join(str(out / n) for n in names)
    assert proc.stdout.startswith("# lta train") and "wrote " not in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == "lta.train/2"
    assert list(results)[:3] == ["schema", "lta_version", "torch_version"]
    table = (out / "table.md").read_text()
    assert "lets a stale copy lag one step only" in table and "2p/(1−p)²σ²" in table
    assert Path(out / "drift.png").read_bytes()[:4] == b"\x89PNG"
