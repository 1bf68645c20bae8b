"""The batched data plane behind :meth:`SoftSwitch.process_batch`: whole batches of packets, vectorized.

The outcome is exactly that of running the packets one by one through the per-packet reference
(:meth:`SoftSwitch.process`): the same packets out, in the same order, byte for byte, the same counters,
slot registers and drop decisions. How:

* Every header is parsed at once (a structured view over the first 36 bytes of each row) and the checks of
  the contract (malformed, unknown job, length, worker, slot range) are array comparisons. Workers are
  matched by port key (:func:`port_key`), precomputed per job.
* The ``up`` drop decisions depend on nothing but those checks, so each worker's stream is drawn once for
  the batch, in arrival order (:meth:`DropStream.drop_many` gives exactly the per-packet decisions).
* PARAM / PARAM_REQ touch no slot; they are replicated one by one (they are rare).
* GRAD and FLUSH are grouped by slot. A slot whose packets in the batch are a plain round (GRADs of one
  round from distinct workers that start it or join it, closing at the last one if at all: the steady
  state) is applied in one pass from reductions over its GRADs (:meth:`BatchEngine._simple_groups`).
  The other slots run in *waves*: wave j holds the j-th packet of each slot, so within a wave a slot
  appears at most once and its registers are gathered, updated and scattered back with fancy indexing.
  A new round (GRAD start, FLUSH empty) first resets the slot from the packet's header, then a GRAD start
  is summed like an add; a RESULT is snapshot from the slot right after its wave. Waves of a few packets
  (a slot hit many times) step packet by packet (:class:`_Stepper`), where numpy's per-call cost would
  dominate.
* Emitted RESULTs are ordered by arrival, expanded into replicas, pass the ``down`` policy per receiver in
  that order, and are written as rows into reused output buffers; with big rows (jumbo K) the replicas of
  a RESULT share its row (:attr:`OutBatch.index`), so no payload is copied per receiver.
* A batch of fewer than a few dozen packets (``_VECTOR_MIN_PACKETS``) skips all of the above and runs the
  packets through the per-packet reference one by one: the vectorized pass costs a few hundred numpy
  calls whatever the batch size, more than the reference spends on a handful of packets. The outcome is
  the reference's by construction; the differential tests force the vectorized pass at every size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from hostlib.batchio import addr_key, key_addr
from hostlib.protocol import COUNTERS, HEADER_BYTES, HEADER_DTYPE, MAX_JOBS, VERSION, Flag, Op

if TYPE_CHECKING:
    from softswitch.pipeline import SoftSwitch, _Job

log = logging.getLogger(__name__)

# A key no packet can come from: workers whose address has no key (a host name) never match, as in the
# per-packet path, where a name never equals the numeric address a datagram comes from.
NO_KEY = int(np.iinfo(np.int64).min)

# Slot registers (the registers the P4 program keeps), one int64 column each in ``_Slots.regs`` (P, R), so
# a set of slots is gathered and scattered with all its registers in one operation; the bitmap is a uint64
# array of its own and the accumulator a (P, K) int32 array.
SLOT_REGISTERS = ("seq", "closed", "count", "weight", "exp", "flags", "nelem", "step", "chunk", "closer")
_SEQ, _CLOSED, _COUNT, _WEIGHT, _EXP, _FLAGS, _NELEM, _STEP, _CHUNK, _CLOSER = range(len(SLOT_REGISTERS))

_C = {name: i for i, name in enumerate(COUNTERS)}
_NC = len(COUNTERS)
_RETX, _SATURATED, _CRITICAL, _MAX = int(Flag.RETX), int(Flag.SATURATED), int(Flag.CRITICAL), int(Flag.MAX)
_GRAD, _RESULT, _FLUSH, _PARAM, _PARAM_REQ, _HEARTBEAT = (
    int(o) for o in (Op.GRAD, Op.RESULT, Op.FLUSH, Op.PARAM, Op.PARAM_REQ, Op.HEARTBEAT)
)
# op -> True when a switch accepts it from a worker (every op of the contract but RESULT).
_ACCEPTED_OP = np.zeros(256, dtype=bool)
_ACCEPTED_OP[[int(o) for o in Op if o != Op.RESULT]] = True
_U32 = 0xFFFFFFFF
_ROUND = _MAX | _SATURATED
_INT32_PAYLOAD = np.dtype(">i4")
# Event kinds of an emission: a RESULT to every worker, a RESULT resent to one, a PARAM replicated.
_MULTICAST, _UNICAST, _PARAM_KIND = 0, 1, 2
# Waves with fewer packets than this run packet by packet (a slot hit many times in one batch).
_SMALL_WAVE = 8
# Rows of at least this many bytes (K >= 1024: MTU 9000 and loopback's 64 KiB datagrams) are moved one
# numpy call per row, on views: numpy's per-call cost (~1-2 us) is small next to the row, and gathers,
# temporaries and byte-swapped copies of whole batches are what cost. Below it, whole-batch operations.
# (64 KiB rows, 2-core VM: np.take of rows 11 us per row, a row-view copy 1.7 us; add of two big-endian
# rows into a native one 8 us, against 2 x 5 us to byte-swap them first plus 3.5 us to add.)
_ROW_LOOP_BYTES = 4096
# Fewer packets than this go one by one through the per-packet reference: the vectorized pass costs a
# few hundred numpy calls whatever the batch size. Measured crossovers (µs per GRAD, one by one vs
# vectorized): K=64 at 16 packets 8.1 vs 13.8, at 32 7.3 vs 7.5, at 64 7.1 vs 3.9; K=16367 at 16
# packets 28 vs 42, at 64 38 vs 33, at 256 33 vs 37 (memory-bound either way).
_VECTOR_MIN_PACKETS = 32
_VECTOR_MIN_PACKETS_BIG_ROWS = 64
_NO_PORT = object()  # the ingress of a packet from no worker's port


def port_key(port: Any) -> int:
    """The int64 key of a port: an int port is itself; a ``(host, udp_port)`` address is
    :func:`hostlib.batchio.addr_key`'s key, the form the UDP server reports sources in. Raises ValueError
    for anything else: a host name, or another spelling of an address ("127.1"), which never equals the
    address a datagram comes from, so the per-packet path never matches it either."""
    if isinstance(port, (int, np.integer)) and not isinstance(port, bool):
        return int(port)
    if isinstance(port, tuple) and len(port) >= 2:
        try:
            return addr_key((port[0], port[1]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"no port key for {port!r}: {exc}") from None
    raise ValueError(f"no port key for {port!r}: use an int port or a (host, udp_port) address")


key_address = key_addr  # the (host, udp_port) of an address key


def worker_keys(workers: Iterable[Any]) -> np.ndarray:
    """Port keys of a job's workers (int64); :data:`NO_KEY` for a worker whose port has none."""
    keys = []
    for port in workers:
        try:
            keys.append(port_key(port))
        except ValueError as exc:
            log.warning("%s: process_batch never matches this worker and cannot address it", exc)
            keys.append(NO_KEY)
    return np.array(keys, dtype=np.int64)


