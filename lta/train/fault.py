"""``lta train --kill-worker RANK@STEP --restart-after S``: a worker dies mid-training and comes back.

What happens, in order (the parent drives it; ``FaultDriver`` is its state machine):

1. When the run reaches STEP, the parent SIGKILLs worker RANK's process. Its heartbeat stops with it.
2. The survivors go on. Until the liveness monitor (``hostlib.liveness``, on the parent's softswitch)
   marks the worker offline, every round waits its deadline for the dead worker's packets and closes on
   a FLUSH; once it is marked (``--liveness-timeout`` without a packet), the job's quorum drops to the live
   count and rounds close as soon as the survivors' packets are in. The survivors' transports presume
   the worker dead (absent from 64 RESULTs) and their parameter exchange stops waiting for its shard,
   which nobody steps while its owner is away (the survivors keep their copies of it).
3. S seconds after the kill the parent starts a new process for RANK. Once it is up, the survivors pause
   before a common step t and hand over their state; the new worker binds the dead one's address, takes a
   survivor's parameter copy and counters (and its own optimizer shard from the run's last checkpoint,
   when ``--checkpoint-every`` saves them; a fresh optimizer state otherwise), and everyone resumes at t.
   Its heartbeat has meanwhile brought the quorum back to N.

``FaultDriver.report()`` gives the timeline and the step times of each phase (results.json ``fault``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PAUSE_MARGIN_STEPS = 5  # the survivors pause this many steps after the last one the parent has seen


@dataclass(frozen=True)
class FaultPlan:
    rank: int
    step: int
    restart_after_s: float = 10.0
    liveness_timeout_s: float = 1.5


def parse_kill(text: str) -> tuple[int, int]:
    """``"RANK@STEP"`` -> (rank, step); ValueError with the expected form otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*@\s*(\d+)\s*", text)
    if match is None:
        raise ValueError(f"expected RANK@STEP (e.g. 2@100), got {text!r}")
    return int(match.group(1)), int(match.group(2))


@dataclass
class FaultDriver:
    """The parent's side of one faulty run: when to kill, restart, pause, hand over and resume."""

    plan: FaultPlan
    n_workers: int
    state: str = "armed"  # armed -> dead -> spawning -> pausing -> joining -> resumed
    killed_at: float | None = None
    offline_at: float | None = None
    online_at: float | None = None
    spawned_at: float | None = None
    resumed_at: float | None = None
    join_step: int | None = None
    handovers: dict[int, dict[str, Any]] = field(default_factory=dict)
    step_times: list[tuple[float, int]] = field(default_factory=list)  # (time, step) of the progress rank
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def progress_rank(self) -> int:
        """The rank whose steps the parent follows: 0, or 1 when 0 is the one killed."""
        return 1 if self.plan.rank == 0 else 0

    @property
    def survivors(self) -> list[int]:
        return [r for r in range(self.n_workers) if r != self.plan.rank]

    def note(self, what: str, **details: Any) -> None:
        self.events.append({"at": time.perf_counter(), "event": what, **details})

    def report(self, t0: float) -> dict[str, Any]:
        """Timeline (seconds from the run's start) and median step time of each phase."""

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 3)

        times = np.array([t for t, _ in self.step_times])
        steps = np.array([s for _, s in self.step_times])

        def phase_ms(lo: float | None, hi: float | None) -> float | None:
            if lo is None or hi is None or len(times) < 2:
                return None
            inside = (times[1:] >= lo) & (times[1:] < hi) & (np.diff(steps) == 1)
            gaps = np.diff(times)[inside]
            return None if not len(gaps) else round(float(np.median(gaps)) * 1000, 2)

        end = float(times[-1]) if len(times) else None
        settled = None if self.offline_at is None else self.offline_at + 2.0
        return {
            "rank": self.plan.rank,
            "kill_step": self.plan.step,
            "restart_after_s": self.plan.restart_after_s,
            "liveness_timeout_s": self.plan.liveness_timeout_s,
            "killed_s": rel(self.killed_at),
            "offline_s": rel(self.offline_at),
            "detect_s": None
            if self.offline_at is None or self.killed_at is None
            else round(self.offline_at - self.killed_at, 3),
            "spawned_s": rel(self.spawned_at),
            "online_s": rel(self.online_at),
            "resumed_s": rel(self.resumed_at),
            "join_step": self.join_step,
            "step_ms": {
                "before_kill": phase_ms(t0, self.killed_at),
                "dead_undetected": phase_ms(self.killed_at, self.offline_at),
                "dead_detected": phase_ms(self.offline_at, self.spawned_at),
                "dead_detected_after_2s": phase_ms(settled, self.spawned_at),
                "after_rejoin": phase_ms(self.resumed_at, end),
            },
            "events": [{**e, "at": rel(e["at"])} for e in self.events],
        }
