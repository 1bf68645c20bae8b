"""A worker's packet I/O: one UDP socket to its switch, many datagrams per system call.

Received packets land as rows of one preallocated buffer (``rx.data``) that the worker parses with
numpy; sends take rows of the plan's packet buffers as they are. :mod:`hostlib.batchio` picks UDP
segmentation offload (GSO trains out, GRO buffers in) where the kernel has it, ``recvmmsg``/``sendmmsg``
where it does not, and one call per packet where neither exists (``mode`` says which; ``LTA_IO=`` forces
one).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import numpy as np

from hostlib.batchio import BatchSocket, RxBatch, addr_key, gro_coalesces
from hostlib.protocol import HEADER_OFFSETS, SLOT_BLOCK_BITS

_RX_BUFFER_BYTES = 4 << 20  # received rows kept per call: 1024 small packets, 64 jumbo ones
_SLOT = HEADER_OFFSETS["slot"]  # byte offset of the big-endian u16 slot


class WorkerIO:
    def __init__(
        self,
        bind: tuple[str, int],
        switch_addr: tuple[str, int],
        packet_bytes: int,
        buffer_bytes: int,
        io: str | None = None,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                self.sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            self.sock.bind(bind)
            # Packets too large to share a GRO buffer are received straight into the rows (batchio).
            self.batch = BatchSocket(self.sock, io, gro=gro_coalesces(packet_bytes))
        except BaseException:
            self.sock.close()
            raise
        self.switch_key = addr_key(switch_addr)
        # A few bytes more than a packet, so a longer datagram shows up as a wrong length (ignored).
        self.rx = RxBatch.within(_RX_BUFFER_BYTES, packet_bytes + 4)
        # Set where the switch runs in this process (a self-hosted rank 0): packets go to it by this call
        # (rows in, how many it took out), not through the kernel. Its replies still come on the socket.
        self.uplink: Callable[[np.ndarray], int] | None = None

    @property
    def mode(self) -> str:
        """The packet I/O path in use (it can change once: a kernel that refuses GSO turns gso-c into
        mmsg-c, and ``batch.io_note`` says why); "local+" before it where sends go by the uplink."""
        return self.batch.io if self.uplink is None else f"local+{self.batch.io}"

    def send_rows(self, rows: np.ndarray, slots: np.ndarray | None = None) -> int:
        """Send each row (a whole packet) to the switch; returns how many went out. GSO trains never span
        two slot blocks (``SLOT_BLOCK_BITS``), so a sharded switch can steer a whole train. ``slots``: the
        rows' slot fields (int64, one per row) where the caller holds them, which spares reading them
        out of the rows (a strided gather per send)."""
        if not len(rows):
            return 0
        if self.uplink is not None:
            return self.uplink(rows)
        trains = None
        if self.batch.io == "gso-c":
            if slots is not None:
                trains = slots >> SLOT_BLOCK_BITS
            else:
                hi = rows[:, _SLOT].astype(np.int64)
                trains = (hi << 8 | rows[:, _SLOT + 1]) >> SLOT_BLOCK_BITS
        return self.batch.send_rows(rows, self.switch_key, trains)

    def recv(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for packets, then take what is queued (rows 0..n-1 of ``rx``)."""
        return self.batch.recv(self.rx, timeout_s)

    def close(self) -> None:
        self.sock.close()
