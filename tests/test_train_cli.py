"""``lta train --quick``: the main job end to end (4 worker processes, a softswitch, 13 runs), and the
sweep the flags ask for (seeds, methods, mechanisms) without training."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest

from hostlib.torch_ext.drift import iid_drift, paper_drift
from lta import cli

ROW_FIELDS = {"drop", "method", "mechanism", "train_loss", "train_ppl", "val_loss", "val_ppl", "seeds"}
ROW_FIELDS |= {
    "grad_loss_seen",
    "param_loss_seen",
    "timer_flushes",
    "resend_requests",
    "resend_requests_per_step",
}
CHANGES = {f"{m}_change_pct" for m in ("train_loss", "train_ppl", "val_loss", "val_ppl")}
INTERVALS = {f"{m}_change_ci95" for m in ("train_loss", "train_ppl", "val_loss", "val_ppl")}
DRIFT_FIELDS = {"p", "mechanism", "measured", "sigma2", "paper", "iid", "max_stale_age", "stale_bound"}
DRIFT_FIELDS |= {"stale_bound_holds"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def unigram_val_loss() -> tuple[float, float]:
    """Validation cross-entropy (nats) of the character-frequency model of the training split (add-one
    smoothed), and of the uniform guess ln(vocab): what a model that learned only frequencies, or
    nothing, would score."""
    import numpy as np

    from lta.train.gpt import CharCorpus

    corpus = CharCorpus()
    freq = np.bincount(corpus.train.numpy(), minlength=corpus.vocab) + 1.0
    freq /= freq.sum()
    return float(-np.log(freq[corpus.val.numpy()]).mean()), float(np.log(corpus.vocab))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lta-train")
    proc = subprocess.run(
        [sys.executable, "-m", "lta.cli", "train", "--quick", "--seeds", "0", "--out", str(out)],
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
    rows = results["rows"]
    unigram, uniform = unigram_val_loss()
    groups = [("renorm", "none"), ("prev", "none"), ("zero", "none")]  # no --mechanism: plain runs
    assert [(r["method"], r["mechanism"], r["drop"]) for r in rows] == [
        (*g, d) for g in groups for d in drops
    ]
    for row in rows:
        assert ROW_FIELDS | CHANGES | INTERVALS <= set(row)
        assert row["seeds"] == [0]
        assert all(row[c] is None for c in INTERVALS)  # one seed: no interval
        assert row["train_ppl"] == pytest.approx(2.718281828 ** row["train_loss"], rel=1e-9)
        assert row["val_ppl"] == pytest.approx(2.718281828 ** row["val_loss"], rel=1e-9)
        # it learned: nearer the character-frequency model than the uniform guess ln(vocab)
        assert 0.5 < row["val_loss"] < (unigram + uniform) / 2, (row["method"], row["drop"], row["val_loss"])
        assert row["resend_requests"] is not None and row["resend_requests"] >= 0
    lossless = [r for r in rows if r["drop"] == 0]
    assert all(r["val_loss"] < unigram for r in lossless)  # and without loss it beats that model
    assert all(r[c] == 0.0 for r in lossless for c in CHANGES)
    assert all(r["grad_loss_seen"] == 0.0 for r in lossless)
    assert "baselines" not in results  # every method is in rows
    assert [d["p"] for d in results["drift"]] == drops
    for d in results["drift"]:
        assert DRIFT_FIELDS <= set(d)
        assert d["mechanism"] == "none"
        assert d["paper"] == pytest.approx(paper_drift(d["p"], d["sigma2"]))
        assert d["iid"] == pytest.approx(iid_drift(d["p"], d["sigma2"]))
        assert d["max_stale_age"] <= d["stale_bound"] + 1 and d["stale_bound_holds"] is True
    lossless, lossy = results["drift"][0], results["drift"][-1]
    assert lossless["measured"] == 0.0  # nothing lost: every replica identical
    assert lossy["measured"] > 0.0 and lossy["sigma2"] > 0.0
    assert lossy["p_effective"] == pytest.approx(0.4, abs=0.08)
    assert "| Metric | 0% | 10% | 20% | 30% | 40% |" in (out / "table.md").read_text()
    assert "| Metric |" in proc.stdout
    assert "run 1/" not in proc.stdout and "run 1/" in proc.stderr  # progress goes to stderr only


def test_quick_train_plots(quick_run):
    out, _ = quick_run
    for name in ("loss_curves.png", "drift.png", "val_ppl_change.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name


STRAGGLERS = ["--straggle-prob", "1", "--straggle-factor", "3", "--straggle-base-ms", "100"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """One small CLI sweep (3 workers, 10 steps, 3 runs) with emulated stragglers on every step, read by the
    --json test and the stragglers test below: each CLI start spawns the workers anew, which costs more
    here than the runs themselves."""
    out = tmp_path_factory.mktemp("small")
    argv = [sys.executable, "-m", "lta.cli", "train", "--quick", "--seeds", "0", "--workers", "3",
            "--drops", "0.3", "--methods", "renorm", "--mechanism", "none,stale1", "--steps", "10", "--json",
            *STRAGGLERS, "--out", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_train_json_is_one_document_on_stdout_and_progress_on_stderr(small_run):
    tmp_path, proc = small_run
    doc = json.loads(proc.stdout)  # the whole of stdout is one JSON document
    assert doc["schema"] == "lta.train/2"
    assert doc["lta_version"] == metadata.version("lta")
    assert doc["torch_version"] == metadata.version("torch")
    # 0 is always run: the lossless reference of every (method, mechanism) group
    got = [(r["method"], r["mechanism"], r["drop"]) for r in doc["rows"]]
    assert got == [
        ("renorm", "none", 0.0),
        ("renorm", "none", 0.3),
        ("renorm", "stale1", 0.0),
        ("renorm", "stale1", 0.3),
    ]
    assert [(d["mechanism"], d["p"]) for d in doc["drift"]] == [("none", 0.0), ("none", 0.3), ("stale1", 0.3)]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert doc["rows"] == saved["rows"]
    assert [r["name"] for r in saved["runs"]] == ["lossless-s0", "renorm-p0.30-s0", "renorm+stale1-p0.30-s0"]
    assert saved["config"]["mechanisms"] == ["none", "stale1"] and saved["config"]["seeds"] == [0]
    # the progress (one line per run when stderr is not a terminal) and the files written: stderr
    assert "run 1/3" in proc.stderr and "run 3/3" in proc.stderr and "results.json" in proc.stderr


def _sweep(*argv: str):
    args = cli.build_parser().parse_args(["train", *argv])
    from lta.train.cli import sweep_from_args

    return sweep_from_args(args)


def test_sweep_runs_every_mechanism_on_renorm_and_the_baselines_plain():
    drops, seeds, mechanisms, specs = _sweep(
        "--mechanism", "none", "--mechanism", "feedback", "--methods", "renorm,prev", "--drops", "0,0.1",
        "--seeds", "0,1",
    )  # fmt: skip
    assert (drops, seeds, mechanisms) == ([0.0, 0.1], [0, 1], ["none", "feedback"])
    expected = []
    for seed in (0, 1):
        expected += [
            (f"lossless-s{seed}", "renorm", "none", 0.0, seed),
            (f"renorm-p0.10-s{seed}", "renorm", "none", 0.1, seed),
            (f"renorm+feedback-p0.10-s{seed}", "renorm", "feedback", 0.1, seed),
            (f"prev-p0.10-s{seed}", "prev", "none", 0.1, seed),
        ]
    assert [(s.name, s.method, s.mechanism, s.drop, s.seed) for s in specs] == expected
    # one job id per seed: every method and mechanism of a seed meets the same drops and rounding
    assert [s.job_id for s in specs] == [1] * 4 + [2] * 4
    # a comma list is the same as repeating the flag; repeats are run once
    again = _sweep("--mechanism", "none,feedback", "--mechanism", "feedback", "--methods", "renorm,prev",
                   "--drops", "0.1", "--seeds", "0,1")  # fmt: skip
    assert [s.name for s in again[3]] == [s.name for s in specs]
    combined = _sweep("--mechanism", "retrieve+feedback", "--methods", "renorm", "--drops", "0.1",
                      "--seeds", "0")  # fmt: skip
    assert [(s.name, s.mechanism) for s in combined[3]] == [
        ("lossless-s0", "none"),
        ("renorm+retrieve+feedback-p0.10-s0", "retrieve+feedback"),
    ]


def test_sweep_defaults_three_seeds_one_with_quick_and_no_mechanism():
    drops, seeds, mechanisms, specs = _sweep()
    assert (drops, seeds, mechanisms) == ([0.0, 0.1, 0.2, 0.3, 0.4], [0, 1, 2], ["none"])
    assert len(specs) == 3 * (1 + 4 * 3)  # per seed: the 0% run, then 4 drop rates x 3 methods
    names = [s.name for s in specs]
    assert len(set(names)) == len(names) and "zero-p0.40-s2" in names and "lossless-s1" in names
    assert all(s.mechanism == "none" for s in specs)
    assert _sweep("--quick")[1] == [0]
    assert _sweep("--quick", "--seeds", "3,4")[1] == [3, 4]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mechanism", "bogus"], "one of none, feedback, stale1, stale2, retrieve, rotate or a '+'"),
        (["--mechanism", "none,bogus"], "--mechanism"),
        (["--mechanism", "retrieve,feedback+rotate"], "feedback does not combine with rotate"),
        (["--mechanism", "stale2+retrieve"], "retrieve leaves no copy to bound"),
        (
            ["--methods", "prev,zero", "--mechanism", "feedback"],
            "applies to renorm runs: add renorm to --methods",
        ),
    ],
)
def test_bad_mechanisms_are_one_line_and_exit_2(capsys, tmp_path, argv, message):
    assert cli.main(["train", "--quick", "--seeds", "0", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_emulated_stragglers_slow_every_step_they_hit(small_run):
    """--straggle-prob 1: every step of every worker sleeps (K-1) x base more; the run records the model."""
    out, _ = small_run
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["stragglers"] == {
        "base_s": 0.1,
        "prob": 1.0,
        "factor": 3.0,
        "slow_host": None,
        "lognormal": False,
        "seed": 0,
    }
    assert len(results["runs"]) == 3
    for run in results["runs"]:  # 10 steps, each at least 200 ms of emulated straggling
        assert run["wall_s"] >= 10 * 0.2 and run["step_ms_median"] >= 200, run["step_ms_median"]


def test_simulated_workers_sgd_and_bursty_loss_run_through_the_cli(tmp_path, capsys):
    """--simulate-workers 16 --optimizer sgd --loss-model ge: the sweep runs in-process and results.json
    says so; the loss the workers saw matches the configured mean rate; simulation refuses what it
    does not model in one line."""
    out = tmp_path / "sim"
    cmd = [sys.executable, "-m", "lta", "-q", "train", "--quick", "--seeds", "0", "--simulate-workers", "16"]
    cmd += ["--drops", "0.2", "--methods", "renorm", "--optimizer", "sgd", "--loss-model", "ge"]
    cmd += ["--batch", "4", "--lr", "0.1", "--out", str(out)]
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
    # --batch 4 (the 4-worker run's global batch of 16 sequences, one per simulated worker); the
    # validation set keeps --quick's batches of 8
    assert (config["train"]["batch"], config["train"]["val_batch"]) == (4, 8)
    assert (config["train"]["sgd_lr"], config["train"]["lr"]) == (0.1, 3e-3)  # --lr is SGD's here
    lossy = next(r for r in results["rows"] if r["drop"] == 0.2)
    # Each worker's GRADs (67 chunks x 40 steps) cross its own Gilbert-Elliott link at a mean 0.2 in
    # bursts of 4 (r = 1/4, p = r·0.2/0.8; exponents are spared in exact mode): the mean of m losses of
    # the two-state chain has variance pi(1 - pi)/m x (1 + rho)/(1 - rho), rho = 1 - p - r; 16 links.
    pi, r = 0.2, 0.25
    rho = 1 - r * pi / (1 - pi) - r
    sigma = np.sqrt(pi * (1 - pi) / (16 * 67 * 40) * (1 + rho) / (1 - rho))
    assert abs(lossy["grad_loss_seen"] - pi) < 5 * sigma, (lossy["grad_loss_seen"], sigma)
    assert lossy["timer_flushes"] is None  # simulated workers have no transport: nothing to count
    assert lossy["resend_requests"] is not None and lossy["resend_requests_per_step"] is not None
    title = (out / "table.md").read_text().splitlines()[0]
    assert "16 simulated workers" in title and "Gilbert-Elliott" in title
    capsys.readouterr()
    bad = cli.main(["train", "--quick", "--simulate-workers", "16", "--kill-worker", "1@5"])
    err = capsys.readouterr().err
    assert bad == 2 and err.count("\n") == 1
    assert "--kill-worker needs worker processes" in err


@pytest.mark.timeout(1200)  # four CLI starts; five took 11 min at load 20
def test_jobs_give_the_sequential_sweep_and_keep_finished_runs(tmp_path, capsys):
    """--jobs 2 trains the simulated runs in two processes: every run's curve and validation loss equal
    the sequential sweep's (runs are independent); the same command again loads the finished runs from
    OUT/runs instead of training them, and runs kept with other settings are refused in one line."""
    base = [sys.executable, "-m", "lta", "train", "--quick", "--simulate-workers", "3", "--seeds", "0"]
    base += ["--drops", "0.2", "--methods", "renorm", "--mechanism", "none,rotate", "--steps", "6"]
    seq = subprocess.run([*base, "--out", str(tmp_path / "seq")], capture_output=True, text=True, timeout=900)
    assert seq.returncode == 0, seq.stderr[-2000:]
    par_cmd = [*base, "--jobs", "2", "--out", str(tmp_path / "par")]
    par = subprocess.run(par_cmd, capture_output=True, text=True, timeout=900)
    assert par.returncode == 0, par.stderr[-2000:]
    runs = {}
    for name in ("seq", "par"):
        results = json.loads((tmp_path / name / "results.json").read_text())
        runs[name] = {r["name"]: (r["val_loss"], r["worker_curves"]) for r in results["runs"]}
    assert len(runs["seq"]) == 3 and runs["seq"] == runs["par"]
    assert len(list((tmp_path / "par" / "runs").glob("*-s*.json"))) == 3
    again = subprocess.run([*par_cmd, "--overwrite"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count("loaded from") == 3
    other = [*base[:-2], "--steps", "7", "--jobs", "2", "--out", str(tmp_path / "par"), "--overwrite"]
    refused = subprocess.run(other, capture_output=True, text=True, timeout=300)
    last = refused.stderr.strip().splitlines()[-1]  # (after --overwrite's warning about the old table)
    assert refused.returncode == 2 and "holds runs trained with other settings (train)" in last
    capsys.readouterr()
    assert cli.main(["train", "--quick", "--jobs", "2"]) == 2  # as base[:5] + --jobs 2, in this process
    assert "--simulate-workers" in capsys.readouterr().err


def test_the_validation_set_does_not_follow_the_training_batch():
    """--batch changes the training batch only: the validation loss of one model is the same at any
    batch, and changes with val_batch (its own setting)."""
    import torch

    from lta.train.experiment import TrainConfig, evaluate, quick_config
    from lta.train.gpt import CharCorpus, CharGpt

    cfg, corpus = quick_config(), CharCorpus()
    torch.manual_seed(0)
    model = CharGpt(cfg.gpt(corpus.vocab))
    losses = {
        (batch, val_batch): evaluate(model, corpus, TrainConfig(**{**vars(cfg), "batch": batch,
                                                                   "val_batch": val_batch}), 0, 1)
        for batch, val_batch in ((8, 8), (3, 8), (8, 5))
    }  # fmt: skip
    assert losses[(3, 8)] == losses[(8, 8)]
    assert losses[(8, 5)][1] == 8 * 5 * cfg.context and losses[(8, 8)][1] == 8 * 8 * cfg.context
    assert losses[(8, 5)][0] != losses[(8, 8)][0]


def test_a_run_folder_from_before_a_new_setting_is_reused_and_other_settings_are_refused(tmp_path):
    """OUT/runs/settings.json written before TrainConfig had val_batch (validation batches were
    --batch's): the same sweep today trains as those runs did, so the folder is taken; a folder
    whose runs had another batch is refused as before."""
    from hostlib.errors import UsageError
    from lta.train.experiment import TrainConfig, config_dict, quick_config
    from lta.train.parallel import RunStore

    for cfg in (TrainConfig(steps=1000), quick_config()):
        settings = {"workers": 4, "directions": ["up", "param"], "train": config_dict(cfg)}
        old = {**settings, "train": {k: v for k, v in settings["train"].items() if k != "val_batch"}}
        out = tmp_path / f"b{cfg.batch}"
        (out / "runs").mkdir(parents=True)
        (out / "runs" / "settings.json").write_text(json.dumps(old))
        RunStore(out, settings)  # taken
        other = {**settings, "train": {**settings["train"], "batch": cfg.batch + 1}}
        with pytest.raises(UsageError, match=r"other settings \(train\)"):
            RunStore(out, other)


def test_a_diverging_simulated_run_is_one_line_that_names_it(tmp_path, capsys):
    """A learning rate no run survives: the sequential sweep stops at the first run that diverges, --jobs
    lets every run end and then names each that diverged, with the step; one line, exit 1, no table."""
    argv = ["train", "--quick", "--simulate-workers", "3", "--seeds", "0", "--drops", "0.2"]
    argv += ["--methods", "renorm", "--lr", "10000", "--steps", "6"]
    assert cli.main(["-q", *argv, "--out", str(tmp_path / "seq")]) == 1  # in this process
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run lossless-s0 diverged at step " in err[0], err
    out = tmp_path / "jobs"
    cmd = [sys.executable, "-m", "lta", *argv, "--jobs", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "2 of 2 runs trained diverged (" in last, done.stderr[-2000:]
    assert "lossless-s0 at step" in last and "renorm-p0.20-s0 at step" in last
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "seq" / "table.md").exists() and not (out / "table.md").exists()


def test_the_runs_that_did_not_diverge_are_kept_and_the_others_named():
    """lta.train.parallel._as_finished over finished futures: the runs that ended are yielded (and so
    saved), then TrainingDiverged names each diverged run and its step."""
    from concurrent.futures import Future
    from pathlib import Path

    from hostlib.errors import TrainingDiverged
    from lta.train.experiment import RunSpec
    from lta.train.parallel import _as_finished

    specs = [RunSpec(f"r{i}", "renorm", 0.1, i, 1) for i in range(3)]

    class Pool:  # submit runs nothing: run 1 diverged at step 7, the others ended
        def submit(self, fn, spec, directions):  # noqa: ANN001, ANN202
            future: Future = Future()
            if spec.name == "r1":
                future.set_exception(TrainingDiverged("run r1 diverged", "r1", 7))
            else:
                future.set_result({"name": spec.name})
            return future

    got = []
    with pytest.raises(TrainingDiverged) as raised:
        for data in _as_finished(Pool(), specs, ("up",), Path("OUT/runs")):  # type: ignore[arg-type]
            got.append(data["name"])
    assert sorted(got) == ["r0", "r2"]
    message = str(raised.value)
    assert "1 of 3 runs trained diverged (r1 at step 7" in message and "kept in OUT/runs" in message


def test_a_diverging_run_of_worker_processes_is_one_line_that_names_it(tmp_path):
    """The real path (4 worker processes through the softswitch): a worker whose loss or gradient is not
    finite ends the sweep with one line naming the run, the step and the worker; exit 1, no traceback."""
    cmd = [sys.executable, "-m", "lta", "train", "--quick", "--seeds", "0", "--drops", "0", "--lr", "10000"]
    cmd += ["--steps", "4", "--out", str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "run lossless-s0 diverged at step " in last, done.stderr[-2000:]
    assert "'s loss or gradient is not finite" in last and "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "table.md").exists()
