"""Drop models against their closed-form laws."""

from __future__ import annotations

import numpy as np
import pytest

from hostlib.dropmodels import DropPolicy, DropStream


def burst_lengths(lost: np.ndarray) -> np.ndarray:
    edges = np.diff(np.concatenate([[0], lost.astype(np.int8), [0]]))
    return np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)


@pytest.mark.parametrize("vectorized", [False, True])
def test_gilbert_elliott_matches_its_stationary_loss_and_burst_length(vectorized):
    pol = DropPolicy("gilbert_elliott", p=0.02, r=0.25, loss_good=0.0, loss_bad=1.0)
    stream = DropStream(pol, seed=1)
    n = 200_000
    lost = stream.drop_many(n) if vectorized else np.array([stream.drop() for _ in range(n)])
    # Stationary bad fraction p/(p+r) = 0.0741; bursts in the bad state are geometric with mean 1/r = 4.
    assert pol.mean_loss == pytest.approx(0.02 / 0.27)
    assert abs(lost.mean() - pol.mean_loss) < 0.01
    assert abs(burst_lengths(lost).mean() - 4.0) < 0.3


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
