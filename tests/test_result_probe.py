"""RESULT loss (issue 42, item 5): units found lost are probed at once while RESULT loss dominates, the
window is capped to a quarter of the span then, and a tail probe is sent again before the lag deadline
(docs/protocol.md, "Host side"). Deadline arithmetic on hand-built plans; expectations from the rules."""

from __future__ import annotations

import numpy as np
import pytest

from hostlib.transport import TransportConfig
from hostlib.transport.deadlines import Deadlines
from hostlib.transport.plan import IN_FLIGHT, ReducePlan

K = 16
N = 4


def _plan(n_chunks: int = 32) -> ReducePlan:
    plan = ReducePlan(n_chunks * K, K)
    plan.frontier = np.full(N, -1, dtype=np.int64)
    plan.synced = True
    plan.has_exp[:] = True
    return plan


def _deadlines(**kw: object) -> Deadlines:
    cfg = TransportConfig(elems_per_packet=K, min_flush_deadline_ms=2, lag_deadline_ms=200, **kw)
    dl = Deadlines(cfg, worker_id=1, n_workers=N)
    dl.rtt_sample(10.0)  # RTO 30 ms
    dl.flush_sample(2.0)  # FLUSH round trip 2 + 4 * 1 = 6 ms
    return dl


def test_lost_units_are_probed_by_the_others_only_while_closed_rounds_dominate():
    dl = _deadlines()
    plan = _plan()
    lost = np.arange(plan.exp_units, plan.exp_units + 8)
    plan.state[lost] = IN_FLIGHT
    plan.deadline_at[lost] = np.inf
    plan.next_unit = lost[-1] + 2
    plan.frontier[:] = lost[-1] + 1  # every worker's bit shown past them: all sent, a packet was lost
    assert dl.fast_flush(plan, 5.0).size == 0  # no answer seen yet: the designated FLUSH alone, as before
    for _ in range(40):  # answers to lost units: 9 in 10 were the stored RESULT resent (closed rounds)
        dl.lost_answers(9, 10)
    assert dl.probing_lost()
    plan.fast_flushed_to = 0
    probe = dl.fast_flush(plan, 5.0)
    designated = lost % N == 1  # worker 1 flushes its own units at once and probes the others' now
    assert probe.tolist() == lost[~designated].tolist()
    assert plan.deadline_at[lost[designated]].tolist() == [5.0] * int(designated.sum())
    for _ in range(40):  # now most lost units were open rounds (GRADs lost on the way up)
        dl.lost_answers(1, 10)
    assert not dl.probing_lost()


def test_exact_mode_never_probes_a_lost_unit():
    dl = _deadlines(exact=True)
    for _ in range(40):
        dl.lost_answers(10, 10)
    assert not dl.probing_lost()
    assert dl.loss_window(1024) > 1 << 40


def test_the_window_is_a_quarter_of_the_span_while_result_loss_dominates():
    dl = _deadlines()
    assert dl.loss_window(1024) > 1 << 40  # no cap without RESULT loss
    for _ in range(40):
        dl.lost_answers(10, 10)
    assert dl.loss_window(1024) == 256
    assert dl.loss_window(8) == 16  # never below 16 units


def test_a_tail_probe_is_sent_again_before_the_lag_deadline_and_the_flush_keeps_its_time():
    dl = _deadlines()
    for _ in range(40):  # RESULT loss dominates
        dl.lost_answers(10, 10)
    plan = _plan()
    plan.all_sent = True
    u = np.array([plan.units - 1])
    plan.state[u] = IN_FLIGHT
    plan.sent_at[u] = 100.0
    lag_at = 100.0 + 0.2
    plan.probes[u] = 1
    now = 100.03
    dl.arm_probed(plan, u, now)
    stagger = 1.0 + 0.5 * 1 / N
    assert plan.deadline_at[u[0]] == pytest.approx(now + 0.006 * stagger)  # again after a FLUSH round trip
    assert dl.tail_reprobing(plan, u, now + 0.01).tolist() == [True]
    plan.probes[u] = 6  # 6 ms x 2^5 x stagger: past the lag deadline, so the FLUSH at its time
    dl.arm_probed(plan, u, now)
    assert plan.deadline_at[u[0]] == pytest.approx(max(lag_at, now + dl.rto_s()))
    assert dl.tail_reprobing(plan, u, lag_at).tolist() == [False]  # at the lag deadline: FLUSH, no probe


def test_without_result_loss_a_tail_probe_is_not_repeated():
    dl = _deadlines()
    plan = _plan()
    plan.all_sent = True
    u = np.array([plan.units - 1])
    plan.state[u] = IN_FLIGHT
    plan.sent_at[u] = 100.0
    plan.probes[u] = 1
    now = 100.03
    dl.arm_probed(plan, u, now)
    assert plan.deadline_at[u[0]] == pytest.approx(max(100.2, now + dl.rto_s()))  # the FLUSH, as before
    assert dl.tail_reprobing(plan, u, now + 0.01).tolist() == [False]