class OutBatch:
    """``m`` packets to send: packet i is the first ``lens[i]`` bytes of row ``index[i]`` of ``data`` (row i
    when ``index`` is None), for port key ``egress[i]``. With big rows the replicas of one RESULT share
    its row (``index`` repeats it): no copy per receiver. The arrays are views of buffers the next
    :meth:`SoftSwitch.process_batch` call reuses."""

    __slots__ = ("data", "lens", "egress", "m", "index")

    def __init__(
        self,
        data: np.ndarray,
        lens: np.ndarray,
        egress: np.ndarray,
        m: int,
        index: np.ndarray | None = None,
    ) -> None:
        self.data, self.lens, self.egress, self.m, self.index = data, lens, egress, m, index

    def __len__(self) -> int:
        return self.m

    def row(self, i: int) -> np.ndarray:
        """Packet i's bytes (a view)."""
        r = i if self.index is None else int(self.index[i])
        return self.data[r, : self.lens[i]]

    def packets(self) -> list[tuple[int, bytes]]:
        """The packets as (egress key, bytes) pairs (for tests and tools; copies)."""
        return [(int(k), self.row(i).tobytes()) for i, k in enumerate(self.egress[: self.m])]


class _Emissions:
    """Events that emit packets, gathered over a batch: one entry per packet that emits anything."""

    def __init__(self) -> None:
        self.idx: list[np.ndarray] = []  # arrival index
        self.job: list[np.ndarray] = []
        self.kind: list[np.ndarray] = []  # _MULTICAST / _UNICAST / _PARAM_KIND
        self.worker: list[np.ndarray] = []  # the unicast receiver
        self.nrep: list[np.ndarray] = []  # replicas before the down policy
        self.rows: list[np.ndarray] = []  # (e, stride) packet bytes
        self.lens: list[np.ndarray] = []
        self.receivers: dict[int, list[int]] = {}  # PARAM events: arrival index -> receivers kept
        self.result_jobs: list[int] = []  # jobs that emitted RESULTs


