"""Every branch of the switch contract (docs/protocol.md) with hand-built packets, counters checked."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.protocol import COUNTERS, HEADER_BYTES, Flag, Op, make_packet
from softswitch.pipeline import JobConfig, SoftSwitch

K = 4
PORTS = [10, 11, 12]  # ingress port of worker 0, 1, 2


def switch_with_job(quorum=None, pool=8, job_id=1, n=3) -> SoftSwitch:
    sw = SoftSwitch(seed=0)
    sw.add_job(JobConfig(job_id, PORTS[:n], quorum=quorum, pool_size=pool, elems_per_packet=K))
    return sw


def grad(w, slot=0, seq=1, values=(1, 2, 3, 4), job=1, **kw) -> bytes:
    return make_packet(
        Op.GRAD,
        job_id=job,
        worker_id=w,
        slot=slot,
        seq=seq,
        payload=np.array(values),
        elems_per_packet=K,
        **kw,
    )


def flush(w, slot=0, seq=1, job=1, **kw) -> bytes:
    return make_packet(
        Op.FLUSH, job_id=job, worker_id=w, slot=slot, seq=seq, elems_per_packet=K, nelem=0, **kw
    )


def decode(packet: bytes) -> tuple[dict, np.ndarray]:
    names = [
        "version",
        "op",
        "flags",
        "exp",
        "job_id",
        "worker_id",
        "count",
        "slot",
        "nelem",
        "seq",
        "step",
        "chunk",
        "weight",
        "bitmap",
    ]
    head = dict(zip(names, struct.unpack(">BBBbHBBHHIIIIQ", packet[:HEADER_BYTES]), strict=True))
    return head, np.frombuffer(packet[HEADER_BYTES:], dtype=">i4")


def changed(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in COUNTERS if after[k] != before[k]}


def test_full_round_sums_and_multicasts_with_count_and_bitmap():
    sw = switch_with_job()
    assert sw.process(grad(0, values=(1, 2, 3, 4), weight=5), 10) == []
    assert sw.process(grad(1, values=(10, 20, 30, 40), weight=6), 11) == []
    out = sw.process(grad(2, values=(-100, 0, 0, 2**30), weight=7), 12)
    assert [port for port, _ in out] == PORTS
    head, acc = decode(out[0][1])
    assert head["op"] == Op.RESULT and head["count"] == 3 and head["bitmap"] == 0b111
    assert head["weight"] == 18 and head["seq"] == 1 and head["slot"] == 0
    assert list(acc) == [-89, 22, 33, 44 + 2**30]
    c = sw.read_counters(1)
    assert (c["grad_start"], c["grad_add"], c["result_quorum"], c["tx_packets"], c["rx_packets"]) == (
        1,
        2,
        1,
        3,
        3,
    )


def test_duplicate_while_open_is_dropped_and_not_added():
    sw = switch_with_job()
    sw.process(grad(0), 10)
    assert sw.process(grad(0, values=(100, 100, 100, 100)), 10) == []
    sw.process(grad(1), 11)
    out = sw.process(grad(2), 12)
    _, acc = decode(out[0][1])
    assert list(acc) == [3, 6, 9, 12]
    assert sw.read_counters(1)["grad_dup"] == 1


def test_late_grad_after_close_gets_unicast_retransmission():
    sw = switch_with_job()
    for w in range(3):
        sw.process(grad(w), PORTS[w])
    out = sw.process(grad(1), 11)  # worker 1 lost the RESULT and sends again
    assert len(out) == 1 and out[0][0] == 11
    head, acc = decode(out[0][1])
    assert head["flags"] & Flag.RETX and head["count"] == 3 and list(acc) == [3, 6, 9, 12]
    assert sw.read_counters(1)["grad_late_resend"] == 1


def test_higher_seq_reuses_slot_and_lower_seq_is_stale():
    sw = switch_with_job()
    for w in range(3):
        sw.process(grad(w, seq=1), PORTS[w])
    before = sw.read_counters(1)
    sw.process(grad(0, seq=2, values=(7, 7, 7, 7)), 10)
    assert sw.process(grad(1, seq=1), 11) == []  # older round: stale, dropped
    sw.process(grad(1, seq=2, values=(1, 1, 1, 1)), 11)
    out = sw.process(grad(2, seq=2, values=(2, 2, 2, 2)), 12)
    head, acc = decode(out[0][1])
    assert head["seq"] == 2 and list(acc) == [10, 10, 10, 10]
    assert changed(before, sw.read_counters(1)) == {
        "rx_packets": 4,
        "grad_start": 1,
        "grad_stale": 1,
        "grad_add": 2,
        "result_quorum": 1,
        "tx_packets": 3,
    }


def test_flush_partial_then_flush_resend_then_flush_stale():
    sw = switch_with_job()
    sw.process(grad(0, values=(5, 5, 5, 5)), 10)
    out = sw.process(flush(1), 11)
    assert [p for p, _ in out] == PORTS
    head, acc = decode(out[0][1])
    assert head["count"] == 1 and head["bitmap"] == 0b001 and list(acc) == [5, 5, 5, 5]
    resend = sw.process(flush(2), 12)
    assert len(resend) == 1 and resend[0][0] == 12 and decode(resend[0][1])[0]["flags"] & Flag.RETX
    sw.process(grad(0, seq=2), 10)
    assert sw.process(flush(1, seq=1), 11) == []
    c = sw.read_counters(1)
    assert (c["flush_partial"], c["flush_resend"], c["flush_stale"]) == (1, 1, 1)


def test_flush_of_unseen_round_closes_with_count_zero():
    sw = switch_with_job()
    out = sw.process(flush(2, slot=3, seq=4, exp=11, chunk=99), 12)
    head, acc = decode(out[0][1])
    assert (head["count"], head["bitmap"], head["seq"], head["exp"], head["chunk"]) == (0, 0, 4, 11, 99)
    assert not acc.any()
    late = sw.process(grad(0, slot=3, seq=4), 10)  # arrives after the empty close: resend, not added
    assert decode(late[0][1])[0]["count"] == 0
    assert sw.read_counters(1)["flush_empty"] == 1


def test_quorum_below_n_closes_early():
    sw = switch_with_job(quorum=2)
    sw.process(grad(0), 10)
    out = sw.process(grad(2), 12)
    assert decode(out[0][1])[0]["bitmap"] == 0b101
    assert sw.process(grad(1), 11)[0][0] == 11  # the third is late: unicast resend


def test_exponent_mismatch_is_dropped_never_added():
    sw = switch_with_job()
    sw.process(grad(0, exp=3), 10)
    assert sw.process(grad(1, exp=4, values=(1000, 0, 0, 0)), 11) == []
    assert sw.process(grad(1, exp=3, flags=int(Flag.MAX)), 11) == []  # max vs sum is a mismatch too
    assert sw.read_counters(1)["grad_exp_mismatch"] == 2
    sw.process(grad(1, exp=3), 11)
    _, acc = decode(sw.process(grad(2, exp=3), 12)[0][1])
    assert list(acc) == [3, 6, 9, 12]


def test_max_round_takes_elementwise_max():
    sw = switch_with_job()
    sw.process(grad(0, values=(1, -5, 3, -(2**31)), flags=int(Flag.MAX)), 10)
    sw.process(grad(1, values=(4, -7, 2, -(2**31)), flags=int(Flag.MAX)), 11)
    out = sw.process(grad(2, values=(-1, -6, 9, -(2**31)), flags=int(Flag.MAX)), 12)
    head, acc = decode(out[0][1])
    assert head["flags"] & Flag.MAX and list(acc) == [4, -5, 9, -(2**31)]


def test_saturated_flag_is_ored_into_the_round():
    sw = switch_with_job()
    sw.process(grad(0), 10)
    sw.process(grad(1, flags=int(Flag.SATURATED)), 11)
    out = sw.process(grad(2), 12)
    assert decode(out[0][1])[0]["flags"] & Flag.SATURATED


def test_param_and_param_req_replicate_to_the_others():
    sw = switch_with_job()
    values = np.array([1.5, -2.0, 0.0, 3.25], dtype=">f4").view(">i4")
    pkt = make_packet(Op.PARAM, job_id=1, worker_id=1, chunk=7, payload=values, elems_per_packet=K)
    out = sw.process(pkt, 11)
    assert [p for p, _ in out] == [10, 12] and all(data == pkt for _, data in out)
    req = make_packet(Op.PARAM_REQ, job_id=1, worker_id=0, chunk=7, elems_per_packet=K)
    assert [p for p, _ in sw.process(req, 10)] == [11, 12]
    c = sw.read_counters(1)
    assert (c["param_fwd"], c["param_req_fwd"], c["tx_packets"]) == (1, 1, 4)


@pytest.mark.parametrize(
    "packet, ingress, counter, row",
    [
        (b"\x01\x01\x00", 10, "drop_malformed", 0),  # truncated header
        (grad(0)[: HEADER_BYTES + 3], 10, "drop_malformed", 1),  # truncated payload
        (b"\x02" + grad(0)[1:], 10, "drop_malformed", 1),  # wrong version
        (bytes([1, 9]) + grad(0)[2:], 10, "drop_malformed", 1),  # unknown op
        (make_packet(Op.RESULT, job_id=1, elems_per_packet=K), 10, "drop_malformed", 1),  # RESULT upstream
        (grad(0, job=9), 10, "drop_unknown_job", 0),
        (grad(0, slot=8), 10, "drop_slot_range", 1),
        (grad(0, nelem=K + 1), 10, "drop_malformed", 1),
        (grad(1), 10, "drop_bad_worker", 1),  # worker 1's id from worker 0's port: spoofed
        (grad(5), 15, "drop_bad_worker", 1),  # worker id beyond N
        (bytes(range(256)) * 2, 10, "drop_malformed", 0),  # garbage
    ],
)
def test_bad_input_is_dropped_and_counted(packet, ingress, counter, row):
    sw = switch_with_job()
    sw.add_job(JobConfig(2, [20, 21], pool_size=8, elems_per_packet=K))
    sw.process(grad(0, job=2, values=(1, 1, 1, 1)), 20)
    before = {j: sw.read_counters(j) for j in (0, 1, 2)}
    assert sw.process(packet, ingress) == []
    after = {j: sw.read_counters(j) for j in (0, 1, 2)}
    assert changed(before[row], after[row]) == {"rx_packets": 1, counter: 1}
    assert after[2] == before[2]  # the other job saw nothing
    # ...and its open round still completes with the right sum.
    _, acc = decode(sw.process(grad(1, job=2, values=(2, 2, 2, 2)), 21)[0][1])
    assert list(acc) == [3, 3, 3, 3]


def test_drop_policies_per_direction_and_worker():
    sw = switch_with_job()
    sw.set_drop_policy(1, "up", DropPolicy(p=1.0), worker=1)
    sw.set_drop_policy(1, "down", DropPolicy(p=1.0), worker=2)
    sw.process(grad(0), 10)
    assert sw.process(grad(1), 11) == []
    sw.process(grad(1, flags=int(Flag.CRITICAL)), 11)  # critical packets pass the emulated loss
    out = sw.process(grad(2), 12)
    assert [p for p, _ in out] == [10, 11]
    c = sw.read_counters(1)
    assert (c["drop_policy_up"], c["drop_policy_down"]) == (1, 1)


def test_bernoulli_policy_drops_at_its_rate_and_replays_with_the_seed():
    def run(seed):
        sw = SoftSwitch(seed=seed)
        sw.add_job(JobConfig(1, [10], pool_size=4096, elems_per_packet=K))
        sw.set_drop_policy(1, "up", DropPolicy(p=0.2))
        return [bool(sw.process(grad(0, slot=i % 4096, seq=1 + i // 4096), 10)) for i in range(5000)]

    delivered = np.array(run(3))
    loss = 1 - delivered.mean()
    assert abs(loss - 0.2) < 4 * np.sqrt(0.2 * 0.8 / 5000)
    assert run(3) == list(delivered) and run(4) != list(delivered)


def test_control_plane_errors_are_clear():
    sw = switch_with_job()
    with pytest.raises(ValueError, match="exists"):
        sw.add_job(JobConfig(1, [30]))
    with pytest.raises(ValueError, match="quorum"):
        JobConfig(3, [1, 2], quorum=3)
    with pytest.raises(ValueError, match="direction"):
        sw.set_drop_policy(1, "sideways", DropPolicy(p=0.1))
    with pytest.raises(KeyError, match="no job 7"):
        sw.remove_job(7)
    sw.process(grad(0), 10)
    sw.reset_job(1)
    assert sw.read_counters(1)["rx_packets"] == 0
    # After a reset the slot starts afresh: seq 1 is a new round again.
    sw.process(grad(0), 10)
    assert sw.read_counters(1)["grad_start"] == 1


def test_two_workers_behind_one_port_as_in_p4():
    sw = SoftSwitch()
    sw.add_job(JobConfig(1, [7, 7, 8], pool_size=4, elems_per_packet=K))  # workers 0, 1 behind port 7
    sw.process(grad(0), 7)
    sw.process(grad(1), 7)
    assert sw.process(grad(2), 7) == []  # worker 2 is on port 8
    out = sw.process(grad(2), 8)
    assert [p for p, _ in out] == [7, 7, 8]  # one replica per worker


# ---- a duplicate at a lowered quorum (docs/protocol.md, "A duplicate at the quorum") ------------------
@pytest.fixture(params=["reference", "native"])
def engine(request):
    """Which softswitch engine takes the packets: the per-packet reference (SoftSwitch.process) or the
    compiled batch engine (softswitch/_swcore.c through process_batch, one packet per batch)."""
    from softswitch import batch as batch_module

    if request.param == "native":
        assert batch_module._swcore is not None, "softswitch._swcore is not built (pip install -e .)"

        def send(sw: SoftSwitch, data: bytes, port: int) -> list[tuple[int, bytes]]:
            row = np.frombuffer(data, dtype=np.uint8)[None, :]
            res = sw.process_batch(row, np.array([len(data)]), np.array([port]))
            return [] if res is None else res.packets()

        return send
    return lambda sw, data, port: [(p, bytes(b)) for p, b in sw.process(data, port)]


def test_duplicate_at_a_lowered_quorum_closes_the_round(engine):
    """Workers 0 and 1 of 3 sent; the liveness monitor lowers the quorum to 2 (worker 2 died); worker 0's
    resend closes the round with the two survivors' values, not its own again."""
    sw = switch_with_job()
    rng = np.random.default_rng(22)
    v0, v1, resend = (rng.integers(-(2**20), 2**20, size=K) for _ in range(3))
    assert engine(sw, grad(0, values=v0, weight=1), 10) == []
    assert engine(sw, grad(1, values=v1, weight=1), 11) == []
    assert engine(sw, grad(0, values=v0, weight=1), 10) == []  # quorum 3: a plain duplicate
    before = sw.read_counters(1)
    sw.set_quorum(1, 2)
    out = engine(sw, grad(0, values=resend, weight=1), 10)
    assert [port for port, _ in out] == PORTS  # multicast, the dead worker's replica too
    for _, packet in out:
        head, acc = decode(packet)
        assert head["op"] == Op.RESULT and head["count"] == 2 and head["bitmap"] == 0b011
        assert head["worker_id"] == 0 and head["weight"] == 2 and head["flags"] == 0
        np.testing.assert_array_equal(acc, (v0 + v1).astype(np.int32))
    assert changed(before, sw.read_counters(1)) == {
        "rx_packets": 1, "grad_dup": 1, "result_quorum": 1, "tx_packets": 3,
    }  # fmt: skip
    # closed now: worker 1's resend gets the stored RESULT back alone
    out = engine(sw, grad(1, values=v1, weight=1), 11)
    assert [port for port, _ in out] == [11]
    head, acc = decode(out[0][1])
    assert head["count"] == 2 and head["flags"] == int(Flag.RETX)
    np.testing.assert_array_equal(acc, (v0 + v1).astype(np.int32))