def test_a_probed_units_flush_waits_one_flush_rto_the_designated_flushes_at_once():
    # Worker 1 of 4; FLUSH round trip 2 ms, its variation 1 ms: flush RTO 2 + 4 * 1 = 6 ms; worker 1's
    # stagger 1 + 0.5 * 1/4 = 1.125.
    dl = _deadlines()
    plan = _plan()
    lost = np.arange(plan.exp_units, plan.exp_units + 8)
    plan.state[lost] = IN_FLIGHT
    plan.deadline_at[lost] = np.inf
    plan.next_unit = lost[-1] + 2
    plan.frontier[:] = lost[-1] + 1
    designated = lost % N == 1
    dl.fast_flush(plan, 5.0)  # no RESULT loss seen: the others' FLUSH one FLUSH round trip later
    assert plan.deadline_at[lost[designated]].tolist() == [5.0] * int(designated.sum())
    assert plan.deadline_at[lost[~designated]] == pytest.approx(np.full(int((~designated).sum()), 5.002))
    for _ in range(40):
        dl.lost_answers(9, 10)
    plan.fast_flushed_to = 0
    plan.deadline_at[lost] = np.inf
    probe = dl.fast_flush(plan, 5.0)
    assert probe.tolist() == lost[~designated].tolist()
    assert plan.deadline_at[lost[designated]].tolist() == [5.0] * int(designated.sum())
    # probed: their FLUSH is the probe's retry, after the answer's round trip and its variation
    assert plan.deadline_at[probe] == pytest.approx(np.full(probe.size, 5.0 + 0.006 * 1.125))


class _RecordingIO:
    """A worker's I/O without a socket: every send call's rows are kept, one list entry per call."""

    mode = "test"

    def __init__(self, packet_bytes: int) -> None:
        from hostlib.batchio import RxBatch

        self.rx = RxBatch(8, packet_bytes + 4)
        self.calls: list[np.ndarray] = []

    def send_rows(self, rows: np.ndarray, slots: np.ndarray | None = None) -> int:
        self.calls.append(np.array(rows, copy=True))
        return len(rows)


def test_a_wake_ups_probes_and_flushes_go_in_one_call_each_rows_copies_side_by_side():
    from hostlib import protocol
    from hostlib.protocol import HEADER_BYTES, HEADER_DTYPE, Op
    from hostlib.transport.engine import ReduceEngine

    cfg = TransportConfig(elems_per_packet=K, pool_size=64, flush_copies=2)
    engine = ReduceEngine(7, 1, N, cfg, _RecordingIO(protocol.packet_bytes(K)), 32)  # type: ignore[arg-type]
    plan, _ = engine._begin(
        np.ones(32 * K, dtype=np.float32), step=3, weight=1, critical=None, owners=None, t0=0.0
    )
    plan.synced = True
    # every exponent agreed with this worker's proposal counted, and every chunk quantized into its packet
    # row (the row gets its slot, seq and step then: the native engine writes them with the payload)
    plan.exp_known[:], plan.own_exp[:], plan.shift[:] = True, True, 10
    engine._quantize_ahead(plan, 0, plan.chunks_count)
    assert plan.has_exp.all()
    dl = engine.deadlines
    dl.rtt_sample(10.0)
    dl.flush_sample(2.0)
    for _ in range(40):  # RESULT loss dominates: the others' lost units are probed
        dl.lost_answers(9, 10)
    lost = np.arange(plan.exp_units, plan.exp_units + 8)
    plan.state[lost] = IN_FLIGHT
    plan.deadline_at[lost] = np.inf
    plan.next_unit = lost[-1] + 2
    plan.frontier[:] = lost[-1] + 1
    now = 5.0
    # one wake-up of ReduceEngine._run_units: found lost, probed, then the FLUSHes due now
    probe = dl.fast_flush(plan, now)
    engine._probe_data(plan, probe)
    assert engine.io.calls == []  # queued until the wake-up's deadlines are done
    engine._on_deadlines(plan, engine._due(plan, now), now, 3)
    assert len(engine.io.calls) == 1
    rows = engine.io.calls[0]
    hdr = rows[:, :HEADER_BYTES].copy().view(HEADER_DTYPE)[:, 0]
    assert np.array_equal(rows[0::2], rows[1::2])  # each packet twice, back to back
    g = plan.base + lost  # global unit g: slot g mod D, round g // D + 1 (D = 63 data slots)
    designated = lost % N == 1
    want = [(int(Op.GRAD), u) for u in g[~designated]] + [(int(Op.FLUSH), u) for u in g[designated]]
    got = [(int(op), int(slot) + (int(seq) - 1) * 63) for op, slot, seq in hdr[0::2][["op", "slot", "seq"]]]
    assert got == want


def test_units_being_recovered_are_handled_up_to_half_a_flush_rto_early_while_result_loss_dominates():
    dl = _deadlines()  # flush RTO 2 + 4 * 1 = 6 ms
    assert dl.recovery_slack_s() == 0.0  # no RESULT loss seen: every deadline keeps its time
    for _ in range(40):
        dl.lost_answers(9, 10)
    assert dl.recovery_slack_s() == pytest.approx(0.003)
    exact = _deadlines(exact=True)
    for _ in range(40):
        exact.lost_answers(10, 10)
    assert exact.recovery_slack_s() == 0.0
    plan = _plan()
    e = plan.exp_units
    lost, flushed, fresh, passed, later = e + 1, e + 4, e + 6, e + 9, e + 12
    units = np.array([lost, flushed, fresh, passed, later])
    plan.state[units] = IN_FLIGHT
    plan.next_unit = later + 1
    now = 10.0
    plan.deadline_at[units] = [now + 0.002, now + 0.0025, now + 0.001, now - 0.001, now + 0.004]
    plan.proven_lost[lost] = True  # found lost (behind every frontier), its probe's FLUSH pending
    plan.flushes[flushed] = 1  # FLUSHed once, its retry pending
    soon = Deadlines.due(plan, now + dl.recovery_slack_s())
    assert soon.tolist() == [lost, flushed, fresh, passed]  # (later: 4 ms away, past the slack)
    # the fresh unit may wait for a late peer: it keeps its deadline; the one past it is due anyway
    assert Deadlines.due_or_recovering(plan, soon, now).tolist() == [lost, flushed, passed]
