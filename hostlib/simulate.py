"""In-process drop simulator: the aggregation semantics of one reduce for many workers at once.

What the switch and the hosts do to one reduce (exponent round, stochastically rounded data round,
per-chunk counts, renormalization, fallback), with every packet's fate drawn from the same drop models
the softswitch uses, but as whole-array numpy operations instead of packets. It scales past the 64
workers a bitmap can name (the scaling benchmark runs it to 1024) and needs no sockets. It models
loss, not timing: no deadlines, no FLUSH races.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hostlib import codec
from hostlib.dropmodels import NO_LOSS, DropPolicy, DropStream


@dataclass
class SimulatedReduce:
    values: np.ndarray  # (N, n) float32: what each worker ends up with
    count: np.ndarray  # (C,) contributions that reached the switch per chunk
    delivered: np.ndarray  # (N, C) bool: the RESULT reached worker w
    contributed: np.ndarray  # (N, C) bool: worker w's data was summed


def simulate_reduce(
    inputs: np.ndarray,
    *,
    elems_per_packet: int = 64,
    up: DropPolicy = NO_LOSS,
    down: DropPolicy = NO_LOSS,
    exp_copies: int = 2,
    fallback: np.ndarray | None = None,
    seed: int = 0,
) -> SimulatedReduce:
    """Reduce ``inputs`` (N workers × n values) as the fabric would under the given loss.

    ``fallback`` (N × n) is what a worker keeps where no RESULT reaches it (default: zeros)."""
    n_workers, n = inputs.shape
    k = elems_per_packet
    c = -(-n // k)
    e_units = -(-c // k)
    rng = np.random.default_rng(seed)
    streams = [DropStream(up, seed * 7919 + 1), DropStream(down, seed * 7919 + 2)]

    def lost(stream: DropStream, shape: tuple[int, ...]) -> np.ndarray:
        return stream.drop_many(int(np.prod(shape))).reshape(shape)

    chunks = np.zeros((n_workers, c * k), dtype=np.float32)
    chunks[:, :n] = inputs
    chunks = chunks.reshape(n_workers, c, k)
    proposals = codec.exponent_proposals(chunks.reshape(-1, k)).reshape(n_workers, c)

    # Exponent round: a worker's proposal counts if any of its copies got through; each worker learns
    # the agreed exponents if that unit's RESULT reaches it.
    e_up = np.all(lost(streams[0], (exp_copies, n_workers, e_units)), axis=0)  # all copies lost
    e_in = np.repeat(~e_up, k, axis=1)[:, :c]
    agreed = np.where(e_in, proposals, np.iinfo(np.int32).min).max(axis=0)
    e_known = np.repeat(~lost(streams[1], (n_workers, e_units)), k, axis=1)[:, :c]
    e_known &= e_in.any(axis=0, keepdims=True)

    shifts = codec.data_shifts(agreed, n_workers)
    ints, saturated = codec.quantize(chunks.reshape(-1, k), np.tile(shifts, n_workers), n_workers, rng)
    ints = ints.reshape(n_workers, c, k)
    # Data round: sent if the exponent is known and fits; summed if the GRAD survives the up link.
    contributed = e_known & ~saturated.reshape(n_workers, c) & ~lost(streams[0], (n_workers, c))
    count = contributed.sum(axis=0)
    sums = np.einsum("wc,wck->ck", contributed.astype(np.int64), ints.astype(np.int64))
    mean = codec.dequantize(sums, shifts, np.maximum(count, 1))
    delivered = ~lost(streams[1], (n_workers, c)) & (count > 0)[None, :]
    base = (
        np.zeros((n_workers, c * k), np.float32)
        if fallback is None
        else np.pad(fallback, ((0, 0), (0, c * k - n)))
    )
    out = np.where(delivered[:, :, None], mean[None, :, :], base.reshape(n_workers, c, k))
    return SimulatedReduce(out.reshape(n_workers, -1)[:, :n], count, delivered, contributed)
