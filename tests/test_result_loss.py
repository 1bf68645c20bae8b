"""Lost RESULTs (issue 22): a worker that lost the RESULT of a round gets the switch's stored copy back
(its FLUSH or GRAD is answered with a unicast resend), so every worker ends a reduce with the same
aggregate; no peer moves the slot to its next round while that copy may still be asked for."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hostlib.protocol import HEADER_BYTES, HEADER_DTYPE, Flag, Op
from hostlib.transport import Fallback, LtaWorker, TransportConfig
from hostlib.transport.reuse import SlotReuse
from tests.conftest import check_mean_over_bitmap, check_reduces, run_workers
from tests.handswitch import HandSwitch

K = 16


def count_excuses(workers: list[LtaWorker]) -> list[int]:
    """The peers these workers excuse from the slot-reuse rule (``SlotReuse.excuse``), one entry per
    excuse: the sum of the excused peers' ids, appended as it happens."""
    holds: list[int] = []
    for w in workers:

        def counted_excuse(peers: np.ndarray, excuse: Callable[[np.ndarray], None] = w.reuse.excuse) -> None:
            holds.append(int(np.flatnonzero(peers).sum()))
            excuse(peers)

        w.reuse.excuse = counted_excuse  # type: ignore[method-assign]
    return holds


@pytest.mark.parametrize("n", [2, 3])
def test_lost_results_are_recovered_before_their_slot_moves_on(make_cluster, n):
    """Down loss only, a pool of 15 data slots (every slot carries a new round every 15 units): each
    worker loses a fifth of its RESULT replicas. Every chunk must come back on every worker (none falls
    back), the same RESULT on all of them (count, bitmap and values identical), and equal to numpy's mean
    over its bitmap. Before the fix a peer's next GRAD for the slot often reached the switch before the
    lossy worker's FLUSH, which was then stale: the chunk was lost for good (units_overtaken)."""
    cluster = make_cluster(
        n,
        down=0.2,
        seed=7,
        elems_per_packet=K,
        pool_size=16,
        exact=True,
        # Long waits for late peers (threads on a loaded machine): recovery must not depend on timers.
        sync_deadline_ms=5000,
        lag_deadline_ms=5000,
        min_deadline_ms=300,
        max_deadline_ms=2000,
    )
    rng = np.random.default_rng(n)
    for step in range(3):
        inputs = [rng.standard_normal(100 * K + 3).astype(np.float32) for _ in range(n)]
        results = cluster.reduce_all(inputs, step=step)
        for r in results:
            assert np.all(r.count > 0), f"step {step}: {np.count_nonzero(r.count == 0)} chunks without RESULT"
        for r in results[1:]:
            np.testing.assert_array_equal(r.count, results[0].count)
            np.testing.assert_array_equal(r.bitmap, results[0].bitmap)
            np.testing.assert_array_equal(r.values, results[0].values)
        assert check_mean_over_bitmap(results, inputs, K, full=n * 101, partial=0, fallback=0) == n * 101
    stats = [w.stats for w in cluster.workers]
    assert sum(s.units_overtaken for s in stats) == 0
    assert sum(s.results_retx for s in stats) > 0  # RESULTs were lost and resent
    assert cluster.switch.read_counters(cluster.job_id)["flush_stale"] == 0


def test_slot_reuse_waits_for_proof_that_every_peer_is_done_with_the_slot():
    """Hand-worked: D = 15 data slots, so S = 8 and A = 7. Worker 0 may send unit g once each peer has
    provably settled g - 15: its bit at unit v proves it settled v - 8 (its own span), and any bit of a
    reduce proves it settled every unit before that reduce."""
    reuse = SlotReuse(15, worker_id=0, n_workers=3)
    assert (reuse.span, reuse.ahead) == (8, 7)
    first, holders = reuse.limit()
    assert first == 15 and holders.tolist() == [False, True, True]  # units 0..14: no slot reused yet
    # A reduce starting at global unit 100: worker 1's bit seen up to local unit 12, worker 2's up to 3.
    reuse.saw(100, np.array([30, 12, 3]))
    assert reuse.settled.tolist() == [122, 104, 99]  # 100 + 30 - 8, 100 + 12 - 8, all before 100
    first, holders = reuse.limit()
    assert first == 99 + 15 + 1 and holders.tolist() == [False, False, True]
    reuse.saw(100, np.array([30, 12, 14]))  # worker 2 catches up (settled 106): worker 1 holds now
    first, holders = reuse.limit()
    assert first == 104 + 16 and holders.tolist() == [False, True, False]


