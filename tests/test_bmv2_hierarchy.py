"""Differential tests of the hierarchy (docs/protocol.md, "Hierarchy"): a leaf job and a spine job on the
P4 program (BMv2) and on the softswitch, configured through the same control plane (``lta ctl``'s
``LtaSwitch``), answer the same hand-built packets with the same packets and counters; and a whole
2-leaf x 2-worker tree of three BMv2 switches (and three softswitches beside them) with loss on both
levels, where every RESULT a worker takes is the sum over its global bitmap with count = its size.

As in tests/test_bmv2_diff.py, the hand-computed expectations run on the softswitch everywhere and on
both switches where BMv2 is installed (marked ``bmv2``, skipped without it).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from controlplane.bmv2 import Bmv2Switch, host_worker, lta_of, worker_frame
from controlplane.jobs import JobSpec
from controlplane.switch import LtaSwitch
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.p4.schema import BMV2_JSON_PATH
from hostlib.protocol import Flag, Op, Role, make_packet
from softswitch.p4runtime_server import serve
from softswitch.pipeline import SoftSwitch
from tests import test_bmv2_diff as diff
from tests.test_bmv2_diff import (
    Pair,
    assert_result,
    check_counters,
    check_frame,
    decode,
    flush,
    grad,
    needs_bmv2,
    run,
    vec,
    workers,
)

# The differential fixtures of tests/test_bmv2_diff.py (BMv2 + softswitch, or the softswitch alone).
pair, soft_only, fresh, fresh_pair = diff.pair, diff.soft_only, diff.fresh, diff.fresh_pair

LEAF_JOB, SPINE_JOB = 1, 2
UPLINK_PORT = 4  # the leaf's port toward the spine (host_worker(4) is the spine's address)


def leaf_spec(quorum: int | None = None) -> JobSpec:
    """Leaf 1 of job 1: global workers 2 and 3 on ports 1 and 2 (0 and 1 are behind leaf 0)."""
    return JobSpec(
        LEAF_JOB,
        (None, None, host_worker(1), host_worker(2)),
        quorum=quorum,
        role=Role.LEAF,
        uplink=host_worker(UPLINK_PORT),
        leaf_id=1,
    )


def spine_spec() -> JobSpec:
    """Job 2's spine: leaves 0, 1, 2 on ports 1, 2, 3."""
    return JobSpec(SPINE_JOB, workers(1, 2, 3), role=Role.SPINE)


def result(job: int, closer: int, values, count: int, bitmap: int, seq: int = 1, **kw) -> bytes:
    """The spine's RESULT as it reaches a leaf from its uplink."""
    return make_packet(
        Op.RESULT, job_id=job, worker_id=closer, seq=seq, payload=values, count=count, bitmap=bitmap, **kw
    )


def partial(
    job: int, leaf: int, values, count: int, bitmap: int, op: Op = Op.GRAD, seq: int = 1, **kw
) -> bytes:
    """A leaf's partial as it reaches the spine: contributor ``leaf``, its count and bitmap."""
    return make_packet(
        op, job_id=job, worker_id=leaf, seq=seq, payload=values, count=count, bitmap=bitmap, **kw
    )


def check_up(out, op: Op, payload, **fields) -> None:
    """``out`` is one packet to the uplink: the leaf's partial (``op``) as contributor 1."""
    assert [p for p, _ in out] == [UPLINK_PORT], out
    got = decode(out[0][1])
    assert got["op"] == op and got["worker_id"] == 1 and got["job_id"] == LEAF_JOB
    for name, value in fields.items():
        assert got[name] == value, (name, got[name], value)
    np.testing.assert_array_equal(got["payload"], np.asarray(payload, dtype=np.int64))


