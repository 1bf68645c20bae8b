"""The parameter server as a UDP daemon: batches of packets in, PARAM packets out, windows on time.

One socket and one thread, as the softswitch's daemon: each wake-up takes every queued datagram in one
system call (:mod:`hostlib.batchio`), runs them through :class:`~softswitch.ps.core.ParameterServer`,
closes the synchronous windows whose ``max_wait_s`` passed, and sends the replies in one call per batch.
Workers are told apart by their UDP source address.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import numpy as np

from hostlib.batchio import MAX_DATAGRAM, BatchSocket, RxBatch
from softswitch.ps.config import PsJobConfig
from softswitch.ps.core import ParameterServer
from softswitch.ps.job import OutRows, PsJob
from softswitch.server import BackgroundServer

log = logging.getLogger(__name__)

_RX_BUFFER_BYTES = 8 << 20
_IDLE_WAIT_S = 0.05  # the longest a receive waits while no window has a deadline


class PsServer(BackgroundServer):
    """``PsServer(listen).start()``: serve the jobs added with :meth:`add_job` from a background thread."""

    thread_name = "ps-server"

    def __init__(
        self,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        *,
        seed: int = 0,
        io: str | None = None,
        buffer_bytes: int = 32 << 20,
        log_pushes: bool = False,
    ) -> None:
        self.core = ParameterServer(seed, log_pushes=log_pushes)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        try:
            self.sock.bind(listen)
        except OSError as exc:
            self.sock.close()
            raise OSError(
                f"parameter server cannot listen on {listen[0]}:{listen[1]}: {exc.strerror}"
            ) from exc
        self.batch = BatchSocket(self.sock, io)
        self.address: tuple[str, int] = self.sock.getsockname()
        self.send_errors = 0
        super().__init__()

    def add_job(self, cfg: PsJobConfig) -> PsJob:
        return self.core.add_job(cfg)

    def close(self) -> None:
        self.sock.close()

    def stats(self) -> dict[str, object]:
        return self.core.stats()

    def job_stats(self, job_id: int) -> dict[str, Any]:
        return self.core.job_stats(job_id)

    def snapshot(self, job_id: int) -> tuple[int, np.ndarray | None]:
        return self.core.snapshot(job_id)

    def _row_bytes(self) -> int:
        longest = max((job.packet_bytes for job in list(self.core.jobs.values())), default=MAX_DATAGRAM)
        return min(MAX_DATAGRAM + 1, longest + 64)  # a longer datagram arrives too long: malformed

    def serve_forever(self) -> None:
        rx, row_bytes = None, 0
        while not self._stop.is_set():
            want = self._row_bytes()
            if rx is None or want != row_bytes:
                row_bytes = want
                rx = RxBatch.within(_RX_BUFFER_BYTES, row_bytes)
            deadline = self.core.next_deadline()
            wait = (
                _IDLE_WAIT_S if deadline is None else min(_IDLE_WAIT_S, max(deadline - time.monotonic(), 0.0))
            )
            try:
                n = self.batch.recv(rx, wait if wait > 0 else 0.0)
            except OSError:
                if self._stop.is_set():
                    return
                raise
            now = time.monotonic()
            out = self.core.process(rx.data, rx.lens, rx.keys, n, now) if n else []
            out.extend(self.core.tick(now))
            self._send(out)

    def _send(self, out: list[OutRows]) -> None:
        by_width: dict[int, list[OutRows]] = {}
        for rows, keys in out:
            known = keys >= 0  # a worker whose address was never seen cannot be answered
            if known.any():
                by_width.setdefault(rows.shape[1], []).append((rows[known], keys[known]))
        for width, parts in by_width.items():
            rows = np.concatenate([r for r, _ in parts]) if len(parts) > 1 else parts[0][0]
            keys = np.concatenate([k for _, k in parts]) if len(parts) > 1 else parts[0][1]
            sent = self.batch.send(rows, width, keys)
            self.send_errors += len(rows) - sent
