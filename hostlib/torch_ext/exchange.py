"""Parameter broadcast with stale copies: owners publish absolute values, receivers keep what arrives.

Each step the owner of a chunk sends its absolute values as PARAM (the switch replicates them to every
other worker, each replica subject to that receiver's loss), then one *end marker* (a PARAM with chunk id
``MARKER_CHUNK_BASE + owner``, flagged CRITICAL so emulated loss spares it). On one switch path packets
stay in order, so once a receiver has every owner's marker it knows which chunks were lost and need not
wait for a deadline; the deadline only covers a marker lost on a real network or a late owner.

A lost chunk leaves the receiver's previous copy in place (the paper's Algorithm 1, lines 17-22). A
:class:`~hostlib.stale.StaleTracker` per receiver counts each copy's age; a copy older than the bound S
is requested (PARAM_REQ, critical) and the owner resends it reliably (critical) — at once if it is
waiting in :meth:`ParamExchange.collect`, else with its next publish (always with its next publish in
exact runs, ``TransportConfig.exact``, so that the copy's value does not depend on timing). The
receiver waits for every copy it requested before it accounts the next step, so **no copy's age ever
exceeds S+1**.

**Retrieval within the step** (``retrieve=True``): broadcasts stay lossy, but a receiver does not
account a step before it holds every foreign chunk of it: once an owner's end marker is in, the chunks
of that owner still missing were lost, and the receiver asks for them (PARAM_REQ); the owner answers at
once, reliably (CRITICAL), from inside a reduce or ``collect``. No copy is ever stale; the cost is at
most one resend per lost copy (``resend_requests`` counts the chunks asked for; a resend reaches every
receiver, so one ask may serve several) and the wait for it. The values
served are the owner's step-t values whenever it answers: it cannot step again before this receiver
has finished ``collect`` (its next reduce needs this receiver's gradient).

**Critical chunks** (``critical=``, LTP's hybrid: see hostlib/torch_ext/critical.py) are delivered, not
just tried: the owner sends them CRITICAL every step, and a receiver does not account a step before
it holds every critical chunk of it. Under real loss, where the flag protects nothing, the receiver asks
for the ones still missing (PARAM_REQ, again every ``_REREQUEST_S``) as soon as their owner's end marker
is in, or at the deadline; the owner answers at once, even from inside a reduce (the transport calls
:meth:`ParamExchange._respond` as requests arrive), so a receiver never waits on an owner that has moved
on to the next step's reduce. After a ``publish(critical=True)`` (``synchronize``) every chunk is
treated so. An owner answers only while it is inside the transport (a reduce, ``collect``, ``poll``): a
worker that stops stepping, or blocks in other collectives (a gloo barrier) between steps, should keep
polling (``worker.poll(seconds)``) until its peers are through, or they wait up to ``resend_timeout_s``.

**A dead owner.** An owner the transport presumes dead (absent from a whole window of RESULTs) publishes
nothing and steps nothing: its copies are kept as its last publish left them (until its shard is
served again, below), neither waited for from it nor requested from it nor aged. An owner killed
after its reduce and before its publish leaves no such evidence (its bit is in every RESULT of its last
reduce, and its peers then wait in ``collect``, in no reduce): chaos seed 99's survivors waited 30 s
for its critical copies and raised TimeoutError. So a receiver also
gives up, and treats as dead, an owner whose end marker for the step is not in and from whom nothing
has come for ``liveness_timeout_s`` of the wait (the switch's liveness monitor's timeout, 3 s by
default: by then the monitor has marked it offline and lowered the job's quorum, so the next reduce
closes without it). It tells the transport, which presumes the owner dead at once (short deadlines, no
bound on its excuse in the slot-reuse rule) instead of after a window of RESULTs: with a 63-slot pool
(seed 99) the survivors took three 1.3-1.9 s steps before their transports had seen that window. A
live owner sends its marker right after its reduce; one stopped or descheduled that long is offline at
the switch too. Its later copies or marker clear the exchange's presumption (its critical copies are
then one step late once), its bit in a RESULT the transport's. An owner whose marker is in but who
stops answering requests (a live one blocked between steps) is still waited for up to
``resend_timeout_s``.

**A dead owner's shard is served again** (``reserve=True``, the default; off for replicated receivers).
Under PARAM loss each survivor holds its own mix of a dead owner's earlier publishes, and nobody would
ever send that shard again: replicas the design keeps identical where nothing is lost would stay apart
for good. So the lowest-numbered rank that is not presumed dead, other than the owner (its
*re-server*, by the same rule on every rank), sends its copy of every chunk of the shard again,
CRITICAL, once per death, when it first presumes the owner dead, and again on request (the whole
shard at most once per ``_REREQUEST_S``). Each copy is
tagged with the step ``max(held step, the owner's last end marker + 1)``: past every step the owner
published, so no late copy of the owner's own replaces it anywhere, the re-server's included (it holds
its copy under the same tag). A receiver tells a re-served copy from the owner's by its sender (the
PARAM's ``worker_id``, kept by the transport with each row of its inbox) and takes it when it is newer than
the copy it holds, or as new and held from the owner itself, or from a higher rank (two ranks that
both took themselves for the re-server end on the lower one's copy). A survivor that presumes the
owner dead and is not its re-server waits in ``collect`` until it holds a re-served copy of every
chunk of the shard, asking every ``_REREQUEST_S``: a PARAM_REQ of the owner's *end marker*
(``MARKER_CHUNK_BASE + owner``, "I gave this owner up") while it holds none of them, which makes every
rank that receives it give the owner up too and the re-server send the whole shard, even from inside a
reduce; else PARAM_REQs of the chunks still missing. So the survivors end with the re-server's copy
whichever of them learnt of the death first, and when: the re-server's copy does not change after the
death (nothing of the owner's is newer than its tag), and it is the copy every survivor adopts. A
re-server silent that long (nothing, not even a relayed heartbeat, for ``liveness_timeout_s`` of the
wait) is given up in turn and the next rank serves. The owner, heard from again (back from a stop,
or restarted: it heals its whole replica, its own shard included, from a peer that holds the
re-served copy), publishes as before, its copies newer than the tag. Not covered: a death that no
survivor notices before its last step (no critical chunk waited for, no later reduce to show the
owner's absence): nobody serves that shard again. A shard's optimizer state died with its owner, so
nobody steps a dead owner's shard (no owner failover): every survivor would have to agree on the owner
map of every reduce, and a restarted owner takes its shard back from its optimizer state.

**Replicated receivers** (``replicated=True``, the DDP hook's re-broadcast): ``rows`` is the receiver's
own replica, which its optimizer keeps current between broadcasts, not a copy that ages. Only a copy of
the step being collected is news there: an owner's copy of an earlier step (one that came after the
receiver had given up waiting for it at the deadline, and waited in the inbox) would roll those values
back by the updates made since, on this receiver alone (chaos seed 91: survivors apart by 1e-2, exit 0).
Such copies are dropped (``late_copies_dropped``), and an owner answers requests when it publishes only,
so a resend carries the step its receiver collects next (as in exact runs).

One worker, one exchange: the exchange drains ``worker.param_inbox`` and ``worker.param_requests``.
"""

