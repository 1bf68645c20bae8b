"""Payloads of the parameter-server exchange (``PsOp``): what goes in the K lanes, and back.

The header is the protocol's (``hostlib.protocol``); a PS packet is a whole LTA packet of exactly K
lanes, like every other. This module says how the lanes of each PS op are filled, for the worker
(``hostlib.ps.client``) and the server (``softswitch.ps``) alike. docs/protocol.md ("Parameter-server
mode") documents the same layouts; all multi-byte values are big-endian, as the int32 lanes are.

Gradients (PUSH) are cut into packets of ``values_per_packet(codec, K)`` consecutive values (top-k:
``K // 2`` (index, value) pairs), packet ``p`` of every worker covering the same values, so that a server
can tell per packet which workers' values arrived:

========= ============================================================ ===================
codec     lanes of one packet                                          values per packet
========= ============================================================ ===================
NONE      K float32                                                    K
FP16      2K float16, the first value in a lane's high half            2K
INT8      lane 0: float32 scale s; then 4(K-1) int8 codes, 4 a lane    4(K-1)
TOPK      (int32 index, float32 value) pairs: lane 2i, lane 2i+1       K // 2 pairs
========= ============================================================ ===================

Parameters (INIT, PARAM) are K float32 per packet, chunk ``c`` holding values ``c·K .. c·K+K-1``.
A PULL's lanes are a bitmap of wanted chunks: bit ``i`` (least significant first) of lane ``j`` asks for
chunk ``first + 32·j + i``, where ``first`` is the header's ``chunk``.

The learning rate a worker sends with its gradient travels as float32 bits in the low 32 bits of a
PUSH's ``bitmap`` (a push has one sender, so the field carries no bitmap); 0 means "the job's".
"""

from __future__ import annotations

import math

import numpy as np

from hostlib.protocol import HEADER_BYTES, PsCodec, empty_batch
from hostlib.ps.compress import ALIASES, COMPRESSORS, Encoded

CODEC_BY_NAME: dict[str, PsCodec] = {
    "none": PsCodec.NONE,
    "fp16": PsCodec.FP16,
    "int8": PsCodec.INT8,
    "topk": PsCodec.TOPK,
}
assert set(CODEC_BY_NAME) == set(COMPRESSORS)
MAX_PUSH_PACKETS = 65535  # a PUSH names its packet count in the 16-bit `slot` field
_BITS_PER_LANE = 32


def codec_of(name: str) -> PsCodec:
    """The wire codec of a compression name (``none``, ``fp16``, ``int8``/``quantize``, ``topk``)."""
    method = ALIASES.get(name, name)
    if method not in CODEC_BY_NAME:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(CODEC_BY_NAME)}")
    return CODEC_BY_NAME[method]


def check_k(codec: PsCodec, k: int) -> None:
    if k < 1 or (codec in (PsCodec.INT8, PsCodec.TOPK) and k < 2):
        raise ValueError(f"{codec.name.lower()} pushes need at least 2 lanes per packet, got K={k}")


def values_per_packet(codec: PsCodec, k: int) -> int:
    """Gradient values one PUSH packet carries (top-k: pairs)."""
    check_k(codec, k)
    if codec == PsCodec.NONE:
        return k
    if codec == PsCodec.FP16:
        return 2 * k
    if codec == PsCodec.INT8:
        return 4 * (k - 1)
    return k // 2


def dense_packets(codec: PsCodec, k: int, n_values: int) -> int:
    """PUSH packets of a dense codec for ``n_values`` values (at least 1)."""
    return max(1, math.ceil(n_values / values_per_packet(codec, k)))


def param_chunks(n_values: int, k: int) -> int:
    """Parameter chunks (INIT / PARAM packets) of a job of ``n_values`` parameters."""
    return max(1, math.ceil(n_values / k))


# ---- lanes <-> bytes ----------------------------------------------------------------------------------


def _rows(flat_bytes: np.ndarray, n: int, k: int) -> np.ndarray:
    """``flat_bytes`` zero-padded to ``n`` rows of ``4k`` bytes."""
    out = np.zeros(n * 4 * k, dtype=np.uint8)
    out[: flat_bytes.size] = flat_bytes
    return out.reshape(n, 4 * k)


