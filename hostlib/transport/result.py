"""What a reduce returns and what a worker counts: per-chunk results, fallbacks, running statistics."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from hostlib.protocol import MAX_WORKERS, Flag
from hostlib.transport.config import Fallback
from hostlib.transport.plan import DONE, ReducePlan

_SATURATED = int(Flag.SATURATED)
# TransportStats keeps the times of this many most recent reduces (a worker runs for days: one entry per
# reduce forever grew without bound, and every stats call read them all).
REDUCE_MS_WINDOW = 10_000


@dataclass
class ReduceResult:
    """What one allreduce returned, chunk by chunk (chunk c covers values [c·K, (c+1)·K))."""

    values: np.ndarray  # float32, the input's length: renormalized mean, or the fallback
    count: np.ndarray  # contributions summed per chunk (0 where no RESULT came)
    bitmap: np.ndarray  # uint64, bit w = worker w contributed
    fallback: np.ndarray  # Fallback code per chunk
    withheld: np.ndarray  # bool per chunk: this worker's exponent proposal was not counted in the agreed
    # exponent (lost on the way), so it sent nothing for the chunk, whatever its values
    saturated: np.ndarray  # bool per chunk: the RESULT carried SATURATED (some sender clamped)
    shift: np.ndarray  # per chunk fixed-point shift used (error bound 2^-shift)
    elapsed_s: float
    critical: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # bool per chunk
    # bool per chunk: some counted worker's chunk held NaN or Inf, so ``values`` are NaN there on every
    # worker whose exponent RESULT counted it (docs/protocol.md, "Non-finite values")
    nonfinite: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def contributors(self, chunk: int) -> list[int]:
        bits = int(self.bitmap[chunk])
        return [w for w in range(MAX_WORKERS) if bits >> w & 1]


@dataclass
class TransportStats:
    """Running totals over every allreduce of a worker."""

    io: str = ""  # packet I/O path in use: mmsg-c, mmsg-ctypes (batched system calls) or plain
    reduces: int = 0
    chunks: int = 0
    chunks_full: int = 0  # count == N
    chunks_partial: int = 0  # 0 < count < N
    chunks_empty: int = 0  # a RESULT with count 0
    chunks_no_result: int = 0  # no RESULT at all, after every FLUSH
    chunks_no_exponent: int = 0  # this worker lost the exponent RESULT and sent nothing
    fallback_prev: int = 0
    fallback_zero: int = 0
    fallback_local: int = 0
    withheld_chunks: int = 0  # own exponent proposal not counted: withheld (whatever the values)
    saturated_results: int = 0  # RESULTs flagged SATURATED by some sender
    nonfinite_chunks: int = 0  # chunks returned as NaN: some counted worker's values were not finite
    flushes_sent: int = 0
    # FLUSHes of units not yet behind every worker's frontier: a timer decided (a late worker's
    # packet could still have come). 0 in exact runs: every round closed by the drop policy alone.
    flushes_on_timer: int = 0
    # GRADs sent again one RTO into a tail unit's wait for a peer (TransportConfig.tail_probe).
    tail_probes: int = 0
    # GRADs sent again at once for units found lost (Deadlines.fast_flush) while RESULT loss dominates
    # (Deadlines.probing_lost): the switch answers a closed round with its stored RESULT.
    lost_probes: int = 0
    # Reduces sent with one copy of each packet: the network had been quiet (TransportConfig.quiet_units).
    single_copy_reduces: int = 0
    # Speculated exponents (TransportConfig.speculate_bits): chunks sent before their exponent round's RESULT,
    # and chunks whose first round came back SATURATED and were redone at the agreed exponent.
    speculated_chunks: int = 0
    redone_chunks: int = 0
    # Time this worker had units left to send and room in its window, but a slot-reuse rule (reuse.py)
    # let none go: its own span (its oldest unsettled unit is S units back: a lost unit being recovered,
    # or a round waiting for a late peer, stalls the pipeline there) or, only where the span did not
    # hold it already, its peers' progress.
    held_by_span_s: float = 0.0
    held_by_peers_s: float = 0.0
    # Peers excused from the peer rule at once because they withhold the units it waited for their bit
    # in (ReduceEngine._peer_limit), and peer-hold waits that ran out (Deadlines.peer_hold_s).
    withheld_excuses: int = 0
    peer_hold_timeouts: int = 0
    packets_sent: int = 0
    packets_received: int = 0
    results_retx: int = 0
    packets_ignored: int = 0  # not ours, stale, duplicate or malformed
    units_overtaken: int = 0  # given up because their slot already moved to a later round
    params_received: int = 0
    heartbeats_relayed: int = 0  # peers' relayed heartbeats (ALIVE_CHUNK PARAMs), not in params_received
    # Critical chunks (allreduce(critical=...)): how many were reduced, how many came back with every
    # worker counted, with fewer (renormalized), or not at all; GRAD resends of critical units; RESULTs
    # of critical units that came back short (see ReduceEngine._settle for when that can happen).
    critical_chunks: int = 0
    critical_full: int = 0
    critical_partial: int = 0
    critical_missing: int = 0
    critical_resends: int = 0
    critical_partial_results: int = 0
    # Adaptive early close: reduces it ended (LT passed with 1 - theta in, or its deadline passed), data
    # units FLUSHed by it, and the longest remaining unit deadline each close cut short, summed (ms: an
    # upper bound on the wait it saved, since those units' RESULTs may have been on the way).
    early_closes_theta: int = 0
    early_closes_deadline: int = 0
    units_closed_early: int = 0
    early_close_deadline_cut_ms: float = 0.0
    elapsed_s: float = 0.0
    # The last REDUCE_MS_WINDOW reduces' times, and the longest of all.
    reduce_ms: deque[float] = field(default_factory=lambda: deque(maxlen=REDUCE_MS_WINDOW))
    reduce_ms_max: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every total, and ``reduce_ms``: p50 and p99 of the last REDUCE_MS_WINDOW reduces, max of all."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("reduce_ms")}
        times = np.fromiter(self.reduce_ms, dtype=np.float64) if self.reduce_ms else np.zeros(1)
        out["reduce_ms"] = {
            "p50": float(np.percentile(times, 50)),
            "p99": float(np.percentile(times, 99)),
            "max": self.reduce_ms_max,
        }
        return out

    def account(self, plan: ReducePlan, fallback: np.ndarray, n_workers: int, elapsed: float) -> int:
        """Add one reduce to the totals; returns how many of its chunks got no aggregate (no RESULT, or
        a RESULT with count 0), what the worker's health check looks at."""
        # Another worker's owner-only chunks are left out: no RESULT was due here (one that came all the
        # same, from a switch that multicasts them, is not counted either).
        done = plan.state[plan.exp_units :] == DONE
        if plan.any_owned:
            done &= ~plan.elsewhere
        count = plan.count
        settled = int(np.count_nonzero(done))
        empty = int(np.count_nonzero(done & (count == 0)))
        full = int(np.count_nonzero(done & (count == n_workers)))
        over = int(np.count_nonzero(done & (count > n_workers)))
        mine = len(done) - (int(np.count_nonzero(plan.elsewhere)) if plan.any_owned else 0)
        self.reduces += 1
        self.chunks += mine
        self.chunks_full += full
        self.chunks_partial += settled - empty - full - over
        self.chunks_empty += empty
        self.chunks_no_result += mine - settled
        self.chunks_no_exponent += len(plan.exp_known) - int(np.count_nonzero(plan.exp_known))
        self.withheld_chunks += int(np.count_nonzero(plan.withheld))
        self.saturated_results += int(np.count_nonzero(done & ((plan.result_flags & _SATURATED) != 0)))
        if plan.any_critical:
            crit = plan.critical
            self.critical_chunks += int(crit.sum())
            self.critical_full += int(np.sum(crit & done & (plan.count == n_workers)))
            self.critical_partial += int(np.sum(crit & done & (plan.count > 0) & (plan.count < n_workers)))
            self.critical_missing += int(np.sum(crit & ~(done & (plan.count > 0))))
        if plan.closing:
            if plan.closing == "theta":
                self.early_closes_theta += 1
            else:
                self.early_closes_deadline += 1
            self.units_closed_early += plan.closed_early
        if np.any(fallback):  # (Fallback.NONE is 0)
            used = np.bincount(fallback, minlength=len(Fallback))
            self.fallback_prev += int(used[Fallback.PREV])
            self.fallback_zero += int(used[Fallback.ZERO])
            self.fallback_local += int(used[Fallback.LOCAL])
        self.elapsed_s += elapsed
        self.reduce_ms.append(elapsed * 1000.0)
        self.reduce_ms_max = max(self.reduce_ms_max, elapsed * 1000.0)
        return empty + mine - settled


