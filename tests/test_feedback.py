"""Lost-contribution feedback (hostlib/emulation/feedback.py) alone and inside the sharded optimizer.

Expectations are independent of the code under test: the sum of a worker's gradients (numpy, float64),
what the switch summed for it (its RESULT's value × count where its bit is set), bitmaps decoded bit by
bit, and the codec's stated error bound.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.emulation.feedback import ResidualFeedback, counted_by_result, counted_mask, feedback_stats
from hostlib.torch_ext.checkpoint import CheckpointMismatch
from hostlib.torch_ext.sharded import ShardedOptimizer
from hostlib.transport import Fallback
from tests.conftest import run_workers

torch.set_num_threads(1)
K = 64


def test_counted_by_result_reads_this_workers_bit_and_the_fallback():
    bitmap = np.array([0b101, 0b010, 0b111, 0, 0b001], dtype=np.uint64)
    fallback = np.array([Fallback.NONE, Fallback.NONE, Fallback.PREV, Fallback.PREV, Fallback.ZERO])
    # worker 0: bit set in chunks 0, 2, 4; chunk 2's sum was discarded (prev), chunk 4 zero-filled (kept)
    assert counted_by_result(bitmap, fallback, 0).tolist() == [True, False, False, False, True]
    assert counted_by_result(bitmap, fallback, 1).tolist() == [False, True, False, False, False]
    high = np.array([1 << 63], dtype=np.uint64)  # the bitmap's last worker
    assert counted_by_result(high, np.array([Fallback.NONE]), 63).tolist() == [True]
    contributed = np.array([[True, True], [True, False]])
    delivered = np.array([[True, False], [True, True]])
    codes = np.full((2, 2), Fallback.NONE)
    assert counted_mask(contributed, delivered, codes).tolist() == [[True, False], [True, False]]


def test_residuals_conserve_every_workers_gradients_over_steps():
    """N workers, a seeded loss pattern: after T steps, Σ_t (what was sent and counted) + the residual
    left = Σ_t gradient, per worker and value. The only error is float32 rounding of the additions
    g_t + r_{t−1} (at most |sent|·2⁻²⁴ each), so the tolerance is T·2⁻²³ of the largest |sent|."""
    n, c, steps = 5, 7, 40
    rng = np.random.default_rng(0)
    feedback = ResidualFeedback(c, K, n)
    total = np.zeros((n, c, K))
    counted_sum = np.zeros((n, c, K))
    largest, lost_chunks, l1 = 0.0, 0, 0.0
    for _ in range(steps):
        grads = rng.standard_normal((n, c, K)).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 2))
        total += grads
        rows = grads.copy()
        feedback.add_to(rows)
        counted = rng.random((n, c)) > 0.3
        counted_sum += np.where(counted[:, :, None], rows, 0.0)
        feedback.settle(rows, counted)
        largest = max(largest, float(np.abs(rows).max()))
        lost_chunks += int((~counted).sum())
        l1 += float(np.abs(np.where(counted[:, :, None], 0.0, rows.astype(np.float64))).sum())
        # a chunk counted at once carries nothing; a lost one carries exactly what was sent
        assert np.all(feedback.residual[counted] == 0.0)
        assert np.array_equal(feedback.residual[~counted], rows[~counted])
    error = np.abs(counted_sum + feedback.residual - total)
    assert error.max() <= steps * largest * 2**-23
    assert int(feedback.chunks_carried.sum()) == lost_chunks
    assert float(feedback.values_l1.sum()) == pytest.approx(l1, rel=1e-9)
    assert sum(feedback_stats(feedback, w)["feedback_chunks"] for w in range(n)) == lost_chunks


def _grad_stream(numel: int, steps: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(numel) * 0.1).astype(np.float32) for _ in range(steps)]


def _set_grads(model: torch.nn.Module, flat: np.ndarray) -> None:
    offset = 0
    for p in model.parameters():
        piece = flat[offset : offset + p.numel()]
        p.grad = torch.from_numpy(piece.copy()).reshape(p.shape)
        offset += p.numel()


def test_sharded_feedback_conserves_a_workers_contributions_through_the_switch(make_cluster):
    """Worker 0 loses 30% of its GRADs (seeded, on the switch); workers 1 and 2 send zeros, so what the
    switch summed for worker 0 in a chunk is its RESULT value × count. Over the run, Σ(what the
    switch counted for worker 0) + its residual left = Σ of its gradients, within the codec's bound
    (the RESULT's mean is within 2^-shift of the contributors' exact mean, so the sum within
    count·2^-shift) plus float32 rounding (of the additions g + r and of value × count)."""
    n, steps = 3, 15
    cluster = make_cluster(n, elems_per_packet=K, seed=3, sync_deadline_ms=300, min_deadline_ms=50)
    cluster.switch.set_drop_policy(cluster.job_id, "up", DropPolicy(p=0.3), worker=0)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    numel = sum(p.numel() for p in base.parameters())
    models = [copy.deepcopy(base) for _ in range(n)]
    grads0 = _grad_stream(numel, steps, seed=1)
    sent: list[np.ndarray] = []
    results = []
    original = cluster.workers[0].allreduce

    def spy(x, **kwargs):
        sent.append(np.array(x, dtype=np.float32, copy=True))
        result = original(x, **kwargs)
        results.append(result)
        return result

    cluster.workers[0].allreduce = spy
    residuals = []

    def train(worker, i):
        opt = ShardedOptimizer(torch.optim.SGD(models[i].parameters(), lr=1e-3), worker, feedback=True)
        for t in range(steps):
            _set_grads(models[i], grads0[t] if i == 0 else np.zeros(numel, np.float32))
            opt.step()
            opt.zero_grad()
            if i == 0:
                residuals.append(opt.feedback.residual[0].reshape(-1)[:numel].copy())
        return opt

    opts = run_workers(cluster.workers, train)
    chunks = -(-numel // K)
    counted_sum = np.zeros(numel)
    tolerance = np.zeros(numel)
    lost = 0
    for t, (x, r) in enumerate(zip(sent, results, strict=True)):
        mine = np.array([0 in r.contributors(c) and r.fallback[c] == Fallback.NONE for c in range(chunks)])
        per_value = np.repeat(mine, K)[:numel]
        bound = np.repeat(r.count * 2.0 ** -r.shift.astype(np.float64), K)[:numel]
        summed = r.values.astype(np.float64) * np.repeat(r.count, K)[:numel]
        counted_sum += np.where(per_value, summed, 0.0)
        tolerance += np.where(per_value, bound + np.abs(summed) * 2**-22, 0.0) + np.abs(x) * 2**-23
        # counted at once: no residual; not counted: exactly what was sent
        assert np.array_equal(residuals[t], np.where(per_value, 0.0, x).astype(np.float32)), t
        lost += int((~mine).sum())
    total = np.sum(grads0, axis=0, dtype=np.float64)
    assert np.all(np.abs(counted_sum + residuals[-1] - total) <= tolerance)
    assert lost > 0 and lost < steps * chunks, "the loss pattern did not exercise both cases"
    stats = opts[0].drift_stats()
    assert stats["feedback"] is True and stats["feedback_chunks"] == lost
    assert opts[1].drift_stats()["feedback_chunks"] == 0  # lossless links: nothing carried

    # The residual is part of the checkpoint: through torch.save/load into a fresh optimizer.
    buffer = io.BytesIO()
    torch.save(opts[0].state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh_cluster = make_cluster(n, elems_per_packet=K, job_id=2, shared_with=cluster)
    fresh = ShardedOptimizer(
        torch.optim.SGD(copy.deepcopy(base).parameters(), lr=1e-3), fresh_cluster.workers[0], feedback=True
    )
    assert not fresh.feedback.residual.any()
    fresh.load_state_dict(state)
    assert np.array_equal(fresh.feedback.residual, opts[0].feedback.residual)
    assert np.array_equal(fresh.feedback.carried, opts[0].feedback.carried)
    assert fresh.drift_stats()["feedback_chunks"] == lost
    assert fresh.drift_stats()["feedback_values_l1"] == stats["feedback_values_l1"]
    plain = ShardedOptimizer(
        torch.optim.SGD(copy.deepcopy(base).parameters(), lr=1e-3), fresh_cluster.workers[1]
    )
    with pytest.raises(CheckpointMismatch, match="feedback"):
        plain.load_state_dict(opts[1].state_dict())


@pytest.mark.parametrize(
    "mechanism,feedback,bound,retrieve",
    [
        ("none", False, 8, False),
        ("feedback", True, 8, False),
        ("stale1", False, 1, False),
        ("stale2", False, 2, False),
        ("retrieve", False, 8, True),
        ("retrieve+feedback", True, 8, True),
        ("feedback+stale1", True, 1, False),
    ],
)
def test_training_run_builds_the_mechanisms_optimizer(make_cluster, mechanism, feedback, bound, retrieve):
    from lta.train.experiment import RunSpec, TrainingRun, quick_config
    from lta.train.gpt import CharCorpus

    cfg = quick_config()
    assert cfg.stale_bound == 8
    cluster = make_cluster(2, elems_per_packet=cfg.elems_per_packet)
    run = TrainingRun(cluster.workers[0], CharCorpus(), cfg, RunSpec("m", "renorm", 0.1, 0, 1, mechanism))
    assert run.opt.exchange.tracker.bound == bound
    assert (run.opt.feedback is not None) == feedback
    assert run.opt.drift_stats()["feedback"] is feedback
    assert run.opt.exchange.retrieve is retrieve
    with pytest.raises(ValueError, match="none, feedback, stale1, stale2, retrieve"):
        TrainingRun(cluster.workers[1], CharCorpus(), cfg, RunSpec("m", "renorm", 0.1, 0, 1, "stale3"))


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_feedback_on_top_of_renormalization_scales_the_aggregate_by_one_over_one_minus_p(p):
    """The docstring's scale claim, against its formula: with i.i.d. loss p and constant gradients g,
    renormalized aggregates with feedback average g/(1−p); zero fill (sum / N) with feedback averages
    g (every contribution counted once, with weight 1/N)."""
    n, c, steps, burn_in = 16, 200, 300, 50
    rng = np.random.default_rng(1)
    means = {}
    for renormalize in (True, False):
        feedback = ResidualFeedback(c, 1, n)
        seen = []
        for t in range(steps):
            rows = np.ones((n, c, 1), np.float32)
            feedback.add_to(rows)
            counted = rng.random((n, c)) >= p
            total = (rows[:, :, 0] * counted).sum(axis=0)
            aggregate = total / np.maximum(counted.sum(axis=0), 1) if renormalize else total / n
            feedback.settle(rows, counted)
            if t >= burn_in:
                seen.append(aggregate.mean())
        means[renormalize] = float(np.mean(seen))
    assert means[True] == pytest.approx(1 / (1 - p), rel=0.01)
    assert means[False] == pytest.approx(1.0, rel=0.01)


def test_feedback_under_privacy_carries_the_clipped_contribution_without_its_noise(make_cluster):
    """With privacy=..., what worker 0 carries for a lost chunk is the clipped gradient it meant to
    send: within the clipping norm C, and short of what went on the wire by exactly its noise share
    (std σC/√N: hostlib/torch_ext/dp.py)."""
    from hostlib.torch_ext.dp import DpConfig, GaussianPrivacy

    n, steps, clip, sigma = 3, 6, 0.5, 1.0
    cluster = make_cluster(n, elems_per_packet=K, seed=4, sync_deadline_ms=300, min_deadline_ms=50)
    cluster.switch.set_drop_policy(cluster.job_id, "up", DropPolicy(p=0.5), worker=0)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(30, 60), torch.nn.Tanh(), torch.nn.Linear(60, 3))
    numel = sum(p.numel() for p in base.parameters())
    models = [copy.deepcopy(base) for _ in range(n)]
    grads0 = _grad_stream(numel, steps, seed=2)
    sent: list[np.ndarray] = []
    original = cluster.workers[0].allreduce

    def spy(x, **kwargs):
        sent.append(np.array(x, dtype=np.float32, copy=True))
        return original(x, **kwargs)

    cluster.workers[0].allreduce = spy
    gaps, norms = [], []

    def train(worker, i):
        privacy = GaussianPrivacy.for_worker(DpConfig(sigma=sigma, clip=clip), worker, shared_seed=9)
        opt = ShardedOptimizer(
            torch.optim.SGD(models[i].parameters(), lr=1e-3), worker, feedback=True, privacy=privacy
        )
        for t in range(steps):
            _set_grads(models[i], grads0[t] if i == 0 else np.zeros(numel, np.float32))
            opt.step()
            opt.zero_grad()
            if i == 0:
                carried = opt.feedback.carried[0]
                rows = opt.feedback.residual[0]
                wire = np.zeros(rows.size, np.float32)
                wire[:numel] = sent[-1]
                gaps.append((wire.reshape(rows.shape) - rows)[carried].reshape(-1))
                norms.append(float(np.linalg.norm(rows.astype(np.float64))))
        return opt

    run_workers(cluster.workers, train)
    gap = np.concatenate(gaps)
    assert gap.size > 10 * K, "too few lost chunks to measure the noise"
    assert max(norms) <= clip * (1 + 1e-6)
    assert np.std(gap) == pytest.approx(sigma * clip / np.sqrt(n), rel=0.1)