class BatchEngine:
    """Vectorized pipeline state: per-job lookup tables and the reused output buffers."""

    def __init__(self) -> None:
        self._jobs: Mapping[int, _Job] = {}
        self._job_row = np.zeros(1 << 16, dtype=np.intp)  # job_id -> counter row (0: no such job)
        self._elems = np.zeros(MAX_JOBS, dtype=np.int64)
        self._pool = np.zeros(MAX_JOBS, dtype=np.int64)
        self._keys = np.full((MAX_JOBS, 256), NO_KEY, dtype=np.int64)  # [job, worker_id] -> port key
        self._stride = HEADER_BYTES
        self._spared = _CRITICAL  # flags the drop policies let pass (SoftSwitch.spare_critical)
        self._out_data = np.zeros((0, HEADER_BYTES), dtype=np.uint8)
        self._out_lens = np.zeros(0, dtype=np.int64)
        self._out_egress = np.zeros(0, dtype=np.int64)
        self._out_index = np.zeros(0, dtype=np.int64)
        # The workers' ports by key and back, for batches run one packet at a time (_one_by_one).
        self._port_of: dict[int, Any] = {}
        self._key_of: dict[Any, int] = {}
        # Batches below this many packets run through the per-packet reference instead (see run), by
        # the widest job's rows (set_jobs).
        self._vector_min = _VECTOR_MIN_PACKETS

    def set_jobs(self, jobs: Mapping[int, _Job]) -> None:
        """Rebuild the lookup tables after a job was added or removed."""
        self._jobs = jobs
        self._job_row[:] = 0
        self._port_of, self._key_of = {}, {}
        self._elems[:] = 0
        self._pool[:] = 0
        self._keys[:] = NO_KEY
        for job_id, job in jobs.items():
            cfg = job.cfg
            self._job_row[job_id] = job_id
            self._elems[job_id] = cfg.elems_per_packet
            self._pool[job_id] = cfg.pool_size
            self._keys[job_id, : cfg.n_workers] = job.worker_keys
            for port, key in zip(cfg.workers, job.worker_keys.tolist(), strict=True):
                if key != NO_KEY:
                    self._port_of[key], self._key_of[port] = port, key
            self._stride = max(self._stride, HEADER_BYTES + 4 * cfg.elems_per_packet)
        big = self._stride - HEADER_BYTES >= _ROW_LOOP_BYTES
        self._vector_min = _VECTOR_MIN_PACKETS_BIG_ROWS if big else _VECTOR_MIN_PACKETS

    # ---- the batch ------------------------------------------------------------------------------
    def run(
        self, sw: SoftSwitch, data: np.ndarray, lens: np.ndarray, ingress: np.ndarray, n: int | None
    ) -> OutBatch:
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.ndim != 2:
            raise ValueError(f"data must be a (cap, stride) uint8 array, got {data.dtype} {data.shape}")
        n = len(lens) if n is None else int(n)
        if n > len(data) or n > len(lens) or n > len(ingress):
            raise ValueError(
                f"n={n} exceeds the batch (data {len(data)}, lens {len(lens)}, ingress {len(ingress)})"
            )
        if n == 0:
            return self._output(0)
        self._spared = _CRITICAL if sw.spare_critical else 0
        if data.shape[1] < HEADER_BYTES:  # every row is short; pad so the header view exists
            padded = np.zeros((n, HEADER_BYTES), dtype=np.uint8)
            padded[:, : data.shape[1]] = data[:n]
            data = padded
        elif data.strides[1] != 1:
            data = np.ascontiguousarray(data[:n])
        length = np.minimum(np.asarray(lens[:n], dtype=np.int64), data.shape[1])
        port = np.asarray(ingress[:n], dtype=np.int64)
        if n < self._vector_min:
            return self._one_by_one(sw, data, length, port, n)
        hdr = data[:n, :HEADER_BYTES].view(HEADER_DTYPE)[:, 0]
        cnt = np.zeros((MAX_JOBS, _NC), dtype=np.int64)

        # Checks 1-5 of the contract, in order; each row fails at most one.
        short = length < HEADER_BYTES
        op = hdr["op"].astype(np.intp)
        row = self._job_row[hdr["job_id"]]
        row[short] = 0
        _tally(cnt, row, "rx_packets")
        bad = ~short & ((hdr["version"] != VERSION) | ~_ACCEPTED_OP[op])
        bad |= short
        _tally(cnt, row[bad], "drop_malformed")
        ok = ~bad
        unknown = ok & (row == 0)
        cnt[0, _C["drop_unknown_job"]] += np.count_nonzero(unknown)
        ok &= ~unknown
        elems = self._elems[row]
        bad = ok & ((length - HEADER_BYTES != 4 * elems) | (hdr["nelem"] > elems))
        _tally(cnt, row[bad], "drop_malformed")
        ok &= ~bad
        worker = hdr["worker_id"].astype(np.intp)
        bad = ok & (self._keys[row, worker] != port)
        _tally(cnt, row[bad], "drop_bad_worker")
        ok &= ~bad
        verified = np.flatnonzero(ok)
        if len(verified):  # WORKER_COUNTER, before any drop policy
            np.add.at(sw._worker_rx, (row[verified], worker[verified]), 1)
        heartbeat = ok & (op == _HEARTBEAT)
        _tally(cnt, row[heartbeat], "heartbeat")
        ok &= ~heartbeat
        param = ok & ((op == _PARAM) | (op == _PARAM_REQ))
        ok &= ~param
        slot = hdr["slot"].astype(np.intp)
        bad = ok & (slot >= self._pool[row])
        _tally(cnt, row[bad], "drop_slot_range")
        ok &= ~bad  # GRAD and FLUSH that reach the slots (before the up policy)

        jobs_hit = np.flatnonzero(np.bincount(row[ok], minlength=MAX_JOBS))
        for job_id in jobs_hit:
            job = self._jobs[int(job_id)]
            if job.has_policy("up"):
                self._up_policy(job, ok, row, op, worker, hdr, cnt)

        em = _Emissions()
        params = np.flatnonzero(param)
        if len(params):
            self._params(params, row, op, worker, hdr, data, length, cnt, em)
        for job_id in jobs_hit:
            job = self._jobs[int(job_id)]
            events = np.flatnonzero(ok) if len(jobs_hit) == 1 else np.flatnonzero(ok & (row == job_id))
            if len(events):
                self._slot_events(job, events, hdr, op, slot, data, n, cnt, em)
        m, shared = self._emit(em, cnt)
        for j, c in zip(*np.nonzero(cnt), strict=True):
            sw._counters[j][c] += int(cnt[j, c])
        return self._output(m, shared)

    def _up_policy(
        self,
        job: _Job,
        ok: np.ndarray,
        row: np.ndarray,
        op: np.ndarray,
        worker: np.ndarray,
        hdr: np.ndarray,
        cnt: np.ndarray,
    ) -> None:
        """Draw the up policy for every GRAD of ``job`` that passed the checks, per worker in arrival
        order; clear ``ok`` for the dropped ones."""
        job_id = job.cfg.job_id
        exposed = ok & (row == job_id) & (op == _GRAD) & ((hdr["flags"] & self._spared) == 0)
        for w in range(job.cfg.n_workers):
            sel = np.flatnonzero(exposed & (worker == w))
            if not len(sel):
                continue
            stream = job.stream("up", w)
            if stream is None:
                continue
            dropped = sel[stream.drop_many(len(sel))]
            ok[dropped] = False
            cnt[job_id, _C["drop_policy_up"]] += len(dropped)

    def _params(
        self,
        params: np.ndarray,
        row: np.ndarray,
        op: np.ndarray,
        worker: np.ndarray,
        hdr: np.ndarray,
        data: np.ndarray,
        length: np.ndarray,
        cnt: np.ndarray,
        em: _Emissions,
    ) -> None:
        """PARAM / PARAM_REQ, one by one in arrival order: replicate to the other workers, each replica
        passing its receiver's param policy (unless CRITICAL)."""
        kinds, jobs, nreps = [], [], []
        for i in params.tolist():
            job_id = int(row[i])
            job, w = self._jobs[job_id], int(worker[i])
            cnt[job_id, _C["param_fwd" if op[i] == _PARAM else "param_req_fwd"]] += 1
            exposed = not int(hdr["flags"][i]) & self._spared
            kept = []
            for r in range(job.cfg.n_workers):
                if r == w:
                    continue
                if exposed and job.drops("param", r, w):
                    cnt[job_id, _C["drop_policy_param"]] += 1
                    continue
                kept.append(r)
            em.receivers[i] = kept
            kinds.append(_PARAM_KIND)
            jobs.append(job_id)
            nreps.append(len(kept))
        rows = np.zeros((len(params), self._stride), dtype=np.uint8)
        width = min(data.shape[1], self._stride)
        rows[:, :width] = data[params, :width]
        em.idx.append(params.astype(np.int64))
        em.job.append(np.array(jobs, dtype=np.int64))
        em.kind.append(np.array(kinds, dtype=np.int8))
        em.worker.append(worker[params].astype(np.int64))
        em.nrep.append(np.array(nreps, dtype=np.int64))
        em.rows.append(rows)
        em.lens.append(length[params])

    def _slot_events(
        self,
        job: _Job,
        events: np.ndarray,
        hdr: np.ndarray,
        op: np.ndarray,
        slot: np.ndarray,
        data: np.ndarray,
        n: int,
        cnt: np.ndarray,
        em: _Emissions,
    ) -> None:
        """GRAD and FLUSH of one job (``events``: arrival indices, ascending) against its slots: the plain
        rounds in one pass (:meth:`_simple_groups`), the rest in waves; then the RESULT rows."""
        cfg = job.cfg
        job_id, k, quorum = cfg.job_id, cfg.elems_per_packet, cfg.quorum
        regs, bitmaps, acc = job.slots.regs, job.slots.bitmap, job.slots.acc
        m = len(events)
        every = m == n  # the usual batch: every packet reaches the slots, no gathers needed

        def field(name: str) -> np.ndarray:
            column = hdr[name]
            return (column if every else column[events]).astype(np.int64)

        ev_slot = slot if every else slot[events]
        ev_seq = field("seq")
        ev_flags = field("flags")
        ev_exp = field("exp")
        ev_worker = field("worker_id")
        ev_weight = field("weight")
        ev_grad = (op if every else op[events]) == _GRAD
        ev_bit = np.left_shift(np.uint64(1), ev_worker.astype(np.uint64))
        ev_sat = ev_flags & _SATURATED
        # What a new round (GRAD start, FLUSH empty) writes into its slot before the add / the close.
        # The closer register is not part of it (the round's close sets it).
        fresh = np.zeros((m, len(SLOT_REGISTERS)), dtype=np.int64)
        fresh[:, _SEQ] = ev_seq
        fresh[:, _EXP] = ev_exp
        fresh[:, _FLAGS] = ev_flags & _MAX
        fresh[:, _NELEM] = field("nelem")
        fresh[:, _STEP] = field("step")
        fresh[:, _CHUNK] = field("chunk")
        body = slice(HEADER_BYTES, HEADER_BYTES + 4 * k)
        payload = (data[:n, body] if every else data[events, body]).view(_INT32_PAYLOAD)
        if 4 * k < _ROW_LOOP_BYTES:
            payload = payload.astype(np.int32)  # small rows: one byte swap for the batch, then native math
        # Big rows stay big-endian views of the receive buffer: the plain rounds add them straight into
        # the slots (_add_rows), and numpy casts them on the fly elsewhere (waves, steps: rare).
        all_grad = np.count_nonzero(ev_grad) == m

        emitted: list[tuple[np.ndarray, ...]] = []
        tally = np.zeros(_NC, dtype=np.int64)
        order, first = _group_by_slot(ev_slot)
        rest = self._simple_groups(
            job, order, first, ev_slot, ev_seq, ev_flags, ev_exp, ev_worker, ev_weight, ev_bit, ev_sat,
            None if all_grad else ev_grad, fresh, payload, tally, emitted,
        )  # fmt: skip
        waves = _waves(rest, first) if rest is order else _waves(*_group_by_slot(ev_slot[rest]), rest)
        one_by_one = None
        for li in waves:
            if len(li) < _SMALL_WAVE:  # numpy's per-call cost outweighs the work: step packet by packet
                if one_by_one is None:
                    one_by_one = _Stepper(
                        job, ev_slot, ev_seq, ev_flags, ev_exp, ev_worker, ev_weight, ev_grad, fresh, payload
                    )
                for i in li.tolist():
                    one_by_one.step(i, tally, emitted)
                continue
            s = ev_slot[li]
            st = regs[s]
            bm = bitmaps[s]
            q = ev_seq[li]
            seq = st[:, _SEQ]
            closed = st[:, _CLOSED] != 0
            newer = q > seq
            same = q == seq
            older = ~newer & ~same
            open_same = same & ~closed
            closed_same = same & closed
            if all_grad:
                flush = empty = None
                g_open = open_same
                start, stale, late = newer, older, closed_same
            else:
                grad = ev_grad[li]
                flush = ~grad
                g_open = open_same & grad
                start, stale, late = newer & grad, older & grad, closed_same & grad
            has = (bm & ev_bit[li]) != 0
            dup = g_open & has
            g_open &= ~has
            mismatch = g_open & ((ev_exp[li] != st[:, _EXP]) | (((ev_flags[li] ^ st[:, _FLAGS]) & _MAX) != 0))
            add = g_open & ~mismatch
            n_start, n_add = np.count_nonzero(start), np.count_nonzero(add)
            tally[_C["grad_start"]] += n_start
            tally[_C["grad_add"]] += n_add
            tally[_C["grad_dup"]] += np.count_nonzero(dup)
            tally[_C["grad_late_resend"]] += np.count_nonzero(late)
            tally[_C["grad_stale"]] += np.count_nonzero(stale)
            tally[_C["grad_exp_mismatch"]] += np.count_nonzero(mismatch)
            if flush is None:
                close = None
                resend = late
            else:
                empty = newer & flush
                partial = open_same & flush
                close = partial | empty
                flush_resend = closed_same & flush
                resend = late | flush_resend
                tally[_C["flush_empty"]] += np.count_nonzero(empty)
                tally[_C["flush_partial"]] += np.count_nonzero(partial)
                tally[_C["flush_resend"]] += np.count_nonzero(flush_resend)
                tally[_C["flush_stale"]] += np.count_nonzero(older & flush)

            if np.count_nonzero(newer):  # new rounds: reset the slot from the packet's header
                reset = fresh[li[newer]]
                reset[:, _CLOSER] = st[newer, _CLOSER]
                st[newer] = reset
                bm[newer] = 0
            if n_start + n_add:
                summed = start | add
                st[:, _COUNT] += summed
                bm |= ev_bit[li] * summed
                weight = st[:, _WEIGHT]
                weight += ev_weight[li] * summed
                weight &= _U32
                st[:, _FLAGS] |= ev_sat[li] * summed
                s_sum, p_sum = s[summed], payload[li[summed]]
                cur = acc[s_sum]
                new = cur + p_sum  # int32 wrap-around, as the switch's registers do
                is_max = (st[summed, _FLAGS] & _MAX) != 0
                if np.count_nonzero(is_max):
                    new[is_max] = np.maximum(cur[is_max], p_sum[is_max])
                if n_start:
                    opening = start[summed]
                    new[opening] = p_sum[opening]
                acc[s_sum] = new
                full = summed & (st[:, _COUNT] >= quorum)
                tally[_C["result_quorum"]] += np.count_nonzero(full)
                close = full if close is None else close | full
            if empty is not None and np.count_nonzero(empty):
                acc[s[empty]] = 0
            if close is not None and np.count_nonzero(close):
                st[:, _CLOSED] |= close
                st[:, _CLOSER] = np.where(close, ev_worker[li], st[:, _CLOSER])
                out = close | resend
            else:
                out = resend
            regs[s] = st
            bitmaps[s] = bm
            if np.count_nonzero(out):
                emitted.append((li[out], resend[out], st[out], bm[out], acc[s[out]]))

        cnt[job_id] += tally
        if not emitted:
            return
        if len(emitted) == 1:  # one part (the usual batch): no concatenation copies
            li, unicast, snap, snap_bitmap, snap_acc = emitted[0]
        else:
            li, unicast, snap, snap_bitmap, snap_acc = (
                np.concatenate(parts) for parts in zip(*emitted, strict=True)
            )
        e = len(li)
        head = np.zeros(e, dtype=HEADER_DTYPE)
        head["version"] = VERSION
        head["op"] = _RESULT
        head["flags"] = snap[:, _FLAGS] | (unicast * _RETX)
        head["exp"] = snap[:, _EXP]
        head["job_id"] = job_id
        head["worker_id"] = snap[:, _CLOSER]
        head["count"] = snap[:, _COUNT]
        head["slot"] = ev_slot[li]
        head["nelem"] = snap[:, _NELEM]
        head["seq"] = snap[:, _SEQ]
        head["step"] = snap[:, _STEP]
        head["chunk"] = snap[:, _CHUNK]
        head["weight"] = snap[:, _WEIGHT]
        head["bitmap"] = snap_bitmap
        rows = np.empty((e, self._stride), dtype=np.uint8)
        rows[:, :HEADER_BYTES] = head.view(np.uint8).reshape(e, HEADER_BYTES)
        width = HEADER_BYTES + 4 * k
        rows[:, HEADER_BYTES:width].view(_INT32_PAYLOAD)[...] = snap_acc  # byte-swapped once, in place
        rows[:, width:] = 0
        em.result_jobs.append(job_id)
        em.idx.append(events[li].astype(np.int64))
        em.job.append(np.full(e, job_id, dtype=np.int64))
        em.kind.append(np.where(unicast, _UNICAST, _MULTICAST).astype(np.int8))
        em.worker.append(ev_worker[li])
        em.nrep.append(np.where(unicast, 1, cfg.n_workers).astype(np.int64))
        em.rows.append(rows)
        em.lens.append(np.full(e, width, dtype=np.int64))

    def _simple_groups(
        self,
        job: _Job,
        order: np.ndarray,
        first: np.ndarray,
        ev_slot: np.ndarray,
        ev_seq: np.ndarray,
        ev_flags: np.ndarray,
        ev_exp: np.ndarray,
        ev_worker: np.ndarray,
        ev_weight: np.ndarray,
        ev_bit: np.ndarray,
        ev_sat: np.ndarray,
        ev_grad: np.ndarray | None,
        fresh: np.ndarray,
        payload: np.ndarray,
        tally: np.ndarray,
        emitted: list[tuple[np.ndarray, ...]],
    ) -> np.ndarray:
        """The steady state in one pass: a slot whose packets in this batch are GRADs all for one round, from
        distinct workers, with one exponent and MAX flag, that either start the round or add to it while
        it is open with the same exponent, MAX flag and none of their workers, and that reach the quorum
        at the last one if at all, is a start followed by adds: its registers follow from reductions
        over its GRADs. Applies those slots; returns the other events (sorted by slot) for the waves."""
        cfg = job.cfg
        regs, bitmaps, acc = job.slots.regs, job.slots.bitmap, job.slots.acc
        starts = np.flatnonzero(first)
        size = np.empty_like(starts)
        size[:-1] = starts[1:] - starts[:-1]
        size[-1] = len(order) - starts[-1]
        group = np.cumsum(first) - 1  # group of each sorted event
        lead = order[starts]  # each group's first event
        seq, exp, is_max = ev_seq[order], ev_exp[order], ev_flags[order] & _MAX
        mixed = (seq != seq[starts][group]) | (exp != exp[starts][group]) | (is_max != is_max[starts][group])
        if ev_grad is not None:  # FLUSHes (``None``: GRADs only)
            mixed |= ~ev_grad[order]
        bits = np.bitwise_or.reduceat(ev_bit[order], starts)
        slots = ev_slot[lead]
        st, bm = regs[slots], bitmaps[slots]
        q = ev_seq[lead]
        newer = q > st[:, _SEQ]
        joins = (
            (q == st[:, _SEQ])
            & (st[:, _CLOSED] == 0)
            & (ev_exp[lead] == st[:, _EXP])
            & ((ev_flags[lead] & _MAX) == (st[:, _FLAGS] & _MAX))
            & ((bits & bm) == 0)
        )
        before = np.where(newer, 0, st[:, _COUNT])
        simple = (
            (newer | joins)
            & ~np.logical_or.reduceat(mixed, starts)
            & (_popcount(bits) == size)  # distinct workers
            & (before + size - 1 < cfg.quorum)  # no close before the last GRAD
        )
        n_simple = np.count_nonzero(simple)
        if n_simple == 0:
            return order
        if n_simple < len(starts):
            in_simple = simple[group]
            rest = order[~in_simple]
            members = order[in_simple]
            starts, size, lead, slots, bits = (
                starts[simple],
                size[simple],
                lead[simple],
                slots[simple],
                bits[simple],
            )
            st, bm, newer = st[simple], bm[simple], newer[simple]
            starts = np.cumsum(size) - size
        else:
            rest = order[:0]
            members = order
        last = members[starts + size - 1]

        # The accumulators: (old or nothing) + sum, or max, of the group's payloads.
        max_round = (ev_flags[lead] & _MAX) != 0
        if 4 * cfg.elems_per_packet >= _ROW_LOOP_BYTES:
            _add_rows(acc, payload, members, starts, size, slots, newer, max_round)
            new = None
        else:
            pay = payload[members]
            cur = acc[slots]
            n_max = np.count_nonzero(max_round)
            if n_max < len(starts):
                new = _segment_reduce(np.add, pay, starts, size)  # int32 wrap-around
                np.add(cur, new, out=new, where=~newer[:, None])
            else:
                new = np.empty_like(cur)
            if n_max:
                top = _segment_reduce(np.maximum, pay, starts[max_round], size[max_round])
                np.maximum(cur[max_round], top, out=top, where=~newer[max_round, None])
                new[max_round] = top
            acc[slots] = new

        n_new = np.count_nonzero(newer)
        if n_new:
            reset = fresh[lead[newer]]
            reset[:, _CLOSER] = st[newer, _CLOSER]
            st[newer] = reset
            bm[newer] = 0
        st[:, _COUNT] += size
        bm |= bits
        weight = st[:, _WEIGHT]
        weight += np.add.reduceat(ev_weight[members], starts)
        weight &= _U32
        st[:, _FLAGS] |= np.bitwise_or.reduceat(ev_sat[members], starts)
        full = st[:, _COUNT] >= cfg.quorum
        n_full = np.count_nonzero(full)
        if n_full:
            st[full, _CLOSED] = 1
            st[full, _CLOSER] = ev_worker[last[full]]
        regs[slots] = st
        bitmaps[slots] = bm
        tally[_C["grad_start"]] += n_new
        tally[_C["grad_add"]] += len(members) - n_new
        tally[_C["result_quorum"]] += n_full
        if n_full:
            # No later event of this batch touches these slots (their groups are all their events), so
            # the RESULT may be read from the accumulator now.
            closed_acc = acc[slots[full]] if new is None else new[full]
            emitted.append((last[full], np.zeros(n_full, dtype=bool), st[full], bm[full], closed_acc))
        return rest

    def _emit(self, em: _Emissions, cnt: np.ndarray) -> tuple[int, np.ndarray | None]:
        """Expand the emitting events into replicas in arrival order, apply the down policy per receiver
        in that order, and write the packets into the output buffers. Returns their number and, with big
        rows, the RESULT rows the replicas point at (``_out_index``); None when they were copied."""
        if not em.idx:
            return 0, None
        if len(em.idx) == 1:
            idx, job, kind, worker, nrep, rows, lens = (
                em.idx[0],
                em.job[0],
                em.kind[0],
                em.worker[0],
                em.nrep[0],
                em.rows[0],
                em.lens[0],
            )
        else:
            idx, job, kind, worker, nrep, rows, lens = (
                np.concatenate(x) for x in (em.idx, em.job, em.kind, em.worker, em.nrep, em.rows, em.lens)
            )
        order = np.argsort(idx, kind="stable")
        rep_job: np.ndarray | None  # None: every replica is a RESULT of job ``only_job``
        if len(em.idx) == 1 and not em.receivers and np.count_nonzero(kind) == 0:
            # The usual batch: multicast RESULTs of one job only.
            only_job, fanout = int(job[0]), int(nrep[0])
            rep_event = np.repeat(order, fanout)
            rep_receiver = np.tile(np.arange(fanout), len(order))
            rep_job = rep_kind = None
        else:
            nrep_sorted = nrep[order]
            rep_event = np.repeat(order, nrep_sorted)  # replica -> event, in emission order
            starts = np.cumsum(nrep_sorted) - nrep_sorted
            rep_pos = np.arange(len(rep_event)) - np.repeat(starts, nrep_sorted)
            rep_kind = kind[rep_event]
            rep_receiver = np.where(rep_kind == _UNICAST, worker[rep_event], rep_pos)
            if em.receivers:
                position = np.empty(len(order), dtype=np.int64)
                position[order] = np.arange(len(order))
                for e in np.flatnonzero(kind == _PARAM_KIND):
                    kept = em.receivers[int(idx[e])]
                    start = starts[position[e]]
                    rep_receiver[start : start + len(kept)] = kept
            rep_job = job[rep_event]

        keep = None
        for job_id in em.result_jobs:
            the_job = self._jobs[job_id]
            if not the_job.has_policy("down"):
                continue
            results = None if rep_job is None else (rep_job == job_id) & (rep_kind != _PARAM_KIND)
            for r in range(the_job.cfg.n_workers):
                to_r = rep_receiver == r
                sel = np.flatnonzero(to_r if results is None else results & to_r)
                if not len(sel):
                    continue
                stream = the_job.stream("down", r)
                if stream is None:
                    continue
                lost = sel[stream.drop_many(len(sel))]
                if len(lost):
                    if keep is None:
                        keep = np.ones(len(rep_event), dtype=bool)
                    keep[lost] = False
                    cnt[job_id, _C["drop_policy_down"]] += len(lost)
        if keep is not None:
            rep_event, rep_receiver = rep_event[keep], rep_receiver[keep]
            if rep_job is not None:
                rep_job = rep_job[keep]
        m = len(rep_event)
        self._reserve(m)
        # Big rows: the replicas point at their RESULT's row (OutBatch.index), no copies; small rows are
        # gathered into the output rows (one np.take beats the indexed send's bookkeeping there).
        shared = rows if rows.shape[1] >= _ROW_LOOP_BYTES else None
        if shared is not None:
            self._out_index[:m] = rep_event
        else:
            np.take(rows, rep_event, axis=0, out=self._out_data[:m])
        np.take(lens, rep_event, out=self._out_lens[:m])
        if rep_job is None:
            cnt[only_job, _C["tx_packets"]] += m
            np.take(self._keys[only_job], rep_receiver, out=self._out_egress[:m])
        else:
            _tally(cnt, rep_job, "tx_packets")
            self._out_egress[:m] = self._keys[rep_job, rep_receiver]
        return m, shared

    def _reserve(self, m: int) -> None:
        if len(self._out_data) < m or self._out_data.shape[1] != self._stride:
            cap = max(m, 2 * len(self._out_data), 1024)
            self._out_data = np.zeros((cap, self._stride), dtype=np.uint8)
            self._out_lens = np.zeros(cap, dtype=np.int64)
            self._out_egress = np.zeros(cap, dtype=np.int64)
            self._out_index = np.zeros(cap, dtype=np.int64)

    def _one_by_one(
        self, sw: SoftSwitch, data: np.ndarray, length: np.ndarray, port: np.ndarray, n: int
    ) -> OutBatch:
        """A small batch: each packet through the per-packet reference (``SoftSwitch._process``), the
        packets it emits written into the output rows. Below ``_vector_min`` packets this is faster than
        the vectorized pass, whose few hundred numpy calls cost about as much as tens of packets."""
        out: list[tuple[Any, bytes]] = []
        for i, (size, key) in enumerate(zip(length.tolist(), port.tolist(), strict=True)):
            # A key of no worker matches no worker of any job (drop_bad_worker), as in the vector pass.
            out += sw._process(memoryview(data[i, :size]), self._port_of.get(key, _NO_PORT))
        m = len(out)
        if not m:
            return self._output(0)
        self._reserve(m)
        rows, lens, egress, index = self._out_data, self._out_lens, self._out_egress, self._out_index
        # The reference hands every receiver of a RESULT the same bytes object: one row for all of them.
        last: bytes | None = None
        r = -1
        for j, (to, packet) in enumerate(out):
            if packet is not last:
                r += 1
                rows[r, : len(packet)] = np.frombuffer(packet, dtype=np.uint8)
                last = packet
            index[j] = r
            lens[j] = len(packet)
            egress[j] = self._key_of[to]
        shared = r + 1 < m
        return OutBatch(rows[: r + 1], lens[:m], egress[:m], m, index[:m] if shared else None)

    def _output(self, m: int, shared: np.ndarray | None = None) -> OutBatch:
        if shared is not None:
            return OutBatch(shared, self._out_lens[:m], self._out_egress[:m], m, self._out_index[:m])
        return OutBatch(self._out_data[:m], self._out_lens[:m], self._out_egress[:m], m)