def test_a_peer_that_went_on_is_followed_and_an_excused_peer_is_waited_for_again():
    reuse = SlotReuse(15, worker_id=0, n_workers=3)
    reuse.saw(0, np.array([5, 5, 5]))  # everyone's bit at unit 5: settled through -1 (5 - 8 < 0)
    assert reuse.limit()[0] == 15
    # Worker 1's GRAD of unit 30 was counted: it went past unit 15 = where worker 2 holds us (settled
    # -1 + 15 + 1), so it stopped waiting for worker 2: follow it. Worker 1 itself proved settled 22.
    # It is followed as far as it went (unit 30), not further: worker 2 holds us at 31 (not 22 + 16).
    reuse.saw(0, np.array([5, 30, 5]))
    first, holders = reuse.limit()
    assert first == 31 and holders.tolist() == [False, False, True]
    reuse.saw(0, np.array([5, 34, 5]))  # worker 1 went on to 34: follow it (its own bit proves 26)
    first, holders = reuse.limit()
    assert first == 35 and holders.tolist() == [False, False, True]
    # Worker 2 shows its bit again (unit 36; not past worker 1's hold at 26 + 16): waited for again, from
    # what that proves (28).
    reuse.saw(0, np.array([40, 34, 36]))
    assert reuse.settled.tolist()[1:] == [26, 28]
    first, holders = reuse.limit()
    assert first == 26 + 16 and holders.tolist() == [False, True, False]
    reuse.excuse(holders)
    assert reuse.limit()[0] == 28 + 16
    # A restored worker takes its peers to have settled every unit before its own next unit.
    fresh = SlotReuse(15, worker_id=1, n_workers=2)
    fresh.restart_at(1000)
    assert fresh.limit()[0] == 999 + 16


def test_an_excused_late_peer_is_waited_for_again_one_pool_later_so_it_can_rejoin():
    """D = 15. Worker 2 reaches the job late: peers 0 and 1 wait for it, then excuse it (peer_hold_s).
    A slot keeps one round, so once a peer sends unit g every GRAD of unit g - 15 is stale at the switch:
    if the peers ran on without bound, none of the late worker's GRADs could be counted again, its bit
    never showed, and it stayed excused (and without aggregates) for good. The excuse lapses one pool of
    units later: the peers stop there (a unit the late worker can still reach while the round is open,
    so its bit shows), and follow it again from what its bit proves."""
    leader = SlotReuse(15, worker_id=0, n_workers=3)
    leader.saw(0, np.array([10, 10, -1]))  # worker 2 not seen: it holds us at unit 15 (slot 0's 2nd round)
    first, holders = leader.limit()
    assert first == 15 and holders.tolist() == [False, False, True]
    leader.excuse(holders)  # no news of worker 2 for peer_hold_s
    for v in range(10, 30):  # worker 1 and we run on, worker 2 never seen
        leader.saw(0, np.array([v, v, -1]))
        first, holders = leader.limit()
        assert first <= 30, f"may send unit {first - 1}: worker 2's GRADs of unit {first - 16} are stale"
    # Held at unit 30: worker 2's units 15..29 are still the rounds the leaders sent (closed, or open
    # for its GRAD), its unit 30 would start a new round with its bit.
    assert first == 30 and holders.tolist() == [False, False, True]
    # Worker 2 gets there: its bit in the RESULT of unit 31 proves it settled unit 23. The excuse is over:
    # it holds us at 23 + 16 once worker 1 is past that.
    leader.saw(0, np.array([29, 36, 31]))
    first, holders = leader.limit()
    assert first == 23 + 16 and holders.tolist() == [False, False, True]
    # A worker following a peer that stopped waiting for worker 2 is bounded the same way.
    follower = SlotReuse(15, worker_id=1, n_workers=3)
    follower.saw(0, np.array([10, 10, -1]))
    for v in (25, 29):  # worker 0's GRAD of unit v counted: past where worker 2 holds us (15)
        follower.saw(0, np.array([v, 10, -1]))
        first, holders = follower.limit()
        assert first == 30 and holders.tolist() == [False, False, True]
    # A silent peer not (yet) presumed dead costs one hold (peer_hold_s) per pool of units.
    alone = SlotReuse(15, worker_id=0, n_workers=2)
    assert alone.limit()[0] == 15
    alone.excuse(np.array([False, True]))
    assert alone.limit()[0] == 30
    alone.excuse(np.array([False, True]))
    assert alone.limit()[0] == 45


