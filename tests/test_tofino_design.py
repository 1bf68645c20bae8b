"""The Tofino program's slot design against the reference.

p4/tofino/slot_update.p4 keeps a slot in four registers that a pass may each read and write once
(slot_seq, slot_bitmap, slot_count, slot_result), decides a GRAD or FLUSH from their answers in that
order, and reads the RESULT's fields back in the element and harvest passes. `TofinoSlot` below is that
design transcribed to Python, register by register; the tests run it and the softswitch (the contract's
executable reference) on the same random packet sequences and require the same counters and the same
RESULT bytes. This checks the design, not the P4 text (the compiler checks that, tests/test_tofino.py):
a change to slot_update.p4's decisions is made here too.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from hostlib.protocol import COUNTERS, Flag, Header, Op, make_packet
from softswitch.pipeline import JobConfig, SoftSwitch

NEWER, OLDER = 0x8000_0000, 0x4000_0000
ROUND_MAX, ROUND_FLUSHED, ROUND_EXP = 0x100, 0x200, 0x1FF
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
        if flushed:
            return (["grad_late_resend"], "load", "resend")
        same_exp = (round_ & ROUND_EXP) == packet_round
        old_bitmap = self.bitmap
        seen = bool(old_bitmap & bit)
        if same_exp:
            self.bitmap |= bit  # test-and-set
        if not same_exp or seen:  # slot_result read
            if self.result[1] >= CLOSED:
                return (["grad_late_resend"], "load", "resend")
            return (["grad_dup" if seen else "grad_exp_mismatch"], "", "")
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
            self.result = [old_bitmap | bit, old | result_flags | closer]
            return (["grad_add", "result_quorum"], op, "multicast")
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
        """The RESULT the element and harvest passes build: stored fields, nelem/step/chunk echoed."""
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


def run_both(seed: int) -> set[str]:
    """Feed one random sequence to the softswitch and the model, asserting equal output packet by
    packet; return the branches the sequence reached."""
    rng = random.Random(seed)
    n_workers, elems, slots = rng.randint(1, 6), 8, 2
    quorum = rng.randint(1, n_workers)
    switch = SoftSwitch(seed=seed)
    ports = [("10.0.0.1", 50000 + w) for w in range(n_workers)]
    switch.add_job(JobConfig(JOB, ports, quorum=quorum, pool_size=slots, elems_per_packet=elems))
    model = [TofinoSlot(elems) for _ in range(slots)]
    counts = dict.fromkeys(COUNTERS, 0)
    branches_seen = set()
    for packet in random_packets(rng, n_workers, slots, elems, 600):
        h = Header.unpack(packet)
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
        assert [(p, bytes(b)) for p, b in out] == expected, (h, names)
        read = switch.read_counters(JOB)  # COUNTERS, then the hierarchy's (0 for a flat job)
        assert {k: read[k] for k in COUNTERS} == counts, (h, names)
        assert not any(v for k, v in read.items() if k not in COUNTERS), (h, read)
    return branches_seen


@pytest.mark.parametrize("seed", SEEDS)
def test_tofino_slot_design_matches_the_softswitch(seed):
    run_both(seed)


def test_the_random_sequences_reach_every_slot_branch():
    reached = set().union(*(run_both(seed) for seed in SEEDS))
    slot_branches = [n for n in COUNTERS if n.startswith(("grad_", "flush_"))] + ["result_quorum"]
    assert sorted(set(slot_branches) - reached) == []
