"""The randomized Hadamard rotation (hostlib/emulation/rotation.py) against independent expectations: scipy's
dense Hadamard matrix, numpy's mean over all workers (unbiasedness over many seeded loss draws) and the
theory of how a fixed loss spreads over a rotated block."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.linalg import hadamard

from hostlib.emulation.dropmodels import NO_LOSS
from hostlib.emulation.rotation import Rotation, block_sizes, fwht
from hostlib.emulation.simulate import (
    FabricStreams,
    loss_policy,
    quantize_round,
    simulate_round,
    sum_contributions,
)
from hostlib.emulation.simulate import worker_values as view_of


def test_block_sizes_cover_the_length_with_powers_of_two():
    assert block_sizes(110592, 65536) == [65536, 32768, 8192, 4096]  # 108 chunks of 1024: no padding
    assert block_sizes(3 * 1024 + 5, 1024) == [1024] * 3 + [4, 1]
    assert block_sizes(0) == []
    with pytest.raises(ValueError, match="power of two"):
        block_sizes(10, 48)


def test_fwht_is_the_dense_hadamard_product():
    rng = np.random.default_rng(0)
    for b in (1, 2, 8, 256, 512):
        rows = rng.standard_normal((3, b))
        assert np.allclose(fwht(rows), rows @ hadamard(b), atol=1e-9)


def test_fwht_adds_as_the_plain_butterfly_to_the_bit():
    """fwht runs its small-span levels on a transposed copy (for speed); the additions and their order
    are those of the textbook butterfly (spans 1, 2, 4, ... in place, written out here), so float32
    results are equal bit for bit, and the input is left as it was."""

    def butterfly(rows: np.ndarray) -> np.ndarray:
        x = rows.copy()
        h = 1
        while h < x.shape[1]:
            for start in range(0, x.shape[1], 2 * h):
                a, b = x[:, start : start + h].copy(), x[:, start + h : start + 2 * h].copy()
                x[:, start : start + h], x[:, start + h : start + 2 * h] = a + b, a - b
            h *= 2
        return x

    rng = np.random.default_rng(5)
    for b in (1, 2, 4, 32, 128, 2048, 8192):
        rows = (rng.standard_normal((3, b)) * 10.0 ** rng.integers(-3, 4, (3, b))).astype(np.float32)
        before = rows.copy()
        got = fwht(rows)
        assert got.dtype == np.float32 and np.array_equal(got, butterfly(rows)), b
        assert np.array_equal(rows, before)


def test_forward_is_signs_then_hadamard_per_block_and_inverse_undoes_it():
    rng = np.random.default_rng(1)
    length = 1024 + 256 + 64  # blocks 1024, 256, 64 with max_block 1024
    x = rng.standard_normal((4, length)).astype(np.float32)
    rot = Rotation(length, seed=3, step=7, bucket=0, max_block=1024)
    assert rot.sizes == [1024, 256, 64]
    y = rot.forward(x)
    # independent: a dense block-diagonal H·D/√B built from scipy's Hadamard and the drawn signs
    start = 0
    for b in rot.sizes:
        dense = hadamard(b) / np.sqrt(b)
        part = x[:, start : start + b].astype(np.float64) * rot.signs[start : start + b]
        assert np.allclose(y[:, start : start + b], part @ dense.T, atol=1e-5)
        start += b
    back = rot.inverse(y)
    assert np.allclose(back, x, atol=1e-5, rtol=0)
    assert np.allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)


def test_the_rotation_depends_on_seed_step_and_bucket_only():
    a = Rotation(4096, seed=1, step=5, bucket=2)
    assert np.array_equal(a.signs, Rotation(4096, seed=1, step=5, bucket=2).signs)  # every worker alike
    for other in (Rotation(4096, seed=2, step=5, bucket=2), Rotation(4096, seed=1, step=6, bucket=2)):
        assert not np.array_equal(a.signs, other.signs)
    assert not np.array_equal(a.signs, Rotation(4096, seed=1, step=5, bucket=3).signs)
    assert abs(a.signs.mean()) < 0.05  # fair signs
    with pytest.raises(ValueError, match="is for 4096 values"):
        a.forward(np.zeros(100, np.float32))


def _rotated_estimate(inputs, rot, fabric, rng, *, method="renorm"):
    """One lossy reduce of ``inputs`` (N × C × K) in ``rot``'s basis, renormalized, rotated back."""
    n, c, k = inputs.shape
    rotated = rot.forward(inputs.reshape(n, -1)).reshape(n, c, k)
    summed, delivered = simulate_round(rotated, fabric, rng, exp_copies=2, exact=True)
    renormalize, fallback = ("count", "prev") if method == "renorm" else ("none", "zero")
    values, _ = view_of(summed, delivered[0], n, renormalize=renormalize, fallback=fallback)
    return rot.inverse(values.reshape(-1))