def test_a_resent_result_times_the_flush_not_the_round_trip():
    """A hand-played switch: it answers the exponent unit at once (a clean RTT sample), never multicasts
    the data unit's RESULT, and answers the worker's FLUSH of it with the stored RESULT (RETX) after
    ``delay``. That answer measured the recovery (the worker's deadline plus the delay), not the path:
    srtt must not move; the FLUSH round trip (FLUSH to answer) is ``delay`` plus the local hops."""
    delay = 0.05
    # The next FLUSH would go 2 x 100 ms after the first: after the answer, so the sample is unambiguous.
    cfg = TransportConfig(elems_per_packet=K, heartbeat_interval_s=0, min_deadline_ms=100)
    with HandSwitch() as switch, LtaWorker(1, 0, 2, switch.address, config=cfg) as worker:
        seen: dict[str, object] = {}

        def play() -> None:
            data, addr = switch.exponent_then_data()
            switch.recv(Op.FLUSH)
            seen["srtt_ms"] = worker.srtt_ms
            time.sleep(delay)
            switch.answer(data, addr, int(Flag.RETX))  # the stored RESULT of a complete round, resent

        player = threading.Thread(target=play)
        player.start()
        x = np.linspace(-1, 1, K, dtype=np.float32)
        result = worker.allreduce(x)
        player.join(timeout=10)
        assert result.count.tolist() == [2] and result.fallback.tolist() == [Fallback.NONE]
        assert np.allclose(result.values, x, atol=1e-6)
        assert worker.stats.results_retx == 1
        assert seen["srtt_ms"] is not None and worker.srtt_ms == seen["srtt_ms"]
        # The sample runs from the FLUSH, which went one deadline (>= min_deadline_ms) after the GRAD, to
        # the answer, which came before the reduce returned: a sample timed from the GRAD would be longer.
        flush_ms = worker.deadlines.flush_srtt_ms
        assert delay * 1000 <= flush_ms <= result.elapsed_s * 1000 - cfg.min_deadline_ms, flush_ms


def test_a_worker_late_to_the_job_rejoins_instead_of_being_locked_out(make_cluster):
    """Three workers, 15 data slots; worker 2 reaches the job late (held back while its peers excuse it,
    peer_hold_s). Before the fix the peers then ran on without bound: they finished every reduce without
    waiting for it again, so its GRADs were stale or late and its bit never showed (in the chaos repro:
    UnhealthyTraining). Now the excuse lapses one pool of units on: the peers wait for it again, it is
    released once they have (twice), and its contributions are counted again before the last reduce
    ends. Every chunk is still the mean over its bitmap."""
    n, reduces = 3, 4
    cluster = make_cluster(
        n, seed=3, elems_per_packet=K, pool_size=16, min_deadline_ms=5, max_deadline_ms=50,
        sync_deadline_ms=100, lag_deadline_ms=50,
    )  # fmt: skip
    # the peers excused, by worker 0 or 1 (a worker that follows the other's excuse makes none of its
    # own: on a loaded host worker 0 followed worker 1's and waited once)
    holds = count_excuses(cluster.workers[:2])
    leaders_done = threading.Event()
    rng = np.random.default_rng(5)
    inputs = [[rng.standard_normal(60 * K).astype(np.float32) for _ in range(n)] for _ in range(reduces)]

    def body(w: LtaWorker, i: int) -> list:
        if i == 2:  # late: until the leaders waited for it twice (or, before the fix, were all done)
            while holds.count(2) < 2 and not leaders_done.is_set():
                time.sleep(0.005)
        out = [w.allreduce(inputs[r][i], step=r) for r in range(reduces)]
        if i == 0:
            leaders_done.set()
        return out

    results = run_workers(cluster.workers, body)
    last = [res[-1] for res in results]
    rejoined = (last[0].bitmap & 0b100) != 0
    assert rejoined.any(), f"worker 2 never counted again (its peers waited for it {holds.count(2)} times)"
    # Nothing is lost: the peers close rounds short of worker 2 while they excuse it (partial), and
    # worker 2 falls back for the chunks of rounds that were over before it came.
    assert check_reduces(
        results,
        inputs,
        K,
        full=(1, None),
        partial=(1, None),
        fallback=(0, None),
        slack_bits=cluster.slack_bits,
    )