# ---- a leaf ---------------------------------------------------------------------------------------
def test_leaf_sends_closed_rounds_up_and_multicasts_the_spines_result(fresh):
    fresh.configure(lambda ctl: ctl.add_job(leaf_spec()))
    assert all(ctl.jobs()[LEAF_JOB].role == Role.LEAF for ctl in fresh.controllers)
    total = vec(7) + vec(8) + vec(9)  # the spine's sum: leaf 0's workers 0, leaf 1's 2 and 3
    retx = int(Flag.RETX)
    out = run(
        fresh,
        [
            (1, grad(1, 2, vec(8), weight=2, step=4, chunk=6)),
            (2, grad(1, 3, vec(9), weight=3, step=4, chunk=6)),  # quorum: the partial goes up
            (2, grad(1, 3, vec(9), weight=3)),  # no answer yet: the partial again (RETX)
            (1, flush(1, 2)),  # first-try FLUSH of a forwarded round: again as a GRAD (state 0 -> 1)
            (1, flush(1, 2)),  # another first-try FLUSH: held (up_held)
            (2, flush(1, 3, flags=retx)),  # a worker's repeated FLUSH: up as a FLUSH (closes the spine)
            (UPLINK_PORT, result(1, 0, total, 3, 0b1101, weight=9, step=4, chunk=6)),  # down
            (2, grad(1, 3, vec(9))),  # late: the global RESULT, unicast
            (1, flush(1, 2, flags=retx)),  # FLUSH (repeated or not): the same
            (UPLINK_PORT, result(1, 0, total, 3, 0b1101, seq=0)),  # older round: down_stale
            (1, result(1, 0, total, 3, 0b1101)),  # a RESULT from a worker's port: malformed
            (1, grad(1, 2, vec(1), slot=1)),  # slot 1 opens ...
            (UPLINK_PORT, result(1, 0, vec(2), 1, 0b1, slot=1)),  # ... and the spine closed it without us
            (UPLINK_PORT, result(1, 0, vec(2), 1, 0b1, slot=1, flags=retx)),  # RETX kept
            (1, flush(1, 2, slot=2, flags=int(Flag.MAX), exp=3)),  # never seen: an empty partial up (state 0)
            (2, flush(1, 3, slot=2)),  # first-try FLUSH of a round a FLUSH closed: up again as a GRAD
            (1, flush(1, 2, slot=2)),  # held
            (2, flush(1, 3, slot=2, flags=retx)),  # repeated: up as a FLUSH
            (1, grad(1, 2, vec(5), slot=3)),
            (2, grad(1, 3, vec(6), slot=3)),  # quorum: up
            (2, flush(1, 3, slot=3, flags=retx)),  # repeated FLUSH at state 0: up as a FLUSH (state 1)
            (1, flush(1, 2, slot=3)),  # first-try FLUSH at state 1: held
            (2, make_packet(Op.PARAM, job_id=1, worker_id=3, payload=vec(3))),  # to worker 2 (port 1) only
            (1, grad(1, 0, vec(1))),  # worker 0 is leaf 0's: bad worker here
        ],
    )
    assert [len(o) for o in out] == [0, 1, 1, 1, 0, 1, 2, 1, 1, 0, 0, 0, 2, 2, 1, 1, 0, 1, 0, 1, 1, 0, 1, 0]
    mine = vec(8) + vec(9)
    up = dict(count=2, bitmap=0b1100, weight=5, step=4, chunk=6, seq=1, slot=0)
    check_up(out[1], Op.GRAD, mine, flags=0, **up)
    check_up(out[2], Op.GRAD, mine, flags=retx, **up)
    check_up(out[3], Op.GRAD, mine, flags=retx, **up)
    check_up(out[5], Op.FLUSH, mine, flags=retx, **up)
    final = dict(count=3, bitmap=0b1101, weight=9, step=4, chunk=6, worker_id=0, job_id=1)
    assert_result(out[6], [1, 2], total, flags=0, **final)
    assert_result(out[7], [2], total, flags=retx, **final)
    assert_result(out[8], [1], total, flags=retx, **final)
    assert_result(out[12], [1, 2], vec(2), flags=0, count=1, bitmap=1, slot=1)
    assert_result(out[13], [1, 2], vec(2), flags=retx, count=1, bitmap=1, slot=1)
    empty = dict(count=0, bitmap=0, weight=0, slot=2, exp=3)
    check_up(out[14], Op.GRAD, np.zeros(64), flags=int(Flag.MAX), **empty)
    check_up(out[15], Op.GRAD, np.zeros(64), flags=int(Flag.MAX | Flag.RETX), **empty)
    check_up(out[17], Op.FLUSH, np.zeros(64), flags=int(Flag.MAX | Flag.RETX), **empty)
    three = dict(count=2, bitmap=0b1100, weight=0, slot=3)
    check_up(out[19], Op.GRAD, vec(5) + vec(6), flags=0, **three)
    check_up(out[20], Op.FLUSH, vec(5) + vec(6), flags=retx, **three)
    assert out[22] == [(1, make_packet(Op.PARAM, job_id=1, worker_id=3, payload=vec(3)))]
    check_counters(
        fresh,
        {1: dict(rx_packets=24, grad_start=3, grad_add=2, result_quorum=2, up_partial=3, up_resend=6,
                 up_held=3, down_result=3, down_stale=1, grad_late_resend=1, flush_resend=1,
                 drop_malformed=1, flush_empty=1, param_fwd=1, drop_bad_worker=1, tx_packets=18)},
        {1: [0, 0, 9, 9]},  # a RESULT passes no worker check; worker 0's GRAD is not leaf 1's
    )  # fmt: skip


def test_leaf_quorum_and_policies_count_its_own_workers(fresh):
    fresh.configure(lambda ctl: ctl.add_job(leaf_spec(quorum=1)))
    fresh.configure(lambda ctl: ctl.set_drop_policy(1, "down", DropPolicy("bernoulli", p=1.0), worker=3))
    out = run(
        fresh,
        [
            (2, grad(1, 3, vec(1))),  # quorum 1: up at once
            (1, grad(1, 2, vec(2))),  # late: not added, the partial again
            (UPLINK_PORT, result(1, 1, vec(1), 1, 0b1000)),  # worker 3's replica dropped (down policy)
        ],
    )
    check_up(out[0], Op.GRAD, vec(1), count=1, bitmap=0b1000, flags=0)
    check_up(out[1], Op.GRAD, vec(1), count=1, bitmap=0b1000, flags=int(Flag.RETX))
    assert_result(out[2], [1], vec(1), count=1, bitmap=0b1000, worker_id=1)
    check_counters(
        fresh,
        {1: dict(rx_packets=3, grad_start=1, result_quorum=1, up_partial=1, up_resend=1, down_result=1,
                 drop_policy_down=1, tx_packets=3)},
    )  # fmt: skip


