"""The codec's C fast path (hostlib._codec) against the numpy reference and against the contract.

Dequantizing must give the reference's floats bit for bit. Quantizing draws its random bits differently,
so it is checked against what the contract promises: every value is the floor or the ceiling of the exact
``x · 2^s`` (computed here in float64, where it is exact), clamps and saturation flags as the reference's,
unbiased over seeded draws, the same output for the same seed, NaN and Inf refused. Then whole reduces
through a softswitch are exact on both paths (``LTA_CODEC=numpy`` and the default).
"""

from __future__ import annotations

import numpy as np
import pytest

from hostlib import codec
from hostlib.protocol import empty_batch
from tests.conftest import check_mean_over_bitmap

needs_c = pytest.mark.skipif(
    codec._cext is None, reason=f"no fast path to compare: {codec._CEXT_MISSING} (pip install -e . builds it)"
)


@pytest.fixture
def use_path(monkeypatch):
    """use_path("c" | "numpy"): route hostlib.codec through that path for the rest of the test."""

    def use(path: str) -> None:
        monkeypatch.setenv(codec.ENV_VAR, path)
        assert codec.codec_path() == path

    return use


def exact_scaled(x: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """x · 2^s in float64: exact for float32 x and |s| <= 127."""
    return x.astype(np.float64) * np.ldexp(1.0, shifts.astype(np.int64))[:, None]


def random_chunks(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Chunks spanning many magnitudes, each with its agreed-exponent shift for 4 workers."""
    x = rng.standard_normal((rows, k)) * 10.0 ** rng.integers(-30, 30, size=(rows, 1))
    x[0] = 0.0  # an all-zero chunk: shift 30 - 2 + 127, clipped to 127
    x[1, ::3] = 0.0
    return x.astype(np.float32)


# ---- dequantize: bit-identical ------------------------------------------------------------------------
@needs_c
@pytest.mark.parametrize("order", [">i4", "<i4"])
@pytest.mark.parametrize("divide", [True, False])
def test_dequantize_is_bit_identical_to_the_reference(use_path, order, divide):
    rng = np.random.default_rng(1)
    rows, k = 300, 67
    sums = rng.integers(-(2**31), 2**31, size=(rows, k), dtype=np.int64)
    sums[0, :4] = [-(2**31), 2**31 - 1, 0, -1]
    sums = sums.astype(order)
    shifts = rng.integers(-127, 128, size=rows).astype(np.int32)
    shifts[:3] = [-127, 127, 0]
    divisor = rng.integers(1, 65, size=rows) if divide else None
    use_path("numpy")
    with np.errstate(over="ignore"):  # sums near 2^31 at a shift of -127 are past float32 (inf)
        expected = codec.dequantize(sums, shifts, divisor)
    use_path("c")
    got = codec.dequantize(sums, shifts, divisor)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))  # bit for bit, +-0 and inf too
    # And the float64 formula by hand on a few values: sum · 2^-s / d, rounded once to float32.
    d = np.ones(rows) if divisor is None else divisor
    with np.errstate(over="ignore"):  # 2^31 · 2^127 is past float32: inf on both sides
        for r, j in [(0, 0), (0, 1), (5, 7), (299, 66)]:
            want = np.float32(float(int(sums[r, j])) * 2.0 ** -int(shifts[r]) / float(d[r]))
            assert got[r, j] == want


@needs_c
def test_dequantize_into_reads_receive_rows_in_place_and_writes_only_the_selected_rows(use_path):
    """The worker's use: payload columns of a receive buffer (big-endian, strided rows) into chosen rows
    of the reduce's output, with a divisor per row."""
    rng = np.random.default_rng(2)
    k, cap = 40, 16
    rx = rng.integers(0, 256, size=(cap, 36 + 4 * k + 4), dtype=np.uint8)  # header, payload, 4 spare bytes
    payload = rx[:, 36 : 36 + 4 * k].view(">i4")
    rows = np.array([9, 2, 14, 3])
    out_rows = np.array([0, 7, 3, 5])
    shifts = np.array([20, -3, 127, 0], dtype=np.int32)
    divisor = np.array([3, 1, 2, 7])
    use_path("numpy")
    expected = codec.dequantize(payload[rows].astype(np.int64), shifts, divisor)  # int64: the reference
    use_path("c")
    out = np.full((8, k), 123.0, dtype=np.float32)
    codec.dequantize_into(payload, shifts, divisor, out, rows=rows, out_rows=out_rows)
    assert np.array_equal(out[out_rows].view(np.uint32), expected.view(np.uint32))
    untouched = np.setdiff1d(np.arange(8), out_rows)
    assert np.all(out[untouched] == 123.0)


# ---- quantize: the contract ---------------------------------------------------------------------------
@needs_c
@pytest.mark.parametrize("n_workers", [1, 2, 5, 64])
def test_quantize_is_floor_or_ceil_of_the_exact_product(use_path, n_workers):
    rng = np.random.default_rng(n_workers)
    x = random_chunks(rng, 200, 129)
    shifts = codec.data_shifts(codec.exponent_proposals(x), n_workers)
    use_path("c")
    ints, saturated = codec.quantize(x, shifts, n_workers, np.random.default_rng(7))
    exact = exact_scaled(x, shifts)
    assert ints.dtype == np.int32 and not saturated.any()  # the agreed exponent bounds every value
    assert np.all((ints >= np.floor(exact)) & (ints <= np.ceil(exact)))
    assert np.all(np.abs(ints - exact) < 1)
    assert np.all(ints[0] == 0)
    # Both directions occur where the product is not an integer (the rounding is not plain truncation).
    frac = exact - np.floor(exact)
    split = frac > 0
    assert np.any(ints[split] == np.floor(exact[split])) and np.any(ints[split] == np.ceil(exact[split]))


@needs_c
def test_clamps_and_saturation_flags_match_the_reference(use_path):
    """A worker whose exponent proposal was lost sends values past the limit: clamped to +-2^(30-L) and
    the chunk flagged, on both paths alike. Values on the limit itself are not saturated."""
    n_workers = 4
    limit = codec.contribution_limit(n_workers)  # 2^28
    shifts = np.array([0, 0, 0, 0, -2, 10, 127], dtype=np.int32)
    x = np.zeros((7, 8), dtype=np.float32)
    x[0, 3] = limit  # exactly on the limit: fine
    x[1, 5] = -limit
    x[2, 0] = 3 * limit  # far past it
    x[3, 7] = -3 * limit
    x[4, 1] = 4.0 * limit + 512  # past it after the shift of -2 (limit + 128)
    x[5, 2] = 3e38  # the float32 product overflows to inf in the reference: still a clamp, not an error
    x[6, 4] = -1.0  # 2^127 past the limit
    want_sat = np.array([False, False, True, True, True, True, True])
    got = {}
    for path in ("numpy", "c"):
        use_path(path)
        got[path] = codec.quantize(x, shifts, n_workers, np.random.default_rng(3))
    for path, (ints, saturated) in got.items():
        assert np.array_equal(saturated, want_sat), path
        assert np.abs(ints.astype(np.int64)).max() == limit, path
        assert ints[0, 3] == limit and ints[1, 5] == -limit, path
        assert ints[2, 0] == limit and ints[3, 7] == -limit and ints[4, 1] == limit, path
        assert ints[5, 2] == limit and ints[6, 4] == -limit, path
    assert np.array_equal(got["c"][0], got["numpy"][0])  # no fractions here: nothing random


@needs_c
def test_quantize_is_unbiased_over_seeded_draws(use_path):
    use_path("c")
    values = np.array(
        [0.3, -0.3, 2.5, -7.125, 1e-3, -1e-3, 0.999, 123456.7, -0.5, 3.0, 1.0 / 3.0, 2.0**22 + 0.75],
        dtype=np.float32,
    )
    x = np.tile(values, (2, 1))
    shifts = np.array([3, 0], dtype=np.int32)
    exact = exact_scaled(x, shifts)
    rng = np.random.default_rng(11)
    trials = 2000
    draws = np.stack([codec.quantize(x, shifts, 1, rng)[0] for _ in range(trials)]).astype(np.float64)
    mean = draws.mean(axis=0)
    frac = exact - np.floor(exact)
    se = np.sqrt(frac * (1 - frac) / trials)
    # Within 4 standard errors of the exact product (exactly equal where the product is an integer).
    assert np.all(np.abs(mean - exact) <= 4 * se + 1e-12), np.abs(mean - exact) / np.maximum(se, 1e-12)
    assert np.all(draws.min(axis=0) >= np.floor(exact)) and np.all(draws.max(axis=0) <= np.ceil(exact))


@needs_c
def test_same_seed_same_output_other_seed_other_output(use_path):
    use_path("c")
    rng = np.random.default_rng(4)
    x = random_chunks(rng, 50, 64)
    shifts = codec.data_shifts(codec.exponent_proposals(x), 2)
    a, sat_a = codec.quantize(x, shifts, 2, np.random.default_rng(99))
    b, sat_b = codec.quantize(x, shifts, 2, np.random.default_rng(99))
    c, _ = codec.quantize(x, shifts, 2, np.random.default_rng(100))
    assert np.array_equal(a, b) and np.array_equal(sat_a, sat_b)
    assert not np.array_equal(a, c)
    # Rows never share random bits: identical rows round differently.
    same = np.tile(np.float32(0.5), (2, 4096))
    twin, _ = codec.quantize(same, np.zeros(2, dtype=np.int32), 1, np.random.default_rng(1))
    assert not np.array_equal(twin[0], twin[1])


@pytest.mark.parametrize("path", ["c", "numpy"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused_with_the_chunk_named(use_path, path, bad):
    if path == "c" and codec._cext is None:
        pytest.skip(codec._CEXT_MISSING)
    use_path(path)
    x = np.ones((4, 16), dtype=np.float32)
    x[2, 9] = bad
    shifts = np.zeros(4, dtype=np.int32)
    with pytest.raises(ValueError, match="NaN or Inf.*chunk 2"):
        codec.quantize(x, shifts, 2, np.random.default_rng(0))
    batch = empty_batch(4, 16)
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.quantize_into(x, shifts, 2, np.random.default_rng(0), batch["payload"])


@pytest.mark.parametrize("path", ["c", "numpy"])
@pytest.mark.parametrize("k", [1, 7, 64, 359])
def test_exponent_proposals_bound_every_value_tightly(use_path, path, k):
    """Per chunk, e with max|x| < 2^e <= 2 max|x| (the contract), whatever the row width: checked value by
    value in float64 against the chunk's own entries, with signed zeros, subnormals and the float32
    extremes in it; -127 for an all-zero chunk; NaN and Inf refused with the chunk named."""
    if path == "c" and codec._cext is None:
        pytest.skip(codec._CEXT_MISSING)
    use_path(path)
    x = random_chunks(np.random.default_rng(9), 200, k)
    x[2] = -0.0
    x[3, 0] = np.float32(1e-45)  # the smallest subnormal
    x[4, -1] = np.float32(-3.4e38)
    x[5] = 0.0
    x[5, 0] = np.float32(-2.0)  # a power of two: 2^1 <= |x| < 2^2
    e = codec.exponent_proposals(x)
    maxabs = np.abs(x.astype(np.float64)).max(axis=1)
    nonzero = maxabs > 0
    assert np.all(maxabs[nonzero] < np.ldexp(1.0, e[nonzero]))
    assert np.all(np.ldexp(1.0, e[nonzero]) <= 2 * maxabs[nonzero])
    assert np.all(e[~nonzero] == codec.EMPTY_EXPONENT) and not nonzero[[0, 2]].any()
    assert e[5] == 2
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[7, k // 2] = bad
        with pytest.raises(ValueError, match="NaN or Inf.*chunk 7"):
            codec.exponent_proposals(y)


@pytest.mark.parametrize("path", ["c", "numpy"])
@pytest.mark.parametrize("k", [1, 7, 64, 359])
@pytest.mark.parametrize("scale", [1.0, 3.0])
@pytest.mark.parametrize("in_place", [False, True])
def test_stage_copies_scales_pads_and_proposes_in_one_call(use_path, path, k, scale, in_place):
    """codec.stage: the rows hold the input times ``scale`` (float32 products), zeros after the last value;
    each chunk proposes the smallest e with max|x| < 2^e (checked in float64 against the staged values),
    -127 for a chunk of zeros, and a chunk holding NaN or Inf proposes NONFINITE_EXPONENT and holds zeros;
    the count of such chunks is returned. Both paths give the same bits."""
    if path == "c" and codec._cext is None:
        pytest.skip(codec._CEXT_MISSING)
    use_path(path)
    rows = 40
    n = rows * k - (k // 2)  # the last chunk is partial (one value of K = 1: full)
    x = random_chunks(np.random.default_rng(5), rows, k).reshape(-1)[:n].copy()
    x[3 * k] = np.float32(1e-45)  # a subnormal chunk maximum
    x[4 * k : 5 * k] = -0.0
    x[6 * k] = np.nan
    x[8 * k + k // 2] = -np.inf
    chunks = np.full((rows, k), 7.0, dtype=np.float32)  # stale values: everything must be overwritten
    if in_place:
        chunks.reshape(-1)[:n] = x
    proposals, bad = codec.stage(None if in_place else x, chunks, n, scale)
    expected = np.zeros(rows * k, dtype=np.float32)
    expected[:n] = x * np.float32(scale)
    expected = expected.reshape(rows, k)
    nonfinite = ~np.isfinite(expected).all(axis=1)
    assert bad == 2 and np.flatnonzero(nonfinite).tolist() == [6, 8]
    expected[nonfinite] = 0.0
    np.testing.assert_array_equal(chunks, expected)
    assert np.all(proposals[nonfinite] == codec.NONFINITE_EXPONENT)
    maxabs = np.abs(expected.astype(np.float64)).max(axis=1)
    zero = (maxabs == 0) & ~nonfinite
    assert zero[4] and np.all(proposals[zero] == codec.EMPTY_EXPONENT)
    real = ~zero & ~nonfinite
    e = proposals[real].astype(np.int64)
    assert np.all(maxabs[real] < np.ldexp(1.0, e)) and np.all(np.ldexp(1.0, e - 1) <= maxabs[real])


@needs_c
def test_stage_gives_the_reference_bits(use_path):
    """The C pass and the numpy passes stage the same floats and propose the same exponents."""
    x = random_chunks(np.random.default_rng(6), 300, 64).reshape(-1)[:-5].copy()
    x[70] = np.inf
    got = {}
    for path in ("c", "numpy"):
        use_path(path)
        chunks = np.empty((300, 64), dtype=np.float32)
        proposals, bad = codec.stage(x, chunks, x.size, 5.0)
        got[path] = (chunks.view(np.uint32).copy(), proposals, bad)
    np.testing.assert_array_equal(got["c"][0], got["numpy"][0])
    np.testing.assert_array_equal(got["c"][1], got["numpy"][1])
    assert got["c"][2] == got["numpy"][2] == 1


@pytest.mark.parametrize("path", ["c", "numpy"])
@pytest.mark.parametrize("rows", ["all", "slice", "index"])
def test_quantize_into_writes_the_payload_rows_of_a_packet_batch_in_place(use_path, path, rows):
    """The worker's use: the big-endian payload field of a structured packet batch, a slice or an index
    array of its rows; the headers and the other rows stay as they were."""
    if path == "c" and codec._cext is None:
        pytest.skip(codec._CEXT_MISSING)
    use_path(path)
    rng = np.random.default_rng(5)
    k, c = 33, 10
    x = (rng.standard_normal((c, k)) * 100).astype(np.float32)
    shifts_all = codec.data_shifts(codec.exponent_proposals(x), 2)
    batch = empty_batch(c, k)
    batch["seq"] = np.arange(c) + 1000
    batch["payload"] = -7
    sel = {"all": None, "slice": slice(2, 8), "index": np.array([1, 4, 9, 6])}[rows]
    picked = np.arange(c) if sel is None else np.arange(c)[sel]
    saturated = codec.quantize_into(x, shifts_all[picked], 2, np.random.default_rng(8), batch["payload"], sel)
    assert saturated.shape == (len(picked),) and not saturated.any()
    exact = exact_scaled(x[picked], shifts_all[picked])
    written = batch["payload"][picked].astype(np.int64)
    assert np.all((written >= np.floor(exact)) & (written <= np.ceil(exact)))
    others = np.setdiff1d(np.arange(c), picked)
    assert np.all(batch["payload"][others] == -7)
    assert np.array_equal(batch["seq"], np.arange(c) + 1000)
    # On the wire, big-endian: the bytes of row picked[0], value 0, are the int's big-endian bytes.
    raw = batch.view(np.uint8).reshape(c, -1)[picked[0], 36:40].tobytes()
    assert raw == int(written[0, 0]).to_bytes(4, "big", signed=True)


# ---- choosing the path --------------------------------------------------------------------------------
def test_lta_codec_chooses_the_path_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv(codec.ENV_VAR, "numpy")
    assert codec.codec_path() == "numpy"
    monkeypatch.setenv(codec.ENV_VAR, "auto")
    assert codec.codec_path() == ("numpy" if codec._cext is None else "c")
    monkeypatch.setenv(codec.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="LTA_CODEC='fast' is not a codec path"):
        codec.codec_path()


def test_without_the_extension_the_reference_runs_and_c_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(codec, "_cext", None)
    monkeypatch.setattr(codec, "_CEXT_MISSING", "the C extension hostlib._codec is not usable (test)")
    codec._resolve_path.cache_clear()
    try:
        monkeypatch.delenv(codec.ENV_VAR, raising=False)
        assert codec.codec_path() == "numpy"
        x = np.full((1, 8), 0.25, dtype=np.float32)
        ints, saturated = codec.quantize(x, np.array([2], dtype=np.int32), 2, np.random.default_rng(0))
        assert np.all(ints == 1) and not saturated.any()
        monkeypatch.setenv(codec.ENV_VAR, "c")
        with pytest.raises(ValueError, match="hostlib._codec is not usable.*LTA_CODEC=numpy"):
            codec.codec_path()
    finally:
        codec._resolve_path.cache_clear()


# ---- whole reduces: exact on both paths ---------------------------------------------------------------
@pytest.fixture(params=["default", "numpy"])
def codec_env(request, monkeypatch) -> str:
    """Reduces through the default codec path (C where built) and through the forced numpy reference."""
    if request.param == "numpy":
        monkeypatch.setenv(codec.ENV_VAR, "numpy")
    else:
        monkeypatch.delenv(codec.ENV_VAR, raising=False)
    return codec.codec_path()


@pytest.mark.parametrize(("n", "k", "loss"), [(2, 64, 0.0), (3, 64, 0.1), (2, 4000, 0.0), (4, 1000, 0.1)])
def test_reduces_are_exact_means_over_the_bitmap_on_both_paths(make_cluster, codec_env, n, k, loss):
    cluster = make_cluster(
        n, up=loss, down=loss / 2, seed=n, elems_per_packet=k, sync_deadline_ms=300, min_deadline_ms=50
    )
    rng = np.random.default_rng(k + n)
    length = 9 * k + 13
    checked, prev = 0, None
    every = n * -(-length // k)
    # lossless: every chunk full; at 10% loss short chunks in some reduce (counted below)
    expect = dict(full=every, partial=0, fallback=0) if loss == 0 else dict(partial=(0, None))
    expect = {"full": (0, None), "fallback": (0, None), **expect}
    short = 0
    for step in range(3):
        inputs = [
            (rng.standard_normal(length) * 10.0 ** rng.integers(-3, 4)).astype(np.float32) for _ in range(n)
        ]
        results = cluster.reduce_all(inputs, step=step)
        checked += check_mean_over_bitmap(results, inputs, k, prev=prev, **expect)
        prev = [r.values for r in results]
        short += sum(int(np.sum(r.count < n)) for r in results)
        if loss == 0.0:
            assert all(np.all(r.count == n) for r in results)
            for r in results[1:]:  # every worker dequantized the same sums the same way
                assert np.array_equal(r.values, results[0].values)
    assert checked > 0 and (short > 0) == (loss > 0)
    assert codec.codec_path() == codec_env  # the path the fixture chose was the one in use throughout