def _stop_worker_two(
    cluster: Any,
    inputs: list[list[np.ndarray]],
    stop_at: int,
    until: int,
    compute_s: float = 0.0,
    on_resume: Callable[[], None] | None = None,
) -> tuple[list[tuple[list, str, float]], float]:
    """Workers 0-2 reduce ``inputs[step][worker]``; worker 2 stops in reduce ``stop_at`` as a SIGSTOP
    would (its heartbeat off, its next send held) until its peers have finished ``until`` reduces, then
    ``on_resume()`` and goes on. Returns per worker (its results, the UnhealthyTraining it raised or "",
    when it ended) and when worker 2 resumed (``time.perf_counter``)."""
    from hostlib.errors import UnhealthyTraining
    from hostlib.liveness import LivenessMonitor

    n = len(cluster.workers)
    monitor = LivenessMonitor(cluster.switch, cluster.job_id, n, timeout_s=0.5, poll_s=0.05).start()
    done = [0] * n
    progress = threading.Condition()
    late = cluster.workers[2]
    send = late.io.send_rows
    armed = threading.Event()
    resumed_at = [0.0]

    def stopped_send(rows: np.ndarray, slots: np.ndarray | None = None) -> int:
        if armed.is_set():
            armed.clear()
            with progress:  # stopped mid-reduce until the peers have finished reduce `until`
                assert progress.wait_for(lambda: min(done[:2]) >= until, timeout=60)
            if on_resume is not None:
                on_resume()
            resumed_at[0] = time.perf_counter()
        return send(rows, slots)

    late.io.send_rows = stopped_send  # type: ignore[method-assign]

    def body(w: LtaWorker, i: int) -> tuple[list, str, float]:
        out: list = []
        try:
            for step in range(len(inputs)):
                if i == 2 and step == stop_at:
                    assert late.heartbeat is not None
                    late.heartbeat.stop()  # SIGSTOP stops every thread of the process
                    armed.set()
                out.append(w.allreduce(inputs[step][i], step=step))
                with progress:
                    done[i] = step + 1
                    progress.notify_all()
                time.sleep(compute_s)
        except UnhealthyTraining as exc:
            return out, str(exc), time.perf_counter()
        return out, "", time.perf_counter()

    try:
        return run_workers(cluster.workers, body), resumed_at[0]
    finally:
        monitor.stop()


@pytest.mark.parametrize("ahead", [3, None])
def test_a_worker_stopped_mid_reduce_skips_the_reduces_its_peers_left_and_rejoins(make_cluster, ahead):
    """Chaos seed 87 (a rank SIGSTOPped for 2.3 s): the liveness monitor lowered the quorum, the peers
    went on, and the stopped worker came back several reduces behind them. Every unit of those reduces
    was overtaken at its start (the peers had moved each slot on), so they came back empty at once, and
    three of them in a row raised UnhealthyTraining before it could reach its peers. A reduce the peers
    had left before it began is how a late worker catches up (docs/protocol.md): it does not count as
    unhealthy, up to ``catch_up_reduces`` (5) in a row. Worker 2 stops in reduce 5 (its heartbeat off,
    its next send held) until the peers have finished reduce 5 + ``ahead`` (None: all 24, they left).
    Independent expectations: with 3 it raises nothing, its bit is in every chunk of the last reduces
    again, and every chunk of every worker is numpy's mean over its bitmap; with the peers gone (18
    reduces to skip) it raises, naming the reduces it could not catch up with, after 6 of them."""

    n, reduces, stop_at, k = 3, 24, 5, 16
    cluster = make_cluster(n, seed=1, elems_per_packet=k, pool_size=16, heartbeat_interval_s=0.1)
    rng = np.random.default_rng(0)
    inputs = [[rng.standard_normal(60 * k).astype(np.float32) for _ in range(n)] for _ in range(reduces)]
    until = reduces if ahead is None else stop_at + ahead
    ran, _ = _stop_worker_two(cluster, inputs, stop_at, until, compute_s=0.05)
    results = [r for r, _, _ in ran]
    errors = [e for _, e, _ in ran]
    assert errors[:2] == ["", ""]
    # Reduces worker 2 came back to after its peers had left most of their rounds (a unit of the last
    # one can still be open when the peers wait for it at their next reduce's reuse rules).
    skipped = [s for s, r in enumerate(results[2]) if np.mean(r.fallback != Fallback.NONE) >= 0.5]
    if ahead is None:
        assert "6 reduces in a row were over before it started them" in errors[2], errors[2]
        assert len(results[2]) == stop_at + 1 + 5  # reduce 5 (answered from its queued RESULTs), 5 skipped
    else:
        assert errors[2] == "", errors[2]  # before the fix: UnhealthyTraining
        assert len(skipped) >= 2, f"worker 2 skipped only reduces {skipped}: the peers did not get ahead"
        for r in results[2][-3:]:
            assert np.all(r.bitmap & 0b100), "worker 2 did not rejoin its peers' rounds"
    # the peers closed rounds without the stopped worker (partial); it fell back for the reduces it skipped
    assert check_reduces(
        results,
        inputs,
        k,
        full=(1, None),
        partial=(1, None),
        fallback=(1, None),
        slack_bits=cluster.slack_bits,
    )


