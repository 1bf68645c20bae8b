"""Worker liveness: mark a worker offline when the switch stops hearing from it, and move the job's
quorum with the live set.

The signal is the switch's per-worker packet counter (``WORKER_COUNTER``: every packet that passed the
worker check, GRAD, FLUSH, PARAM and HEARTBEAT alike). A worker sends a HEARTBEAT every
``heartbeat_interval_s`` (0.5 s by default, ``TransportConfig``) besides its traffic, so a counter that has
not moved for ``timeout_s`` means the worker is gone (a crash, a kill, a cut link), not busy computing.
Offline detection therefore takes between ``timeout_s`` and ``timeout_s`` + one poll interval after the
last packet (plus at most one heartbeat interval after the worker stopped).

Silence counts only while the switch hears the job's other workers: a worker is offline once it has
been silent for ``timeout_s`` *up to the last packet of any worker*, and a stretch longer than
twice ``timeout_s`` in which the switch heard nobody is not counted at all (shorter lulls are: a
sparse reader cannot tell them from a worker's death). When no counter moves, the
switch (or the process that runs it and this monitor: the embedded softswitch shares a process with rank
0) was not reading packets, or every worker stopped at once; neither is a worker's death, and lowering
the quorum then closed the next rounds with one contribution each. On a host loaded well past its
cores, the embedded switch's process was descheduled for 8 s and the monitor marked all four workers
offline (quorum 1).

While workers are offline the job's quorum is ``min(configured quorum, live workers)``, so rounds close as
soon as every live worker has contributed instead of waiting for each unit's deadline and FLUSH; when an
offline worker's counter moves again (it restarted and sends), it is online and the quorum goes back up.
The monitor works on anything with ``read_worker_rx(job_id, n_workers)`` and
``set_quorum(job_id, quorum)``: an :class:`~controlplane.switch.LtaSwitch` (BMv2, the softswitch's
P4Runtime server) or an in-process :class:`~softswitch.pipeline.SoftSwitch`. ``lta ctl liveness`` runs it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 3.0
DEFAULT_POLL_S = 0.25


class LivenessTarget(Protocol):
    def read_worker_rx(self, job_id: int, n_workers: int) -> list[int]: ...

    def set_quorum(self, job_id: int, quorum: int) -> Any: ...


@dataclass(frozen=True)
class LivenessEvent:
    at: float  # the monitor's clock (time.monotonic by default)
    job_id: int
    worker: int
    state: str  # "offline" or "online"
    quorum: int  # the job's quorum after the event
    silent_s: float  # how long the worker had been silent when it was marked (0 for "online")

    def describe(self) -> str:
        if self.state == "offline":
            return (
                f"job {self.job_id}: worker {self.worker} offline (silent {self.silent_s:.1f} s); "
                f"quorum {self.quorum}"
            )
        return f"job {self.job_id}: worker {self.worker} online again; quorum {self.quorum}"


class LivenessMonitor:
    """Polls one job's per-worker counters; ``poll()`` once, or ``start()`` a background thread."""

    def __init__(
        self,
        target: LivenessTarget,
        job_id: int,
        n_workers: int,
        *,
        quorum: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        poll_s: float = DEFAULT_POLL_S,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[LivenessEvent], None] | None = None,
    ) -> None:
        if timeout_s <= 0 or poll_s <= 0:
            raise ValueError("timeout_s and poll_s must be > 0")
        if not 1 <= (quorum or n_workers) <= n_workers:
            raise ValueError(f"quorum must be in 1..{n_workers}, got {quorum}")
        self.target, self.job_id, self.n_workers = target, job_id, n_workers
        self.quorum = quorum or n_workers  # the configured quorum, restored when all are back
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.clock, self.on_event = clock, on_event
        now = clock()
        # Everyone starts online, as if heard now: a worker that never sends is offline after timeout_s.
        self.counts = list(target.read_worker_rx(job_id, n_workers))
        self.last_heard = [now] * n_workers
        self.last_any = now  # when the switch last heard any worker of the job
        self.online = [True] * n_workers
        self.current_quorum = self.quorum
        self.events: list[LivenessEvent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def offline(self) -> list[int]:
        """The workers marked offline now. Read under the poll's lock, so a change seen here comes with its
        event in ``events`` and the quorum it set (a poll marks a worker, sets the quorum, then records the
        event: read between the two, a returned worker showed online while its event was not recorded
        yet)."""
        with self._lock:
            return [w for w in range(self.n_workers) if not self.online[w]]

    def poll(self) -> list[LivenessEvent]:
        """Read the counters once; mark workers offline / online; set the quorum if it changes."""
        with self._lock:
            counts = self.target.read_worker_rx(self.job_id, self.n_workers)
            now = self.clock()
            events = []
            if counts != self.counts:
                gap = now - self.last_any
                if gap > 2 * self.timeout_s:  # nobody was heard for this long: the switch did not read
                    self.last_heard = [min(now, t + gap) for t in self.last_heard]
                self.last_any = now
            for w, count in enumerate(counts):
                if count != self.counts[w]:
                    self.counts[w], self.last_heard[w] = count, now
                    if not self.online[w]:
                        self.online[w] = True
                        events.append((w, "online", 0.0))
                elif self.online[w] and self.last_any - self.last_heard[w] > self.timeout_s:
                    self.online[w] = False
                    events.append((w, "offline", now - self.last_heard[w]))
            if not events:
                return []
            quorum = max(1, min(self.quorum, sum(self.online)))
            if quorum != self.current_quorum:
                self.target.set_quorum(self.job_id, quorum)
                self.current_quorum = quorum
            out = [LivenessEvent(now, self.job_id, w, state, quorum, silent) for w, state, silent in events]
            self.events.extend(out)
        for event in out:
            if self.on_event is None:  # nobody reports events: the log does (a warning, on stderr)
                log.warning("%s", event.describe())
            else:  # the receiver reports it (lta ctl liveness prints it): once is enough
                log.info("%s", event.describe())
                self.on_event(event)
        return out

    def status(self) -> list[dict[str, Any]]:
        """Per worker: state, packets counted, seconds since the counter last moved."""
        with self._lock:
            now = self.clock()
            return [
                {
                    "worker": w,
                    "state": "online" if self.online[w] else "offline",
                    "packets": self.counts[w],
                    "silent_s": round(now - self.last_heard[w], 3),
                }
                for w in range(self.n_workers)
            ]

    # ---- background thread -------------------------------------------------------------------------
    def start(self) -> LivenessMonitor:
        self._thread = threading.Thread(target=self._run, name=f"lta-liveness-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except KeyError:  # the job was removed from the switch: nothing left to watch
                return
            except Exception:  # a failed read must not end monitoring silently
                log.exception("liveness poll of job %d failed", self.job_id)

    def stop(self, restore_quorum: bool = False) -> None:
        """Stop the thread; with ``restore_quorum`` put the configured quorum back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if restore_quorum and self.current_quorum != self.quorum:
            self.target.set_quorum(self.job_id, self.quorum)
            self.current_quorum = self.quorum

    def __enter__(self) -> LivenessMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