def _tally(cnt: np.ndarray, rows: np.ndarray, name: str) -> None:
    if len(rows):
        cnt[:, _C[name]] += np.bincount(rows, minlength=MAX_JOBS)


class _Stepper:
    """The slot state machine one packet at a time, for the tail of a batch that hits a few slots many
    times (small waves). Same registers, same outcome as a wave; draws nothing."""

    def __init__(
        self,
        job: _Job,
        ev_slot: np.ndarray,
        ev_seq: np.ndarray,
        ev_flags: np.ndarray,
        ev_exp: np.ndarray,
        ev_worker: np.ndarray,
        ev_weight: np.ndarray,
        ev_grad: np.ndarray,
        fresh: np.ndarray,
        payload: np.ndarray,
    ) -> None:
        self.quorum = job.cfg.quorum
        self.regs, self.bitmaps, self.acc = job.slots.regs, job.slots.bitmap, job.slots.acc
        self.slot, self.seq, self.flags = ev_slot.tolist(), ev_seq.tolist(), ev_flags.tolist()
        self.exp, self.worker, self.weight = ev_exp.tolist(), ev_worker.tolist(), ev_weight.tolist()
        self.grad = ev_grad.tolist()
        self.fresh, self.payload = fresh, payload

    def step(self, i: int, tally: np.ndarray, emitted: list[tuple[np.ndarray, ...]]) -> None:
        s, q, w, hflags = self.slot[i], self.seq[i], self.worker[i], self.flags[i]
        regs, acc = self.regs, self.acc
        seq, closed, count, weight, exp, flags, nelem, step, chunk, closer = regs[s].tolist()
        bitmap = int(self.bitmaps[s])
        resend = close = False
        if self.grad[i]:
            if q > seq:
                acc[s] = self.payload[i]
                _, _, _, _, exp, _, nelem, step, chunk, _ = self.fresh[i].tolist()
                seq, closed, count, bitmap, weight, flags = q, 0, 1, 1 << w, self.weight[i], hflags & _ROUND
                tally[_C["grad_start"]] += 1
            elif q < seq:
                tally[_C["grad_stale"]] += 1
                return
            elif closed:
                tally[_C["grad_late_resend"]] += 1
                resend = True
            elif bitmap >> w & 1:
                tally[_C["grad_dup"]] += 1
                return
            elif self.exp[i] != exp or (hflags ^ flags) & _MAX:
                tally[_C["grad_exp_mismatch"]] += 1
                return
            else:
                if flags & _MAX:
                    np.maximum(acc[s], self.payload[i], out=acc[s])
                else:
                    np.add(acc[s], self.payload[i], out=acc[s])  # int32 wrap-around
                count += 1
                bitmap |= 1 << w
                weight = (weight + self.weight[i]) & _U32
                flags |= hflags & _SATURATED
                tally[_C["grad_add"]] += 1
            if not resend and count >= self.quorum:
                closed, closer, close = 1, w, True
                tally[_C["result_quorum"]] += 1
        elif q > seq:
            acc[s] = 0
            _, _, _, _, exp, flags, nelem, step, chunk, _ = self.fresh[i].tolist()
            seq, closed, count, bitmap, weight, closer, close = q, 1, 0, 0, 0, w, True
            tally[_C["flush_empty"]] += 1
        elif q < seq:
            tally[_C["flush_stale"]] += 1
            return
        elif closed:
            tally[_C["flush_resend"]] += 1
            resend = True
        else:
            closed, closer, close = 1, w, True
            tally[_C["flush_partial"]] += 1
        regs[s] = (seq, closed, count, weight, exp, flags, nelem, step, chunk, closer)
        self.bitmaps[s] = bitmap
        if close or resend:
            emitted.append(
                (np.array([i]), np.array([resend]), regs[s : s + 1].copy(), self.bitmaps[s : s + 1].copy(),
                 acc[s : s + 1].copy())
            )  # fmt: skip