def test_a_worker_stopped_past_every_result_it_could_keep_learns_from_the_relayed_heartbeats(make_cluster):
    """A rank stopped while its peers ran on and finished (chaos: SIGSTOP 4 s at step 14 of 30) finds its
    socket holding none of their later RESULTs (a kernel buffer keeps a few hundred datagrams; here: drained
    on resume). Its units' slots moved on at the switch, which drops their GRADs and FLUSHes as stale:
    nothing ever answers. Each reduce waited for its FLUSHes to give up (here ~15 s; the chaos run hit its
    20 s reduce timeout, then healed), and three of them raised "got no aggregate" (46 s) instead of the
    catch-up error. The peers' relayed heartbeats carry how far they settled (docs/protocol.md, "The relayed
    heartbeat"): its units a pool below that are given up at once, its reduces count as passed, and after
    ``catch_up_reduces`` of them it raises the catch-up error, within a few heartbeat intervals instead
    of timeouts. Independent expectation: the peers' own units per reduce and the pool say which units
    are a pool behind; the resumed reduces each end well within the timeout."""

    n, reduces, stop_at, k = 3, 12, 2, 16
    cluster = make_cluster(
        n, seed=2, elems_per_packet=k, pool_size=16, heartbeat_interval_s=0.1, reduce_timeout_s=30.0
    )
    late = cluster.workers[2]
    x = np.ones(60 * k, dtype=np.float32)

    def lose_what_it_held() -> None:  # what its socket held is lost (a full kernel buffer)
        while late.io.recv(0.0):
            pass

    ran, resumed_at = _stop_worker_two(
        cluster, [[x] * n] * reduces, stop_at, reduces, on_resume=lose_what_it_held
    )
    assert [e for _, e, _ in ran[:2]] == ["", ""]
    results, error, ended = ran[2]
    assert "6 reduces in a row were over before it started them" in error, error
    assert ended - resumed_at < 5.0, ended - resumed_at  # before: 15 s or more per reduce
    assert len(results) == stop_at + 5
    for r in results[stop_at:]:  # (the first of them holds the stop itself)
        assert np.all(r.fallback != Fallback.NONE)
    assert max(r.elapsed_s for r in results[stop_at + 1 :]) < 2.0
    # what the peers' heartbeats announced (the first heard was enough): all their units, 60 chunks and
    # 4 exponent units a reduce
    assert late.engine.peers_settled[:2].max() == reduces * (60 + 4)


def test_a_reduce_starts_by_waiting_as_long_as_a_live_peer_may_finish_the_one_before():
    """Until the first RESULT of a reduce, units wait the sync deadline, but at least one RTO plus the
    time a peer takes to give a unit up (each of its max_flushes + 1 FLUSHes unanswered, staggered by
    1.5, each wait doubled): a live peer whose last RESULT of the reduce before was lost is that late.
    While a peer looks dead (a window of RESULTs without its bit), the sync deadline alone, except after
    a reduce a live peer missed entirely (``Deadlines.end_of_reduce``). Hand-computed from TCP's
    estimator (srtt + 4 rttvar, first sample: rttvar = srtt / 2)."""
    from hostlib.transport.deadlines import Deadlines

    cfg = TransportConfig(sync_deadline_ms=200, min_deadline_ms=20, max_deadline_ms=500, max_flushes=3)
    dl = Deadlines(cfg, worker_id=0, n_workers=3)
    # Nothing measured: RTO = initial_deadline_ms (50), the FLUSH timeout the RTO.
    assert dl.sync_wait_s() == pytest.approx(0.050 + 0.050 * 1.5 * 15)
    dl.rtt_sample(10.0)  # RTO 10 + 4 * 5 = 30 ms
    dl.flush_sample(8.0)  # FLUSH timeout 8 + 4 * 4 = 24 ms
    assert dl.sync_wait_s() == pytest.approx(0.030 + 0.024 * 1.5 * 15)
    dl.track_absent(np.full(64, 0b011, dtype=np.uint64))  # worker 2 in no RESULT of a window
    assert dl.early_close and dl.sync_wait_s() == pytest.approx(0.200)  # a peer looks dead: no more
    # ... unless a live peer (heard lately, not presumed dead) was in no RESULT of the last reduce: the
    # next reduce waits the longer time for it, once
    now = time.perf_counter()
    dl.heard(np.array([1]), now)
    behind = np.zeros(3, dtype=bool)  # no peer's heartbeat said it settled the reduce
    dl.end_of_reduce(np.array([40, -1, -1]), behind, now)  # worker 1 heard, absent; worker 2 dead
    # (early close's RTO: 1.5 srtt = 15 ms, floored at min_deadline_ms)
    assert dl.sync_wait_s() == pytest.approx(0.020 + 0.024 * 1.5 * 15)
    dl.end_of_reduce(np.array([40, 39, -1]), behind, now)  # worker 1 back in the next reduce
    assert dl.sync_wait_s() == pytest.approx(0.200)
    dl.end_of_reduce(np.array([40, -1, -1]), behind, now + 10.0)  # absent, not heard for 10 s: dead-like
    assert dl.sync_wait_s() == pytest.approx(0.200)
    dl.end_of_reduce(np.array([40, -1, -1]), np.array([False, True, False]), now)  # worker 1 is ahead
    assert dl.sync_wait_s() == pytest.approx(0.200)  # (this worker is the late one: no waiting)
    slow = Deadlines(TransportConfig(sync_deadline_ms=2000, max_flushes=1), worker_id=0, n_workers=3)
    slow.rtt_sample(10.0)
    slow.flush_sample(8.0)
    assert slow.sync_wait_s() == pytest.approx(2.0)  # the configured deadline when it is the longer


