"""The reference data plane: the switch contract of docs/protocol.md, packet in, packets out.

:class:`SoftSwitch` knows nothing about sockets: ``process(data, ingress)`` takes one packet and the port
(or UDP address) it came from and returns the ``(egress, bytes)`` pairs to send. The UDP daemon, the
raw-port runner and the P4Runtime server all drive this one object, so every deployment runs the same
state machine, and the P4 program is tested against it.

Per packet the work is one struct unpack, a few comparisons and one numpy add over the K payload
values: no per-element Python. That per-packet path is the reference; ``process_batch`` runs whole
batches through the native engine (:mod:`softswitch.batch`, ``softswitch/_swcore.c``) with exactly its
outcome, packet for packet.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from hostlib.emulation.dropmodels import DIRECTIONS, NO_LOSS, DropPolicy, DropStream
from hostlib.job import Job
from hostlib.protocol import (
    DEFAULT_ELEMS_PER_PACKET,
    HEADER_BYTES,
    HEADER_STRUCT,
    MAX_JOBS,
    MAX_WORKERS,
    PROBE_SEQ,
    SWITCH_COUNTERS,
    VERSION,
    Flag,
    Op,
    Role,
)
from softswitch.batch import (
    LEAF_FINAL,
    LEAF_FLUSHED,
    LEAF_PARTIAL,
    SLOT_REGISTERS,
    BatchEngine,
    OutBatch,
    worker_keys,
)

log = logging.getLogger(__name__)

Port = Hashable  # an int port number (raw ports, BMv2-like) or a (host, udp_port) address
Egress = list[tuple[Port, bytes]]

_C = {name: i for i, name in enumerate(SWITCH_COUNTERS)}
# Plain ints for the per-packet path: IntEnum/IntFlag operators go through Python-level __and__.
_RETX, _SATURATED, _CRITICAL, _MAX = int(Flag.RETX), int(Flag.SATURATED), int(Flag.CRITICAL), int(Flag.MAX)
_OWNER = int(Flag.OWNER)
_GRAD, _RESULT, _FLUSH, _PARAM, _PARAM_REQ, _HEARTBEAT = (
    int(o) for o in (Op.GRAD, Op.RESULT, Op.FLUSH, Op.PARAM, Op.PARAM_REQ, Op.HEARTBEAT)
)
_ROUND_FLAGS = _MAX | _SATURATED
_SEQ, _CLOSED, _CLOSER, _STATE, _FLAGS, _OWNER_REG = (
    SLOT_REGISTERS.index(n) for n in ("seq", "closed", "closer", "leaf_state", "flags", "owner")
)
_FLAT, _LEAF, _SPINE = int(Role.FLAT), int(Role.LEAF), int(Role.SPINE)
_VALID_OPS = {int(op) for op in Op}


@dataclass
class JobConfig:
    """One aggregation job: ``workers[w]`` is the port/address worker ``w`` sends from and receives on.
    Several workers may share a port (behind a leaf switch), as in the P4 program: a packet is checked
    by looking up its worker id's port, and every worker gets its own replica.

    ``role`` (docs/protocol.md, "Hierarchy"): a FLAT job answers its workers. A LEAF job serves the
    workers whose entry is not None (the others, global worker ids of the same job, sit behind other
    leaves), sends each closed round up to ``uplink`` as contributor ``leaf_id`` and multicasts the
    RESULT that comes back. A SPINE job's ``workers`` are its leaves (index = the leaf's ``leaf_id``,
    the port/address its partials come from); its ``quorum`` counts leaves. The quorum defaults to every
    worker served here (every leaf, for a spine)."""

    job_id: int
    workers: list[Port | None]
    quorum: int | None = None  # None: all workers (leaves) served here
    pool_size: int = 0  # 0: default_pool_size(elems_per_packet)
    elems_per_packet: int = DEFAULT_ELEMS_PER_PACKET
    role: Role = Role.FLAT
    uplink: Port | None = None  # LEAF: the spine's port/address, where partials go
    leaf_id: int = 0  # LEAF: this leaf's contributor id at the spine

    def __post_init__(self) -> None:
        job = Job.of(
            self.job_id,
            self.workers,
            quorum=self.quorum,
            pool_size=self.pool_size,
            elems_per_packet=self.elems_per_packet,
            role=self.role,
            uplink=self.uplink,
            leaf_id=self.leaf_id,
        )
        self.role, self.quorum, self.pool_size = job.role, job.quorum, job.pool_size

    @property
    def n_workers(self) -> int:
        """Worker ids 0..n_workers-1 are valid (a leaf's include those served by other leaves)."""
        return len(self.workers)

    @property
    def local(self) -> list[int]:
        """The worker ids this switch serves (multicasts to): every one but a leaf's None entries."""
        return [w for w, port in enumerate(self.workers) if port is not None]


class _Slots:
    """Slot registers of one job (the registers the P4 program keeps): ``regs`` (P, R) int64, one column per
    name of SLOT_REGISTERS, ``bitmap`` (P,) uint64 and ``acc`` (P, K) int32. A register is readable by
    name as a (P,) view: ``slots.seq[s]``."""

    def __init__(self, pool_size: int, elems: int) -> None:
        self.pool_size = pool_size
        self.elems = elems
        self.regs = np.zeros((pool_size, len(SLOT_REGISTERS)), dtype=np.int64)
        self.bitmap = np.zeros(pool_size, dtype=np.uint64)
        self.acc = np.zeros((pool_size, elems), dtype=np.int32)

    def __getattr__(self, name: str) -> np.ndarray:
        if name in SLOT_REGISTERS:
            return self.__dict__["regs"][:, SLOT_REGISTERS.index(name)]
        raise AttributeError(name)


class _Job:
    def __init__(self, cfg: JobConfig, seed: int) -> None:
        self.cfg = cfg
        self.slots = _Slots(cfg.pool_size, cfg.elems_per_packet)
        self.payload_bytes = 4 * cfg.elems_per_packet
        self.seed = seed
        self.policies: dict[tuple[str, int | None], DropPolicy] = {}
        self.streams: dict[tuple[str, int, int | None], DropStream] = {}
        # Port keys of the workers (see softswitch.batch.port_key), for the batched worker check and egress.
        self.worker_keys = worker_keys(cfg.workers)
        # The incarnation of the run the slots belong to (docs/protocol.md, "Run after run"; 0: none yet).
        self.incarnation = 0
        # A sharded switch: this shard started a new run and the others have not forgotten their slots yet;
        # until then no probe of the job is answered (so no worker sends a unit), softswitch/shards.py.
        self.run_pending = False

    def announces_new_run(self, s: int, q: int, step: int) -> bool:
        """Whether a GRAD or FLUSH of slot ``s``, round ``q``, with ``step`` starts a new run: a probe of
        the job's last slot whose incarnation is set and not the one the slots belong to."""
        return q == PROBE_SEQ and s == self.cfg.pool_size - 1 and step != 0 and step != self.incarnation

    def start_run(self, incarnation: int) -> None:
        """Forget every slot (in place: the native engine holds these arrays); counters, drop policies and
        their streams are kept."""
        log.info(
            "job %d: a new run (incarnation %08x, was %08x): its slots are forgotten",
            self.cfg.job_id,
            incarnation,
            self.incarnation,
        )
        self.slots.regs[...] = 0
        self.slots.bitmap[...] = 0
        self.slots.acc[...] = 0
        self.incarnation = incarnation

    def stream(self, direction: str, worker: int, sender: int | None = None) -> DropStream | None:
        """The drop stream of (direction, worker), or None when no policy applies (nothing is drawn).
        ``sender``: for ``param``, the worker whose broadcast this replica is; each (receiver, sender)
        pair has its own stream, drawn in that sender's order, so which copies a receiver loses does
        not depend on how the senders' broadcasts interleave at the switch."""
        policy = self.policies.get((direction, worker)) or self.policies.get((direction, None))
        if policy is None or policy == NO_LOSS:
            return None
        key = (direction, worker, sender)
        stream = self.streams.get(key)
        if stream is None or stream.policy != policy:
            # Seeded per (job, direction, worker[, sender]) so a run replays whatever the interleaving.
            entropy = [self.seed, self.cfg.job_id, DIRECTIONS.index(direction), worker]
            if sender is not None:
                entropy.append(sender)
            stream_seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
            stream = self.streams[key] = DropStream(policy, stream_seed)
        return stream

    def has_policy(self, direction: str) -> bool:
        return any(d == direction and p != NO_LOSS for (d, _), p in self.policies.items())

    def drops(self, direction: str, worker: int, sender: int | None = None) -> bool:
        stream = self.stream(direction, worker, sender)
        return stream is not None and stream.drop()


class SoftSwitch:
    """The switch contract of docs/protocol.md. Thread-safe: one lock around each packet (or batch)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.jobs: dict[int, _Job] = {}
        # counters[job_id][branch]; row 0 collects packets of no known job.
        self._counters = np.zeros((MAX_JOBS, len(SWITCH_COUNTERS)), dtype=np.int64)
        # WORKER_COUNTER: packets per (job, worker) that passed the worker check (liveness).
        self._worker_rx = np.zeros((MAX_JOBS, MAX_WORKERS), dtype=np.int64)
        self._lock = threading.Lock()
        self._batch = BatchEngine()  # the native engine's tables and buffers, behind process_batch
        # Emulated loss spares CRITICAL packets (the contract). Tests set False to emulate a real network,
        # where the flag protects nothing, and check that the hosts' resends deliver critical data anyway.
        self.spare_critical = True
        # Called (job id, incarnation) under the lock when a probe starts a new run of a job here; a shard
        # of a sharded switch sets it, and the job's probes go unanswered until release_run.
        self.on_new_run: Callable[[int, int], None] | None = None
        # The longest payload of any job (None: no job), kept with the jobs: the UDP server sizes its
        # receive rows by it on every batch.
        self.longest_payload: int | None = None

    # ---- control plane -------------------------------------------------------------------------
    def add_job(self, cfg: JobConfig) -> None:
        with self._lock:
            if cfg.job_id in self.jobs:
                raise ValueError(f"job {cfg.job_id} exists; remove it first (lta ctl job rm {cfg.job_id})")
            self.jobs[cfg.job_id] = _Job(cfg, self.seed)
            self._counters[cfg.job_id] = 0
            self._worker_rx[cfg.job_id] = 0
            self._jobs_changed()

    def remove_job(self, job_id: int) -> None:
        with self._lock:
            if self.jobs.pop(job_id, None) is None:
                raise KeyError(f"no job {job_id} on this switch")
            self._jobs_changed()

    def _jobs_changed(self) -> None:
        self._batch.set_jobs(self.jobs)
        self.longest_payload = max((job.payload_bytes for job in self.jobs.values()), default=None)

    def reset_job(self, job_id: int) -> None:
        """Clear a job's slots, drop-policy state and counters; keep its configuration and policies."""
        with self._lock:
            job = self.jobs[job_id]
            job.slots = _Slots(job.cfg.pool_size, job.cfg.elems_per_packet)
            job.streams.clear()
            self._counters[job_id] = 0
            self._worker_rx[job_id] = 0
            self._batch.set_jobs(self.jobs)

    def start_run(self, job_id: int, incarnation: int) -> None:
        """Forget the job's slots for a new run of ``incarnation`` (unless they already belong to it): what
        a probe of a new incarnation does, for a shard whose slots the probe did not reach."""
        with self._lock:
            job = self.jobs[job_id]
            if incarnation and incarnation != job.incarnation:
                job.start_run(incarnation)

    def release_run(self, job_id: int) -> None:
        """Answer the job's probes again (every shard has forgotten its slots for the new run)."""
        with self._lock:
            self.jobs[job_id].run_pending = False

    def set_quorum(self, job_id: int, quorum: int) -> None:
        """Change a running job's quorum (liveness: lowered while workers are offline, restored when they
        return). Slots keep their state; an open round closes at its next contribution, FLUSH or
        duplicate (a resend into a round already at the new quorum: docs/protocol.md, "Switch contract")."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None:
                raise KeyError(f"no job {job_id} on this switch")
            job.cfg = dataclasses.replace(job.cfg, quorum=quorum)  # checked as any job (hostlib.job)
            self._batch.set_jobs(self.jobs)

    def set_drop_policy(
        self, job_id: int, direction: str, policy: DropPolicy | None, worker: int | None = None
    ) -> None:
        """Emulated loss for one job and direction (``up``/``down``/``param``), for every worker or one.
        ``None`` removes the policy."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None:
                raise KeyError(f"no job {job_id} on this switch")
            if worker is not None and not 0 <= worker < job.cfg.n_workers:
                raise ValueError(f"job {job_id} has workers 0..{job.cfg.n_workers - 1}, not {worker}")
            if policy is None:
                job.policies.pop((direction, worker), None)
            else:
                job.policies[(direction, worker)] = policy
            self._batch.set_jobs(self.jobs)

    def read_counters(self, job_id: int) -> dict[str, int]:
        with self._lock:
            return dict(zip(SWITCH_COUNTERS, self._counters[job_id].tolist(), strict=True))

    def job_state(self, job_id: int) -> dict[str, np.ndarray]:
        """Copies of a job's counters, worker counters, slot registers (``regs``, ``bitmap``, ``acc``) and
        the incarnation its slots belong to: what a switch that served in another process hands back
        (:mod:`softswitch.process`)."""
        with self._lock:
            slots = self.jobs[job_id].slots
            return {
                "counters": self._counters[job_id].copy(),
                "worker_rx": self._worker_rx[job_id].copy(),
                "regs": slots.regs.copy(),
                "bitmap": slots.bitmap.copy(),
                "acc": slots.acc.copy(),
                "incarnation": np.array([self.jobs[job_id].incarnation], dtype=np.int64),
            }

    def load_job_state(self, job_id: int, state: dict[str, np.ndarray]) -> None:
        """Overwrite a job's counters, worker counters and slot registers with :meth:`job_state`'s copies
        from a switch holding the same job (same pool size and K)."""
        with self._lock:
            slots = self.jobs[job_id].slots
            if state["acc"].shape != slots.acc.shape:
                raise ValueError(
                    f"job {job_id}: state of {state['acc'].shape} slots x values, this switch has "
                    f"{slots.acc.shape}"
                )
            self._counters[job_id] = state["counters"]
            self._worker_rx[job_id] = state["worker_rx"]
            slots.regs[...] = state["regs"]  # in place: the engine holds these arrays
            slots.bitmap[...] = state["bitmap"]
            slots.acc[...] = state["acc"]
            if "incarnation" in state:
                self.jobs[job_id].incarnation = int(state["incarnation"][0])

    def read_worker_rx(self, job_id: int, n_workers: int | None = None) -> list[int]:
        """``WORKER_COUNTER`` of the job's first ``n_workers`` workers (default: all of them): packets
        that passed the worker check, heartbeats included."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None:
                raise KeyError(f"no job {job_id} on this switch")
            return self._worker_rx[job_id, : n_workers or job.cfg.n_workers].tolist()

    # ---- data plane ----------------------------------------------------------------------------
    def process(self, data: bytes | memoryview, ingress: Port) -> Egress:
        """Run one packet through the pipeline; return the packets to send as (egress, bytes)."""
        with self._lock:
            return self._process(data, ingress)

    def process_many(self, packets: list[tuple[bytes | memoryview, Port]]) -> Egress:
        """Run a batch of packets in order under one lock acquisition."""
        out: Egress = []
        with self._lock:
            for data, ingress in packets:
                out.extend(self._process(data, ingress))
        return out

    def process_batch(
        self, data: np.ndarray, lens: np.ndarray, ingress: np.ndarray, n: int | None = None
    ) -> OutBatch:
        """Run ``n`` packets (default ``len(lens)``) through the pipeline at once, in the native engine.

        ``data`` is (cap, stride) uint8, row i holding packet i's bytes (its first ``lens[i]`` are valid);
        ``ingress`` holds the port keys (:func:`softswitch.batch.port_key`) the packets came from. The
        outcome is exactly that of calling :meth:`process` on each packet in order: the same packets in
        the same order, the same counters, slot registers and drop decisions. The returned
        :class:`~softswitch.batch.OutBatch` (rows, lengths and egress port keys) lives in buffers reused
        by the next call."""
        with self._lock:
            return self._batch.run(self, data, lens, ingress, n)

    def count_damaged_frame(self) -> None:
        """A frame to the LTA port whose IPv4/UDP header is damaged (bad checksum, a fragment, lengths
        that disagree), dropped before the LTA checks by the raw-port front end: nothing in it is
        trusted, so it counts on index 0 (``rx_packets`` and ``drop_malformed``), as in the P4 program."""
        with self._lock:
            self._counters[0, _C["rx_packets"]] += 1
            self._count(0, "drop_malformed")

    def _count(self, job_id: int, name: str) -> None:
        self._counters[job_id, _C[name]] += 1

    def _process(self, data: bytes | memoryview, ingress: Port) -> Egress:
        if len(data) < HEADER_BYTES:
            self._counters[0, _C["rx_packets"]] += 1
            self._count(0, "drop_malformed")
            return []
        (version, op, flags, exp, job_id, w, hcount, s, nelem, q, step, chunk, weight, hbitmap) = (
            HEADER_STRUCT.unpack_from(data)
        )
        job = self.jobs.get(job_id)
        row = job_id if job is not None else 0
        self._counters[row, _C["rx_packets"]] += 1
        # A RESULT reaches a switch only as the spine's answer to a leaf, from the leaf's uplink.
        down = op == _RESULT and job is not None and job.cfg.role == _LEAF and ingress == job.cfg.uplink
        if version != VERSION or op not in _VALID_OPS or (op == _RESULT and not down):
            self._count(row, "drop_malformed")
            return []
        if job is None:
            self._count(0, "drop_unknown_job")
            return []
        cfg = job.cfg
        spine = cfg.role == _SPINE
        # A partial's count must be the size of its bitmap: then no round's count can exceed its bitmap's.
        bad_partial = spine and op in (_GRAD, _FLUSH) and hcount != hbitmap.bit_count()
        if len(data) - HEADER_BYTES != job.payload_bytes or nelem > cfg.elems_per_packet or bad_partial:
            self._count(job_id, "drop_malformed")
            return []
        if down:
            return self._down(job, data, s, q, flags, exp, w, hcount, nelem, step, chunk, weight, hbitmap)
        if w >= cfg.n_workers or cfg.workers[w] != ingress:
            self._count(job_id, "drop_bad_worker")
            return []
        self._worker_rx[job_id, w] += 1
        if op == _HEARTBEAT:
            self._count(job_id, "heartbeat")
            return []
        if op in (_PARAM, _PARAM_REQ):
            return self._replicate(job, data, w, flags, "param_fwd" if op == _PARAM else "param_req_fwd")
        if s >= cfg.pool_size:
            self._count(job_id, "drop_slot_range")
            return []
        probe = q == PROBE_SEQ and s == cfg.pool_size - 1
        if probe and job.announces_new_run(s, q, step):
            job.start_run(step)
            if self.on_new_run is not None:
                job.run_pending = True
                self.on_new_run(job_id, step)
        # Owner-only RESULT (Flag.OWNER): a flat switch's worker names the owner in `count`; a leaf or a
        # spine multicasts as before (the flag is not kept).
        owner, owner_flag = (hcount, flags & _OWNER) if cfg.role == _FLAT else (0, 0)
        if not spine:  # a worker's packet is one contribution; a leaf's partial carries its own
            hcount, hbitmap = 1, 1 << w
        if op == _FLUSH:
            if spine:
                return self._spine_flush(
                    job, data, w, s, q, exp, flags, nelem, step, chunk, hcount, weight, hbitmap
                )
            fflags = flags & (_MAX | _RETX) | owner_flag
            out = self._flush(job, w, s, q, exp, fflags, nelem, step, chunk, owner)
            return [] if probe and job.run_pending else out  # held: the worker probes again

        # GRAD
        if not flags & _CRITICAL * self.spare_critical and job.drops("up", w):
            self._count(job_id, "drop_policy_up")
            return []
        slots = job.slots
        regs = slots.regs
        row_values = regs[s].tolist()
        (seq, closed, count, sweight, sexp, sflags, snelem, sstep, schunk, closer, parts, state, sowner) = (
            row_values
        )
        bitmap = int(slots.bitmap[s])
        if q > seq:
            self._store(job, s, data, hcount)
            seq, closed, count, bitmap, sweight, sexp = q, False, hcount, hbitmap, weight, exp
            sflags, snelem, sstep, schunk = flags & _ROUND_FLAGS | owner_flag, nelem, step, chunk
            parts, state, sowner = (1 << w if spine else 0), LEAF_PARTIAL, owner
            self._count(job_id, "grad_start")
        elif q < seq:
            self._count(job_id, "grad_stale")
            return []
        elif closed and cfg.role == _LEAF and state != LEAF_FINAL:
            # Forwarded, no answer yet: the worker may have lost it, or the partial was lost on its way up.
            self._count(job_id, "up_resend")
            return self._send_up(job, s, _GRAD, retx=True)
        elif closed:
            self._count(job_id, "grad_late_resend")
            return self._emit(job, s, [w], retx=True)
        elif (parts if spine else bitmap) >> w & 1 or (spine and bitmap & hbitmap):
            # (a spine: this leaf's partial is in, or one of its workers was counted through another leaf)
            self._count(job_id, "grad_dup")
            if (parts.bit_count() if spine else count) < cfg.quorum:
                return []
            # The quorum was lowered under the round (liveness): a survivor's resend closes it as the
            # GRAD that reached the quorum would have (docs/protocol.md, "Switch contract").
        elif count and hcount and (exp != sexp or (flags ^ sflags) & _MAX):
            self._count(job_id, "grad_exp_mismatch")
            return []
        else:
            if hcount and not count:  # a spine round opened by an empty partial takes this one's contents
                self._store(job, s, data, hcount)
                sexp, sflags = exp, (sflags & _SATURATED) | (flags & _MAX)
            elif hcount:
                self._combine(job, s, data, sflags)
            count += hcount
            bitmap |= hbitmap
            parts |= (1 << w) if spine else 0
            sweight = (sweight + weight) & 0xFFFFFFFF
            sflags |= flags & _SATURATED
            self._count(job_id, "grad_add")
        reached = (parts.bit_count() if spine else count) >= cfg.quorum
        if reached:
            closed, closer = True, w
        regs[s] = (
            seq, closed, count, sweight, sexp, sflags, snelem, sstep, schunk, closer, parts, state, sowner
        )  # fmt: skip
        slots.bitmap[s] = bitmap
        if reached:
            self._count(job_id, "result_quorum")
            return self._close(job, s)
        return []

    def _store(self, job: _Job, s: int, data: bytes | memoryview, hcount: int) -> None:
        """acc[s] = the packet's payload (zero for an empty partial: it carries no values)."""
        if hcount:
            k = job.cfg.elems_per_packet
            job.slots.acc[s] = np.frombuffer(data, dtype=">i4", count=k, offset=HEADER_BYTES)
        else:
            job.slots.acc[s] = 0

    def _combine(self, job: _Job, s: int, data: bytes | memoryview, sflags: int) -> None:
        payload = np.frombuffer(data, dtype=">i4", count=job.cfg.elems_per_packet, offset=HEADER_BYTES)
        acc = job.slots.acc[s]
        if sflags & _MAX:
            np.maximum(acc, payload, out=acc)
        else:
            # int32 wrap-around, as the switch's registers do; the codec guarantees no wrap.
            np.add(acc, payload, out=acc, casting="unsafe")

    def _close(self, job: _Job, s: int, op: int = _GRAD) -> Egress:
        """A round just closed: a leaf sends its partial up (as ``op``), any other role multicasts it."""
        if job.cfg.role == _LEAF:
            self._count(job.cfg.job_id, "up_partial")
            return self._send_up(job, s, op)
        return self._emit(job, s, job.cfg.local)

    def _flush(
        self, job: _Job, w: int, s: int, q: int, exp: int, flags: int, nelem: int, step: int, chunk: int,
        owner: int,
    ) -> Egress:  # fmt: skip
        """FLUSH at a flat switch or a leaf. At a leaf, a FLUSH of an open round closes it there and sends
        the partial up as a GRAD: the spine still waits for the other leaves, whose workers are flushing
        too. A FLUSH of a round closed here and not answered sends the partial up again: as a FLUSH, which
        closes the spine's round, when it is a worker's repeated one (RETX); otherwise as a GRAD, once
        (a round closed by a FLUSH, or already sent again, holds the later first-try FLUSHes). ``flags``:
        the packet's MAX and RETX, and OWNER (with its ``owner``) at a flat switch only; a never-seen
        round closes with MAX and OWNER."""
        slots, job_id = job.slots, job.cfg.job_id
        regs = slots.regs
        leaf = job.cfg.role == _LEAF
        seq, closed, state = (int(v) for v in regs[s, [_SEQ, _CLOSED, _STATE]])
        if q > seq:
            slots.acc[s] = 0
            rflags = flags & (_MAX | _OWNER)
            regs[s] = (q, True, 0, 0, exp, rflags, nelem, step, chunk, w, 0, LEAF_PARTIAL, owner)
            slots.bitmap[s] = 0
            self._count(job_id, "flush_empty")
            return self._close(job, s)
        if q < seq:
            self._count(job_id, "flush_stale")
            return []
        if closed and leaf and state != LEAF_FINAL:
            # Only a worker's own repeated FLUSH (RETX: its first went unanswered for a FLUSH timeout)
            # closes the spine. The first FLUSHes of a round come from many workers within one round
            # trip (one designated worker, then the rest): had the second of them closed the spine, it
            # would race the partials other leaves resend at their own first FLUSH, and shut them out.
            # A first-try FLUSH sends the partial up again once (LEAF_PARTIAL -> LEAF_FLUSHED): every
            # partial gets two tries before a repeated FLUSH closes the spine; the round's later
            # first-try FLUSHes (up to one per worker, within a round trip) would only repeat it.
            if not flags & _RETX and state == LEAF_FLUSHED:
                self._count(job_id, "up_held")
                return []
            self._count(job_id, "up_resend")
            regs[s, _STATE] = LEAF_FLUSHED
            return self._send_up(job, s, _FLUSH if flags & _RETX else _GRAD, retx=True)
        if closed:
            self._count(job_id, "flush_resend")
            return self._emit(job, s, [w], retx=True)
        regs[s, _CLOSED] = True
        regs[s, _CLOSER] = w
        self._count(job_id, "flush_partial")
        return self._close(job, s)

    def _spine_flush(
        self,
        job: _Job,
        data: bytes | memoryview,
        w: int,
        s: int,
        q: int,
        exp: int,
        flags: int,
        nelem: int,
        step: int,
        chunk: int,
        hcount: int,
        weight: int,
        hbitmap: int,
    ) -> Egress:
        """FLUSH from leaf ``w`` at a spine: its partial is added if the round lacks it; the round closes."""
        slots, job_id = job.slots, job.cfg.job_id
        regs = slots.regs
        (seq, closed, count, sweight, sexp, sflags, snelem, sstep, schunk, _, parts, _, _) = regs[s].tolist()
        if q > seq:
            self._store(job, s, data, hcount)
            regs[s] = (
                q, True, hcount, weight, exp, flags & _ROUND_FLAGS, nelem, step, chunk, w, 1 << w, 0, 0
            )  # fmt: skip
            slots.bitmap[s] = hbitmap
            self._count(job_id, "flush_partial" if hcount else "flush_empty")
            return self._emit(job, s, job.cfg.local)
        if q < seq:
            self._count(job_id, "flush_stale")
            return []
        if closed:
            self._count(job_id, "flush_resend")
            return self._emit(job, s, [w], retx=True)
        if parts >> w & 1:
            pass  # the leaf's partial is in already (it came up as a GRAD): this FLUSH only closes
        elif int(slots.bitmap[s]) & hbitmap:
            self._count(job_id, "grad_dup")  # a worker counted through another leaf
        else:
            if count and hcount and (exp != sexp or (flags ^ sflags) & _MAX):
                self._count(job_id, "grad_exp_mismatch")
            else:
                if hcount and not count:
                    self._store(job, s, data, hcount)
                    sexp, sflags = exp, (sflags & _SATURATED) | (flags & _MAX)
                elif hcount:
                    self._combine(job, s, data, sflags)
                count += hcount
                slots.bitmap[s] = int(slots.bitmap[s]) | hbitmap
                parts |= 1 << w
                sweight = (sweight + weight) & 0xFFFFFFFF
                sflags |= flags & _SATURATED
        regs[s] = (seq, True, count, sweight, sexp, sflags, snelem, sstep, schunk, w, parts, 0, 0)
        self._count(job_id, "flush_partial")
        return self._emit(job, s, job.cfg.local)

    def _down(
        self,
        job: _Job,
        data: bytes | memoryview,
        s: int,
        q: int,
        flags: int,
        exp: int,
        closer: int,
        hcount: int,
        nelem: int,
        step: int,
        chunk: int,
        weight: int,
        hbitmap: int,
    ) -> Egress:
        """The spine's RESULT at a leaf: kept as the slot's final round (what late workers get resent)
        and multicast to the leaf's workers. A round still open here is overtaken: the spine closed it
        without this leaf, whose partial is dropped (its workers' bits are not in the bitmap)."""
        job_id = job.cfg.job_id
        if s >= job.cfg.pool_size:
            self._count(job_id, "drop_slot_range")
            return []
        regs = job.slots.regs
        if q < regs[s, _SEQ]:
            self._count(job_id, "down_stale")
            return []
        self._store(job, s, data, 1)
        regs[s] = (
            q,
            True,
            hcount,
            weight,
            exp,
            flags & _ROUND_FLAGS,
            nelem,
            step,
            chunk,
            closer,
            0,
            LEAF_FINAL,
            0,
        )
        job.slots.bitmap[s] = hbitmap
        self._count(job_id, "down_result")
        return self._emit(job, s, job.cfg.local, retx=bool(flags & _RETX))

    def _header(self, job: _Job, s: int, op: int, flags: int, worker_id: int) -> bytes:
        """Header of a packet built from slot ``s``: a RESULT, or a leaf's partial going up."""
        (seq, _closed, count, weight, exp, sflags, nelem, step, chunk, _closer, _parts, _state, _owner) = (
            job.slots.regs[s].tolist()
        )
        return HEADER_STRUCT.pack(
            VERSION, op, sflags | flags, exp, job.cfg.job_id, worker_id, count, s, nelem, seq, step, chunk,
            weight, int(job.slots.bitmap[s]),
        )  # fmt: skip

    def _send_up(self, job: _Job, s: int, op: int, retx: bool = False) -> Egress:
        """The leaf's partial of slot ``s`` to its uplink: ``op`` GRAD (closed here) or FLUSH (close the
        spine's round too), as contributor ``leaf_id``, with the partial's count, bitmap and weight."""
        cfg = job.cfg
        header = self._header(job, s, op, _RETX if retx else 0, cfg.leaf_id)
        self._count(cfg.job_id, "tx_packets")
        return [(cfg.uplink, b"".join((header, job.slots.acc[s].astype(">i4").data)))]

    def _emit(self, job: _Job, s: int, receivers: Iterable[int], retx: bool = False) -> Egress:
        """RESULT replicas of slot ``s`` to ``receivers``, each passing the down drop policy. An owner-only
        round (Flag.OWNER) goes to its owner alone, whoever asked (none if the owner is no worker here)."""
        slots, cfg = job.slots, job.cfg
        closer = int(slots.regs[s, _CLOSER])
        if slots.regs[s, _FLAGS] & _OWNER:
            owner = int(slots.regs[s, _OWNER_REG])
            receivers = [owner] if owner in cfg.local else []
        header = self._header(job, s, _RESULT, _RETX if retx else 0, closer)
        packet = b"".join((header, slots.acc[s].astype(">i4").data))  # one copy into the packet
        out: Egress = []
        for r in receivers:
            if job.drops("down", r):
                self._count(cfg.job_id, "drop_policy_down")
                continue
            out.append((cfg.workers[r], packet))
            self._count(cfg.job_id, "tx_packets")
        return out

    def _replicate(self, job: _Job, data: bytes | memoryview, w: int, flags: int, counter: str) -> Egress:
        cfg = job.cfg
        self._count(cfg.job_id, counter)
        packet = bytes(data)
        out: Egress = []
        for r in cfg.local:  # a leaf replicates to its own workers only (docs/protocol.md, "Hierarchy")
            if r == w:
                continue
            if not flags & _CRITICAL * self.spare_critical and job.drops("param", r, w):
                self._count(cfg.job_id, "drop_policy_param")
                continue
            out.append((cfg.workers[r], packet))
            self._count(cfg.job_id, "tx_packets")
        return out
