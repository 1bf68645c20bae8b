"""Fixed-point codec: unbiased rounding, the documented error bound, no wrap, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from hostlib import codec


def test_stochastic_rounding_is_unbiased():
    rng = np.random.default_rng(0)
    x = np.full((1, 64), 0.3, dtype=np.float32)  # 0.3·2^s is not an integer: plain rounding would be biased
    shifts = np.array([3], dtype=np.int32)
    draws = np.stack([codec.quantize(x, shifts, 2, rng)[0] for _ in range(4000)]).astype(np.float64)
    mean = draws.mean() / 2**3
    # One draw is 2 or 3 (x·8 = 2.4): sd 0.49 per value, 256000 values -> sd of the mean ~ 0.001/8.
    assert abs(mean - 0.3) < 5 * 0.49 / np.sqrt(draws.size) / 8
    assert set(np.unique(draws)) == {2.0, 3.0}


@pytest.mark.parametrize("n_workers", [1, 2, 3, 8, 64])
def test_mean_error_within_documented_bound(n_workers):
    rng = np.random.default_rng(n_workers)
    x = (rng.standard_normal((n_workers, 20, 64)) * rng.uniform(1e-6, 1e3, (1, 20, 1))).astype(np.float32)
    proposals = np.stack([codec.exponent_proposals(xi) for xi in x])
    shifts = codec.data_shifts(proposals.max(axis=0), n_workers)
    ints = np.stack([codec.quantize(xi, shifts, n_workers, rng)[0] for xi in x])
    total = ints.astype(np.int64).sum(axis=0)
    assert np.abs(total).max() < 2**31  # no wrap
    mean = codec.dequantize(total, shifts, np.full(len(shifts), n_workers))
    exact = x.astype(np.float64).mean(axis=0)
    bound = codec.error_bound(shifts)[:, None]
    # the codec's bound, plus half an ulp for the float32 output
    assert np.all(np.abs(mean - exact) < bound + np.abs(exact) * 2**-24)
    # The bound is relative to the chunk's max: 2^-s <= 2·max|x|·2^(L-30).
    L = codec.headroom_bits(n_workers)
    assert np.all(bound[:, 0] <= 2 * np.abs(x).max(axis=(0, 2)) * 2.0 ** (L - 30))


def test_worst_case_sum_of_64_cannot_wrap():
    x = np.full((1, 64), np.float32(np.nextafter(np.float32(1.0), np.float32(0))), dtype=np.float32)
    shifts = codec.data_shifts(codec.exponent_proposals(x), 64)
    rng = np.random.default_rng(1)
    ints, saturated = codec.quantize(x, shifts, 64, rng)
    assert not saturated.any()
    assert int(ints.astype(np.int64).max()) * 64 < 2**31
    # A value above the agreed bound (its proposal was lost) is caught and reported, never wrapped.
    big = x * 4
    ints, saturated = codec.quantize(big, shifts, 64, rng)
    assert saturated.all() and int(np.abs(ints).max()) == codec.contribution_limit(64)


def test_zero_chunk_and_extreme_exponents_fit_the_header_byte():
    x = np.zeros((2, 4), dtype=np.float32)
    x[1] = 3e38
    proposals = codec.exponent_proposals(x)
    assert proposals[0] == codec.EMPTY_EXPONENT
    shifts = codec.data_shifts(proposals, 4)
    assert np.all(np.abs(shifts) <= 127)
    ints, _ = codec.quantize(x, shifts, 4, np.random.default_rng(0))
    assert np.all(ints[0] == 0)
    assert np.allclose(codec.dequantize(ints, shifts)[1], 3e38, rtol=1e-6)


def test_nan_is_refused_with_the_chunk_named():
    x = np.zeros((3, 4), dtype=np.float32)
    x[2, 1] = np.nan
    with pytest.raises(ValueError, match="chunk 2"):
        codec.exponent_proposals(x)
