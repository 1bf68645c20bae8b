"""A switch played by hand in a test: one UDP socket, its packets read and answered one at a time, for a
worker of a two-worker job whose peer never sends (the answers count both)."""

from __future__ import annotations

import socket

import numpy as np

from hostlib.protocol import HEADER_BYTES, HEADER_DTYPE, Flag, Op


class HandSwitch:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(10.0)
        self.address = self.sock.getsockname()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> HandSwitch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def recv(self, op: Op) -> tuple[np.ndarray, tuple]:
        """The next packet of ``op`` (others are read and dropped) and its sender."""
        while True:
            data, addr = self.sock.recvfrom(65536)
            pkt = np.frombuffer(data, dtype=np.uint8).copy()
            if pkt[1] == op:
                return pkt, addr

    def answer(self, pkt: np.ndarray, addr: tuple, flags: int, count: int = 2) -> None:
        """``pkt`` sent back as the RESULT of a round both workers contributed to: a max (flag MAX) is the
        proposal itself, a sum twice the payload."""
        hdr = pkt[:HEADER_BYTES].view(HEADER_DTYPE)
        hdr["op"], hdr["flags"], hdr["count"], hdr["bitmap"] = int(Op.RESULT), flags, count, 0b11
        if not flags & Flag.MAX:  # a sum of two equal contributions
            payload = pkt[HEADER_BYTES:].view(">i4")
            payload *= 2
        self.sock.sendto(pkt.tobytes(), addr)

    def exponent_then_data(self) -> tuple[np.ndarray, tuple]:
        """Answer the worker's exponent unit at once, then return its first data GRAD (the exponent's
        copies skipped) and its sender; the data round's RESULT is the caller's to send, or not."""
        exp, addr = self.recv(Op.GRAD)
        self.answer(exp, addr, int(Flag.MAX))
        data, _ = self.recv(Op.GRAD)
        while data[:HEADER_BYTES].view(HEADER_DTYPE)["flags"][0] & Flag.MAX:  # a copy of the exponent
            data, _ = self.recv(Op.GRAD)
        return data, addr
