"""Fixed-point codec: float32 chunks <-> int32 with one agreed exponent per chunk.

How it works (docs/protocol.md, "Numbers"):
- each worker proposes ``e_c`` with ``max|x_c| < 2^e_c``; the switch takes the max over workers, ``E_c``;
- with ``L = ceil(log2 N)`` every worker sends ``q = floor(x · 2^s + u)``, ``s = 30 - L - E_c``,
  ``u ~ U[0, 1)``: stochastic rounding, so ``E[q] = x · 2^s`` exactly (unbiased quantization);
- ``|q|`` is clamped to ``2^(30-L)``, so a sum over at most ``2^L`` workers stays below ``2^31``: it can
  never wrap. Only a worker whose exponent proposal was lost can hit the clamp; that is reported.
Error bound: one contribution is off by less than ``2^-s``, so a mean over any set of contributors is
off by less than ``2^-s <= 2 · max|x| · 2^(L-30)``.
"""

from __future__ import annotations

import math

import numpy as np

EMPTY_EXPONENT = -127  # proposal for an all-zero chunk
SHIFT_LIMIT = 127  # the header's exp field is a signed byte
SUM_BITS = 30  # sums stay below 2^30, one bit of margin under int32


def headroom_bits(n_workers: int) -> int:
    """``L = ceil(log2 N)``: bits reserved so that N contributions can be summed."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    return math.ceil(math.log2(n_workers))


def contribution_limit(n_workers: int) -> int:
    """Largest |int| one worker may send: ``2^(30-L)``."""
    return 1 << (SUM_BITS - headroom_bits(n_workers))


def exponent_proposals(chunks: np.ndarray) -> np.ndarray:
    """Per chunk (rows of ``chunks``), the int32 ``e`` with ``max|x| < 2^e``.

    Raises ValueError on NaN or Inf: they cannot be summed meaningfully and would poison every worker."""
    # max|x| as max(max x, -min x): two reductions, no |x| temporary the size of the tensor.
    maxabs = np.maximum(chunks.max(axis=1), -chunks.min(axis=1))
    if not np.all(np.isfinite(maxabs)):
        bad = int(np.flatnonzero(~np.isfinite(maxabs))[0])
        raise ValueError(f"tensor holds NaN or Inf (first in chunk {bad}); refusing to send it")
    _, exponent = np.frexp(maxabs)
    exponent = exponent.astype(np.int32)
    exponent[maxabs == 0] = EMPTY_EXPONENT
    return exponent


def data_shifts(agreed_exponent: np.ndarray, n_workers: int) -> np.ndarray:
    """Per chunk, the shift ``s`` all workers use for the data round (fits the signed exp byte)."""
    shift = (SUM_BITS - headroom_bits(n_workers)) - agreed_exponent.astype(np.int64)
    return np.clip(shift, -SHIFT_LIMIT, SHIFT_LIMIT).astype(np.int32)


def _pow2(shifts: np.ndarray, dtype) -> np.ndarray:
    """Per-row scale ``2^shift`` as a column, exact in ``dtype`` (float32 holds 2^-149..2^127)."""
    return np.ldexp(np.ones(len(shifts), dtype=dtype), shifts.astype(np.int32))[:, None]


def quantize(
    chunks: np.ndarray, shifts: np.ndarray, n_workers: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Stochastically round ``chunks · 2^shift`` to int32. Returns (ints, saturated-per-chunk).

    Unbiased: ``E[ints] = chunks · 2^shift`` for every value within the limit. Scaling float32 by a
    power of two is exact; ``floor(v)`` and ``frac = v - floor(v)`` are exact too, so rounding up with
    probability ``frac`` (a float32 uniform draw) is unbiased to within 2^-24 of one unit."""
    scaled = np.multiply(chunks, _pow2(shifts, np.float32), dtype=np.float32)
    floor = np.floor(scaled)
    np.subtract(scaled, floor, out=scaled)  # the fractional part, in [0, 1)
    floor += rng.random(scaled.shape, dtype=np.float32) < scaled
    limit = contribution_limit(n_workers)
    saturated = np.any(np.abs(floor) > limit, axis=1)
    np.clip(floor, -limit, limit, out=floor)
    return floor.astype(np.int32), saturated


def dequantize(sums: np.ndarray, shifts: np.ndarray, divisor: np.ndarray | None = None) -> np.ndarray:
    """``sums · 2^-shift / divisor`` per chunk row, computed in float64 and returned as float32."""
    scale = _pow2(-shifts, np.float64)
    if divisor is not None:
        scale = scale / divisor.reshape(-1, 1)
    return np.multiply(sums, scale, dtype=np.float64).astype(np.float32)


def error_bound(shifts: np.ndarray) -> np.ndarray:
    """Per chunk, the bound on |renormalized mean - exact mean of the contributors|: ``2^-shift``."""
    return np.ldexp(1.0, -shifts.astype(np.int64))
