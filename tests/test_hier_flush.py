"""Host timers behind leaf switches (TransportConfig.leaf_sizes): one first FLUSH per leaf and unit, ranks
staggered within their leaf, and no RTT sample from a complete answer to a unit proven lost."""

from __future__ import annotations

import numpy as np
import pytest

from hostlib.protocol import Op, make_packet
from hostlib.transport import LtaWorker, TransportConfig
from hostlib.transport.deadlines import Deadlines, flush_group
from hostlib.transport.plan import IN_FLIGHT, ReducePlan

SIZES = (3, 3, 2)  # workers 0-2, 3-5 and 6-7
N = sum(SIZES)


def test_flush_group_is_the_workers_leaf_block():
    assert [flush_group(SIZES, w, N) for w in range(N)] == [(0, 3)] * 3 + [(3, 3)] * 3 + [(6, 2)] * 2
    assert flush_group((), 5, N) == (0, N)
    with pytest.raises(ValueError, match="add up to 7"):
        flush_group((3, 4), 0, N)
    with pytest.raises(ValueError, match="leaf_sizes"):
        TransportConfig(leaf_sizes=(3, 0))


def _fast_flush_now(config: TransportConfig, w: int, units: int, now: float) -> np.ndarray:
    """Units that worker ``w`` flushes at ``now`` when every peer has passed all of them (by hand: every
    unit in flight, every worker's frontier beyond the last)."""
    plan = ReducePlan(units * 4, 4)  # units data units and a few exponent units
    plan.reset(0, 512, {"version": 1, "job_id": 1, "worker_id": w, "step": 0}, 1,
               np.zeros(plan.chunks_count, np.int64), N)  # fmt: skip
    plan.state[:] = IN_FLIGHT
    plan.next_unit = plan.units
    plan.frontier[:] = plan.units
    dl = Deadlines(config, w, N)
    dl.flush_srtt_ms = 5.0
    dl.fast_flush(plan, now)
    assert plan.proven_lost.all()
    return plan.deadline_at == now


def test_fast_flush_picks_one_worker_of_every_leaf_for_each_unit():
    now, units = 10.0, 40
    at_once = np.array([_fast_flush_now(TransportConfig(leaf_sizes=SIZES), w, units, now) for w in range(N)])
    base = 0
    for size in SIZES:  # exactly one worker of each leaf flushes each unit at once, in turn
        block = at_once[base : base + size]
        assert (block.sum(axis=0) == 1).all()
        first = np.argmax(block, axis=0)
        assert (first == np.arange(block.shape[1]) % size).all()
        base += size
    flat = np.array([_fast_flush_now(TransportConfig(), w, units, now) for w in range(N)])
    assert (flat.sum(axis=0) == 1).all()  # one switch: one worker per unit, as before


def test_timer_stagger_restarts_in_every_leaf():
    cfg = TransportConfig(leaf_sizes=SIZES)
    stagger = [Deadlines(cfg, w, N)._stagger for w in range(N)]
    assert stagger[0] == stagger[3] == stagger[6] == 1.0  # each leaf's first rank flushes first
    assert stagger[1] == pytest.approx(1 + 0.5 / 3) and stagger[7] == pytest.approx(1.25)


def test_complete_answer_to_a_proven_lost_unit_is_no_rtt_sample():
    """Behind a leaf, a unit every worker had passed came back complete once the leaf resent its lost
    partial: the wait was a recovery, not a round trip. A complete answer to a FLUSH sent on a timer
    (the unit not proven lost) still is one (the FLUSH was spurious)."""
    k, n = 4, 2
    cfg = TransportConfig(elems_per_packet=k, heartbeat_interval_s=0.0, health_timeout_s=0.0)
    with LtaWorker(1, 0, n, ("127.0.0.1", 9), config=cfg) as worker:
        plan = worker._plan_for(2 * k)
        plan.reset(0, cfg.pool_size, dict(worker._header), 1, np.zeros(plan.chunks_count, np.int64), n)
        plan.state[:] = IN_FLIGHT
        plan.next_unit = plan.units
        plan.flushes[:] = 1
        t = 1e6  # sent "long ago": any sample taken would be huge
        plan.sent_at[:] = -t
        plan.proven_lost[plan.exp_units] = True  # the first data unit: proven lost; the second: on a timer
        rows = [
            make_packet(Op.RESULT, job_id=1, worker_id=1, slot=int(plan.slots[u]), seq=int(plan.seqs[u]),
                        count=n, bitmap=0b11, payload=np.zeros(k, np.int32), elems_per_packet=k, nelem=k)
            for u in (plan.exp_units, plan.exp_units + 1)
        ]  # fmt: skip
        for i, packet in enumerate(rows[:1]):
            worker.io.rx.data[i, : len(packet)] = np.frombuffer(packet, np.uint8)
            worker.io.rx.lens[i] = len(packet)
        worker._handle(1, plan)
        assert worker.deadlines.srtt_ms is None  # the proven-lost unit gave no sample
        worker.io.rx.data[0, : len(rows[1])] = np.frombuffer(rows[1], np.uint8)
        worker._handle(1, plan)
        assert worker.deadlines.srtt_ms is not None and worker.deadlines.srtt_ms > t  # the timer one did


def test_leaf_index_is_the_block_a_worker_sits_in():
    from hostlib.transport.deadlines import leaf_index

    assert [leaf_index(SIZES, w) for w in range(N)] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert leaf_index((), 5) == 5  # one switch: the closer of a round is the worker itself
