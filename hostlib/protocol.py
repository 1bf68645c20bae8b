"""LTA wire protocol, version 1: the single source of truth.

Every packet is Ethernet / IPv4 / UDP (destination port ``LTA_PORT`` towards the switch) /
LTA header (``HEADER_BYTES``, big-endian) / payload of exactly K int32 values (big-endian), where K is
the job's elements-per-packet. Only the first ``nelem`` payload values are meaningful; the rest are
zero (or ``INT32_MIN`` in exponent rounds, so that ``max`` ignores them). Every op carries the full
payload so a switch parser needs no op-dependent lengths. ``docs/protocol.md`` documents the same
layout; ``tests/test_protocol.py`` checks that the P4 header and the scapy layer match this module.

Vectorised helpers turn a whole batch of packets into a structured numpy array (one row per packet)
and back, so encoding and decoding never loop over elements in Python.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

VERSION = 1
LTA_PORT = 48879  # 0xBEEF, the switch's UDP port (and the port the P4 parser matches)
DEFAULT_ELEMS_PER_PACKET = 64  # K; the P4 program is compiled for this value
MAX_WORKERS = 64  # bitmap width; also the worker count the codec's headroom is sized for
MAX_JOBS = 64  # job ids 1..MAX_JOBS-1 are usable; index 0 collects packets of no known job


def default_pool_size(elems_per_packet: int) -> int:
    """A job's slots where nobody says (hosts and switches must agree: the same rule on both sides):
    2048 for packets of up to 1024 values, 512 for larger ones. The pool bounds how far a worker's units
    may run ahead of its oldest unsettled one (docs/protocol.md, "Slots and rounds": about half the
    pool), so it must cover the units sent in a round trip or two; on the softswitch's round trips (ms)
    512 slots held a 4 MiB reduce of 64-value packets at 192 ms against 88 with 2048 (4 workers), and at
    1% loss a lost unit stopped the sender until it was recovered. A job's pool costs its slots times K
    values of switch memory: 2048 x 64 values is 512 KiB (8 such jobs fill the P4 program's 16384
    slots); 512 jumbo slots (16367 values) already hold 33 MB of a softswitch."""
    return 2048 if elems_per_packet <= 1024 else 512


INT32_MIN = -(2**31)
# Slots and rounds (docs/protocol.md, "Slots and rounds"): unit g of a job uses slot g mod D and, in that
# slot, two rounds: its first, 2 (g div D) + 1, and a redo, 2 (g div D) + 2, which only a data unit whose
# first round came back SATURATED uses (docs/protocol.md, "Speculated exponents"). The switch only orders
# a slot's rounds, so the hosts may number them so.
ROUNDS_PER_UNIT = 2


def unit_seq(g: Any, data_slots: int, redo: bool = False) -> Any:
    """The round (``seq``) of unit ``g`` (an int or an int64 array) with ``data_slots`` = D: its first round,
    or its redo."""
    return (g // data_slots) * ROUNDS_PER_UNIT + (2 if redo else 1)


def seq_unit(seq: Any, slot: Any, data_slots: int) -> tuple[Any, Any]:
    """The unit a packet of round ``seq`` in ``slot`` belongs to, and its phase (0 the first round, 1 the
    redo): :func:`unit_seq`'s inverse. ``seq`` and ``slot`` are ints or int64 arrays."""
    q = seq - 1
    return (q // ROUNDS_PER_UNIT) * data_slots + slot, q % ROUNDS_PER_UNIT


# The health probe (a host convention on the existing contract, no new op): a worker FLUSHes round
# PROBE_SEQ of its job's last slot (P-1, which no unit uses). The first probe closes that round empty
# and every worker gets the RESULT; every later one is answered by a unicast resend. An answer proves
# that the switch runs, knows the job, and maps this worker id to this sender's address.
PROBE_SEQ = 2**32 - 1
# A probe's `step` is its run's incarnation (0: none). The first GRAD or FLUSH of round PROBE_SEQ of
# slot P-1 whose nonzero step differs from the one the switch holds for the job starts a new run there:
# the switch forgets every slot of the job first (docs/protocol.md, "Run after run"; the softswitch).
# The relayed heartbeat (a host convention on the existing contract, no new op): besides its HEARTBEAT,
# each beat a worker sends one PARAM of chunk ALIVE_CHUNK (CRITICAL, nelem 0), which the switch replicates
# to every other worker of the job as any PARAM. A peer heard from this way lately is alive, whatever
# the RESULT bitmaps say (hostlib/transport/deadlines.py: it is not presumed dead). Never a chunk of a
# shard nor an end marker (MARKER_CHUNK_BASE + owner, owner < MAX_WORKERS); hosts never put it in
# their parameter inbox.
ALIVE_CHUNK = 2**32 - 1
# Healing a rank that fell behind (a host convention on the existing contract, no new op; hostlib/torch_ext
# /heal.py, docs/protocol.md "Catching up"): a rank past TransportConfig.catch_up_reduces asks one peer for
# its state with a PARAM_REQ of chunk HEAL_REQUEST_BASE + donor; the donor answers at its next step
# boundary with PARAMs of chunks HEAL_CHUNK_BASE + i (CRITICAL, `step` = the donor's step), i = 0 a header
# and 1... the state's values. Both ranges lie between any shard's chunks (< HEAL_CHUNK_BASE) and the end
# markers (MARKER_CHUNK_BASE = 0xFFFF_0000 and up); hosts keep them out of the parameter inbox.
HEAL_CHUNK_BASE = 0x8000_0000
HEAL_REQUEST_BASE = 0xFFFE_0000
# UDP GSO trains (several datagrams sent as one message, see hostlib/batchio.py) never mix slots of two
# blocks of 2**SLOT_BLOCK_BITS consecutive slots: a receiver that steers a whole train by its first datagram
# (the sharded softswitch gives block (slot >> SLOT_BLOCK_BITS) mod N to shard i) still gets every
# datagram of a slot on the shard that owns it. 128 = the longest train the kernel sends.
SLOT_BLOCK_BITS = 7
# The switch's Ethernet address where it answers ARP itself (softswitch raw ports, Mininet demos);
# locally administered, "LTA" in ASCII.
SWITCH_MAC = "02:4c:54:41:00:01"


class Op(enum.IntEnum):
    GRAD = 1  # worker -> switch: a contribution to (slot, seq)
    RESULT = 2  # switch -> workers: the sum with count, bitmap and weight
    FLUSH = 3  # worker -> switch: close (slot, seq) now, with whatever arrived
    PARAM = 4  # owner -> switch -> other workers: absolute parameter values (float32 bits)
    PARAM_REQ = 5  # receiver -> switch -> other workers: "resend this shard reliably"
    # worker -> switch: "I am alive" (payload unused). Counted per worker (WORKER_COUNTER) and dropped;
    # 10, past the parameter-server ops 6..9, so a PS packet that reaches a switch stays malformed.
    HEARTBEAT = 10


class Flag(enum.IntFlag):
    RETX = 0x01  # a RESULT unicast again to a worker that asked for a closed round
    SATURATED = 0x02  # some contribution was clamped by the codec
    CRITICAL = 0x04  # exempt from emulated drop policies (reliable resends)
    MAX = 0x08  # aggregate by element-wise max instead of sum (exponent rounds)
    # The round's RESULT goes to one worker only, its owner, instead of every worker (a reduce-scatter
    # chunk is needed by its owner alone: N times less downlink). A worker's GRAD or FLUSH that starts the
    # round names the owner in its `count` field (unused in a worker's packet otherwise); resends of the
    # round go to the owner too. Honoured by a flat switch only (docs/protocol.md, "Owner-only RESULT").
    # 0x20, not 0x10: PsFlag.REJECTED holds 0x10 in the parameter-server exchange.
    OWNER = 0x20


class Role(enum.IntEnum):
    """A switch's part in a job (docs/protocol.md, "Hierarchy"). FLAT sums its workers and answers them.
    A LEAF sums its own workers, sends the partial aggregate up to its uplink as one GRAD (or FLUSH) that
    carries the partial's count, bitmap and weight, and multicasts the RESULT that comes back down. A
    SPINE sums the leaves' partials: a leaf is one contributor whose count, bitmap and weight are added
    as they are, so the RESULT carries the exact global count and bitmap."""

    FLAT = 0
    LEAF = 1
    SPINE = 2


# A spine's contributors (leaves) are kept in a 32-bit slot register ("parts").
MAX_LEAVES = 32


# The parameter-server exchange (docs/protocol.md, "Parameter-server mode"): the same header and the
# same K-lane payload, served by `lta ps` (softswitch/ps/), never by a switch. These ops are kept out of
# `Op` on purpose: `Op` is the switch contract (and the P4 constants generated from it), and a switch,
# P4 or softswitch, drops every op it does not know as malformed, so a PS packet that reaches one is
# counted and dropped, never summed.
class PsOp(enum.IntEnum):
    INIT = 6  # worker -> PS: initial parameters (float32 bits), kept only while the job has none
    PUSH = 7  # worker -> PS: one packet of a gradient, encoded by the job's compression
    PULL = 8  # worker -> PS: "my push is over, send me parameters" (payload: bitmap of wanted chunks)
    PARAM = 9  # PS -> worker: absolute parameter values (float32 bits) of one chunk


class PsFlag(enum.IntFlag):
    REJECTED = 0x10  # PARAM answering a push the PS refused (too stale, or late for its window)


class PsCodec(enum.IntEnum):
    """How a PUSH payload encodes gradient values (carried in the ``exp`` field of PUSH)."""

    NONE = 0  # K float32 per packet
    FP16 = 1  # 2K float16 per packet, two per lane
    INT8 = 2  # lane 0: float32 scale; lanes 1..K-1: 4(K-1) int8 codes, four per lane
    TOPK = 3  # K//2 (int32 index, float32 value) pairs per packet


# Header layout: (name, numpy big-endian type). Order and sizes are the wire format.
HEADER_FIELDS: tuple[tuple[str, str], ...] = (
    ("version", "u1"),
    ("op", "u1"),
    ("flags", "u1"),
    ("exp", "i1"),  # fixed-point exponent: value = int * 2**-exp
    ("job_id", ">u2"),
    ("worker_id", "u1"),
    ("count", "u1"),  # contributions summed into this RESULT
    ("slot", ">u2"),
    ("nelem", ">u2"),  # meaningful payload values (<= K)
    ("seq", ">u4"),  # round of the slot; strictly increases per slot
    ("step", ">u4"),  # training iteration (informational, echoed)
    ("chunk", ">u4"),  # chunk index inside the tensor being reduced (echoed)
    ("weight", ">u4"),  # summed sample weights
    ("bitmap", ">u8"),  # bit w set = worker w contributed
)
HEADER_DTYPE = np.dtype([(n, t) for n, t in HEADER_FIELDS])
HEADER_BYTES = HEADER_DTYPE.itemsize  # 36
HEADER_BITS = {n: np.dtype(t).itemsize * 8 for n, t in HEADER_FIELDS}
# field -> its byte offset in the header (the sum of the sizes before it)
HEADER_OFFSETS: dict[str, int] = {
    name: sum(HEADER_BITS[n] // 8 for n, _ in HEADER_FIELDS[:i]) for i, (name, _) in enumerate(HEADER_FIELDS)
}
# The same layout as a struct.Struct, for the per-packet path (one unpack is cheaper than numpy there).
_STRUCT_CODES = {"u1": "B", "i1": "b", ">u2": "H", ">u4": "I", ">u8": "Q"}
HEADER_STRUCT = struct.Struct(">" + "".join(_STRUCT_CODES[t] for _, t in HEADER_FIELDS))
assert HEADER_STRUCT.size == HEADER_BYTES
# The largest K whose packet still fits one UDP datagram (jumbo loopback use; the P4 program uses 64).
MAX_ELEMS_PER_PACKET = (65507 - HEADER_BYTES) // 4

# Counter names: one per branch of the switch contract. The softswitch, the P4 program (indirect
# counters indexed by job id) and the control plane use exactly these names (the flat contract's, then
# the hierarchy's: HIERARCHY_COUNTERS below).
_FLAT_COUNTERS: tuple[str, ...] = (
    "rx_packets",  # every packet that reached the pipeline
    "drop_malformed",  # short, wrong version, bad op, nelem > K, wrong payload length
    "drop_unknown_job",
    "drop_slot_range",
    "drop_bad_worker",  # worker id out of range or not matching its ingress port/address
    "drop_policy_up",  # emulated loss of GRAD
    "grad_start",  # q > seq: a new round starts
    "grad_add",  # q == seq, open, bit clear: summed
    "grad_dup",  # q == seq, open, bit set: duplicate, not added (at a lowered quorum it closes the round)
    "grad_late_resend",  # q == seq, closed: stored RESULT unicast to the sender
    "grad_stale",  # q < seq: dropped
    "grad_exp_mismatch",  # exponent differs from the round's: dropped, never added
    "result_quorum",  # round closed because count reached quorum (or met a lowered one: grad_dup)
    "flush_partial",  # FLUSH closed an open round
    "flush_empty",  # FLUSH for a round the slot never saw: closed with count 0
    "flush_resend",  # FLUSH for an already closed round: stored RESULT unicast
    "flush_stale",  # FLUSH for an older round: dropped
    "param_fwd",  # PARAM replicated to the other workers
    "param_req_fwd",  # PARAM_REQ replicated to the other workers
    "heartbeat",  # HEARTBEAT from a known worker: counted (here and per worker), dropped
    "drop_policy_down",  # emulated loss of a RESULT replica
    "drop_policy_param",  # emulated loss of a PARAM / PARAM_REQ replica
    "tx_packets",  # every packet the switch sent
)


# Counters of the hierarchy's branches (docs/protocol.md, "Hierarchy"): 0 for a flat job. They close
# COUNTERS, so the branch codes of the flat contract keep their numbers.
HIERARCHY_COUNTERS: tuple[str, ...] = (
    "up_partial",  # a leaf closed its round (quorum or FLUSH) and sent its partial aggregate up
    "up_resend",  # a leaf sent a forwarded partial up again (a worker asked for a round still unanswered)
    "down_result",  # a leaf took the spine's RESULT and multicast it to its workers
    "down_stale",  # a RESULT from the uplink for an older round than the slot's: dropped
    "up_held",  # a leaf's first-try FLUSH of a round whose partial went up again at an earlier FLUSH: no send
)
COUNTERS: tuple[str, ...] = _FLAT_COUNTERS + HIERARCHY_COUNTERS
# The softswitch's counters: the same list (kept as a name for its readers).
SWITCH_COUNTERS: tuple[str, ...] = COUNTERS


# Per-worker packet counter, for liveness: every packet that passes the worker check (GRAD, FLUSH,
# PARAM, PARAM_REQ, HEARTBEAT) counts at index job_id * MAX_WORKERS + worker_id, before any drop policy.
# A worker whose count stops moving for longer than its heartbeat interval has stopped sending.
WORKER_COUNTER = "worker_rx"


def worker_counter_index(job_id: int, worker_id: int) -> int:
    return job_id * MAX_WORKERS + worker_id


def parse_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; raises ValueError naming the text otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {text!r} is not HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:48879)")
    return host, int(port)


def check_elems_per_packet(elems_per_packet: int) -> None:
    if not 1 <= elems_per_packet <= MAX_ELEMS_PER_PACKET:
        raise ValueError(f"elems_per_packet must be in 1..{MAX_ELEMS_PER_PACKET}, got {elems_per_packet}")


def packet_dtype(elems_per_packet: int) -> np.dtype:
    """Structured dtype of one whole packet: header fields, then K big-endian int32."""
    check_elems_per_packet(elems_per_packet)
    return np.dtype([(n, t) for n, t in HEADER_FIELDS] + [("payload", ">i4", (elems_per_packet,))])


def packet_bytes(elems_per_packet: int) -> int:
    return HEADER_BYTES + 4 * elems_per_packet


def empty_batch(n: int, elems_per_packet: int) -> np.ndarray:
    """A zeroed batch of ``n`` packets with version set; fill fields column-wise."""
    batch = np.zeros(n, dtype=packet_dtype(elems_per_packet))
    batch["version"] = VERSION
    return batch


def batch_rows(batch: np.ndarray) -> np.ndarray:
    """The batch as an (n, packet_bytes) uint8 array of wire bytes (a view, no copy)."""
    return batch.view(np.uint8).reshape(len(batch), batch.dtype.itemsize)


def decode_batch(raw: np.ndarray, elems_per_packet: int) -> np.ndarray:
    """View an (n, packet_bytes) uint8 array as a batch of packets (no copy)."""
    return np.ascontiguousarray(raw).view(packet_dtype(elems_per_packet)).reshape(len(raw))


@dataclass(frozen=True)
class Header:
    """One decoded header, for tools, tests and the slow path."""

    version: int
    op: int
    flags: int
    exp: int
    job_id: int
    worker_id: int
    count: int
    slot: int
    nelem: int
    seq: int
    step: int
    chunk: int
    weight: int
    bitmap: int

    def pack(self) -> bytes:
        rec = np.zeros(1, dtype=HEADER_DTYPE)
        for name, _ in HEADER_FIELDS:
            rec[name] = getattr(self, name)
        return rec.tobytes()

    @classmethod
    def unpack(cls, data: bytes) -> Header:
        if len(data) < HEADER_BYTES:
            raise ValueError(f"LTA header needs {HEADER_BYTES} bytes, got {len(data)}")
        rec = np.frombuffer(data[:HEADER_BYTES], dtype=HEADER_DTYPE)[0]
        return cls(**{name: int(rec[name]) for name, _ in HEADER_FIELDS})


def make_packet(
    op: Op | int,
    *,
    job_id: int,
    worker_id: int = 0,
    slot: int = 0,
    seq: int = 0,
    payload: np.ndarray | None = None,
    elems_per_packet: int = DEFAULT_ELEMS_PER_PACKET,
    flags: int = 0,
    exp: int = 0,
    count: int = 0,
    step: int = 0,
    chunk: int = 0,
    weight: int = 0,
    bitmap: int = 0,
    nelem: int | None = None,
    version: int = VERSION,
) -> bytes:
    """Build one packet (header + K int32) as bytes. For tests, tools and rare control packets."""
    values = np.zeros(elems_per_packet, dtype=np.int64) if payload is None else np.asarray(payload)
    if len(values) > elems_per_packet:
        raise ValueError(f"payload has {len(values)} values, more than K={elems_per_packet}")
    batch = empty_batch(1, elems_per_packet)
    fields = dict(
        version=version,
        op=int(op),
        flags=flags,
        exp=exp,
        job_id=job_id,
        worker_id=worker_id,
        count=count,
        slot=slot,
        seq=seq,
        step=step,
        chunk=chunk,
        weight=weight,
        bitmap=bitmap,
        nelem=len(values) if nelem is None else nelem,
    )
    for name, value in fields.items():
        batch[name] = value
    batch["payload"][0, : len(values)] = values
    return batch.tobytes()
