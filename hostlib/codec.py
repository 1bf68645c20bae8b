"""Fixed-point codec: float32 chunks <-> int32 with one agreed exponent per chunk.

How it works (docs/protocol.md, "Numbers"):
- each worker proposes ``e_c`` with ``max|x_c| < 2^e_c``; the switch takes the max over workers, ``E_c``;
- with ``L = ceil(log2 N)`` every worker sends ``q = floor(x · 2^s + u)``, ``s = 30 - L - E_c``,
  ``u ~ U[0, 1)``: stochastic rounding, so ``E[q] = x · 2^s`` exactly (unbiased quantization);
- ``|q|`` is clamped to ``2^(30-L)``, so a sum over at most ``2^L`` workers stays below ``2^31``: it can
  never wrap. Only a worker whose exponent proposal was lost can hit the clamp; that is reported.
Error bound: one contribution is off by less than ``2^-s``, so a mean over any set of contributors is
off by less than ``2^-s <= 2 · max|x| · 2^(L-30)``.

Two interchangeable paths (``CODEC_PATHS``) with the same contract: ``c``, the optional extension
``hostlib._codec`` (``hostlib/_codec.c``: one pass per value, straight into or out of big-endian packet
rows, GIL released), and ``numpy``, the reference in this module. :func:`quantize` / :func:`dequantize` and
their in-place forms :func:`quantize_into` / :func:`dequantize_into` take ``c`` when it is built, unless the
environment variable ``LTA_CODEC=numpy`` forces the reference (``LTA_CODEC=c`` insists on the extension).
Dequantizing gives bit-identical floats on both; quantizing draws its random bits differently (the C path
from a splitmix64 stream seeded by one draw of the caller's generator per call), so two paths agree in
distribution, clamps and saturation flags, not draw for draw.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np

from hostlib.extras import choose_path, optional_extension

_cext: Any
_cext, _CEXT_MISSING = optional_extension("hostlib._codec")

CODEC_PATHS = ("c", "numpy")
ENV_VAR = "LTA_CODEC"

EMPTY_EXPONENT = -127  # proposal for an all-zero chunk
SHIFT_LIMIT = 127  # the header's exp field is a signed byte
SUM_BITS = 30  # sums stay below 2^30, one bit of margin under int32
# The proposal of a chunk holding NaN or Inf: far above any float32 exponent (at most 128), so the max
# over workers keeps it, and its data round runs at the lowest shift (every contribution quantizes to ~0).
NONFINITE_EXPONENT = 1 << 24


def headroom_bits(n_workers: int) -> int:
    """``L = ceil(log2 N)``: bits reserved so that N contributions can be summed."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    return math.ceil(math.log2(n_workers))


def contribution_limit(n_workers: int) -> int:
    """Largest |int| one worker may send: ``2^(30-L)``."""
    return 1 << (SUM_BITS - headroom_bits(n_workers))


def exponent_proposals(chunks: np.ndarray, *, mark_nonfinite: bool = False) -> np.ndarray:
    """Per chunk (rows of ``chunks``), the int32 ``e`` with ``max|x| < 2^e``.

    A chunk holding NaN or Inf raises ValueError, or, with ``mark_nonfinite``, proposes
    :data:`NONFINITE_EXPONENT`: above every real exponent, so the switch's max carries it to every worker
    whose exponent RESULT counts it (docs/protocol.md, "Non-finite values")."""
    maxabs = _maxabs_rows(chunks)
    finite = np.isfinite(maxabs)
    if not finite.all() and not mark_nonfinite:
        bad = int(np.flatnonzero(~finite)[0])
        raise ValueError(f"tensor holds NaN or Inf (first in chunk {bad}); refusing to send it")
    with np.errstate(invalid="ignore"):
        _, exponent = np.frexp(maxabs)
    exponent = exponent.astype(np.int32)
    exponent[maxabs == 0] = EMPTY_EXPONENT
    exponent[~finite] = NONFINITE_EXPONENT
    return exponent


