"""Checkpoint/restore of the sharded optimizer and of ``lta train``.

The expectation is always an uninterrupted run: a job saved at step k and restored into fresh objects
(fresh sockets, a fresh switch, other initial weights and generator seeds) must take exactly the same
steps k..m, bit for bit, at zero loss. Workers run as threads on one softswitch; their deadlines for late
peers are long, so that a thread the GIL holds back is never taken for a lost packet.
"""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from hostlib.torch_ext.checkpoint import (
    CheckpointMismatch,
    commit,
    load_shard,
    read_manifest,
    rng_states,
    save_shard,
    set_rng_states,
)
from hostlib.torch_ext.sharded import ShardedOptimizer
from tests.conftest import run_workers

torch.set_num_threads(1)

PATIENT = {
    "sync_deadline_ms": 30_000.0,
    "lag_deadline_ms": 30_000.0,
    "min_deadline_ms": 30_000.0,
    "max_deadline_ms": 30_000.0,
    "elems_per_packet": 64,
}
COLLECT_MS = 30_000.0
_GLOBAL_RNG = threading.Lock()


class Trainer:
    """One worker's training loop: two parameter groups, AdamW, an LR schedule, its own batch stream."""

    def __init__(self, worker, init_seed: int, batch_seed: int, hidden: int = 40) -> None:
        with _GLOBAL_RNG:  # threads share torch's global generator: one initializes at a time
            torch.manual_seed(init_seed)
            self.model = torch.nn.Sequential(
                torch.nn.Linear(12, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)
            )
        first, second = self.model[0], self.model[2]
        groups = [
            {"params": list(first.parameters()), "weight_decay": 0.1},
            {"params": list(second.parameters()), "weight_decay": 0.0},
        ]
        adamw = torch.optim.AdamW(groups, lr=3e-2, betas=(0.9, 0.95))
        self.opt = ShardedOptimizer(adamw, worker, stale_bound=4, collect_deadline_ms=COLLECT_MS)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1.0 + 0.3 * s))
        self.batches = torch.Generator().manual_seed(batch_seed)
        self.losses: list[float] = []

    def train(self, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(16, 12, generator=self.batches)
            loss = (self.model(x) - x[:, :3]).pow(2).mean()
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            self.schedule.step()
            self.losses.append(loss.item())

    def save(self, directory, step: int):
        extra = {"scheduler": self.schedule.state_dict(), "losses": list(self.losses)}
        return save_shard(
            directory,
            step=step,
            model=self.model,
            optimizer=self.opt,
            generators={"batches": self.batches},
            extra=extra,
        )

    def load(self, directory) -> int:
        restored = load_shard(
            directory, model=self.model, optimizer=self.opt, generators={"batches": self.batches}
        )
        self.schedule.load_state_dict(restored.extra["scheduler"])
        self.losses = list(restored.extra["losses"])
        return restored.step


def assert_same(a, b, where: str = "") -> None:
    """Bitwise equality of nested dicts/lists of tensors, arrays and plain values."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (
            f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        )
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def train_uninterrupted(make_cluster, n: int, steps: int) -> list[Trainer]:
    cluster = make_cluster(n, **PATIENT)

    def body(worker, i):
        trainer = Trainer(worker, init_seed=0, batch_seed=100 + i)
        trainer.train(steps)
        return trainer

    return run_workers(cluster.workers, body)


def test_state_dict_round_trip_is_bitwise(make_cluster):
    n = 4
    cluster = make_cluster(n, **PATIENT)

    def first(worker, i):
        trainer = Trainer(worker, init_seed=0, batch_seed=100 + i)
        trainer.train(3)
        return trainer, trainer.opt.state_dict()

    saved = run_workers(cluster.workers, first)
    fresh = make_cluster(n, job_id=2, **PATIENT)  # other job id: another rounding seed until loaded

    def second(worker, i):
        trainer = Trainer(worker, init_seed=7, batch_seed=999)
        original, state = saved[i]
        buffer = io.BytesIO()
        torch.save(state, buffer)  # only tensors and plain values: weights_only reads it
        buffer.seek(0)
        trainer.model.load_state_dict(original.model.state_dict())
        trainer.opt.load_state_dict(torch.load(buffer, weights_only=True))
        return trainer

    restored = run_workers(fresh.workers, second)
    sizes = []
    for (original, state), trainer in zip(saved, restored, strict=True):
        assert_same(state, trainer.opt.state_dict(), "state")
        # the restored optimizer steps the same shard with the same hyperparameters, groups still shared
        assert trainer.opt.param_groups is trainer.opt.inner.param_groups
        assert [g["lr"] for g in trainer.opt.param_groups] == [g["lr"] for g in original.opt.param_groups]
        moments = [trainer.opt.state[g["params"][0]]["exp_avg"] for g in trainer.opt.param_groups]
        lo, hi = trainer.opt.shard
        assert sum(m.numel() for m in moments) == hi - lo > 0  # the shard's state only
        assert any(m.numel() and m.abs().max() > 0 for m in moments)
        sizes.append(hi - lo)
    assert sum(sizes) == restored[0].opt.flat.numel  # the shards tile the parameters
    assert restored[0].opt.state_dict()["transport"]["next_unit"] > 0  # the unit counter came along
    with pytest.raises(CheckpointMismatch, match=r"worker_id 0 \(here 1\), shard \[0, \d+\] \(here \["):
        restored[1].opt.load_state_dict(saved[0][1])  # rank 0's shard into rank 1: refused


def test_restore_at_step_k_continues_bitwise_to_step_m(make_cluster, tmp_path):
    n, k, m = 4, 4, 9
    reference = train_uninterrupted(make_cluster, n, m)

    before = make_cluster(n, **PATIENT)  # the reference's job id, so the same rounding seed: a replay of it

    def part_one(worker, i):
        trainer = Trainer(worker, init_seed=0, batch_seed=100 + i)
        trainer.train(k)
        return trainer.save(tmp_path, k)

    records = run_workers(before.workers, part_one)
    manifest = commit(tmp_path, records, extra={"note": "part one"})
    assert manifest.step == k and manifest.world_size == n
    assert read_manifest(tmp_path) == manifest

    after = make_cluster(n, job_id=4, **PATIENT)  # fresh switch, sockets and job: nothing carried over

    def part_two(worker, i):
        trainer = Trainer(worker, init_seed=123, batch_seed=456)  # other weights and batches until loaded
        assert trainer.load(tmp_path) == k
        trainer.train(m - k)
        return trainer

    resumed = run_workers(after.workers, part_two)
    moved = float(np.abs(reference[0].opt.replica() - resumed[0].opt.replica()).max())
    for i in range(n):
        want, got = reference[i].opt.replica(), resumed[i].opt.replica()
        assert np.array_equal(want, got), f"worker {i}: parameters differ by up to {np.abs(want - got).max()}"
        assert reference[i].losses == resumed[i].losses  # steps 0..k-1 loaded, k..m-1 retrained
        assert reference[i].opt.lta_step == resumed[i].opt.lta_step == m
    assert moved == 0.0
    assert reference[0].losses[k] != reference[0].losses[m - 1]  # not vacuous: training went on after k


def test_uncommitted_files_are_invisible_and_commit_prunes_old_steps(make_cluster, tmp_path):
    n = 3
    cluster = make_cluster(n, **PATIENT)

    def body(worker, i):
        trainer = Trainer(worker, init_seed=0, batch_seed=i)
        trainer.train(2)
        first = trainer.save(tmp_path, 2)
        trainer.train(2)
        second = trainer.save(tmp_path, 4)
        return trainer, first, second

    results = run_workers(cluster.workers, body)
    commit(tmp_path, [r[1] for r in results])
    assert read_manifest(tmp_path).step == 2  # step 4's files are written but not committed
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == [
        f"rank{r}-step{s}.pt" for r in range(n) for s in (2, 4)
    ]
    commit(tmp_path, [r[2] for r in results])
    assert read_manifest(tmp_path).step == 4
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == [f"rank{r}-step4.pt" for r in range(n)]
    with pytest.raises(ValueError, match="one file per rank"):
        commit(tmp_path, [r[2] for r in results][:2])


def test_manifest_mismatch_is_one_clear_line(make_cluster, tmp_path):
    four = make_cluster(4, **PATIENT)
    records = run_workers(four.workers, lambda w, i: Trainer(w, 0, i).save(tmp_path, 0))
    commit(tmp_path, records)

    three = make_cluster(3, job_id=5, **PATIENT)
    with pytest.raises(CheckpointMismatch) as info:
        load_shard(tmp_path, **_objects(Trainer(three.workers[0], 0, 0)))
    message = str(info.value)
    assert "\n" not in message and "workers 4 (this job: 3)" in message and str(tmp_path) in message

    other_model = make_cluster(4, job_id=6, **PATIENT)
    with pytest.raises(CheckpointMismatch, match=r"parameters 643 \(this job: 659\)"):
        load_shard(tmp_path, **_objects(Trainer(other_model.workers[0], 0, 0, hidden=41)))

    other_k = make_cluster(4, job_id=7, **{**PATIENT, "elems_per_packet": 32})
    with pytest.raises(CheckpointMismatch, match=r"K 64 \(this job: 32\)"):
        load_shard(tmp_path, **_objects(Trainer(other_k.workers[0], 0, 0)))

    empty = tmp_path / "empty"
    empty.mkdir()
    assert read_manifest(empty) is None
    with pytest.raises(CheckpointMismatch, match="no checkpoint"):
        load_shard(empty, **_objects(Trainer(four.workers[0], 0, 0)))
    (tmp_path / records[2].name).unlink()
    with pytest.raises(CheckpointMismatch, match="incomplete"):
        load_shard(tmp_path, **_objects(Trainer(four.workers[2], 0, 0)))


def _objects(trainer: Trainer) -> dict:
    return {"model": trainer.model, "optimizer": trainer.opt}


def test_rng_states_round_trip():
    torch.manual_seed(3)
    np.random.seed(4)
    random.seed(5)
    g = torch.Generator().manual_seed(6)
    states = rng_states({"batches": g})
    buffer = io.BytesIO()
    torch.save(states, buffer)
    first = (torch.rand(4), np.random.rand(4), random.random(), torch.rand(4, generator=g))
    buffer.seek(0)
    set_rng_states(torch.load(buffer, weights_only=True), {"batches": g})
    again = (torch.rand(4), np.random.rand(4), random.random(), torch.rand(4, generator=g))
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert first[2] == again[2] and torch.equal(first[3], again[3])
    with pytest.raises(CheckpointMismatch, match="'other'"):
        set_rng_states(states, {"other": torch.Generator()})


# ---- lta train -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--checkpoint-every", "5"], "--checkpoint-every needs somewhere to save"),
        (["--stop-after", "5"], "--stop-after needs somewhere to save"),
        (["--checkpoint-dir", "{tmp}/a", "--stop-after", "40"], "--stop-after 40 must be below --steps 40"),
        (["--checkpoint-dir", "{tmp}/a", "--resume", "{tmp}/a"], "leave out --checkpoint-dir"),
        (["--resume", "{tmp}/nothing"], "no lta train checkpoints there"),
        (["--checkpoint-dir", "{tmp}"], "is not empty; continue what is there with --resume"),
    ],
)
def test_bad_checkpoint_flags_are_one_line_and_exit_2(capsys, tmp_path, argv, message):
    from lta import cli

    (tmp_path / "out").mkdir()
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(["train", "--quick", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out" / "results.json").exists()


def test_resume_of_another_sweep_names_the_difference(capsys, tmp_path):
    from lta import cli
    from lta.train.experiment import quick_config
    from lta.train.resume import SweepCheckpoints, sweep_settings

    # a --quick sweep of 3 workers with another stale bound was checkpointed here
    settings = sweep_settings(3, ["up", "param"], replace(quick_config(), stale_bound=5), None)
    SweepCheckpoints(tmp_path / "ckpt", settings, resume=False, every=None, stop_after=None)
    assert cli.main(["train", "--quick", "--out", str(tmp_path), "--resume", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "workers 3 (this command: 4)" in err and "train.stale_bound 5 (this command: 8)" in err


def _train(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lta.cli", "train", "--quick", "--drops", "0", "--methods", "renorm", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _worker_curves(out) -> list[list[float]]:
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert len(runs) == 1
    return runs[0]["worker_curves"]


@pytest.mark.slow
def test_lta_train_resume_reproduces_the_uninterrupted_losses(tmp_path):
    steps, every, stop = "60", "20", "30"
    whole = _train("--steps", steps, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]

    ckpt = tmp_path / "ckpt"
    first = _train(
        "--steps",
        steps,
        "--checkpoint-every",
        every,
        "--checkpoint-dir",
        str(ckpt),
        "--stop-after",
        stop,
        "--out",
        str(tmp_path / "first"),
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (tmp_path / "first" / "results.json").exists()  # stopped: nothing to report yet
    manifest = read_manifest(ckpt / "lossless-s0")
    assert manifest is not None and manifest.step == int(stop) and manifest.world_size == 4

    second = _train("--steps", steps, "--resume", str(ckpt), "--out", str(tmp_path / "resumed"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming lossless-s0 at step 30" in second.stderr

    want, got = _worker_curves(tmp_path / "whole"), _worker_curves(tmp_path / "resumed")
    assert len(want) == len(got) == 4 and all(len(c) == int(steps) for c in got)
    assert got == want  # bitwise: JSON floats round-trip exactly

    again = _train("--steps", steps, "--resume", str(ckpt), "--out", str(tmp_path / "again"))
    assert again.returncode == 0 and "lossless-s0: finished, results loaded" in again.stderr
    assert _worker_curves(tmp_path / "again") == want

    wrong = _train("--steps", steps, "--workers", "3", "--resume", str(ckpt), "--out", str(tmp_path / "x"))
    assert wrong.returncode == 2
    assert wrong.stderr.count("\n") == 1 and "workers" in wrong.stderr