def _add_rows(
    acc: np.ndarray,
    payload: np.ndarray,
    members: np.ndarray,
    starts: np.ndarray,
    size: np.ndarray,
    slots: np.ndarray,
    newer: np.ndarray,
    max_round: np.ndarray,
) -> None:
    """Plain rounds with big rows: each group's GRADs (``members[starts[g] : starts[g] + size[g]]``, rows
    of ``payload``, big-endian views of the receive buffer) go straight into its slot's accumulator row:
    a new round starts from its first GRADs, an open one adds to what it holds; sums wrap around in int32
    as the per-packet path's. One numpy call per GRAD on views: no gathers, no byte-swapped copies."""
    groups = zip(
        starts.tolist(), size.tolist(), slots.tolist(), newer.tolist(), max_round.tolist(), strict=True
    )
    for start, count, slot, new_round, is_max in groups:
        row = acc[slot]
        combine = np.maximum if is_max else np.add
        grads = members[start : start + count].tolist()
        if new_round:
            if count >= 2:
                combine(payload[grads[0]], payload[grads[1]], out=row)
                grads = grads[2:]
            else:
                row[...] = payload[grads[0]]
                grads = []
        for i in grads:
            combine(row, payload[i], out=row)


def _popcount(bits: np.ndarray) -> np.ndarray:
    """Set bits of each uint64."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2
        return np.bitwise_count(bits).astype(np.int64)
    return np.unpackbits(bits.view(np.uint8).reshape(len(bits), 8), axis=1).sum(axis=1)


def _segment_reduce(ufunc: np.ufunc, rows: np.ndarray, starts: np.ndarray, size: np.ndarray) -> np.ndarray:
    """``ufunc`` over each segment ``rows[starts[i] : starts[i] + size[i]]`` (sizes >= 1), in the rows' own
    dtype (int32 sums wrap around). One step per position in the segments, vectorized over segments:
    segments are short (at most a slot's packets in a batch), and ``ufunc.reduceat`` along axis 0 pays
    per segment."""
    out = rows[starts]
    longest = int(size.max())
    for j in range(1, longest):
        live = size > j
        if np.count_nonzero(live) == len(size):
            ufunc(out, rows[starts + j], out=out)
        else:
            at = np.flatnonzero(live)
            out[at] = ufunc(out[at], rows[starts[at] + j])
    return out


def _group_by_slot(slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``order``: the events sorted by slot, arrival order kept within a slot; ``first[i]``: sorted event i
    is the first of its slot."""
    m = len(slot)
    order = np.argsort(slot.astype(np.uint16), kind="stable")  # slots are < 65536: a radix sort
    ordered = slot[order]
    first = np.empty(m, dtype=bool)
    if m:
        first[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return order, first


def _waves(order: np.ndarray, first: np.ndarray, index: np.ndarray | None = None) -> list[np.ndarray]:
    """Split events grouped by slot (``order``, ``first`` from :func:`_group_by_slot`) into waves: wave j
    holds the j-th event of every slot, so a wave has each slot at most once and a slot's events are in
    order across waves. ``index`` maps the events to the caller's numbering."""
    m = len(order)
    if index is not None:
        order = index[order]
    if m == 0:
        return []
    if np.count_nonzero(first) == m:
        return [order]
    positions = np.arange(m)
    rank = positions - np.maximum.accumulate(np.where(first, positions, 0))
    small = np.uint16 if m <= 0xFFFF else np.int64  # 16-bit keys sort by radix
    by_rank = order[np.argsort(rank.astype(small), kind="stable")]
    return np.split(by_rank, np.cumsum(np.bincount(rank))[:-1])