# ---- a spine --------------------------------------------------------------------------------------
def test_spine_adds_partials_weighted_by_their_counts(fresh):
    fresh.configure(lambda ctl: ctl.add_job(spine_spec()))
    assert all(ctl.jobs()[SPINE_JOB].role == Role.SPINE for ctl in fresh.controllers)
    a, b, c = vec(1), vec(2), vec(3)
    out = run(
        fresh,
        [
            (1, partial(2, 0, a, 2, 0b00011, weight=5, step=3, chunk=2)),
            (2, partial(2, 1, b, 1, 0b00100, weight=1)),
            (2, partial(2, 1, b, 1, 0b00100, weight=1)),  # leaf 1's part is in: dup
            (3, partial(2, 2, c, 1, 0b00001)),  # worker 0 counted through leaf 0 already: dup
            (3, partial(2, 2, c, 2, 0b11000, exp=4)),  # other exponent: mismatch
            (3, partial(2, 2, c, 3, 0b11000)),  # count is not the bitmap's size: malformed
            (3, partial(2, 2, c, 2, 0b11000, weight=2)),  # the third leaf: closes, to every leaf
            (1, partial(2, 0, a, 2, 0b00011)),  # closed: the RESULT again to leaf 0
            (2, partial(2, 1, b, 1, 0b00100, op=Op.FLUSH)),  # FLUSH of a closed round: resend
            (1, partial(2, 0, a, 2, 0b11, seq=0)),  # stale
            (1, partial(2, 0, a, 2, 0b11, seq=0, op=Op.FLUSH)),  # stale FLUSH
        ],
    )
    assert [len(o) for o in out] == [0, 0, 0, 0, 0, 0, 3, 1, 1, 0, 0]
    closed = dict(count=5, bitmap=0b11111, weight=8, step=3, chunk=2, worker_id=2, job_id=2)
    assert_result(out[6], [1, 2, 3], a + b + c, flags=0, **closed)
    assert_result(out[7], [1], a + b + c, flags=int(Flag.RETX), **closed)
    assert_result(out[8], [2], a + b + c, flags=int(Flag.RETX), **closed)
    check_counters(
        fresh,
        {2: dict(rx_packets=11, grad_start=1, grad_add=2, grad_dup=2, grad_exp_mismatch=1, drop_malformed=1,
                 result_quorum=1, grad_late_resend=1, flush_resend=1, grad_stale=1, flush_stale=1,
                 tx_packets=5)},
        {2: [4, 3, 3]},  # the malformed partial passed no worker check
    )  # fmt: skip


def test_duplicate_at_a_lowered_quorum_at_a_leaf_and_a_spine(fresh):
    """docs/protocol.md, "A duplicate at the quorum": a leaf whose quorum is lowered under an open round
    sends the partial up at a worker's resend (up_partial); a spine closes at a leaf's resent partial,
    or at a partial overlapping the round (both grad_dup), once popcount(parts) meets the new quorum."""
    fresh.configure(lambda ctl: ctl.add_job(leaf_spec()))
    fresh.configure(lambda ctl: ctl.add_job(spine_spec()))
    out = run(
        fresh,
        [
            (1, grad(1, 2, vec(1), weight=1)),  # leaf: worker 2 in, worker 3 died
            (1, grad(1, 2, vec(1), weight=1)),  # quorum 2: a plain duplicate
            (1, partial(2, 0, vec(2), 2, 0b0011, weight=2)),  # spine slot 0: leaves 0 and 1 in
            (2, partial(2, 1, vec(3), 1, 0b0100, weight=1)),
            (1, partial(2, 0, vec(4), 1, 0b0001, slot=1)),  # spine slot 1: leaf 0 in
            (2, partial(2, 1, vec(5), 1, 0b0100, slot=1)),  # and leaf 1
        ],
    )
    assert out == [[]] * 6
    fresh.configure(lambda ctl: ctl.set_quorum(1, 1))
    fresh.configure(lambda ctl: ctl.set_quorum(2, 2))
    out = run(
        fresh,
        [
            (1, grad(1, 2, vec(9), weight=1)),  # leaf: at the quorum, the partial goes up
            (2, partial(2, 1, vec(3), 1, 0b0100, weight=1)),  # spine: leaf 1's resend closes slot 0
            (3, partial(2, 2, vec(6), 1, 0b0001, slot=1)),  # overlaps worker 0: closes slot 1 too
        ],
    )
    assert [len(o) for o in out] == [1, 3, 3]
    check_up(out[0], Op.GRAD, vec(1), count=1, bitmap=0b0100, weight=1, flags=0)
    assert_result(out[1], [1, 2, 3], vec(2) + vec(3), count=3, bitmap=0b0111, weight=3, worker_id=1)
    assert_result(out[2], [1, 2, 3], vec(4) + vec(5), count=2, bitmap=0b0101, worker_id=2, slot=1)
    check_counters(
        fresh,
        {1: dict(rx_packets=3, grad_start=1, grad_dup=2, result_quorum=1, up_partial=1, tx_packets=1),
         2: dict(rx_packets=6, grad_start=2, grad_add=2, grad_dup=2, result_quorum=2, tx_packets=6)},
    )  # fmt: skip


