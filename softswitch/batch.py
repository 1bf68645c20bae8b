r"""The batched data plane behind :meth:`SoftSwitch.process_batch`: a whole batch of packets per call, in C.

The outcome is exactly that of running the packets one by one through the per-packet reference
(:meth:`SoftSwitch.process`): the same packets out, in the same order, byte for byte, the same counters,
slot registers and drop decisions. The switch contract is written twice in this project, no more: the
reference in :mod:`softswitch.pipeline` (readable, one packet at a time, what the P4 program is tested
against) and the native engine ``softswitch/_swcore.c`` (the same branches over a batch, arrival order),
which the differential tests hold to the reference.

* The engine reads the tables kept here (job ids, K, pool size, quorum, the workers' port keys per job,
  which drop policies a job has) and the job's registers themselves (``_Slots``: the arrays the reference
  updates), so the two paths share one state and can be mixed freely.
* Drop decisions stay in the Python :class:`~hostlib.emulation.dropmodels.DropStream`\ s: the first time a
  batch needs a stream, the engine peeks at its next decisions (:meth:`DropStream.peek`) and afterwards
  consumes exactly as many as it used (:meth:`DropStream.advance`): the same decisions as the reference's, in
  its order.
* Each packet emits at most one distinct packet (a RESULT or a PARAM copy), written once into an output row;
  its replicas point at that row (:attr:`OutBatch.index`), so no payload is copied per receiver.
* Without the compiled engine (no C compiler at install time) every batch runs through the per-packet
  reference (:meth:`BatchEngine._one_by_one`), with the same outcome, slower.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from hostlib.batchio import addr_key, key_addr
from hostlib.emulation.dropmodels import DIRECTIONS, DropStream
from hostlib.protocol import (
    HEADER_BITS,
    HEADER_BYTES,
    HEADER_FIELDS,
    HEADER_OFFSETS,
    MAX_JOBS,
    MAX_WORKERS,
    PROBE_SEQ,
    SWITCH_COUNTERS,
    VERSION,
    Flag,
    Op,
    Role,
)

if TYPE_CHECKING:
    from softswitch.pipeline import SoftSwitch, _Job

log = logging.getLogger(__name__)

# A key no packet can come from: workers whose address has no key (a host name) never match, as in the
# per-packet path, where a name never equals the numeric address a datagram comes from.
NO_KEY = int(np.iinfo(np.int64).min)

# Slot registers (the registers the P4 program keeps), one int64 column each in ``_Slots.regs`` (P, R), so
# a set of slots is gathered and scattered with all its registers in one operation; the bitmap is a uint64
# array of its own and the accumulator a (P, K) int32 array.
# "parts" (a spine: the leaves whose partial is in the round) and "leaf_state" (a leaf: LEAF_PARTIAL, the
# slot holds its own partial; LEAF_FLUSHED, and sent it up again at a FLUSH; LEAF_FINAL, it holds the spine's
# RESULT) serve the hierarchy (docs/protocol.md, "Hierarchy"). "owner": the worker an owner-only round's
# RESULT goes to (Flag.OWNER in "flags").
SLOT_REGISTERS = (
    "seq", "closed", "count", "weight", "exp", "flags", "nelem", "step", "chunk", "closer",
    "parts", "leaf_state", "owner",
)  # fmt: skip
LEAF_PARTIAL, LEAF_FLUSHED, LEAF_FINAL = 0, 1, 2

_C = {name: i for i, name in enumerate(SWITCH_COUNTERS)}
_NC = len(SWITCH_COUNTERS)
_RETX, _SATURATED, _CRITICAL, _MAX = int(Flag.RETX), int(Flag.SATURATED), int(Flag.CRITICAL), int(Flag.MAX)
_OWNER = int(Flag.OWNER)
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
    """Port keys of a job's workers (int64); :data:`NO_KEY` for a worker whose port has none (and for a
    leaf's None entries: workers served by another leaf)."""
    keys = []
    for port in workers:
        if port is None:
            keys.append(NO_KEY)
            continue
        try:
            keys.append(port_key(port))
        except ValueError as exc:
            log.warning("%s: process_batch never matches this worker and cannot address it", exc)
            keys.append(NO_KEY)
    return np.array(keys, dtype=np.int64)


