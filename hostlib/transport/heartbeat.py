"""The worker's heartbeat: one HEARTBEAT packet to the switch every ``heartbeat_interval_s``, from a
daemon thread, so the switch's per-worker counter (``WORKER_COUNTER``) keeps moving while the worker
computes and sends nothing else. The liveness monitor (``hostlib.liveness``) marks a worker offline
when that counter stops; a process that dies stops its heartbeat with it.

Each beat also sends one PARAM of chunk ``ALIVE_CHUNK`` (CRITICAL), which the switch relays to every
other worker (``hostlib.protocol``): the peers learn that this worker is alive even when none of its
GRADs is counted (chaos seed 32: a rank behind a burst of lost RESULTs was missing from a whole window
of RESULTs, presumed dead, and its peers ran on without bound so that it never got back in). A worker
that is its own leaf (``TransportConfig.own_leaf``) sends no relay: the spine would replicate it to the
leaves, which relay nothing across levels anyway, under its leaf id, which its peers would take for a
worker's.

The relayed PARAM's ``bitmap`` field carries ``progress()``, the worker's settled unit counter (every unit
below it answered or given up; the switch relays a PARAM unchanged): a peer stopped past this worker's
last RESULT it could buffer learns from it that its stale units' slots moved on (docs/protocol.md, "The
relayed heartbeat").

The packets are built once; each beat is one ``sendto`` each on the worker's own socket (a UDP send is
atomic, so it interleaves safely with the transport's sends from the training thread). They carry the
job's K payload values (all zero) because a switch accepts only packets of the job's size.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable

from hostlib.protocol import ALIVE_CHUNK, HEADER_OFFSETS, Flag, Op, make_packet

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        sock: socket.socket,
        switch_addr: tuple[str, int],
        *,
        job_id: int,
        worker_id: int,
        elems_per_packet: int,
        interval_s: float,
        relay: bool = True,
        progress: Callable[[], int] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"heartbeat interval must be > 0 s, got {interval_s}")
        self.sock, self.switch_addr, self.interval_s = sock, switch_addr, interval_s
        self.packet = make_packet(
            Op.HEARTBEAT, job_id=job_id, worker_id=worker_id, elems_per_packet=elems_per_packet, nelem=0
        )
        self.progress = progress
        self.relay = (
            bytearray(
                make_packet(
                    Op.PARAM,
                    job_id=job_id,
                    worker_id=worker_id,
                    elems_per_packet=elems_per_packet,
                    nelem=0,
                    chunk=ALIVE_CHUNK,
                    flags=int(Flag.CRITICAL),
                )
            )
            if relay
            else None
        )
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lta-heartbeat-{worker_id}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                self.sock.sendto(self.packet, self.switch_addr)
                if self.relay is not None:
                    if self.progress is not None:
                        struct.pack_into(">Q", self.relay, HEADER_OFFSETS["bitmap"], self.progress())
                    self.sock.sendto(self.relay, self.switch_addr)
                self.sent += 1
            except OSError as exc:  # closed socket (shutting down) or a transient send error
                if self._stop.is_set() or self.sock.fileno() < 0:
                    return
                log.debug("heartbeat send failed: %s", exc)
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
