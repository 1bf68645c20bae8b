"""The lockout behind issue 22's three known failures, rule by rule, with hand-made RESULT streams (no
threads, no clocks): (a) ShardedOptimizer, 4 workers, 10% loss everywhere, 703 chunks (reduces longer
than the 511 data slots); (b) 2 hosts on the softswitch at 10% loss; (c) critical-set runs. In each, a
worker late for a moment (descheduled, its RESULTs lost) went missing from 64 RESULTs in a row, its peers
presumed it dead and excused it without bound, ran more than a pool of units ahead, and every GRAD it sent
afterwards was stale at the switch: its bit could never show again (UnhealthyTraining).

Now the unbounded excuse needs the switch's word too: the peer is offline there (its liveness monitor
lowered the quorum, which a worker sees as a round its own GRAD closed without that peer). A late peer
whose heartbeats the switch still hears is excused a few pools (LATE_POOLS) at a time, so its peers stop
where it can still reach their rounds."""

from __future__ import annotations

import numpy as np

from hostlib.transport import TransportConfig
from hostlib.transport.deadlines import Deadlines
from hostlib.transport.reuse import LATE_POOLS, SlotReuse

D = 511  # data slots of the default pool (512)


def _bits(workers: list[int]) -> np.uint64:
    return np.uint64(sum(1 << w for w in workers))


def _leader_runs(
    n: int, late: int, units: int, reduce_units: int, switch_hears_late: bool, monitor: bool = True
) -> int:
    """Worker 0 of ``n``: the RESULTs of ``units`` consecutive units all lack worker ``late``'s bit (it is
    descheduled), the others' bits at every unit; the reduces are ``reduce_units`` long. Worker 0 excuses
    whoever holds it (the hold has timed out each time: peer_hold_s) and closes some of the short rounds
    itself: by its GRAD where the switch has ``late`` offline (quorum n - 1), by its FLUSH where the switch
    still hears it. Returns how often worker 0 was held by the late worker on the way: each hold is
    ``peer_hold_s`` during which the late worker can reach the rounds its peers are in."""
    dl = Deadlines(TransportConfig(switch_liveness=monitor), 0, n)
    reuse = SlotReuse(D, 0, n)
    others = [w for w in range(n) if w != late]
    bitmap = _bits(others)
    sent, holds = 0, 0
    while sent < units:
        first, holders = reuse.limit()
        if first <= sent:  # held with nothing in flight: the hold times out, the holders are excused
            holds += int(holders[late])
            reuse.excuse(holders)
            first, holders = reuse.limit()
            assert first > sent
        hi = min(units, first, sent + 64)
        batch = np.full(hi - sent, bitmap, dtype=np.uint64)
        dl.track_absent(batch)
        mine = (np.arange(sent, hi) % (n - 1)) == 0  # this worker closes its share of the rounds
        by_grad = mine if not switch_hears_late else np.zeros_like(mine)
        by_flush = mine if switch_hears_late else np.zeros_like(mine)
        dl.track_switch_view(batch, by_grad, by_flush)
        base = (sent // reduce_units) * reduce_units
        frontier = np.full(n, -1, dtype=np.int64)
        frontier[others] = hi - 1 - base
        offline = dl.switch_offline if monitor else dl.presumed_dead  # as LtaWorker._run_units does
        bits = np.arange(n, dtype=np.uint64)
        dead = ((np.uint64(dl.presumed_dead & offline) >> bits) & np.uint64(1)).astype(bool)
        reuse.presume_late(((np.uint64(dl.presumed_dead) >> bits) & np.uint64(1)).astype(bool) & ~dead)
        reuse.presume_dead(dead, hi)
        reuse.saw(base, frontier)
        sent = hi
    return holds


def test_a_sharded_703_chunks_late_worker_presumed_dead_is_waited_for_within_a_pool():
    """(a): 4 workers, reduces of 714 units (703 chunks + 11 exponent units), worker 3 descheduled while
    the switch still hears its heartbeats. Its peers presume it dead after 64 RESULTs (the deadlines'
    rule), but excuse it LATE_POOLS pools of units at a time: each time they stop, the late worker can
    reach their rounds and its bit can show again. (Before: one hold, then never again.)"""
    units = 20 * 714
    holds = _leader_runs(4, late=3, units=units, reduce_units=714, switch_hears_late=True)
    assert holds >= units // (LATE_POOLS * D) - 1
    # The same RESULTs with the switch counting worker 3 offline (it was killed: the quorum fell to 3):
    # excused without bound once presumed dead, its peers run on without a hold per pool.
    assert _leader_runs(4, late=3, units=units, reduce_units=714, switch_hears_late=False) <= 2


def test_b_two_hosts_lossy_late_peer_is_never_excused_for_good():
    """(b): 2 hosts at 10% loss, the softswitch with its liveness monitor: the late host is missed from 64
    RESULTs in a row, but no round closes by a GRAD without it (quorum 2), so the other host waits for it
    again one pool after each excuse instead of running on for good. Without a monitor (``lta mininet``
    runs none) the switch's view says nothing, and a peer presumed dead is excused for good as before:
    there the lockout remains possible."""
    units = 12 * LATE_POOLS * D
    assert _leader_runs(2, late=1, units=units, reduce_units=341, switch_hears_late=True) >= 11
    assert _leader_runs(2, late=1, units=units, reduce_units=341, switch_hears_late=True, monitor=False) <= 2


def test_c_critical_run_switch_view_follows_the_quorum_and_lifts_the_presumption():
    """(c): a critical-set run (its resent GRADs are no evidence: they are excluded by the caller, as are
    RETX answers). The switch's view: offline at the first round this worker's GRAD closed without the
    peer, online again after a window of 16 short rounds it closed, none of them by a GRAD without it.
    When the view turns online while the peer is excused without bound, the excuse is bounded again at
    this worker's next unit: it waits for the peer from there."""
    dl = Deadlines(TransportConfig(switch_liveness=True), 0, 3)
    short = np.full(4, _bits([0, 1]), dtype=np.uint64)
    no = np.zeros(4, dtype=bool)
    dl.track_switch_view(short, np.array([True, False, False, False]), no)
    assert dl.switch_offline == 0b100
    dl.track_switch_view(np.full(16, _bits([0, 1, 2]), np.uint64), np.ones(16, bool), np.zeros(16, bool))
    assert dl.switch_offline == 0b100  # full rounds are no evidence either way
    flushed = np.ones(4, dtype=bool)
    for _ in range(3):  # 12 FLUSH-closed + the first window's 1 GRAD-closed: window not over yet
        dl.track_switch_view(short, no, flushed)
    assert dl.switch_offline == 0b100
    dl.track_switch_view(short, no, flushed)  # 17 short rounds: the window had a GRAD-closed one
    assert dl.switch_offline == 0b100
    for _ in range(4):  # a whole window of FLUSH-closed short rounds: the switch waits for worker 2
        dl.track_switch_view(short, no, flushed)
    assert dl.switch_offline == 0

    reuse = SlotReuse(D, 0, 2)
    reuse.saw(0, np.array([10, 10]))
    reuse.presume_dead(np.array([False, True]), 20)
    reuse.excuse(np.array([False, True]))
    assert reuse.limit()[0] > 10**12  # presumed dead and offline at the switch: no bound
    reuse.presume_dead(np.array([False, False]), 3000)  # the switch hears it again
    first, holders = reuse.limit()
    assert first == 3000 and holders.tolist() == [False, True]
    reuse.excuse(holders)  # held there for peer_hold_s without news: one more pool, not more
    assert reuse.limit()[0] == 3000 + D
