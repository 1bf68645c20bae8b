"""The drop simulator against independent expectations: exact at p=0, counts follow the loss, unbiased."""

from __future__ import annotations

import numpy as np

from hostlib.dropmodels import DropPolicy
from hostlib.simulate import simulate_reduce


def test_lossless_reduce_is_the_mean_for_every_worker():
    x = np.random.default_rng(0).standard_normal((100, 1000)).astype(np.float32)
    r = simulate_reduce(x)
    assert np.all(r.count == 100)
    assert np.allclose(r.values, x.mean(axis=0, dtype=np.float64), atol=1e-6)


def test_counts_follow_the_loss_and_renormalization_is_unbiased():
    n, p_up, p_down = 256, 0.2, 0.1
    rng = np.random.default_rng(1)
    x = (2.0 + rng.standard_normal((n, 64 * 64))).astype(np.float32)
    r = simulate_reduce(x, up=DropPolicy(p=p_up), down=DropPolicy(p=p_down), seed=3)
    frac = r.count.mean() / n
    # A contribution needs its data packet to survive the up link and its worker to have received the
    # exponent RESULT (down link). A lost exponent proposal rarely matters (only for the chunk's max).
    expected = (1 - p_up) * (1 - p_down)
    assert abs(frac - expected) < 5 * np.sqrt(expected * (1 - expected) / (n * len(r.count)))
    err = r.values[0][np.repeat(r.delivered[0], 64)] - x.mean(axis=0)[np.repeat(r.delivered[0], 64)]
    assert abs(err.mean()) < 5 * err.std() / np.sqrt(err.size)


def test_lost_results_keep_the_fallback():
    x = np.ones((4, 128), np.float32)
    r = simulate_reduce(x, down=DropPolicy(p=1.0), fallback=np.full((4, 128), 7.0, np.float32))
    assert not r.delivered.any() and np.all(r.values == 7.0)
