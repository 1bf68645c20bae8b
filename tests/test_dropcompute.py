"""DropCompute: the weight-renormalized reduce is numpy's per-sample mean over the contributors; Algorithm 2's
tau* is a brute-force grid's; the accumulator stops at tau and plumbs the exchange; the straggler emulator
replays with its seed; Theorem 4.1's iterate draw is proportional to the batch sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hostlib import codec
from hostlib.emulation.stragglers import LOGNORMAL_ALPHA, LOGNORMAL_BETA, StragglerEmulator, StragglerModel
from hostlib.torch_ext.dropcompute import (
    DropComputeAccumulator,
    WeightedIterate,
    choose_threshold,
    threshold_curves,
)
from hostlib.transport import Fallback
from tests.conftest import run_workers

K = 64


# ---- the weighted reduce ---------------------------------------------------------------------------
def _micro_batches(rng: np.random.Generator, count: int, length: int) -> list[tuple[int, np.ndarray]]:
    """``count`` micro-batches: (samples, the micro-batch's mean gradient)."""
    return [
        (
            int(rng.integers(1, 9)),
            (rng.standard_normal(length) * 10.0 ** rng.integers(-2, 2)).astype(np.float32),
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("up", [0.0, 0.2])
def test_weighted_reduce_is_the_per_sample_mean_over_the_contributors(make_cluster, up):
    n, length = 4, 7 * K + 5
    cluster = make_cluster(
        n, up=up, seed=3, renormalize="weight", fallback="zero", sync_deadline_ms=300, min_deadline_ms=50
    )
    rng = np.random.default_rng(11)
    checked = 0
    for step, counts in enumerate([(8, 3, 0, 5), (1, 8, 8, 2), (0, 0, 4, 0), (0, 0, 0, 0)]):
        work = [_micro_batches(rng, c, length) for c in counts]

        def body(worker, w, work=work, step=step):
            acc = DropComputeAccumulator(8, numel=length)
            acc.start_step()
            for samples, grad in work[w]:
                assert acc.should_continue()
                acc.mark_done(samples=samples, grad=torch.from_numpy(grad))
            return acc.samples, acc.reduce(worker, step=step)

        out = run_workers(cluster.workers, body)
        # Expectation, in float64 from the micro-batches themselves: every contributing worker's samples.
        sums = np.stack([sum((s * g.astype(np.float64) for s, g in wk), np.zeros(length)) for wk in work])
        weights = np.array([sum(s for s, _ in wk) for wk in work], dtype=np.float64)
        magnitude = np.stack(
            [sum((s * np.abs(g.astype(np.float64)) for s, g in wk), np.zeros(length)) for wk in work]
        )
        for w, (samples, result) in enumerate(out):
            assert samples == weights[w]
            bound = codec.error_bound(result.shift)
            for c in np.flatnonzero(result.fallback == Fallback.NONE):
                who = result.contributors(c)
                assert len(who) == result.count[c] > 0 and max(who) < n
                lo, hi = c * K, min((c + 1) * K, length)
                total = weights[who].sum()
                got = result.values[lo:hi]
                if total == 0:  # every contributor computed nothing: a zero gradient, not a division by 0
                    assert np.all(got == 0.0)
                    continue
                expected = sums[who, lo:hi].sum(axis=0) / total
                # Quantization (one unit per nonzero contribution), float32 rounding of the weighted inputs
                # and of the output. Dividing by the count instead would miss by O(|expected|).
                tol = (len(who) * bound[c] + magnitude[who, lo:hi].sum(axis=0) * 2**-20) / total
                tol = tol + np.abs(expected) * 2**-22
                assert np.all(np.abs(got - expected) <= tol), (step, w, c, who)
                checked += 1
    assert checked > 0
    if up == 0.0:
        assert all(r.count.min() == n for _, r in out)


def test_reduce_refuses_a_transport_that_divides_by_the_count(make_cluster):
    cluster = make_cluster(1, renormalize="count")
    acc = DropComputeAccumulator(2)
    acc.start_step()
    acc.mark_done(3, grad=np.ones(10, dtype=np.float32))
    with pytest.raises(ValueError, match="renormalize='weight'"):
        acc.reduce(cluster.workers[0], step=0)


def test_params_gradients_are_accumulated_per_sample_and_written_back(make_cluster):
    cluster = make_cluster(1, renormalize="weight")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    acc = DropComputeAccumulator(4, params=model.parameters())
    xs = [torch.randn(5, 3), torch.randn(2, 3)]
    acc.start_step()
    for x in xs:
        model(x).pow(2).mean().backward()
        acc.mark_done(samples=len(x))
        assert all(p.grad is None for p in model.parameters())  # folded into the sum, cleared
    acc.reduce(cluster.workers[0], step=0)
    reference = torch.nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    reference(torch.cat(xs)).pow(2).mean().backward()  # the mean over all 7 samples
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4)


# ---- Algorithm 2 -----------------------------------------------------------------------------------
def _brute_force(lat: np.ndarray, comm: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """Algorithm 2 as the paper writes it (strict T < tau), loop by loop, vectorized over the grid only."""
    iters, workers, m = lat.shape
    s_eff = np.zeros(len(taus))
    for i in range(iters):
        completed = np.zeros(len(taus))
        slowest = 0.0
        for n in range(workers):
            t = 0.0
            for j in range(m):
                t += lat[i, n, j]
                completed += (t < taus) / workers
            slowest = max(slowest, t)
        s_eff += (slowest + comm[i]) / (np.minimum(taus, slowest) + comm[i]) * completed / m
    return s_eff / iters


def _synthetic(seed: int, iters: int = 6, workers: int = 4, m: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lat = 0.02 * (1 + 0.05 * rng.random((iters, workers, m)))
    lat *= np.where(rng.random(lat.shape) < 0.06, 3.0, 1.0)
    return lat, 0.01 + 0.002 * rng.random(iters)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tau_star_matches_a_brute_force_grid(seed):
    lat, comm = _synthetic(seed)
    choice = choose_threshold(lat, comm)
    floor = lat.shape[2] * lat.mean() / 2  # Assumption C.3, applied to the grid too
    assert choice.min_tau_s == pytest.approx(floor)
    top = np.cumsum(lat, axis=2).max()
    h = 1e-6
    grid = np.arange(floor, top + 2 * h, h)
    brute = _brute_force(lat, comm, grid)
    g = int(np.argmax(brute))
    assert math.isfinite(choice.tau_s) and choice.s_eff > 1.0
    # The exact maximum is at a finish time; the grid's best point is just above it (strict <).
    assert brute.max() <= choice.s_eff + 1e-12
    assert brute.max() >= choice.s_eff - 1e-3
    assert choice.tau_s <= grid[g] <= choice.tau_s + h
    # And the value at tau*: the paper's strict comparison an epsilon above it.
    assert _brute_force(lat, comm, np.array([choice.tau_s + 1e-12]))[0] == pytest.approx(
        choice.s_eff, abs=1e-9
    )


def test_s_eff_by_hand():
    # One iteration, two workers, two micro-batches: worker 1's second one straggles (3 s).
    lat = np.array([[[1.0, 1.0], [1.0, 3.0]]])
    s_eff, step, completed = threshold_curves(lat, np.array([0.0]), np.array([2.0, 4.0]))
    # tau = 2: 3 of 4 micro-batches finish by 2 s; the step takes 2 s instead of 4.
    assert s_eff.tolist() == [4 / 2 * 3 / 4, 1.0]
    assert step.tolist() == [2.0, 1.0] and completed.tolist() == [0.75, 1.0]
    choice = choose_threshold(lat, np.array([0.0]))
    assert (choice.tau_s, choice.s_eff, choice.dropped_fraction) == (2.0, 1.5, 0.25)
    # Communication time dilutes the gain: with 2 s of it, tau = 2 gives 6/4 * 3/4 = 1.125.
    assert choose_threshold(lat, np.array([2.0])).s_eff == pytest.approx(1.125)
    # A cap on drops below 25 % leaves only waiting for all.
    assert math.isinf(choose_threshold(lat, np.array([0.0]), max_drop=0.2).tau_s)


def test_no_threshold_when_nothing_straggles():
    lat = np.full((3, 4, 8), 0.01)
    choice = choose_threshold(lat, np.full(3, 0.005))
    assert math.isinf(choice.tau_s) and choice.s_eff == 1.0 and choice.dropped_fraction == 0.0


# ---- Algorithm 1 and the accumulator -------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_accumulator_stops_at_tau_and_records_the_step():
    clock = FakeClock()
    acc = DropComputeAccumulator(8, tau_s=0.1, clock=clock)
    acc.start_step()
    done = 0
    while acc.should_continue():
        clock.now += 0.03
        acc.mark_done(samples=4)
        done += 1
    assert done == 4  # started at 0, .03, .06, .09 (all before 0.1); the fourth ends after tau
    assert acc.samples == 16 and acc.deadline == pytest.approx(100.1)
    clock.now += 0.01
    acc.end_step()
    rec = acc.records[-1]
    assert (rec.micro_batches, rec.samples, rec.tau_s) == (4, 16, 0.1)
    assert rec.compute_s == pytest.approx(0.12) and rec.iteration_s == pytest.approx(0.13)


def test_warmup_exchanges_latencies_and_every_worker_gets_the_same_tau():
    m, warmup = 4, 3
    clock = FakeClock()
    seen = []
    other_lat = np.array([[0.01, 0.01, 0.03, 0.01], [0.01, 0.01, 0.01, 0.01], [0.03, 0.01, 0.01, 0.01]])
    other_comm = np.array([0.002, 0.004, 0.001])

    def exchange(local):
        seen.append(local.copy())
        return np.stack([local, np.column_stack([other_lat, other_comm])])

    acc = DropComputeAccumulator(m, warmup_steps=warmup, exchange=exchange, clock=clock)
    mine = np.full((warmup, m), 0.01)
    mine_comm = np.array([0.003, 0.003, 0.003])
    for i in range(warmup):
        assert acc.warming_up and acc.tau_s is None
        acc.start_step()
        for j in range(m):
            assert acc.should_continue()
            clock.now += mine[i, j]
            acc.mark_done(1)
        assert not acc.should_continue()  # all M done
        clock.now += mine_comm[i]
        choice = acc.end_step()
        assert (choice is None) == (i < warmup - 1)
    assert len(seen) == 1 and seen[0].shape == (warmup, m + 1)
    assert np.allclose(seen[0][:, :m], mine) and np.allclose(seen[0][:, m], mine_comm)
    # What each worker computes from the same exchanged record: T^c_i is the smaller of the two.
    lat = np.stack([seen[0][:, :m], other_lat], axis=1)
    expected = choose_threshold(lat, np.minimum(seen[0][:, m], other_comm))
    # By hand: at tau = 40 ms the two straggling iterations keep 6 of 8 micro-batches in 2/3 of the time.
    assert expected.tau_s == pytest.approx(0.04)
    assert expected.s_eff == pytest.approx((0.062 / 0.042 * 0.75 + 1.0 + 0.061 / 0.041 * 0.75) / 3)
    assert acc.choice == expected and acc.tau_s == expected.tau_s and not acc.warming_up


def test_a_warmup_step_must_compute_everything():
    acc = DropComputeAccumulator(2, warmup_steps=1, exchange=lambda x: x[None])
    acc.start_step()
    acc.mark_done(1)
    with pytest.raises(RuntimeError, match="all 2 micro-batches"):
        acc.end_step()


def test_constructor_errors_say_what_to_do():
    with pytest.raises(ValueError, match="exchange="):
        DropComputeAccumulator(4, warmup_steps=3)
    with pytest.raises(ValueError, match="not both"):
        DropComputeAccumulator(4, tau_s=0.1, warmup_steps=3, exchange=lambda x: x[None])
    with pytest.raises(RuntimeError, match="start_step"):
        DropComputeAccumulator(4).should_continue()


# ---- the straggler emulator ------------------------------------------------------------------------
def test_emulator_replays_with_its_seed_in_any_order():
    model = StragglerModel(base_s=0.02, prob=0.1, factor=3.0, seed=7)
    keys = [(w, i, m) for w in range(4) for i in range(30) for m in range(8)]
    first = {k: StragglerEmulator(model).multiplier(*k) for k in keys}
    shuffled = list(keys)
    np.random.default_rng(0).shuffle(shuffled)
    again = StragglerEmulator(model)
    assert {k: again.multiplier(*k) for k in shuffled} == first
    assert set(first.values()) == {1.0, 3.0}
    other = StragglerEmulator(StragglerModel(base_s=0.02, prob=0.1, factor=3.0, seed=8))
    assert [other.multiplier(*k) for k in keys] != [first[k] for k in keys]
    # The share of stragglers is q, within 4 binomial standard deviations.
    share = np.mean([v == 3.0 for v in first.values()])
    assert abs(share - 0.1) <= 4 * math.sqrt(0.1 * 0.9 / len(keys))
    assert again.latency_s(*keys[0]) == pytest.approx(0.02 * first[keys[0]])


def test_slow_host_is_always_slow_and_stragglers_compose():
    emu = StragglerEmulator(StragglerModel(base_s=0.01, prob=0.5, factor=2.0, slow_host=1, seed=1))
    for i in range(20):
        for m in range(4):
            coin = emu.straggles(1, i, m)
            assert emu.multiplier(1, i, m) == (4.0 if coin else 2.0)
            assert emu.multiplier(0, i, m) == (2.0 if emu.straggles(0, i, m) else 1.0)


def test_lognormal_noise_follows_the_papers_distribution():
    emu = StragglerEmulator(StragglerModel(base_s=1.0, lognormal=True, seed=3))
    ours = np.array([emu.multiplier(0, i, 0) - 1.0 for i in range(20000)])
    ref = np.minimum(np.random.default_rng(0).lognormal(4.0, 1.0, 400000) / LOGNORMAL_ALPHA, LOGNORMAL_BETA)
    assert ours.min() >= 0 and ours.max() <= LOGNORMAL_BETA
    assert ours.mean() == pytest.approx(ref.mean(), rel=0.03)
    assert np.quantile(ours, 0.9) == pytest.approx(np.quantile(ref, 0.9), rel=0.05)


def test_emulator_sleep_stops_at_the_deadline():
    clock = FakeClock()
    slept: list[float] = []

    def sleeper(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    emu = StragglerEmulator(StragglerModel(base_s=0.05, seed=0), clock=clock, sleeper=sleeper)
    assert emu.sleep(0, 0, 0) and slept == [pytest.approx(0.05)]
    assert not emu.sleep(0, 0, 1, until=clock.now + 0.02) and slept[-1] == pytest.approx(0.02)
    assert not emu.sleep(0, 0, 2, until=clock.now - 1.0) and len(slept) == 2  # past already: no sleep


# ---- Theorem 4.1 -----------------------------------------------------------------------------------
def test_weighted_iterate_is_drawn_in_proportion_to_the_batch_sizes():
    weights = [3, 0, 1, 4, 2]
    trials = 20000
    picks = np.zeros(len(weights))
    for seed in range(trials):
        it = WeightedIterate(seed)
        for i, w in enumerate(weights):
            it.offer(w, lambda i=i: i)
        assert it.value == it.index
        picks[it.index] += 1
    p = np.array(weights) / sum(weights)
    assert picks[1] == 0
    assert np.all(np.abs(picks / trials - p) <= 4 * np.sqrt(p * (1 - p) / trials))
