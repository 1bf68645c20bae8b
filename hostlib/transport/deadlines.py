"""When a unit stops waiting: the RTO estimate, the deadline of every unit in flight, and which units
are flushed early because every peer has provably passed them.

Deadlines are one array per reduce (``ReducePlan.deadline_at``), armed and scanned with numpy over the
units in flight: no per-packet heap entries. Each rule below says *why* a wait is as long as it is, so
a timer can be changed without rediscovering a stall.
"""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np

from hostlib.transport.config import TransportConfig
from hostlib.transport.native import native_ext
from hostlib.transport.plan import IN_FLIGHT, ReducePlan

_DEAD_AFTER_RESULTS = 64  # see Deadlines.track_absent
_RTPROP_SAMPLES = 128  # RTprop: the smallest round trip among this many receive batches (BBR's min filter)
_ADAPTIVE_FLOOR_S = 0.001  # a per-unit deadline is never shorter than this
_NO_CAP = 1 << 62  # loss_window when it caps nothing


class Deadlines:
    """RTO estimation (srtt + 4·rttvar, as TCP) and the deadline rules of one worker."""

    def __init__(self, config: TransportConfig, worker_id: int, n_workers: int) -> None:
        self.config = config
        self.worker_id, self.n_workers = worker_id, n_workers
        self.srtt_ms: float | None = None
        self.rttvar_ms = 0.0
        self.early_close = False  # some worker looks dead: use short deadlines
        # A live peer (heard lately, not presumed dead) showed in no RESULT of the last reduce: it is
        # a reduce behind, and the next reduce's first units wait for it (sync_wait_s).
        self.left_behind = False
        self._all_workers = (1 << n_workers) - 1
        self._absent = self._all_workers  # workers missing from every RESULT of the current window
        # Bit w: worker w was missing from every RESULT of a whole window, and from every one since
        # (presumed dead; the parameter exchange stops waiting for its shard). Cleared when it shows up.
        self.presumed_dead = 0
        self._absent_window = 0
        # When each peer's relayed heartbeat last came (time.perf_counter; -inf: never): see heard.
        self.heard_at = np.full(n_workers, -np.inf)
        self._rtt_mins: deque[float] = deque(maxlen=_RTPROP_SAMPLES)
        # The round trip of a FLUSH (see flush_sample): the switch answers it at once, whatever the peers.
        self.flush_srtt_ms: float | None = None
        self.flush_rttvar_ms = 0.0
        # Of the units found lost (fast_flush), the share whose round had closed: the answer was the
        # stored RESULT resent (its multicast was lost on the way down), not a round a FLUSH closed (a
        # GRAD lost on the way up). A moving average; see probe_lost.
        self.closed_share = 0.0
        self.adaptive = config.early_close_theta is not None  # per-unit deadlines (see unit_wait_s)
        # This worker's flush group: the workers behind its leaf switch (config.leaf_sizes), or all of
        # them. A FLUSH closes a round at its own leaf only, so each group picks its own first FLUSH.
        self.group_base, self.group_size = flush_group(config.leaf_sizes, worker_id, n_workers)
        # Ranks are staggered (up to +50%) within the group so that one worker's FLUSH, whose RESULT goes
        # to all, usually saves the others'.
        self._stagger = 1.0 + 0.5 * (worker_id - self.group_base) / self.group_size
        self._bits = np.arange(n_workers, dtype=np.uint64)
        self._update_rto()

    # ---- the RTO -------------------------------------------------------------------------------
    @property
    def stagger(self) -> float:
        """This worker's factor on its deadlines (1 to 1.5 by its place in its flush group), so that the
        workers of a group do not all time out at once."""
        return self._stagger

    def rto_s(self) -> float:
        """Retransmission timeout from the measured round trips, clamped. Cached: it changes only with
        a new RTT sample or the dead-peer mode."""
        return self._rto_cached_s

    def _update_rto(self) -> None:
        cfg = self.config
        if self.srtt_ms is None:
            ms = cfg.initial_deadline_ms
        elif self.early_close:
            ms = 1.5 * self.srtt_ms  # a worker looks dead: don't wait the full RTO for it
        else:
            ms = self.srtt_ms + 4 * self.rttvar_ms
        self._rto_cached_s = min(max(ms, cfg.min_deadline_ms), cfg.max_deadline_ms) / 1000.0

    @property
    def rtprop_ms(self) -> float | None:
        """The round trip without queueing (LTP's RTprop): the smallest seen over recent batches."""
        return min(self._rtt_mins) if self._rtt_mins else None

    def rtt_sample(self, ms: float, min_ms: float | None = None) -> None:
        """One round-trip sample. Callers pass one per received batch (the batch's median), as TCP takes
        about one sample per round trip: the estimator follows the path, not the batching. ``min_ms``:
        the batch's smallest round trip, for RTprop."""
        self._rtt_mins.append(ms if min_ms is None else min_ms)
        if self.srtt_ms is None:
            self.srtt_ms, self.rttvar_ms = ms, ms / 2
        else:
            self.rttvar_ms = 0.75 * self.rttvar_ms + 0.25 * abs(self.srtt_ms - ms)
            self.srtt_ms = 0.875 * self.srtt_ms + 0.125 * ms
        self._update_rto()

    def flush_sample(self, ms: float) -> None:
        """One FLUSH round trip: from a FLUSH to its answer (the partial RESULT it closed, or the stored
        one resent). The RTO's samples time a GRAD until the round closes, which waits for the slowest
        peer: a peer held up by its own recovery made them hundreds of ms on loopback at 20% down loss,
        and every lost FLUSH answer then cost a doubled RTO of that. A FLUSH is answered by the switch at
        once, so its retry waits for this round trip, not for peers."""
        if self.flush_srtt_ms is None:
            self.flush_srtt_ms, self.flush_rttvar_ms = ms, ms / 2
        else:
            self.flush_rttvar_ms = 0.75 * self.flush_rttvar_ms + 0.25 * abs(self.flush_srtt_ms - ms)
            self.flush_srtt_ms = 0.875 * self.flush_srtt_ms + 0.125 * ms

    def flush_rto_s(self) -> float:
        """How long a FLUSH waits for its answer before the next one: ``flush_srtt + 4·flush_rttvar``
        (the RTO until a FLUSH was answered), clamped to [min_flush_deadline_ms, max_deadline_ms]."""
        return self._flush_rto_s(self.config.min_flush_deadline_ms)

    def _flush_rto_s(self, floor_ms: float) -> float:
        if self.flush_srtt_ms is None:
            return self.rto_s()
        ms = self.flush_srtt_ms + 4 * self.flush_rttvar_ms
        return min(max(ms, floor_ms), self.config.max_deadline_ms) / 1000.0

    def give_up_s(self) -> float:
        """The time a worker with this worker's FLUSH round trip takes to give a unit up once it FLUSHed
        it: ``max_flushes`` doubling waits (stagger included) from a FLUSH round trip floored at
        ``min_deadline_ms``. Retries come sooner (:meth:`flush_rto_s`) and go on until then, so a peer's
        hold bound (:meth:`peer_hold_s`) is what it was with the slower retries."""
        return self._flush_rto_s(self.config.min_deadline_ms) * 1.5 * ((2 << self.config.max_flushes) - 1)

    def peer_hold_s(self, plan: ReducePlan) -> float:
        """How long a worker with nothing in flight waits for news of a peer that holds its next unit
        (reuse.py): the first deadline (the peer may be late to this reduce) plus the time a peer takes
        to give a unit up (:meth:`give_up_s`)."""
        return self.first_wait_s(plan) + self.give_up_s()

    def sync_wait_s(self) -> float:
        """How long a unit waits before its first FLUSH until the first RESULT of its reduce shows every
        worker in it: ``sync_deadline_ms``, but while no peer looks dead at least the time a live peer
        may still spend finishing the reduce before, its last RESULT lost: one RTO and a give-up
        (:meth:`give_up_s`). Only exponent units are in flight then, and an exponent round closed
        without a worker withholds all K chunks of it from that worker (docs/protocol.md): at 36% down
        loss (chaos seed 84, srtt 80-140 ms) ranks 0.3-1.5 s late were cut from every exponent round at
        200 ms, had no bit in any RESULT of the reduce, were presumed dead after 64 of them and stayed
        locked out. While a peer looks dead (early close) the sync deadline alone: with a killed rank,
        survivors that waited the longer time for each other split for good, one leading by more than
        it and the others withheld from every round (chaos seed 60: steps 0.04 s -> 1.3 s). Except after
        a reduce a live peer missed entirely (:meth:`end_of_reduce`): the longer time again, once."""
        sync_s = self.config.sync_deadline_ms / 1000.0
        if self.early_close and not self.left_behind:
            return sync_s
        return max(sync_s, self.rto_s() + self.give_up_s())

    def end_of_reduce(self, frontier: np.ndarray, past_it: np.ndarray, now: float) -> None:
        """A reduce ended with ``frontier[w]`` the last unit whose RESULT showed worker ``w`` (-1: none);
        ``past_it[w]``: peer w's relayed heartbeat said it settled the whole reduce. A live peer in none
        of its RESULTs (heard within ``peer_alive_s``, not presumed dead, not past it) fell a reduce
        behind while another peer is dead: with the sync deadline alone, the next reduce would close its
        first units without it again, it would withhold the whole of it again, and it would never get
        back (chaos seed 2). So the next reduce's first units wait the long time for it (:meth:`sync_wait_s`),
        once for each reduce it missed. A peer past it is ahead: this worker is the late one, and
        waiting longer would only slow its catching up."""
        absent = _mask_of(np.flatnonzero((frontier < 0) & ~past_it))
        live = self.alive(now) & ~self.presumed_dead & ~(1 << self.worker_id)
        self.left_behind = bool(absent & live)

    def presume_dead(self, workers: np.ndarray) -> None:
        """Presume these peers dead now, on other evidence than the RESULTs (the parameter exchange: an
        owner that sent nothing for a step for the liveness timeout); cleared as any presumption, when
        a peer's bit shows up again."""
        bits = _mask_of(workers)
        bits &= self._all_workers & ~(1 << self.worker_id)
        if bits & ~self.presumed_dead:
            self.presumed_dead |= bits
            self.early_close = True
            self._update_rto()

    def heard(self, workers: np.ndarray, now: float) -> None:
        """Peers whose relayed heartbeat (``hostlib.protocol.ALIVE_CHUNK``) just came: alive. One presumed
        dead is not any more (a live rank its peers had given up on gets back in: they wait for it
        again, within the slot-reuse bound, so its GRADs reach their rounds and its bit comes back)."""
        self.heard_at[workers] = now
        bits = _mask_of(workers)
        if self.presumed_dead & bits:
            self.presumed_dead &= ~bits
            self.early_close = self.presumed_dead != 0
            self._update_rto()

    def alive(self, now: float) -> int:
        """Bit w: peer w's relayed heartbeat came within ``peer_alive_s``."""
        recent = np.flatnonzero(now - self.heard_at <= self.config.peer_alive_s)
        return _mask_of(recent)

    def track_absent(self, bitmaps: np.ndarray) -> None:
        """Presume a worker dead when it is missing from every one of 64 consecutive RESULTs and no
        relayed heartbeat of it came within ``peer_alive_s``; a worker that shows up in any of them is
        slow or lossy, and is waited for with the normal RTO. One that is heard but never counted is
        behind its peers (a burst of lost RESULTs, a descheduling), not dead: presumed dead, its peers
        ran on without bound and it could never get back in (chaos seeds 84, 32)."""
        if not bitmaps.size:
            return
        seen = int(np.bitwise_or.reduce(bitmaps))
        self.track_absent_bits(seen, len(bitmaps), bool(np.any(bitmaps == self._all_workers)))

    def track_absent_bits(self, seen: int, results: int, any_complete: bool) -> None:
        """:meth:`track_absent` from a batch's summary: ``seen``, the OR of its ``results`` bitmaps, and
        ``any_complete``, whether one of them counts every worker (the native engine computes these)."""
        if not results:
            return
        self._absent &= ~seen
        self.presumed_dead &= ~seen
        self._absent_window += results
        if self._absent_window >= _DEAD_AFTER_RESULTS:
            # (the steady state: every worker showed up in the window, and nobody's heartbeat is needed)
            self.presumed_dead = self._absent & ~self.alive(time.perf_counter()) if self._absent else 0
            self.early_close = self.presumed_dead != 0
            self._absent, self._absent_window = self._all_workers, 0
            self._update_rto()
        elif self.early_close and any_complete:
            self.early_close = False  # everyone contributed again
            self._update_rto()

    def lost_answers(self, closed: int, total: int) -> None:
        """``total`` units found lost were answered, ``closed`` of them by the stored RESULT resent (their
        round had closed: the RESULT was lost on the way down). Updates :attr:`closed_share`."""
        if total:
            self.closed_share += 0.125 * (closed / total - self.closed_share)

    def probing_lost(self) -> bool:
        """Whether a unit found lost is probed at once by every worker (:meth:`fast_flush`): while most
        such units had their round closed already (RESULT loss, :attr:`closed_share` above one half), and
        never in exact mode (a probe would draw the drop policy again)."""
        return self.closed_share > 0.5 and not self.config.exact

    def loss_window(self, span: int) -> int:
        """The most units this worker keeps in flight while RESULT loss dominates (:meth:`probing_lost`):
        a quarter of its span ``S`` (reuse.py), at least 16; otherwise no cap (a very large number).
        Past the bottleneck's rate, units in flight only queue, and the round trip grows with them; a lost
        RESULT is found one round trip after its send (fast_flush) and recovered one FLUSH round trip
        later, and the span lets the worker run only S units past it meanwhile. With the window of a
        2048-slot pool (1023 units, the peer rule's A) in flight, that was used up before the loss was
        found, at every lost RESULT: at 20% down loss, 4 workers on loopback, the span held 60-90 ms of
        a 1 MiB reduce's 150-190 ms (lossless: 30-40 ms); with 256 in flight, 5 ms of 108."""
        if not self.probing_lost():
            return _NO_CAP
        return max(span // 4, 16)

    def recovery_slack_s(self) -> float:
        """How much earlier than its deadline a unit being recovered (found lost, or FLUSHed already) is
        handled when the worker is awake anyway: half a FLUSH RTO while RESULT loss dominates
        (:meth:`probing_lost`, never in exact mode), else 0. Each lost probe answer or FLUSH answer woke
        the worker for its own retry, one unit at a time: at 20% down loss, 4 workers, a 1 MiB reduce at
        K = 64, 10-14 of a worker's 60-70 wake-ups had no packet and 1-2 units due. A retry half a round
        trip early costs at most a duplicate FLUSH, answered with the stored RESULT."""
        return self.flush_rto_s() / 2 if self.probing_lost() else 0.0

    @staticmethod
    def due_or_recovering(plan: ReducePlan, soon: np.ndarray, now: float) -> np.ndarray:
        """Of ``soon`` (in-flight units due within the slack, :meth:`recovery_slack_s`), those due by
        ``now`` and those being recovered: found lost (``plan.proven_lost``) or FLUSHed already. The
        others, whose first deadline waits for a possibly late peer, keep it."""
        return soon[(plan.deadline_at[soon] <= now) | plan.proven_lost[soon] | (plan.flushes[soon] > 0)]

    # ---- deadlines -----------------------------------------------------------------------------
    def first_wait_s(self, plan: ReducePlan) -> float:
        """How long a unit waits before its first FLUSH (units behind every frontier are flushed
        sooner, by :meth:`fast_flush`). In the tail: the RTO, and :meth:`arm` gives a unit past a live
        peer's frontier the lag deadline still."""
        if not plan.synced:
            return self.sync_wait_s()
        if self.early_close or plan.all_sent:
            return self.rto_s()  # a peer looks dead, or this is the tail of the reduce
        return max(self.rto_s(), self.config.lag_deadline_ms / 1000.0)

    def slowest_frontier(self, plan: ReducePlan) -> int:
        """The lowest frontier among this worker and the peers not presumed dead (see track_absent)."""
        dead = (np.uint64(self.presumed_dead) >> self._bits) & np.uint64(1)
        live = plan.frontier[dead == 0]
        return int(live.min()) if live.size else int(plan.frontier.max())

    def unit_wait_s(self, plan: ReducePlan, units: np.ndarray, start: float) -> np.ndarray:
        """Adaptive early close's per-unit deadline, counted from ``start``: the unit's RESULT is due
        when its frame has left the bottleneck queue (``plan.expect_at``: send time + the serialization
        of the frames queued before it and of itself, at the paced or learned rate) plus RTprop; the
        wait adds 4 x rttvar for jitter, as the RTO does. Where no rate or RTprop is known yet: the RTO."""
        rto = self.rto_s()
        rtprop = self.rtprop_ms
        if rtprop is None:
            return np.full(len(units), rto)
        due = plan.expect_at[units] + (rtprop + 4 * self.rttvar_ms) / 1000.0
        wait = np.where(np.isfinite(due), due - start, rto)
        return np.clip(wait, _ADAPTIVE_FLOOR_S, self.config.max_deadline_ms / 1000.0)

    def resending(self, plan: ReducePlan, units: np.ndarray) -> np.ndarray:
        """Which of ``units`` are resent rather than flushed at their deadline: the critical ones, unless
        a peer looks dead or they were resent ``critical_max_resends`` times already, not counting the
        resends made while a live peer may still send (see :meth:`waiting_for_peers` and the config)."""
        if self.early_close:
            return np.zeros(len(units), dtype=bool)
        return plan.critical_unit[units] & (plan.retx_spent[units] < self.config.critical_max_resends)

    def waiting_for_peers(self, plan: ReducePlan, units: np.ndarray, now: float) -> np.ndarray:
        """Which of ``units`` a live peer may still send: a critical resend of one of them waits for that
        peer and does not spend the unit's resend budget, within ``critical_wait_ms`` of the first send.
        Two cases:
        - the unit is past some peer's frontier: that peer may not have sent it yet (late, descheduled);
        - the unit went less than two ``max_deadline_ms`` ago: a peer whose GRAD was lost resends it at its
          own RTO, then every two, and its RTO may be far longer than this worker's (a loaded host: at
          20 ms here against 90-165 ms there, 8 resends ran out in 0.33 s, before the peers had resent
          once or twice, and the round closed short; tests/test_critical.py)."""
        age = now - plan.sent_at[units]
        beyond = units > self.slowest_frontier(plan)
        resend_s = 2 * self.config.max_deadline_ms / 1000.0
        return (beyond | (age < resend_s)) & (age < self.config.critical_wait_ms / 1000.0)

    def peer_lag_s(self, plan: ReducePlan, units: np.ndarray) -> np.ndarray:
        """How much later than this worker the slowest peer may send ``units``, when the frame rate is
        known (pacing): the frames it has still to send up to each unit, past its frontier, at that rate.
        A paced worker's round trips are short (no queue), so the RTO alone would FLUSH the units a
        slightly later peer is still pacing out; an unpaced one's queue is in its round trips already."""
        behind = units - int(plan.frontier.min())
        return np.maximum(behind, 0) * plan.frame_s

    def arm(self, plan: ReducePlan, units: np.ndarray, start: float) -> None:
        """Set the deadlines of ``units`` from ``start``. Each FLUSH without an answer doubles the wait
        (RTO backoff, as TCP does). Once FLUSHed, a unit's round is closed (or its RESULT resent) by the
        switch within one round trip: a missing answer was lost, so retry on the RTO, not on the
        sync/lag deadline that waits for late peers (2 x 200 ms there made every lost FLUSH or RESULT
        of a flush a 400 ms stall).

        A critical unit is not FLUSHed: at its deadline the worker resends its GRAD (the switch adds
        it if the first copy was lost, or answers a closed round with its stored RESULT), one RTO after
        the first send, then every two: LTP's losses are random, not congestion, and the critical units
        are few, so doubling (which made the p99 step 2.7x at 5% kernel loss) buys nothing. Past
        ``critical_max_resends`` resends (those made while a live peer may still send do not count, for up to
        ``critical_wait_ms``: :meth:`waiting_for_peers`), or while a peer looks dead, it is flushed like
        the rest."""
        if not units.size:
            return
        flushes = plan.flushes[units]
        first_s = self.first_wait_s(plan)
        tail = plan.synced and (self.early_close or plan.all_sent)
        if self.adaptive and tail:
            first = self.unit_wait_s(plan, units, start)
        else:
            first = np.full(len(units), first_s)
        if tail:
            if plan.frame_s > 0 and not self.early_close:
                first += self.peer_lag_s(plan, units)
            # A unit past a live peer's frontier may be one that peer has not sent yet: it waits the
            # lag deadline, in the tail as before it (lag_deadline_ms). With the RTO alone (20-50 ms), a
            # peer descheduled for longer had the rest of its units flushed, and a reduce that fits one
            # window is all tail: on 2 Mininet hosts at 10% loss, 4255 of 4570 FLUSHes went on a timer
            # and 16% of the chunks came back full where the loss leaves 81%. The same while another
            # peer looks dead (early close, where every unit counts as tail): the RTO is for the dead
            # peer, whose frontier slowest_frontier leaves out, never for a live one. With speculated
            # exponents a worker sends a whole window at once, without the exponent rounds that had kept
            # the live workers together, and with the RTO alone 2 survivors of a killed third on a
            # loaded host FLUSHed each other out (29 chunks of 782 in one run; 4 runs of 6 lost some,
            # none of 8 with the lag rule).
            beyond = units > self.slowest_frontier(plan)
            quick = first.copy()
            first[beyond] = np.maximum(first[beyond], self.config.lag_deadline_ms / 1000.0)
        retry = flushes > 0
        # A retry's backoff is capped at max_deadline_ms (retries go on until the give-up time); a first
        # wait is not: it may be the sync or lag deadline, which wait for a late peer, not a lost packet.
        backoff = np.minimum(
            self.flush_rto_s() * np.left_shift(1, flushes), self.config.max_deadline_ms / 1e3
        )
        wait_s = np.where(retry, backoff, first) * self._stagger
        at = start + wait_s
        if retry.any():  # never past the give-up time: the last deadline of a FLUSHed unit is its give-up
            at[retry] = np.minimum(at[retry], plan.first_flush_at[units[retry]] + self.give_up_s())
        if tail and not self.early_close:
            probing = self.tail_probing(plan, units)
            at[probing] = np.minimum(at[probing], start + quick[probing])
        crit = self.resending(plan, units)
        if crit.any():
            at[crit] = start + self.rto_s() * np.where(plan.retx[units[crit]] > 0, 2.0, 1.0)
        if not plan.synced:
            # Exponent units also get an early probe (see ReduceEngine._on_deadlines), one RTO after
            # each send.
            exp = (units < plan.exp_units) & ~plan.critical_unit[units]
            if exp.any():
                probe_at = start + self.rto_s() * np.left_shift(1, plan.probes[units[exp]])
                at[exp] = np.minimum(at[exp], probe_at)
        plan.deadline_at[units] = at

    def arm_run(self, plan: ReducePlan, lo: int, hi: int, start: float) -> bool:
        """:meth:`arm` for units ``lo..hi-1`` just sent for the first time, where every one gets the same
        deadline: the reduce is synced and not in its tail, and none of them is critical or was FLUSHed
        (the steady state; the same deadlines as :meth:`arm`). Returns False, arming nothing, elsewhere.
        (A unit sent for the first time was never FLUSHed; without critical chunks and outside exact mode
        no unit is critical: ReducePlan.reset.)"""
        if not plan.synced or self.early_close or plan.all_sent or plan.any_critical or self.config.exact:
            return False
        plan.deadline_at[lo:hi] = start + self.first_wait_s(plan) * self._stagger
        return True

    def tail_probing(self, plan: ReducePlan, units: np.ndarray) -> np.ndarray:
        """Which of ``units`` get a tail probe (``TransportConfig.tail_probe``) at their next deadline: data
        units of the tail (this worker sent everything, the exponents agreed, no peer looks dead) that
        wait for a live peer that may be late (past its frontier), were neither probed nor FLUSHed yet
        and have a GRAD to send again (not withheld). Never in exact mode: there a round closes by the
        drop policy's decision on each worker's one GRAD, and a probe would draw again."""
        cfg = self.config
        if not (cfg.tail_probe and plan.synced and plan.all_sent) or cfg.exact or self.early_close:
            return np.zeros(len(units), dtype=bool)
        return (
            self._probe_candidates(plan, units)
            & (units > self.slowest_frontier(plan))
            & (plan.probes[units] == 0)
        )

    @staticmethod
    def _probe_candidates(plan: ReducePlan, units: np.ndarray) -> np.ndarray:
        """What a tail probe or a repeated one asks of ``units`` alike: data units with a GRAD to send again
        (not withheld), neither FLUSHed yet nor critical (those are resent, not probed)."""
        data = units >= plan.exp_units
        c = np.where(data, units - plan.exp_units, 0)
        return data & plan.has_exp[c] & (plan.flushes[units] == 0) & ~plan.critical_unit[units]

    def arm_probed(self, plan: ReducePlan, units: np.ndarray, now: float) -> None:
        """Deadlines of ``units`` just tail-probed: their FLUSH at the lag deadline from their send (not
        staggered), or one RTO from now if that is later, so the probe's answer has a round trip. Before
        that, the probe is sent again (:meth:`tail_reprobing`) after a FLUSH round trip, doubled per probe
        (staggered): a probe that found the round open (the late peer had not sent yet) is dropped as a
        duplicate, and the RESULT that closes the round later may be lost on the way down; the unit then
        waited the rest of the lag deadline (200 ms: at 20% down loss, one reduce in 5 to 10 ended so).
        Only while RESULT loss dominates (:meth:`probing_lost`). A probe never closes a round: the FLUSH
        for a late peer keeps its time."""
        lag_at = plan.sent_at[units] + self.config.lag_deadline_ms / 1000.0
        flush_at = np.maximum(lag_at, now + self.rto_s())
        if not self.probing_lost():  # no RESULT loss to speak of: a late peer's RESULT will come
            plan.deadline_at[units] = flush_at
            return
        again_at = now + self.flush_rto_s() * np.left_shift(1, plan.probes[units] - 1) * self._stagger
        plan.deadline_at[units] = np.where(again_at < lag_at, again_at, flush_at)

    def tail_reprobing(self, plan: ReducePlan, units: np.ndarray, now: float) -> np.ndarray:
        """Which of ``units`` (due now) are tail-probed again rather than FLUSHed (:meth:`arm_probed`):
        while RESULT loss dominates (:meth:`probing_lost`, never in exact mode), tail-probed ones whose
        lag deadline has not passed, as :meth:`tail_probing` asks of a first probe but for the probe
        count. Without RESULT loss a repeated probe would only add packets while a peer is late."""
        cfg = self.config
        if not (cfg.tail_probe and plan.synced and plan.all_sent and self.probing_lost()) or self.early_close:
            return np.zeros(len(units), dtype=bool)
        return (
            self._probe_candidates(plan, units)
            & (plan.probes[units] > 0)
            & (now < plan.sent_at[units] + cfg.lag_deadline_ms / 1000.0)
        )

    def fast_flush(self, plan: ReducePlan, now: float, native: bool = False) -> np.ndarray:
        """Every worker sends units in order, so once each worker's bit has shown up in some RESULT at
        or beyond unit v (its frontier), all of them have sent every unit before v: an older unit still
        open lost a packet (up or down), and waiting would only add latency. One worker per unit
        (u mod N) flushes it at once; its RESULT goes to all. Units past some worker's frontier wait
        longer (``lag_deadline_ms``): that worker may simply be late.

        Returns the units to probe now (this worker's GRAD sent again, :meth:`probing_lost`): the others'
        of those units while most lost units had their round closed. The designated FLUSH does nothing
        for a RESULT lost on the way down to one worker (the designated one got it and sends none), so the
        others waited one FLUSH round trip for nothing before their own FLUSH; a probe is answered with
        the stored RESULT at once if the round closed, and dropped as a duplicate if it is open (the
        designated FLUSH closes it). In the tail, the unit just past every frontier (the last one, whose
        RESULT has no later one to show it lost) gets its tail probe one FLUSH round trip from now.

        ``native``: the range's units in one call into ``hostlib._engine`` (the same deadlines, marks and
        probes; tests/test_engine_native.py)."""
        lo, hi = max(plan.low, plan.fast_flushed_to), min(plan.frontier.tolist())
        plan.fast_flushed_to = max(plan.fast_flushed_to, hi)
        none = np.zeros(0, dtype=np.int64)
        if plan.all_sent and hi + 1 < plan.units and plan.state[hi + 1] == IN_FLIGHT:
            nxt = np.array([hi + 1])
            probing = self.tail_probing(plan, nxt) | self.tail_reprobing(plan, nxt, now)
            if probing[0]:
                due_at = now + self.flush_rto_s() * self._stagger
                plan.deadline_at[hi + 1] = min(plan.deadline_at[hi + 1], due_at)
        if hi <= lo:
            return none
        if native:
            return self._fast_flush_native(plan, lo, hi, now)
        units = np.flatnonzero(plan.state[lo:hi] == IN_FLIGHT) + lo
        if not units.size:
            return none
        plan.proven_lost[units] = True
        # The others wait one FLUSH round trip for the designated FLUSH's RESULT, then flush themselves:
        # their copy of it, or of the RESULT that closed the round, may have been lost on the way down.
        srtt_s = self._others_wait_s()
        # (An owner-only unit is in flight at its owner alone, whose FLUSH is the only one.)
        # Behind leaf switches, one worker of each leaf (config.leaf_sizes): the round may be open at any.
        designated = units % self.group_size == self.worker_id - self.group_base
        designated |= plan.owner_of_unit(units) >= 0
        at = np.where(designated, now, now + srtt_s)
        # A critical unit is resent, not flushed, and any worker's GRAD may be the lost one: every
        # worker resends its own at once (a duplicate costs one packet; the switch drops it).
        crit = self.resending(plan, units)
        at[crit] = now
        first_try = np.where(crit, plan.retx[units] == 0, plan.flushes[units] == 0)
        if not self.probing_lost():
            sooner = first_try & (plan.deadline_at[units] > at)
            plan.deadline_at[units[sooner]] = at[sooner]
            return none
        probe = first_try & ~designated & ~crit & (units >= plan.exp_units)
        probe[probe] = plan.has_exp[units[probe] - plan.exp_units]
        # A probed unit's FLUSH is the retry of its probe: it waits the probe's answer (the stored RESULT,
        # or the designated FLUSH's RESULT), one FLUSH round trip with its variation (flush_rto_s), as any
        # retry does. At the bare round trip, half the answers were still on their way: a FLUSH and a
        # wake-up for nothing.
        at[probe] = now + self.flush_rto_s() * self._stagger
        sooner = first_try & (plan.deadline_at[units] > at)
        plan.deadline_at[units[sooner]] = at[sooner]
        return units[probe]

    def _others_wait_s(self) -> float:
        """How long the workers not designated to flush a unit found lost wait for the designated FLUSH's
        answer before flushing it themselves: one FLUSH round trip (the RTT before one was measured, the
        deadline floor before any), at least 1 ms."""
        return max(self.flush_srtt_ms or self.srtt_ms or self.config.min_deadline_ms, 1.0) / 1000.0

    def fast_flush_params(self, now: float) -> tuple[float, float, int]:
        """The native fast flush's constants at ``now`` (hostlib/_engine.c, fast_flush): how long the
        workers not designated wait (:meth:`_others_wait_s`), when a probed unit's FLUSH is due (NaN
        unless RESULT loss dominates: no probes), and the resends a critical unit gets (-1: none, a peer
        looks dead)."""
        probe_at = now + self.flush_rto_s() * self._stagger if self.probing_lost() else math.nan
        resend_max = -1 if self.early_close else self.config.critical_max_resends
        return self._others_wait_s(), probe_at, resend_max

    def _fast_flush_native(self, plan: ReducePlan, lo: int, hi: int, now: float) -> np.ndarray:
        others_wait_s, probe_at, resend_max = self.fast_flush_params(now)
        out = np.empty(hi - lo, dtype=np.int64)
        n = native_ext.fast_flush(plan.state, plan.proven_lost, plan.deadline_at, plan.flushes, plan.retx,
                                  plan.critical_unit, plan.retx_spent, plan.has_exp, plan.owner, lo, hi,
                                  plan.exp_units, self.group_size, self.worker_id - self.group_base, now,
                                  others_wait_s, probe_at, resend_max, out)  # fmt: skip
        return out[:n]

    def flush_withheld(self, plan: ReducePlan, now: float) -> None:
        """:meth:`fast_flush` for units some worker withholds (its exponent proposal was not counted:
        ``ReducePlan.withheld_by``): such a unit's round has every GRAD it will ever get once each other
        worker has provably sent it (its bit at that unit or later; this worker: sent), so it is flushed
        then, one worker per unit first, as fast_flush does. Without it the round waited for a GRAD that
        never comes: the lag deadline (200 ms) per run of withheld units, and with a pool of D <= K data
        slots a deadlock that only the peer-hold bound broke (0.5-1 s; see ReduceEngine._peer_limit)."""
        if not plan.any_withheld:
            return
        units = plan.in_flight()
        units = units[(plan.flushes[units] == 0) & ~plan.critical_unit[units]]
        if not units.size:
            return
        sent = plan.frontier[None, :] >= units[:, None]
        sent[:, self.worker_id] = plan.next_unit > units
        ready = (sent | plan.withheld_by(units, self._bits)).all(axis=1) & ~sent.all(axis=1)
        units = units[ready]
        if not units.size:
            return
        plan.proven_in[units] = True
        designated = units % self.group_size == self.worker_id - self.group_base
        designated |= plan.owner_of_unit(units) >= 0
        at = np.where(designated, now, now + self._others_wait_s())
        sooner = plan.deadline_at[units] > at
        plan.deadline_at[units[sooner]] = at[sooner]

    def stall_flush(self, plan: ReducePlan, permitted: int, now: float) -> None:
        """The window stall of a small pool: this worker is held by the peer rule (reuse.py), and every
        peer may, by the same rule, send every unit below ``permitted`` (local index, from the newest
        RESULT that showed this worker's bit). Its in-flight units there that are past a peer's frontier
        then close only when that peer's GRAD arrives or a FLUSH closes them, and no peer can send
        beyond them to show progress: with A = D // 2 units ahead (7 for a pool of 16), all of them
        lacking a GRAD is common at 30% loss, and the lag deadline (200 ms, or a 500 ms RTO inflated by
        the peers' own stalls) ended each such stall: 2 workers, 200 chunks took 4-14 s instead of 0.1 s.
        The peers had the same RESULT that permitted them, so their GRADs are due within the RTO (whose
        samples include the peers' skew; staggered by rank as the other deadlines): the newest such unit
        is FLUSHed then, and the next newest one RTO later if the stall goes on. A RESULT that shows a
        peer's bit moves the peer rule on and makes the older units lost for sure. The cost: a peer late
        by more than the RTO (descheduled) has one round per RTO closed without it. Critical units are
        resent, never flushed, so they are left to their own deadlines."""
        lo = max(plan.low, self.slowest_frontier(plan) + 1)
        hi = min(permitted, plan.next_unit)
        if hi <= lo:
            return
        units = np.flatnonzero(plan.state[lo:hi] == IN_FLIGHT) + lo
        units = units[(plan.flushes[units] == 0) & ~plan.critical_unit[units]]
        if not units.size:
            return
        # The newest only: a RESULT with a peer's bit there proves it sent every unit before, which are
        # then flushed as lost (fast_flush); a peer merely late loses one round per RTO, not all of them.
        newest = int(units[-1])
        plan.deadline_at[newest] = min(plan.deadline_at[newest], self.rto_at(now))

    def rto_at(self, now: float) -> float:
        """One RTO from ``now`` (the floor min_deadline_ms included), staggered: when :meth:`stall_flush`
        FLUSHes the newest stalled unit, and a redo round's first wait (:meth:`arm_redo`)."""
        return now + self.rto_s() * self._stagger

    def arm_redo(self, plan: ReducePlan, units: np.ndarray, now: float) -> None:
        """Arm a redo round's ``units`` in flight as this worker sends it (ReduceEngine._redo_send): every
        worker that knows the agreed exponent sends now, so the round's GRADs are due within a round trip,
        as a tail unit's are: one RTO before its FLUSH; later FLUSHes back off as any unit's (:meth:`arm`)."""
        plan.deadline_at[units] = self.rto_at(now)

    def rearm_shorter(self, plan: ReducePlan, now: float) -> None:
        """Re-arm in-flight units whose first deadline is later than the current rule gives (never
        later than they were: a fast flush may have brought one forward)."""
        units = plan.in_flight()
        fresh = (plan.flushes[units] == 0) & (plan.retx[units] == 0)
        later = fresh & (plan.deadline_at[units] > now + self.first_wait_s(plan))
        if self.adaptive:  # per-unit deadlines may be shorter than the RTO: re-arm every fresh unit
            later = fresh
        units = units[later]
        before = plan.deadline_at[units].copy()
        self.arm(plan, units, now)
        np.minimum(plan.deadline_at[units], before, out=before)
        plan.deadline_at[units] = before

    @staticmethod
    def due(plan: ReducePlan, now: float) -> np.ndarray:
        """In-flight units whose deadline has passed."""
        units = plan.in_flight()
        return units[plan.deadline_at[units] <= now]

    @staticmethod
    def next_at(plan: ReducePlan) -> float:
        """The earliest deadline of a unit in flight (inf when none is)."""
        units = plan.in_flight()
        return float(plan.deadline_at[units].min()) if units.size else float("inf")


def flush_group(leaf_sizes: tuple[int, ...], worker_id: int, n_workers: int) -> tuple[int, int]:
    """The first worker id and the size of ``worker_id``'s block among contiguous blocks of
    ``leaf_sizes`` (TransportConfig.leaf_sizes); with none, every worker is one group."""
    if not leaf_sizes:
        return 0, n_workers
    if sum(leaf_sizes) != n_workers:
        raise ValueError(
            f"leaf_sizes {list(leaf_sizes)} add up to {sum(leaf_sizes)} workers, the job has {n_workers}"
        )
    base = 0
    for size in leaf_sizes:
        if worker_id < base + size:
            return base, size
        base += size
    raise ValueError(f"worker id {worker_id} is not below the job's {n_workers} workers")


def leaf_index(leaf_sizes: tuple[int, ...], worker_id: int) -> int:
    """The index of ``worker_id``'s block among contiguous blocks of ``leaf_sizes`` (its leaf's id,
    softswitch.hierarchy.leaf_blocks' order); with none, ``worker_id`` itself."""
    if not leaf_sizes:
        return worker_id
    ends = np.cumsum(leaf_sizes)
    return int(np.searchsorted(ends, worker_id, side="right"))


def _mask_of(workers: np.ndarray) -> int:
    """The bitmask of these worker ids (bit w: worker w). A loop over Python ints: the arrays are a few
    ids long (alive() runs once per received batch), where numpy's calls cost more than the work."""
    mask = 0
    for w in workers.tolist():
        mask |= 1 << int(w)
    return mask
