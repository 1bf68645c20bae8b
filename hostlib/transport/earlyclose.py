"""LTP's Early Close for a reduce: when it stops waiting for the units that are still out.

LTP closes a transfer on two time thresholds. Before the *loss-tolerant threshold* (LT) it waits for
everything; between LT and the *deadline* (LT + C) it closes as soon as a share 1 - theta of the data is
in; at the deadline it closes whatever is missing. Here the data are a reduce's units and "in" means a
RESULT with every worker counted; closing means FLUSHing the units still open (their RESULTs bring the
partial sums back, renormalized by their counts, to every worker). Critical units are never closed.

LT is the reduce's expected completion time. Before any reduce of a length completed with every unit
full, it is LTP's initial value ``1.5 RTprop + bytes / BtlBw`` (the round trip without queueing, and the
time to serialize the reduce's frames at the bottleneck rate); afterwards it is the shortest complete
reduce of that length among the last ``history`` (LTP: "updated by the shortest 100% transmission time
during every epoch"), so a slow network raises it again once the fast samples age out. Without a rate
or a round trip measured yet there is no LT (nothing closes early).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class CloseTimes:
    """Seconds after a reduce's start: ``lt_s`` the loss-tolerant threshold, ``deadline_s`` LT + C."""

    lt_s: float = math.inf
    deadline_s: float = math.inf


class EarlyClose:
    """LT thresholds per tensor (keyed by the reduce's length), learned from completed reduces."""

    def __init__(self, theta: float, slack_ms: float, history: int = 16) -> None:
        self.theta = theta
        self.slack_s = slack_ms / 1000.0
        self.history = history
        self._complete: dict[Hashable, deque[float]] = {}

    def times(self, key: Hashable, wire_bytes: int, rtprop_s: float | None, rate_bps: float) -> CloseTimes:
        """LT and the deadline for a reduce of ``key`` that puts ``wire_bytes`` on the link."""
        done = self._complete.get(key)
        if done:
            lt = min(done)
        elif rtprop_s is not None and rate_bps > 0:
            lt = 1.5 * rtprop_s + wire_bytes * 8 / rate_bps
        else:
            return CloseTimes()
        return CloseTimes(lt, lt + self.slack_s)

    def record(self, key: Hashable, elapsed_s: float, complete: bool) -> None:
        """A reduce of ``key`` ended after ``elapsed_s``; ``complete``: every unit came back full. Only
        complete reduces say how long the whole transfer takes."""
        if complete:
            self._complete.setdefault(key, deque(maxlen=self.history)).append(elapsed_s)

    def enough_in(self, full_units: int, units: int) -> bool:
        """At least 1 - theta of the reduce's units came back with every worker counted."""
        return full_units >= math.ceil((1.0 - self.theta) * units - 1e-9)