def test_a_peer_late_to_every_reduce_is_counted_in_every_reduce(make_cluster):
    """Chaos seed 84's lockout, reduced: worker 2 starts every reduce a third of the wait below (~0.4 s) after
    its peers (it computes longer; in seed 84 a rank still recovering the last lost RESULTs of the reduce
    before). Before the fix the peers flushed the exponent rounds at the sync deadline (50 ms) without it,
    so it withheld every chunk of the reduce (its exponent proposals were not counted), its bit was in no
    RESULT, the peers presumed it dead within the first reduce and it was counted in no chunk of any
    reduce. Now a unit waits, until the first RESULT of its reduce, at least one RTO and a give-up (the
    time a live peer may still spend finishing the reduce before: ``Deadlines.sync_wait_s``, 50 + 1125 ms
    with these deadlines), and a third of it is well within it (a loaded machine may add a few hundred ms)
    and nearly eight times the sync deadline that failed. Independent expectations: worker 2's bit is in
    chunks of every reduce; every chunk of every worker is numpy's mean over its bitmap."""
    n, reduces, k = 3, 5, 16
    cluster = make_cluster(
        n, seed=2, elems_per_packet=k, pool_size=16, min_deadline_ms=50, max_deadline_ms=50,
        sync_deadline_ms=50, lag_deadline_ms=50, max_flushes=3, reduce_timeout_s=30,
    )  # fmt: skip
    rng = np.random.default_rng(7)
    inputs = [[rng.standard_normal(200 * k).astype(np.float32) for _ in range(n)] for _ in range(reduces)]
    wait_s = cluster.workers[0].deadlines.sync_wait_s()  # nothing measured yet: the longest it gets
    assert wait_s == pytest.approx(0.050 + 0.050 * 1.5 * 15)
    late_s = wait_s / 3
    assert late_s > 5 * 0.050  # late past the old rule's wait (the sync deadline)

    def body(w: LtaWorker, i: int) -> list:
        out = []
        for r in range(reduces):
            if i == 2:
                time.sleep(late_s)  # computes longer than its peers
            out.append(w.allreduce(inputs[r][i], step=r))
        return out

    results = run_workers(cluster.workers, body)
    counted = [int(np.count_nonzero(res.bitmap & 0b100)) for res in results[0]]
    assert all(counted), f"worker 2 counted in no chunk of some reduce: {counted}"
    # Nothing is lost and worker 2 is late within the wait: no chunk of anyone falls back.
    assert check_reduces(
        results,
        inputs,
        k,
        full=(1, None),
        partial=(0, None),
        fallback=0,
        slack_bits=cluster.slack_bits,
    )


def test_held_time_counts_the_reuse_rules_holding_a_worker(make_cluster):
    """``stats.held_by_span_s`` / ``held_by_peers_s``: the time a worker had units to send and room in its
    window while a slot-reuse rule let none go. A reduce that fits inside the own span (8 data units,
    S = 256) is never held. A lone worker with a pool of 15 data slots (S = 8, window 15) and 30% GRAD
    loss sends 8 units and must then wait for its oldest (lost ones recovered by FLUSHes) before the
    ninth: it is held by its span, for part of the reduce at most, and never by peers (it has none);
    every chunk is still the mean over its bitmap. Two lossless workers with that pool are held too:
    204 units through 15 slots, each slot's next round waiting for proof that both are done with it.
    That proof is the peer rule's (reuse.py: a unit goes once the peer's bit showed up A = 7 units back,
    while the own span allows S = 8), which binds first: each of the two is held by its peer."""
    small = make_cluster(1, elems_per_packet=K)
    small.reduce_all([np.ones(8 * K, dtype=np.float32)])
    (st,) = [w.stats for w in small.workers]
    assert st.held_by_span_s == 0.0 and st.held_by_peers_s == 0.0

    rng = np.random.default_rng(0)
    alone = make_cluster(1, up=0.3, seed=3, elems_per_packet=K, pool_size=16, job_id=2)
    inputs = [rng.standard_normal(200 * K).astype(np.float32)]
    (r,) = alone.reduce_all(inputs)
    # alone, a chunk is full (its one GRAD counted) or, lost every time, the fallback (zeros: a first reduce)
    assert check_mean_over_bitmap([r], inputs, K, full=(1, None), partial=0, fallback=(0, None))
    (st,) = [w.stats for w in alone.workers]
    assert st.flushes_sent > 0  # units were lost and flushed
    assert 0.0 < st.held_by_span_s <= r.elapsed_s and st.held_by_peers_s == 0.0

    pair = make_cluster(2, seed=3, elems_per_packet=K, pool_size=16, job_id=3)
    inputs = [rng.standard_normal(200 * K).astype(np.float32) for _ in range(2)]
    results = pair.reduce_all(inputs)
    # nothing lost: every chunk from a RESULT (a thread descheduled past a deadline may be closed out)
    expect = dict(full=(1, None), partial=(0, None), fallback=0)
    assert check_mean_over_bitmap(results, inputs, K, **expect) == 2 * 200
    for w, r in zip(pair.workers, results, strict=True):
        assert w.stats.held_by_peers_s > 0.0, "the peer rule never held a worker of a lossless pair"
        assert w.stats.held_by_span_s + w.stats.held_by_peers_s <= r.elapsed_s


