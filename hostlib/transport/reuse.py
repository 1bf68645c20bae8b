"""When a worker may start the next round of a slot: only once every live peer is provably done with the
round before it, so a peer that lost that round's RESULT can still get the switch's stored copy.

A slot keeps one round (docs/protocol.md): once unit ``g`` of the job starts round ``q + 1`` of slot
``g mod D``, the switch drops FLUSHes and GRADs of round ``q`` (unit ``g - D``) as stale, and a worker
that lost that RESULT can only give the unit up. Without a rule, a peer that got the RESULT reaches unit
``g`` about two windows later; the worker that lost it asks after one round trip, and when its FLUSH or
the answer is lost too (two copies at 20% down loss: 4%), the peer wins the race. The chunk was then
lost for good, the peer waited on a timer for the worker's blocked next GRAD of the slot, and at high
loss the workers drifted a whole reduce apart (issue 22: "100% no aggregate").

Two rules close the race, with ``D`` data slots, ``S = D - D // 2`` and ``A = D // 2`` (``S + A = D``):

* **own span**: a worker sends unit ``g`` only once its own units up to ``g - S`` are settled (answered
  or given up); every worker of the job uses the same ``S`` (it depends on the pool size alone);
* **peers**: a worker sends unit ``g`` only once every live peer ``w`` has provably settled unit
  ``g - D``. Worker ``w``'s bit in the RESULT of unit ``v`` proves it sent ``v`` (the switch counted it),
  hence, by its own span, settled every unit up to ``v - S``; and its bit in any RESULT of a reduce
  proves it settled every unit of the reduces before (a worker finishes a reduce before it starts the
  next). So unit ``g`` may go once ``w``'s bit has shown up at unit ``g - A`` or later.

A RESULT reaches every worker about one round trip after its unit was sent, so the peer rule lets a
worker keep about ``A`` units in flight (the window is no larger in practice: 255 of the 511 data slots),
and the span gives a worker that lost a RESULT ``S`` units of its own pipeline to recover it before it
stalls. A worker that has nothing in flight and is held only by this rule waits a bounded time for news
of its peers (``Deadlines.peer_hold_s``: long enough for a peer to give a unit up), then goes on without
the ones that hold it until they show progress again, but for one pool of units at most (``D`` past where
they held it; a worker that follows a peer which stopped waiting goes no further either). Without that
bound a peer late to a round (slow start-up, descheduled, its clock stepped) was locked out for good: once
the others were ``D`` units past it, every GRAD it sent was stale at the switch, so its bit could never
show again and it got no aggregate at all. Held there, the others let it reach their rounds (closed ones
answer it at once; the first round past their hold it starts itself, with its bit), and they wait for it
normally again from what its bit proves. A peer the deadlines presume dead is excused without that bound
(survivors held at different moments closed each other's rounds short); a late one falls back for the
chunks it missed, as before. The worker feeds :meth:`SlotReuse.saw` the RESULTs of later
reduces too: a late worker is then not held, pool by pool, waiting for its peers' bits in a reduce they left.
The 64-RESULT dead-peer presumption of :class:`~hostlib.transport.deadlines.Deadlines` does not start
an excuse here (a peer held up by its recovery for a few hundred ms misses that many RESULTs); it only
lifts the bound of one already given. A peer whose relayed heartbeat comes is not presumed dead; one no
longer presumed dead gets the bound back (:meth:`SlotReuse.set_presumed_dead`), so a live peer that fell
behind can reach this worker's rounds (chaos seed 32: unbounded, it never could).
"""

from __future__ import annotations

import numpy as np

from hostlib.transport.native import native_ext

_NO_LIMIT = int(np.iinfo(np.int64).max)


class SlotReuse:
    """The two rules above for one worker: what each peer has provably settled (global unit indices)."""

    def __init__(self, data_slots: int, worker_id: int, n_workers: int) -> None:
        self.data_slots = data_slots
        self.ahead = data_slots // 2  # A: units past a peer's newest counted GRAD this worker may send
        self.span = data_slots - self.ahead  # S: own units in flight lie within S of the oldest unsettled
        self.worker_id = worker_id
        # settled[w]: every unit of the job up to this global index is settled at worker w (-1: none known).
        self.settled = np.full(n_workers, -1, dtype=np.int64)
        self.sent = np.full(n_workers, -1, dtype=np.int64)  # the newest unit whose RESULT had w's bit
        self._peers = np.ones(n_workers, dtype=bool)
        self._peers[worker_id] = False
        self._excused = np.zeros(n_workers, dtype=bool)  # not waited for until they show progress
        # excused_to[w]: while w is excused, the first global unit this worker may not send all the same
        # (one pool past where w held it): the excuse lapses there, so a late w can catch up.
        self.excused_to = np.full(n_workers, -1, dtype=np.int64)
        # Peers the deadlines presume dead (absent from a window of RESULTs; the worker keeps it current):
        # excused without that bound, so survivors do not stop once a pool for a peer that never comes.
        self.presumed_dead = np.zeros(n_workers, dtype=bool)

    def set_presumed_dead(self, dead: np.ndarray) -> None:
        """The deadlines' current presumption. A peer no longer presumed dead (it was heard, or its bit
        came back) whose excuse had no bound gets the bound an excuse given now would have: one pool
        past where it holds this worker (:meth:`excuse`), so that a live peer that fell behind can
        reach this worker's rounds."""
        revived = self.presumed_dead & ~dead & self._excused & (self.excused_to == _NO_LIMIT)
        if revived.any():
            self.excused_to[revived] = self.settled[revived] + 2 * self.data_slots + 1
        self.presumed_dead = dead.copy()

    def news(self, base: int, frontier: np.ndarray, presumed_dead: int, native: bool = False) -> None:
        """:meth:`set_presumed_dead` (bit w of ``presumed_dead``: peer w), then :meth:`saw`: what a wake-up
        that brought RESULTs tells the rules. ``native``: in one call into ``hostlib._engine`` (the same
        arrays written the same way; tests/test_engine_native.py)."""
        if native:
            native_ext.peers_news(self.settled, self.sent, self._peers, self._excused, self.excused_to,
                                  self.presumed_dead, frontier, presumed_dead, base, self.span,
                                  self.data_slots)  # fmt: skip
            return
        bits = np.arange(len(self.settled), dtype=np.uint64)
        dead = (np.uint64(presumed_dead) >> bits) & np.uint64(1)
        self.set_presumed_dead(dead.astype(bool))
        self.saw(base, frontier)

    def restart_at(self, next_unit: int) -> None:
        """This worker continues at global unit ``next_unit`` (restored from a checkpoint): its peers are
        taken to have settled every unit before it, as they had when the state was saved."""
        np.maximum(self.settled, next_unit - 1, out=self.settled)

    def saw(self, base: int, frontier: np.ndarray) -> None:
        """Learn from a reduce starting at global unit ``base`` whose RESULTs showed worker ``w``'s bit at
        local unit ``frontier[w]`` at the latest (-1: not yet). A peer excused by :meth:`excuse` is
        waited for again once it shows progress."""
        seen = frontier >= 0
        if not seen.any():
            return
        np.maximum(self.sent, np.where(seen, base + frontier, -1), out=self.sent)
        proven = np.where(seen, np.maximum(base - 1, base + frontier - self.span), -1)
        if self._excused.any():  # waited for again once its own bit shows progress
            self._excused &= proven <= self.settled
        np.maximum(self.settled, proven, out=self.settled)
        # A peer whose GRAD went past where w holds this worker stopped waiting for w (or knew more of w):
        # follow it at once. Two workers held by a dead third one used to part here: the first to stop
        # waiting ran on alone, the other, still held, only ever reached units the first had flushed.
        newest = np.where(self._peers, self.sent, -1)
        top = int(np.argmax(newest))
        others = np.full(len(newest), newest[top])  # the newest unit of any peer but w itself
        newest[top] = -1  # (a copy: np.where made it) the newest of the peers but top itself
        others[top] = newest.max()
        follow = self._peers & (others > self.settled + self.data_slots)
        if follow.any():  # as far as that peer's own excuse (or one unit past its newest GRAD)
            reach = np.maximum(self.settled + 2 * self.data_slots + 1, others + 1)
            reach[self.presumed_dead] = _NO_LIMIT
            self.excused_to[follow] = np.maximum(self.excused_to[follow], reach[follow])
            self._excused |= follow

    def limit(self) -> tuple[int, np.ndarray]:
        """The first global unit this worker may not send yet, and the peers that hold it there (a bool
        mask)."""
        if not self._peers.any():
            return _NO_LIMIT, self._peers.copy()
        bound = np.where(self._excused, self.excused_to, self.settled + self.data_slots + 1)
        first = int(bound[self._peers].min())
        return first, self._peers & (bound == first)

    def first(self, native: bool = False) -> int:
        """:meth:`limit`'s first unit alone (``native``: in one call into ``hostlib._engine``)."""
        if native:
            return int(native_ext.reuse_first(self.settled, self._excused, self.excused_to, self._peers,
                                              self.data_slots))  # fmt: skip
        return self.limit()[0]

    def excuse(self, peers: np.ndarray) -> None:
        """Stop waiting for ``peers`` until they show progress (:meth:`saw`), for one pool of units at most:
        past that this worker waits for them again (and may excuse them again)."""
        peers = peers & self._peers
        hold = np.where(self._excused, self.excused_to, self.settled + self.data_slots + 1)
        self.excused_to[peers] = np.where(self.presumed_dead, _NO_LIMIT, hold + self.data_slots)[peers]
        self._excused |= peers
