"""The switch's UDP sockets: receive buffers past ``net.core.rmem_max`` where allowed, and reuseport groups.

A reuseport group is N UDP sockets with ``SO_REUSEPORT`` bound, in order, to one HOST:PORT; the group
numbers its sockets in bind order (socket i has index i). A classic BPF program attached to the group
(``SO_ATTACH_REUSEPORT_CBPF``) picks the socket of each datagram: for UDP the kernel runs it with the
data starting at the UDP payload, i.e. at the LTA header, and delivers the datagram to the socket whose
index it returns (a load past the end ends the program with 0: socket 0). Two programs steer here:

* by slot block, ``(slot >> SLOT_BLOCK_BITS) % N``: the shard processes of ``lta softswitch --shards``
  (:mod:`softswitch.shards`), each serving a share of the slots;
* by worker, ``worker_id % N``: the receive sockets of one :class:`~softswitch.server.SoftSwitchServer`,
  each with its own kernel buffer, so that N workers' windows in flight need not share one
  ``net.core.rmem_max`` (4 MiB on a stock kernel, where the process may not raise it).

A worker's UDP GSO train is steered whole by its first datagram: every datagram of it carries the same
worker id, and a train never spans two slot blocks (``hostlib.transport.io``).

Linux only; IPv4, like :mod:`hostlib.batchio`.
"""

from __future__ import annotations

import ctypes
import socket
import struct

from hostlib.protocol import HEADER_OFFSETS, SLOT_BLOCK_BITS

SO_ATTACH_REUSEPORT_CBPF = getattr(socket, "SO_ATTACH_REUSEPORT_CBPF", 51)  # <asm-generic/socket.h>
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux's number; Python names it from 3.12
MAX_GROUP = 64

# Classic BPF opcodes (<linux/filter.h>).
_BPF_LD_B_ABS = 0x00 | 0x10 | 0x20  # BPF_LD | BPF_B | BPF_ABS
_BPF_LD_H_ABS = 0x00 | 0x08 | 0x20  # BPF_LD | BPF_H | BPF_ABS
_BPF_ALU_AND_K = 0x04 | 0x50 | 0x00  # BPF_ALU | BPF_AND | BPF_K
_BPF_ALU_MOD_K = 0x04 | 0x90 | 0x00  # BPF_ALU | BPF_MOD | BPF_K
_BPF_ALU_RSH_K = 0x04 | 0x70 | 0x00  # BPF_ALU | BPF_RSH | BPF_K
_BPF_RET_A = 0x06 | 0x10  # BPF_RET | BPF_A

Program = list[tuple[int, int, int, int]]  # (code, jt, jf, k) instructions


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


def _check_size(n: int, what: str) -> None:
    if not 1 <= n <= MAX_GROUP:
        raise ValueError(f"{what} must be in 1..{MAX_GROUP}, got {n}")


def _mod(n: int) -> tuple[int, int, int, int]:
    return (_BPF_ALU_AND_K, 0, 0, n - 1) if n & (n - 1) == 0 else (_BPF_ALU_MOD_K, 0, 0, n)


def slot_program(n: int) -> Program:
    """``(slot >> SLOT_BLOCK_BITS) % n`` (slot: the big-endian u16 of the LTA header)."""
    _check_size(n, "shards")
    block = (_BPF_ALU_RSH_K, 0, 0, SLOT_BLOCK_BITS)
    return [(_BPF_LD_H_ABS, 0, 0, HEADER_OFFSETS["slot"]), block, _mod(n), (_BPF_RET_A, 0, 0, 0)]


def worker_program(n: int) -> Program:
    """``worker_id % n`` (worker_id: the u8 of the LTA header)."""
    _check_size(n, "sockets")
    return [(_BPF_LD_B_ABS, 0, 0, HEADER_OFFSETS["worker_id"]), _mod(n), (_BPF_RET_A, 0, 0, 0)]


def attach_program(sock: socket.socket, program: Program) -> None:
    """Attach ``program`` to the reuseport group of ``sock`` (any member; it applies to all)."""
    prog = (_SockFilter * len(program))(*(_SockFilter(*i) for i in program))
    fprog = struct.pack("@HP", len(program), ctypes.addressof(prog))  # struct sock_fprog
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)
    except OSError as exc:
        raise OSError(f"cannot attach the steering program (SO_ATTACH_REUSEPORT_CBPF): {exc}") from exc


def force_receive_buffer(sock: socket.socket, buffer_bytes: int) -> None:
    """Raise the receive buffer past ``net.core.rmem_max`` where the process may (CAP_NET_ADMIN).

    A switch socket takes the windows of every worker it serves at once: with 64 KiB datagrams and the
    usual rmem_max of a few MiB, 4 workers overflowed one on loopback (measured: ~90 datagrams dropped
    per FSDP2 step, each costing a deadline and a FLUSH, at 0% emulated loss). Without the capability
    the buffer stays what SO_RCVBUF gave."""
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 2 * buffer_bytes:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, buffer_bytes)
    except OSError:  # PermissionError without CAP_NET_ADMIN; not Linux
        pass


def bind_group(
    listen: tuple[str, int],
    n: int,
    program: Program | None = None,
    buffer_bytes: int = 32 << 20,
    *,
    force: bool = False,
) -> list[socket.socket]:
    """``n`` UDP sockets bound to ``listen`` (port 0: one free port for all), with send and receive
    buffers of ``buffer_bytes`` (``force``: past rmem_max where allowed). ``n`` > 1: a reuseport group,
    bound in order so that socket i has group index i, with ``program`` (returning 0..n-1) attached.
    Raises OSError naming the address (closing what it opened) when the port is taken, or the group or
    its program cannot be made."""
    _check_size(n, "sockets")
    if n > 1 and program is None:
        raise ValueError("a group of sockets needs a steering program")
    host, port = listen
    socks: list[socket.socket] = []
    if n > 1:
        if not hasattr(socket, "SO_REUSEPORT"):
            raise OSError("a group of sockets on one port needs SO_REUSEPORT (Linux)")
        if port:
            # SO_REUSEPORT would let our sockets join a group someone else (another softswitch of this
            # user) already has on the port, and the kernel would split the packets between the two. A
            # plain bind fails on any port in use, reuseport group or not.
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                try:
                    probe.bind((host, port))
                except OSError as exc:
                    raise OSError(f"softswitch cannot listen on {host}:{port}: {exc.strerror}") from exc
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            socks.append(sock)
            if n > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            if force:
                force_receive_buffer(sock, buffer_bytes)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise OSError(f"softswitch cannot listen on {host}:{port}: {exc.strerror}") from exc
            port = sock.getsockname()[1]
        if n > 1 and program is not None:
            attach_program(socks[0], program)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks
