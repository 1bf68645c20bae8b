"""A FLUSH whose answer was lost is retried on the FLUSH round trip, and given up only after the time it
took with the old floor (TransportConfig.min_flush_deadline_ms, docs/protocol.md "Host side").

The switch answers a FLUSH at once, so the wait before retrying one is the FLUSH round trip, not the RTO
floor (``min_deadline_ms``, 20 ms) that waits for peers: at 20% RESULT loss that floor, doubled per retry,
made every twice-lost answer a 40-60 ms stall (issue 42, item 5). What a peer may assume is unchanged: a
unit is given up ``give_up_s`` after its first FLUSH, computed with the old floor.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hostlib.protocol import Flag, Op
from hostlib.transport import Fallback, LtaWorker, TransportConfig
from hostlib.transport.deadlines import Deadlines
from hostlib.transport.plan import IN_FLIGHT, ReducePlan
from tests.handswitch import HandSwitch

K = 16


def test_a_flush_retry_waits_the_flush_round_trip_and_never_past_the_give_up_time():
    cfg = TransportConfig(min_deadline_ms=20, min_flush_deadline_ms=2, max_deadline_ms=500, max_flushes=3)
    dl = Deadlines(cfg, worker_id=0, n_workers=2)  # worker 0: stagger 1.0
    dl.rtt_sample(10.0)  # RTO 10 + 4 * 5 = 30 ms
    dl.flush_sample(1.0)  # FLUSH round trip 1 + 4 * 0.5 = 3 ms: above the 2 ms floor
    assert dl.flush_rto_s() == pytest.approx(0.003)
    # The give-up time a peer assumes: max_flushes doubling waits from the round trip floored at 20 ms.
    assert dl.give_up_s() == pytest.approx(0.020 * 1.5 * 15)
    plan = ReducePlan(4 * K, K)
    units = np.array([plan.exp_units])  # the first data unit
    plan.state[units] = IN_FLIGHT
    plan.synced = True
    now = 100.0
    plan.first_flush_at[units] = now
    plan.flushes[units] = 1
    dl.arm(plan, units, now)
    assert plan.deadline_at[units[0]] == pytest.approx(now + 0.003 * 2)  # one doubling, not 2 x 20 ms
    plan.flushes[units] = 9  # 3 ms x 2^9 would be 1.5 s: capped at the give-up time from the first FLUSH
    later = now + 0.4
    dl.arm(plan, units, later)
    assert plan.deadline_at[units[0]] == pytest.approx(now + dl.give_up_s())


def test_the_retry_cap_leaves_a_first_wait_for_a_late_peer_alone():
    """max_deadline_ms caps a retry's backoff only: a unit's first wait is the lag deadline while a peer
    may be late (past its frontier), however short max_deadline_ms is. Capping it too flushed the units
    of a peer descheduled for 0.4 s after 60 ms, and their rounds closed without it (CI, 2026-11-28)."""
    cfg = TransportConfig(min_deadline_ms=20, max_deadline_ms=60, lag_deadline_ms=3000, sync_deadline_ms=3000)
    dl = Deadlines(cfg, worker_id=0, n_workers=2)
    dl.rtt_sample(10.0)
    plan = ReducePlan(16 * K, K)
    plan.synced = True
    units = np.arange(plan.exp_units, plan.exp_units + 4)
    plan.state[units] = IN_FLIGHT
    now = 50.0
    dl.arm(plan, units, now)
    np.testing.assert_allclose(plan.deadline_at[units], now + 3.0)  # lag deadline, not 60 ms
    plan.flushes[units] = 4  # retries: 30 ms x 2^4 is over the cap
    plan.first_flush_at[units] = now
    dl.arm(plan, units, now)
    np.testing.assert_allclose(plan.deadline_at[units], now + 0.060)


def test_while_a_peer_looks_dead_a_live_late_peer_still_gets_the_lag_deadline():
    """Worker 2 of 3 is presumed dead (a window of RESULTs without its bit): every unit counts as the tail
    and waits the RTO, not for the dead peer. A unit the live worker 1 has not reached (past its frontier)
    still waits the lag deadline, as it does outside early close: with the RTO alone, a survivor
    descheduled a little longer lost its units to its peer's FLUSHes (tests/test_transport.py's killed
    worker: 29 chunks of 782 closed without it, 4 runs in 6 on a loaded host). Units both live workers
    passed keep the RTO."""
    cfg = TransportConfig(min_deadline_ms=20, max_deadline_ms=500, lag_deadline_ms=300, sync_deadline_ms=300)
    dl = Deadlines(cfg, worker_id=0, n_workers=3)  # worker 0: stagger 1.0
    dl.rtt_sample(10.0)
    dl.track_absent(np.full(64, 0b011, dtype=np.uint64))  # worker 2 in no RESULT of a window
    assert dl.presumed_dead == 0b100 and dl.early_close
    rto = dl.rto_s()  # early close: 1.5 srtt, floored at min_deadline_ms
    assert rto == pytest.approx(0.020)
    plan = ReducePlan(16 * K, K)
    plan.synced = True
    plan.frontier = np.array([plan.units - 1, plan.exp_units + 5, -1])  # worker 1 passed 6 data units
    units = np.arange(plan.exp_units, plan.exp_units + 10)
    plan.state[units] = IN_FLIGHT
    now = 50.0
    dl.arm(plan, units, now)
    np.testing.assert_allclose(plan.deadline_at[units[:6]], now + rto)  # both live workers passed them
    np.testing.assert_allclose(plan.deadline_at[units[6:]], now + 0.300)  # worker 1 may still send them


def test_a_unit_flushed_past_max_flushes_is_recovered_within_the_give_up_time():
    """A hand-played switch that loses the answers to the worker's first ``max_flushes`` FLUSHes and answers
    the next one with the stored RESULT. Before, the unit was given up after ``max_flushes`` FLUSHes (a
    fallback); now FLUSHes go on until the give-up time, so the RESULT comes back and is exact."""
    cfg = TransportConfig(elems_per_packet=K, heartbeat_interval_s=0, flush_copies=1, max_flushes=2)
    with HandSwitch() as switch, LtaWorker(1, 0, 2, switch.address, config=cfg) as worker:
        flushes: list[float] = []

        def play() -> None:
            data, addr = switch.exponent_then_data()
            for _ in range(cfg.max_flushes + 1):  # the answers to the first max_flushes are "lost"
                switch.recv(Op.FLUSH)
                flushes.append(time.perf_counter())
            switch.answer(data, addr, int(Flag.RETX))  # the stored RESULT of a complete round, resent

        player = threading.Thread(target=play)
        player.start()
        x = np.linspace(-1, 1, K, dtype=np.float32)
        result = worker.allreduce(x)
        player.join(timeout=10)
        assert len(flushes) == cfg.max_flushes + 1
        assert result.count.tolist() == [2] and result.fallback.tolist() == [Fallback.NONE]
        assert np.allclose(result.values, x, atol=2 * 2.0**-28)
        assert worker.stats.results_retx == 1
