"""Drop models against their closed-form laws."""

from __future__ import annotations

import numpy as np
import pytest

from hostlib.emulation.dropmodels import DropPolicy, DropStream


def burst_lengths(lost: np.ndarray) -> np.ndarray:
    edges = np.diff(np.concatenate([[0], lost.astype(np.int8), [0]]))
    return np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)


@pytest.mark.parametrize("vectorized", [False, True])
def test_gilbert_elliott_matches_its_stationary_loss_and_burst_length(vectorized):
    p, r = 0.05, 0.25
    pol = DropPolicy("gilbert_elliott", p=p, r=r, loss_good=0.0, loss_bad=1.0)
    stream = DropStream(pol, seed=1)
    n = 200_000
    lost = stream.drop_many(n) if vectorized else np.array([stream.drop() for _ in range(n)])
    # Stationary bad fraction pi = p/(p+r) = 1/6 (p/r would be 0.2); bursts in the bad state are
    # geometric with mean 1/r = 4. Losing exactly in the bad state, the loss sequence is the two-state
    # chain itself: its lag-k correlation is rho^k with rho = 1 - p - r, so the mean of n has variance
    # pi(1 - pi)/n x (1 + rho)/(1 - rho); about n·pi·r bursts, each of variance (1 - r)/r^2.
    pi, rho = p / (p + r), 1 - p - r
    assert pol.mean_loss == pytest.approx(pi)
    sigma = np.sqrt(pi * (1 - pi) / n * (1 + rho) / (1 - rho))
    assert abs(lost.mean() - pi) < 5 * sigma, (lost.mean(), pi, sigma)  # 5 sigma = 0.010, p/r is 16 away
    bursts = burst_lengths(lost)
    sigma_burst = np.sqrt((1 - r) / r**2 / (n * pi * r))
    assert abs(bursts.mean() - 1 / r) < 5 * sigma_burst, (bursts.mean(), sigma_burst)


def test_bernoulli_is_memoryless_and_seeded():
    a = DropStream(DropPolicy(p=0.3), seed=5).drop_many(100_000)
    assert abs(a.mean() - 0.3) < 0.01
    # Memoryless: a loss is no likelier right after a loss.
    assert abs(a[1:][a[:-1]].mean() - 0.3) < 0.015
    assert np.array_equal(a, DropStream(DropPolicy(p=0.3), seed=5).drop_many(100_000))


def test_policy_validation_names_the_problem():
    with pytest.raises(ValueError, match="unknown drop model"):
        DropPolicy("netem", p=0.1)
    with pytest.raises(ValueError, match="p=1.5"):
        DropPolicy(p=1.5)
    with pytest.raises(ValueError, match="unknown drop policy keys"):
        DropPolicy.from_dict({"model": "bernoulli", "prob": 0.1})


@pytest.mark.parametrize(
    "policy",
    [DropPolicy(p=0.3), DropPolicy("gilbert_elliott", p=0.05, r=0.3, loss_good=0.02, loss_bad=0.8)],
    ids=["bernoulli", "gilbert_elliott"],
)
def test_peek_then_advance_gives_the_sequential_decisions(policy):
    """The batched switch peeks at a batch's worth of decisions and consumes what its packets used: that
    must be exactly the sequence of one drop() per packet, across block boundaries (4096 uniforms)."""
    sequential = DropStream(policy, seed=11)
    expected = [sequential.drop() for _ in range(20000)]
    stream = DropStream(policy, seed=11)
    rng = np.random.default_rng(3)
    got: list[bool] = []
    while len(got) < len(expected):
        want = int(rng.integers(1, 3000))
        peeked = stream.peek(want)
        assert peeked.dtype == np.uint8 and len(peeked) == want
        again = stream.peek(want)  # peeking consumes nothing
        assert np.array_equal(peeked, again)
        used = int(rng.integers(0, want + 1))
        got += [bool(d) for d in peeked[:used]]
        stream.advance(used)
        if rng.random() < 0.2:  # interleaved with the per-packet path
            got.append(stream.drop())
    n = len(expected)
    assert got[:n] == expected
    assert sum(got[:n]) > 0.01 * n  # the streams do drop