def fallback_codes(
    arrived: np.ndarray,
    count: np.ndarray,
    n_workers: int,
    renormalize: str,
    policy: Fallback,
    elsewhere: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The renormalize/fallback rule, per chunk: whether a worker keeps the RESULT's aggregate (``got``)
    and the Fallback code it reports. ``arrived``: a RESULT with count > 0 reached the worker (any
    shape ending in the chunks: (C,) for one worker, (N, C) for N at once); ``count`` (C,): its count.

    ``renormalize`` "count" or "weight": every arrived chunk is kept (its sum over its count or weight
    is unbiased for any value-independent loss). "none" (sum / N): with the zero fallback any arrived
    chunk is kept (lost contributions count as zeros), otherwise only complete ones (count == N); every
    chunk short of N is marked with the fallback either way. ``elsewhere``: chunks another worker owns
    (no RESULT was due): code NONE, not kept."""
    if renormalize == "none":
        got = arrived if policy == Fallback.ZERO else arrived & (count == n_workers)
    else:
        got = arrived
    codes = np.where(got, Fallback.NONE, policy).astype(np.int8)
    if renormalize == "none":  # zero-filled chunks are a fallback too, though they keep sum/N
        codes[..., count < n_workers] = policy
    if elsewhere is not None:
        codes[..., elsewhere] = Fallback.NONE
    return got, codes


def renormalize_divisor(
    count: np.ndarray, weight: np.ndarray | None, renormalize: str, n_workers: int
) -> np.ndarray:
    """What a chunk's sum is divided by: its count ("count"), its summed sample weight where positive
    and else its count ("weight"), or N ("none")."""
    if renormalize == "count":
        return count
    if renormalize == "weight":
        assert weight is not None, "renormalize='weight' needs the summed weights"
        return np.where(weight > 0, weight, count)
    return np.full(len(count), n_workers)


def fallback_rows(
    policy: Fallback, prev: np.ndarray | None, n: int, missing: np.ndarray, chunks: np.ndarray
) -> np.ndarray:
    """Rows for the chunks where nothing usable arrived: this worker's own values (local), its last
    result for the tensor (prev; zeros the first time) or zeros."""
    if policy == Fallback.LOCAL:
        return chunks[missing]
    if policy == Fallback.ZERO or prev is None:
        return np.zeros((int(missing.sum()), chunks.shape[1]), dtype=np.float32)
    padded = np.zeros(chunks.size, dtype=np.float32)
    padded[:n] = prev
    return padded.reshape(chunks.shape)[missing]
