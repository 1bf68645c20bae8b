"""``ReduceEngine``: the unit engine of one worker, the one owner of a reduce's state.

It plans a reduce, sends its units (exponent and data GRADs), receives and settles RESULTs, keeps the
deadlines, pacing and early close, and builds the :class:`ReduceResult`. It works on whole batches:
every wake-up receives what is queued in one system call, parses the headers as one structured array,
settles all the RESULTs at once (vectorized), sends every unit that may go in one call, and scans the
deadlines of the units in flight with numpy. No Python runs per packet in the steady state.

Two paths with the same results (``self.native``, chosen by native.py: ``LTA_ENGINE=python|native``): the
methods here are the reference; the native path hands the steady state of a wake-up to
``hostlib/_engine.c`` — a received batch settled in one call (``_handle_native``), then, for a reduce in its
steady state, one call of the reduce's ``Wake`` for what follows the receive (the slot-reuse news, the fast
flush, the due scan: :meth:`_wake_after`) and one for the send half (the scan, the window and slot-reuse
rules, quantizing and committing the units that go, the frontier, the stall rule and the next deadline:
:meth:`_wake_send`); elsewhere (the exponent round, the tail, pacing, owners, critical units) the single
steps: the next chunks quantized into their packet rows in one call, a run of units sent with slices
(``_send_run``), the unit scans, the window-stall rule and the slot-reuse news in C — and keeps in Python
what is rare (FLUSH policy, retries, parameters, health, fallbacks). tests/test_engine_native.py checks
them bit for bit, the Wake's wake-ups in the reference's order.

Its interface is small: :meth:`reduce` (one allreduce of a float32 vector), :meth:`receive` (handle
what arrived, between reduces too), the PARAM sends, the codec state, and :attr:`trace` (an
:class:`EngineTrace` told of each step, for benchmarks). ``LtaWorker`` (worker.py) is the front that
users hold; health verdicts are health.py's.

Three LTP mechanisms sit on that engine (seed 002): *critical* units are resent until every worker is
counted and never FLUSHed; a token bucket *paces* the sends (``TransportConfig.pace_gbps`` /
``pace_learn``, see pacing.py); *adaptive early close* (``TransportConfig.early_close_theta``, see
earlyclose.py) ends a reduce once enough of it is in.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hostlib import codec
from hostlib.protocol import (
    ALIVE_CHUNK,
    HEADER_BYTES,
    HEADER_DTYPE,
    HEAL_CHUNK_BASE,
    HEAL_REQUEST_BASE,
    MAX_WORKERS,
    VERSION,
    Flag,
    Op,
    batch_rows,
    empty_batch,
    packet_bytes,
    seq_unit,
)
from hostlib.transport.config import FALLBACK_POLICIES, Fallback, TransportConfig
from hostlib.transport.deadlines import Deadlines, leaf_index
from hostlib.transport.earlyclose import EarlyClose
from hostlib.transport.inbox import ParamInbox
from hostlib.transport.io import WorkerIO
from hostlib.transport.native import RENORMALIZE_CODES, engine_path, native_ext
from hostlib.transport.pacing import RateLearner, TokenBucket, frame_bytes
from hostlib.transport.plan import DONE, ELSEWHERE, GAVE_UP, IN_FLIGHT, PENDING, ReducePlan, critical_chunks
from hostlib.transport.result import (
    ReduceResult,
    TransportStats,
    fallback_codes,
    fallback_rows,
    renormalize_divisor,
)
from hostlib.transport.reuse import SlotReuse
from hostlib.transport.trace import EngineTrace

_QUANTIZE_BLOCK_VALUES = 1 << 16  # values quantized at once, ahead of the sends that need them
_RESULT, _PARAM, _PARAM_REQ = int(Op.RESULT), int(Op.PARAM), int(Op.PARAM_REQ)
_RETX, _MAX, _CRITICAL, _OWNER = int(Flag.RETX), int(Flag.MAX), int(Flag.CRITICAL), int(Flag.OWNER)
_SATURATED = int(Flag.SATURATED)
# Wake.send's codes and held values (hostlib/_engine.c)
_WAKE_DONE, _WAKE_IDLE, _WAKE_SENT, _WAKE_BAIL, _WAKE_SENT_SOME = 0, 1, 2, 3, 4
_HELD = ("", "span", "peers")

log = logging.getLogger(__name__)

_HEAL_STREAMS_KEPT = 4  # a peer's heal streams meant for another rank are held this many at most
_SPEC_KEYS = 256  # keys whose last agreed exponents a worker keeps for speculation
_REDO_MAX_WORKERS = 32  # a redo's GRAD names its sender in the 32-bit weight field (_redo_send)
_LATER_REDO_KEPT = 4096  # later units known to be redone, kept for their reduce (_later_redone)


@dataclass
class ReduceOutcome:
    """What the health checks need from one reduce besides its result."""

    got_nothing: int  # chunks this worker waited for that got no aggregate
    chunks: int  # chunks this worker waited for (at least 1)
    passed: bool  # the peers had left this reduce before this worker started it


class ReduceEngine:
    """The unit engine of worker ``worker_id`` of job ``job_id`` (``n_workers`` in all), talking to the
    switch at ``switch_addr`` (resolved) through ``io``. All workers of a job reduce vectors of the same
    lengths in the same order: the slot and round of every packet follow from that order."""

    def __init__(
        self,
        job_id: int,
        worker_id: int,
        n_workers: int,
        config: TransportConfig,
        io: WorkerIO,
        window: int,
    ) -> None:
        self.job_id, self.worker_id, self.n_workers = job_id, worker_id, n_workers
        self.config = cfg = config
        self.io = io
        k = cfg.elems_per_packet
        self.packet_bytes = packet_bytes(k)
        # The pool's last slot is reserved for the health probe (health.probe_switch); units use the others.
        self.probe_slot = cfg.pool_size - 1
        self._slots = cfg.data_slots
        self.window = window
        self._flush_batch = empty_batch(0, k)  # FLUSH scratch, grown on demand
        # The native path's FLUSH row (_flush_native), for the header fields it was made with.
        self._flush_template: tuple[Any, np.ndarray] = (None, np.zeros(0, dtype=np.uint8))
        # What a wake-up sends to recover units (probes, FLUSHes): gathered, each row's copies side by
        # side, and sent in one call at the end of the wake-up (_send_recovery).
        self._recovery: list[tuple[np.ndarray, np.ndarray]] = []  # (rows, their slots)
        # The reduce's last data units sent more than once (none in exact mode: one draw per GRAD there)
        self._tail_units = 0 if cfg.exact else cfg.tail_units
        # Units settled in a row with no sign of loss, and whether this reduce sends each packet once
        # (TransportConfig.quiet_units; _learn decides it for the next reduce).
        self._quiet_run = 0
        self._single_copies = False
        self._next_unit = 0  # global unit counter shared (by construction) with every worker of the job
        self._rng = np.random.default_rng([cfg.seed, job_id, worker_id])
        self._plans: dict[int, ReducePlan] = {}
        self._prev: dict[Any, np.ndarray] = {}
        # The exponent round's result of the last reduce of each (length, occurrence in its step) (INT32_MIN:
        # none), for speculated exponents (TransportConfig.speculate_bits; _spec_key, _speculate); at most
        # _SPEC_KEYS of them, the oldest dropped.
        self._agreed: dict[tuple[int, int], np.ndarray] = {}
        self._spec_step: int | None = None
        self._spec_seen: dict[int, int] = {}
        # Later reduces' units a RESULT showed redone, and their first rounds' bitmaps (_on_redo)
        self._later_redo: dict[int, int] = {}
        # The (chunks, K) rows buffer a prev value is a view of, where it was a plan's output rows (handed
        # over in _finish instead of copied; plan.out then takes the buffer it held before). A plan's out
        # is never one of these while they back a prev value.
        self._prev_rows: dict[Any, np.ndarray] = {}
        self.deadlines = Deadlines(cfg, worker_id, n_workers)
        self.reuse = SlotReuse(self._slots, worker_id, n_workers)
        # An owner-only reduce makes every news_every-th chunk every worker's (_owners_rule): ~8 RESULTs
        # with every peer's bit inside the A units the slot-reuse rule lets a worker run ahead of them.
        self.news_every = max(1, self.reuse.ahead // 8)
        # The window's cap while RESULT loss dominates (Deadlines.loss_window; none until then), updated
        # as units found lost are answered.
        self._loss_window = self.deadlines.loss_window(self.reuse.span)
        # The newest global unit a RESULT showed, in a reduce or between reduces (-1: none; one cell, which
        # the native settle updates in place). Units a pool or more below it can never be answered
        # (_drop_overtaken).
        self._newest_unit = np.full(1, -1, dtype=np.int64)
        # Every unit below this one is settled here (the end of the last reduce), what this worker's
        # relayed heartbeat announces; and what each peer's announced (-1: nothing yet), which feeds
        # _newest_unit (_peer_settled; docs/protocol.md, "The relayed heartbeat").
        self.settled_to = 0
        self.peers_settled = np.full(n_workers, -1, dtype=np.int64)
        self._peer_news = False
        # Since when only the peers' progress holds this worker's next unit, nothing of its own in flight
        # (_peer_limit); inf while it is not so held. Kept across reduces: a worker held at every reduce
        # by a dead peer must not start its wait afresh each time.
        self._peer_wait_since = math.inf
        # What held this worker's sending at its last _send_ready ("span", "peers" or ""), and since when
        # (stats.held_by_span_s, held_by_peers_s).
        self._held, self._held_since = "", 0.0
        self.stats = TransportStats(io=io.mode)
        self._fallback = FALLBACK_POLICIES[cfg.fallback]
        # The worker id a RESULT this worker's FLUSH closed carries: its own, or behind leaf switches
        # (config.leaf_sizes) its leaf's id, the contributor that closed the spine's round.
        self._closer_id = leaf_index(cfg.leaf_sizes, worker_id)
        if cfg.own_leaf and not cfg.leaf_sizes:
            raise ValueError("own_leaf needs leaf_sizes: a worker is its own leaf only behind a spine")
        # Its own leaf (config.own_leaf, alone in its block): it talks to the spine as leaf _closer_id.
        self.own_leaf = bool(cfg.own_leaf and cfg.leaf_sizes[self._closer_id] == 1)
        self.switch_id = self._closer_id if self.own_leaf else worker_id  # the id its switch knows it by
        self._header = {"version": VERSION, "job_id": job_id, "worker_id": self.switch_id, "step": 0}
        self._worker_bits = np.arange(n_workers, dtype=np.uint64)
        self._all_bits = np.uint64((1 << n_workers) - 1)  # a RESULT every worker is counted in
        # Parameter broadcasts that arrived, each with its step and sender (the PARAM's worker_id: an
        # owner's copy, or a survivor's re-served copy of a dead owner's shard: torch_ext/exchange.py),
        # and requests for resends.
        self.param_inbox = ParamInbox(config.elems_per_packet)
        self.param_requests: set[int] = set()
        # Answers PARAM_REQs as they arrive, even inside a reduce (set by the parameter exchange): a
        # receiver waiting for a critical chunk must not wait for this worker's next publish.
        self.param_responder: Any = None
        # Healing (hostlib/torch_ext/heal.py): state streams that arrived, per (sender, sender's step):
        # {index: values}; and the senders whose heal request named this worker. Kept apart from the
        # parameter inbox and requests, which the parameter exchange drains.
        self.heal_inbox: dict[tuple[int, int], dict[int, np.ndarray]] = {}
        self.heal_requests: set[int] = set()
        self.heal_responder: Any = None  # answers them as they arrive, even inside a reduce (heal.py)
        # Pacing: the token bucket, the learned bottleneck rate, and a virtual copy of the bottleneck
        # queue (when the last frame sent will have left it), for per-unit deadlines.
        self._frame = frame_bytes(self.packet_bytes)
        self.pacer = TokenBucket(cfg.pace_gbps * 1e9, cfg.pace_burst_ms / 1000.0, self._frame)
        self.rate_learner = RateLearner()
        self._queue_free_at = 0.0
        theta = cfg.early_close_theta
        self.early = None if theta is None else EarlyClose(theta, cfg.early_close_slack_ms)
        self.trace: EngineTrace | None = None  # told of each step of a reduce (benchmarks; None: nobody)
        # The native path settles received batches in one call (native.py; LTA_ENGINE=python: the reference)
        self.native = engine_path() == "native"
        self._codec_c = codec.codec_path() == "c"  # (LTA_CODEC, read once: the quantize path of this engine)
        self._renormalize_code = RENORMALIZE_CODES[cfg.renormalize]
        self._headroom = codec.headroom_bits(n_workers)
        cap = len(io.rx.lens)
        self._scratch = {
            "later": np.full(n_workers, -1, dtype=np.int64),
            "settled": np.zeros(cap, dtype=np.int64),
            "side": np.zeros(cap, dtype=np.int64),
            "rtt": np.zeros(cap, dtype=np.float64),
            "flush": np.zeros(cap, dtype=np.float64),
            "redo": np.zeros(cap, dtype=np.int64),
            "due": np.zeros(0, dtype=np.int64),  # grown to the plan's units
            "probe": np.zeros(0, dtype=np.int64),  # ... the Wake's fast flush's probes too
            "todo": np.zeros(0, dtype=np.int64),  # ... and chunks
            "saturated": np.zeros(0, dtype=bool),
        }
        self._quantize_flags = (_CRITICAL, _SATURATED, _OWNER)
        # settle's parameters, per (base, units) of a reduce
        self._native_params: tuple[tuple[int, int], tuple[int, ...]] = ((-1, 0), ())

    # ---- one reduce ----------------------------------------------------------------------------
    def reduce(
        self,
        local: np.ndarray,
        *,
        step: int,
        key: Any,
        weight: int,
        critical: Any,
        out: np.ndarray | None,
        owners: np.ndarray | None,
        scale: float = 1.0,
    ) -> tuple[ReduceResult, ReduceOutcome]:
        """One allreduce of the float32 vector ``local`` (see ``LtaWorker.allreduce`` for the arguments
        and the guarantee); returns the result and what the health checks need."""
        t0 = time.perf_counter()
        key = local.size if key is None else key
        spec_key = self._spec_key(local.size, step)
        plan, n_chunks = self._begin(
            local,
            step=step,
            weight=weight,
            critical=critical,
            owners=owners,
            t0=t0,
            out=out,
            out_scale=scale,
            spec_key=spec_key,
        )
        self._run_units(plan, step, t0)
        self._count_held(time.perf_counter(), "")
        self.deadlines.end_of_reduce(
            plan.frontier, self.peers_settled >= plan.base + plan.units, time.perf_counter()
        )
        self._learn(plan, time.perf_counter() - t0)
        result, outcome = self._finish(plan, local.size, n_chunks, key, out, t0, scale)
        self._remember_agreed(plan, spec_key)
        self.settled_to = max(self.settled_to, plan.base + plan.units)
        if self.trace is not None:
            self.trace.on_reduce_end(self, plan, result)
        return result, outcome

    def _begin(
        self,
        local: np.ndarray,
        *,
        step: int,
        weight: int,
        critical: Any,
        owners: np.ndarray | None,
        t0: float,
        out: np.ndarray | None = None,
        out_scale: float = 1.0,
        spec_key: tuple[int, int] | None = None,
    ) -> tuple[ReducePlan, int]:
        """Stage ``local``, take its exponent proposals and reset the plan of its length: the reduce is
        ready to send. Returns the plan and the chunk count (without exact mode's fence). ``out`` and
        ``out_scale``: where the values go (``reduce``'s), given here so that each chunk's values go there as
        its RESULT is settled (ReducePlan.deliver_to)."""
        n = local.size
        k, exact = self.config.elems_per_packet, self.config.exact
        n_chunks = max(1, -(-n // k))
        plan = self._plan_for(n)
        mask = None if critical is None else critical_chunks(critical, n, k)
        if exact:
            fenced = np.zeros(plan.chunks_count, dtype=bool)
            if mask is not None:
                fenced[:n_chunks] = mask
            fenced[n_chunks] = True
            mask = fenced
        proposals, k_full = self._stage(local, plan, weight)
        self._header["step"] = step
        owners = self._owners_rule(owners, n_chunks)
        plan.reset(
            self._next_unit,
            self._slots,
            self._header,
            weight,
            proposals,
            self.n_workers,
            mask,
            exponents_critical=exact,
            owners=owners,
            worker_id=self.worker_id,
            # the native quantize writes each data row's slot, seq and step with its payload
            stamp_data=not self._native_quantize,
        )
        plan.direct = local[: k_full * k].reshape(k_full, k) if k_full else None
        if spec_key is not None and self._speculating(plan):
            self._speculate(plan, spec_key, proposals)
        self._later_redone(plan)
        # Each chunk's values go to ``out`` as its RESULT is settled, while the reduce waits for the others,
        # instead of in a pass over every value after the last: not where chunks are owned elsewhere (their
        # rows are not written), nor with renormalize "none" (a partial chunk there takes the fallback, and
        # the `local` one reads the input, which ``out`` may be).
        deliver = out is not None and not plan.any_owned and self.config.renormalize != "none"
        plan.deliver_to(out.reshape(-1) if deliver and out is not None else None, out_scale)
        if self.own_leaf:  # partials of one: this worker's count and bit
            for batch in (plan.exp_batch, plan.data_batch):
                batch["count"], batch["bitmap"] = 1, np.uint64(1) << np.uint64(self.worker_id)
        self._next_unit += plan.units
        self._start_pacing()
        plan.frame_s = self._frame * 8 / self.pacer.rate_bps if self.pacer.paced else 0.0
        self._arm_early_close(plan, t0)
        if self.trace is not None:
            self.trace.on_reduce_start(self, plan)
        return plan, n_chunks

    def _stage(self, local: np.ndarray, plan: ReducePlan, weight: int) -> tuple[np.ndarray, int]:
        """``local``'s exponent proposals, its values staged in ``plan.chunks`` as far as they need to be:
        returns the proposals and how many whole chunks are quantized where the caller holds them (0: all
        staged)."""
        n, k, chunks = local.size, self.config.elems_per_packet, plan.chunks
        in_place = local.ctypes.data == chunks.ctypes.data  # filled in place (input_buffer)
        # A chunk holding NaN or Inf proposes the non-finite exponent (the max carries it to every worker)
        # and sends zeros in its data round, so its round runs as any other's and comes back NaN everywhere.
        scale = float(weight) if self.config.renormalize == "weight" else 1.0
        # The native engine quantizes whole chunks where the caller holds them (``direct``): staged are only
        # the last, partial chunk and what follows, so the input is read once before quantizing, not copied.
        k_full = n // k if self._native_quantize and not in_place and scale == 1.0 else 0
        proposals, own_nonfinite = codec.stage(None if in_place else local, chunks, n, scale, k_full)
        if own_nonfinite and k_full:  # staged whole after all: a non-finite chunk sends zeros
            proposals, own_nonfinite = codec.stage(local, chunks, n, scale)
            k_full = 0
        if own_nonfinite:
            log.warning(
                "worker %d: %d chunks hold NaN or Inf; they come back NaN on every worker",
                self.worker_id,
                own_nonfinite,
            )
        return proposals, k_full

    @property
    def _native_quantize(self) -> bool:
        """Whether chunks are quantized by the native engine (``hostlib._engine.quantize_ahead``): it can
        read whole chunks from the caller's input (``plan.direct``, not staged by ``_begin``) and it writes
        each data row's slot, seq and step (not stamped by the reset). One predicate for the three places
        that depend on it, so that they can never disagree."""
        return self.native and self._codec_c

    def _owners_rule(self, owners: np.ndarray | None, n_chunks: int) -> np.ndarray | None:
        """``owners`` checked, with the chunks that are every worker's whatever it says (see
        ``LtaWorker.allreduce``)."""
        if owners is None:
            return None
        owners = np.asarray(owners, dtype=np.int64).reshape(-1)
        top = int(owners.max(initial=-1))
        if len(owners) != n_chunks or top >= self.n_workers:
            raise ValueError(
                f"owners must hold one worker id (< {self.n_workers}) or -1 per chunk: {n_chunks} "
                f"values, got {len(owners)} (max {top})"
            )
        if top >= 0:
            owners = owners.copy()
            # Every news_every-th chunk is every worker's: its RESULT shows each worker which peers
            # sent that far, the news the slot-reuse rule waits for (reuse.py). With RESULTs of its own
            # chunks alone, a worker that owns none of a long run of chunks heard nothing of its peers
            # there, was held, then excused them and drifted a pool apart: 4 workers, contiguous
            # shards, no loss, 90-100% of every worker's chunks came back without an aggregate.
            owners[self.news_every - 1 :: self.news_every] = -1
            if not self.config.exact:
                # The last chunk is every worker's: its RESULT shows each worker who passed the whole
                # reduce (units go in order), so an owner flushes its own last units at once, and a
                # GRAD of the last unit lost is probed by its sender (docs/protocol.md, "Owner-only
                # units"). Without it an owner's last unit waited the lag deadline for a peer's lost
                # GRAD.
                owners[-1] = -1
        # In exact mode the fence is every worker's (and the last chunk keeps its owner).
        return np.append(owners, -1) if self.config.exact else owners

    # ---- speculated exponents (docs/protocol.md, "Speculated exponents") ----------------------------------
    def _speculating(self, plan: ReducePlan) -> bool:
        """Whether ``plan``'s reduce may send chunks at speculated exponents: TransportConfig.speculate_bits
        set, renormalized by the count (a redo's round carries its contributors in the weight field, one
        bit per worker: 32 workers at most), not in exact mode, not behind leaf switches, no chunk owned
        (owner-only RESULTs)."""
        cfg = self.config
        if not cfg.speculate_bits or cfg.renormalize != "count" or self.n_workers > _REDO_MAX_WORKERS:
            return False
        return not cfg.exact and not cfg.leaf_sizes and not plan.any_owned

    def _spec_key(self, n: int, step: int) -> tuple[int, int]:
        """The reduce whose agreed exponents a reduce of ``n`` values at ``step`` speculates from: the last
        one of the same length and the same occurrence of that length in its step (DDP's buckets of one
        length in a step are told apart). Lengths, their order and the steps are what every worker of the
        job passes alike, so every worker that got that reduce's exponent RESULTs speculates alike (the
        caller's key, a tensor's address on torch's paths, may differ between ranks)."""
        if step == 0:  # (no step numbering, LtaWorker.allreduce's default: by the length alone)
            return n, 0
        if step != self._spec_step:
            self._spec_step = step
            self._spec_seen.clear()
        seen = self._spec_seen.get(n, 0)
        self._spec_seen[n] = seen + 1
        return n, seen

    def _speculate(self, plan: ReducePlan, key: tuple[int, int], proposals: np.ndarray) -> None:
        """Mark the chunks of ``plan`` that go at once, at the exponent the reduce ``key`` (:meth:`_spec_key`)
        agreed on last plus ``speculate_bits``: those whose exponent RESULT this worker got there (finite),
        critical ones excepted. Their shift is known now, their rows are sent whatever the exponent round
        will say, and the exponent round's RESULT leaves them be (_on_exponents).

        A chunk whose own exponent lies above the speculated one (its values may not fit; a non-finite
        chunk too), or more than ``speculate_guard_bits`` below it while not all zero (it would lose more
        than that many bits against the exponent round's shift), goes flagged SATURATED: its first round
        cannot be final, and the chunk is redone at the agreed exponent (_on_redo). Both decisions depend
        on this worker's own values; who is counted in the result never does (the redo is by the first
        round's contributors)."""
        last = self._agreed.get(key)
        if last is None or len(last) != plan.chunks_count:
            return
        cfg = self.config
        # (an all-zero chunk last time says nothing of this one's range: it waits for the exponent round)
        ok = (last > codec.EMPTY_EXPONENT) & (last < codec.NONFINITE_EXPONENT)
        if plan.any_critical:
            ok &= ~plan.critical
        every = bool(ok.all())  # (the steady state: slices, no gathers)
        if not every and not ok.any():
            return
        c: slice | np.ndarray = slice(None) if every else np.flatnonzero(ok)
        guess = last[c] + np.int32(cfg.speculate_bits)  # (|exponents| < 2^25: int32 holds them)
        own = proposals[c]
        sat = plan.spec_sat[c] if every else np.empty(len(guess), dtype=bool)
        np.greater(own, guess, out=sat)
        sat |= (own < guess - np.int32(cfg.speculate_guard_bits)) & (own > codec.EMPTY_EXPONENT)
        if not every:
            plan.spec_sat[c] = sat
        plan.spec[c] = plan.exp_known[c] = plan.own_exp[c] = True
        plan.shift[c] = codec.data_shifts(guess, self.n_workers)
        plan.exp_bitmap[c] = self._all_bits
        self.stats.speculated_chunks += len(guess)

    def _remember_agreed(self, plan: ReducePlan, key: tuple[int, int]) -> None:
        """Keep what the exponent round of ``plan``'s reduce agreed on, for the next reduce of ``key``."""
        if not self._speculating(plan):
            return
        kept = self._agreed.pop(key, None)
        if kept is None or kept.shape != plan.agreed_exp.shape:
            kept = np.empty_like(plan.agreed_exp)
        np.copyto(kept, plan.agreed_exp)
        self._agreed[key] = kept  # (re-inserted: the newest key is last)
        if len(self._agreed) > _SPEC_KEYS:
            del self._agreed[next(iter(self._agreed))]

    def _on_redo(self, plan: ReducePlan, rows: np.ndarray) -> None:
        """``rows`` of the receive buffer are RESULTs of data units' first rounds that some contributor
        flagged SATURATED (it clamped, or its values lay outside the speculated exponent's range): no such
        sum is used. Each unit moves to its second round (``plan.seqs``: its FLUSHes and probes go there),
        where the first round's contributors whose proposals the exponent round counted send the chunk
        again at the agreed exponent (_redo_send); every worker awaits its RESULT as any unit's. Rows of a
        later reduce's units (flagged, or of their redo's round) are remembered for it (_later_redo)."""
        data = self.io.rx.data
        hdr = np.ndarray((len(data),), dtype=HEADER_DTYPE, buffer=data, strides=(data.strides[0],))
        g, phase = seq_unit(
            hdr["seq"][rows].astype(np.int64), hdr["slot"][rows].astype(np.int64), self._slots
        )
        bits = np.where(phase == 0, hdr["bitmap"][rows].astype(np.uint64), np.uint64(0))
        later = g >= plan.base + plan.units
        if later.any():
            for unit, first in zip(g[later].tolist(), bits[later].tolist(), strict=True):
                self._later_redo.setdefault(unit, first)
            while len(self._later_redo) > _LATER_REDO_KEPT:
                del self._later_redo[next(iter(self._later_redo))]
            g, bits = g[~later], bits[~later]
        self._mark_redo(plan, g - plan.base - plan.exp_units, bits)

    def _later_redone(self, plan: ReducePlan) -> None:
        """At a reduce's start: its units a peer's RESULT showed redone before this worker got there (it
        was late: its first round's GRAD and FLUSHes go to a round the slot moved past, which the switch
        drops unanswered). They are redone here too, at once: this worker's second-round GRAD gets the
        stored RESULT back, instead of its FLUSHes giving up."""
        if not self._later_redo:
            return
        top = plan.base + plan.units
        mine = {g: bits for g, bits in self._later_redo.items() if plan.base + plan.exp_units <= g < top}
        self._later_redo = {g: bits for g, bits in self._later_redo.items() if g >= top}
        if mine:
            units = np.fromiter(mine.keys(), dtype=np.int64, count=len(mine))
            bits = np.fromiter(mine.values(), dtype=np.uint64, count=len(mine))
            self._mark_redo(plan, units - plan.base - plan.exp_units, bits)

    def _mark_redo(self, plan: ReducePlan, c: np.ndarray, bits: np.ndarray) -> None:
        """Chunks ``c`` of ``plan`` are redone, their first rounds' bitmaps ``bits`` (_on_redo)."""
        if not c.size:
            return
        c, first = np.unique(c, return_index=True)
        bits = bits[first]
        new = ~plan.redo[c] & (plan.state[c + plan.exp_units] < DONE)
        c, bits = c[new], bits[new]
        if not c.size:
            return
        u = c + plan.exp_units
        plan.redo[c] = True
        plan.redo_bits[c] = bits
        plan.seqs[u] += 1
        # The second round has no deadline until this worker knows the agreed exponent (_redo_send): its
        # contributors cannot send before they know it, and a FLUSH before their GRADs would close the
        # round short of them, or empty (a fallback chosen by the values that caused the redo). Then it
        # waits one RTO. It counts as FLUSHed once: no rule that reads a peer's progress (the fast flush,
        # tail probes) may close it sooner, since the peers send it out of order, as their first round's
        # RESULT reaches them.
        for arr in (plan.probes, plan.retx, plan.retx_spent):
            arr[u] = 0
        plan.flushes[u] = 1
        plan.proven_lost[u] = plan.proven_in[u] = False
        plan.deadline_at[u] = np.inf
        # A unit this worker had not sent yet is in flight from now: its first round is over, and its row
        # for the second goes with the others' (_redo_send); the send loop passes it by.
        pending = plan.state[u] == PENDING
        if pending.any():
            plan.state[u[pending]] = IN_FLIGHT
            plan.sent_at[u[pending]] = time.perf_counter()
            plan.quantized[c[pending]] = True
            plan.has_exp[c[pending]] = False
        plan.redo_waiting[c] = True
        plan.any_redo_waiting = True
        self.stats.redone_chunks += len(c)
        self._redo_send(plan)

    def _redo_send(self, plan: ReducePlan) -> None:
        """Send this worker's GRAD of the redone chunks whose agreed exponent is known now, at that exponent:
        its values with weight 2^worker where it is one of their first round's contributors and its
        proposal was counted, else zeros with weight 0. Every worker that knows of the redo sends, so the
        round closes when the last GRAD arrives, as a first round does, and no timer decides who is
        counted; the weights' sum names the contributors counted (the settle reads it: count and bitmap).
        A chunk whose exponent unit was given up has no agreed exponent: this worker sends nothing for it
        (its FLUSH closes the round)."""
        k, e = self.config.elems_per_packet, plan.exp_units
        c = np.flatnonzero(plan.redo_waiting)
        known = (plan.agreed_bits[c] != 0) | (plan.state[c // k] >= DONE)
        c = c[known]
        if not c.size:
            return
        plan.redo_waiting[c] = False
        plan.any_redo_waiting = bool(plan.redo_waiting.any())
        u = c + e
        now = time.perf_counter()
        plan.first_flush_at[u] = plan.flushed_at[u] = now
        self.deadlines.arm_redo(plan, u[plan.state[u] == IN_FLIGHT], now)
        sends = (plan.agreed_bits[c] != 0) & (plan.state[u] == IN_FLIGHT)
        plan.has_exp[c] = sends  # (a probe resends the second round's row; none where nothing went)
        if not sends.any():
            return
        c, u = c[sends], u[sends]
        own = np.uint64(1) << np.uint64(self.worker_id)
        mine = (plan.redo_bits[c] & plan.agreed_bits[c] & own) != 0
        if plan.direct is not None:  # whole chunks were quantized where the caller holds them
            there = c[mine & (c < len(plan.direct))]
            plan.chunks[there] = plan.direct[there]
        shifts = codec.data_shifts(plan.agreed_exp[c].astype(np.int64), self.n_workers)
        plan.shift[c] = shifts
        d = plan.data_batch
        if mine.any():
            codec.quantize_into(plan.chunks, shifts[mine], self.n_workers, self._rng, d["payload"], c[mine])
        d["payload"][c[~mine]] = 0
        d["weight"][c] = np.where(mine, 1 << self.worker_id, 0)
        plan.restamp("weight")  # (the next reset writes the reduce's weight back)
        d["exp"][c], d["seq"][c], d["slot"][c] = shifts, plan.seqs[u], plan.slots[u]
        d["step"][c] = self._header["step"]
        d["flags"][c] = np.where(plan.critical[c], _CRITICAL, 0) | np.where(plan.owner[c] >= 0, _OWNER, 0)
        self.send(plan.data_rows[c], plan.slots[u])
        plan.sent_at[u] = time.perf_counter()

    def _finish(
        self,
        plan: ReducePlan,
        n: int,
        n_chunks: int,
        key: Any,
        out: np.ndarray | None,
        t0: float,
        scale: float = 1.0,
    ) -> tuple[ReduceResult, ReduceOutcome]:
        """The reduce's values (renormalized where a RESULT came, the fallback elsewhere) times
        ``scale``, its result and its statistics. The ``prev`` fallback keeps the values unscaled."""
        values, fallback, nonfinite = self._values(plan, n, n_chunks, n if key is None else key, out, scale)
        elapsed = time.perf_counter() - t0
        got_nothing = self.stats.account(plan, fallback, self.n_workers, elapsed)
        # A RESULT one pool past this reduce's last unit: a peer sent past its end (units go in order), so
        # the peers had left this reduce (with got_nothing == every chunk: skipped whole; _drop_overtaken).
        last = plan.base + plan.units - 1
        passed = int(self._newest_unit[0]) >= last + self._slots
        waited = max(1, plan.chunks_count - int(plan.elsewhere.sum()))
        done = (plan.state[plan.exp_units :] == DONE)[:n_chunks] & ~plan.elsewhere[:n_chunks]
        c = slice(0, n_chunks)  # without the exact mode's fence
        result = ReduceResult(
            values=values,
            count=np.where(done, plan.count[c], 0),
            bitmap=np.where(done, plan.bitmap[c], np.uint64(0)),
            fallback=fallback[c],
            withheld=plan.withheld[c],
            saturated=(plan.result_flags[c] & Flag.SATURATED).astype(bool),
            shift=plan.shift[c].copy(),
            elapsed_s=elapsed,
            critical=plan.critical[c].copy(),
            nonfinite=nonfinite.copy(),
        )
        return result, ReduceOutcome(got_nothing, waited, passed)

    def _values(
        self, plan: ReducePlan, n: int, n_chunks: int, key: Any, out: np.ndarray | None, scale: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The values :meth:`_finish` returns (``out`` itself where given), the fallback code of every
        chunk and the chunks that came back NaN; the ``prev`` fallback of ``key`` taken from this reduce."""
        arrived = (plan.state[plan.exp_units :] == DONE) & (plan.count > 0)
        got, fallback = fallback_codes(
            arrived, plan.count, self.n_workers, self.config.renormalize, self._fallback, plan.elsewhere
        )
        rows = plan.out
        missing = ~got & ~plan.elsewhere
        if missing.any():
            if plan.direct is not None and self._fallback == Fallback.LOCAL:  # own values, never staged
                split = len(plan.direct)
                plan.chunks[:split][missing[:split]] = plan.direct[missing[:split]]
            rows[missing] = fallback_rows(self._fallback, self._prev.get(key), n, missing, plan.chunks)
        nonfinite = plan.nonfinite[:n_chunks] & ~plan.elsewhere[:n_chunks]
        if out is None:
            flat = rows.reshape(-1)[:n]
            values = flat.copy() if scale == 1.0 else flat * np.float32(scale)
        else:
            values = out if out.ndim == 1 else out.reshape(-1)
            which = None if not plan.any_owned else ~plan.elsewhere[:n_chunks]
            if plan.user_out is not None:  # the chunks settled with values are there already
                which = ~plan.delivered[:n_chunks] | missing[:n_chunks]
            if which is None or which.any():
                _copy_rows(rows, values, n, which, scale)
            plan.deliver_to(None)  # (the plan keeps no hold on the caller's buffer)
        if self._fallback == Fallback.PREV:
            # The rows themselves, taken over (the mean; a NaN chunk's rows hold ~0 sums), never the
            # array handed to the caller, with ``out`` or without: a caller that scaled or clipped its
            # result in place made that the next reduce's fallback, silently.
            self._keep_prev(plan, key, n, n_chunks)
        if nonfinite.any():
            # rare: a mask per value is fine here
            values[np.repeat(nonfinite, self.config.elems_per_packet)[: values.size]] = np.nan
            self.stats.nonfinite_chunks += int(nonfinite.sum())
        return values, fallback, nonfinite

    def _keep_prev(self, plan: ReducePlan, key: Any, n: int, n_chunks: int) -> None:
        """The prev fallback's copy of this reduce's values (``plan.out``'s first ``n``), one the caller
        cannot overwrite. Without chunks owned elsewhere every row of ``plan.out`` was written in this
        reduce (a RESULT's values or the fallback's), so the rows are taken over, not copied, and
        ``plan.out`` gets the rows buffer the previous value of ``key`` lived in (its old contents do not
        matter: the next reduce writes every row again). With chunks owned elsewhere their rows were not
        written and their older prev values stay: the written rows are copied, as before."""
        rows = plan.out
        if plan.any_owned:  # chunks owned elsewhere keep their older prev values: copied, as before
            kept = self._prev.get(key)
            if kept is None or kept.size != n:
                kept = self._prev[key] = np.zeros(n, dtype=np.float32)
            self._prev_rows.pop(key, None)
            _copy_rows(rows, kept, n, ~plan.elsewhere[:n_chunks])
            return
        spare = self._prev_rows.get(key)
        self._prev_rows[key] = rows
        self._prev[key] = rows.reshape(-1)[:n]
        plan.out = spare if spare is not None and spare.shape == rows.shape else np.empty_like(rows)

    # ---- pacing and early close (LTP) ------------------------------------------------------------
    def _bottleneck_bps(self) -> float:
        """The rate frames leave the bottleneck at: the pacing rate, else the learned one (0: unknown)."""
        return self.pacer.rate_bps if self.pacer.paced else self.rate_learner.estimate_bps

    def _start_pacing(self) -> None:
        cfg = self.config
        if cfg.pace_learn:
            learned = self.rate_learner.next_rate_bps()
            self.pacer.set_rate(learned if learned > 0 else cfg.pace_gbps * 1e9)

    def _arm_early_close(self, plan: ReducePlan, t0: float) -> None:
        if self.early is None:
            return
        rtprop = self.deadlines.rtprop_ms
        wire = (plan.units + (self._exp_copies - 1) * plan.exp_units) * self._frame
        rtprop_s = None if rtprop is None else rtprop / 1000.0
        times = self.early.times(plan.n, wire, rtprop_s, self._bottleneck_bps())
        plan.lt_at, plan.hard_close_at = t0 + times.lt_s, t0 + times.deadline_s

    def _learn(self, plan: ReducePlan, elapsed: float) -> None:
        """After a reduce: one delivery-rate sample, (early close) its completion time, and whether the
        next reduce sends its redundant copies (:meth:`_quiet`)."""
        self.rate_learner.sample(plan.rx_batches, self._frame)
        if self.early is not None:
            self.early.record(plan.n, elapsed, plan.full_units == plan.units)
        if self._single_copies:
            self.stats.single_copy_reduces += 1
        cfg = self.config
        if cfg.quiet_units and not cfg.exact:
            self._quiet_run = self._quiet_run + plan.units if self._quiet(plan) else 0
            self._single_copies = self._quiet_run >= cfg.quiet_units

    def _quiet(self, plan: ReducePlan) -> bool:
        """Whether ``plan``'s reduce showed no sign of loss: no unit found lost (``proven_lost``: recovered
        by a FLUSH or a probe for its stored RESULT), FLUSHed, probed, resent or given up, and every RESULT
        it received counted every worker (a short one means a peer's packet was lost, or a peer is late or
        gone; with a quorum below the job's size every RESULT is short: the copies stay)."""
        lost, flushes = plan.proven_lost, plan.flushes
        if plan.redo.any():  # a redone unit's FLUSH bookkeeping (_on_redo) is no sign of loss
            kept = np.ones(plan.units, dtype=bool)
            kept[np.flatnonzero(plan.redo) + plan.exp_units] = False
            lost, flushes = lost & kept, np.where(kept, flushes, 0)
        if lost.any() or flushes.any() or plan.probes.any() or plan.retx.any():
            return False
        if (plan.state == GAVE_UP).any():
            return False
        received = ~plan.elsewhere
        return not bool(np.any(plan.count[received] < self.n_workers))

    @property
    def _exp_copies(self) -> int:
        return 1 if self._single_copies else self.config.exp_copies

    @property
    def _tail_copies(self) -> int:
        return 1 if self._single_copies else self.config.tail_copies

    def _early_close(self, plan: ReducePlan, now: float, step: int) -> None:
        """LTP's Early Close: past LT with at least 1 - theta of the units full, or past LT + C, FLUSH
        every data unit still in flight at once (critical ones excepted) instead of waiting for its own
        deadline."""
        assert self.early is not None
        if not plan.closing:
            if now >= plan.hard_close_at:
                plan.closing = "deadline"
            elif now >= plan.lt_at and plan.all_sent and self.early.enough_in(plan.full_units, plan.units):
                plan.closing = "theta"
            else:
                return
        units = plan.in_flight()
        units = units[(units >= plan.exp_units) & (plan.flushes[units] == 0) & ~plan.critical_unit[units]]
        if not units.size:
            return
        # How long the unit that would have waited longest had left on its own deadline (an upper bound
        # on the wait cut short: its RESULT may have been on the way; measure saved time end to end).
        cut_s = float(plan.deadline_at[units].max() - now)
        self.stats.early_close_deadline_cut_ms += max(0.0, cut_s) * 1000.0
        plan.flushes[units] += 1
        plan.closed_early += len(units)
        self._send_flushes(plan, units, step)
        self.deadlines.arm(plan, units, now)

    def broadcast_params(
        self, chunk_ids: np.ndarray, values: np.ndarray, *, step: int = 0, critical: bool = False
    ) -> None:
        """Send absolute float32 values of the given chunks (rows of ``values``, K each) as PARAM; the
        switch replicates them to every other worker. ``critical`` exempts them from emulated loss."""
        k = self.config.elems_per_packet
        values = np.asarray(values, dtype=np.float32).reshape(len(chunk_ids), -1)
        if values.shape[1] > k:
            raise ValueError(f"param rows have {values.shape[1]} values, more than K={k}")
        batch = self.control_batch(len(chunk_ids), Op.PARAM, step)
        batch["chunk"] = chunk_ids
        batch["nelem"] = values.shape[1]
        batch["flags"] = int(Flag.CRITICAL) if critical else 0
        batch["payload"][:, : values.shape[1]] = values.view(np.int32)
        self.send(batch_rows(batch))

    def request_params(self, chunk_ids: np.ndarray, *, step: int = 0) -> None:
        """Ask the owners of these chunks for a reliable resend (PARAM_REQ, marked critical)."""
        batch = self.control_batch(len(chunk_ids), Op.PARAM_REQ, step)
        batch["chunk"] = chunk_ids
        batch["flags"] = int(Flag.CRITICAL)
        self.send(batch_rows(batch))

    def poll(self, timeout_s: float = 0.0) -> None:
        """Receive whatever arrived (parameter broadcasts, requests) for up to ``timeout_s``."""
        deadline = time.perf_counter() + timeout_s
        while True:
            self._receive(max(0.0, deadline - time.perf_counter()), None)
            if time.perf_counter() >= deadline:
                return

    @property
    def next_unit(self) -> int:
        """The global unit counter: the first unit of the next reduce."""
        return self._next_unit

    def codec_state(self) -> dict[str, Any]:
        """What the next reduces depend on besides their inputs (copies): the stochastic-rounding
        generator, the unit counter (slot and round of every packet), the ``prev`` fallback's last
        values and the last agreed exponents speculation starts from (``agreed``, with the step and the
        lengths seen in it: :meth:`_spec_key`). :meth:`load_codec_state` on a fresh worker of the same job
        makes its next reduces round, speculate and number their packets exactly as this one's would
        (checkpoint/restore)."""
        return {
            "rng": self._rng.bit_generator.state,
            "next_unit": self._next_unit,
            "prev": {key: values.copy() for key, values in self._prev.items()},
            "agreed": {key: values.copy() for key, values in self._agreed.items()},
            "agreed_step": -1 if self._spec_step is None else self._spec_step,
            "agreed_seen": dict(self._spec_seen),
        }

    def load_codec_state(self, state: dict[str, Any]) -> None:
        self._rng.bit_generator.state = state["rng"]
        self._restart_units(int(state["next_unit"]))
        self._prev = {key: np.array(values, dtype=np.float32) for key, values in state["prev"].items()}
        self._prev_rows = {}
        # (a state saved before speculated exponents: nothing to speculate from, as a fresh worker)
        self._agreed = {
            (int(n), int(seen)): np.array(values, dtype=np.int32)
            for (n, seen), values in state.get("agreed", {}).items()
        }
        step = int(state.get("agreed_step", -1))
        self._spec_step = None if step < 0 else step
        self._spec_seen = {int(n): int(seen) for n, seen in state.get("agreed_seen", {}).items()}

    def rejoin_at(self, next_unit: int) -> None:
        """Number the next reduce's units from ``next_unit`` (the peers' counter: a worker that fell behind
        and took a peer's state, torch_ext/heal.py) and forget the last agreed exponents: they are of
        reduces its peers left long ago, and a reduce speculated from them would disagree with theirs.
        The rounding stream and the ``prev`` fallback's values are kept."""
        self._restart_units(next_unit)
        self._agreed.clear()
        self._spec_step = None
        self._spec_seen.clear()

    def _restart_units(self, next_unit: int) -> None:
        """The unit counter at ``next_unit``, and what was learnt of units numbered before it forgotten."""
        self._next_unit = next_unit
        self.reuse.restart_at(next_unit)
        self._newest_unit[0] = -1  # units numbered afresh
        self.settled_to = next_unit
        self.peers_settled[:] = -1

    def input_buffer(self, n: int) -> np.ndarray:
        """The float32 buffer (``n`` values, C-contiguous) a reduce of ``n`` values stages its input in.
        A caller that writes its input there and passes it as ``x`` to :meth:`allreduce` saves a copy; the
        next reduce of that length overwrites it."""
        return self._plan_for(n).chunks.reshape(-1)[:n]

    # ---- the unit engine -----------------------------------------------------------------------
    def _plan_for(self, n: int) -> ReducePlan:
        """The plan of a reduce of ``n`` values. Exact mode: one zero chunk after the data, the fence
        (critical: spared by emulated loss)."""
        k = self.config.elems_per_packet
        return self._plan((max(1, -(-n // k)) + 1) * k if self.config.exact else n)

    def _plan(self, n: int) -> ReducePlan:
        if n == 0:
            raise ValueError("cannot allreduce an empty tensor")
        plan = self._plans.get(n)
        if plan is None:
            plan = self._plans[n] = ReducePlan(n, self.config.elems_per_packet)
        return plan

    def control_batch(self, n: int, op: Op, step: int) -> np.ndarray:
        batch = empty_batch(n, self.config.elems_per_packet)
        for name, value in self._header.items():
            batch[name] = value
        batch["op"] = int(op)
        batch["step"] = step
        return batch

    def _run_units(self, plan: ReducePlan, step: int, t0: float) -> None:
        dl = self.deadlines
        give_up_at = t0 + self.config.reduce_timeout_s
        self._drop_overtaken(plan)  # slots that RESULTs seen before this reduce showed moved on
        self._frontier_from_marks(plan)
        self._recovery.clear()  # (rows a reduce left by an exception are no unit's of this one)
        wake = self._wake_for(plan)
        while True:
            if self._steady(plan, wake, plan.synced):
                next_at = self._wake_send(plan, wake)  # (NaN: the rules after a send are left to the below)
                if next_at is None:
                    return
                paced_out = False
            else:
                in_flight = self._advance(plan)
                if in_flight < 0:
                    return
                paced_out = self._send_ready(plan, in_flight)
                next_at = math.nan
            if self.trace is not None:
                self.trace.on_sent(self, plan)
            if next_at != next_at:
                next_at = self._after_send(plan)
            now = time.perf_counter()
            wait = min(next_at - now, 0.05, give_up_at - now)
            if paced_out:  # units wait for tokens: wake when the next frame may go
                wait = min(wait, self.pacer.wait_s(now))
            if self.early is not None and not plan.closing:
                wait = min(wait, (plan.lt_at if plan.all_sent else plan.hard_close_at) - now)
            if self._peer_wait_since < give_up_at:  # held by the peers alone: see _peer_limit
                wait = min(wait, self._peer_wait_since + dl.peer_hold_s(plan) - now)
            was_synced = plan.synced
            result_batches = len(plan.rx_batches)
            self._receive(max(0.0, wait), plan)
            if self._peer_news:  # a relayed heartbeat: a peer settled further (_drop_overtaken)
                self._peer_news = False
                self._drop_overtaken(plan)
                self._frontier_from_marks(plan)
            now = time.perf_counter()
            results = len(plan.rx_batches) != result_batches
            self._after_receive(plan, wake, now, step, results, was_synced)
            if now >= give_up_at:
                plan.state[plan.state < DONE] = GAVE_UP
                return

    def _after_send(self, plan: ReducePlan) -> float:
        """What a wake-up does once its units went: this worker's frontier, the stall rule, the start of
        the tail; returns the earliest deadline of a unit in flight."""
        plan.frontier[self.worker_id] = plan.next_unit - 1
        if self._held == "peers" and plan.own_shown >= 0 and not self.config.exact:
            # Held by the peer rule: its units the peers may send too wait one FLUSH round trip
            # (Deadlines.stall_flush), not the lag deadline. Exact mode keeps its timers a safety net.
            span = self.reuse.span
            self._stall_flush(plan, max(-1, plan.own_shown - span) + self._slots + 1, time.perf_counter())
        if plan.next_unit == plan.units and not plan.all_sent:
            # The tail: nothing more of ours is coming, so units still open wait only the RTO.
            plan.all_sent = True
            self.deadlines.rearm_shorter(plan, time.perf_counter())
        return self._next_deadline(plan)

    def _after_receive(
        self, plan: ReducePlan, wake: Any, now: float, step: int, results: bool, was_synced: bool
    ) -> None:
        """What a wake-up does once its batch is handled: the slot-reuse news where RESULTs came
        (``results``), the fast flush and its probes, the withheld units' flush, early close, and the units
        due (probed, resent, FLUSHed or given up), the wake-up's recovery packets sent in one call. For a
        reduce synced before the batch and still steady, the reduce's Wake does the news, the fast flush
        and the due scan in one call (:meth:`_wake_after`)."""
        dl = self.deadlines
        due = None
        if self._steady(plan, wake, was_synced):
            due = self._wake_after(plan, wake, now, results)
        else:
            if results:  # RESULTs came: the peers' frontiers may have moved
                self.reuse.news(plan.base, plan.frontier, dl.presumed_dead, self.native)
            if plan.synced and not was_synced:
                # Everyone is in this reduce now: units waiting on the sync deadline get the normal one.
                dl.rearm_shorter(plan, now)
            if min(plan.frontier.tolist()) > plan.fast_flushed_to:  # (a few workers: no numpy reduction)
                probe = dl.fast_flush(plan, now, self.native)
                if probe.size:  # RESULTs lost on the way down: ask the switch for its stored copy now
                    self._probe_data(plan, probe)
                    self.stats.lost_probes += len(probe)
        if due is None:
            dl.flush_withheld(plan, now)
            if self.early is not None:
                self._early_close(plan, now, step)
            due = self._due(plan, now, dl.recovery_slack_s())
        if due.size:
            self._on_deadlines(plan, due, now, step)
        if plan.any_redo_waiting:  # (an exponent unit given up or overtaken: its redone chunks' deadlines)
            self._redo_send(plan)
        self._send_recovery()

    def _steady(self, plan: ReducePlan, wake: Any, synced: bool) -> bool:
        """Whether the reduce's Wake takes this step: it has one (:meth:`_wake_for`), it is ``synced`` (as
        of the step's start), not in its tail, and no peer looks dead."""
        return wake is not None and synced and not plan.all_sent and not self.deadlines.early_close

    def _wake_after(self, plan: ReducePlan, wake: Any, now: float, results: bool) -> np.ndarray | None:
        """:meth:`_after_receive`'s news, fast flush (its probes queued here) and due scan in one call
        (Wake.after), the same units, deadlines and marks (tests/test_engine_native.py). Returns the units
        due, or None where a worker withholds units: the reference goes on from Deadlines.flush_withheld."""
        dl = self.deadlines
        others_wait_s, probe_at, resend_max = dl.fast_flush_params(now)
        code, plan.fast_flushed_to, n_probe, n_due = wake.after(
            results, dl.presumed_dead, plan.fast_flushed_to, plan.low, plan.next_unit, plan.any_withheld, now,
            others_wait_s, probe_at, resend_max, dl.recovery_slack_s(),
        )  # fmt: skip
        if n_probe:  # RESULTs lost on the way down: ask the switch for its stored copy now
            self._probe_data(plan, self._scratch["probe"][:n_probe])
            self.stats.lost_probes += n_probe
        return None if code else self._scratch["due"][:n_due].copy()

    def _wake_for(self, plan: ReducePlan) -> Any:
        """The native calls of this reduce's steady wake-ups (``hostlib._engine.Wake``: the send half,
        :meth:`_wake_send`, and what follows a receive, :meth:`_wake_after`), or None where the reference
        decides every wake-up: the Python path, and reduces with pacing, owners, critical units, exact
        mode, per-unit deadlines or early close (their sends take branches the Wake leaves to the
        reference). A trace sees the same steps either way: its hooks are called where both paths pass."""
        if not (self.native and self._native_quantize) or self.pacer.paced:
            return None
        # (early close brings the per-unit deadlines too: Deadlines.adaptive)
        if plan.any_owned or plan.any_critical or self.config.exact or self.early is not None:
            return None
        todo, saturated = self._quantize_scratch(plan)
        due, probe = self._due_scratch(plan), self._due_scratch(plan, "probe")
        reuse, dl = self.reuse, self.deadlines
        return native_ext.wake(
            plan.state, plan.sent_at, plan.deadline_at, reuse.settled, reuse._excused, reuse.excused_to,
            reuse._peers, plan.chunks, plan.data_rows, plan.exp_known, plan.quantized, plan.own_exp,
            plan.critical, plan.owner, plan.shift, plan.has_exp, todo, saturated, plan.spec_sat,
            (plan.exp_units, reuse.span, self._slots, plan.base, self._quantize_block,
             codec.contribution_limit(self.n_workers), self._quantize_flags),
            self._rng.bit_generator, plan.direct,
            (plan.base + plan.exp_units, self._slots, self._header["step"]),
            (plan.frontier, reuse.sent, reuse.presumed_dead, plan.proven_lost, plan.flushes, plan.retx,
             plan.critical_unit, plan.retx_spent, probe, due),
            (dl.group_size, self.worker_id - dl.group_base, self.worker_id),
        )  # fmt: skip

    def _wake_send(self, plan: ReducePlan, wake: Any) -> float | None:
        """:meth:`_advance`, :meth:`_send_ready` and :meth:`_after_send` for a synced reduce not in its
        tail with no peer presumed dead: a call into ``wake`` (:meth:`_wake_for`) that decides and
        quantizes, the rows sent here, and a call that puts the units in flight from then (as the
        reference stamps them after its send) and takes the rules after a send: the same units, rows,
        states and deadlines (tests/test_engine_native.py). Returns None when nothing is left to settle,
        else the earliest deadline in flight; NaN where the reference is to take the rules after the send
        (:meth:`_after_send`: the Wake left the decision to :meth:`_send_ready`, or the tail starts)."""
        now = time.perf_counter()
        u0 = plan.next_unit
        code, plan.low, in_flight, u1, held, checked = wake.send(
            plan.low, u0, min(self.window, self._loss_window), plan.any_withheld
        )
        if code == _WAKE_DONE:
            return None
        if code == _WAKE_BAIL:
            self._send_ready(plan, in_flight)  # (never paced: a Wake is made only without pacing)
            return math.nan
        self._count_held(now, "")
        if checked:  # (_peer_limit's first branch)
            self._peer_wait_since = math.inf
        e = plan.exp_units
        plan.next_unit = u1
        c0, c1 = u0 - e, u1 - e
        if code == _WAKE_SENT:
            self._send_data(plan, c0, c1, None, plan.slots[u0:u1])
        elif code == _WAKE_SENT_SOME:  # the pending units' rows, but those withheld
            sent = np.flatnonzero((plan.state[u0:u1] == PENDING) & plan.has_exp[c0:c1]) + c0
            self._send_data(plan, c0, c1, sent)
        now = time.perf_counter()
        dl = self.deadlines
        next_at = wake.commit(
            u0, u1, plan.low, now, now + dl.first_wait_s(plan) * dl.stagger,
            (plan.own_shown, dl.presumed_dead, dl.rto_at(now), plan.all_sent), held,
        )  # fmt: skip
        if held:
            self._count_held(now, _HELD[held])
        return float(next_at)

    def _advance(self, plan: ReducePlan) -> int:
        """Move ``plan.low`` past the settled prefix; the units in flight, or -1 when none is left to
        settle (the reduce is over)."""
        if self.native:
            plan.low, unsettled, in_flight = native_ext.scan(plan.state, plan.low, plan.next_unit)
            return in_flight if unsettled else -1
        plan.advance_low()
        if not plan.unsettled():
            return -1
        return int(np.count_nonzero(plan.state[plan.low : plan.next_unit] == IN_FLIGHT))

    def _stall_flush(self, plan: ReducePlan, permitted: int, now: float) -> None:
        """Deadlines.stall_flush (the native path: one call)."""
        dl = self.deadlines
        if not self.native:
            dl.stall_flush(plan, permitted, now)
            return
        at = dl.rto_at(now)
        native_ext.stall(plan.state, plan.flushes, plan.critical_unit, plan.deadline_at, plan.frontier,
                         dl.presumed_dead, plan.low, permitted, plan.next_unit, at)  # fmt: skip

    def _next_deadline(self, plan: ReducePlan) -> float:
        """The earliest deadline of a unit in flight (Deadlines.next_at; inf when none is)."""
        if self.native:  # (no unit is due by -inf: the scratch list is left empty)
            out = self._due_scratch(plan)
            return native_ext.due(plan.state, plan.deadline_at, plan.low, plan.next_unit, -math.inf, out)[1]
        return self.deadlines.next_at(plan)

    def _due(self, plan: ReducePlan, now: float, slack: float = 0.0) -> np.ndarray:
        """The units in flight whose deadline passed (Deadlines.due); with a recovery ``slack``
        (Deadlines.recovery_slack_s), also those being recovered whose deadline is that near
        (Deadlines.due_or_recovering)."""
        if self.native:
            if slack:
                return self._native_due(plan, now + slack, now)[0]
            return self._native_due(plan, now)[0]
        if slack:
            return self.deadlines.due_or_recovering(plan, self.deadlines.due(plan, now + slack), now)
        return self.deadlines.due(plan, now)

    def _native_due(
        self, plan: ReducePlan, now: float, strict: float | None = None
    ) -> tuple[np.ndarray, float]:
        out = self._due_scratch(plan)
        recovering = () if strict is None else (plan.proven_lost, plan.flushes, strict)
        n_due, next_at = native_ext.due(plan.state, plan.deadline_at, plan.low, plan.next_unit, now, out,
                                        *recovering)  # fmt: skip
        return out[:n_due].copy(), next_at

    def _due_scratch(self, plan: ReducePlan, name: str = "due") -> np.ndarray:
        """A native unit list (``name``: the due scan's, or the Wake's fast-flush probes), one entry per unit
        of ``plan`` at least (grown on demand)."""
        out = self._scratch[name]
        if len(out) < plan.units:
            out = self._scratch[name] = np.zeros(plan.units, dtype=np.int64)
        return out

    def _send_ready(self, plan: ReducePlan, in_flight: int) -> bool:
        """Send, in one batch, every unit that may go: window room, pacing tokens, its slot's previous
        round settled, its exponent known. Quantizes the chunks it needs (a block ahead) just before.
        ``in_flight``: the units in flight. Returns True when the pacer held back units the window would
        have let go."""
        u0 = plan.next_unit
        self._count_held(time.perf_counter(), "")
        room = min(self.window, self._loss_window) - in_flight
        if room <= 0 or u0 >= plan.units:
            return False
        # A slot's next round starts only once this worker (own span) and every live peer are done with
        # the round before it (reuse.py): a peer that lost its RESULT can still ask for the stored copy.
        own, peers = plan.low + self.reuse.span, self._peer_limit(plan, in_flight)
        hi = min(plan.units, u0 + room, own, peers)
        # Once every unit up to hi has gone, a reuse rule holds the next one (the window has room).
        held = ("span" if own <= peers else "peers") if min(own, peers) < min(plan.units, u0 + room) else ""
        try:
            return self._send_units(plan, u0, hi)
        finally:
            if held and plan.next_unit >= hi:
                self._count_held(time.perf_counter(), held)

    def _send_units(self, plan: ReducePlan, u0: int, hi: int) -> bool:
        """:meth:`_send_ready` once the window and the reuse rules gave ``hi``: units ``u0..hi-1`` go
        but for those whose exponent is unknown and those the pacer holds back."""
        if self.native:
            sent = self._send_run(plan, u0, hi)
            if sent is not None:
                return sent
        state, k = plan.state, self.config.elems_per_packet
        units = np.arange(u0, max(u0, hi))
        blocked = np.zeros(len(units), dtype=bool)
        data = units >= plan.exp_units
        # exponent not settled, nor speculated
        c = units[data] - plan.exp_units
        blocked[data] |= (state[c // k] < DONE) & ~plan.exp_known[c]
        if blocked.any():
            units = units[: int(np.argmax(blocked))]
        # Tokens bind only when more units are ready than they allow; units blocked for another reason
        # wait for a RESULT, not for the pacer (a wake-up per frame time would spin for nothing).
        paced_out = False
        if self.pacer.paced and units.size:
            allowed = self.pacer.allowance(time.perf_counter())
            if allowed < units.size:
                units, paced_out = units[:allowed], True
        if not units.size:
            return paced_out
        plan.next_unit = int(units[-1]) + 1
        units = units[state[units] == PENDING]  # settled already (a peer's FLUSH): nothing to send
        if not units.size:
            return paced_out
        queue_free_at = self._queue_free_at
        exp_units = units[units < plan.exp_units]
        if exp_units.size:
            self._send_copies(plan.exp_rows[exp_units], plan.slots[exp_units], self._exp_copies)
        c = units[units >= plan.exp_units] - plan.exp_units
        if c.size:
            c0, c1 = int(c[0]), int(c[-1]) + 1
            self._quantize_ahead(plan, c0, c1)
            # no exponent: withheld, but the RESULT is still awaited
            self._send_data(plan, c0, c1, c[plan.has_exp[c]])
        now = time.perf_counter()
        state[units] = IN_FLIGHT
        if plan.any_owned:  # another worker's chunk: sent, nothing to wait for
            data = units >= plan.exp_units
            theirs = units[data][plan.elsewhere[units[data] - plan.exp_units]]
            if theirs.size:
                state[theirs] = ELSEWHERE
                units = units[state[units] == IN_FLIGHT]
        plan.sent_at[units] = now
        rate = self._bottleneck_bps() if self.deadlines.adaptive else 0.0  # (only unit_wait_s reads it)
        if rate > 0:  # each unit's frame leaves the bottleneck after those queued before it
            start = max(now, queue_free_at)
            plan.expect_at[units] = start + np.arange(1, len(units) + 1) * (self._frame * 8 / rate)
        self.deadlines.arm(plan, units, now)
        return paced_out

    def _send_run(self, plan: ReducePlan, u0: int, hi: int) -> bool | None:
        """:meth:`_send_units` of the native path for its steady state, a run of pending units with
        nothing paced or owned: the same packets, states and deadlines, with slices where the reference
        gathers (tests/test_engine_native.py compares the two). None where it does not apply (the
        reference runs then, before anything changed)."""
        if plan.any_owned or self.pacer.paced or hi <= u0:
            return None
        k, e, state = self.config.elems_per_packet, plan.exp_units, plan.state
        # data units wait for their exponent unit's RESULT
        u1, pending = native_ext.run(state, plan.exp_known, e, k, u0, hi)
        if u1 <= u0:
            return False
        if not pending:
            return None
        d0 = max(u0, e)
        plan.next_unit = u1
        queue_free_at = self._queue_free_at
        if u0 < e:
            e1 = min(u1, e)
            self._send_copies(plan.exp_rows[u0:e1], plan.slots[u0:e1], self._exp_copies)
        if u1 > e:
            c0, c1 = d0 - e, u1 - e
            self._quantize_ahead(plan, c0, c1)
            if plan.has_exp[c0:c1].all():  # the steady state: one contiguous run, its slots at hand
                self._send_data(plan, c0, c1, None, plan.slots[d0:u1])
            else:
                self._send_data(plan, c0, c1, np.flatnonzero(plan.has_exp[c0:c1]) + c0)
        now = time.perf_counter()
        state[u0:u1] = IN_FLIGHT
        plan.sent_at[u0:u1] = now
        rate = self._bottleneck_bps() if self.deadlines.adaptive else 0.0
        if rate > 0:
            start = max(now, queue_free_at)
            plan.expect_at[u0:u1] = start + np.arange(1, u1 - u0 + 1) * (self._frame * 8 / rate)
        if not self.deadlines.arm_run(plan, u0, u1, now):
            self.deadlines.arm(plan, np.arange(u0, u1), now)
        return False

    def _send_data(
        self, plan: ReducePlan, c0: int, c1: int, chunks: np.ndarray | None, slots: np.ndarray | None = None
    ) -> None:
        """Send the data rows of ``chunks`` (sorted chunk indices in [c0, c1); None: every chunk there,
        whose slots are ``slots``), one slice where they are contiguous, then those of the reduce's last
        ``tail_units`` chunks ``tail_copies - 1`` times more (TransportConfig.tail_units)."""
        rows = plan.data_rows
        if chunks is None:
            self.send(rows[c0:c1], slots)
        elif chunks.size and chunks[-1] - chunks[0] + 1 == chunks.size:
            self.send(rows[chunks[0] : chunks[-1] + 1])  # contiguous: a view, no copy
        elif chunks.size:
            self.send(rows[chunks])
        tail = plan.chunks_count - self._tail_units
        if self._tail_units and c1 > tail:
            last = rows[max(c0, tail) : c1] if chunks is None else rows[chunks[chunks >= tail]]
            for _ in range(self._tail_copies - 1):
                self.send(last)

    def _send_copies(self, rows: np.ndarray, slots: np.ndarray, copies: int) -> None:
        """Send ``rows`` ``copies`` times, one copy after the other, in one call (one system call where
        the rows fit one send): the exponent units, a handful of rows a reduce."""
        if copies > 1:
            rows, slots = np.tile(rows, (copies, 1)), np.tile(slots, copies)
        self.send(rows, slots)

    def _count_held(self, now: float, held: str) -> None:
        """Add the time since the last call to what held sending then (``stats.held_by_span_s``: this
        worker's own oldest unsettled unit, a lost one being recovered or one a late peer still holds
        open; ``held_by_peers_s``: the peers' progress alone), and remember what holds it from ``now``
        on ("": neither)."""
        if self._held == "span":
            self.stats.held_by_span_s += now - self._held_since
        elif self._held == "peers":
            self.stats.held_by_peers_s += now - self._held_since
        self._held, self._held_since = held, now

    def _peer_limit(self, plan: ReducePlan, in_flight: int) -> int:
        """The first unit of ``plan`` the peers' progress does not let go yet (reuse.py). When it holds
        this worker with nothing of its own in flight, the wait is bounded: after ``Deadlines.peer_hold_s``
        without news, the peers that hold it are excused until their bits show up again."""
        local = self.reuse.first(self.native) - plan.base
        if local > plan.next_unit or (in_flight and not plan.any_withheld):  # (the steady state)
            self._peer_wait_since = math.inf
            return local
        first, holders = self.reuse.limit()
        local = first - plan.base
        if local <= plan.next_unit and plan.any_withheld and local < plan.units:
            # A holder that withholds units between its newest shown bit and here cannot show progress
            # before it has sent past them, and that may need this worker's next units (its own span
            # waits for their RESULTs): with D <= K data slots a run of K withheld units always
            # deadlocked, until the peer-hold bound below. It is excused at once instead, as that bound
            # would (for one pool at most, or until its bit shows again).
            lo = max(plan.low, int(plan.frontier[holders].min()) + 1)
            span = np.arange(lo, max(lo, local + 1))
            if span.size:
                withholding = holders & plan.withheld_by(span, self._worker_bits).any(axis=0)
                if withholding.any():
                    log.debug("worker %d: peers %s withhold units before %d; going on", self.worker_id,
                              np.flatnonzero(withholding).tolist(), first)  # fmt: skip
                    self.stats.withheld_excuses += int(withholding.sum())
                    self.reuse.excuse(withholding)
                    first, holders = self.reuse.limit()
                    local = first - plan.base
        if local > plan.next_unit or in_flight:
            self._peer_wait_since = math.inf
            return local
        now = time.perf_counter()
        if self._peer_wait_since == math.inf:
            self._peer_wait_since = now
        elif now >= self._peer_wait_since + self.deadlines.peer_hold_s(plan):
            log.debug("worker %d: no news of peers %s past unit %d; going on", self.worker_id,
                      np.flatnonzero(holders).tolist(), first)  # fmt: skip
            self.reuse.excuse(holders)
            self.stats.peer_hold_timeouts += 1
            self._peer_wait_since = math.inf
            first, _ = self.reuse.limit()
            local = first - plan.base
        return local

    def _quantize_ahead(self, plan: ReducePlan, c0: int, c1: int) -> None:
        """Quantize chunks [c0, c1) that are not yet, plus the known-exponent chunks after them up to a
        block, so that the numpy passes are large and run while earlier packets are at the switch."""
        block = self._quantize_block
        if self._native_quantize:  # the same rows, draws and flags in one call
            todo, saturated = self._quantize_scratch(plan)
            limit = codec.contribution_limit(self.n_workers)
            native_ext.quantize_ahead(
                plan.chunks, plan.data_rows, plan.exp_known, plan.quantized, plan.own_exp, plan.critical,
                plan.owner, plan.shift, plan.has_exp, todo, saturated, plan.spec_sat, c0, c1, block, limit,
                self._quantize_flags, self._rng.bit_generator, plan.direct,
                (plan.base + plan.exp_units, self._slots, self._header["step"]),
            )  # fmt: skip
            return
        hi = min(plan.chunks_count, max(c1, c0 + block))
        known = plan.exp_known[c1:hi]
        if not known.all():
            hi = c1 + int(np.argmin(known))
        todo = np.flatnonzero(plan.exp_known[c0:hi] & ~plan.quantized[c0:hi]) + c0
        if not todo.size:
            return
        lo, top = int(todo[0]), int(todo[-1]) + 1
        sel: slice | np.ndarray = slice(lo, top) if todo.size == top - lo else todo
        shifts = plan.shift[sel]
        d = plan.data_batch
        # Straight into the packet rows (big-endian), no int32 temporary.
        saturated = codec.quantize_into(plan.chunks, shifts, self.n_workers, self._rng, d["payload"], sel)
        d["exp"][sel] = shifts
        # A chunk whose agreed exponent does not count this worker's proposal (lost on the way) is
        # withheld, whatever its values: its values may exceed the agreed bound, and withholding only
        # those (a decision on the values) would remove the largest contributions and bias the mean; a
        # contribution missing for a reason independent of the values is renormalized away. A chunk
        # whose proposal was counted cannot exceed the bound; if the codec clamps one all the same, it
        # goes flagged SATURATED (docs/protocol.md).
        counted = plan.own_exp[sel]
        d["flags"][sel] = (
            np.where(plan.critical[sel], _CRITICAL, 0)
            | np.where((saturated & counted) | plan.spec_sat[sel], _SATURATED, 0)
            | np.where(plan.owner[sel] >= 0, _OWNER, 0)
        )
        plan.has_exp[sel] = counted  # the others are withheld (ReducePlan.withheld)
        plan.quantized[sel] = True

    @property
    def _quantize_block(self) -> int:
        """How many chunks a native quantize covers at least (the values of _QUANTIZE_BLOCK_VALUES)."""
        return max(1, _QUANTIZE_BLOCK_VALUES // self.config.elems_per_packet)

    def _quantize_scratch(self, plan: ReducePlan) -> tuple[np.ndarray, np.ndarray]:
        """The native quantize's scratch lists (todo, saturated), one entry per chunk of ``plan`` at least."""
        todo, saturated = self._scratch["todo"], self._scratch["saturated"]
        if len(todo) < plan.chunks_count:
            todo = self._scratch["todo"] = np.zeros(plan.chunks_count, dtype=np.int64)
            saturated = self._scratch["saturated"] = np.zeros(plan.chunks_count, dtype=bool)
        return todo, saturated

    def _on_deadlines(self, plan: ReducePlan, due: np.ndarray, now: float, step: int) -> None:
        """Units whose deadline passed: resend (critical), probe, FLUSH, or give up. The probes and FLUSHes
        go out at the end, in one call with those queued before in the wake-up (_send_recovery)."""
        self._deadline_actions(plan, due, now, step)
        self._send_recovery()

    def _deadline_actions(self, plan: ReducePlan, due: np.ndarray, now: float, step: int) -> None:
        if self.trace is not None:
            self.trace.on_deadlines(self, plan, due)
        if plan.any_critical:
            crit = self.deadlines.resending(plan, due)
            data = due >= plan.exp_units
            # A chunk withheld for want of an exponent has no GRAD to resend: it is flushed as any other.
            crit[data] &= plan.has_exp[due[data] - plan.exp_units]
            if crit.any():
                self._resend_critical(plan, due[crit], now)
                due = due[~crit]
                if not due.size:
                    return
        rest = due
        if not plan.synced:
            sync_end = plan.sent_at[due] + self.deadlines.sync_wait_s()
            probe = (due < plan.exp_units) & (now < sync_end)
            if probe.any():
                # Probe: send the exponent GRAD again. While the round is open the switch drops it as a
                # duplicate (or counts it, if the first copies were lost); once the round closed, it
                # answers with the stored RESULT, so a worker that lost the exponent RESULT recovers in
                # one RTO instead of sitting out the whole group. No FLUSH yet: others may be late.
                units = due[probe]
                plan.probes[units] += 1
                self.send(plan.exp_rows[units])
                self.deadlines.arm(plan, units, now)
                rest = due[~probe]
        # (tail_probing and tail_reprobing ask for the reduce's tail, synced: none before it)
        tail = None
        if plan.all_sent and plan.synced:
            tail = self.deadlines.tail_probing(plan, rest) | self.deadlines.tail_reprobing(plan, rest, now)
        if tail is not None and tail.any():
            # Tail probe: this worker's GRAD again, one RTO into the wait for a possibly late peer (or one
            # FLUSH round trip after every peer was shown past the unit before it), and again with backoff
            # (Deadlines.arm_probed). The FLUSH keeps its time (the lag deadline from the send), or one
            # RTO from now if later.
            units = rest[tail]
            self._probe_data(plan, units)
            plan.probes[units] += 1
            self.stats.tail_probes += len(units)
            self.deadlines.arm_probed(plan, units, now)
            rest = rest[~tail]
        # A FLUSHed unit is retried until it has had max_flushes FLUSHes and the give-up time has passed
        # since its first (TransportConfig.min_flush_deadline_ms).
        if self.native and not self.own_leaf and self.trace is None:
            self._flush_native(plan, rest, now, step)
            return
        flushed = plan.flushes[rest]
        more = (flushed < self.config.max_flushes) | (
            (flushed > 0) & (now < plan.first_flush_at[rest] + self.deadlines.give_up_s())
        )
        units = rest[more]
        if units.size:
            # Units behind every worker's frontier lost a packet for sure (fast_flush); the others are
            # flushed on a timer's word: some worker may still have been about to send.
            on_timer = (units >= plan.frontier.min()) & ~plan.proven_in[units]
            self.stats.flushes_on_timer += int(np.count_nonzero(on_timer))
            plan.first_flush_at[units[plan.flushes[units] == 0]] = now
            plan.flushes[units] += 1
            self._send_flushes(plan, units, step)
            self.deadlines.arm(plan, units, now)
        plan.state[rest[~more]] = GAVE_UP  # an exponent unit given up leaves its chunks without has_exp

    def _flush_native(self, plan: ReducePlan, units: np.ndarray, now: float, step: int) -> None:
        """The FLUSH rule of :meth:`_deadline_actions` with :meth:`_send_flushes` and the retries'
        ``Deadlines.arm`` in one call into ``hostlib._engine`` (the same rows, deadlines, flushes and
        statistics; tests/test_engine_native.py)."""
        if not units.size:
            return
        dl, cfg, n = self.deadlines, self.config, len(units)
        copies = cfg.flush_copies
        key = tuple(self._header[name] for name in ("version", "job_id", "worker_id"))
        if self._flush_template[0] != key:
            self._flush_template = key, batch_rows(self.control_batch(1, Op.FLUSH, 0))[0].copy()
        template = self._flush_template[1]
        rows = np.empty((n * copies, len(template)), dtype=np.uint8)
        slots = np.empty(n * copies, dtype=np.int64)
        flushed, on_timer, _ = native_ext.flush(
            units, n, plan.state, plan.flushes, plan.first_flush_at, plan.flushed_at, plan.deadline_at,
            plan.proven_in, plan.critical_unit, plan.retx_spent, plan.retx, plan.probes, plan.slots,
            plan.seqs, plan.shift, template, rows, slots,
            (now, time.perf_counter(), step, plan.exp_units, min(plan.frontier.tolist()), cfg.max_flushes,
             dl.give_up_s(), dl.flush_rto_s(), cfg.max_deadline_ms / 1e3, dl.stagger, dl.rto_s(),
             -1 if dl.early_close else cfg.critical_max_resends, plan.synced, copies),
        )  # fmt: skip
        self.stats.flushes_on_timer += on_timer
        if flushed:
            self._recovery.append((rows[: flushed * copies], slots[: flushed * copies]))
            self.stats.flushes_sent += flushed

    def _probe_data(self, plan: ReducePlan, units: np.ndarray) -> None:
        """Send this worker's GRAD of data ``units`` again, ``flush_copies`` times as a FLUSH is (a lost
        probe or a lost answer costs a deadline), queued for the wake-up's one call (_send_recovery). The
        switch answers a closed round with its stored RESULT (flagged RETX), adds the GRAD to an open round
        that lacks it, and drops it as a duplicate otherwise: a probe never closes a round."""
        if self.native:  # the gather and the copies in one pass
            copies = self.config.flush_copies
            rows = np.empty((len(units) * copies, plan.data_rows.shape[1]), dtype=np.uint8)
            slots = np.empty(len(units) * copies, dtype=np.int64)
            native_ext.gather_rows(plan.data_rows, units, len(units), plan.exp_units, copies, plan.slots,
                                   rows, slots)  # fmt: skip
            self._recovery.append((rows, slots))
            return
        self._queue_recovery(plan.data_rows[units - plan.exp_units], plan.slots[units])

    def _queue_recovery(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Queue probe or FLUSH ``rows`` (of units in ``slots``) for :meth:`_send_recovery`, each
        ``flush_copies`` times, its copies side by side (a GSO train holds both; a copy in a call of its
        own was a train, and a system call, of its own). Copied: the rows may be a scratch batch's."""
        copies = self.config.flush_copies
        self._recovery.append((np.repeat(rows, copies, axis=0), np.repeat(slots, copies)))

    def _send_recovery(self) -> None:
        """Send the rows queued by :meth:`_queue_recovery` in one call (the probes and FLUSHes of one
        wake-up: at 20% down loss, 4 workers, a 1 MiB reduce at K = 64 sent them in 4 calls a wake-up)."""
        if not self._recovery:
            return
        if len(self._recovery) == 1:
            rows, slots = self._recovery[0]
        else:
            rows = np.concatenate([r for r, _ in self._recovery])
            slots = np.concatenate([s for _, s in self._recovery])
        self._recovery.clear()
        self.send(rows, slots)

    def _resend_critical(self, plan: ReducePlan, units: np.ndarray, now: float) -> None:
        """Send this worker's GRAD of critical ``units`` again (flagged RETX | CRITICAL): added if the
        first copy was lost, dropped as a duplicate if it was not, answered with the stored RESULT if the
        round closed and only the RESULT was lost."""
        exp = units[units < plan.exp_units]
        if exp.size:
            plan.exp_batch["flags"][exp] |= _RETX
            self.send(plan.exp_rows[exp])
        c = units[units >= plan.exp_units] - plan.exp_units
        if c.size:
            plan.data_batch["flags"][c] |= _RETX
            self.send(plan.data_rows[c])
        plan.retx[units] += 1
        waiting = self.deadlines.waiting_for_peers(plan, units, now)
        plan.retx_spent[units[~waiting]] += 1
        self.stats.critical_resends += len(units)
        self.deadlines.arm(plan, units, now)

    def _send_flushes(self, plan: ReducePlan, units: np.ndarray, step: int) -> None:
        if self.trace is not None:
            self.trace.on_flushes(self, plan, units)
        n = len(units)
        if len(self._flush_batch) < n:
            self._flush_batch = self.control_batch(max(n, 2 * len(self._flush_batch), 16), Op.FLUSH, 0)
        b = self._flush_batch[:n]
        b["step"] = step
        b["slot"], b["seq"] = plan.slots[units], plan.seqs[units]
        exp = units < plan.exp_units
        c = np.where(exp, units, units - plan.exp_units)
        # A repeated FLUSH (this worker's earlier one went unanswered) says so with RETX: a leaf closes
        # the spine's round only on such a FLUSH (docs/protocol.md, "Hierarchy").
        b["flags"] = np.where(exp, _MAX, 0) | np.where(plan.flushes[units] > 1, _RETX, 0)
        b["exp"] = np.where(exp, 0, plan.shift[np.where(exp, 0, c)])
        b["chunk"] = c
        b["nelem"] = 0
        if self.own_leaf:
            self._as_leaf_flushes(plan, units, b, exp, c)
        self._queue_recovery(batch_rows(self._flush_batch)[:n], plan.slots[units])
        plan.flushed_at[units] = time.perf_counter()
        self.stats.flushes_sent += n

    def _as_leaf_flushes(
        self, plan: ReducePlan, units: np.ndarray, b: np.ndarray, exp: np.ndarray, c: np.ndarray
    ) -> None:
        """The FLUSHes ``b`` of a worker that is its own leaf, turned into what a leaf sends up at them
        (docs/protocol.md, "A worker as its own leaf"): the unit's partial, which is its GRAD (an exponent
        unit's, or a quantized chunk's; a withheld chunk has none and sends an empty one, count 0), as a
        GRAD at the unit's first FLUSH (it adds the partial if the spine lacks it, without closing the
        spine's round) and as a FLUSH at a repeated one (it closes it); both flagged RETX."""
        has = exp.copy()
        has[~exp] = plan.has_exp[c[~exp]]
        rows = np.flatnonzero(exp)
        b[rows] = plan.exp_batch[units[rows]]
        rows = np.flatnonzero(has & ~exp)
        b[rows] = plan.data_batch[c[rows]]
        empty = np.flatnonzero(~has)  # (rows of this scratch batch may hold an earlier call's partials)
        for name in ("count", "bitmap", "weight", "payload"):
            b[name][empty] = 0
        b["op"] = np.where(plan.flushes[units] > 1, int(Op.FLUSH), int(Op.GRAD))
        b["flags"] |= _RETX

    def send(self, rows: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Send packet rows to the switch, spending pacing tokens and counting them (``slots``: the rows'
        slot fields as int64, where the caller has them: see WorkerIO.send_rows)."""
        sent = self.io.send_rows(rows, slots)
        self.stats.packets_sent += sent
        if not sent:
            return
        now = time.perf_counter()
        self.pacer.spend(sent, now)
        rate = self._bottleneck_bps()
        if rate > 0:
            self._queue_free_at = max(now, self._queue_free_at) + sent * self._frame * 8 / rate

    # ---- receiving -----------------------------------------------------------------------------
    def receive_batch(self, n: int) -> None:
        """Handle the first ``n`` rows received outside a reduce: parameters, requests, slot news."""
        self._handle(n, None)

    def _receive(self, timeout_s: float, plan: ReducePlan | None) -> None:
        """Wait up to ``timeout_s`` for packets, then handle everything queued as one batch."""
        if self.trace is None:
            n = self.io.recv(timeout_s)
        else:
            t_in = time.perf_counter()
            n = self.io.recv(timeout_s)
            self.trace.on_recv(self, timeout_s, n, t_in, time.perf_counter())
        if n:
            self.stats.packets_received += n
            self._handle(n, plan)

    def _handle(self, n: int, plan: ReducePlan | None) -> None:
        if plan is not None and self.native:
            self._handle_native(n, plan)
            return
        rx = self.io.rx
        data = rx.data
        hdr = np.ndarray((n,), dtype=HEADER_DTYPE, buffer=data, strides=(data.strides[0],))
        ok = (rx.lens[:n] == self.packet_bytes) & (hdr["version"] == VERSION) & (hdr["job_id"] == self.job_id)
        ops = hdr["op"]
        params = np.flatnonzero(ok & (ops == _PARAM))
        requests = ok & (ops == _PARAM_REQ)
        self._on_side(hdr, params, requests)
        # Answers to a health probe (slot P-1) are no unit's: they would alias a round of slot 0.
        result = ok & (ops == _RESULT) & (hdr["slot"] != self.probe_slot)
        if result.any():  # the newest unit answered, remembered even between reduces (a late worker's news)
            slot = hdr["slot"][result].astype(np.int64)
            mine = slot < self._slots
            if mine.any():
                unit, _ = seq_unit(hdr["seq"][result][mine].astype(np.int64), slot[mine], self._slots)
                self._newest_unit[0] = max(int(self._newest_unit[0]), int(unit.max()))
        results = np.flatnonzero(result) if plan is not None else np.zeros(0, np.int64)
        self.stats.packets_ignored += n - params.size - int(requests.sum()) - results.size
        if plan is not None and results.size:
            self._on_results(plan, hdr, results)

    def _on_side(self, hdr: np.ndarray, params: np.ndarray, requests: np.ndarray) -> None:
        """The PARAM rows ``params`` and PARAM_REQ rows (a bool mask over ``hdr``) of a batch."""
        if params.size:
            self._on_params(hdr, params)
        heal = (
            requests & (hdr["chunk"] >= HEAL_REQUEST_BASE) & (hdr["chunk"] < HEAL_REQUEST_BASE + MAX_WORKERS)
        )
        if heal.any():  # a rank behind asks a donor for its state: only the donor named keeps it
            named = hdr["chunk"][heal].astype(np.int64) - HEAL_REQUEST_BASE == self.worker_id
            self.heal_requests.update(hdr["worker_id"][heal][named].astype(np.int64).tolist())
            requests = requests & ~heal
            if self.heal_requests and self.heal_responder is not None:
                self.heal_responder()
        if requests.any():
            self.param_requests.update(hdr["chunk"][requests].tolist())
            if self.param_responder is not None:
                self.param_responder()

    def _handle_native(self, n: int, plan: ReducePlan) -> None:
        """:meth:`_handle` in one call into ``hostlib._engine`` (native.py): the same rows settled the same
        way (tests/test_engine_native.py); what is rare or per batch stays here (parameters, the RTT
        estimator, absent peers, the slot-reuse news, the trace)."""
        rx, s = self.io.rx, self._scratch
        if self._native_params[0] != (plan.base, plan.units):  # (once per reduce: a restored checkpoint
            # may start a reduce of another length at a base seen before)
            self._native_params = (plan.base, plan.units), (
                self.packet_bytes, VERSION, self.job_id, self.probe_slot, self._slots, self.n_workers,
                self.worker_id, self._closer_id, self.config.elems_per_packet, self._renormalize_code,
                plan.base, plan.units, plan.exp_units, plan.chunks_count, self._headroom,
            )  # fmt: skip
        deliver = None  # (ReducePlan.deliver_to)
        if plan.user_out is not None:
            deliver = plan.user_out, plan.user_scale, plan.quantized, plan.delivered
        now = time.perf_counter()
        (settled, results, side, any_later, retx, full, critical_short, ignored, seen_bits, any_all_bits,
         rtt_ms, rtt_min_ms, flush_ms, own_reached, withheld, overtaken, lost, lost_retx,
         redo) = native_ext.settle(
            rx.data, rx.lens, n, self._native_params[1], plan.low, now, self._newest_unit, plan.state,
            plan.flushes, plan.retx, plan.proven_lost, plan.sent_at, plan.flushed_at, plan.critical_unit,
            plan.count, plan.bitmap, plan.weight, plan.result_flags, plan.shift, plan.out, plan.exp_known,
            plan.nonfinite, plan.own_exp, plan.exp_bitmap, plan.frontier, s["later"], s["settled"], s["side"],
            s["rtt"], s["flush"], plan.spec, plan.agreed_exp, plan.agreed_bits, s["redo"],
            deliver)  # fmt: skip
        if side:
            data = rx.data
            hdr = np.ndarray((n,), dtype=HEADER_DTYPE, buffer=data, strides=(data.strides[0],))
            rows = s["side"][:side]
            ops = hdr["op"][rows]
            requests = np.zeros(n, dtype=bool)
            requests[rows[ops == _PARAM_REQ]] = True
            self._on_side(hdr, rows[ops == _PARAM], requests)
        self.stats.packets_ignored += ignored
        if not results:
            return
        if any_later:
            self.reuse.saw(plan.base, s["later"].copy())
        plan.rx_batches.append((time.perf_counter(), results))
        if settled:
            plan.synced = True
            self.stats.results_retx += retx
            if rtt_ms == rtt_ms:  # (NaN: no clean answer in the batch)
                self.deadlines.rtt_sample(rtt_ms, rtt_min_ms)
            if flush_ms == flush_ms:
                self.deadlines.flush_sample(flush_ms)
            if lost and self.early is None:  # as _time_answers: were their rounds closed already?
                self.deadlines.lost_answers(lost_retx, lost)
                self._loss_window = self.deadlines.loss_window(self.reuse.span)
            self.deadlines.track_absent_bits(seen_bits, settled, bool(any_all_bits))
            plan.full_units += full
            if critical_short:
                self.stats.critical_partial_results += critical_short
                log.debug("worker %d: %d critical units closed short", self.worker_id, critical_short)
            plan.own_shown = max(plan.own_shown, own_reached)
            plan.any_withheld |= bool(withheld)
            if self.trace is not None:
                self.trace.on_settled(self, plan, s["settled"][:settled].copy())
        self.stats.units_overtaken += overtaken  # (given up in the call, as _drop_overtaken does)
        if redo or plan.any_redo_waiting:
            self._redo_news(plan, s["redo"][:redo].copy())

    def _on_params(self, hdr: np.ndarray, rows: np.ndarray) -> None:
        alive = hdr["chunk"][rows] == ALIVE_CHUNK
        if alive.any():  # a peer's relayed heartbeat: news for the deadlines, no parameter
            senders = hdr["worker_id"][rows[alive]].astype(np.int64)
            self.deadlines.heard(senders[senders < self.n_workers], time.perf_counter())
            # ... and how far it settled (its bitmap field: "The relayed heartbeat" in docs/protocol.md)
            peer = (senders < self.n_workers) & (senders != self.worker_id)
            if peer.any():
                before = self.peers_settled.copy()
                reach = hdr["bitmap"][rows[alive]].astype(np.int64)
                np.maximum.at(self.peers_settled, senders[peer], reach[peer])
                if (self.peers_settled != before).any():  # any peer's mark: its frontier moves on
                    self._peer_settled(int(self.peers_settled.max()))
            self.stats.heartbeats_relayed += int(alive.sum())
            rows = rows[~alive]
            if not rows.size:
                return
        k = self.config.elems_per_packet
        payloads = self.io.rx.data[:, HEADER_BYTES : HEADER_BYTES + 4 * k].view(">f4")  # (a view)
        chunks = hdr["chunk"][rows]
        heal = (chunks >= HEAL_CHUNK_BASE) & (chunks < HEAL_REQUEST_BASE)
        if heal.any():  # a donor's state stream (hostlib/torch_ext/heal.py), never a parameter copy
            values = payloads[rows[heal]].astype(np.float32)
            for i, r in enumerate(rows[heal].tolist()):
                key = (int(hdr["worker_id"][r]), int(hdr["step"][r]))
                if key not in self.heal_inbox and len(self.heal_inbox) >= _HEAL_STREAMS_KEPT:
                    del self.heal_inbox[next(iter(self.heal_inbox))]  # the oldest: nobody took it
                stream = self.heal_inbox.setdefault(key, {})
                stream[int(hdr["chunk"][r]) - HEAL_CHUNK_BASE] = values[i, : int(hdr["nelem"][r])].copy()
            self.stats.params_received += int(heal.sum())
            rows = rows[~heal]
            if not rows.size:
                return
        # Each run of consecutive receive rows goes in as views: the inbox's copy (the byte swap) is the
        # only one (a gather of rows first would be a second pass over every parameter copy)
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        for run in np.split(rows, cuts) if cuts.size else (rows,):
            lo, hi = int(run[0]), int(run[-1]) + 1
            h = hdr[lo:hi]
            self.param_inbox.add(h["chunk"], h["step"], h["worker_id"], h["nelem"], payloads[lo:hi])
        self.stats.params_received += len(rows)

    def _on_results(self, plan: ReducePlan, hdr: np.ndarray, rows: np.ndarray) -> None:
        """Settle the units these RESULTs answer, all at once."""
        seqs, slots = hdr["seq"][rows].astype(np.int64), hdr["slot"][rows].astype(np.int64)
        g_all, phase = seq_unit(seqs, slots, self._slots)
        u_all = g_all - plan.base
        state = plan.state
        take = (u_all >= 0) & (u_all < plan.units)
        take[take] = state[u_all[take]] != DONE
        # A data unit's first round that some contributor flagged SATURATED is redone, not settled (_on_redo);
        # a later reduce's unit so flagged, or in its redo's round, is remembered for that reduce
        flagged = (phase == 0) & (hdr["count"][rows] > 0) & ((hdr["flags"][rows] & _SATURATED) != 0)
        later = u_all >= plan.units
        redo = (take & flagged & (u_all >= plan.exp_units)) | (later & (flagged | (phase == 1)))
        take &= ~redo
        if redo.any():  # (rare) one behind a RESULT that settled its unit in this batch is ignored, as late
            first_settled: dict[int, int] = {}
            for pos in np.flatnonzero(take).tolist():
                first_settled.setdefault(int(u_all[pos]), pos)
            for pos in np.flatnonzero(redo).tolist():
                if first_settled.get(int(u_all[pos]), pos) < pos:
                    redo[pos] = False
        rows_all, redone_all = rows, phase == 1  # (a redo's round: its unit's second)
        rows, u, redone = rows[take], u_all[take], redone_all[take]
        # One RESULT per unit: a resend or a duplicate FLUSH answer in the same batch changes nothing.
        # (Units mostly arrive in order, each once: then there is nothing to remove and no sort to pay.)
        if u.size > 1 and not bool((u[1:] > u[:-1]).all()):
            first = np.sort(np.unique(u, return_index=True)[1])
            rows, u, redone = rows[first], u[first], redone[first]
        self.stats.packets_ignored += len(u_all) - len(u) - int(np.count_nonzero(redo))
        if later.any():  # a later reduce's: its bits prove what the peers settled (reuse.py)
            bitmap = _proof(hdr, rows_all[later], redone_all[later])
            bits = ((bitmap[:, None] >> self._worker_bits) & np.uint64(1)).astype(bool)
            self.reuse.saw(plan.base, np.where(bits, u_all[later][:, None], -1).max(axis=0))
        # Every RESULT frame of this batch crossed this worker's link: one point of the delivery rate.
        plan.rx_batches.append((time.perf_counter(), len(u_all)))
        if u.size:
            self._settle(plan, hdr, rows, u, redone)
            if self.trace is not None:
                self.trace.on_settled(self, plan, u)
        self._drop_overtaken(plan)
        self._redo_news(plan, rows_all[redo])

    def _redo_news(self, plan: ReducePlan, rows: np.ndarray) -> None:
        """After a batch is settled: the first rounds it brought back SATURATED (``rows``), and the redone
        chunks whose agreed exponent it brought (_on_redo, _redo_send)."""
        if rows.size:
            self._on_redo(plan, rows)
        elif plan.any_redo_waiting:
            self._redo_send(plan)

    def _settle(
        self, plan: ReducePlan, hdr: np.ndarray, rows: np.ndarray, u: np.ndarray, redone: np.ndarray
    ) -> None:
        """Settle units ``u`` from RESULT ``rows`` (``redone``: a row is of its unit's redo round)."""
        n_workers = self.n_workers
        prior = plan.state[u].copy()
        plan.state[u] = DONE
        plan.synced = True
        flags = hdr["flags"][rows].astype(np.int64)
        count = hdr["count"][rows].astype(np.int64)
        bitmap = hdr["bitmap"][rows].astype(np.uint64)
        retx = (flags & _RETX) != 0
        self.stats.results_retx += int(retx.sum())
        self._time_answers(plan, hdr, rows, u, prior, count, retx)
        proof = _proof(hdr, rows, redone)  # (whose bits prove they sent every unit up to u: reached, below)
        self.deadlines.track_absent(bitmap)
        plan.full_units += int(np.count_nonzero(count == n_workers))
        if plan.any_critical:
            short = plan.critical_unit[u] & (count < n_workers)
            if short.any():
                # Only a FLUSH or a quorum below N closes a round short, and no worker flushes a critical
                # unit unless it presumes a peer dead or has resent it critical_max_resends times (or the
                # workers marked different chunks): renormalized like any partial chunk, and counted.
                self.stats.critical_partial_results += int(short.sum())
                log.debug("worker %d: %d critical units closed short", self.worker_id, int(short.sum()))
        # A worker's bit in unit u's RESULT proves it has sent every unit up to u (units go in order).
        if bool((proof == self._all_bits).all()):  # every round complete (the lossless case): one max
            reached = np.full(n_workers, int(u.max()), dtype=np.int64)
        else:
            has_bit = ((proof[:, None] >> self._worker_bits) & np.uint64(1)).astype(bool)
            reached = np.where(has_bit, u[:, None], -1).max(axis=0)
        np.maximum(plan.frontier, reached, out=plan.frontier)
        plan.own_shown = max(plan.own_shown, int(reached[self.worker_id]))
        self._settle_values(plan, hdr, rows, u, count, proof, flags, redone)

    def _time_answers(
        self,
        plan: ReducePlan,
        hdr: np.ndarray,
        rows: np.ndarray,
        u: np.ndarray,
        prior: np.ndarray,
        count: np.ndarray,
        retx: np.ndarray,
    ) -> None:
        """The RTT and FLUSH round-trip samples a batch of RESULTs gives (``prior``: the units' states
        before it settled them)."""
        n_workers = self.n_workers
        # A clean answer is an RTT sample. So is a complete multicast that answers a FLUSHed unit: a round
        # closes complete by its last GRAD alone, so the FLUSH was spurious and the wait we saw is what
        # the RTO must cover. A unicast resend (RETX) never is: the multicast went first on the same path,
        # so it was lost, and the wait measured the recovery (srtt grew 5-30x at 1-20% down loss).
        # A resent critical GRAD leaves it unknown which copy was answered (Karn): no sample.
        # Nor is a complete answer to a unit proven lost (fast_flush: every worker had sent it and more),
        # whose FLUSH was not spurious: behind a leaf switch (docs/protocol.md, "Hierarchy") such a
        # unit had lost a leaf's partial, which the leaf resent at the FLUSH, and the wait measured that
        # recovery (at 1% loss on both levels, about 5 such units per worker and reduce of 1056 units
        # made the RTO up to twice the flat switch's). A flat switch never answers one complete but
        # with a RETX resend.
        clean = (prior == IN_FLIGHT) & ~retx
        clean &= (plan.flushes[u] == 0) | ((count == n_workers) & ~plan.proven_lost[u])
        clean &= plan.retx[u] == 0
        if clean.any():
            rtt_ms = (time.perf_counter() - plan.sent_at[u[clean]]) * 1000.0
            # The batch's median (the upper one for an even count): np.partition, not np.median, whose
            # Python-level checks cost more than the selection on a batch of a few hundred.
            mid = len(rtt_ms) // 2
            self.deadlines.rtt_sample(float(np.partition(rtt_ms, mid)[mid]), float(rtt_ms.min()))
        # Was the round of a unit found lost closed already (Deadlines.probing_lost)? Not asked under LTP's
        # early close, which closes rounds short by design: a stored RESULT then says nothing of RESULT
        # loss (it capped the window and made test_pacing's early close rare).
        lost = (prior == IN_FLIGHT) & plan.proven_lost[u] & (self.early is None)
        if lost.any():
            self.deadlines.lost_answers(int(np.count_nonzero(retx[lost])), int(np.count_nonzero(lost)))
            self._loss_window = self.deadlines.loss_window(self.reuse.span)
        # The answer to a single FLUSH (Karn: not after a second one): the stored RESULT resent, or the
        # round it closed (its closer is this worker). A multicast another worker's packet closed crossed
        # the FLUSH on the way and times nothing.
        answered = (prior == IN_FLIGHT) & (plan.flushes[u] == 1) & (plan.retx[u] == 0)
        answered &= retx | (hdr["worker_id"][rows] == self._closer_id)
        if answered.any():
            flush_ms = (time.perf_counter() - plan.flushed_at[u[answered]]) * 1000.0
            mid = len(flush_ms) // 2
            self.deadlines.flush_sample(float(np.partition(flush_ms, mid)[mid]))

    def _settle_values(
        self,
        plan: ReducePlan,
        hdr: np.ndarray,
        rows: np.ndarray,
        u: np.ndarray,
        count: np.ndarray,
        bitmap: np.ndarray,
        flags: np.ndarray,
        redone: np.ndarray,
    ) -> None:
        """What the RESULTs of units ``u`` carry: agreed exponents (exponent units) and the dequantized,
        renormalized sums with their counts, bitmaps and weights (data units). ``bitmap``: the rows'
        :func:`_proof` (in a redo's round, ``redone``, the contributors counted)."""
        k, n_workers = self.config.elems_per_packet, self.n_workers
        # The payloads of every receive row, as a view (no gather): row rows[i] is RESULT i's.
        payload = self.io.rx.data[:, HEADER_BYTES : HEADER_BYTES + 4 * k].view(">i4")
        exp = u < plan.exp_units
        agreed = np.flatnonzero(exp & (count > 0))
        if agreed.size:  # every exponent RESULT of the batch at once (K chunks each, fewer in the last)
            chunks = u[agreed][:, None] * k + np.arange(k)  # (exponent units, K)
            valid = chunks < plan.chunks_count
            ebits = np.broadcast_to(bitmap[agreed][:, None], chunks.shape)[valid]
            chunks = chunks[valid]
            self._on_exponents(plan, chunks, payload[rows[agreed]][valid], ebits)
        data = ~exp
        if not data.any():
            return
        c = u[data] - plan.exp_units
        cnt, shift = count[data], hdr["exp"][rows[data]].astype(np.int32)
        bits = bitmap[data]  # (_proof's: a redo's round names the contributors counted, _redo_send)
        redone = redone[data]
        if redone.any():  # ... and counts them
            ones = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8).reshape(-1, 8), axis=1).sum(axis=1)
            cnt = np.where(redone, ones.astype(np.int64), cnt)
        plan.count[c], plan.bitmap[c] = cnt, bits
        plan.weight[c] = hdr["weight"][rows[data]]
        plan.result_flags[c], plan.shift[c] = flags[data], shift
        # Dequantized as they arrive, straight from the receive buffer.
        divisor = renormalize_divisor(cnt, plan.weight[c], self.config.renormalize, n_workers)
        got = cnt > 0
        if got.all():
            codec.dequantize_into(payload, shift, divisor, plan.out, rows=rows[data], out_rows=c)
        elif got.any():
            codec.dequantize_into(
                payload, shift[got], divisor[got], plan.out, rows=rows[data][got], out_rows=c[got]
            )
        if plan.user_out is not None:  # (ReducePlan.deliver_to) once quantized, a chunk's input is not read
            done = c[got]
            done = done[plan.quantized[done]]
            if done.size:
                which = np.zeros(plan.chunks_count, dtype=bool)
                which[done] = True
                _copy_rows(plan.out, plan.user_out, plan.user_out.size, which, plan.user_scale)
                plan.delivered[done] = True

    def _peer_settled(self, settled: int) -> None:
        """A peer settled every unit below ``settled`` (its relayed heartbeat), so unit ``settled - 1``
        reached the switch: the newest unit every overtaken test reads (the native settle's,
        _drop_overtaken, the passed reduce) learns it as from a RESULT. A worker stopped past the last
        RESULT its socket could keep finds its stale units here; before, their GRADs and FLUSHes went to
        rounds the switch had moved past, unanswered, 15-20 s a reduce. (A unit a peer gave up with every
        copy lost did not move its slot: this worker then falls back for a chunk it could have had.)"""
        self._newest_unit[0] = max(int(self._newest_unit[0]), settled - 1)
        self._peer_news = True

    def _frontier_from_marks(self, plan: ReducePlan) -> None:
        """A peer's relayed settled mark says it is done with every unit below it (answered or given up),
        as its bit in a RESULT says it sent the units up to there: its frontier in this reduce is raised
        to the mark. The fast flush and the withheld units' flush (Deadlines) then FLUSH at once the units
        every live peer is done with, and the switch answers with the stored RESULT (or the unit is
        overtaken). Without it a worker that withholds a whole reduce (its exponent proposals reached
        rounds a peer had closed without it) and hears few RESULTs (owner-only reduces, RESULT loss) had
        no proof that its peers had sent anything: it waited until its units were overtaken, which comes
        at the leader's pace, and never caught up (chaos seed 2, docs/results.md)."""
        reach = np.minimum(self.peers_settled - 1 - plan.base, plan.units - 1)
        reach[self.worker_id] = -1  # (this worker's own frontier is what it sent)
        np.maximum(plan.frontier, reach, out=plan.frontier)

    def _drop_overtaken(self, plan: ReducePlan) -> None:
        """A RESULT for global unit ``g`` shows that its sender sent every unit before g (first copies go
        in order), so each unit up to g - D (D data slots) had a newer round in its slot: units still
        open there can never be answered (the switch drops their GRADs and FLUSHes as stale). Give them
        up now instead of waiting through every deadline: the worker that fell behind falls back for
        those chunks and catches up. (A newer unit every copy of which was lost left its slot where it
        was: this worker then falls back for a chunk it could have had, as from a relayed heartbeat.)
        Before, only the unit in g's own slot was given up: a late worker that heard few RESULTs (RESULT
        loss, owner-only reduces) waited out the FLUSH give-ups of the rest, and a worker stopped until its
        peers were 3 reduces ahead, with 30% of RESULTs lost and a heartbeat a second, was locked out in 6
        of 12 runs (1 of 12 since; docs/results.md). The newest unit is remembered across reduces, so a
        worker that starts a reduce its peers left skips at once to where they are; it comes from RESULTs
        and from the peers' relayed heartbeats (_peer_settled)."""
        d, base = self._slots, plan.base
        hi = min(plan.units, int(self._newest_unit[0]) - base - d + 1)
        if hi <= plan.low:
            return
        v = np.arange(plan.low, hi)
        over = v[plan.state[v] < DONE]
        if over.size:
            plan.state[over] = GAVE_UP
            self.stats.units_overtaken += len(over)

    def _on_exponents(
        self, plan: ReducePlan, chunks: np.ndarray, agreed: np.ndarray, ebits: np.ndarray
    ) -> None:
        """The exponent rounds of ``chunks`` closed with the ``agreed`` exponents, counting the proposals
        ``ebits``: their data-round shifts are known, and whether this worker withholds them. Chunks are
        quantized lazily, a block at a time as they are sent, so the quantizing overlaps the switch's work on
        the packets already sent. A chunk sent at a speculated exponent keeps its shift and goes whatever
        the bits say; the round's result is kept for a redo and for the next reduce's speculation."""
        agreed = agreed.astype(np.int64)
        plan.agreed_exp[chunks] = agreed
        plan.agreed_bits[chunks] = ebits
        plan.exp_known[chunks] = True
        plan.nonfinite[chunks] = codec.nonfinite_agreed(agreed)
        spec = plan.spec[chunks]
        if spec.any():
            chunks, agreed, ebits = chunks[~spec], agreed[~spec], ebits[~spec]
        plan.shift[chunks] = codec.data_shifts(agreed, self.n_workers)
        plan.own_exp[chunks] = ((ebits >> np.uint64(self.worker_id)) & np.uint64(1)).astype(bool)
        plan.exp_bitmap[chunks] = ebits
        plan.any_withheld |= bool(np.any(ebits != self._all_bits))


def _proof(hdr: np.ndarray, rows: np.ndarray, redone: np.ndarray) -> np.ndarray:
    """The bits of RESULT ``rows`` that prove their workers sent every unit up to the row's (units go in
    order): the bitmap, but in a redo's round (``redone``: its unit's second, hostlib.protocol.seq_unit's
    phase 1) only the first round's contributors, named by the weight (2^w each; the others' zeros went
    out of order: ReduceEngine._redo_send)."""
    bitmap = hdr["bitmap"][rows].astype(np.uint64)
    if redone.any():
        bitmap = np.where(redone, bitmap & hdr["weight"][rows].astype(np.uint64), bitmap)
    return bitmap


def _copy_rows(
    rows: np.ndarray, dst: np.ndarray, n: int, which: np.ndarray | None, scale: float = 1.0
) -> None:
    """``dst[:n]`` = the first ``n`` values of ``rows`` (chunks of K) times ``scale`` (in the one pass that
    copies them), only in the chunks ``which`` (a bool mask over the chunks; None: all)."""
    if which is None or which.all():
        _put(dst[:n], rows.reshape(-1)[:n], scale)
        return
    k = rows.shape[1]
    full = n // k
    idx = np.flatnonzero(which[:full])
    sel: slice | np.ndarray = idx
    if len(idx) > 1 and np.all(np.diff(idx) == idx[1] - idx[0]):  # every N-th (a reduce-scatter's)
        sel = slice(int(idx[0]), int(idx[-1]) + 1, int(idx[1] - idx[0]))  # one strided pass, no gather
    if isinstance(sel, slice):
        _put(dst[: full * k].reshape(full, k)[sel], rows[sel], scale)
    else:
        dst[: full * k].reshape(full, k)[sel] = rows[sel] if scale == 1.0 else rows[sel] * np.float32(scale)
    if full * k < n and which[full]:
        _put(dst[full * k : n], rows[full, : n - full * k], scale)


def _put(dst: np.ndarray, src: np.ndarray, scale: float) -> None:
    """``dst[...] = src * scale`` in float32, one pass."""
    if scale == 1.0:
        dst[...] = src
    else:
        np.multiply(src, np.float32(scale), out=dst)