from __future__ import annotations

import logging
import select
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from hostlib.liveness import DEFAULT_TIMEOUT_S as DEFAULT_LIVENESS_TIMEOUT_S
from hostlib.stale import StaleTracker
from hostlib.torch_ext.layout import MARKER_CHUNK_BASE, ShardLayout
from hostlib.transport import LtaWorker

log = logging.getLogger(__name__)

_REREQUEST_S = 0.1  # PARAM_REQ is critical, but a real network may still lose it: ask again this often
# _reserved_by of a copy taken from a peer's whole replica (adopt: a heal, a rejoin): neither the owner's
# nor known to be re-served, its held step made up (the step joined at), so a re-served copy of any
# step replaces it.
_ADOPTED = -2


@dataclass
class ExchangeStats:
    steps: int = 0
    chunks_expected: int = 0  # foreign chunks summed over steps
    chunks_fresh: int = 0  # ... of which this step's copy arrived in time
    late_copies: int = 0  # copies that arrived after their step was accounted
    late_copies_dropped: int = 0  # replicated: copies of an earlier step than the one collected, not taken
    resend_requests: int = 0  # chunks this receiver asked for reliably (age past the bound; retrieve: lost)
    resends_served: int = 0  # chunks this owner resent reliably on request
    markers_missed: int = 0  # an owner's end marker did not come before the deadline
    critical_requests: int = 0  # critical (or required) chunks this receiver asked for again
    owners_given_up: int = 0  # owners presumed dead here: no marker and silent past liveness_timeout_s
    reserved_chunks_sent: int = 0  # chunk copies of dead owners' shards this rank re-served
    reserved_chunks_taken: int = 0  # re-served copies taken into rows
    reserve_requests: int = 0  # re-serve requests this receiver sent (markers and chunks, see collect)
    wait_s: float = 0.0  # time spent in collect

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fresh_fraction"] = self.chunks_fresh / self.chunks_expected if self.chunks_expected else 1.0
        return out


