"""The Tofino program's slot design against the reference.

p4/tofino/slot_update.p4 keeps a slot in registers that a pass may each read and write once (slot_seq
with slot_round, here one pair `seq`; slot_bitmap, slot_count, slot_result), decides a GRAD or FLUSH
from their answers in that order, and reads the RESULT's fields back in the element and harvest passes.
`TofinoSlot` below is that design transcribed to Python, register by register; the tests run it and the
softswitch (the contract's executable reference) on the same random packet sequences, with the job's
quorum lowered and raised between packets as the liveness monitor does, and require the same counters
and the same RESULT bytes. This checks the design, not the P4 text (the compiler checks that,
tests/test_tofino.py; tests/test_tofino_slot_tables.py walks its tables): a change to slot_update.p4's
decisions is made here too. The one documented difference of the slot design under a lowered quorum
(docs/protocol.md, "Tofino": a new GRAD into an open round already at the quorum closes it without
being added) is checked on its own with hand-computed expectations, and the random sequences do not
draw it; a raised quorum is no difference (a closed round is late, "Raised quorum").
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from hostlib.protocol import COUNTERS, Flag, Header, Op, make_packet
from softswitch.batch import SLOT_REGISTERS
from softswitch.pipeline import JobConfig, SoftSwitch

NEWER, OLDER = 0x8000_0000, 0x4000_0000
ROUND_MAX, ROUND_FLUSHED, ROUND_CLOSED, ROUND_EXP = 0x100, 0x200, 0x400, 0x1FF
CLOSED, NOT_ADDED = 0x8000_0000, 0xFFFF_FFFF
SAT, MAX, RETX = int(Flag.SATURATED), int(Flag.MAX), int(Flag.RETX)
JOB = 3


class TofinoSlot:
    """One slot as the Tofino program keeps it: {seq, round}, raw bitmap, {count, weight},
    {bitmap at closure, CLOSED | closer << 8 | SATURATED} and the accumulator pairs."""

    def __init__(self, elems: int) -> None:
        self.seq = [0, 0]
        self.bitmap = 0
        self.count = [0, 0]
        self.result = [0, 0]
        self.acc = np.zeros(elems, dtype=np.int64)

    def control_pass(self, h: Header, payload: np.ndarray, quorum: int) -> tuple[list[str], str, str]:
        """The branch counters it counts, the element operation, and how a RESULT leaves (or "")."""
        q, w, bit = h.seq, h.worker_id, 1 << h.worker_id
        packet_round = (h.exp & 0xFF) | (ROUND_MAX if h.flags & MAX else 0)
        result_flags = h.flags & SAT
        closer = CLOSED | w << 8
        grad = h.op == Op.GRAD
        # slot_seq
        if q > self.seq[0]:
            self.seq = [q, packet_round | (0 if grad else ROUND_FLUSHED)]
            round_ = NEWER
        elif q == self.seq[0]:
            round_ = self.seq[1]
            if not grad:
                self.seq[1] |= ROUND_FLUSHED
        else:
            round_ = OLDER
        if round_ == OLDER:
            return (["grad_stale" if grad else "flush_stale"], "", "")
        if round_ == NEWER:  # grad_start or flush_empty: slot_bitmap, slot_count, slot_result set
            self.bitmap = bit if grad else 0
            self.count = [1, h.weight] if grad else [0, 0]
            if not grad:
                self.result = [0, closer]
                return (["flush_empty"], "clear", "multicast")
            if quorum <= 1:
                self.result = [bit, result_flags | closer]
                return (["grad_start", "result_quorum"], "store", "multicast")
            self.result = [0, result_flags]
            return (["grad_start"], "store", "")
        flushed = bool(round_ & ROUND_FLUSHED)
        if not grad:
            if flushed:
                return (["flush_resend"], "load", "resend")
            old = self.result[1]  # slot_result or_close with the bitmap read from slot_bitmap
            if old < CLOSED:
                self.result = [self.bitmap, old | closer]
                return (["flush_partial"], "load", "multicast")
            return (["flush_resend"], "load", "resend")
        if flushed or round_ & ROUND_CLOSED:  # slot_round: closed by FLUSH, or marked at its RESULT
            return (["grad_late_resend"], "load", "resend")
        same_exp = (round_ & ROUND_EXP) == packet_round
        old_bitmap = self.bitmap
        seen = bool(old_bitmap & bit)
        if same_exp:
            self.bitmap |= bit  # test-and-set
        if seen:  # a duplicate (whatever its exponent): slot_count probed, count against the quorum
            old = self.result[1]
            if self.count[0] >= quorum:  # slot_result or_close: a lowered quorum, closed by this resend
                if old >= CLOSED:
                    return (["grad_late_resend"], "load", "resend")
                self.result = [old_bitmap, old | closer]
                return (["grad_dup", "result_quorum"], "load", "multicast")
            if old >= CLOSED:  # slot_result read
                return (["grad_late_resend"], "load", "resend")
            return (["grad_dup"], "", "")
        if not same_exp:  # slot_result read
            if self.result[1] >= CLOSED:
                return (["grad_late_resend"], "load", "resend")
            return (["grad_exp_mismatch"], "", "")
        # slot_count add, while count < quorum
        if self.count[0] < quorum:
            self.count = [self.count[0] + 1, (self.count[1] + h.weight) & 0xFFFF_FFFF]
            count = self.count[0]
        else:
            count = NOT_ADDED
        old = self.result[1]  # slot_result or_close
        op = "max" if round_ & ROUND_MAX else "add"
        if count == NOT_ADDED:
            if old >= CLOSED:
                return (["grad_late_resend"], "load", "resend")
            self.result = [old_bitmap, old | closer]  # a lowered quorum: closed without this packet
            return (["grad_late_resend", "result_quorum"], "load", "multicast")
        if count >= quorum:
            if old < CLOSED:
                self.result = [old_bitmap | bit, old | result_flags | closer]
            return (["grad_add", "result_quorum"], op, "multicast")
        if old < CLOSED:
            self.result[1] = old | result_flags
        return (["grad_add"], op, "")

    def element_pass(self, op: str, payload: np.ndarray) -> None:
        """The pair registers' four actions (store, add, max; load_lo in the harvest pass): LOAD and
        CLEAR first zero the payload in the element pass, then add (LOAD) or store (CLEAR) it."""
        if op in ("load", "clear"):
            payload = np.zeros_like(payload)
        if op in ("store", "clear"):
            self.acc[:] = payload
        elif op in ("add", "load"):
            self.acc[:] = ((self.acc + payload + 2**31) % 2**32) - 2**31
        elif op == "max":
            np.maximum(self.acc, payload, out=self.acc)

    def result_packet(self, h: Header, retx: bool) -> bytes:
        """The RESULT the element and harvest passes build: stored fields, nelem/step/chunk echoed. The
        element pass reads slot_round and marks the round CLOSED (slot_seq holds the packet's round)."""
        assert h.seq == self.seq[0]
        self.seq[1] |= ROUND_CLOSED
        exp = self.seq[1] & 0xFF
        flags = (MAX if self.seq[1] & ROUND_MAX else 0) | (self.result[1] & SAT) | (RETX if retx else 0)
        header = Header(
            1, int(Op.RESULT), flags, exp - 256 if exp > 127 else exp, JOB, (self.result[1] >> 8) & 0xFF,
            self.count[0], h.slot, h.nelem, self.seq[0], h.step, h.chunk, self.count[1], self.result[0],
        )  # fmt: skip
        return header.pack() + self.acc.astype(">i4").tobytes()


def random_packets(rng: random.Random, n_workers: int, slots: int, elems: int, count: int):
    """GRAD (80 %) and FLUSH for a few slots around each slot's newest round: starts, adds, duplicates,
    stale and late packets, exponent mismatches, MAX rounds and SATURATED flags."""
    newest = [1] * slots
    for _ in range(count):
        s = rng.randrange(slots)
        q = max(1, newest[s] + rng.choice((-1, 0, 0, 0, 0, 1)))
        newest[s] = max(newest[s], q)
        op = Op.GRAD if rng.random() < 0.8 else Op.FLUSH
        flags = rng.choice((0, 0, 0, SAT, MAX, MAX))
        values = [rng.randrange(-(2**20), 2**20) for _ in range(elems)]
        # step, chunk and nelem are the unit's, the same on every worker, as hostlib sends them
        yield make_packet(
            op, job_id=JOB, worker_id=rng.randrange(n_workers), slot=s, seq=q, payload=values,
            elems_per_packet=elems, flags=flags, exp=rng.choice((5, 5, 5, -3)), weight=rng.randrange(4),
            step=q * 10 + s, chunk=q * 100 + s, nelem=(q + s) % elems + 1,
        )  # fmt: skip


SEEDS = range(12)
REG = {name: i for i, name in enumerate(SLOT_REGISTERS)}
DUP_AT_QUORUM = "grad_dup closing at the quorum"
RAISED_LATE = "late first GRAD into a round closed below the raised quorum"


def at_lowered_quorum(switch: SoftSwitch, h: Header, quorum: int) -> int | None:
    """From the reference's slot state: when ``h`` is a new GRAD (same round, open, same exponent and
    MAX, sender not in the bitmap) into a round whose count already meets ``quorum`` (the documented
    Tofino difference), a worker the round has counted; else None."""
    state = switch.job_state(JOB)
    regs, bitmap = state["regs"][h.slot], int(state["bitmap"][h.slot])
    if h.op != Op.GRAD or h.seq != regs[REG["seq"]] or regs[REG["closed"]] or bitmap >> h.worker_id & 1:
        return None
    if h.exp != regs[REG["exp"]] or (h.flags ^ int(regs[REG["flags"]])) & MAX:
        return None
    count = int(regs[REG["count"]])
    return (bitmap & -bitmap).bit_length() - 1 if count and count >= quorum else None


def below_raised_quorum(switch: SoftSwitch, h: Header, quorum: int) -> bool:
    """From the reference's slot state: ``h`` is a first GRAD (same round and exponent, sender not in
    the bitmap) into a round closed with a count below ``quorum`` (raised after the closure), which
    slot_count alone would add."""
    state = switch.job_state(JOB)
    regs, bitmap = state["regs"][h.slot], int(state["bitmap"][h.slot])
    if h.op != Op.GRAD or h.seq != regs[REG["seq"]] or not regs[REG["closed"]] or bitmap >> h.worker_id & 1:
        return False
    if h.exp != regs[REG["exp"]] or (h.flags ^ int(regs[REG["flags"]])) & MAX:
        return False
    return int(regs[REG["count"]]) < quorum


def run_both(seed: int, change_quorum: bool = True) -> set[str]:
    """Feed one random sequence to the softswitch and the model, asserting equal output packet by
    packet; return the branches the sequence reached (DUP_AT_QUORUM for a duplicate that closed its
    round, RAISED_LATE for a late first GRAD into a round closed below the current, raised, quorum).
    With ``change_quorum`` the job's quorum is changed (both switches, between two packets) at random
    points, lowered twice as often as raised, as the liveness monitor does when workers go quiet and
    come back, and a GRAD that would meet the documented difference of a lowered quorum is sent instead
    by a worker the round already counted (a survivor's resend); the job is reset (the switch's slots
    and counters, a new model) every 50 packets and starts again at a random quorum, so that each
    sequence changes the quorum under many open and closed rounds."""
    rng = random.Random(seed)
    n_workers, elems, slots = rng.randint(1, 6), 8, 2
    quorum = rng.randint(1, n_workers)
    switch = SoftSwitch(seed=seed)
    ports = [("10.0.0.1", 50000 + w) for w in range(n_workers)]
    switch.add_job(JobConfig(JOB, ports, quorum=quorum, pool_size=slots, elems_per_packet=elems))
    model = [TofinoSlot(elems) for _ in range(slots)]
    counts = dict.fromkeys(COUNTERS, 0)
    branches_seen = set()
    for i, packet in enumerate(random_packets(rng, n_workers, slots, elems, 600)):
        if change_quorum and i % 50 == 49:
            switch.reset_job(JOB)
            model = [TofinoSlot(elems) for _ in range(slots)]
            counts = dict.fromkeys(COUNTERS, 0)
            quorum = rng.randint(1, n_workers)
            switch.set_quorum(JOB, quorum)
        elif change_quorum and i % 4 == 3 and rng.random() < 0.6:
            quorum = rng.randint(quorum, n_workers) if rng.random() < 1 / 3 else rng.randint(1, quorum)
            switch.set_quorum(JOB, quorum)
        h = Header.unpack(packet)
        resender = at_lowered_quorum(switch, h, quorum) if change_quorum else None
        if resender is not None:
            h = dataclasses.replace(h, worker_id=resender)
            packet = h.pack() + packet[len(h.pack()) :]
        if below_raised_quorum(switch, h, quorum):
            branches_seen.add(RAISED_LATE)
        payload = np.frombuffer(packet, dtype=">i4", offset=36).astype(np.int64)
        out = switch.process(packet, ports[h.worker_id])
        slot = model[h.slot]
        names, element_op, emit = slot.control_pass(h, payload, quorum)
        slot.element_pass(element_op, payload)
        expected = []
        if emit:
            result = slot.result_packet(h, retx=emit == "resend")
            receivers = range(n_workers) if emit == "multicast" else [h.worker_id]
            expected = [(ports[r], result) for r in receivers]
        counts["rx_packets"] += 1
        counts["tx_packets"] += len(expected)
        for name in names:
            counts[name] += 1
        branches_seen.update(names)
        if "grad_dup" in names and "result_quorum" in names:
            branches_seen.add(DUP_AT_QUORUM)
        assert [(p, bytes(b)) for p, b in out] == expected, (h, names)
        read = switch.read_counters(JOB)  # COUNTERS, then the hierarchy's (0 for a flat job)
        assert {k: read[k] for k in COUNTERS} == counts, (h, names)
        assert not any(v for k, v in read.items() if k not in COUNTERS), (h, read)
    return branches_seen


@pytest.mark.parametrize("seed", SEEDS)
def test_tofino_slot_design_matches_the_softswitch(seed):
    run_both(seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_tofino_slot_design_matches_the_softswitch_at_a_fixed_quorum(seed):
    run_both(seed, change_quorum=False)


def test_the_random_sequences_reach_every_slot_branch():
    """Every slot branch, a duplicate closing its round at a lowered quorum, and a late first GRAD into
    a round closed below a raised quorum."""
    reached = set().union(*(run_both(seed) for seed in SEEDS))
    slot_branches = [n for n in COUNTERS if n.startswith(("grad_", "flush_"))] + ["result_quorum"]
    assert sorted({*slot_branches, DUP_AT_QUORUM, RAISED_LATE} - reached) == []


# ---- a lowered quorum, by hand --------------------------------------------------------------------
ELEMS = 8
A = np.arange(1, ELEMS + 1, dtype=np.int64) * 1000
B = np.arange(ELEMS, dtype=np.int64) * -7 + 3
JUNK = np.full(ELEMS, 123_456, dtype=np.int64)


def grad(worker: int, payload: np.ndarray, weight: int = 1, exp: int = 5, flags: int = 0, seq: int = 4):
    data = make_packet(
        Op.GRAD, job_id=JOB, worker_id=worker, slot=0, seq=seq, payload=payload.tolist(),
        elems_per_packet=ELEMS, flags=flags, exp=exp, weight=weight, step=40, chunk=400, nelem=ELEMS,
    )  # fmt: skip
    return Header.unpack(data), payload


def send(slot: TofinoSlot, packet: tuple[Header, np.ndarray], quorum: int) -> tuple[list[str], str, bytes]:
    h, payload = packet
    names, element_op, emit = slot.control_pass(h, payload, quorum)
    slot.element_pass(element_op, payload)
    return names, emit, slot.result_packet(h, retx=emit == "resend") if emit else b""


def result_of(data: bytes) -> tuple[Header, np.ndarray]:
    return Header.unpack(data), np.frombuffer(data, dtype=">i4", offset=36).astype(np.int64)


def two_of_three() -> TofinoSlot:
    """Quorum 3: workers 0 and 1 have sent (weights 1 and 2), the round is open."""
    slot = TofinoSlot(ELEMS)
    assert send(slot, grad(0, A, weight=1), 3) == (["grad_start"], "", b"")
    assert send(slot, grad(1, B, weight=2), 3) == (["grad_add"], "", b"")
    return slot


@pytest.mark.parametrize("exp", [5, -3])
def test_a_duplicate_at_a_lowered_quorum_closes_the_round_without_its_values(exp):
    """Quorum lowered from 3 to 2 under a round holding workers 0 and 1: worker 1's resend (junk values,
    SATURATED, and with exp -3 another exponent: a duplicate all the same) closes it. RESULT = A + B
    multicast, count 2, bitmap 0b011, weight 3, closer 1, not SATURATED; counted grad_dup and
    result_quorum. Afterwards a resend is answered with the same RESULT (RETX)."""
    slot = two_of_three()
    names, emit, data = send(slot, grad(1, JUNK, weight=9, exp=exp, flags=SAT), 2)
    assert (names, emit) == (["grad_dup", "result_quorum"], "multicast")
    h, values = result_of(data)
    assert np.array_equal(values, A + B)
    fields = (h.op, h.count, h.bitmap, h.weight, h.worker_id, h.exp, h.flags)
    assert fields == (Op.RESULT, 2, 0b011, 3, 1, 5, 0)
    names, emit, again = send(slot, grad(0, JUNK), 2)
    assert (names, emit) == (["grad_late_resend"], "resend")
    h2, values2 = result_of(again)
    assert np.array_equal(values2, A + B)
    assert (h2.count, h2.bitmap, h2.worker_id, h2.flags) == (2, 0b011, 1, RETX)


def test_a_duplicate_below_the_quorum_is_dropped():
    slot = two_of_three()
    assert send(slot, grad(1, JUNK), 3) == (["grad_dup"], "", b"")
    assert send(slot, grad(0, JUNK, exp=-3), 3) == (["grad_dup"], "", b"")
    names, emit, data = send(slot, grad(2, -A, weight=4), 3)  # the third contribution still closes it
    h, values = result_of(data)
    assert (names, emit) == (["grad_add", "result_quorum"], "multicast")
    assert np.array_equal(values, B) and (h.count, h.bitmap, h.weight, h.worker_id) == (3, 0b111, 7, 2)


def test_a_new_grad_at_a_lowered_quorum_closes_without_being_added():
    """The documented Tofino difference (docs/protocol.md, "Tofino", "Lowered quorum"): worker 2's first
    GRAD finds the round at the lowered quorum 2 and closes it without its values (grad_late_resend and
    result_quorum, multicast; v1model and the softswitch would add it)."""
    slot = two_of_three()
    names, emit, data = send(slot, grad(2, JUNK, weight=9), 2)
    assert (names, emit) == (["grad_late_resend", "result_quorum"], "multicast")
    h, values = result_of(data)
    assert np.array_equal(values, A + B) and (h.count, h.bitmap, h.weight, h.worker_id) == (2, 0b011, 3, 2)


# ---- a raised quorum, by hand ---------------------------------------------------------------------
def closed_at_two() -> tuple[SoftSwitch, TofinoSlot, list[tuple[str, int]]]:
    """Four workers, quorum 2: workers 0 and 1 (weights 1 and 2) close the round, on the softswitch and
    on the model alike (the RESULT A + B multicast)."""
    ports = [("10.0.0.1", 50000 + w) for w in range(4)]
    switch = SoftSwitch(seed=0)
    switch.add_job(JobConfig(JOB, ports, quorum=2, pool_size=1, elems_per_packet=ELEMS))
    slot = TofinoSlot(ELEMS)
    for worker, payload, weight, names in (
        (0, A, 1, ["grad_start"]),
        (1, B, 2, ["grad_add", "result_quorum"]),
    ):
        packet = grad(worker, payload, weight=weight)
        out = switch.process(packet[0].pack() + payload.astype(">i4").tobytes(), ports[worker])
        got, emit, data = send(slot, packet, 2)
        assert got == names
        assert [bytes(b) for _, b in out] == ([data] * 4 if emit else [])
    return switch, slot, ports


@pytest.mark.parametrize("raised", [3, 4])
def test_a_late_first_grad_into_a_closed_round_after_a_raise_is_answered_with_the_stored_result(raised):
    """The liveness monitor raises the quorum (2 -> 3: the late GRAD would meet it; 2 -> 4: it would
    not) above the count of a round it closed; worker 2's first GRAD for that round is late, as the
    contract says: grad_late_resend, the stored RESULT (A + B, count 2, bitmap 0b011, weight 3, closer 1,
    RETX) to worker 2 only, no second RESULT, nothing added; the softswitch answers the same bytes and
    counts the same. Before the mark in slot_round (docs/protocol.md, "Tofino", "Raised quorum") the
    Tofino design added it (2 -> 3: a second multicast RESULT with count 3)."""
    switch, slot, ports = closed_at_two()
    switch.set_quorum(JOB, raised)
    before = switch.read_counters(JOB)
    packet = grad(2, JUNK, weight=9)
    out = switch.process(packet[0].pack() + JUNK.astype(">i4").tobytes(), ports[2])
    names, emit, data = send(slot, packet, raised)
    assert (names, emit) == (["grad_late_resend"], "resend")
    h, values = result_of(data)
    assert np.array_equal(values, A + B)
    fields = (h.op, h.count, h.bitmap, h.weight, h.worker_id, h.exp, h.flags)
    assert fields == (Op.RESULT, 2, 0b011, 3, 1, 5, RETX)
    assert [(p, bytes(b)) for p, b in out] == [(ports[2], data)]
    after = switch.read_counters(JOB)
    assert {k: after[k] - before[k] for k in COUNTERS if after[k] != before[k]} == {
        "rx_packets": 1, "tx_packets": 1, "grad_late_resend": 1,
    }  # fmt: skip
    # and again (a duplicate now, the same answer), and worker 3 too: the round stays as it closed
    for worker in (2, 3):
        names, emit, again = send(slot, grad(worker, JUNK), raised)
        assert (names, emit, again) == (["grad_late_resend"], "resend", data)