def test_spine_flush_and_empty_partials(fresh):
    fresh.configure(lambda ctl: ctl.add_job(spine_spec()))
    a, b, c = vec(4), vec(5), vec(6)
    out = run(
        fresh,
        [
            (1, partial(2, 0, None, 0, 0, slot=1)),  # an empty partial opens slot 1 with count 0
            (2, partial(2, 1, b, 1, 0b00100, slot=1, exp=5, flags=int(Flag.MAX))),  # takes its values
            (3, partial(2, 2, c, 2, 0b11000, slot=1, exp=5, flags=int(Flag.MAX), op=Op.FLUSH)),  # add, close
            (1, partial(2, 0, a, 2, 0b00011, slot=2, op=Op.FLUSH)),  # never seen: starts and closes
            (1, partial(2, 0, None, 0, 0, slot=3, op=Op.FLUSH)),  # never seen, empty: flush_empty
            (1, partial(2, 0, a, 1, 0b00001, slot=4)),
            (2, partial(2, 1, b, 1, 0b00001, slot=4, op=Op.FLUSH)),  # overlaps: closes, not added
            (1, partial(2, 0, a, 1, 0b00001, slot=5)),
            (1, partial(2, 0, a, 1, 0b00001, slot=5, op=Op.FLUSH)),  # its partial is in: only closes
            (1, partial(2, 0, a, 1, 0b00001, slot=6, exp=3)),
            (2, partial(2, 1, b, 1, 0b00100, slot=6, exp=4, op=Op.FLUSH)),  # mismatch: closes, not added
            (1, partial(2, 0, None, 0, 0, slot=7)),
            (2, partial(2, 1, None, 0, 0, slot=7)),
            (3, partial(2, 2, None, 0, 0, slot=7)),  # three empty partials: quorum, count 0
        ],
    )
    assert [len(o) for o in out] == [0, 0, 3, 3, 3, 0, 3, 0, 3, 0, 3, 0, 0, 3]
    mx = int(Flag.MAX)
    assert_result(out[2], [1, 2, 3], np.maximum(b, c), count=3, bitmap=0b11100, exp=5, flags=mx, slot=1)
    assert_result(out[3], [1, 2, 3], a, count=2, bitmap=0b00011, slot=2, worker_id=0)
    assert_result(out[4], [1, 2, 3], np.zeros(64), count=0, bitmap=0, slot=3)
    assert_result(out[6], [1, 2, 3], a, count=1, bitmap=0b00001, slot=4, worker_id=1)
    assert_result(out[8], [1, 2, 3], a, count=1, bitmap=0b00001, slot=5, worker_id=0)
    assert_result(out[10], [1, 2, 3], a, count=1, bitmap=0b00001, slot=6, exp=3)
    assert_result(out[13], [1, 2, 3], np.zeros(64), count=0, bitmap=0, slot=7, worker_id=2)
    check_counters(
        fresh,
        {2: dict(rx_packets=14, grad_start=5, grad_add=3, result_quorum=1, flush_partial=5, flush_empty=1,
                 grad_dup=1, grad_exp_mismatch=1, tx_packets=21)},
    )  # fmt: skip


def test_spine_policies_are_by_leaf(fresh):
    fresh.configure(lambda ctl: ctl.add_job(spine_spec()))

    def policies(ctl: LtaSwitch) -> None:
        ctl.set_drop_policy(2, "up", DropPolicy("bernoulli", p=1.0), worker=1)
        ctl.set_drop_policy(2, "down", DropPolicy("bernoulli", p=1.0), worker=2)

    fresh.configure(policies)
    out = run(
        fresh,
        [
            (1, partial(2, 0, vec(1), 1, 0b1)),
            (2, partial(2, 1, vec(2), 1, 0b10)),  # leaf 1's partial lost (up policy)
            (3, partial(2, 2, vec(3), 1, 0b100)),
            (2, partial(2, 1, vec(2), 1, 0b10, op=Op.FLUSH)),  # a FLUSH passes: closes, leaf 2 loses it
        ],
    )
    assert_result(out[3], [1, 2], vec(1) + vec(2) + vec(3), count=3, bitmap=0b111, worker_id=1)
    check_counters(
        fresh,
        {2: dict(rx_packets=4, grad_start=1, drop_policy_up=1, grad_add=1, flush_partial=1,
                 drop_policy_down=1, tx_packets=2)},
    )  # fmt: skip