def float_rows(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 values as rows of K big-endian lanes (zero padded) and each row's ``nelem``."""
    flat = np.asarray(values, dtype=np.float32).ravel()
    n = max(1, math.ceil(flat.size / k))
    nelem = np.clip(flat.size - k * np.arange(n), 0, k)
    return _rows(flat.astype(">f4").view(np.uint8), n, k), nelem


def rows_to_floats(payload: np.ndarray, k: int) -> np.ndarray:
    """(m, 4K) payload bytes of float32 lanes -> (m, K) float32."""
    return np.ascontiguousarray(payload[:, : 4 * k]).view(">f4").astype(np.float32)


def encode_push(codec: PsCodec, enc: Encoded, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The PUSH payload rows ``(n, 4K)`` uint8 and ``nelem`` per row of one encoded gradient.

    ``enc`` comes from ``hostlib.ps.compress``: ``none``/``fp16`` as they are; ``int8`` encoded with
    ``chunk = values_per_packet(INT8, K)`` so that each packet holds exactly one scale; ``topk`` any."""
    if codec == PsCodec.NONE:
        return float_rows(enc.parts[0], k)
    if codec == PsCodec.FP16:
        halves = np.asarray(enc.parts[0], dtype=np.float16).ravel()
        n = dense_packets(codec, k, halves.size)
        nelem = np.clip(math.ceil(halves.size / 2) - k * np.arange(n), 0, k)
        return _rows(halves.astype(">f2").view(np.uint8), n, k), nelem
    if codec == PsCodec.INT8:
        codes, scales = enc.parts
        per = values_per_packet(codec, k)
        n = dense_packets(codec, k, codes.size)
        if len(scales) != n:
            raise ValueError(f"int8 pushes need one scale per {per} values ({n}), got {len(scales)}")
        rows = np.zeros((n, 4 * k), dtype=np.uint8)
        rows[:, :4] = np.asarray(scales, dtype=">f4").view(np.uint8).reshape(n, 4)
        rows[:, 4:] = _rows(np.asarray(codes, dtype=np.int8).view(np.uint8), n, k - 1)
        nelem = 1 + np.clip(np.ceil((codes.size - per * np.arange(n)) / 4), 0, k - 1).astype(np.int64)
        return rows, nelem
    indices, values = enc.parts
    pairs = values_per_packet(codec, k)
    n = max(1, math.ceil(len(indices) / pairs))
    lanes = np.zeros((n * pairs, 2), dtype=">u4")
    lanes[: len(indices), 0] = np.asarray(indices, dtype=">i4").view(">u4")
    lanes[: len(indices), 1] = np.asarray(values, dtype=">f4").view(">u4")
    flat = lanes.reshape(n, 2 * pairs).view(np.uint8).reshape(n, 8 * pairs)
    rows = np.zeros((n, 4 * k), dtype=np.uint8)
    rows[:, : 8 * pairs] = flat
    nelem = 2 * np.clip(len(indices) - pairs * np.arange(n), 0, pairs)
    return rows, nelem


def decode_dense(codec: PsCodec, payload: np.ndarray, k: int) -> np.ndarray:
    """(m, 4K) PUSH payloads of a dense codec -> (m, values_per_packet) float32 gradient values."""
    payload = np.ascontiguousarray(payload[:, : 4 * k])
    if codec == PsCodec.NONE:
        return payload.view(">f4").astype(np.float32)
    if codec == PsCodec.FP16:
        return payload.view(">f2").astype(np.float32)
    if codec == PsCodec.INT8:
        scales = np.ascontiguousarray(payload[:, :4]).view(">f4").astype(np.float32)
        codes = np.ascontiguousarray(payload[:, 4:]).view(np.int8)
        return codes.astype(np.float32) * scales
    raise ValueError("top-k payloads are sparse: use decode_topk")


def decode_topk(payload: np.ndarray, nelem: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(m, 4K) top-k PUSH payloads -> (indices int64, values float32) of every pair they carry."""
    pairs = values_per_packet(PsCodec.TOPK, k)
    lanes = np.ascontiguousarray(payload[:, : 8 * pairs]).view(">u4").reshape(len(payload), pairs, 2)
    used = np.arange(pairs)[None, :] < (np.asarray(nelem) // 2)[:, None]
    indices = lanes[..., 0].view(">i4")[used].astype(np.int64)
    values = lanes[..., 1].view(">f4")[used].astype(np.float32)
    return indices, values


# ---- PULL: a bitmap of wanted chunks -------------------------------------------------------------------


def chunk_bitmap(chunks: np.ndarray, k: int) -> tuple[int, np.ndarray, int]:
    """``(first, payload (4K,) bytes, nelem)`` of a PULL asking for ``chunks`` (sorted, non-empty).

    One PULL covers ``32·K`` chunks from ``first``; chunks beyond that are asked for by the next PULL."""
    chunks = np.asarray(chunks, dtype=np.int64)
    first = int(chunks[0])
    inside = chunks[chunks < first + _BITS_PER_LANE * k] - first
    lanes = np.zeros(k, dtype=np.uint64)
    np.bitwise_or.at(
        lanes, inside // _BITS_PER_LANE, np.uint64(1) << (inside % _BITS_PER_LANE).astype(np.uint64)
    )
    nelem = int(inside.max()) // _BITS_PER_LANE + 1
    return first, lanes.astype(">u4").view(np.uint8), nelem


def bitmap_chunks(payload: np.ndarray, first: int, nelem: int, n_chunks: int) -> np.ndarray:
    """The chunk indices (< ``n_chunks``) a PULL's bitmap asks for."""
    lanes = np.ascontiguousarray(payload[: 4 * nelem]).view(">u4").astype(np.uint64)
    bits = (lanes[:, None] >> np.arange(_BITS_PER_LANE, dtype=np.uint64)[None, :]) & np.uint64(1)
    chunks = first + np.flatnonzero(bits.ravel())
    return chunks[chunks < n_chunks]


# ---- the learning rate in a PUSH ------------------------------------------------------------------------


def lr_bits(lr: float | None) -> int:
    """float32 bits of ``lr`` for a PUSH's ``bitmap`` (0: none given, the job's lr applies)."""
    if lr is None:
        return 0
    return int(np.array([lr], dtype=">f4").view(">u4")[0])


def lr_from_bits(bits: int) -> float | None:
    """The learning rate a PUSH carried, or None (the job's) for 0, a negative, NaN or Inf."""
    value = float(np.array([bits & 0xFFFFFFFF], dtype=">u4").view(">f4")[0])
    return value if math.isfinite(value) and value > 0 else None


# ---- whole packets ----------------------------------------------------------------------------------------


def build_packets(payload: np.ndarray, k: int, **fields: object) -> np.ndarray:
    """(n, header + 4K) uint8 wire rows: header ``fields`` (scalars or per-row arrays) and ``payload``."""
    n = len(payload)
    batch = empty_batch(n, k)
    for name, value in fields.items():
        batch[name] = value
    rows = batch.view(np.uint8).reshape(n, batch.dtype.itemsize)
    rows[:, HEADER_BYTES:] = payload
    return rows
