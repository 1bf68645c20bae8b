"""Gradient compression: fewer bytes per step on the wire, decoded before aggregation.

Methods (``make_compressor(name, **kw)``; every compressor has ``encode``, ``decode``, ``nbytes``):

============ ======================================================= ==========================
method       encoding                                                bytes on the wire (d values)
============ ======================================================= ==========================
``none``     float32 as is                                           ``4d``
``fp16``     IEEE half precision, round to nearest; values beyond    ``2d``
             +-65504 are clamped and counted (``Encoded.saturated``)
``int8``     per chunk of ``chunk`` values a float32 scale           ``d + 4·ceil(d/chunk)``
             ``max|x|/127`` and codes ``q`` in [-127, 127], rounded
             stochastically (alias ``quantize``, the seed's name)
``topk``     the ``k = max(1, ceil(ratio·d))`` largest ``|x + r|``   ``8k``
             as (int32 index, float32 value); the rest stays in
             the worker's residual ``r`` (error feedback)
============ ======================================================= ==========================

``nbytes`` counts the payload arrays only; the method, the tensor's shape and ``chunk`` are job
configuration that both ends know, not per-step traffic.

Guarantees:
- ``fp16``: ``|decode(encode(x)) - x| <= max(2^-11·|x|, 2^-25)`` for ``|x| <= 65504`` (half an ulp of
  an 11-bit significand; 2^-25 is half the subnormal spacing).
- ``int8``: unbiased, ``E[decode(encode(x))] = x`` up to the float32 rounding of the decoded value
  (2^-24 relative): ``q = floor(x/s + u)``, ``u ~ U[0, 1)`` from the compressor's numpy Generator, is
  ``floor(x/s) + 1`` with probability ``frac(x/s)``. One value is off by less than its chunk's ``s``.
  The stored scale is rounded up to a float32 ``s >= max|x|/127``, so ``|x/s| <= 127`` and ``q`` never
  leaves [-127, 127].
- ``topk``: error feedback conserves the total: after any number of steps, the sum of everything
  sent plus the residual equals the sum of every input (up to float32 rounding of the additions;
  exactly when the values are small integers). The residual stays on the worker: one ``TopK`` per
  tensor.

The summing switch path (a P4 switch can only add int32, exactly, and must never wrap):
- ``fp16`` values cannot be added by an integer adder, and ``topk`` payloads of different workers
  carry different indices, so neither can be summed in the switch: both are for the parameter-server
  path, where the server decodes each worker's payload and aggregates (``hostlib.ps.robust``) after.
- ``int8`` codes can be summed by the switch if all workers share each chunk's scale (agree on it as
  the codec agrees on its exponent: ``s_c = 2^E_c / 127`` with ``max|x| < 2^E_c`` over the workers, then
  ``int8_quantize(x, scales, chunk, rng)``), and two codes then share one int32 lane:
  ``pack_int8_pairs`` / ``unpack_sums``, so one packet carries twice the values. The mean is
  ``unpack_sums(S, count, d) · s / count``.

No-wrap proof for packed pairs. A worker packs codes ``a, b`` with ``|a|, |b| <= c`` as
``w = a + 2^16·b`` (``|w| <= c·(2^16 + 1) < 2^31`` for ``c <= 127``: the int32 is exact). The switch adds
``N`` such words: ``S = A + 2^16·B`` with ``A = sum a``, ``B = sum b``, ``|A|, |B| <= c·N``. If
``c·N <= 2^15 - 1 = 32767`` then (1) ``|S| <= 32767·(2^16 + 1) = 2147450879 < 2^31``: the int32 sum never
wraps (and a switch that adds modulo 2^32 still holds ``S`` itself); (2) ``S ≡ A (mod 2^16)`` and
``|A| < 2^15``, so ``A`` is the low 16 bits of ``S`` read as a signed int16 (the one representative of its
residue class in [-2^15, 2^15)), and ``B = (S - A) / 2^16`` exactly. No bias offset is needed. For int8
codes (``c = 127``): ``N <= 32767 // 127 = 258`` workers (``INT8_PAIR_MAX_WORKERS``); at the protocol's
``MAX_WORKERS = 64``, ``127·64 = 8128``, a quarter of the bound, so 9-bit codes (``pair_code_limit(64)
= 511``) would still fit. The bound is tight: 259 workers all sending +127 give ``A = 32893``, whose
low 16 bits read as -32643.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hostlib.protocol import DEFAULT_ELEMS_PER_PACKET

log = logging.getLogger(__name__)

COMPRESSORS: tuple[str, ...] = ("none", "fp16", "int8", "topk")
ALIASES: dict[str, str] = {"quantize": "int8"}  # the seed protocol's name for int8

FP16_MAX = 65504.0  # the largest finite float16
INT8_CODE_MAX = 127  # symmetric codes: -128 is never produced
# One packet of DEFAULT_ELEMS_PER_PACKET int32 lanes carries two int8 codes per lane.
INT8_CHUNK = 2 * DEFAULT_ELEMS_PER_PACKET

PAIR_LANE_BITS = 16
_LANE_SUM_LIMIT = (1 << (PAIR_LANE_BITS - 1)) - 1  # 32767: |sum of one lane| must stay below 2^15

# Slack for ceil(ratio·d): keeps decimal ratios exact (0.07 · 100 is 7.000000000000001 in binary).
_RATIO_SLACK = 1e-9


@dataclass(frozen=True)
class Encoded:
    """One tensor's compressed form: what goes on the wire (``parts``) and how to rebuild it."""

    method: str
    shape: tuple[int, ...]
    parts: tuple[np.ndarray, ...]
    saturated: int = 0  # values that had to be clamped (fp16 beyond +-65504, int8 beyond the given scale)


