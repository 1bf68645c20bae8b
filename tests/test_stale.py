"""Stale-shard tracker: ages, bound, histogram."""

from __future__ import annotations

import numpy as np
import pytest

from hostlib.stale import StaleTracker


def test_ages_grow_on_loss_and_reset_on_arrival():
    t = StaleTracker(3, bound=2)
    assert list(t.update(np.array([True, False, False]))) == []
    assert list(t.age) == [0, 1, 1]
    t.update(np.array([False, True, False]))
    over = t.update(np.array([False, False, False]))
    assert list(t.age) == [2, 1, 3] and list(over) == [2]
    t.refreshed(over)
    assert t.within_bound() and t.summary()["max_age_seen"] == 3


def test_histogram_matches_geometric_ages_under_bernoulli_loss():
    p, steps = 0.3, 4000
    rng = np.random.default_rng(0)
    t = StaleTracker(50, bound=20)
    for _ in range(steps):
        t.update(rng.random(50) >= p)
    hist = t.summary()["histogram"]
    total = sum(hist.values())
    # The age after a step is geometric: P(age = a) = (1 - p) p^a.
    for a in range(4):
        assert abs(hist[str(a)] / total - (1 - p) * p**a) < 0.01


def test_mask_shape_is_checked():
    with pytest.raises(ValueError, match="shape"):
        StaleTracker(4).update(np.ones(3, bool))