@pytest.mark.parametrize("method", ["renorm", "zero"])
def test_rotated_renormalized_mean_is_unbiased_over_seeded_loss_draws(method):
    """Over many seeded loss draws (30% of GRADs lost, a new rotation every draw) the mean of the
    rotated-back renormalized estimates equals numpy's mean over all workers within 3 standard errors
    (for the sum of all values, and for all but a chance share of single values). The same check
    rejects zero fill (sum / N), whose estimate is 0.7x the mean: the test can see a bias."""
    n, c, k, draws = 12, 16, 64, 1500
    rng = np.random.default_rng(7)
    inputs = (rng.standard_normal((n, c, k)) + rng.standard_normal((1, c, k))).astype(np.float32)
    truth = inputs.astype(np.float64).mean(axis=0).reshape(-1)
    estimates = np.empty((draws, c * k))
    policy = loss_policy("bernoulli", 0.3)
    for d in range(draws):
        fabric = FabricStreams(n, {"up": policy}, seed=d)
        rot = Rotation(c * k, seed=11, step=d)
        estimates[d] = _rotated_estimate(inputs, rot, fabric, np.random.default_rng([d, 1]), method=method)
    mean = estimates.mean(axis=0)
    se = estimates.std(axis=0, ddof=1) / np.sqrt(draws)
    z = (mean - truth) / se
    total = estimates.sum(axis=1)
    z_total = (total.mean() - truth.sum()) / (total.std(ddof=1) / np.sqrt(draws))
    if method == "renorm":
        assert abs(z_total) < 3, z_total
        assert np.mean(np.abs(z) > 3) < 0.01, np.mean(np.abs(z) > 3)  # 0.27% expected by chance
    else:
        assert abs(z_total) > 3 and np.mean(np.abs(z) > 3) > 0.2


def test_a_lost_packet_is_spread_over_the_block_as_theory_says():
    """One worker of 4 loses one GRAD (chunk 5 of a block of 64 chunks, K=64). Without rotation the
    error sits on that chunk's K values: d = (mean without the worker − mean) there. Rotated, the error is
    ``Rᵀ P_c R d`` for the block's difference vector d: each value's error has standard deviation
    ≈ √K·‖d‖/B (B values in the block), so the largest error falls by about √(B/K)·√(ln K / ln B) (5.7
    here) while the total squared error stays the same in expectation."""
    n, c, k = 4, 64, 64
    b = c * k
    rng = np.random.default_rng(3)
    inputs = rng.standard_normal((n, c, k)).astype(np.float32)
    contributed = np.ones((n, c), dtype=bool)
    contributed[1, 5] = False
    x = inputs.astype(np.float64)
    truth = x.mean(axis=0).reshape(-1)
    d = (np.delete(x, 1, axis=0).mean(axis=0) - x.mean(axis=0)).reshape(-1)  # over the whole block
    sigma_theory = np.sqrt(k) * np.linalg.norm(d) / b

    def reduce_with(rot: Rotation | None, seed: int) -> np.ndarray:
        sent = inputs if rot is None else rot.forward(inputs.reshape(n, -1)).reshape(n, c, k)
        from hostlib import codec

        agreed = codec.exponent_proposals(sent.reshape(-1, k)).reshape(n, c).max(axis=0)
        ints, shifts, _ = quantize_round(sent, agreed, np.random.default_rng(seed))
        summed = sum_contributions(ints, shifts, contributed)
        values, _ = view_of(summed, np.ones(c, dtype=bool), n)
        values = values.reshape(-1)
        return values if rot is None else rot.inverse(values)

    plain = reduce_with(None, 0) - truth
    assert np.count_nonzero(np.abs(plain) > 1e-4) <= k  # the error sits on one chunk
    ratios, rms, sq = [], [], []
    for step in range(8):
        err = reduce_with(Rotation(b, seed=0, step=step), step) - truth
        assert np.abs(err).max() < 6 * sigma_theory  # a Gaussian tail over 4096 values: ~4σ expected
        ratios.append(np.abs(plain).max() / np.abs(err).max())
        rms.append(np.sqrt(np.mean(err**2)))
        sq.append(np.sum(err**2))
    theory_ratio = np.sqrt(b / k) * np.sqrt(np.log(k) / np.log(b))
    assert np.mean(ratios) > 0.6 * theory_ratio and np.mean(ratios) > 3, (ratios, theory_ratio)
    assert np.mean(rms) == pytest.approx(sigma_theory, rel=0.25)
    assert np.mean(sq) == pytest.approx(np.sum(plain**2), rel=0.5)  # same total error, spread


def test_no_loss_rotation_changes_only_rounding():
    """At 0% loss a rotated reduce returns numpy's mean within the codec's rounding."""
    n, c, k = 4, 32, 64
    rng = np.random.default_rng(5)
    inputs = rng.standard_normal((n, c, k)).astype(np.float32)
    fabric = FabricStreams(n, {"up": NO_LOSS}, seed=0)
    out = _rotated_estimate(inputs, Rotation(c * k, seed=0, step=0), fabric, rng)
    assert np.allclose(out, inputs.astype(np.float64).mean(axis=0).reshape(-1), atol=1e-5)
