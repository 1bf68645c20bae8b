"""The PARAMs a worker received and nobody took yet: the parameter inbox that the exchange
(``hostlib.torch_ext.exchange``) and the lossy all-gather (``hostlib.torch_ext.gather``) drain.

Every PARAM of a batch goes in at once, as rows of arrays that grow (chunk id, step, sender, ``nelem``
and the K values in the host's byte order): a steady stream of parameter copies makes no Python object
per packet. A reader takes what is there as one :class:`ParamBatch` holding the newest arrival of each
chunk (an older copy of a chunk still waiting is dropped, as a dict keyed by chunk id would keep the
last one), and may put back the rows it is not ready for yet (a faster rank's next gather).

The inbox keeps two sets of arrays and fills one while the batch last taken views the other, so a take
copies nothing (unless a chunk came twice) and that batch stays good while PARAMs keep arriving, until
the next take.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ParamBatch:
    """PARAM rows, one per chunk, in arrival order: a batch taken from the inbox, and the inbox's own
    storage (:meth:`zeros`)."""

    chunk: np.ndarray  # int64: the chunk id
    step: np.ndarray  # int64: the header's step
    sender: np.ndarray  # int64: the header's worker id
    nelem: np.ndarray  # int64: meaningful values of the row
    values: np.ndarray  # float32 (rows, K); past nelem: what the packet carried (zeros)

    @classmethod
    def zeros(cls, capacity: int, k: int) -> ParamBatch:
        chunk, step, sender, nelem = (np.zeros(capacity, dtype=np.int64) for _ in range(4))
        return cls(chunk, step, sender, nelem, np.zeros((capacity, k), dtype=np.float32))

    def __len__(self) -> int:
        return len(self.chunk)

    def rows(self, index: slice | np.ndarray) -> ParamBatch:
        """These rows: views for a slice, a copy for a mask or an index array."""
        return ParamBatch(
            self.chunk[index], self.step[index], self.sender[index], self.nelem[index], self.values[index]
        )


class ParamInbox:
    """PARAM rows received and not yet taken (see the module docstring)."""

    def __init__(self, elems_per_packet: int) -> None:
        self.k = elems_per_packet
        self._n = 0
        self._sets = [ParamBatch.zeros(0, elems_per_packet), ParamBatch.zeros(0, elems_per_packet)]
        self._active = 0

    def __len__(self) -> int:
        return self._n

    def add(
        self, chunk: np.ndarray, step: np.ndarray, sender: np.ndarray, nelem: np.ndarray, values: np.ndarray
    ) -> None:
        """Append rows (``values``: (rows, K), any float byte order, converted as it is copied in)."""
        m = len(chunk)
        if not m:
            return
        end = self._n + m
        rows = self._sets[self._active]
        if end > len(rows):
            grown = ParamBatch.zeros(max(end, 2 * len(rows), 64), self.k)
            for name in ("chunk", "step", "sender", "nelem", "values"):
                getattr(grown, name)[: self._n] = getattr(rows, name)[: self._n]
            rows = self._sets[self._active] = grown
        sl = slice(self._n, end)
        rows.chunk[sl], rows.step[sl], rows.sender[sl], rows.nelem[sl] = chunk, step, sender, nelem
        rows.values[sl] = values
        self._n = end

    def put_back(self, batch: ParamBatch) -> None:
        """Rows taken that the reader leaves for later, back in ahead of whatever came since: a newer
        copy of the same chunk that came meanwhile still wins (rare: a faster rank's next gather)."""
        if not len(batch):
            return
        waiting = self._sets[self._active].rows(np.arange(self._n))  # (copies)
        self._n = 0
        for rows in (batch, waiting):
            self.add(rows.chunk, rows.step, rows.sender, rows.nelem, rows.values)

    def peek(self) -> ParamBatch:
        """The newest arrival of each chunk waiting, in arrival order, leaving the inbox as it is. Where
        no chunk came twice (the usual case) the batch views the arrays being filled: read it before the
        next :meth:`add` (:meth:`take`'s batch lasts longer)."""
        n, rows = self._n, self._sets[self._active]
        # the last occurrence of each chunk id (in arrival order once sorted)
        last = n - 1 - np.unique(rows.chunk[:n][::-1], return_index=True)[1]
        if last.size == n:  # no chunk came twice
            return rows.rows(slice(0, n))
        last.sort()
        return rows.rows(last)

    def take(self) -> ParamBatch:
        """:meth:`peek`, and the inbox emptied: later arrivals fill the other set of arrays, so the batch
        stays good until the next take."""
        batch = self.peek()
        self._n = 0
        self._active ^= 1
        return batch