def stage(
    local: np.ndarray | None, chunks: np.ndarray, n: int, scale: float = 1.0, skip: int = 0
) -> tuple[np.ndarray, int]:
    """A reduce's input staged into its (C, K) float32 rows ``chunks`` and its exponent proposals, as
    :func:`exponent_proposals` with ``mark_nonfinite``: the ``n`` values of ``local`` (None: already in
    ``chunks``) times ``scale`` (float32 products), zeros after them; a chunk holding NaN or Inf proposes
    :data:`NONFINITE_EXPONENT` and is zeroed (it sends zeros: docs/protocol.md, "Non-finite values").
    Returns the proposals and how many chunks were not finite. One pass over the data on the ``c`` path
    (the same values and proposals as the numpy passes).

    ``skip`` (scale 1, ``local`` given, the ``c`` path): the whole chunks below it are only read, for their
    proposals, and their rows of ``chunks`` left as they were (the caller quantizes them from ``local``);
    a non-finite one among them is counted, not zeroed. Elsewhere every chunk is staged."""
    if codec_path() == "c" and chunks.dtype == np.float32 and chunks.ndim == 2 and chunks.flags.c_contiguous:
        proposals = np.empty(len(chunks), dtype=np.int32)
        src = None if local is None else np.ascontiguousarray(local, dtype=np.float32).reshape(-1)
        skip = skip if src is not None and scale == 1.0 else 0
        bad = _cext.stage(src, chunks, n, scale, proposals, EMPTY_EXPONENT, NONFINITE_EXPONENT, skip)
        return proposals, int(bad)
    staged = chunks.reshape(-1)
    if local is not None:
        staged[:n] = local
    staged[n:] = 0.0
    if scale != 1.0:
        chunks *= np.float32(scale)
    proposals = exponent_proposals(chunks, mark_nonfinite=True)
    own_nonfinite = proposals == NONFINITE_EXPONENT
    bad = int(own_nonfinite.sum())
    if bad:
        chunks[own_nonfinite] = 0.0
    return proposals, bad


def nonfinite_agreed(agreed_exponent: np.ndarray) -> np.ndarray:
    """Which agreed exponents say that some counted worker's chunk held NaN or Inf."""
    return np.asarray(agreed_exponent) >= NONFINITE_EXPONENT


def _maxabs_rows(chunks: np.ndarray) -> np.ndarray:
    """max|x| per row (NaN where a row holds one): one pass in C where the extension is built and the
    rows are float32 with contiguous values, else numpy's two row reductions (no |x| temporary)."""
    if codec_path() == "c" and chunks.dtype == np.float32 and chunks.ndim == 2 and chunks.strides[1] == 4:
        out = np.empty(len(chunks), dtype=np.float32)
        _cext.maxabs(chunks, out)
        return out
    return np.maximum(chunks.max(axis=1), -chunks.min(axis=1))


def data_shifts(agreed_exponent: np.ndarray, n_workers: int) -> np.ndarray:
    """Per chunk, the shift ``s`` all workers use for the data round (fits the signed exp byte)."""
    shift = (SUM_BITS - headroom_bits(n_workers)) - agreed_exponent.astype(np.int64)
    return np.clip(shift, -SHIFT_LIMIT, SHIFT_LIMIT).astype(np.int32)


def _pow2(shifts: np.ndarray, dtype) -> np.ndarray:
    """Per-row scale ``2^shift`` as a column, exact in ``dtype`` (float32 holds 2^-149..2^127)."""
    return np.ldexp(np.ones(len(shifts), dtype=dtype), shifts.astype(np.int32))[:, None]


def codec_path() -> str:
    """The path :func:`quantize` and :func:`dequantize` take now: ``"c"`` or ``"numpy"`` (``LTA_CODEC``:
    unset or ``auto`` picks ``c`` where it is built). Raises ValueError for an unknown value, or for ``c``
    where the extension is missing."""
    return _resolve_path(os.environ.get(ENV_VAR, "").strip())


@functools.lru_cache(maxsize=8)
def _resolve_path(requested: str) -> str:
    return choose_path(ENV_VAR, requested, CODEC_PATHS, "c", _CEXT_MISSING, "a codec path")