@pytest.mark.bmv2
@pytest.mark.skipif(diff._missing() is not None, reason=diff._missing() or "")
def test_seeded_random_leaf_and_spine_sequence(fresh_pair):
    """A leaf job and a spine job side by side, fed a seeded mix of GRADs, FLUSHes, RESULTs from the
    uplink (and from elsewhere), partials with random bitmaps (some with a wrong count), exponents,
    MAX / SATURATED / CRITICAL / RETX / OWNER flags and spoofed ports: both switches agree packet by
    packet. Differential only (BMv2's agreement is its one expectation), so it needs BMv2; the leaf's
    and the spine's rules are checked by hand in the tests above, on every switch."""
    fresh = fresh_pair
    fresh.configure(lambda ctl: ctl.add_job(leaf_spec(quorum=2)))
    fresh.configure(lambda ctl: ctl.add_job(spine_spec()))
    rng = random.Random(2027)
    flags_ = (Flag.MAX, Flag.SATURATED, Flag.CRITICAL, Flag.RETX, Flag.OWNER)
    flag_choices = (0, 0, 0, *(int(f) for f in flags_))
    packets = []
    for i in range(400):
        fields = dict(
            slot=rng.randrange(3),
            seq=i // 25 + rng.choice((1, 1, 1, 0)),  # rounds move on, with some stale packets
            exp=rng.choice((0, 0, 1)),
            flags=rng.choice(flag_choices),
            weight=rng.randrange(4),
        )
        values = vec(rng.randrange(10**6))
        if rng.random() < 0.5:  # the leaf: its workers 2 and 3, or the spine's RESULT on port 4
            kind = rng.choices(("grad", "flush", "result", "param"), (0.6, 0.2, 0.12, 0.08))[0]
            w = rng.choice((2, 3, 3, 2, 0))
            port = w - 1 if w else 1
            if kind == "result":
                bitmap = rng.randrange(16)
                lta = result(1, rng.randrange(4), values, bitmap.bit_count(), bitmap, **fields)
                port = UPLINK_PORT if rng.random() > 0.1 else 1
            elif kind == "param":
                lta = make_packet(Op.PARAM, job_id=1, worker_id=w, payload=values)
            elif kind == "grad":
                lta = grad(1, w, values, **fields)
            else:
                lta = flush(1, w, **fields)
        else:  # the spine: partials from leaves 0..2 on ports 1..3
            leaf = rng.randrange(3)
            # mostly the leaf's own workers (2 per leaf, some lost), sometimes anyone's (overlaps)
            bitmap = rng.randrange(4) << (2 * leaf) if rng.random() > 0.1 else rng.randrange(256)
            count = bitmap.bit_count() + (1 if rng.random() < 0.05 else 0)
            op = Op.GRAD if rng.random() < 0.75 else Op.FLUSH
            lta = partial(2, leaf, values, count, bitmap, op=op, **fields)
            port = leaf + 1 if rng.random() > 0.05 else rng.randint(1, 4)
        packets.append((port, lta))
    out = run(fresh, packets)
    assert fresh.bmv2 is not None  # the comparison ran
    assert sum(len(o) for o in out) > 80  # rounds really closed, went up and came down
    counters = fresh.counters()[0][0]
    assert counters[1]["up_partial"] > 5 and counters[1]["down_result"] > 10 and counters[2]["grad_add"] > 10


# ---- OWNER (owner-only RESULT) is a flat job's: a leaf and a spine ignore it -----------------------
def test_owner_flag_is_ignored_in_leaf_and_spine_rounds(fresh):
    """Flag.OWNER with an owner in `count` (docs/protocol.md, "Owner-only RESULT"): a leaf's round does
    not keep it (its partial goes up without it, with the partial's count), the spine's RESULT reaches
    all the leaf's workers, and a spine reads a partial's `count` as its count, never as an owner."""
    fresh.configure(lambda ctl: ctl.add_job(leaf_spec()))
    fresh.configure(lambda ctl: ctl.add_job(spine_spec()))
    own, retx = int(Flag.OWNER), int(Flag.RETX)
    total = vec(1) + vec(2) + vec(3)
    a, b, c = vec(4), vec(5), vec(6)
    out = run(
        fresh,
        [
            (1, grad(1, 2, vec(1), flags=own, count=3)),  # owner 3 named: ignored at a leaf
            (2, grad(1, 3, vec(2), flags=own, count=3)),  # quorum: the partial up, no OWNER, count 2
            (UPLINK_PORT, result(1, 0, total, 3, 0b1101, flags=own)),  # to both workers, OWNER dropped
            (2, grad(1, 3, vec(2), flags=own, count=3)),  # late: unicast to the asker
            (1, flush(1, 2, slot=1, flags=own, count=2)),  # never seen: an empty partial up, no OWNER
            (1, partial(2, 0, a, 2, 0b0011, flags=own)),  # a spine: count 2 is the partial's
            (2, partial(2, 1, b, 1, 0b0100, flags=own)),
            (3, partial(2, 2, c, 1, 0b1000)),  # quorum: the RESULT to every leaf
            (1, partial(2, 0, None, 0, 0, slot=1, op=Op.FLUSH, flags=own)),  # never seen, empty: to all
        ],
    )
    assert [len(o) for o in out] == [0, 1, 2, 1, 1, 0, 0, 3, 3]
    check_up(out[1], Op.GRAD, vec(1) + vec(2), flags=0, count=2, bitmap=0b1100)
    assert_result(out[2], [1, 2], total, flags=0, count=3, bitmap=0b1101)
    assert_result(out[3], [2], total, flags=retx, count=3, bitmap=0b1101)
    check_up(out[4], Op.GRAD, np.zeros(64), flags=0, count=0, bitmap=0, slot=1)
    assert_result(out[7], [1, 2, 3], a + b + c, flags=0, count=4, bitmap=0b1111, worker_id=2)
    assert_result(out[8], [1, 2, 3], np.zeros(64), flags=0, count=0, bitmap=0, slot=1)
    check_counters(
        fresh,
        {1: dict(rx_packets=5, grad_start=1, grad_add=1, result_quorum=1, up_partial=2, down_result=1,
                 grad_late_resend=1, flush_empty=1, tx_packets=5),
         2: dict(rx_packets=4, grad_start=1, grad_add=2, result_quorum=1, flush_empty=1, tx_packets=6)},
        {1: [0, 0, 2, 2], 2: [2, 1, 1]},
    )  # fmt: skip


