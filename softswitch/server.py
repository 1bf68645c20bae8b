"""The softswitch as a UDP aggregation server: one socket, batches of packets in, the pipeline's replies out.

Runs in a background thread (``SoftSwitchServer.start()``, what tests and ``lta train`` use) or in the
foreground (``lta softswitch --listen HOST:PORT``). Workers are identified by their UDP source address,
which plays the role of the ingress port (as an int key, ``hostlib.batchio.addr_key``).

Each wake-up takes every queued datagram in one system call (GRO trains cut into rows, or ``recvmmsg``; see
:mod:`hostlib.batchio`), runs them through :meth:`SoftSwitch.process_batch` as one batch (the native engine),
and sends the replies in one call, each destination's as GSO trains: the per-packet cost is the kernel's
and C's, not Python's.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Self

from hostlib.batchio import MAX_DATAGRAM, BatchSocket, RxBatch
from softswitch.pipeline import SoftSwitch

log = logging.getLogger(__name__)

_RX_BUFFER_BYTES = 8 << 20  # receive rows per call: 1024 small packets, or 128 of 64 KiB
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux's number; Python names it from 3.12


def _force_receive_buffer(sock: socket.socket, buffer_bytes: int) -> None:
    """Raise the receive buffer past ``net.core.rmem_max`` where the process may (CAP_NET_ADMIN).

    The switch's one socket takes every worker's window at once: with 64 KiB datagrams and the usual
    rmem_max of a few MiB, 4 workers overflowed it on loopback (measured: ~90 datagrams dropped per
    FSDP2 step, each costing a deadline and a FLUSH, at 0% emulated loss). Without the capability the
    buffer stays what SO_RCVBUF gave, and the workers' windows shrink to it instead."""
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 2 * buffer_bytes:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, buffer_bytes)
    except OSError:  # PermissionError without CAP_NET_ADMIN; not Linux
        pass


class BackgroundServer:
    r"""What every serving loop here shares: ``start()`` runs :meth:`serve_forever` in a daemon thread
    named ``thread_name``, ``stop()`` sets ``_stop`` (the loop checks it at least every 0.1 s), joins
    the thread and :meth:`close`\s; also a context manager. Subclasses call ``super().__init__()``
    and define ``serve_forever`` and ``close``."""

    thread_name = "lta-server"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        self._thread = threading.Thread(target=self.serve_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SoftSwitchServer(BackgroundServer):
    thread_name = "softswitch"

    def __init__(
        self,
        switch: SoftSwitch,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        buffer_bytes: int = 32 << 20,
        io: str | None = None,
    ) -> None:
        self.switch = switch
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        _force_receive_buffer(self.sock, buffer_bytes)
        # What the kernel grants (twice the usable bytes, as Linux reports it): every worker's window
        # of datagrams in flight lands here, so a self-hosted job sizes the windows to it (rendezvous.py).
        self.rcvbuf_bytes: int = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        try:
            self.sock.bind(listen)
        except OSError as exc:
            self.sock.close()
            raise OSError(f"softswitch cannot listen on {listen[0]}:{listen[1]}: {exc.strerror}") from exc
        self.batch = BatchSocket(self.sock, io)
        self.io = self.batch.io  # the packet I/O path in use (gso-c, mmsg-c, mmsg-ctypes or plain)
        self.address: tuple[str, int] = self.sock.getsockname()
        self.send_errors = 0
        super().__init__()

    def close(self) -> None:
        self.sock.close()

    def _row_bytes(self) -> int:
        """Receive rows a little longer than the longest packet of any job, so that a longer datagram
        arrives with a wrong length (dropped as malformed) instead of passing for a good one."""
        longest = max((job.payload_bytes for job in list(self.switch.jobs.values())), default=MAX_DATAGRAM)
        return min(MAX_DATAGRAM + 1, longest + 64)

    def serve_forever(self) -> None:
        rx, row_bytes = None, 0
        while not self._stop.is_set():
            want = self._row_bytes()
            if rx is None or want != row_bytes:
                row_bytes = want
                rx = RxBatch.within(_RX_BUFFER_BYTES, row_bytes)
            try:
                n = self.batch.recv(rx, 0.1)
            except OSError:
                if self._stop.is_set():
                    return
                raise
            if not n:
                continue
            out = self.switch.process_batch(rx.data, rx.lens, rx.keys, n)
            if out.m:
                m = out.m
                if out.index is None:
                    sent = self.batch.send(out.data[:m], out.lens[:m], out.egress[:m])
                else:  # replicas share their RESULT's row
                    sent = self.batch.send(out.data, out.lens[:m], out.egress[:m], out.index[:m])
                # A replica that found no room or a worker that went away (ICMP unreachable) is lost,
                # as on a wire; the worker's deadlines recover it.
                self.send_errors += m - sent
