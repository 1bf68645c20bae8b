"""The softswitch as a UDP aggregation server: batches of packets in, the pipeline's replies out.

Runs in a background thread (``SoftSwitchServer.start()``, what tests and ``lta train`` use) or in the
foreground (``lta softswitch --listen HOST:PORT``). Workers are identified by their UDP source address,
which plays the role of the ingress port (as an int key, ``hostlib.batchio.addr_key``).

Each wake-up takes every queued datagram in one system call (GRO trains cut into rows, or ``recvmmsg``; see
:mod:`hostlib.batchio`), runs them through :meth:`SoftSwitch.process_batch` as one batch (the native engine),
and sends the replies in one call, each destination's as GSO trains: the per-packet cost is the kernel's
and C's, not Python's.

Every worker's window of datagrams in flight lands in the switch's receive buffer at once. An unprivileged
process gets at most ``net.core.rmem_max`` (4 MiB on a stock kernel) per socket, so ``sockets`` > 1 binds a
group of that many sockets to the one address (``SO_REUSEPORT``) with a classic BPF program that steers each
datagram to socket ``worker_id mod sockets`` (read from the LTA header): each has its own buffer, one worker's
packets stay in order in one of them, and the one serving thread polls them all.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Self

import numpy as np

from hostlib.batchio import MAX_DATAGRAM, BatchSocket, RxBatch
from softswitch import reuseport
from softswitch.batch import OutBatch
from softswitch.pipeline import SoftSwitch
from softswitch.reuseport import MAX_GROUP

log = logging.getLogger(__name__)

_RX_BUFFER_BYTES = 8 << 20  # receive rows per call: 1024 small packets, or 128 of 64 KiB
MAX_SOCKETS = MAX_GROUP


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
        sockets: int = 1,
        gro: bool = True,
    ) -> None:
        """``gro``: receive with ``UDP_GRO`` (trains of small datagrams as one buffer); False for a switch
        whose jobs all send datagrams too large to coalesce (``hostlib.batchio.gro_coalesces``), which
        are then received straight into the rows."""
        program = reuseport.worker_program(sockets) if sockets > 1 else None
        try:
            group = reuseport.bind_group(listen, sockets, program, buffer_bytes, force=True)
        except OSError as exc:
            if sockets == 1 or "cannot listen" in str(exc):
                raise
            log.info("softswitch: no group of %d sockets on %s:%d (%s): one socket", sockets, *listen, exc)
            group = reuseport.bind_group(listen, 1, None, buffer_bytes, force=True)
        self._serve_on(switch, group, io, gro)

    def _serve_on(
        self, switch: SoftSwitch, group: list[socket.socket], io: str | None, gro: bool = True
    ) -> None:
        """Serve ``switch`` on ``group``, bound sockets (one, or a steered reuseport group)."""
        self.switch = switch
        self.socks = group
        self.sock = group[0]
        # What the kernel grants each socket (twice the usable bytes, as Linux reports it): the windows of
        # the workers steered to one socket land there at once, so a self-hosted job sizes the windows to
        # it (rendezvous.py, with ``sockets``).
        self.rcvbuf_bytes: int = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self.sockets = len(group)
        self.batches = [BatchSocket(sock, io, gro=gro) for sock in group]
        self.io = self.batches[0].io  # the packet I/O path in use (gso-c, mmsg-c, mmsg-ctypes or plain)
        self.address: tuple[str, int] = self.sock.getsockname()
        self.send_errors = 0
        self.rx_datagrams = [0] * self.sockets  # datagrams received, per socket
        self.local_datagrams = 0  # datagrams a worker of this process handed in (local_port)
        # One batch through the pipeline and its replies out at a time: the serving thread's, or one that
        # a worker of this process handed in (the OutBatch lives in buffers the next batch reuses).
        self._pipeline = threading.Lock()
        # CPU seconds the serving thread used (receiving, the pipeline, sending), set when it ends: what a
        # switch costs per reduce (lta bench scaling) without a clock read per batch.
        self.cpu_s = 0.0
        BackgroundServer.__init__(self)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()

    def _row_bytes(self) -> int:
        """Receive rows a little longer than the longest packet of any job, so that a longer datagram
        arrives with a wrong length (dropped as malformed) instead of passing for a good one."""
        longest = self.switch.longest_payload
        return min(MAX_DATAGRAM + 1, (MAX_DATAGRAM if longest is None else longest) + 64)

    def serve_forever(self) -> None:
        try:
            self._serve_loop()
        finally:
            self.cpu_s = time.thread_time()

    def _serve_loop(self) -> None:
        rx, row_bytes = None, 0
        poller = select.poll()
        for sock in self.socks:
            poller.register(sock.fileno(), select.POLLIN)
        index = {sock.fileno(): i for i, sock in enumerate(self.socks)}
        while not self._stop.is_set():
            want = self._row_bytes()
            if rx is None or want != row_bytes:
                row_bytes = want
                rx = RxBatch.within(_RX_BUFFER_BYTES, row_bytes)
            try:
                if self.sockets == 1:
                    self._serve_batch(0, rx, 0.1)
                    continue
                # Sockets holding datagrams already taken from the kernel first, then what poll finds.
                ready = [i for i, b in enumerate(self.batches) if b.pending]
                if not ready:
                    ready = [index[fd] for fd, _ in poller.poll(100)]
                for i in ready:
                    self._serve_batch(i, rx, 0)
            except OSError:
                if self._stop.is_set():
                    return
                raise

    def _serve_batch(self, i: int, rx: RxBatch, timeout_s: float) -> None:
        """One receive call on socket ``i`` (waiting up to ``timeout_s``), through the pipeline, and the
        replies out of the same socket (every socket of the group has the switch's address)."""
        batch = self.batches[i]
        n = batch.recv(rx, timeout_s)
        if not n:
            return
        self.rx_datagrams[i] += n
        with self._pipeline:
            self._send_out(batch, self.switch.process_batch(rx.data, rx.lens, rx.keys, n))

    def _send_out(self, batch: BatchSocket, out: OutBatch) -> None:
        if not out.m:
            return
        m = out.m
        if out.index is None:
            sent = batch.send(out.data[:m], out.lens[:m], out.egress[:m])
        else:  # replicas share their RESULT's row
            sent = batch.send(out.data, out.lens[:m], out.egress[:m], out.index[:m])
        # A replica that found no room or a worker that went away (ICMP unreachable) is lost,
        # as on a wire; the worker's deadlines recover it.
        self.send_errors += m - sent

    def local_port(self, key: int) -> Callable[[np.ndarray], int]:
        """For a worker in this process whose UDP address is ``key`` (:func:`hostlib.batchio.addr_key`, as
        its job lists it): a function that takes its packets (rows of a uint8 matrix, each a datagram of
        the row's width), runs them through the pipeline in the caller's thread as if they had arrived
        from that address, sends the replies out of the switch's socket and returns how many it took (0
        once the server stopped). The datagrams skip the kernel's two copies (the worker's send and the
        switch's receive) and the serving thread's wake-up; the replies still travel as datagrams."""
        # Its own send state: the serving thread receives on the socket meanwhile.
        tx = BatchSocket(self.sock, self.io, gro=False)
        lens = np.zeros(0, dtype=np.int64)
        ports = np.zeros(0, dtype=np.int64)

        def deliver(rows: np.ndarray) -> int:
            nonlocal lens, ports
            n = len(rows)
            if not n or self._stop.is_set():
                return 0
            if len(lens) < n:
                lens = np.zeros(max(n, 2 * len(lens)), dtype=np.int64)
                ports = np.full(len(lens), key, dtype=np.int64)
            lens[:n] = rows.shape[1]
            with self._pipeline:
                self.local_datagrams += n
                self._send_out(tx, self.switch.process_batch(rows, lens, ports, n))
            return n

        return deliver