def _int32_rows(a: np.ndarray) -> bool:
    """2-D int32 (either byte order) with contiguous rows: what the C loops read and write in place."""
    return (
        a.ndim == 2
        and a.dtype.kind == "i"
        and a.dtype.itemsize == 4
        and (a.shape[1] < 2 or a.strides[1] == 4)
    )


def _float32_rows(a: np.ndarray) -> bool:
    return (
        a.ndim == 2 and a.dtype == np.float32 and a.dtype.isnative and (a.shape[1] < 2 or a.strides[1] == 4)
    )


def _row_index(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.dtype == bool:
        return np.flatnonzero(rows)
    return np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)


def quantize(
    chunks: np.ndarray, shifts: np.ndarray, n_workers: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Stochastically round ``chunks · 2^shift`` to int32. Returns (ints, saturated-per-chunk).

    Unbiased: ``E[ints] = chunks · 2^shift`` for every value within the limit; every value is the floor or
    the ceiling of ``chunks · 2^shift``, clamped to ``±contribution_limit(n_workers)``; a chunk is flagged
    saturated when one of its values went past the limit. Raises ValueError on NaN or Inf."""
    chunks = np.asarray(chunks)
    if codec_path() == "c" and chunks.ndim == 2:
        rows = chunks if _float32_rows(chunks) else np.ascontiguousarray(chunks, dtype=np.float32)
        out = np.empty(rows.shape, dtype=np.int32)
        saturated = np.empty(len(rows), dtype=bool)
        _c_quantize(rows, None, shifts, n_workers, rng, out, saturated)
        return out, saturated
    return _quantize_numpy(chunks, shifts, n_workers, rng)


def quantize_into(
    chunks: np.ndarray,
    shifts: np.ndarray,
    n_workers: int,
    rng: np.random.Generator,
    out: np.ndarray,
    rows: slice | np.ndarray | None = None,
) -> np.ndarray:
    """:func:`quantize` rows ``rows`` of ``chunks`` (all, a slice or an index array; ``shifts`` has one entry
    per selected row) into the same rows of ``out``, an int32 array of either byte order (e.g. the
    ``payload`` field of a packet batch: written in place, no temporary). Returns saturated-per-row."""
    if codec_path() == "c" and _int32_rows(out) and out.flags.writeable:
        if rows is None or isinstance(rows, slice):
            src, dst, index = (chunks, out, None) if rows is None else (chunks[rows], out[rows], None)
        else:
            src, dst, index = chunks, out, _row_index(rows)
        if _float32_rows(src) and src.shape == dst.shape:
            saturated = np.empty(len(src) if index is None else len(index), dtype=bool)
            _c_quantize(src, index, shifts, n_workers, rng, dst, saturated)
            return saturated
    sel = slice(None) if rows is None else rows
    ints, saturated = _quantize_numpy(np.asarray(chunks)[sel], shifts, n_workers, rng)
    out[sel] = ints
    return saturated


def _c_quantize(
    chunks: np.ndarray,
    index: np.ndarray | None,
    shifts: np.ndarray,
    n_workers: int,
    rng: np.random.Generator,
    out: np.ndarray,
    saturated: np.ndarray,
) -> None:
    seed = int(rng.bit_generator.random_raw())
    shifts = np.ascontiguousarray(shifts, dtype=np.int32).reshape(-1)
    _cext.quantize(chunks, index, shifts, contribution_limit(n_workers), seed, out, saturated)


def _quantize_numpy(
    chunks: np.ndarray, shifts: np.ndarray, n_workers: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The reference. Scaling float32 by a power of two is exact; ``floor(v)`` and ``frac = v - floor(v)``
    are exact too, so rounding up with probability ``frac`` (a float32 uniform draw) is unbiased to within
    2^-24 of one unit."""
    # A value far past the limit may overflow float32 (inf, then inf - inf): both are handled below.
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.multiply(chunks, _pow2(shifts, np.float32), dtype=np.float32)
        floor = np.floor(scaled)
        np.subtract(scaled, floor, out=scaled)  # the fractional part, in [0, 1)
    floor += rng.random(scaled.shape, dtype=np.float32) < scaled
    limit = contribution_limit(n_workers)
    # Per row max and min: NaN propagates into them; +-Inf there is an Inf input or a product past float32.
    top, bottom = floor.max(axis=1), floor.min(axis=1)
    odd = np.flatnonzero(~np.isfinite(top) | ~np.isfinite(bottom))
    if len(odd):
        bad = odd[~np.isfinite(np.asarray(chunks)[odd]).all(axis=1)]
        if len(bad):
            raise ValueError(f"tensor holds NaN or Inf (first in chunk {int(bad[0])}); refusing to send it")
    saturated = (top > limit) | (bottom < -limit)
    np.clip(floor, -limit, limit, out=floor)
    return floor.astype(np.int32), saturated


def dequantize(sums: np.ndarray, shifts: np.ndarray, divisor: np.ndarray | None = None) -> np.ndarray:
    """``sums · 2^-shift / divisor`` per chunk row, computed in float64 and returned as float32 (``sums`` of
    any integer type; int32 rows of either byte order are read in place)."""
    sums = np.asarray(sums)
    if codec_path() == "c" and _int32_rows(sums):
        out = np.empty(sums.shape, dtype=np.float32)
        if _c_dequantize(sums, None, shifts, divisor, out, None):
            return out
    return _dequantize_numpy(sums, shifts, divisor)


def dequantize_into(
    sums: np.ndarray,
    shifts: np.ndarray,
    divisor: np.ndarray | None,
    out: np.ndarray,
    *,
    rows: np.ndarray | None = None,
    out_rows: np.ndarray | None = None,
) -> None:
    """``out[out_rows] = dequantize(sums[rows], shifts, divisor)`` without the gathers: ``rows`` and
    ``out_rows`` are index arrays (or None: every row), so ``sums`` can be a column view of a receive
    buffer and ``out`` the reduce's output, each read or written once."""
    if (
        codec_path() == "c"
        and _int32_rows(sums)
        and _float32_rows(out)
        and out.flags.writeable
        and _c_dequantize(
            sums,
            None if rows is None else _row_index(rows),
            shifts,
            divisor,
            out,
            None if out_rows is None else _row_index(out_rows),
        )
    ):
        return
    values = _dequantize_numpy(sums if rows is None else sums[rows], shifts, divisor)
    if out_rows is None:
        out[...] = values
    else:
        out[out_rows] = values


def _c_dequantize(
    sums: np.ndarray,
    index: np.ndarray | None,
    shifts: np.ndarray,
    divisor: np.ndarray | None,
    out: np.ndarray,
    out_index: np.ndarray | None,
) -> bool:
    """Run the C loop; False (nothing written) when the arguments are not its shapes, so the caller
    takes the reference, which raises whatever it raises."""
    n = len(sums) if index is None else len(index)
    shifts = np.ascontiguousarray(shifts, dtype=np.int32).reshape(-1)
    divisors = None
    if divisor is not None:
        divisors = np.ascontiguousarray(divisor, dtype=np.float64).reshape(-1)
        if divisors.size == 1 and n != 1:
            divisors = np.full(n, divisors[0])
        if divisors.size != n:
            return False
    if len(shifts) != n or sums.shape[1] != out.shape[1] or (out_index is None and len(out) != n):
        return False
    _cext.dequantize(sums, index, shifts, divisors, out, out_index)
    return True


def _dequantize_numpy(sums: np.ndarray, shifts: np.ndarray, divisor: np.ndarray | None = None) -> np.ndarray:
    """The reference: the scale ``2^-shift / divisor`` in float64, one product, one rounding to float32."""
    scale = _pow2(-shifts, np.float64)
    if divisor is not None:
        scale = scale / divisor.reshape(-1, 1)
    return np.multiply(sums, scale, dtype=np.float64).astype(np.float32)


def error_bound(shifts: np.ndarray) -> np.ndarray:
    """Per chunk, the bound on |renormalized mean - exact mean of the contributors|: ``2^-shift``."""
    return np.ldexp(1.0, -shifts.astype(np.int64))
