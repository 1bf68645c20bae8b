"""Seeded randomized Hadamard rotation of a reduce's values: a lost packet costs a little of every value.

Without it a lost GRAD packet removes one worker's contribution to K neighbouring values (one chunk),
and renormalization stands in the survivors' mean for exactly those K values: the error sits on them.
Rotating first (OptiReduce's idea, written here for renormalized sums) mixes every value of a block into
every packet of that block, so the same loss costs each of the block's B values about √(K/B) of what
it cost the K values before, while the total squared error stays the same in expectation (the rotation
is orthogonal).

The rotation of a vector of length L is block diagonal: L is cut into blocks whose sizes are powers of
two (as many blocks of ``max_block`` as fit, then the binary digits of the rest, largest first), so no
value is padded and a reduce sends exactly the packets it sent without rotation when K divides the
blocks (K a power of two and L whole chunks: the transport's layout). Each block is ``H·D/√B``: D random
signs, H the Walsh–Hadamard matrix (fast transform, log₂B vectorized passes). The signs come from
``(seed, step, bucket)`` alone, so every worker of a job draws the same rotation at the same step for
the same tensor, and a new one at every step (a loss pattern never lines up with one fixed basis).

Unbiasedness: the rotated chunks are renormalized by their arrival count (unbiased for any loss
independent of the values) and the inverse is linear, so the estimate of the mean stays unbiased; a
chunk with count 0 falls back as before (``prev``: the previous result, rotated into this step's basis
by the caller).
"""

from __future__ import annotations

import numpy as np

DEFAULT_MAX_BLOCK = 1 << 16  # 64 chunks of K=1024, 1024 chunks of the P4 program's K=64
_SALT = 0x0807A7E  # keeps the sign stream apart from the other seeded streams of a run


def block_sizes(length: int, max_block: int = DEFAULT_MAX_BLOCK) -> list[int]:
    """Sizes of the rotation's blocks for ``length`` values: ``length // max_block`` blocks of
    ``max_block``, then the powers of two of the remainder's binary digits, largest first."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if max_block < 1 or max_block & (max_block - 1):
        raise ValueError(f"max_block must be a power of two, got {max_block}")
    full, rest = divmod(length, max_block)
    sizes = [max_block] * full
    bit = max_block >> 1
    while bit:
        if rest & bit:
            sizes.append(bit)
        bit >>= 1
    return sizes


def _levels(x: np.ndarray, y: np.ndarray, spans: list[int]) -> np.ndarray:
    """Butterfly levels of every row of ``x`` (M × B), one per span h (pairs i, i+h within blocks of
    2h), in the order given; ``x`` and ``y`` swap roles at each level. Returns the buffer holding the
    result (``x`` or ``y``)."""
    m, b = x.shape
    for h in spans:
        src = x.reshape(m, b // (2 * h), 2, h)
        dst = y.reshape(m, b // (2 * h), 2, h)
        np.add(src[:, :, 0], src[:, :, 1], out=dst[:, :, 0])
        np.subtract(src[:, :, 0], src[:, :, 1], out=dst[:, :, 1])
        x, y = y, x
    return x


def fwht(rows: np.ndarray) -> np.ndarray:
    """Unnormalized fast Walsh–Hadamard transform of every row of ``rows`` (M × B, B a power of two):
    returns ``rows @ H`` (H symmetric, entries ±1, H·H = B·I) as a new array of the same dtype.

    The butterfly levels run in the order h = 1, 2, 4, ... B/2, but a level of small span h pairs
    neighbours h apart, which numpy walks in runs of h values (slow for h < ~64). So each row is seen
    as a (B/L) × L matrix (L = 2^⌊log₂B / 2⌋): the levels of spans below L run on its transpose, where
    they pair values a whole row apart, and the rest on the matrix itself (~2.5x faster at B = 65536,
    the same additions in the same order, so the result is the same to the bit)."""
    m, b = rows.shape
    if b & (b - 1):
        raise ValueError(f"row length must be a power of two, got {b}")
    bits = b.bit_length() - 1
    low = bits // 2
    lo = 1 << low
    x = rows.reshape(m, b // lo, lo).transpose(0, 2, 1).copy().reshape(m, b)  # (L × B/L) per row
    y = np.empty_like(x)
    done = _levels(x, y, [(b // lo) << j for j in range(low)])  # spans 1..L/2, transposed
    other = y if done is x else x
    other.reshape(m, b // lo, lo)[:] = done.reshape(m, lo, b // lo).transpose(0, 2, 1)
    return _levels(other, done, [lo << j for j in range(bits - low)])  # spans L..B/2


class Rotation:
    """The rotation of one tensor (``length`` values) at one step: :meth:`forward` before quantizing and
    sending, :meth:`inverse` after renormalizing. Orthogonal: ``inverse(forward(x)) == x`` up to float
    rounding and norms are kept. Works on the last axis, so N workers' rows go through at once."""

    def __init__(
        self, length: int, *, seed: int, step: int, bucket: int = 0, max_block: int = DEFAULT_MAX_BLOCK
    ) -> None:
        if min(seed, step, bucket) < 0:
            raise ValueError(f"seed, step and bucket must be >= 0, got {seed}, {step}, {bucket}")
        self.length = length
        self.sizes = block_sizes(length, max_block)
        rng = np.random.default_rng([seed, step, bucket, _SALT])
        self.signs = (rng.integers(0, 2, length, dtype=np.int8) * 2 - 1).astype(np.float32)

    def _blocks(self, x: np.ndarray, signs_first: bool) -> np.ndarray:
        if x.shape[-1] != self.length:
            raise ValueError(f"the rotation is for {self.length} values, got {x.shape[-1]}")
        lead = x.shape[:-1]
        flat = np.asarray(x, dtype=np.float32).reshape(-1, self.length)
        if signs_first:
            flat = flat * self.signs
        out = np.empty_like(flat)
        start, i = 0, 0
        while i < len(self.sizes):  # equal sizes are adjacent: one transform for a run of them
            b = self.sizes[i]
            j = i
            while j < len(self.sizes) and self.sizes[j] == b:
                j += 1
            stop = start + (j - i) * b
            part = flat[:, start:stop].reshape(-1, b)
            out[:, start:stop] = (fwht(part) * np.float32(1.0 / np.sqrt(b))).reshape(flat.shape[0], -1)
            start, i = stop, j
        if not signs_first:
            out *= self.signs
        return out.reshape(*lead, self.length)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """``H·D/√B`` per block of the last axis (a new float32 array)."""
        return self._blocks(x, signs_first=True)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """``D·H/√B`` per block: the transpose of :meth:`forward`, hence its inverse."""
        return self._blocks(y, signs_first=False)
