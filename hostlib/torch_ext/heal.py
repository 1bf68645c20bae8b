"""Healing a rank that fell behind: it takes a live peer's state and goes on at its peers' step.

A rank stopped (SIGSTOP, a VM pause, a long descheduling) comes back behind its peers: the reduces it
starts are over (every unit overtaken, ``ReduceOutcome.passed``). Up to ``TransportConfig.catch_up_
reduces`` of them in a row it skips them, falling back for their chunks; past that bound its
``HealthMonitor`` marks it ``behind`` (instead of raising) when a :class:`Healer` is installed, and at its
next step boundary the front door calls :meth:`Healer.heal`:

1. it asks one peer, the *donor*, for its state: a PARAM_REQ of chunk ``HEAL_REQUEST_BASE + donor``
   (critical; the switch relays it to every other worker and only the donor keeps it);
2. the donor answers as soon as the request arrives, from inside its transport (a reduce, a parameter
   collect, a poll: the engine's ``heal_responder``), never waiting for a step boundary: its peers'
   critical units wait for the rank behind, so a donor that answered only between steps would wait
   for it too. The front door's ``snapshot`` says what the donor stands at: the step whose reduce it is
   in (or the next one), the transport's unit counter at that reduce's start, and the values a rank
   joining that reduce needs (parameters as they were at the step's start, and the optimizer state
   the donor holds). It goes as PARAMs of chunks ``HEAL_CHUNK_BASE + i`` (critical), ``step`` = that
   step, chunk 0 a header (the number of values, the unit counter, the door's own counters), chunks
   1... the values;
3. once a whole stream of one (donor, step) is in, the rank loads it (the door's ``restore``), moves its
   transport's unit counter to the donor's (its next reduce is its peers' next one) and is healthy again.

A donor that sends nothing within ``ask_s`` of a request (dead, finished, or stopped itself) is passed
over for the next peer, in rank order; a stream that stays incomplete (a real network lost some of it)
is asked for again. Past ``timeout_s`` with no whole stream, or once no peer's relayed heartbeat has
been heard for ``peer_alive_s`` (3 ``ask_s`` into the asking), the rank raises ``UnhealthyTraining``: no
live peer could give it their state (they finished the run while it was stopped, or every one is gone;
in ``lta chaos`` a rank stopped 1-8 s past its peers' last step).

The peers never wait for it: they answer at a step boundary they reach anyway, in one burst of sends,
and their reduces meanwhile treat the rank as any late peer (its rounds closed by their deadlines, or by
the quorum the liveness monitor lowered while it was silent).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from hostlib.errors import UnhealthyTraining
from hostlib.protocol import HEAL_CHUNK_BASE, HEAL_REQUEST_BASE
from hostlib.transport import LtaWorker

log = logging.getLogger(__name__)

_INT_BITS = 24  # an int travels as two float32 values of 24 bits each (exact), up to 2**48
_ASK_S = 1.0  # a donor that sent nothing this long after a request is passed over
_TIMEOUT_S = 30.0

# snapshot() -> (step, the transport's unit counter at that step's start, counters, values)
Snapshot = Callable[[], tuple[int, int, list[int], np.ndarray]]
# restore(step, counters, values)
Restore = Callable[[int, list[int], np.ndarray], None]


def _encode_ints(ints: list[int]) -> np.ndarray:
    out = np.zeros(1 + 2 * len(ints), dtype=np.float32)
    out[0] = len(ints)
    for i, v in enumerate(ints):
        if not 0 <= v < 1 << (2 * _INT_BITS):
            raise ValueError(f"heal header value {v} out of range 0..2^48")
        out[1 + 2 * i], out[2 + 2 * i] = v >> _INT_BITS, v & ((1 << _INT_BITS) - 1)
    return out


def _decode_ints(header: np.ndarray) -> list[int]:
    n = int(header[0])
    return [(int(header[1 + 2 * i]) << _INT_BITS) | int(header[2 + 2 * i]) for i in range(n)]


class Healer:
    """Serves this rank's state to a peer that asks (:meth:`serve`) and takes a peer's state when this
    rank fell behind (:meth:`heal`). ``snapshot`` returns ``(step, counters, values)`` at a step
    boundary; ``restore`` loads them. Installing one makes the worker's health monitor mark the rank
    ``behind`` instead of raising past ``catch_up_reduces``."""

    def __init__(
        self,
        worker: LtaWorker,
        snapshot: Snapshot,
        restore: Restore,
        *,
        ask_s: float = _ASK_S,
        timeout_s: float = _TIMEOUT_S,
    ) -> None:
        if ask_s <= 0 or timeout_s <= 0:
            raise ValueError(f"need ask_s > 0 and timeout_s > 0, got {ask_s} and {timeout_s}")
        self.worker, self.snapshot, self.restore = worker, snapshot, restore
        self.ask_s, self.timeout_s = ask_s, timeout_s
        self.served = 0  # states sent to peers
        self.healed = 0  # states taken from peers
        self.last_heal_s = 0.0  # how long the last heal took, from the first request to the state loaded
        self.last_donor = -1
        self._answering = False
        self._healing = False
        worker.health.can_heal = True
        worker.engine.heal_responder = self._answer

    @property
    def behind(self) -> bool:
        """The rank skipped more than ``catch_up_reduces`` reduces in a row: heal it at the next step
        boundary."""
        return bool(self.worker.health.behind)

    # ---- donor side ------------------------------------------------------------------------------
    def serve(self) -> None:
        """At a step boundary: answer any request that came (the transport answers them as they arrive;
        this catches those that came while it was not called) and drop peers' streams meant for others."""
        self.worker.poll(0.0)
        if not self.behind:
            self.worker.heal_inbox.clear()
        self._answer()

    def _answer(self) -> None:
        """Send this rank's state once for every request that came since the last answer (one stream
        serves every rank that waits). A rank that is behind itself has nothing current to give."""
        worker = self.worker
        if not worker.heal_requests or self._answering:
            return
        asked = sorted(worker.heal_requests)
        worker.heal_requests.clear()
        if self.behind or self._healing:  # nothing current to give (a restarted rank: its fresh model)
            return
        self._answering = True
        try:
            step, next_unit, counters, values = self.snapshot()
            self._send(step, [next_unit, *counters], values)
        finally:
            self._answering = False
        self.served += 1
        log.info("worker %d sent its state at step %d to %s", worker.worker_id, step, asked)

    def _send(self, step: int, counters: list[int], values: np.ndarray) -> None:
        k = self.worker.config.elems_per_packet
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        header = _encode_ints([len(values), *counters])
        if len(header) > k:
            raise ValueError(f"heal header of {len(header)} values does not fit one packet of K={k}")
        rows = np.zeros((1 + -(-len(values) // k), k), dtype=np.float32)
        rows[0, : len(header)] = header
        rows.reshape(-1)[k : k + len(values)] = values
        ids = HEAL_CHUNK_BASE + np.arange(len(rows), dtype=np.int64)
        if ids[-1] >= HEAL_REQUEST_BASE:
            raise ValueError(f"a state of {len(values)} values needs more heal chunks than the range holds")
        self.worker.broadcast_params(ids, rows, step=step, critical=True)

    def linger(
        self, max_s: float = 10.0, grace_s: float = 10.0, until: Callable[[], bool] | None = None
    ) -> float:
        """At the end of a run: keep answering heal requests while some peer has missed a relayed
        heartbeat (none for two intervals: stopped, or dead; nobody can tell), and for ``grace_s``
        after the last such peer is heard again (it skips the reduces it missed, or a restarted one
        builds its model, then asks), up to ``max_s`` in all. A rank stopped past its peers' last step
        can then still take their final state instead of finding nobody (chaos seed 38: its peers had
        finished 2.4 s before it came back). ``until``: the caller knows better (a launcher that saw every
        rank finish or die for good): lingering ends once it says True. Returns the seconds spent; 0 when
        every peer was heard lately, or without heartbeats (nothing to tell)."""
        worker, cfg = self.worker, self.worker.config
        if cfg.heartbeat_interval_s <= 0 or worker.n_workers < 2:
            return 0.0
        t0 = time.perf_counter()
        others = np.arange(worker.n_workers) != worker.worker_id
        quiet_until = t0  # serve at least until then once a silent peer is heard again
        quiet_s = 2 * cfg.heartbeat_interval_s  # a peer that missed a relayed heartbeat is silent
        while True:
            self.serve()
            now = time.perf_counter()
            silent = bool(np.any(now - worker.deadlines.heard_at[others] > quiet_s))
            if silent:
                quiet_until = max(quiet_until, now + grace_s)
            if now - t0 >= max_s or (not silent and now >= quiet_until) or (until is not None and until()):
                return now - t0
            worker.poll(0.05)

    # ---- the rank behind -------------------------------------------------------------------------
    def heal(self) -> int:
        """Take a live peer's state (module docstring) and load it; returns the donor's step. Raises
        UnhealthyTraining when no peer sent a whole state within ``timeout_s``."""
        worker = self.worker
        me, n = worker.worker_id, worker.n_workers
        donors = [(me + i) % n for i in range(1, n)]
        self._healing = True
        try:
            return self._heal(me, donors)
        finally:
            self._healing = False

    def _heal(self, me: int, donors: list[int]) -> int:
        worker = self.worker
        inbox = worker.heal_inbox
        inbox.clear()
        t0 = time.perf_counter()
        turn, asked_at = 0, -np.inf
        while True:
            worker.poll(0.0)
            got = self._whole_stream(inbox)
            if got is not None:
                donor, step, counters, values = got
                break
            now = time.perf_counter()
            gone = self._peers_gone(now, t0)
            if now - t0 >= self.timeout_s or gone:
                why = (
                    f"none of them has been heard for {worker.config.peer_alive_s:g} s (their relayed "
                    "heartbeats stopped): they finished the run or are gone"
                    if gone
                    else "its peers finished the run or are gone"
                )
                raise UnhealthyTraining(
                    f"worker {me} of job {worker.job_id} fell behind its peers (more than "
                    f"catch_up_reduces={worker.config.catch_up_reduces} reduces in a row were over before "
                    f"it started them, or it was restarted) and no peer sent it their state within "
                    f"{now - t0:.1f} s (asked {sorted(set(donors))}): {why}"
                )
            if now - asked_at >= self.ask_s:
                current = donors[turn % len(donors)]
                if asked_at > -np.inf and not any(s == current for s, _ in inbox):
                    turn += 1  # nothing from that donor: ask the next one
                worker.request_heal(donors[turn % len(donors)])
                asked_at = now
            worker.poll(0.01)
        next_unit, own = counters[0], counters[1:]
        self.restore(step, own, values)
        worker.rejoin_at(next_unit)
        worker.health.healed()
        inbox.clear()
        self.healed += 1
        self.last_donor = donor
        self.last_heal_s = time.perf_counter() - t0
        log.warning(
            "worker %d of job %d fell behind its peers and took worker %d's state at step %d (%.2f s)",
            me,
            worker.job_id,
            donor,
            step,
            self.last_heal_s,
        )
        return step

    def _peers_gone(self, now: float, since: float) -> bool:
        """No peer's relayed heartbeat heard for ``peer_alive_s``, ``3 ask_s`` into the asking (packets
        queued while this rank was stopped count as heard when it reads them, once). Never with
        heartbeats off: then only ``timeout_s`` ends the asking."""
        cfg = self.worker.config
        if cfg.heartbeat_interval_s <= 0 or now - since < 3 * self.ask_s:
            return False
        heard = np.delete(self.worker.deadlines.heard_at, self.worker.worker_id)
        return bool(np.all(now - heard > cfg.peer_alive_s))

    def _whole_stream(
        self, inbox: dict[tuple[int, int], dict[int, np.ndarray]]
    ) -> tuple[int, int, list[int], np.ndarray] | None:
        """The newest whole stream in ``inbox`` (donor, step, counters, values), or None."""
        k = self.worker.config.elems_per_packet
        for (donor, step), chunks in sorted(inbox.items(), key=lambda kv: -kv[0][1]):
            header = chunks.get(0)
            if header is None:
                continue
            ints = _decode_ints(header)
            n_values, counters = ints[0], ints[1:]
            n_rows = -(-n_values // k)
            if not all(i in chunks for i in range(1, n_rows + 1)):
                continue
            values = np.zeros(n_rows * k, dtype=np.float32)
            for i in range(1, n_rows + 1):
                row = chunks[i]
                values[(i - 1) * k : (i - 1) * k + len(row)] = row
            return donor, step, counters, values[:n_values]
        return None
