"""The drop simulator against independent expectations: exact at p=0, counts follow the loss, unbiased."""

from __future__ import annotations

import numpy as np

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.emulation.simulate import simulate_reduce


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


def test_tree_counts_compose_the_two_levels_and_stay_exact():
    """1024 workers behind 32 leaves. Up: a contribution needs its GRAD to reach the leaf (1 - p) and the
    leaf's partial to reach the spine in one of two tries (1 - ps^2), so a leaf drops out of a chunk whole
    with probability ps^2. Down: a worker gets a RESULT when the spine's reaches its leaf in one of two
    tries. Each delivered chunk is the mean over exactly the contributions counted."""
    n, leaves, p, ps = 1024, 32, 0.1, 0.2
    rng = np.random.default_rng(5)
    x = rng.integers(-8, 9, size=(n, 64 * 32)).astype(np.float32)  # small integers: sums are exact
    leaf_of = np.repeat(np.arange(leaves), n // leaves)
    r = simulate_reduce(x, up=DropPolicy(p=p), leaf_of=leaf_of, spine_up=DropPolicy(p=ps), seed=2)
    chunks = len(r.count)
    expected = (1 - p) * (1 - ps**2)
    # A leaf's workers share its partial's fate: the bound counts (leaf, chunk) pairs, not workers.
    assert abs(r.count.mean() / n - expected) < 5 * np.sqrt(expected * (1 - expected) / (leaves * chunks))
    empty = ~r.contributed.reshape(leaves, n // leaves, chunks).any(axis=1)  # 32 worker losses: negligible
    assert abs(empty.mean() - ps**2) < 5 * np.sqrt(ps**2 * (1 - ps**2) / empty.size), empty.mean()
    c = int(np.flatnonzero(r.delivered[0])[0])
    chunk = slice(c * 64, (c + 1) * 64)
    assert np.allclose(r.values[0, chunk], x[r.contributed[:, c], chunk].mean(axis=0), atol=1e-6)
    down = simulate_reduce(x, leaf_of=leaf_of, spine_down=DropPolicy(p=ps), seed=3)
    # The exponent RESULT too must reach a leaf for its workers to send data: count only where it did.
    got = down.delivered.reshape(leaves, n // leaves, chunks)[:, 0, down.count > 0]
    assert abs(got.mean() - (1 - ps**2)) < 5 * np.sqrt(ps**2 * (1 - ps**2) / got.size), got.mean()


def test_a_tree_of_one_leaf_without_spine_loss_is_one_switch():
    x = np.random.default_rng(6).standard_normal((16, 4096)).astype(np.float32)
    flat = simulate_reduce(x, up=DropPolicy(p=0.1), seed=4)
    tree = simulate_reduce(x, up=DropPolicy(p=0.1), seed=4, leaf_of=np.zeros(16, int))
    assert np.array_equal(flat.count, tree.count) and np.array_equal(flat.values, tree.values)