def test_duplicate_below_a_lowered_quorum_is_still_dropped(engine):
    sw = switch_with_job(n=3)
    assert engine(sw, grad(0), 10) == []
    sw.set_quorum(1, 2)
    assert engine(sw, grad(0, values=(9, 9, 9, 9)), 10) == []  # one of two: stays open
    out = engine(sw, grad(2, values=(10, 20, 30, 40)), 12)
    head, acc = decode(out[0][1])
    assert head["count"] == 2 and head["bitmap"] == 0b101 and list(acc) == [11, 22, 33, 44]
    c = sw.read_counters(1)
    assert (c["grad_dup"], c["grad_add"], c["result_quorum"]) == (1, 1, 1)


def test_duplicate_at_a_lowered_quorum_of_an_owner_round_goes_to_the_owner(engine):
    sw = switch_with_job()
    owner = int(Flag.OWNER)
    engine(sw, grad(0, values=(1, 1, 1, 1), flags=owner, count=1), 10)
    engine(sw, grad(2, values=(2, 3, 4, 5), flags=owner, count=1), 12)
    sw.set_quorum(1, 2)
    out = engine(sw, grad(2, values=(2, 3, 4, 5), flags=owner, count=1), 12)
    assert [port for port, _ in out] == [11]  # worker 1, the owner, alone (the closer is worker 2)
    head, acc = decode(out[0][1])
    assert head["count"] == 2 and head["bitmap"] == 0b101 and head["worker_id"] == 2
    assert head["flags"] == owner and list(acc) == [3, 4, 5, 6]


