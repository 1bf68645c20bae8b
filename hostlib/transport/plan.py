"""The buffers of one reduce: every unit (packet's worth) of a tensor of one length, reused each step.

A reduce of n values is ``exp_units`` exponent units (one per K chunks: each carries K per-chunk
exponent proposals, aggregated by max) followed by one data unit per chunk. Unit g of the job (counted
over every reduce since the worker started) uses slot ``g mod D`` in round ``2 (g div D) + 1`` (its redo,
round ``2 (g div D) + 2``: hostlib.protocol.unit_seq), where ``D = P - 1`` (slot P-1 is the health
probe's); every worker of a job derives the same numbering from the same sequence of tensor lengths.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hostlib.protocol import INT32_MIN, ROUNDS_PER_UNIT, Flag, Op, batch_rows, empty_batch

# Unit states, ordered: a unit at or past DONE is settled. ELSEWHERE: an owner-only unit another worker
# owns, settled once sent (its RESULT goes to the owner alone; docs/protocol.md, "Owner-only RESULT").
PENDING, IN_FLIGHT, DONE, GAVE_UP, ELSEWHERE = 0, 1, 2, 3, 4


def critical_chunks(spec: Any, n: int, k: int) -> np.ndarray:
    """The chunks of a reduce of ``n`` values (K = ``k`` per chunk) that are critical, as a bool mask.

    ``spec``: None (none), a bool array with one entry per chunk, or value ranges ``[(start, stop),
    ...]`` (a chunk is critical when it holds any value of a range; stop is exclusive)."""
    chunks = max(1, math.ceil(n / k))
    if spec is None:
        return np.zeros(chunks, dtype=bool)
    arr = np.asarray(spec)
    if arr.dtype == bool:
        if arr.shape != (chunks,):
            raise ValueError(f"a critical chunk mask needs {chunks} entries (one per chunk), got {arr.shape}")
        return arr.copy()
    ranges = arr.reshape(-1, 2).astype(np.int64) if arr.size else np.zeros((0, 2), np.int64)
    if ranges.size and (ranges.min() < 0 or ranges[:, 1].max() > n or np.any(ranges[:, 1] < ranges[:, 0])):
        raise ValueError(f"critical ranges must be (start, stop) with 0 <= start <= stop <= {n}")
    mask = np.zeros(chunks + 1, dtype=np.int64)
    ranges = ranges[ranges[:, 1] > ranges[:, 0]]
    np.add.at(mask, ranges[:, 0] // k, 1)
    np.add.at(mask, (ranges[:, 1] - 1) // k + 1, -1)
    return np.cumsum(mask[:chunks]) > 0


class ReducePlan:
    """Preallocated buffers for reduces of one length (reused every step)."""

    def __init__(self, n: int, k: int) -> None:
        self.n = n
        self.k = k
        self.chunks_count = max(1, math.ceil(n / k))
        c = self.chunks_count
        self.exp_units = math.ceil(c / k)
        self.units = self.exp_units + c
        self.chunks = np.zeros((c, k), dtype=np.float32)
        # This reduce's whole chunks where the caller holds them, quantized from there (not staged in
        # ``chunks``; ReduceEngine._begin), or None.
        self.direct: np.ndarray | None = None
        self.exp_batch = empty_batch(self.exp_units, k)
        self.data_batch = empty_batch(c, k)
        self.exp_rows = batch_rows(self.exp_batch)
        self.data_rows = batch_rows(self.data_batch)
        # What depends on the length alone, written once (nothing else writes these fields of the batches)
        for batch in (self.exp_batch, self.data_batch):
            batch["op"] = int(Op.GRAD)
        self.exp_batch["chunk"] = np.arange(self.exp_units)
        self.exp_batch["nelem"] = np.minimum(k, c - k * np.arange(self.exp_units))
        self.data_batch["chunk"] = np.arange(c)
        self.data_batch["nelem"] = np.minimum(k, n - k * np.arange(c))
        # The header fields and weight the batches hold now (reset rewrites only those that changed: a
        # strided write over every packet row costs ~10-50 us at K = 64 and 4 MiB)
        self._stamped: dict[str, int] = {}
        self.out = np.zeros((c, k), dtype=np.float32)  # dequantized as RESULTs arrive
        self.count = np.zeros(c, dtype=np.int64)
        self.bitmap = np.zeros(c, dtype=np.uint64)
        self.weight = np.zeros(c, dtype=np.int64)
        self.shift = np.zeros(c, dtype=np.int32)
        self.has_exp = np.zeros(c, dtype=bool)  # quantized, own exponent counted: will be sent
        self.exp_known = np.zeros(c, dtype=bool)  # the agreed exponent arrived
        self.nonfinite = np.zeros(c, dtype=bool)  # ... and says some counted worker's chunk was not finite
        self.own_exp = np.zeros(c, dtype=bool)  # ... and this worker's proposal was counted in it
        # ... and whose proposals it counted (bit w: worker w). A worker whose bit is missing withholds
        # the chunk: it never sends that GRAD (ReduceEngine._quantize_ahead), and every peer knows it.
        self.exp_bitmap = np.zeros(c, dtype=np.uint64)
        self.any_withheld = False  # some worker withholds some chunk of this reduce
        # Speculated exponents (docs/protocol.md, "Speculated exponents"): the chunks this worker sends at an
        # exponent it derived from the last reduce of the same key, before the exponent round's RESULT
        # (their shift, exp_known and own_exp set by ReduceEngine._speculate), and those whose values lie
        # outside that exponent's range: their first-round rows go flagged SATURATED, so the chunk is redone.
        self.spec = np.zeros(c, dtype=bool)
        self.spec_sat = np.zeros(c, dtype=bool)
        # The exponent round's result for every chunk, speculated or not: its exponent (INT32_MIN: none yet)
        # and whose proposals it counted (0: none yet).
        self.agreed_exp = np.full(c, INT32_MIN, dtype=np.int32)
        self.agreed_bits = np.zeros(c, dtype=np.uint64)
        # Chunks whose first round came back SATURATED, redone in their unit's second round at the agreed
        # exponent by the first round's contributors (ReduceEngine._redo); the first round's bitmap; and
        # those of them this worker still has to send once the agreed exponent is known.
        self.redo = np.zeros(c, dtype=bool)
        self.redo_bits = np.zeros(c, dtype=np.uint64)
        self.redo_waiting = np.zeros(c, dtype=bool)
        self.any_redo_waiting = False
        self.quantized = np.zeros(c, dtype=bool)
        # The caller's output, where each chunk's values go as its RESULT is settled (deliver_to), and the
        # chunks whose values went there that way.
        self.user_out: np.ndarray | None = None
        self.user_scale = 1.0
        self.delivered = np.zeros(c, dtype=bool)
        self.result_flags = np.zeros(c, dtype=np.int64)
        self.state = np.zeros(self.units, dtype=np.int8)
        self.sent_at = np.zeros(self.units, dtype=np.float64)
        self.flushes = np.zeros(self.units, dtype=np.int64)
        self.flushed_at = np.zeros(self.units, dtype=np.float64)  # when the last FLUSH went
        self.first_flush_at = np.zeros(self.units, dtype=np.float64)  # ... and the first (flushes > 0)
        # Behind every worker's frontier while still open (Deadlines.fast_flush): a packet of it was lost
        self.proven_lost = np.zeros(self.units, dtype=bool)
        # Every GRAD the round will get was provably sent, the rest withheld (Deadlines.flush_withheld)
        self.proven_in = np.zeros(self.units, dtype=bool)
        self.probes = np.zeros(self.units, dtype=np.int64)
        self.deadline_at = np.full(self.units, np.inf, dtype=np.float64)
        # Critical data (LTP): units resent until every worker is counted, never FLUSHed (deadlines.py).
        self.critical = np.zeros(c, dtype=bool)  # per chunk
        self.critical_unit = np.zeros(self.units, dtype=bool)  # an exponent unit: any of its chunks
        # Owner-only RESULTs: the worker each chunk's RESULT goes to (-1: every worker), and the chunks
        # another worker owns (this worker sends them and awaits nothing).
        self.owner = np.full(c, -1, dtype=np.int64)
        self.elsewhere = np.zeros(c, dtype=bool)
        self.any_owned = False
        self.any_critical = False
        self.retx = np.zeros(self.units, dtype=np.int64)  # GRAD resends of a critical unit
        # ... of which count toward critical_max_resends (not those made waiting for a late peer)
        self.retx_spent = np.zeros(self.units, dtype=np.int64)
        # Adaptive early close: when each unit's RESULT is expected (send time + queue + own frame at the
        # bottleneck rate, before the round trip; inf where no rate is known or early close is off), units
        # with every worker counted, and the close (see earlyclose.py).
        self.expect_at = np.full(self.units, np.inf, dtype=np.float64)
        self.full_units = 0
        self.closing = ""  # "", "theta" (LT passed and enough in) or "deadline" (LT + C passed)
        self.closed_early = 0  # units this worker FLUSHed because of the close
        self.lt_at = math.inf  # the loss-tolerant threshold and the close deadline, as perf_counter times
        self.hard_close_at = math.inf
        self.rx_batches: list[tuple[float, int]] = []  # (time, RESULT frames): pacing.RateLearner
        self.frame_s = 0.0  # a frame's time at the pacing rate (0: unpaced), set by the worker
        self.slots = np.zeros(self.units, dtype=np.int64)
        self.seqs = np.zeros(self.units, dtype=np.int64)
        self._cycle_d = 0  # the pool the tables below were built for (reset)
        self._cycle_mod = self._cycle_div = np.zeros(0, dtype=np.int64)
        self.base = 0  # global index of this reduce's first unit
        self.synced = False  # a RESULT of this reduce arrived: every worker is in it
        self.low = 0  # every unit below this index is done or given up
        self.next_unit = 0  # units below this were sent (or skipped: already settled)
        self.frontier = np.full(0, -1, dtype=np.int64)  # per worker: highest unit it is known to have sent
        # The newest unit whose RESULT showed this worker's own bit (-1: none yet): how far its peers
        # may send by the slot-reuse rules (reuse.py). frontier[own] is what it sent, shown or not.
        self.own_shown = -1
        self.fast_flushed_to = 0  # units below this were already checked against the frontier
        self.all_sent = False  # this worker sent every unit of the reduce

    def reset(
        self,
        base: int,
        pool_size: int,
        header: dict[str, int],
        weight: int,
        proposals: np.ndarray,
        n_workers: int,
        critical: np.ndarray | None = None,
        *,
        exponents_critical: bool = False,
        owners: np.ndarray | None = None,
        worker_id: int = 0,
        stamp_data: bool = True,
    ) -> None:
        """Start a reduce whose first unit is global unit ``base``; ``header`` holds the fields every
        packet of this worker carries (version, job_id, worker_id, step); ``critical``: the critical
        chunk mask (:func:`critical_chunks`), or None; ``exponents_critical``: every exponent unit is
        critical, whatever its chunks (exact mode: TransportConfig.exact); ``owners``: per chunk, the one
        worker its RESULT goes to (-1: every worker), or None; ``worker_id``: this worker;
        ``stamp_data=False``: the data rows' slot, seq and step are left to whoever quantizes them (the
        native engine writes them with each row's payload: ``hostlib._engine.quantize_ahead``'s ``stamp``),
        sparing a strided pass over every packet row per reduce."""
        self._number(base, pool_size, header, stamp_data)
        self._mark_critical(critical, exponents_critical, proposals)
        if self._stamped.get("weight") != weight:
            self.data_batch["weight"] = weight
            self._stamped["weight"] = weight
        if owners is not None or self.any_owned:  # (no owners now nor before: nothing to rewrite)
            self._set_owners(owners, worker_id)
        self._clear(n_workers)

    def _number(self, base: int, pool_size: int, header: dict[str, int], stamp_data: bool) -> None:
        """Unit i of this reduce is global unit ``base + i``: its slot and round, and the header fields
        that changed since the last reduce, written into the packet rows (:meth:`reset`)."""
        self.base = base
        # Unit i's slot and first round: (base + i) mod D and 2 ((base + i) div D) + 1 (unit_seq), read from
        # tables of j mod D and j div D over j < units + D (no division per unit; built once per pool). The
        # rounds are a fresh array: a unit redone moves to its second round (ReduceEngine._redo).
        if self._cycle_d != pool_size:
            j = np.arange(self.units + pool_size, dtype=np.int64)
            self._cycle_mod, self._cycle_div = j % pool_size, j // pool_size
            self._cycle_d = pool_size
        r = base % pool_size
        self.slots = self._cycle_mod[r : r + self.units]
        self.seqs = (self._cycle_div[r : r + self.units] + base // pool_size) * ROUNDS_PER_UNIT + 1
        changed = [(name, value) for name, value in header.items() if self._stamped.get(name) != value]
        for batch, sl, every in (
            (self.exp_batch, slice(0, self.exp_units), True),
            (self.data_batch, slice(self.exp_units, None), stamp_data),
        ):
            for name, value in changed:
                if every or name != "step":
                    batch[name] = value
            if every:
                batch["slot"] = self.slots[sl]
                batch["seq"] = self.seqs[sl]
        self._stamped.update(changed)

    def _mark_critical(
        self, critical: np.ndarray | None, exponents_critical: bool, proposals: np.ndarray
    ) -> None:
        """The critical chunks and units, and the exponent units' flags and proposals (:meth:`reset`)."""
        k = self.k
        if critical is None:
            self.critical[:] = False
        else:
            self.critical[:] = critical
        self.any_critical = bool(self.critical.any())
        self.critical_unit[self.exp_units :] = self.critical
        # An exponent unit is critical when any chunk it covers is: a proposal lost to a FLUSH could
        # leave a worker's values over the agreed exponent, and it would withhold that chunk. In exact
        # mode every one is (a lost one would block its data units, and no later unit could show it lost).
        padded_crit = np.zeros(self.exp_units * k, dtype=bool)
        padded_crit[: self.chunks_count] = self.critical
        covers_critical = padded_crit.reshape(self.exp_units, k).any(axis=1)
        self.critical_unit[: self.exp_units] = covers_critical | exponents_critical
        e = self.exp_batch
        exp_flags = int(Flag.MAX | Flag.CRITICAL), int(Flag.MAX)
        e["flags"] = np.where(self.critical_unit[: self.exp_units], *exp_flags)
        e["exp"] = 0
        padded = np.full(self.exp_units * k, INT32_MIN, dtype=np.int64)
        padded[: self.chunks_count] = proposals
        e["payload"] = padded.reshape(self.exp_units, k)

    def _set_owners(self, owners: np.ndarray | None, worker_id: int) -> None:
        """Each chunk's owner (-1: every worker) and the chunks another worker owns (:meth:`reset`)."""
        if owners is None:
            self.owner[:] = -1
        else:
            self.owner[:] = owners
        self.any_owned = bool((self.owner >= 0).any())
        self.elsewhere[:] = (self.owner >= 0) & (self.owner != worker_id)
        self.data_batch["count"] = np.maximum(self.owner, 0)  # a worker's GRAD names the owner in count

    def _clear(self, n_workers: int) -> None:
        """Every per-reduce state back to its start: nothing sent, settled or learned (:meth:`reset`)."""
        for arr in (self.count, self.bitmap, self.weight, self.shift, self.result_flags, self.flushes):
            arr[:] = 0
        self.probes[:] = 0
        self.retx[:] = 0
        self.retx_spent[:] = 0
        self.proven_lost[:] = False
        self.proven_in[:] = False
        self.deadline_at[:] = np.inf
        self.expect_at[:] = np.inf
        self.full_units = 0
        self.closing = ""
        self.closed_early = 0
        self.lt_at = self.hard_close_at = math.inf
        self.rx_batches = []
        for flags in (self.has_exp, self.exp_known, self.nonfinite, self.own_exp, self.quantized):
            flags[:] = False
        self.delivered[:] = False
        self.exp_bitmap[:] = 0
        self.any_withheld = False
        for flags in (self.spec, self.spec_sat, self.redo, self.redo_waiting):
            flags[:] = False
        self.agreed_exp[:] = INT32_MIN
        self.agreed_bits[:] = 0
        self.redo_bits[:] = 0
        self.any_redo_waiting = False
        self.state[:] = PENDING
        self.synced = False
        self.low = 0
        self.next_unit = 0
        self.frontier = np.full(n_workers, -1, dtype=np.int64)
        self.own_shown = -1
        self.fast_flushed_to = 0
        self.all_sent = False

    def restamp(self, name: str) -> None:
        """Header field ``name`` of some data rows was written outside :meth:`reset` (a redo's weight:
        ReduceEngine._redo_send): the next reset writes it into every row again."""
        self._stamped.pop(name, None)

    def deliver_to(self, out: np.ndarray | None, scale: float = 1.0) -> None:
        """Settling a data chunk with values (a RESULT of count > 0) also writes them, times ``scale``, to
        the flat float32 ``out`` (its first ``out.size`` values are the reduce's), once the chunk has been
        quantized, and marks it ``delivered``: from then on its input is never read again, so ``out`` may be
        the input itself. ReduceEngine._finish writes the rest. None: nothing is written while settling.
        Called after :meth:`reset`."""
        self.user_out, self.user_scale = out, scale

    @property
    def withheld(self) -> np.ndarray:
        """Chunks this worker quantized but did not send: its exponent proposal was not counted in the
        agreed exponent (see ReduceEngine._quantize_ahead)."""
        return self.quantized & ~self.own_exp

    def withheld_by(self, units: np.ndarray, bits: np.ndarray) -> np.ndarray:
        """Whether worker ``w`` (bit ``bits[w]``) withholds unit ``u``, for every pair (``len(units)`` x
        ``len(bits)``): a data unit whose agreed exponent arrived without that worker's proposal. Such a
        GRAD never comes (ReduceEngine._quantize_ahead), whatever the wait."""
        data = units >= self.exp_units
        c = np.where(data, units - self.exp_units, 0)
        missing = ((self.exp_bitmap[c][:, None] >> bits[None, :]) & np.uint64(1)) == 0
        return missing & (data & self.exp_known[c])[:, None]

    def advance_low(self) -> None:
        """Move ``low`` past the settled prefix."""
        pending = np.flatnonzero(self.state[self.low : max(self.low, self.next_unit)] < DONE)
        self.low = self.low + int(pending[0]) if pending.size else max(self.low, self.next_unit)

    def unsettled(self) -> bool:
        """Whether any unit is still pending or in flight. Past :meth:`advance_low`, one below
        ``next_unit`` is (``low`` stops at it); otherwise only the units not sent yet need a look (a
        peer's FLUSH may have settled some of them already)."""
        if self.low < self.next_unit:
            return True
        return bool(np.any(self.state[self.low :] < DONE))

    def owner_of_unit(self, units: np.ndarray) -> np.ndarray:
        """The owner of each unit's RESULT (-1: every worker; exponent units are every worker's)."""
        data = units >= self.exp_units
        return np.where(data, self.owner[np.where(data, units - self.exp_units, 0)], -1)

    def in_flight(self) -> np.ndarray:
        """Indices of the units in flight (they all lie in [low, next_unit))."""
        return np.flatnonzero(self.state[self.low : self.next_unit] == IN_FLIGHT) + self.low