def test_a_live_worker_missing_from_a_window_of_results_is_not_presumed_dead_and_gets_back_in(make_cluster):
    """Chaos seed 32 (39% burst RESULT loss alone): a rank fell behind, its bit was missing from 64
    RESULTs in a row, its peers presumed it dead, excused it without bound and ran on, so its GRADs only
    ever reached closed rounds; it raised UnhealthyTraining (locked out). Here worker 2 reaches the job
    late, alive (its heartbeat runs), while the pool (127 data slots) is longer than the 64-RESULT
    window: before, its peers presumed it dead and ran to the end without it (its bit in no RESULT of
    any reduce). Now its relayed heartbeat (a PARAM of ``ALIVE_CHUNK`` the switch copies to every
    peer) keeps it from being presumed dead: the peers' excuse of it stays bounded (one pool), they
    wait for it again, and its contributions are counted in the last reduce. Every chunk is still the
    mean over its bitmap."""
    n, reduces, chunks = 3, 4, 150
    cluster = make_cluster(
        n, seed=3, elems_per_packet=K, pool_size=128, min_deadline_ms=5, max_deadline_ms=50,
        sync_deadline_ms=100, lag_deadline_ms=50, heartbeat_interval_s=0.1,
    )  # fmt: skip
    holds = count_excuses(cluster.workers[:2])
    leaders_done = threading.Event()
    rng = np.random.default_rng(5)
    inputs = [[rng.standard_normal(chunks * K).astype(np.float32) for _ in range(n)] for _ in range(reduces)]
    presumed: list[int] = []  # the peers' presumed-dead masks after each of their reduces

    def body(w: LtaWorker, i: int) -> list:
        if i == 2:  # late: until the leaders waited for it three times (or, before the fix, were done)
            while holds.count(2) < 3 and not leaders_done.is_set():
                time.sleep(0.005)
        out = []
        for r in range(reduces):
            out.append(w.allreduce(inputs[r][i], step=r))
            if i < 2:
                presumed.append(int(w.deadlines.presumed_dead))
        if i == 0:
            leaders_done.set()
        return out

    results = run_workers(cluster.workers, body)
    assert all(w.stats.heartbeats_relayed > 0 for w in cluster.workers), "no relayed heartbeat came"
    assert all(not (mask >> 2) & 1 for mask in presumed), f"worker 2 presumed dead: {presumed}"
    last = [res[-1] for res in results]
    rejoined = (last[0].bitmap & 0b100) != 0
    assert rejoined.any(), f"worker 2 never counted again (its peers waited for it {holds.count(2)} times)"
    # Nothing is lost: rounds closed short of worker 2 while it was excused, and it fell back for rounds
    # that were over before it came.
    assert check_reduces(
        results,
        inputs,
        K,
        full=(1, None),
        partial=(1, None),
        fallback=(0, None),
        slack_bits=cluster.slack_bits,
    )