def test_duplicate_at_a_lowered_quorum_at_a_leaf_and_a_spine(engine):
    """A leaf sends its partial up (up_partial); a spine's quorum counts leaves (parts), and a leaf's
    resent partial closes the round there."""
    from hostlib.protocol import Role

    leaf = SoftSwitch(seed=0)
    leaf.add_job(JobConfig(1, [10, None, 11, 12], pool_size=8, elems_per_packet=K, role=Role.LEAF,
                           uplink=30, leaf_id=3))  # fmt: skip
    engine(leaf, grad(0, values=(1, 2, 3, 4)), 10)
    engine(leaf, grad(2, values=(5, 6, 7, 8)), 11)
    leaf.set_quorum(1, 2)
    before = leaf.read_counters(1)
    out = engine(leaf, grad(2, values=(5, 6, 7, 8)), 11)
    assert [port for port, _ in out] == [30]
    head, acc = decode(out[0][1])
    assert head["op"] == Op.GRAD and head["worker_id"] == 3 and head["count"] == 2
    assert head["bitmap"] == 0b0101 and list(acc) == [6, 8, 10, 12]
    assert changed(before, leaf.read_counters(1)) == {
        "rx_packets": 1, "grad_dup": 1, "result_quorum": 1, "up_partial": 1, "tx_packets": 1,
    }  # fmt: skip

    spine = SoftSwitch(seed=0)
    spine.add_job(JobConfig(1, [20, 21, 22], pool_size=8, elems_per_packet=K, role=Role.SPINE))

    def partial(leaf_id: int, bitmap: int, values) -> bytes:
        return grad(leaf_id, values=values, count=bitmap.bit_count(), bitmap=bitmap)

    engine(spine, partial(0, 0b0011, (1, 1, 1, 1)), 20)
    engine(spine, partial(1, 0b1100, (2, 2, 2, 2)), 21)
    spine.set_quorum(1, 2)
    out = engine(spine, partial(1, 0b1100, (2, 2, 2, 2)), 21)
    assert [port for port, _ in out] == [20, 21, 22]
    head, acc = decode(out[0][1])
    assert head["op"] == Op.RESULT and head["count"] == 4 and head["bitmap"] == 0b1111
    assert head["worker_id"] == 1 and list(acc) == [3, 3, 3, 3]
    c = spine.read_counters(1)
    assert (c["grad_dup"], c["result_quorum"]) == (1, 1)