class ParamExchange:
    """Publishes this worker's chunks of ``rows`` and collects everyone else's into it.

    ``rows``: a (C, K) float32 host array (the flat parameters, padded), written in place on receipt.
    ``replicated``: ``rows`` is the receiver's own live replica (see the module's docstring): only copies
    of the step being collected are taken."""

    def __init__(
        self,
        worker: LtaWorker,
        layout: ShardLayout,
        rows: np.ndarray,
        *,
        stale_bound: int = 8,
        deadline_ms: float = 200.0,
        resend_timeout_s: float = 30.0,
        critical: np.ndarray | None = None,
        retrieve: bool = False,
        replicated: bool = False,
        liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
        reserve: bool = True,
    ) -> None:
        if liveness_timeout_s <= 0:
            raise ValueError(f"liveness_timeout_s must be > 0 s, got {liveness_timeout_s}")
        k = worker.config.elems_per_packet
        if layout.elems_per_chunk != k:
            raise ValueError(f"layout chunks hold {layout.elems_per_chunk} values, the transport's K is {k}")
        if rows.shape != (layout.n_chunks, k) or rows.dtype != np.float32:
            raise ValueError(
                f"rows must be float32 of shape {(layout.n_chunks, k)}, got {rows.dtype} {rows.shape}"
            )
        self.worker, self.layout, self.rows = worker, layout, rows
        me = worker.worker_id
        self.owned = layout.chunks_of(me)
        self.foreign = np.flatnonzero(layout.owners != me)
        self.others = np.array([w for w in range(worker.n_workers) if w != me], dtype=np.int64)
        self.deadline_s = deadline_ms / 1000.0
        self.resend_timeout_s = resend_timeout_s
        self.liveness_timeout_s = liveness_timeout_s
        # Owners given up in collect (see _silent_owners): presumed dead until a packet of theirs comes.
        self._given_up = np.zeros(worker.n_workers, dtype=bool)
        self._heard_at = np.full(worker.n_workers, -np.inf)  # perf_counter of each owner's last packet
        self.tracker = StaleTracker(len(self.foreign), stale_bound)
        self.held_step = np.full(layout.n_chunks, -1, dtype=np.int64)  # step of the copy held
        self.held_step[self.owned] = np.iinfo(np.int64).max  # the owner's copy is never stale
        self._held_at_update = self.held_step[self.foreign].copy()
        self._awaiting = np.zeros(layout.n_chunks, dtype=bool)  # requested, no newer copy yet
        self._awaiting_above = np.zeros(layout.n_chunks, dtype=np.int64)  # ... than this step
        self._marker_step = np.full(worker.n_workers, -1, dtype=np.int64)
        self._published_step = -1
        self.changed = False  # some foreign rows were overwritten since the flag was last cleared
        self.stats = ExchangeStats()
        # Critical chunks (bool per chunk): always sent CRITICAL, always waited for, resent on request
        # at once. After a critical publish every owned chunk is answered at once until the next publish.
        if critical is None:
            critical = np.zeros(layout.n_chunks, dtype=bool)
        if critical.shape != (layout.n_chunks,) or critical.dtype != bool:
            raise ValueError(f"critical: need {layout.n_chunks} bools (one per chunk), got {critical.shape}")
        self.critical = critical.copy()
        self.critical_foreign = self.foreign[self.critical[self.foreign]]
        self._all_critical_step = -1  # the step of the last publish(critical=True)
        self.retrieve = retrieve
        self.replicated = replicated
        self._asked = np.zeros(layout.n_chunks, dtype=bool)  # retrieval: asked for this step already
        # Re-serving a dead owner's shard (module docstring, "A dead owner's shard is served again"):
        # off for a replicated receiver, whose rows are its own live replica (nothing is frozen there).
        # Re-served copies are told from the owner's by their sender, the PARAM's worker_id: under
        # own_leaf that is the leaf's id, not the rank, so re-serving is off there too.
        self.reserve = reserve and not replicated and not worker.config.own_leaf
        self._reserved_by = np.full(layout.n_chunks, -1, dtype=np.int64)  # -1: the owner's own copy
        self._reserving = np.zeros(worker.n_workers, dtype=bool)  # dead owners this rank re-served
        # When this rank last sent a dead owner's whole shard: marker requests from several receivers
        # at once (or repeated while a large shard is on its way) are answered by one send per
        # _REREQUEST_S; a receiver still missing chunks asks again, for those chunks.
        self._whole_sent_at = np.full(worker.n_workers, -np.inf)
        worker.param_responder = self._respond

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What the next steps' accounting depends on (copies): the step of every copy held, the stale
        tracker, outstanding resend requests, the owners' last markers and the statistics. The copies'
        values are the model's parameters, saved with the model; packets in flight are not saved (a
        receiver asks again for a copy it still awaits)."""
        return {
            "n_chunks": self.layout.n_chunks,
            "held_step": self.held_step.copy(),
            "held_at_update": self._held_at_update.copy(),
            "awaiting": self._awaiting.copy(),
            "awaiting_above": self._awaiting_above.copy(),
            "marker_step": self._marker_step.copy(),
            "published_step": self._published_step,
            "all_critical_step": self._all_critical_step,
            "reserved_by": self._reserved_by.copy(),
            "tracker": self.tracker.state_dict(),
            "stats": asdict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ValueError if it was taken over another layout."""
        if int(state["n_chunks"]) != self.layout.n_chunks or len(state["marker_step"]) != len(
            self._marker_step
        ):
            raise ValueError(
                f"exchange state covers {int(state['n_chunks'])} chunks of {len(state['marker_step'])} "
                f"workers; this exchange has {self.layout.n_chunks} chunks of {len(self._marker_step)}"
            )
        self.tracker.load_state_dict(state["tracker"])
        self.held_step = np.array(state["held_step"], dtype=np.int64)
        self._held_at_update = np.array(state["held_at_update"], dtype=np.int64)
        self._awaiting = np.array(state["awaiting"], dtype=bool)
        self._awaiting_above = np.array(state["awaiting_above"], dtype=np.int64)
        self._marker_step = np.array(state["marker_step"], dtype=np.int64)
        self._published_step = int(state["published_step"])
        self._all_critical_step = int(state.get("all_critical_step", -1))
        reserved_by = state.get("reserved_by")  # (absent from states saved before re-serving)
        self._reserved_by = (
            np.full(self.layout.n_chunks, -1, dtype=np.int64)
            if reserved_by is None
            else np.array(reserved_by, dtype=np.int64)
        )
        self._reserving[:] = False
        known = {f.name for f in fields(ExchangeStats)}
        self.stats = ExchangeStats(**{k: v for k, v in state["stats"].items() if k in known})
        self.changed = False

    # ---- owner side ------------------------------------------------------------------------------
    def publish(self, step: int, *, critical: bool = False) -> None:
        """Broadcast every owned chunk's current values, then this owner's end marker. Chunks a receiver
        asked for (and all of them when ``critical``) go CRITICAL, exempt from emulated loss."""
        owned = self.owned
        if len(owned):
            if critical:
                self.worker.broadcast_params(owned, self.rows[owned], step=step, critical=True)
                self._all_critical_step = step
            else:
                asked = np.isin(owned, self._take_requests())
                marked = self.critical[owned]
                lossy, reliable = owned[~asked & ~marked], owned[asked | marked]
                if len(lossy):
                    self.worker.broadcast_params(lossy, self.rows[lossy], step=step)
                if len(reliable):
                    self.worker.broadcast_params(reliable, self.rows[reliable], step=step, critical=True)
                    self.stats.resends_served += int(asked.sum())
        marker = np.array([MARKER_CHUNK_BASE + self.worker.worker_id])
        self.worker.broadcast_params(
            marker, np.array([[float(len(owned))]], np.float32), step=step, critical=True
        )
        self._published_step = step

    def _take_requests(self) -> np.ndarray:
        requests = self.worker.param_requests
        if not requests:
            return np.empty(0, dtype=np.int64)
        ids = np.fromiter(requests, dtype=np.int64, count=len(requests))
        requests.clear()
        ids = ids[ids < self.layout.n_chunks]
        return ids[self.layout.owners[ids] == self.worker.worker_id]

    def _respond(self) -> None:
        """Called by the transport as PARAM_REQs arrive: resend at once the requested owned chunks that
        are critical (all of them after a critical publish, until the next publish). The other requests
        wait for :meth:`_serve_requests` or the next publish, as before."""
        requests = self.worker.param_requests
        if self.reserve and requests:
            self._answer_reserve_requests(requests)
        if self._published_step < 0 or not requests:
            return
        ids = np.fromiter(requests, dtype=np.int64, count=len(requests))
        ids = ids[ids < self.layout.n_chunks]
        ids = ids[self.layout.owners[ids] == self.worker.worker_id]
        if self._all_critical_step != self._published_step and not self.retrieve:
            ids = ids[self.critical[ids]]
        if len(ids):
            requests.difference_update(ids.tolist())
            self.worker.broadcast_params(ids, self.rows[ids], step=self._published_step, critical=True)
            self.stats.resends_served += len(ids)

    def _serve_requests(self) -> None:
        if self._published_step < 0 or not self.worker.param_requests:
            return
        ids = self._take_requests()
        if len(ids):
            self.worker.broadcast_params(ids, self.rows[ids], step=self._published_step, critical=True)
            self.stats.resends_served += len(ids)

    # ---- receiver side ---------------------------------------------------------------------------
    def collect(self, step: int, *, require_all: bool = False) -> np.ndarray:
        """Take in what the owners published for ``step``; returns the foreign chunks that are fresh.

        Waits until every other owner's end marker for ``step`` is in (or the deadline passes) and every
        copy this receiver requested earlier has arrived; ``require_all`` waits for every chunk (after a
        critical publish), and every critical chunk for ``step`` (asking its owner again for those still
        missing once the owner's marker is in or the deadline passed). Meanwhile serves other receivers'
        requests for owned chunks. Raises TimeoutError past ``resend_timeout_s``."""
        t0 = time.perf_counter()
        deadline, give_up = t0 + self.deadline_s, t0 + self.resend_timeout_s
        last_request = t0
        last_required_request = -np.inf
        # Exact runs (TransportConfig.exact) serve requests only when they publish: a copy resent from
        # inside collect holds this step's values or the next one's, depending on when the request came.
        # Retrieval's requests are all for this step, whose values are the same whenever served. A
        # replicated receiver drops a copy of an earlier step than it collects: a request (made when a
        # step is accounted) answered at once would carry the step its receiver has just left.
        serve = self.retrieve or not (self.worker.config.exact or self.replicated)
        required = self.foreign if require_all or self.retrieve else self.critical_foreign
        self._asked[:] = False
        last_reserve_request = -np.inf
        reservers = np.zeros(self.worker.n_workers, dtype=bool)  # re-servers this receiver waits on
        while True:
            self._absorb(step)
            if serve:
                self._serve_requests()
            self._awaiting &= self.held_step <= self._awaiting_above
            # An owner the transport presumes dead publishes nothing and steps nothing: its shard's
            # copies are as current as they can be, so none of them is waited for or requested. So is
            # one that has sent nothing for this step one liveness timeout into the wait; and so is a
            # re-server this receiver waits on that stays silent as long.
            self._give_up_silent(step, t0, reservers)
            dead = self._dead_owners()
            self._awaiting &= ~dead[self.layout.owners]
            # Every dead owner's shard is served again by one survivor (its re-server); the others
            # wait until they hold its copy, so that every survivor holds the same one.
            self._reserve_dead_shards(dead)
            unserved, reservers = self._unserved(dead)
            awaiting = np.flatnonzero(self._awaiting)
            missing_required = required[
                (self.held_step[required] < step) & ~dead[self.layout.owners[required]]
            ]
            live = self.others[~dead[self.others]]
            if require_all:
                done = len(missing_required) == 0
            else:
                done = bool(np.all(self._marker_step[live] >= step)) and len(awaiting) == 0
                done &= len(missing_required) == 0
            done &= len(unserved) == 0
            if done:
                break
            now = time.perf_counter()
            idle = len(awaiting) == 0 and len(missing_required) == 0 and len(unserved) == 0
            if not require_all and idle and now >= deadline:
                self.stats.markers_missed += int(np.sum(self._marker_step[live] < step))
                break
            if len(unserved) and now - last_reserve_request >= _REREQUEST_S:
                self._request_reserve(unserved, step)
                last_reserve_request = now
            if len(missing_required) and now - last_required_request >= _REREQUEST_S:
                # Lost on the way (the owner's marker, sent after them, is in) or late (the deadline).
                owner_done = self._marker_step[self.layout.owners[missing_required]] >= step
                ask = missing_required if now >= deadline else missing_required[owner_done]
                if len(ask):
                    self.worker.request_params(ask, step=step)
                    self.stats.critical_requests += len(ask)
                    if self.retrieve:  # the cost of retrieval: each lost copy asked for once
                        self.stats.resend_requests += int(np.count_nonzero(~self._asked[ask]))
                        self._asked[ask] = True
                    last_required_request = now
            if now >= give_up:
                missing = awaiting if len(awaiting) else unserved
                missing = missing if len(missing) else self.foreign[self.held_step[self.foreign] < step]
                owners = sorted({int(w) for w in self.layout.owners[missing]})
                host, port = self.worker.switch_addr
                raise TimeoutError(
                    f"worker {self.worker.worker_id}: chunks {missing[:8].tolist()} (owners {owners}) "
                    f"did not arrive within {self.resend_timeout_s:.0f} s at step {step}; are those workers "
                    f"alive and still calling step()? (switch {host}:{port})"
                )
            if len(awaiting) and now - last_request >= _REREQUEST_S:
                self.worker.request_params(awaiting, step=step)
                last_request = now
            bounded = require_all or len(awaiting) or len(missing_required) or len(unserved)
            self._wait_readable(0.01 if bounded else min(0.01, max(deadline - now, 0.0)))
        self.stats.wait_s += time.perf_counter() - t0
        return self._account(step)

    def _dead_owners(self) -> np.ndarray:
        """Bool per worker: presumed dead by the transport (absent from a whole window of RESULTs), or
        given up by this exchange (:meth:`_give_up_silent`)."""
        mask = self.worker.deadlines.presumed_dead
        bits = np.array([mask >> w & 1 for w in range(self.worker.n_workers)], dtype=bool)
        return bits | self._given_up

    def _give_up_silent(self, step: int, since: float, reservers: np.ndarray | None = None) -> None:
        """Presume dead every owner whose end marker for ``step`` is not in and from whom nothing (no
        copy, no marker) has come for ``liveness_timeout_s`` since ``since`` (the start of the wait);
        and every re-server in ``reservers`` (bool per worker: this receiver waits for its copy of a
        dead owner's shard) from whom nothing, not even a relayed heartbeat, has come as long: a live
        one answers at once from inside its transport, so the next rank in order serves instead.

        The transport's own presumption needs a whole window of RESULTs without the owner's bit, and
        an owner killed after its reduce and before its publish leaves none: its bit is in every
        RESULT of the reduce, and its peers then wait here, in no reduce. A live owner sends its
        marker right after its reduce (its optimizer's step in between) and answers requests at once
        from inside the transport; one silent for the liveness timeout is what the switch's liveness
        monitor (hostlib/liveness.py) marks offline, lowering the job's quorum, so that the next
        reduce closes without it. Its shard is then treated as a presumed-dead owner's: not waited for
        from it, not aged, served again by its re-server. A copy or marker of its clears it."""
        now = time.perf_counter()
        heard = np.maximum(self._heard_at, since)
        quiet = (self._marker_step < step) & (now - heard >= self.liveness_timeout_s)
        if reservers is not None and reservers.any():
            heard = np.maximum(heard, self.worker.deadlines.heard_at)
            quiet |= reservers & (now - heard >= self.liveness_timeout_s)
        quiet[self.worker.worker_id] = False
        new = np.flatnonzero(quiet & ~self._given_up)
        if len(new):
            timeout = f"{self.liveness_timeout_s:.1f} s"
            why = f"sent nothing for step {step} within the liveness timeout ({timeout})"
            self._give_up(new, why)

    def _give_up(self, owners: np.ndarray, why: str) -> None:
        """Presume ``owners`` dead here (until a packet of theirs comes) and tell the transport."""
        self._given_up[owners] = True
        self.stats.owners_given_up += len(owners)
        # The transport's next reduce needs no window of RESULTs to learn it: no wait for its bit.
        self.worker.deadlines.presume_dead(owners)
        log.warning(
            "worker %d: owners %s %s: presumed dead, their shards served again by the lowest live rank",
            self.worker.worker_id,
            owners.tolist(),
            why,
        )

    # ---- a dead owner's shard, served again --------------------------------------------------------
    def _reserver(self, owner: int, dead: np.ndarray) -> int:
        """The rank that serves dead ``owner``'s shard again in this rank's view: the lowest-numbered
        rank other than the owner not presumed dead here (this rank, at worst)."""
        live = ~dead
        live[owner] = False
        live[self.worker.worker_id] = True
        return int(np.argmax(live))

    def _reserve_dead_shards(self, dead: np.ndarray) -> None:
        """Serve again, once per death, the shard of every dead owner this rank is the re-server of."""
        if not self.reserve:
            return
        self._reserving &= dead
        me = self.worker.worker_id
        for owner in np.flatnonzero(dead & ~self._reserving).tolist():
            if owner == me or self._reserver(owner, dead) != me:
                continue
            self._reserving[owner] = True
            self._whole_sent_at[owner] = time.perf_counter()
            ids = self.layout.chunks_of(owner)
            log.warning("worker %d: serving dead owner %d's shard again (%d chunks)", me, owner, len(ids))
            self._send_reserved(ids)

    def _send_reserved(self, ids: np.ndarray) -> None:
        """Send this rank's copies of dead owners' chunks ``ids`` (CRITICAL), each tagged with the step
        ``max(held, owner's last marker + 1)``: past every step its owner published (so no copy of its
        own, late, replaces it), and held here under that tag from now on."""
        if not len(ids):
            return
        owners = self.layout.owners[ids]
        tags = np.maximum(self.held_step[ids], self._marker_step[owners] + 1)
        self.held_step[ids] = tags
        own = self._reserved_by[ids] < 0
        self._reserved_by[ids[own]] = self.worker.worker_id
        for tag in np.unique(tags).tolist():
            sel = ids[tags == tag]
            self.worker.broadcast_params(sel, self.rows[sel], step=int(tag), critical=True)
        self.stats.reserved_chunks_sent += len(ids)

    def _unserved(self, dead: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chunks of dead owners that another rank re-serves and of which this receiver holds no
        re-served copy yet, and (bool per worker) the re-servers it waits on for them."""
        reservers = np.zeros(self.worker.n_workers, dtype=bool)
        if not self.reserve or not dead.any():
            return np.empty(0, dtype=np.int64), reservers
        me = self.worker.worker_id
        served_elsewhere = np.zeros(self.worker.n_workers, dtype=bool)
        for owner in np.flatnonzero(dead).tolist():
            if owner != me:
                reserver = self._reserver(owner, dead)
                served_elsewhere[owner] = reserver != me
        owners = self.layout.owners[self.foreign]
        unserved = self.foreign[served_elsewhere[owners] & (self._reserved_by[self.foreign] < 0)]
        for owner in np.unique(self.layout.owners[unserved]).tolist():
            reservers[self._reserver(owner, dead)] = True
        return unserved, reservers

    def _request_reserve(self, unserved: np.ndarray, step: int) -> None:
        """Ask for re-served copies: of an owner none of whose chunks came re-served yet, its end
        marker (PARAM_REQ of ``MARKER_CHUNK_BASE + owner``: "I gave this owner up", which makes every
        rank give it up and its re-server serve the whole shard); else the chunks still missing."""
        owners = self.layout.owners[unserved]
        whole = np.array(
            [o for o in np.unique(owners).tolist() if np.sum(owners == o) == len(self.layout.chunks_of(o))],
            dtype=np.int64,
        )
        ask = np.concatenate([MARKER_CHUNK_BASE + whole, unserved[~np.isin(owners, whole)]])
        self.worker.request_params(ask, step=step)
        self.stats.reserve_requests += len(ask)

    def _answer_reserve_requests(self, requests: set[int]) -> None:
        """Called as PARAM_REQs arrive: a request for an owner's end marker says its sender gave that
        owner up (this rank gives it up too); the re-server of a dead owner then sends the whole shard,
        and it answers requests for single chunks of dead owners it re-serves."""
        ids = np.fromiter(requests, dtype=np.int64, count=len(requests))
        me, n = self.worker.worker_id, self.worker.n_workers
        markers = ids[(ids >= MARKER_CHUNK_BASE) & (ids < MARKER_CHUNK_BASE + n)]
        named = np.unique(markers - MARKER_CHUNK_BASE)
        named = named[named != me]
        if len(markers):
            requests.difference_update(markers.tolist())
            new = named[~self._dead_owners()[named]]
            if len(new):
                self._give_up(new, "were given up by a peer")
        dead = self._dead_owners()
        serving = np.array([o != me and dead[o] and self._reserver(o, dead) == me for o in range(n)])
        whole = named[serving[named]]
        self._reserving[whole] = True
        now = time.perf_counter()
        whole = whole[now - self._whole_sent_at[whole] >= _REREQUEST_S]
        self._whole_sent_at[whole] = now
        data = ids[ids < self.layout.n_chunks]
        data = data[serving[self.layout.owners[data]]]
        if len(data):
            requests.difference_update(data.tolist())
        if len(whole):
            data = np.union1d(data, np.concatenate([self.layout.chunks_of(o) for o in whole.tolist()]))
        self._send_reserved(data)

    def adopt(self, step: int) -> None:
        """A restarted worker joins at ``step``: every copy it holds (a survivor's, taken between two
        steps) counts as that of ``step - 1``, no request is outstanding, and no copy has aged."""
        held = step - 1
        self.held_step[self.foreign] = held
        self._held_at_update = self.held_step[self.foreign].copy()
        self._awaiting[:] = False
        self._marker_step[:] = held
        self._published_step = held
        self._given_up[:] = False
        self._heard_at[:] = -np.inf
        self._reserved_by[:] = -1
        # A dead owner's copy in the replica may predate its re-serve: any re-served copy replaces it.
        self._reserved_by[self.foreign] = _ADOPTED
        self._reserving[:] = False
        self.tracker = StaleTracker(len(self.foreign), self.tracker.bound)
        self.changed = False

    def _wait_readable(self, timeout_s: float) -> None:
        readable, _, _ = select.select([self.worker.sock], [], [], timeout_s)
        if readable:
            self.worker.poll(0.0)

    def _absorb(self, step: int) -> None:
        """Move the inbox into ``rows``: every copy newer than the one held (replicated: and of ``step``
        or later; an older one would roll the receiver's replica back)."""
        self.worker.poll(0.0)
        inbox = self.worker.param_inbox
        if not len(inbox):
            return
        got = inbox.take()
        ids, steps, who = got.chunk, got.step, got.sender
        is_marker = ids >= MARKER_CHUNK_BASE
        data = ~is_marker & (ids < self.layout.n_chunks)
        owner = np.where(is_marker, ids - MARKER_CHUNK_BASE, -1)
        owner[data] = self.layout.owners[ids[data]]
        # The sender: the packet's worker_id (a survivor re-serving a dead owner's shard), else the owner.
        sender = np.where((who >= 0) & self.reserve, who, owner)
        # Whatever a rank sent proves it alive now (a given-up owner back from a stop, or restarted).
        known = (sender >= 0) & (sender < self.worker.n_workers)
        self._heard_at[sender[known]] = time.perf_counter()
        self._given_up[sender[known]] = False
        own = known & (sender == owner)
        if own.any():  # an owner heard from again: its shard's copies are its own business once more
            self._reserved_by[np.isin(self.layout.owners, np.unique(sender[own]))] = -1
        if is_marker.any():
            marker_owner = ids[is_marker] - MARKER_CHUNK_BASE
            valid = marker_owner < len(self._marker_step)
            np.maximum.at(self._marker_step, marker_owner[valid], steps[is_marker][valid])
        fresh = data.copy()
        held = self.held_step[ids[fresh]]
        # A re-served copy wins a tie of steps over the owner's own copy, and over a copy re-served
        # by a higher rank (two ranks that both took themselves for the re-server end on the lower's).
        reserved = sender[fresh] != owner[fresh]
        held_by = self._reserved_by[ids[fresh]]
        tie_won = reserved & (steps[fresh] == held) & ((held_by < 0) | (sender[fresh] < held_by))
        fresh[fresh] = (steps[fresh] > held) | tie_won | (reserved & (held_by == _ADOPTED))
        if self.replicated:
            old = fresh & (steps < step)
            self.stats.late_copies_dropped += int(old.sum())
            fresh &= ~old
        take = np.flatnonzero(fresh)
        if len(take):
            k = self.layout.elems_per_chunk
            self.rows[ids[take], :k] = got.values[take, :k]
            # (a re-served copy over an adopted one keeps the adopted step if later: nothing older counts)
            self.held_step[ids[take]] = np.maximum(steps[take], self.held_step[ids[take]])
            by = np.where(sender[take] == owner[take], -1, sender[take])
            self._reserved_by[ids[take]] = by
            self.stats.reserved_chunks_taken += int(np.count_nonzero(by >= 0))
            self.changed = True

    def _account(self, step: int) -> np.ndarray:
        held = self.held_step[self.foreign]
        fresh = held >= step
        late = (held > self._held_at_update) & ~fresh  # an older step's copy that came after its step
        if late.any():
            self.tracker.refreshed(np.flatnonzero(late))
            self.stats.late_copies += int(late.sum())
        # A presumed-dead owner's copies do not age: nobody steps its shard while it is away.
        overdue = self.tracker.update(fresh | self._dead_owners()[self.layout.owners[self.foreign]])
        self._held_at_update = held.copy()
        if len(overdue):
            ids = self.foreign[overdue]
            self._awaiting[ids] = True
            self._awaiting_above[ids] = self.held_step[ids]  # satisfied by any newer copy
            self.worker.request_params(ids, step=step)
            self.stats.resend_requests += len(ids)
        self.stats.steps += 1
        self.stats.chunks_expected += len(self.foreign)
        self.stats.chunks_fresh += int(fresh.sum())
        return self.foreign[fresh]
