"""Lossy all-gather of equal shards with stale copies: FSDP2's parameter unshard through the switch.

Every worker broadcasts its shard as PARAM chunks (the switch replicates them to the others, each replica
subject to that receiver's loss), then its end marker (critical: emulated loss spares it; on one switch
path packets stay in order, so once a receiver has every other owner's marker it knows which chunks were
lost without waiting for a deadline). A lost chunk leaves the receiver's previous copy of that chunk *of
the same call key* in place: the paper's Algorithm 1 applied to a gather.

Copies are recognized across steps by a **call key** (``hostlib.torch_ext.callkeys``), not by buffer:
FSDP2 allocates new all-gather buffers every time. Each key has its own rows of copies and, per chunk,
the key's call at which the copy held was fresh. **No copy older than S calls of its key is ever handed
out**: a copy ages by at most one call per call, so the caller (the process group) has the ranks agree,
after each lossy gather, whether some rank now holds a copy S calls old (``GatherOutcome.max_age``), and
then gathers the key's next call reliably and calls :meth:`StaleGather.refresh`; ``outcome.resync``
(a copy older than S) is the check that this never failed. A key's first call is reliable for the same
reason (no copy yet).

One worker, one StaleGather: it reads ``worker.param_inbox``. Chunk ids are allocated per key in the order
keys first appear, the same on every rank because every rank makes the same calls in the same order.
"""

from __future__ import annotations

import math
import select
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hostlib.torch_ext.layout import MARKER_CHUNK_BASE
from hostlib.transport import LtaWorker


@dataclass
class _Copies:
    """What a receiver holds for one call key: every rank's shard as rows of K, and their freshness."""

    base: int  # first chunk id of this key on the wire
    shard_numel: int
    chunks_per_rank: int
    rows: np.ndarray  # (N · chunks_per_rank, K) float32
    held: np.ndarray  # int64 per chunk: the key's call whose values the row holds
    calls: int = 0  # calls of this key so far


@dataclass
class GatherOutcome:
    """One lossy gather as seen by this receiver: foreign chunks, how many arrived, the oldest copy."""

    chunks_expected: int
    chunks_fresh: int
    stale_copies: int  # foreign chunks handed out from an earlier call
    max_age: int  # calls since the oldest copy handed out was fresh (0: all fresh)
    markers_missed: int
    resync: bool  # some copy would be older than S: gather this call reliably instead
    wait_s: float


@dataclass
class GatherTotals:
    calls: int = 0
    chunks_expected: int = 0
    chunks_fresh: int = 0
    stale_copies: int = 0
    max_age: int = 0
    markers_missed: int = 0
    resyncs: int = 0
    wait_s: float = 0.0

    def add(self, outcome: GatherOutcome) -> None:
        self.calls += 1
        self.chunks_expected += outcome.chunks_expected
        self.chunks_fresh += outcome.chunks_fresh
        self.stale_copies += outcome.stale_copies if not outcome.resync else 0
        self.max_age = max(self.max_age, outcome.max_age if not outcome.resync else 0)
        self.markers_missed += outcome.markers_missed
        self.resyncs += int(outcome.resync)
        self.wait_s += outcome.wait_s