class OutBatch:
    """``m`` packets to send: packet i is the first ``lens[i]`` bytes of row ``index[i]`` of ``data`` (row i
    when ``index`` is None), for port key ``egress[i]``. The replicas of one RESULT share its row (``index``
    repeats it): no copy per receiver. The arrays are views of buffers the next
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


class BatchEngine:
    """The tables the native engine reads (rebuilt by :meth:`set_jobs` whenever a job, its quorum or its
    drop policies change) and the reused output buffers."""

    def __init__(self) -> None:
        self._jobs: Mapping[int, _Job] = {}
        self._job_row = np.zeros(1 << 16, dtype=np.int64)  # job_id -> job_id if the job exists, else 0
        self._elems = np.zeros(MAX_JOBS, dtype=np.int64)
        self._pool = np.zeros(MAX_JOBS, dtype=np.int64)
        self._quorum = np.zeros(MAX_JOBS, dtype=np.int64)
        self._nworkers = np.zeros(MAX_JOBS, dtype=np.int64)
        self._policy = np.zeros(MAX_JOBS, dtype=np.int64)  # bit d: the job has a policy in DIRECTIONS[d]
        # The hierarchy (docs/protocol.md, "Hierarchy"): the job's Role, a leaf's uplink key and leaf id,
        # and the workers served here (bit w; a leaf's others sit behind other leaves).
        self._role = np.zeros(MAX_JOBS, dtype=np.int64)
        self._uplink = np.full(MAX_JOBS, NO_KEY, dtype=np.int64)
        self._leaf_id = np.zeros(MAX_JOBS, dtype=np.int64)
        self._local = np.zeros(MAX_JOBS, dtype=np.uint64)
        self._keys = np.full((MAX_JOBS, 256), NO_KEY, dtype=np.int64)  # [job, worker_id] -> port key
        self._slots: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * MAX_JOBS
        self._stride = HEADER_BYTES
        self._max_workers = 1
        self._out_data = np.zeros((0, HEADER_BYTES), dtype=np.uint8)
        self._out_lens = np.zeros(0, dtype=np.int64)
        self._out_egress = np.zeros(0, dtype=np.int64)
        self._out_index = np.zeros(0, dtype=np.int64)
        # The workers' ports by key and back, for batches run one packet at a time (_one_by_one).
        self._port_of: dict[int, Any] = {}
        self._key_of: dict[Any, int] = {}
        # The drop streams the engine asked for, by (job, direction, receiver, sender): every batch asks
        # again for each stream it uses (peek, then commit), and a switch relaying for a tree uses one per
        # worker or leaf in every batch. Cleared by set_jobs, which every change of a job's policies or
        # streams calls, so an entry is the stream the job itself would hand out.
        self._streams: dict[tuple[int, int, int, int], DropStream | None] = {}

    def set_jobs(self, jobs: Mapping[int, _Job]) -> None:
        """Rebuild the tables from the jobs (after a job was added, removed or reset, or its quorum or drop
        policies changed)."""
        self._jobs = jobs
        self._streams = {}
        self._job_row[:] = 0
        self._port_of, self._key_of = {}, {}
        for table in (self._elems, self._pool, self._quorum, self._nworkers, self._policy, self._role):
            table[:] = 0
        self._uplink[:] = NO_KEY
        self._leaf_id[:] = 0
        self._local[:] = 0
        self._keys[:] = NO_KEY
        self._slots = [None] * MAX_JOBS
        self._stride, self._max_workers = HEADER_BYTES, 1
        for job_id, job in jobs.items():
            cfg = job.cfg
            self._job_row[job_id] = job_id
            self._elems[job_id] = cfg.elems_per_packet
            self._pool[job_id] = cfg.pool_size
            self._quorum[job_id] = cfg.quorum
            self._nworkers[job_id] = cfg.n_workers
            self._policy[job_id] = sum(1 << d for d, name in enumerate(DIRECTIONS) if job.has_policy(name))
            self._keys[job_id, : cfg.n_workers] = job.worker_keys
            self._role[job_id] = int(cfg.role)
            self._leaf_id[job_id] = cfg.leaf_id
            self._local[job_id] = sum(1 << w for w in cfg.local)
            if cfg.uplink is not None:
                uplink = port_key(cfg.uplink)
                self._uplink[job_id] = uplink
                self._port_of[uplink], self._key_of[cfg.uplink] = cfg.uplink, uplink
            self._slots[job_id] = (job.slots.regs, job.slots.bitmap, job.slots.acc)
            for port, key in zip(cfg.workers, job.worker_keys.tolist(), strict=True):
                if key != NO_KEY and port is not None:
                    self._port_of[key], self._key_of[port] = port, key
            self._stride = max(self._stride, HEADER_BYTES + 4 * cfg.elems_per_packet)
            self._max_workers = max(self._max_workers, cfg.n_workers)

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
            return self._output(0, 0)
        if data.shape[1] > 1 and data.strides[1] != 1:
            data = np.ascontiguousarray(data[:n])
        length = _int64(lens, n)
        port = _int64(ingress, n)
        # A batch that starts a new run (once per run: docs/protocol.md, "Run after run") goes through the
        # reference, which forgets the job's slots at that packet: rare, so decided here, not in C.
        if _swcore is None or self._announces_new_run(data, length, n):
            return self._one_by_one(sw, data, np.minimum(length, data.shape[1]), port, n)
        self._reserve(n, n * self._max_workers)
        m, rows = _swcore.run(
            data,
            length,
            port,
            n,
            self._job_row,
            self._elems,
            self._pool,
            self._quorum,
            self._nworkers,
            self._keys,
            self._policy,
            (self._role, self._uplink, self._leaf_id, self._local),
            self._slots,
            sw._counters,
            sw._worker_rx,
            self._out_data,
            self._out_lens,
            self._out_egress,
            self._out_index,
            _CRITICAL if sw.spare_critical else 0,
            self._peek,
            self._commit,
        )
        return self._output(m, rows)

    def _announces_new_run(self, data: np.ndarray, length: np.ndarray, n: int) -> bool:
        """Whether a packet of the batch may start a new run of its job (:meth:`_Job.announces_new_run`,
        judged on its header alone; the reference applies the checks before it), or is a probe of a job
        whose new run is pending (its answer is held)."""
        if data.shape[1] < HEADER_BYTES:
            return False
        head = data[:n, :HEADER_BYTES]
        seq_at, job_at, slot_at, step_at = _SEQ_AT, _JOB_AT, _SLOT_AT, _STEP_AT
        # seq == PROBE_SEQ (all ones): a cheap filter over the batch (one compare per row, on the field read
        # in place as a big-endian u32), the rest per candidate.
        seq = head[:, seq_at : seq_at + 4].view(">u4")[:, 0]
        if seq.max() != PROBE_SEQ:  # (the all-ones seq is the largest: one reduction says there is none)
            return False
        probes = np.flatnonzero((seq == PROBE_SEQ) & (length >= HEADER_BYTES))
        for i in probes.tolist():
            row = head[i].tobytes()
            job = self._jobs.get(int.from_bytes(row[job_at : job_at + 2], "big"))
            slot = int.from_bytes(row[slot_at : slot_at + 2], "big")
            step = int.from_bytes(row[step_at : step_at + 4], "big")
            probe_slot = job is not None and slot == job.cfg.pool_size - 1
            if probe_slot and (job.run_pending or job.announces_new_run(slot, PROBE_SEQ, step)):
                return True
        return False

    def _stream(self, job_id: int, direction: int, receiver: int, sender: int) -> DropStream | None:
        key = (job_id, direction, receiver, sender)
        try:
            return self._streams[key]
        except KeyError:
            name = DIRECTIONS[direction]
            stream = self._jobs[job_id].stream(name, receiver, sender if name == "param" else None)
            self._streams[key] = stream
            return stream

    def _peek(self, job_id: int, direction: int, receiver: int, sender: int, n: int) -> np.ndarray | None:
        """The engine's view of a stream: its next ``n`` decisions, not yet consumed (None: no policy)."""
        stream = self._stream(job_id, direction, receiver, sender)
        return None if stream is None else stream.peek(n)

    def _commit(self, job_id: int, direction: int, receiver: int, sender: int, used: int) -> None:
        stream = self._stream(job_id, direction, receiver, sender)
        assert stream is not None  # peeked in this batch, under the switch's lock
        stream.advance(used)

    def _reserve(self, rows: int, replicas: int) -> None:
        """Output buffers for ``rows`` packets and ``replicas`` replicas: grown to what a batch needs (at
        least 1024), rebuilt at that size when the row width changes (never doubled for it: a switch whose
        jobs come and go changes its width often)."""
        if self._out_data.shape[1] != self._stride:
            self._out_data = np.zeros((max(rows, 1024), self._stride), dtype=np.uint8)
        elif len(self._out_data) < rows:
            self._out_data = np.zeros((max(rows, 2 * len(self._out_data)), self._stride), dtype=np.uint8)
        if len(self._out_index) < replicas:
            cap = max(replicas, 2 * len(self._out_index), 1024)
            self._out_lens = np.zeros(cap, dtype=np.int64)
            self._out_egress = np.zeros(cap, dtype=np.int64)
            self._out_index = np.zeros(cap, dtype=np.int64)

    def _one_by_one(
        self, sw: SoftSwitch, data: np.ndarray, length: np.ndarray, port: np.ndarray, n: int
    ) -> OutBatch:
        """Each packet through the per-packet reference (``SoftSwitch._process``), the packets it emits
        written into the output rows: the path where the compiled engine is missing, and the one the
        differential tests hold the engine to."""
        out: list[tuple[Any, bytes]] = []
        for i, (size, key) in enumerate(zip(length.tolist(), port.tolist(), strict=True)):
            # A key of no worker matches no worker of any job (drop_bad_worker), as in the engine.
            out += sw._process(memoryview(data[i, :size]), self._port_of.get(key, _NO_PORT))
        m = len(out)
        if not m:
            return self._output(0, 0)
        self._reserve(m, m)
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
        return self._output(m, r + 1)

    def _output(self, m: int, rows: int) -> OutBatch:
        index = self._out_index[:m] if m else None
        return OutBatch(self._out_data[:rows], self._out_lens[:m], self._out_egress[:m], m, index)