def test_survivors_late_to_a_reduce_while_a_peer_is_dead_get_back_in(make_cluster):
    """Chaos seed 2 (sharded door, rank 2 killed at step 12, 32% RESULT loss; loud in ~1 of 9 runs on a
    loaded host), reduced: one peer is dead (presumed so: early close, so the sync wait is the sync
    deadline alone), and two live workers reach one reduce 0.8 s after the third. The leader closes that
    reduce's exponent rounds without them, so they withhold every chunk of it, and the leader excuses
    them for withholding (``ReduceEngine._peer_limit``). Before the fix it did so again at every reduce,
    each excuse one pool past the one before, so the slot-reuse bound never held it: the two stayed a
    reduce behind for good, counted in nothing (in chaos they raised UnhealthyTraining, locked out). Now
    a reduce that ends with a live peer in none of its RESULTs makes the next one's first units wait the
    long time (``Deadlines.end_of_reduce``, ``sync_wait_s``), and the two get back in. Independent
    expectations: both late workers counted in every chunk of the last reduces (nothing is lost), every
    chunk numpy's mean over its bitmap or a fallback."""
    n, reduces, chunks, late_at, late_s, step_s = 4, 14, 200, 3, 0.8, 0.15
    cluster = make_cluster(
        n, seed=3, elems_per_packet=K, pool_size=128, min_deadline_ms=5, max_deadline_ms=50,
        sync_deadline_ms=50, lag_deadline_ms=50, heartbeat_interval_s=0.05, peer_alive_s=0.3,
    )  # fmt: skip
    rng = np.random.default_rng(5)
    inputs = [[rng.standard_normal(chunks * K).astype(np.float32) for _ in range(n)] for _ in range(reduces)]

    def body(w: LtaWorker, i: int) -> list:
        out: list = []
        if i == 2:  # dead from the start: no GRAD, no heartbeat
            w.close()
            return out
        for r in range(reduces):
            if i in (1, 3) and r == late_at:
                time.sleep(late_s)  # descheduled once, after the dead peer was presumed dead
            began = time.perf_counter()
            out.append(w.allreduce(inputs[r][i], step=r))
            time.sleep(max(0.0, step_s - (time.perf_counter() - began)))  # a step's compute
        return out

    results = run_workers(cluster.workers, body)
    for w in (1, 3):
        late = [int(np.count_nonzero(res.bitmap & (1 << w))) for res in results[0][-3:]]
        assert late == [chunks] * 3, f"worker {w} counted in {late} of {chunks} chunks of the last reduces"
    assert cluster.workers[0].deadlines.presumed_dead == 0b100
    # (no chunk is full: the dead worker is in none)
    assert check_reduces(
        results,
        inputs,
        K,
        full=0,
        partial=(1, None),
        fallback=(0, None),
        slack_bits=cluster.slack_bits,
    )


def test_a_peer_that_withholds_a_group_holds_no_one_with_a_pool_of_k_slots(make_cluster):
    """Issue 22 (small-pool fault): a worker whose exponent proposal is missing from an exponent RESULT
    withholds all K chunks of it, so its bit cannot show up in K units in a row. With a pool of 16 (D = 15
    data slots, ⌊D/2⌋ = 7 units past a peer's newest bit) and K = 16 that run is longer than the peer rule
    lets anyone go past it: on main both workers stalled until a timer, the withheld units waited the lag
    deadline and were FLUSHed on it, and the worker held with nothing in flight waited out the peer-hold
    bound. Every worker has the exponent RESULT's bitmap, so the withholding is known: the peer is excused
    at once and each withheld unit is flushed as soon as its other contributor provably sent it. Lossless
    but for worker 1's GRADs of exponent unit 2 (every copy and probe): independent expectations are the
    bitmaps (chunks 32-47 from worker 0 alone, every other chunk from both), numpy's mean over them, and
    no FLUSH on a timer (the deadlines are long: they are only a safety net here) nor a peer-hold timeout
    on either worker."""
    n, k, chunks = 2, 16, 120
    cluster = make_cluster(
        n, seed=5, elems_per_packet=k, pool_size=16, lag_deadline_ms=2000, sync_deadline_ms=2000,
        min_deadline_ms=1000, max_deadline_ms=2000,
    )  # fmt: skip
    lossy = cluster.workers[1]
    send = lossy.io.send_rows
    target = 2  # exponent unit 2 of the first reduce (global unit 2): slot 2, round 1

    def drop_exponent_grads(rows: np.ndarray, slots: np.ndarray | None = None) -> int:
        hdr = np.ascontiguousarray(rows[:, :HEADER_BYTES]).view(HEADER_DTYPE).reshape(-1)
        keep = ~((hdr["op"] == int(Op.GRAD)) & (hdr["slot"] == target) & (hdr["seq"] == 1))
        return send(rows[keep]) + int(np.count_nonzero(~keep)) if keep.any() else len(rows)

    lossy.io.send_rows = drop_exponent_grads  # type: ignore[method-assign]
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(chunks * k).astype(np.float32) for _ in range(n)]
    results = cluster.reduce_all(inputs)
    group = np.zeros(chunks, dtype=bool)
    group[target * k : (target + 1) * k] = True
    for r in results:
        assert np.all(r.fallback == Fallback.NONE)
        np.testing.assert_array_equal(r.count, np.where(group, 1, 2))
        np.testing.assert_array_equal(r.bitmap, np.where(group, 1, 3).astype(np.uint64))
    assert check_mean_over_bitmap(results, inputs, k, full=n * (chunks - k), partial=n * k, fallback=0)
    stats = [w.stats for w in cluster.workers]
    assert stats[1].withheld_chunks == k and stats[0].withheld_chunks == 0
    assert [s.flushes_on_timer for s in stats] == [0, 0]
    assert [s.peer_hold_timeouts for s in stats] == [0, 0]