def wire_bytes(enc: Encoded) -> int:
    """Bytes of the payload arrays of ``enc`` (what one worker sends for this tensor per step)."""
    return int(sum(part.nbytes for part in enc.parts))


class Compressor(Protocol):
    name: str

    def encode(self, x: np.ndarray) -> Encoded: ...

    def decode(self, enc: Encoded) -> np.ndarray: ...

    def nbytes(self, enc: Encoded) -> int: ...

    def max_abs_error(self, x: np.ndarray, enc: Encoded) -> float: ...


def _flat_finite(x: np.ndarray) -> np.ndarray:
    """``x`` flattened, in its own float precision (a cast to float32 first would round twice for fp16)."""
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"gradients must be floating point, got {arr.dtype}")
    flat = arr.ravel()
    if not np.all(np.isfinite(flat)):
        bad = int(np.flatnonzero(~np.isfinite(flat))[0])
        raise ValueError(f"tensor holds NaN or Inf (first at flat index {bad}); refusing to encode it")
    return flat


class _Codec(ABC):
    name = ""

    def _check(self, enc: Encoded) -> None:
        if enc.method != self.name:
            raise ValueError(f"{self.name} compressor cannot decode a {enc.method!r} payload")

    @abstractmethod
    def encode(self, x: np.ndarray) -> Encoded:
        """The wire form of ``x``."""

    @abstractmethod
    def decode(self, enc: Encoded) -> np.ndarray:
        """float32 values of ``enc``'s shape."""

    def nbytes(self, enc: Encoded) -> int:
        """Bytes on the wire for ``enc``."""
        self._check(enc)
        return wire_bytes(enc)

    def max_abs_error(self, x: np.ndarray, enc: Encoded) -> float:
        """``max |decode(enc) - x|`` (for topk: against ``x`` alone, the residual not counted)."""
        decoded = self.decode(enc).astype(np.float64).ravel()
        return float(np.max(np.abs(decoded - np.asarray(x, dtype=np.float64).ravel()), initial=0.0))


class NoCompression(_Codec):
    """float32 as is: the baseline the others are measured against."""

    name = "none"

    def encode(self, x: np.ndarray) -> Encoded:
        return Encoded(self.name, np.shape(x), (_flat_finite(x).astype(np.float32),))

    def decode(self, enc: Encoded) -> np.ndarray:
        self._check(enc)
        return enc.parts[0].reshape(enc.shape).copy()


class Fp16(_Codec):
    """IEEE half precision; values beyond +-65504 are clamped and counted, never sent as Inf."""

    name = "fp16"

    def encode(self, x: np.ndarray) -> Encoded:
        flat = _flat_finite(x)
        saturated = int(np.count_nonzero(np.abs(flat) > FP16_MAX))
        if saturated:
            log.warning("fp16: %d values beyond +-%g clamped", saturated, FP16_MAX)
            flat = np.clip(flat, -FP16_MAX, FP16_MAX)
        return Encoded(self.name, np.shape(x), (flat.astype(np.float16),), saturated)

    def decode(self, enc: Encoded) -> np.ndarray:
        self._check(enc)
        return enc.parts[0].astype(np.float32).reshape(enc.shape)


def _chunked(flat: np.ndarray, chunk: int) -> np.ndarray:
    """``flat`` zero-padded to whole chunks, as rows of ``chunk`` values."""
    n_chunks = max(1, math.ceil(flat.size / chunk))
    padded = np.zeros(n_chunks * chunk, dtype=flat.dtype)
    padded[: flat.size] = flat
    return padded.reshape(n_chunks, chunk)