_SEQ_AT, _JOB_AT, _SLOT_AT, _STEP_AT = (HEADER_OFFSETS[f] for f in ("seq", "job_id", "slot", "step"))


def _int64(values: np.ndarray, n: int) -> np.ndarray:
    arr = np.asarray(values)[:n]
    if arr.dtype != np.int64 or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype=np.int64)
    return arr


def _configure() -> None:
    """Hand the protocol's constants to the engine (hostlib/protocol.py stays the one definition)."""
    assert _swcore is not None
    names = [name for name, _ in HEADER_FIELDS]
    assert tuple(names) == _FIELD_ORDER, "softswitch/_swcore.c reads the header fields in this order"
    valid = [0] * 256
    for op in Op:
        valid[int(op)] = 1
    _swcore.configure(
        tuple(HEADER_OFFSETS[name] for name in names),
        tuple(HEADER_BITS[name] // 8 for name in names),
        HEADER_BYTES,
        VERSION,
        MAX_JOBS,
        MAX_WORKERS,
        _NC,
        len(SLOT_REGISTERS),
        tuple(int(op) for op in (Op.GRAD, Op.RESULT, Op.FLUSH, Op.PARAM, Op.PARAM_REQ, Op.HEARTBEAT)),
        tuple(int(role) for role in (Role.FLAT, Role.LEAF, Role.SPINE)),
        tuple(valid),
        (_RETX, _SATURATED, _CRITICAL, _MAX, _OWNER),
        tuple(range(len(SLOT_REGISTERS))),
        (LEAF_PARTIAL, LEAF_FLUSHED, LEAF_FINAL),
        tuple(_C[name] for name in _COUNTER_ROLES),
    )


# The order in which _swcore.c's enums name the header fields and counters.
_FIELD_ORDER = tuple(
    "version op flags exp job_id worker_id count slot nelem seq step chunk weight bitmap".split()
)
_COUNTER_ROLES = tuple(
    """rx_packets drop_malformed drop_unknown_job drop_slot_range drop_bad_worker drop_policy_up grad_start
    grad_add grad_dup grad_late_resend grad_stale grad_exp_mismatch result_quorum flush_partial flush_empty
    flush_resend flush_stale param_fwd param_req_fwd heartbeat drop_policy_down drop_policy_param
    tx_packets up_partial up_resend down_result down_stale up_held""".split()
)
assert set(_COUNTER_ROLES) == set(SWITCH_COUNTERS), "a counter of the contract has no branch in _swcore.c"

_swcore: Any
try:
    from softswitch import _swcore as _swcore_module

    _swcore = _swcore_module
    _configure()
    ENGINE = "native"
except ImportError as _exc:
    _swcore = None
    ENGINE = "reference"
    log.warning("softswitch._swcore is not built (%s): batches run through the per-packet reference", _exc)