# ---- a whole tree: 2 leaves x 2 workers and a spine, loss on both levels ---------------------------
class Fabric:
    """Moves packets between workers (2 per leaf, on leaf ports 1 and 2), the leaves (uplink port 3)
    and the spine (leaf l on port l + 1), dropping each with probability ``loss`` on every hop; the
    drops are the test's, so BMv2 and the softswitch see the same packets. ``lost`` counts the drops
    on the worker-leaf links ("down": both ways) and the leaf-spine links ("up": both ways)."""

    def __init__(self, leaves: tuple[Node, Node], spine: Node, rng: random.Random, loss: float) -> None:
        self.leaves, self.spine, self.rng, self.loss = leaves, spine, rng, loss
        self.queue: list[tuple[int | None, int, bytes]] = []  # (leaf id or None: the spine, port, packet)
        self.lost = {"up": 0, "down": 0}

    def _hop(self, level: str) -> bool:
        if self.rng.random() < self.loss:
            self.lost[level] += 1
            return False
        return True

    def send(self, w: int, lta: bytes) -> None:
        if self._hop("down"):
            self.queue.append((w // 2, w % 2 + 1, lta))

    def deliver(self, slot: int, seq: int, got: dict[int, bytes]) -> None:
        """Run every packet in flight to the end; a worker keeps the first RESULT of (slot, seq) it gets."""
        while self.queue:
            leaf_id, port, lta = self.queue.pop(0)
            if leaf_id is None:
                for out_port, out in self.spine.step(port, lta):
                    if self._hop("up"):
                        self._from_spine(out_port, out, slot, seq, got)
                continue
            for out_port, out in self.leaves[leaf_id].step(port, lta):
                if out_port == 3:
                    if self._hop("up"):
                        self.queue.append((None, leaf_id + 1, out))
                elif self._hop("down"):
                    self._take(2 * leaf_id + out_port - 1, out, slot, seq, got)

    def _from_spine(self, out_port: int, out: bytes, slot: int, seq: int, got: dict[int, bytes]) -> None:
        """A packet the spine sent out of ``out_port`` and the link let through: to leaf out_port - 1."""
        self.queue.append((out_port - 1, 3, out))

    @staticmethod
    def _take(w: int, out: bytes, slot: int, seq: int, got: dict[int, bytes]) -> None:
        """Worker ``w`` receives ``out``, a RESULT: it keeps the first one of (slot, seq)."""
        header = decode(out)
        assert header["op"] == Op.RESULT
        if (header["slot"], header["seq"]) == (slot, seq):
            got.setdefault(w, out)

    def round(self, slot: int, seq: int, values: dict[int, np.ndarray]) -> dict[int, bytes]:
        """Every worker sends its GRAD, then FLUSHes (as hosts do, with no timing here; every FLUSH
        after a worker's first carries RETX) until it holds the round's RESULT (at most 40 tries);
        returns worker -> the RESULT it took."""
        got: dict[int, bytes] = {}
        for w in range(4):
            self.send(w, grad(1, w, values[w], slot=slot, seq=seq, weight=1))
        self.deliver(slot, seq, got)
        for attempt in range(40):
            waiting = [w for w in range(4) if w not in got]
            if not waiting:
                break
            for w in waiting:
                self.send(w, flush(1, w, slot=slot, seq=seq, flags=int(Flag.RETX) if attempt else 0))
            self.deliver(slot, seq, got)
        return got


@dataclass
class Node:
    """One switch of the tree: BMv2 (where installed) and a softswitch, configured alike."""

    pair: Pair

    def step(self, port: int, lta: bytes) -> list[tuple[int, bytes]]:
        expected = sorted(self.pair.softswitch.process(lta, port))
        if self.pair.bmv2 is not None:
            frames = self.pair.bmv2.exchange(port, worker_frame(lta, host_worker(port)), len(expected))
            for out_port, frame in frames:
                check_frame(out_port, frame)
            got = sorted((out_port, lta_of(frame)[0]) for out_port, frame in frames)
            assert got == expected, f"{lta[:12].hex()}... on port {port} differs"
        return expected


def _node(bmv2: Bmv2Switch | None) -> Iterator[Node]:
    softswitch = SoftSwitch(seed=1)
    server, port, _ = serve(softswitch)
    controllers = [LtaSwitch.connect(f"127.0.0.1:{port}")]
    if bmv2 is not None:
        controllers.insert(0, LtaSwitch.connect(bmv2.target, timeout_s=10))
    try:
        for ctl in controllers:
            ctl.load_pipeline(BMV2_JSON_PATH)
        yield Node(Pair(bmv2, softswitch, controllers))
    finally:
        for ctl in controllers:
            ctl.close()
        server.stop(None)


@pytest.fixture(params=["softswitch", pytest.param("bmv2", marks=needs_bmv2)])
def tree(request) -> Iterator[list[Node]]:
    """Leaf 0, leaf 1 and the spine (in that order), each a BMv2 + softswitch pair or a softswitch."""
    with_bmv2 = request.param == "bmv2"
    switches = [Bmv2Switch(3, prefix=f"lto{i}h") if with_bmv2 else None for i in range(3)]
    try:
        for s in switches:
            if s is not None:
                s.start()
        gens = [_node(s) for s in switches]
        nodes = [next(g) for g in gens]
        yield nodes
        for g in gens:
            g.close()
    finally:
        for s in switches:
            if s is not None:
                s.stop()


def check_one_global_result(
    g: int, got: dict[int, bytes], values: dict[int, np.ndarray], ignored: tuple[str, ...]
) -> list[int]:
    """Round ``g``: all 4 workers took a RESULT, the same one but for the ``ignored`` fields (RETX
    resends), whose payload is the sum of ``values`` over exactly the workers of its bitmap, with count
    and weight its size (so sum / count is their mean). Returns the counted workers."""
    assert sorted(got) == [0, 1, 2, 3], f"round {g}: {sorted(set(range(4)) - set(got))} unanswered"
    fields = [decode(lta) for lta in got.values()]
    first = fields[0]
    for f in fields[1:]:  # one global RESULT for everyone
        assert {k: v for k, v in f.items() if k not in ignored} == {
            k: v for k, v in first.items() if k not in ignored
        }
        np.testing.assert_array_equal(f["payload"], first["payload"])
    counted = [w for w in range(4) if first["bitmap"] >> w & 1]
    assert first["bitmap"] < 16 and first["count"] == len(counted) == first["weight"]
    expected = sum((values[w] for w in counted), np.zeros(64, dtype=np.int64))
    np.testing.assert_array_equal(first["payload"], expected)
    if counted:
        mean = first["payload"] / first["count"]
        np.testing.assert_allclose(mean, np.mean([values[w] for w in counted], axis=0))
    return counted


def test_two_leaves_two_workers_each_with_loss_on_both_levels(tree):
    """Workers 0, 1 on leaf 0 (ports 1, 2), workers 2, 3 on leaf 1; each leaf's port 3 goes to the spine,
    whose ports 1 and 2 are leaves 0 and 1. Every hop drops packets at random (seeded: the same drops
    for BMv2 and the softswitch); workers FLUSH until they hold their round's RESULT. Every RESULT a
    worker takes is the sum of the values of exactly the workers in its bitmap, and its count is the
    bitmap's size (so sum / count is the mean over the counted set); all workers of a round take the
    same one. BMv2 and the softswitch agree on every packet and every counter."""
    leaf0, leaf1, spine = tree
    uplink = host_worker(3)
    for leaf_id, node in enumerate((leaf0, leaf1)):
        entries: list = [None] * 4
        entries[2 * leaf_id], entries[2 * leaf_id + 1] = host_worker(1), host_worker(2)
        job = JobSpec(1, tuple(entries), role=Role.LEAF, uplink=uplink, leaf_id=leaf_id, pool_size=4)
        node.pair.configure(lambda ctl, job=job: ctl.add_job(job))
    spine.pair.configure(lambda ctl: ctl.add_job(JobSpec(1, workers(1, 2), role=Role.SPINE, pool_size=4)))
    fabric = Fabric((leaf0, leaf1), spine, random.Random(27), loss=0.15)
    partial_rounds = 0
    for g in range(16):
        slot, seq = g % 4, g // 4 + 1
        values = {w: vec(1000 * g + w, -(2**20), 2**20) for w in range(4)}
        counted = check_one_global_result(g, fabric.round(slot, seq, values), values, ("payload", "flags"))
        partial_rounds += len(counted) < 4
    assert (
        fabric.lost["up"] > 5 and fabric.lost["down"] > 5 and partial_rounds >= 1
    )  # loss bit at both levels
    for node in tree:
        if node.pair.bmv2 is not None:
            bmv2_counters, soft_counters = node.pair.counters()
            assert bmv2_counters == soft_counters
    spine_counters = spine.pair.controllers[-1].read_counters(1)[1]
    leaf_counters = [node.pair.controllers[-1].read_counters(1)[1] for node in (leaf0, leaf1)]
    assert sum(c["up_partial"] for c in leaf_counters) >= 16 and spine_counters["rx_packets"] >= 16
    assert sum(c["down_result"] for c in leaf_counters) >= 16
    assert sum(c["up_held"] for c in leaf_counters) >= 1  # first-try FLUSHes after a resend were held


class OwnLeafFabric(Fabric):
    """Workers 0, 1 behind leaf 0 (its ports 1, 2; uplink port 3 to the spine's port 1), and workers 2
    and 3 each its own leaf (docs/protocol.md, "A worker as its own leaf"): contributors 1 and 2, on
    the spine's ports 2 and 3. Their hosts are modelled here by hand: a GRAD is a partial of one
    (``worker_id`` = the leaf id, count 1, the worker's bit); the first FLUSH of a round sends it again
    as a GRAD, later ones as a FLUSH, all flagged RETX. Every hop drops with probability ``loss``."""

    OWN = {2: 1, 3: 2}  # worker -> its leaf id at the spine (= spine port - 1)

    def _own_partial(self, w: int, values, slot: int, seq: int, op: Op, retx: bool) -> bytes:
        flags = int(Flag.RETX) if retx else 0
        return partial(1, self.OWN[w], values, 1, 1 << w, op=op, seq=seq, slot=slot, weight=1, flags=flags)

    def send_own(self, w: int, lta: bytes) -> None:
        if self._hop("up"):
            self.queue.append((None, self.OWN[w] + 1, lta))

    def _from_spine(self, out_port: int, out: bytes, slot: int, seq: int, got: dict[int, bytes]) -> None:
        if out_port == 1:  # leaf 0
            super()._from_spine(out_port, out, slot, seq, got)
        else:  # straight to the worker that is its own leaf (worker 2 on port 2, 3 on port 3)
            self._take(out_port, out, slot, seq, got)

    def round(self, slot: int, seq: int, values: dict[int, np.ndarray]) -> dict[int, bytes]:
        got: dict[int, bytes] = {}
        for w in (0, 1):
            self.send(w, grad(1, w, values[w], slot=slot, seq=seq, weight=1))
        for w in self.OWN:
            self.send_own(w, self._own_partial(w, values[w], slot, seq, Op.GRAD, retx=False))
        self.deliver(slot, seq, got)
        for attempt in range(40):
            waiting = [w for w in range(4) if w not in got]
            if not waiting:
                break
            for w in waiting:
                if w in self.OWN:
                    op = Op.FLUSH if attempt else Op.GRAD
                    self.send_own(w, self._own_partial(w, values[w], slot, seq, op, retx=True))
                else:
                    self.send(w, flush(1, w, slot=slot, seq=seq, flags=int(Flag.RETX) if attempt else 0))
            self.deliver(slot, seq, got)
        return got


def test_workers_that_are_their_own_leaves_beside_a_leaf_switch(tree):
    """A spine with three contributors: leaf 0 (a switch serving workers 0 and 1) and workers 2 and 3,
    each its own leaf, their hosts sending what a one-worker leaf would send up (OwnLeafFabric). Every
    hop drops 15% (seeded, the same for BMv2 and the softswitch). Every RESULT a worker takes is the sum
    over exactly the workers of its global bitmap, count = its size; all workers of a round take the
    same one; BMv2 and the softswitch agree on every packet and counter. The spine is the unchanged
    P4 program: only the hosts differ."""
    leaf0, _, spine = tree
    job = JobSpec(1, (host_worker(1), host_worker(2), None, None), role=Role.LEAF, uplink=host_worker(3),
                  leaf_id=0, pool_size=4)  # fmt: skip
    leaf0.pair.configure(lambda ctl: ctl.add_job(job))
    spine.pair.configure(lambda ctl: ctl.add_job(JobSpec(1, workers(1, 2, 3), role=Role.SPINE, pool_size=4)))
    fabric = OwnLeafFabric((leaf0, leaf0), spine, random.Random(5), loss=0.15)
    partial_rounds, own_counted = 0, 0
    for g in range(16):
        slot, seq = g % 4, g // 4 + 1
        values = {w: vec(700 * g + w, -(2**20), 2**20) for w in range(4)}
        got = fabric.round(slot, seq, values)
        counted = check_one_global_result(g, got, values, ("payload", "flags", "worker_id"))
        partial_rounds += len(counted) < 4
        own_counted += sum(w in counted for w in OwnLeafFabric.OWN)
    assert fabric.lost["up"] > 5 and fabric.lost["down"] > 5 and partial_rounds >= 1
    # A worker that is its own leaf sends its values again at its FLUSHes: counted unless every try was
    # lost (two or more tries at 15% a hop), where leaf 0's workers are left out at a lost GRAD.
    assert own_counted >= 0.9 * 2 * 16, own_counted
    for node in (leaf0, spine):
        if node.pair.bmv2 is not None:
            bmv2_counters, soft_counters = node.pair.counters()
            assert bmv2_counters == soft_counters
    counters = spine.pair.controllers[-1].read_counters(1)[1]
    assert counters["grad_dup"] + counters["grad_late_resend"] >= 1  # resent partials met a counted one
