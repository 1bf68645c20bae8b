"""Where every parameter value lives on the wire: chunks of K values, and which worker owns each chunk.

A model's parameters are laid out end to end in one flat float32 vector, padded to a whole number of
chunks. Chunk ``c`` covers values ``[c·K, (c+1)·K)``: the same chunk index names the gradient chunk in an
allreduce and the parameter chunk in a PARAM broadcast, so a shard is simply a set of chunks. ZeRO-style
sharding gives each worker one contiguous, balanced run of chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# PARAM chunk ids at or above this are end-of-broadcast markers (``MARKER_CHUNK_BASE + owner``), never data.
MARKER_CHUNK_BASE = 0xFFFF_0000


@dataclass(frozen=True)
class ShardLayout:
    """``numel`` meaningful values in chunks of ``elems_per_chunk``; ``owners[c]`` is chunk c's owner."""

    numel: int
    elems_per_chunk: int
    owners: np.ndarray

    @classmethod
    def contiguous(cls, numel: int, elems_per_chunk: int, n_workers: int) -> ShardLayout:
        """ZeRO-style: worker w owns chunks ``[ceil(w·C/N), ceil((w+1)·C/N))``, as equal as they can be."""
        if numel < 1:
            raise ValueError(f"nothing to shard: numel={numel}")
        n_chunks = math.ceil(numel / elems_per_chunk)
        owners = (np.arange(n_chunks, dtype=np.int64) * n_workers) // n_chunks
        return cls(numel, elems_per_chunk, owners)

    @classmethod
    def single_owner(cls, numel: int, elems_per_chunk: int, owner: int) -> ShardLayout:
        """Every chunk owned by one worker (a synthetic shard with N-1 receivers)."""
        n_chunks = math.ceil(numel / elems_per_chunk)
        return cls(numel, elems_per_chunk, np.full(n_chunks, owner, dtype=np.int64))

    @property
    def n_chunks(self) -> int:
        return len(self.owners)

    @property
    def padded(self) -> int:
        return self.n_chunks * self.elems_per_chunk

    def chunks_of(self, worker: int) -> np.ndarray:
        return np.flatnonzero(self.owners == worker)

    def shard_range(self, worker: int) -> tuple[int, int]:
        """Values ``[lo, hi)`` owned by ``worker`` (clipped to ``numel``); needs a contiguous shard."""
        chunks = self.chunks_of(worker)
        if len(chunks) == 0:
            return 0, 0
        if chunks[-1] - chunks[0] + 1 != len(chunks):
            raise ValueError(f"worker {worker} owns a non-contiguous set of chunks")
        k = self.elems_per_chunk
        return int(chunks[0]) * k, min(int(chunks[-1] + 1) * k, self.numel)

    def element_owners(self) -> np.ndarray:
        """Owner of every meaningful value (length ``numel``)."""
        return np.repeat(self.owners, self.elems_per_chunk)[: self.numel]
