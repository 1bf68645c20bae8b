"""Gradient compression: fp16 error bound, int8 unbiasedness, top-k conservation, wire bytes, packed pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hostlib.ps import compress
from hostlib.ps.compress import TopK, make_compressor

# --- none and fp16 -----------------------------------------------------------------------------------


def test_none_is_exact_and_four_bytes_a_value():
    x = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)
    c = make_compressor("none")
    enc = c.encode(x)
    np.testing.assert_array_equal(c.decode(enc), x)
    assert c.decode(enc).shape == (3, 7)
    assert c.nbytes(enc) == 4 * 21


def test_fp16_relative_error_at_most_2_pow_minus_11():
    rng = np.random.default_rng(1)
    # Magnitudes across the whole normal fp16 range, both signs.
    x = (np.exp2(rng.uniform(-14, 15.99, 20000)) * rng.choice([-1.0, 1.0], 20000)).astype(np.float32)
    c = make_compressor("fp16")
    enc = c.encode(x)
    out = c.decode(enc)
    assert out.dtype == np.float32 and enc.saturated == 0
    err = np.abs(out.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= 2.0**-11 * np.abs(x.astype(np.float64)))
    assert err.max() > 0  # fp16 does round: the bound is not vacuous
    # Subnormal fp16 range: absolute error at most half the spacing 2^-24.
    tiny = (rng.uniform(-1, 1, 1000) * 2.0**-14).astype(np.float32)
    small_err = np.abs(c.decode(c.encode(tiny)).astype(np.float64) - tiny)
    assert np.all(small_err <= 2.0**-25)
    assert c.max_abs_error(x, enc) == pytest.approx(err.max(), rel=0, abs=0)
    assert c.nbytes(enc) == 2 * x.size


def test_fp16_clamps_and_counts_out_of_range():
    x = np.array([1.0, 1e5, -7e4, 65504.0], dtype=np.float32)
    c = make_compressor("fp16")
    enc = c.encode(x)
    assert enc.saturated == 2
    np.testing.assert_array_equal(c.decode(enc), [1.0, 65504.0, -65504.0, 65504.0])
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.encode(np.array([1.0, np.inf], dtype=np.float32))


# --- int8 ----------------------------------------------------------------------------------------------


def make_int8_input() -> np.ndarray:
    rng = np.random.default_rng(2)
    chunk = 64
    x = rng.standard_normal(200)  # chunks of 64, 64, 64 and a partial 8
    x[:chunk] *= 1e-3
    x[2 * chunk : 3 * chunk] = 0.0  # an all-zero chunk
    x[3 * chunk :] *= 50.0
    return x.astype(np.float32)


def test_int8_is_unbiased_over_seeded_trials():
    x = make_int8_input()
    chunk, trials = 64, 2000
    c = make_compressor("int8", chunk=chunk, rng=np.random.default_rng(3))
    decodes = np.empty((trials, x.size))
    for t in range(trials):
        decodes[t] = c.decode(c.encode(x))
    # Independent expectation: scale max|x|/127 per chunk; a value is floor(x/s) or floor(x/s)+1 times s,
    # the latter with probability frac(x/s), so one decode has sd s·sqrt(p(1-p)).
    x64 = x.astype(np.float64)
    chunk_max = [np.abs(x64[i : i + chunk]).max() for i in range(0, x.size, chunk)]
    scale = np.repeat(np.array(chunk_max) / 127, chunk)[: x.size]
    v = np.divide(x64, scale, out=np.zeros_like(x64), where=scale > 0)
    p = v - np.floor(v)
    stderr = scale * np.sqrt(p * (1 - p)) / np.sqrt(trials)
    # Float32 leaves: the stored scale may be one ulp above max|x|/127, and each decode is rounded to
    # float32 (half an ulp of |x| <= 127·s): together far below 4e-5·s.
    slack = 4e-5 * scale
    assert np.all(np.abs(decodes.mean(axis=0) - x64) <= 4 * stderr + slack)
    # Every single decode is one of the two neighbouring grid points: error below one scale step.
    assert np.all(np.abs(decodes - x64) <= scale + slack)
    np.testing.assert_array_equal(decodes[:, 128:192], 0.0)
    # The draws do vary: rounding is stochastic, not to nearest.
    assert decodes[:, :128].std(axis=0).max() > 0


def test_int8_codes_range_bytes_and_seeded_replay():
    x = make_int8_input()
    enc_a = make_compressor("int8", chunk=64, rng=7).encode(x)
    enc_b = make_compressor("int8", chunk=64, rng=7).encode(x)
    codes, scales = enc_a.parts
    assert codes.dtype == np.int8 and scales.dtype == np.float32
    assert int(np.abs(codes.astype(np.int64)).max()) <= 127
    np.testing.assert_array_equal(codes, enc_b.parts[0])  # same seed, same draws
    assert make_compressor("int8", chunk=64).nbytes(enc_a) == 200 + 4 * math.ceil(200 / 64)
    # The default chunk fills one packet of int32 lanes with two codes each.
    assert compress.Int8().chunk == 2 * 64
    assert make_compressor("quantize").name == "int8"
    with pytest.raises(ValueError, match="same chunk"):
        make_compressor("int8", chunk=32).decode(enc_a)


def test_int8_scale_never_lets_a_code_leave_the_range():
    # max|x|/127 rounded to nearest float32 can land below the true quotient; the code must not reach 128.
    rng = np.random.default_rng(4)
    x = rng.uniform(0.5, 1.0, (500, 16)).astype(np.float32)
    x[:, 0] = np.nextafter(np.float32(1.0), np.float32(2.0)) * rng.uniform(0.9, 1.1, 500).astype(np.float32)
    for row in x:
        scales = compress.int8_scales(row, 16)
        assert scales[0].astype(np.float64) * 127 >= np.abs(row.astype(np.float64)).max()
        codes, saturated = compress.int8_quantize(row, scales, 16, rng)
        assert saturated == 0 and int(np.abs(codes.astype(np.int64)).max()) <= 127


# --- top-k with error feedback -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "d", "k"),
    [(0.01, 1000, 10), (0.07, 100, 7), (0.01, 50, 1), (1.0, 5, 5), (0.5, 3, 2)],  # 0.07·100 > 7 in binary
)
def test_topk_k(ratio, d, k):
    assert TopK(ratio).k(d) == k


def test_topk_keeps_the_largest_and_stores_the_rest():
    x = np.array([0.5, -3.0, 2.0, 0.25, -1.0, 4.0, 0.0, -0.125, 1.5, 0.75], dtype=np.float32)
    tk = TopK(0.3)  # k = 3
    indices, values = tk.compress(x)
    assert indices.dtype == np.int32 and values.dtype == np.float32
    assert indices.tolist() == [1, 2, 5]  # |-3|, |2|, |4|: ascending index order
    assert values.tolist() == [-3.0, 2.0, 4.0]
    want_residual = x.copy()
    want_residual[[1, 2, 5]] = 0
    np.testing.assert_array_equal(tk.residual, want_residual)
    np.testing.assert_array_equal(TopK.decompress(indices, values, 10), x - want_residual)


def test_topk_error_feedback_sends_a_small_persistent_value_eventually():
    tk = TopK(0.5)  # d = 2, k = 1
    sent = [tk.compress(np.array([1.0, 0.375], dtype=np.float32)) for _ in range(4)]
    # Accumulated: [1, .375] -> send 1; [1, .75] -> send 1; [1, 1.125] -> send 1.125; [2, .375] -> send 2.
    want = [([0], [1.0]), ([0], [1.0]), ([1], [1.125]), ([0], [2.0])]
    assert [(i.tolist(), v.tolist()) for i, v in sent] == want
    np.testing.assert_array_equal(tk.residual, [0.0, 0.375])


@pytest.mark.parametrize("integers", [True, False])
def test_topk_conserves_the_total(integers):
    rng = np.random.default_rng(5)
    d, steps = 300, 60
    c = make_compressor("topk", compression_ratio=0.02)
    inputs = rng.integers(-50, 51, (steps, d)) if integers else rng.standard_normal((steps, d)) * 3
    inputs = inputs.astype(np.float32)
    decoded_total = np.zeros(d)
    for x in inputs:
        enc = c.encode(x)
        assert c.nbytes(enc) == 8 * 6  # k = ceil(0.02 * 300) = 6 (int32 index + float32 value)
        decoded_total += c.decode(enc)
    sent_plus_residual = decoded_total + c.residual
    want = inputs.astype(np.float64).sum(axis=0)
    if integers:
        np.testing.assert_array_equal(sent_plus_residual, want)  # small integers: every addition exact
    else:
        tolerance = 1e-4 * np.abs(inputs).sum(axis=0).max()  # float32 additions over the steps
        np.testing.assert_allclose(sent_plus_residual, want, rtol=0, atol=tolerance)


def test_topk_residual_belongs_to_one_tensor():
    tk = TopK(0.1)
    tk.compress(np.ones(20, dtype=np.float32))
    with pytest.raises(ValueError, match="one TopK per tensor"):
        tk.compress(np.ones(21, dtype=np.float32))
    tk.reset()
    assert tk.residual is None
    enc = tk.encode(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert tk.decode(enc).shape == (2, 3)


def test_make_compressor_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown compression"):
        make_compressor("zstd")
    with pytest.raises(ValueError, match="bad options"):
        make_compressor("fp16", ratio=0.1)
    with pytest.raises(ValueError, match="cannot decode"):
        make_compressor("fp16").decode(make_compressor("none").encode(np.ones(3, dtype=np.float32)))


# --- the summing switch path: two int8 codes per int32 lane ------------------------------------------


def switch_sum(payloads: np.ndarray) -> np.ndarray:
    """What an int32 switch does: add lanes with int32 arithmetic (wrapping, were the bound broken)."""
    total = np.zeros(payloads.shape[1], dtype=np.int32)
    for payload in payloads:
        total = (total + payload).astype(np.int32)
    return total


def test_packed_pairs_of_64_workers_sum_exactly():
    rng = np.random.default_rng(6)
    workers, d = 64, 257  # odd: the last lane carries one code and a zero
    codes = rng.integers(-127, 128, (workers, d)).astype(np.int8)
    codes[:, :4] = 127  # worst cases in the first lanes: every worker at +127 or -127
    codes[:, 4:8] = -127
    codes[:, 8:10] = [127, -127]
    codes[:, 10:12] = [-127, 127]
    payloads = np.stack([compress.pack_int8_pairs(c) for c in codes])
    assert payloads.dtype == np.int32 and payloads.shape == (workers, 129)
    sums = switch_sum(payloads)
    exact = codes.astype(np.int64).sum(axis=0)
    assert np.all(np.abs(payloads.astype(np.int64).sum(axis=0)) < 2**31)  # no wrap
    np.testing.assert_array_equal(compress.unpack_sums(sums, workers, d), exact)


@pytest.mark.parametrize("pattern", [(127, 127), (-127, -127), (127, -127), (-127, 127)])
def test_packed_pairs_exact_at_the_worker_limit(pattern):
    workers = compress.INT8_PAIR_MAX_WORKERS
    assert workers == 258 == 32767 // 127
    codes = np.tile(np.array(pattern, dtype=np.int8), (workers, 1))
    sums = switch_sum(np.stack([compress.pack_int8_pairs(c) for c in codes]))
    want = [pattern[0] * workers, pattern[1] * workers]
    np.testing.assert_array_equal(compress.unpack_sums(sums, workers, 2), want)


def test_packed_pairs_refuse_what_could_wrap():
    with pytest.raises(ValueError, match="at most 258"):
        compress.unpack_sums(np.zeros(1, dtype=np.int32), 259, 2)
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        compress.pack_int8_pairs(np.array([-128, 0], dtype=np.int8))
    assert compress.pair_code_limit(64) == 511
    assert compress.pair_code_limit(258) == 127
    assert compress.pair_code_limit(259) == 126


def test_int8_summing_path_mean_within_one_scale_step():
    # Workers agree on a power-of-two bound per chunk (as the codec agrees its exponent), quantize with
    # the shared scale, pack, the switch sums, hosts unpack and divide by the count that arrived.
    rng = np.random.default_rng(9)
    workers, d, chunk = 64, 512, 128
    x = (rng.standard_normal((workers, d)) * np.repeat([1e-3, 1.0, 30.0, 0.2], chunk)).astype(np.float32)
    arrived = rng.random(workers) < 0.9  # some contributions lost
    exponent = np.frexp(np.abs(x).reshape(workers, -1, chunk).max(axis=(0, 2)))[1]
    scales = (np.ldexp(1.0, exponent) / 127).astype(np.float32)
    payloads = []
    for w in np.flatnonzero(arrived):
        codes, saturated = compress.int8_quantize(x[w], scales, chunk, rng)
        assert saturated == 0
        payloads.append(compress.pack_int8_pairs(codes))
    count = len(payloads)
    sums = compress.unpack_sums(switch_sum(np.stack(payloads)), count, d)
    mean = compress.int8_dequantize(sums, scales, chunk).astype(np.float64) / count
    exact = x[arrived].astype(np.float64).mean(axis=0)
    step = np.repeat(scales.astype(np.float64), chunk)
    assert np.all(np.abs(mean - exact) < step)