class StaleGather:
    """Gathers float32 shards of equal size from every worker of ``worker``'s job, keeping stale copies."""

    def __init__(self, worker: LtaWorker, *, stale_bound: int = 8, deadline_ms: float = 200.0) -> None:
        if stale_bound < 1:
            raise ValueError(f"stale_bound (S) must be >= 1 call, got {stale_bound}")
        self.worker = worker
        self.stale_bound = stale_bound
        self.deadline_s = deadline_ms / 1000.0
        self._copies: dict[Any, _Copies] = {}
        self._next_base = 0
        self._gen = 0  # lossy gathers so far: the PARAM step of the current one (all keys)
        self._marker_step = np.full(worker.n_workers, -1, dtype=np.int64)
        self.totals = GatherTotals()

    def known(self, key: Any) -> bool:
        """True once ``key`` has been gathered (reliably) at least once: its next call may be lossy."""
        return key in self._copies

    def refresh(self, key: Any, gathered: np.ndarray, *, after_gather: bool = False) -> None:
        """Record a reliable gather of ``key``: its first call, or (``after_gather``) the call that
        :meth:`gather` just tried, made reliable because some rank's copy would have been older than S.
        ``gathered`` holds every rank's shard, end to end (N·m values). Every copy is then fresh."""
        n = self.worker.n_workers
        values = np.asarray(gathered, dtype=np.float32).reshape(-1)
        if values.size % n:
            raise ValueError(f"a gather of {n} ranks returns a multiple of {n} values, got {values.size}")
        m = values.size // n
        copies = self._copies.get(key)
        if copies is None or copies.shard_numel != m:
            k = self.worker.config.elems_per_packet
            cpr = max(1, math.ceil(m / k))
            copies = _Copies(
                self._next_base, m, cpr, np.zeros((n * cpr, k), np.float32), np.zeros(n * cpr, np.int64)
            )
            self._next_base += n * cpr
            if self._next_base >= MARKER_CHUNK_BASE:
                raise RuntimeError("lossy all-gather: chunk ids exhausted (too many distinct call keys)")
            self._copies[key] = copies
        flat = copies.rows.reshape(n, -1)
        flat[:, :m] = values.reshape(n, m)
        if after_gather:
            copies.held[:] = copies.calls - 1
        else:
            copies.held[:] = copies.calls
            copies.calls += 1

    def gather(self, key: Any, shard: np.ndarray) -> tuple[np.ndarray, GatherOutcome]:
        """Publish this rank's ``shard`` of ``key`` and collect the others' (a known key only).

        Returns every rank's shard, one row each: an (N, m) float32 view of the copies held (fresh where
        the copy arrived, else the previous copy held; read it before this key's next gather), and what
        happened. When ``outcome.resync`` is set the values must not be used:
        some copy is older than S calls; gather reliably and :meth:`refresh` (all ranks must agree)."""
        copies = self._copies[key]
        n, me = self.worker.n_workers, self.worker.worker_id
        m, cpr = copies.shard_numel, copies.chunks_per_rank
        local = np.asarray(shard, dtype=np.float32).reshape(-1)
        if local.size != m:
            raise ValueError(f"call key {key!r}: shard of {local.size} values, {m} before")
        t, gen = copies.calls, self._gen
        self._gen += 1
        own = copies.rows[me * cpr : (me + 1) * cpr]
        own.reshape(-1)[:m] = local
        ids = copies.base + me * cpr + np.arange(cpr, dtype=np.int64)
        self.worker.broadcast_params(ids, own, step=gen)
        marker = np.array([MARKER_CHUNK_BASE + me])
        self.worker.broadcast_params(marker, np.array([[float(cpr)]], np.float32), step=gen, critical=True)
        copies.held[me * cpr : (me + 1) * cpr] = t
        wait_s, missed = self._collect(copies, gen, t)
        foreign = np.ones(n * cpr, dtype=bool)
        foreign[me * cpr : (me + 1) * cpr] = False
        ages = t - copies.held[foreign]
        max_age = int(ages.max()) if ages.size else 0
        outcome = GatherOutcome(
            chunks_expected=int(foreign.sum()),
            chunks_fresh=int(np.count_nonzero(ages == 0)),
            stale_copies=int(np.count_nonzero(ages > 0)),
            max_age=max_age,
            markers_missed=missed,
            resync=max_age > self.stale_bound,
            wait_s=wait_s,
        )
        copies.calls += 1
        self.totals.add(outcome)
        return copies.rows.reshape(n, -1)[:, :m], outcome  # a view: the caller copies once, into its output

    def _collect(self, copies: _Copies, gen: int, t: int) -> tuple[float, int]:
        """Take in this gather's chunks until every other owner's marker is in or the deadline passed."""
        t0 = time.perf_counter()
        deadline = t0 + self.deadline_s
        others = np.array([w for w in range(self.worker.n_workers) if w != self.worker.worker_id])
        while True:
            self.worker.poll(0.0)
            self._absorb(copies, gen, t)
            if np.all(self._marker_step[others] >= gen):
                return time.perf_counter() - t0, 0
            now = time.perf_counter()
            if now >= deadline:
                return now - t0, int(np.sum(self._marker_step[others] < gen))
            readable, _, _ = select.select([self.worker.sock], [], [], min(0.01, deadline - now))
            if readable:
                self.worker.poll(0.0)

    def _absorb(self, copies: _Copies, gen: int, t: int) -> None:
        inbox = self.worker.param_inbox
        if not len(inbox):
            return
        got = inbox.take()
        marker = got.chunk >= MARKER_CHUNK_BASE
        if marker.any():
            owner = got.chunk[marker] - MARKER_CHUNK_BASE
            known = owner < len(self._marker_step)
            np.maximum.at(self._marker_step, owner[known], got.step[marker][known])
        lo, hi = copies.base, copies.base + len(copies.held)
        mine = ~marker & (got.step == gen) & (got.chunk >= lo) & (got.chunk < hi)
        if mine.any():
            arrived = got if mine.all() else got.rows(mine)
            rows = arrived.chunk - lo
            short = arrived.nelem < copies.rows.shape[1]
            if short.any():  # (every gather row is full; a short one keeps the rest of the row it holds)
                for r, i in zip(rows[short].tolist(), np.flatnonzero(short).tolist(), strict=True):
                    copies.rows[r, : arrived.nelem[i]] = arrived.values[i, : arrived.nelem[i]]
                rows, values = rows[~short], arrived.values[~short]
            else:
                values = arrived.values
            copies.rows[rows] = values
            copies.held[arrived.chunk - lo] = t
        # a faster rank's next gather: left for it (a late copy of an earlier gather is dropped)
        later = ~marker & (got.step > gen)
        if later.any():
            inbox.put_back(got.rows(later))