def int8_scales(x: np.ndarray, chunk: int = INT8_CHUNK) -> np.ndarray:
    """Per chunk of ``chunk`` values of flat ``x``, the float32 scale ``s >= max|x|/127`` (0 if all zero).

    Rounded up, never to nearest: with ``s·127 >= max|x|`` no code can leave [-127, 127]."""
    rows = _chunked(np.asarray(x, dtype=np.float64).ravel(), chunk)
    maxabs = np.max(np.abs(rows), axis=1)
    scales = (maxabs / INT8_CODE_MAX).astype(np.float32)
    low = scales.astype(np.float64) * INT8_CODE_MAX < maxabs
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))  # one ulp up is enough: it was rounded
    return scales


def int8_quantize(
    x: np.ndarray, scales: np.ndarray, chunk: int, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """Stochastically round flat ``x / s`` per chunk to int8 codes in [-127, 127]. Returns (codes, saturated).

    Unbiased for every value with ``|x| <= 127·s``: ``E[q] = x / s``. ``scales`` may come from
    ``int8_scales`` (this worker's own) or be agreed among workers (the summing path); values beyond
    ``127·s`` (only possible with agreed scales) are clamped and counted."""
    flat = np.asarray(x, dtype=np.float64).ravel()
    rows = _chunked(flat, chunk)
    scales64 = np.asarray(scales, dtype=np.float64).reshape(-1, 1)
    if len(scales64) != len(rows):
        raise ValueError(f"{len(rows)} chunks of {chunk} values need {len(rows)} scales, got {len(scales64)}")
    scaled = np.divide(rows, scales64, out=np.zeros_like(rows), where=scales64 != 0)
    codes = np.floor(scaled)
    codes += rng.random(scaled.shape) < (scaled - codes)
    saturated = int(np.count_nonzero(np.abs(codes.ravel()[: flat.size]) > INT8_CODE_MAX))
    np.clip(codes, -INT8_CODE_MAX, INT8_CODE_MAX, out=codes)
    return codes.ravel()[: flat.size].astype(np.int8), saturated


def int8_dequantize(codes: np.ndarray, scales: np.ndarray, chunk: int) -> np.ndarray:
    """``codes · s`` per chunk, float32 (also turns unpacked switch sums into sums of values)."""
    flat = np.asarray(codes).ravel()
    per_value = np.repeat(np.asarray(scales, dtype=np.float32), chunk)[: flat.size]
    return flat.astype(np.float32) * per_value


class Int8(_Codec):
    """Per-chunk scale ``max|x|/127`` and unbiased stochastic rounding (``rng``: Generator or seed)."""

    name = "int8"

    def __init__(self, chunk: int = INT8_CHUNK, rng: np.random.Generator | int | None = None) -> None:
        if chunk < 1:
            raise ValueError(f"int8 chunk must be >= 1 value, got {chunk}")
        self.chunk = chunk
        self.rng = np.random.default_rng(rng)

    def encode(self, x: np.ndarray) -> Encoded:
        flat = _flat_finite(x)
        scales = int8_scales(flat, self.chunk)
        codes, saturated = int8_quantize(flat, scales, self.chunk, self.rng)
        return Encoded(self.name, np.shape(x), (codes, scales), saturated)

    def decode(self, enc: Encoded) -> np.ndarray:
        self._check(enc)
        codes, scales = enc.parts
        if len(scales) != max(1, math.ceil(codes.size / self.chunk)):
            raise ValueError(
                f"{len(scales)} scales for {codes.size} codes do not match chunk={self.chunk}: "
                "encoder and decoder must use the same chunk"
            )
        return int8_dequantize(codes, scales, self.chunk).reshape(enc.shape)


class TopK(_Codec):
    """Top-k sparsification with error feedback; holds the residual of one tensor (keep it on the worker).

    ``compress`` adds the residual to ``x``, sends the ``k`` entries of largest magnitude and keeps
    the rest as the next residual, so nothing is dropped, only delayed: sent + residual = accumulated."""

    name = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"topk ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self._residual: np.ndarray | None = None

    def k(self, d: int) -> int:
        """Entries sent for a tensor of ``d`` values: ``max(1, ceil(ratio · d))``, at most ``d``."""
        return min(d, max(1, math.ceil(self.ratio * d - _RATIO_SLACK)))

    @property
    def residual(self) -> np.ndarray | None:
        """A copy of what has been accumulated but not sent yet (None before the first step)."""
        return None if self._residual is None else self._residual.copy()

    def reset(self) -> None:
        """Forget the residual (e.g. after the worker reloaded parameters)."""
        self._residual = None

    def compress(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(indices int32 ascending, values float32)`` of the ``k`` largest ``|x + residual|``."""
        flat = _flat_finite(x).astype(np.float32, copy=False)
        d = flat.size
        if d >= 2**31:
            raise ValueError(f"topk indices are int32; a tensor of {d} values needs splitting")
        if self._residual is None:
            self._residual = np.zeros(d, dtype=np.float32)
        elif self._residual.size != d:
            raise ValueError(
                f"this TopK holds the residual of a {self._residual.size}-value tensor, got {d} values; "
                "use one TopK per tensor"
            )
        accumulated = flat + self._residual
        k = self.k(d)
        if k == d:
            indices = np.arange(d)
        else:
            indices = np.argpartition(np.abs(accumulated), d - k)[d - k :]
            indices.sort()
        values = accumulated[indices]  # fancy indexing: a copy
        accumulated[indices] = 0.0
        self._residual = accumulated
        return indices.astype(np.int32), values

    @staticmethod
    def decompress(indices: np.ndarray, values: np.ndarray, d: int) -> np.ndarray:
        """The dense float32 vector of length ``d`` that holds ``values`` at ``indices`` and 0 elsewhere."""
        dense = np.zeros(d, dtype=np.float32)
        dense[indices] = values
        return dense

    def encode(self, x: np.ndarray) -> Encoded:
        indices, values = self.compress(x)
        return Encoded(self.name, np.shape(x), (indices, values))

    def decode(self, enc: Encoded) -> np.ndarray:
        self._check(enc)
        indices, values = enc.parts
        return self.decompress(indices, values, math.prod(enc.shape)).reshape(enc.shape)


def make_compressor(name: str, **kw: object) -> Compressor:
    """The compressor called ``name`` (``none``, ``fp16``, ``int8``/``quantize``, ``topk``).

    Keywords: ``int8``: ``chunk`` (values per scale, default ``INT8_CHUNK``), ``rng`` (numpy Generator
    or seed); ``topk``: ``ratio`` (default 0.01; ``compression_ratio`` is accepted, the seed's name)."""
    method = ALIASES.get(name, name)
    if method not in COMPRESSORS:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(COMPRESSORS)}")
    if method == "topk" and "compression_ratio" in kw:
        kw = dict(kw)
        kw.setdefault("ratio", kw.pop("compression_ratio"))
    classes: dict[str, type] = {"none": NoCompression, "fp16": Fp16, "int8": Int8, "topk": TopK}
    try:
        return classes[method](**kw)
    except TypeError as exc:
        raise ValueError(f"bad options for {method} compression: {exc}") from None


# --- the summing switch path: two int8 codes per int32 lane --------------------------------------


def pair_code_limit(workers: int) -> int:
    """Largest ``c`` such that ``workers`` packed pairs of codes in [-c, c] sum without wrap (32767 // N)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return _LANE_SUM_LIMIT // workers


INT8_PAIR_MAX_WORKERS = _LANE_SUM_LIMIT // INT8_CODE_MAX  # 258


def pack_int8_pairs(codes: np.ndarray) -> np.ndarray:
    """Two int8 codes per int32 lane: ``codes[2i] + 2^16·codes[2i+1]`` (an odd tail is paired with 0).

    Codes must lie in [-127, 127] (``int8_quantize`` never makes -128). Sums of up to
    ``INT8_PAIR_MAX_WORKERS`` such lanes never wrap; see the module docstring for the proof."""
    flat = np.asarray(codes).ravel()
    if flat.size and int(np.abs(flat.astype(np.int64)).max()) > INT8_CODE_MAX:
        raise ValueError(f"packed codes must lie in [-{INT8_CODE_MAX}, {INT8_CODE_MAX}]")
    pairs = np.zeros(2 * math.ceil(flat.size / 2), dtype=np.int64)
    pairs[: flat.size] = flat
    return (pairs[0::2] + (pairs[1::2] << PAIR_LANE_BITS)).astype(np.int32)


def unpack_sums(lane_sums: np.ndarray, count: int, length: int) -> np.ndarray:
    """Per-value sums (int32, ``length`` of them) from switch sums of ``count`` packed lanes.

    Exact for ``count <= INT8_PAIR_MAX_WORKERS``: the low lane is the signed low 16 bits, the high
    lane what remains divided by 2^16."""
    if not 0 <= count <= INT8_PAIR_MAX_WORKERS:
        raise ValueError(
            f"packed int8 pairs sum exactly for at most {INT8_PAIR_MAX_WORKERS} contributions, got {count}"
        )
    sums = np.asarray(lane_sums).astype(np.int64).ravel()
    if length > 2 * sums.size:
        raise ValueError(f"{sums.size} lanes hold at most {2 * sums.size} values, {length} asked")
    half = 1 << (PAIR_LANE_BITS - 1)
    low = ((sums + half) & ((1 << PAIR_LANE_BITS) - 1)) - half
    high = (sums - low) >> PAIR_LANE_BITS
    out = np.empty(2 * sums.size, dtype=np.int64)
    out[0::2] = low
    out[1::2] = high
    return out[:length].astype(np.int32)
