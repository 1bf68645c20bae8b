"""Batched UDP datagram I/O: many datagrams per system call, straight into and out of numpy buffers.

``BatchSocket`` wraps a bound IPv4 UDP socket. ``recv`` fills the rows of a preallocated ``RxBatch``
(payload bytes, length and source address key per row) with as many queued datagrams as fit;
``send`` sends the rows of a byte matrix, each to its own (or one common) destination. Addresses travel
as integer keys, ``(IPv4 address << 16) | port`` (``addr_key`` / ``key_addr``), so that a batch's
addresses are one int64 array, not a list of tuples.

Four interchangeable paths (``IO_MODES``), all with the same results:

``gso-c``
    segmentation offload, through the C extension: equal-size datagrams to one destination leave as one
    ``sendmmsg`` message carrying ``UDP_SEGMENT`` (up to 64 or 128 datagrams, probed), which the kernel or
    the NIC cuts into datagrams; the socket has ``UDP_GRO`` set, so the kernel hands a train of datagrams
    from one source over as one buffer, which the extension cuts back into rows by its segment size
    (``gro=False``: one datagram per message, straight into the rows, for datagrams too large for two to
    share a buffer: ``gro_coalesces``). On
    loopback a train stays one buffer from sender to receiver. Where the kernel refuses (no ``UDP_GRO``:
    the socket starts as ``mmsg-c``; a GSO send refused with EINVAL/EIO: the socket sends ``mmsg-c`` from
    then on), ``io`` names the path taken and ``io_note`` says why.
``mmsg-c``
    the C extension ``hostlib._batchio`` (``hostlib/_batchio.c``, built by ``pip install -e .`` when a
    compiler is there): Linux ``recvmmsg``/``sendmmsg`` with the message headers filled in C, GIL released.
``mmsg-ctypes``
    the same system calls through ctypes on libc; the headers are numpy structured arrays allocated once
    and rewritten column-wise (one numpy operation per field per call, no per-datagram Python objects).
``plain``
    ``recvfrom_into`` / ``sendto`` loops: one system call and a few Python objects per datagram. Works
    wherever Python does.

``BatchSocket(sock)`` takes the first available in ``_PREFERENCE`` (measured with
``python -m lta.bench.batchio_micro``); ``io=`` or the environment variable ``LTA_IO`` forces one.

A ``BatchSocket`` may receive in one thread while it sends in another; two threads must not send (or
receive) on the same one at once, and an ``RxBatch`` serves one ``recv`` at a time.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import select
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hostlib.extras import optional_extension

log = logging.getLogger(__name__)

IO_MODES = ("gso-c", "mmsg-c", "mmsg-ctypes", "plain")
# Default order, fastest first. `python -m lta.bench.batchio_micro`, loopback, 292-byte datagrams, 2-core
# x86_64 VM, microseconds per datagram send / recv:
#   64 per call:      mmsg-c 2.7 / 0.89   mmsg-ctypes 2.7 / 1.0   plain 4.0 / 2.1
#   1 per call:       mmsg-c 5.5 / 2.4    mmsg-ctypes 12.4 / 12.2  plain 10.8 / 4.4
#   empty recv call:  mmsg-c 1.2          mmsg-ctypes 3.4          plain 1.8
# Sending is mostly the kernel's loopback path, so the modes differ less there. ctypes matches C from about
# 16 datagrams per call, but its numpy column writes cost ~7-10 us more per call, so with only a few
# datagrams per call plain beats it; it stays second because batches are the point of this module.
_PREFERENCE = ("gso-c", "mmsg-c", "mmsg-ctypes", "plain")
ENV_VAR = "LTA_IO"
MAX_DATAGRAM = 65507  # the largest UDP payload over IPv4
_GRO_BUFFER_BYTES, _GRO_HEADROOM = 65536, 64  # a coalesced receive: one 64 KiB skb, headers included
DEFAULT_STALL_TIMEOUT_S = 1.0  # send: how long "no room in the socket" is waited out before giving up

_MAX_VLEN = 1024  # UIO_MAXIOV: the kernel clamps recvmmsg/sendmmsg to this many messages per call
_MAX_REFUSED_RETRIES = 64
_ENOBUFS_SLEEP_S = 1e-4
_POLLOUT_SLICE_MS = 100
_KEY_CACHE_MAX = 4096

_SKIP_ERRNOS = frozenset(
    e
    for e in (
        errno.ECONNREFUSED,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        getattr(errno, "EHOSTDOWN", None),
        errno.ENETDOWN,
        errno.EMSGSIZE,
        errno.EPERM,
        errno.EACCES,
        errno.EADDRNOTAVAIL,
    )
    if e is not None
)
_ROOM_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.ENOMEM})
_SLEEP_ERRNOS = frozenset({errno.ENOBUFS, errno.ENOMEM})  # POLLOUT would not wait for these

# ---------------------------------------------------------------------------------------------------
# Address keys


def gro_coalesces(datagram_bytes: int) -> bool:
    """Whether two datagrams of ``datagram_bytes`` fit one GRO buffer: a 64 KiB skb, less room for its
    headers (Linux 6.x on loopback coalesces pairs of up to 32,746 bytes; this says yes up to 32,736).
    Larger ones arrive one per buffer, so a ``UDP_GRO`` receive of them only adds a copy (the kernel
    writes a staging buffer that the extension then cuts into rows): a socket that takes only such
    datagrams is better built with ``gro=False``, which receives straight into the rows. Either way every
    datagram arrives as sent; this decides speed, not correctness."""
    return 2 * datagram_bytes + _GRO_HEADROOM <= _GRO_BUFFER_BYTES


def addr_key(addr: tuple[str, int]) -> int:
    """``(host, port)`` of an IPv4 address (dotted quad) -> ``(address as u32 << 16) | port``."""
    host, port = addr[0], int(addr[1])
    try:
        packed = socket.inet_pton(socket.AF_INET, host)
    except (OSError, TypeError) as exc:
        raise ValueError(f"not an IPv4 address written as a dotted quad: {host!r}") from exc
    if not 0 <= port <= 0xFFFF:
        raise ValueError(f"port out of range: {port}")
    return (int.from_bytes(packed, "big") << 16) | port


def key_addr(key: int) -> tuple[str, int]:
    """The inverse of ``addr_key``."""
    key = int(key)
    if not 0 <= key < 1 << 48:
        raise ValueError(f"not an IPv4 address key: {key}")
    return socket.inet_ntop(socket.AF_INET, (key >> 16).to_bytes(4, "big")), key & 0xFFFF


# ---------------------------------------------------------------------------------------------------
# Statistics

_STAT_FIELDS = (
    "syscalls_send",
    "syscalls_recv",
    "packets_sent",
    "packets_received",
    "send_errors",
    "recv_truncated",
    "send_waits",
    "gso_trains_sent",
    "gro_trains_received",
)
(
    _SYSCALLS_SEND,
    _SYSCALLS_RECV,
    _PACKETS_SENT,
    _PACKETS_RECEIVED,
    _SEND_ERRORS,
    _RECV_TRUNCATED,
    _SEND_WAITS,
    _GSO_TRAINS_SENT,
    _GRO_TRAINS_RECEIVED,
) = range(len(_STAT_FIELDS))


def _counter(index: int) -> property:
    return property(lambda self: int(self.counts[index]) + self.py[index])


class BatchStats:
    """Counters of one ``BatchSocket``: the sum of ``counts``, the int64 array the C extension adds to, and
    ``py``, the list the Python paths add to (cheaper than numpy scalar updates).

    syscalls_* count recv/send system calls (polls and sleeps not included); send_errors counts datagrams
    given up (unreachable, too big, or no room for the stall timeout); recv_truncated counts datagrams
    longer than an ``RxBatch`` row (the mmsg paths only: ``recvfrom_into`` does not tell); send_waits
    counts waits for room in the socket or the device queue; gso_trains_sent / gro_trains_received count
    GSO messages of two or more datagrams sent and coalesced buffers of two or more received (``gso-c``).
    """

    __slots__ = ("counts", "py")
    FIELDS = _STAT_FIELDS

    syscalls_send = _counter(_SYSCALLS_SEND)
    syscalls_recv = _counter(_SYSCALLS_RECV)
    packets_sent = _counter(_PACKETS_SENT)
    packets_received = _counter(_PACKETS_RECEIVED)
    send_errors = _counter(_SEND_ERRORS)
    recv_truncated = _counter(_RECV_TRUNCATED)
    send_waits = _counter(_SEND_WAITS)
    gso_trains_sent = _counter(_GSO_TRAINS_SENT)
    gro_trains_received = _counter(_GRO_TRAINS_RECEIVED)

    def __init__(self) -> None:
        self.counts = np.zeros(len(_STAT_FIELDS), dtype=np.int64)
        self.py = [0] * len(_STAT_FIELDS)

    def as_dict(self) -> dict[str, int]:
        return {k: c + p for k, c, p in zip(_STAT_FIELDS, self.counts.tolist(), self.py, strict=True)}

    def reset(self) -> None:
        self.counts[:] = 0
        self.py[:] = [0] * len(_STAT_FIELDS)

    def __repr__(self) -> str:
        return f"BatchStats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"


# ---------------------------------------------------------------------------------------------------
# Which paths exist here


def _check_counters(module: Any) -> None:
    if module.STAT_COUNT != len(_STAT_FIELDS):
        raise ImportError(f"it has {module.STAT_COUNT} counters, batchio {len(_STAT_FIELDS)}: rebuild it")


_cext: Any  # the module, or None: the "mmsg-c" path is chosen only when it loaded
_cext, _CEXT_MISSING = optional_extension("hostlib._batchio", _check_counters)


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _Msghdr), ("msg_len", ctypes.c_uint)]


class _SockaddrIn(ctypes.Structure):
    _fields_ = [
        ("sin_family", ctypes.c_ushort),
        ("sin_port", ctypes.c_uint16),
        ("sin_addr", ctypes.c_uint32),
        ("sin_zero", ctypes.c_ubyte * 8),
    ]


def _struct_dtype(fields: dict[str, tuple[str, int]], itemsize: int) -> np.dtype:
    """A numpy structured dtype over a C struct: {field: (numpy format, byte offset)}, total size."""
    return np.dtype(
        {
            "names": list(fields),
            "formats": [fmt for fmt, _ in fields.values()],
            "offsets": [offset for _, offset in fields.values()],
            "itemsize": itemsize,
        }
    )


_PTR = np.dtype(np.uintp).str
_MM_DTYPE = _struct_dtype(
    {
        "msg_name": (_PTR, _Msghdr.msg_name.offset),
        "msg_namelen": ("=u4", _Msghdr.msg_namelen.offset),
        "msg_iov": (_PTR, _Msghdr.msg_iov.offset),
        "msg_iovlen": (_PTR, _Msghdr.msg_iovlen.offset),
        "msg_flags": ("=i4", _Msghdr.msg_flags.offset),
        "msg_len": ("=u4", _Mmsghdr.msg_len.offset),
    },
    ctypes.sizeof(_Mmsghdr),
)
_IOV_DTYPE = _struct_dtype(
    {"iov_base": (_PTR, _Iovec.iov_base.offset), "iov_len": (_PTR, _Iovec.iov_len.offset)},
    ctypes.sizeof(_Iovec),
)
# sin_port and sin_addr are in network byte order: numpy swaps on assignment.
_SA_DTYPE = _struct_dtype(
    {
        "sin_family": ("=u2", _SockaddrIn.sin_family.offset),
        "sin_port": (">u2", _SockaddrIn.sin_port.offset),
        "sin_addr": (">u4", _SockaddrIn.sin_addr.offset),
    },
    ctypes.sizeof(_SockaddrIn),
)
_MM_SIZE = _MM_DTYPE.itemsize
_SIXTEEN = np.int64(16)


def _load_libc() -> tuple[Callable[..., int] | None, Callable[..., int] | None, str]:
    if not sys.platform.startswith("linux"):
        return None, None, f"recvmmsg/sendmmsg are Linux system calls (this is {sys.platform})"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        recvmmsg, sendmmsg = libc.recvmmsg, libc.sendmmsg
    except (OSError, AttributeError) as exc:
        return None, None, f"libc has no recvmmsg/sendmmsg ({exc})"
    recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    recvmmsg.restype = ctypes.c_int
    sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    sendmmsg.restype = ctypes.c_int
    return recvmmsg, sendmmsg, ""


_recvmmsg, _sendmmsg, _CTYPES_MISSING = _load_libc()
_MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0x40)
_MSG_TRUNC = getattr(socket, "MSG_TRUNC", 0x20)

_MISSING = {"gso-c": _CEXT_MISSING, "mmsg-c": _CEXT_MISSING, "mmsg-ctypes": _CTYPES_MISSING, "plain": ""}

SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
UDP_GRO = getattr(socket, "UDP_GRO", 104)
_GSO_SEGMENT_LIMITS = (128, 64)  # UDP_MAX_SEGMENTS: 64 before Linux 6.x raised it to 128
GRO_MESSAGES = 128  # coalesced buffers (64 KiB each) taken per recvmmsg on a gso-c socket
_gso_probed: list[int] = []  # [segments per GSO message] once probed; [0] where the kernel has no GSO/GRO


def gso_max_segments() -> int:
    """How many datagrams one GSO message may carry on this kernel (128 or 64), 0 where UDP GSO/GRO is
    missing. Probed once, on loopback: a ``UDP_GRO`` socket and one GSO message of that many segments."""
    if not _gso_probed:
        _gso_probed.append(_probe_gso())
        if not _gso_probed[0] and not _MISSING["gso-c"]:
            _MISSING["gso-c"] = "the kernel refuses UDP_SEGMENT or UDP_GRO on loopback"
    return _gso_probed[0]


def _probe_gso() -> int:
    if _cext is None or not sys.platform.startswith("linux"):
        return 0
    try:
        with (
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx,
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx,
        ):
            rx.bind(("127.0.0.1", 0))
            rx.setsockopt(SOL_UDP, UDP_GRO, 1)
            for segs in _GSO_SEGMENT_LIMITS:
                try:
                    tx.sendmsg(
                        [bytes(8 * segs)],
                        [(SOL_UDP, UDP_SEGMENT, (8).to_bytes(2, sys.byteorder))],
                        0,
                        rx.getsockname(),
                    )
                except OSError:
                    continue
                return segs
    except OSError:
        return 0
    return 0


def available_modes() -> tuple[str, ...]:
    """The I/O modes that work here, in the default order (the first is what ``BatchSocket`` picks)."""
    gso_max_segments()
    return tuple(m for m in _PREFERENCE if not _MISSING[m])


def _resolve_io(io: str | None) -> str:
    source = "io="
    if io is None:
        io = os.environ.get(ENV_VAR, "").strip() or None
        source = f"{ENV_VAR}="
    if io is None or io == "auto":
        return available_modes()[0]
    if io not in IO_MODES:
        raise ValueError(f"{source}{io!r} is not an I/O mode; expected one of {', '.join(IO_MODES)} or auto")
    if io == "gso-c":
        gso_max_segments()
    if _MISSING[io]:
        raise ValueError(f"{source}{io}: this I/O mode is not available here: {_MISSING[io]}")
    return io


# ---------------------------------------------------------------------------------------------------
# Message header vectors (mmsg-ctypes)


class _MsgVec:
    """``capacity`` mmsghdr/iovec/sockaddr_in triples; message i points at iovec i and sockaddr i."""

    __slots__ = (
        "mm",
        "iov",
        "sa",
        "addr",
        "idx",
        "msg_len",
        "msg_flags",
        "iov_base",
        "iov_len",
        "sin_addr",
        "sin_port",
        "filled",
    )

    def __init__(self, capacity: int) -> None:
        self.mm = np.zeros(capacity, dtype=_MM_DTYPE)
        self.iov = np.zeros(capacity, dtype=_IOV_DTYPE)
        self.sa = np.zeros(capacity, dtype=_SA_DTYPE)
        self.addr: int = self.mm.ctypes.data
        self.idx = np.arange(capacity, dtype=np.uintp)
        self.mm["msg_iov"] = self.iov.ctypes.data + self.idx * _IOV_DTYPE.itemsize
        self.mm["msg_iovlen"] = 1
        self.mm["msg_name"] = self.sa.ctypes.data + self.idx * _SA_DTYPE.itemsize
        self.mm["msg_namelen"] = _SA_DTYPE.itemsize
        self.sa["sin_family"] = socket.AF_INET
        self.msg_len = self.mm["msg_len"]
        self.msg_flags = self.mm["msg_flags"]
        self.iov_base = self.iov["iov_base"]
        self.iov_len = self.iov["iov_len"]
        self.sin_addr = self.sa["sin_addr"]
        self.sin_port = self.sa["sin_port"]
        # send: what messages 0..n-1 already hold, so that a call like the last one rewrites nothing:
        # [(first row address, row stride), n, (scalar length), n, (scalar key), n]
        self.filled: list[Any] = [None, 0, None, 0, None, 0]

    def keys_into(self, out: np.ndarray, n: int) -> None:
        """Source address keys of messages 0..n-1 into ``out[:n]``."""
        keys = out[:n]
        keys[...] = self.sin_addr[:n]
        np.left_shift(keys, _SIXTEEN, out=keys)
        np.bitwise_or(keys, self.sin_port[:n], out=keys)

    def set_dests(self, keys: np.ndarray | int, n: int) -> None:
        """Destinations of messages 0..n-1 from one key or n keys."""
        self.sin_addr[:n] = keys >> 16
        self.sin_port[:n] = keys & 0xFFFF


# ---------------------------------------------------------------------------------------------------
# Receive buffers


class RxBatch:
    """Preallocated receive buffers, reused across ``BatchSocket.recv`` calls.

    After ``n = sock.recv(rx)``, rows 0..n-1 are valid: ``data[i, :lens[i]]`` is datagram i and
    ``keys[i]`` its source (``key_addr`` turns it back into ``(host, port)``). A datagram longer than
    ``max_bytes`` is truncated to it. The arrays are fixed for the batch's lifetime (the mmsg paths keep
    pointers into them); write into them, don't rebind them.
    """

    __slots__ = ("_data", "_lens", "_keys", "_vec", "_rows", "_scratch")

    def __init__(self, capacity: int, max_bytes: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not 1 <= max_bytes <= 1 << 20:
            raise ValueError(f"max_bytes must be in 1..{1 << 20}, got {max_bytes}")
        self._data = np.zeros((capacity, max_bytes), dtype=np.uint8)  # calloc: pages appear when used
        self._lens = np.zeros(capacity, dtype=np.int64)
        self._keys = np.zeros(capacity, dtype=np.int64)
        self._vec: _MsgVec | None = None
        self._rows: list[memoryview] | None = None
        self._scratch: np.ndarray | None = None

    @classmethod
    def within(cls, budget_bytes: int, max_bytes: int) -> RxBatch:
        """As many rows of ``max_bytes`` as ``budget_bytes`` holds, between 16 and the 1024 datagrams the
        kernel hands over per ``recvmmsg`` (1024 small packets, or a few dozen of 64 KiB)."""
        return cls(max(16, min(_MAX_VLEN, budget_bytes // max_bytes)), max_bytes)

    @property
    def data(self) -> np.ndarray:
        return self._data

    @property
    def lens(self) -> np.ndarray:
        return self._lens

    @property
    def keys(self) -> np.ndarray:
        return self._keys

    @property
    def capacity(self) -> int:
        return self._data.shape[0]

    @property
    def max_bytes(self) -> int:
        return self._data.shape[1]

    def row(self, i: int) -> np.ndarray:
        """Datagram i's bytes (a view)."""
        return self._data[i, : self._lens[i]]

    def _msgvec(self) -> _MsgVec:
        if self._vec is None:
            vec = _MsgVec(self.capacity)
            vec.iov_base[:] = self._data.ctypes.data + vec.idx * self.max_bytes
            vec.iov_len[:] = self.max_bytes
            self._vec = vec
        return self._vec

    def _c_scratch(self) -> np.ndarray:
        if self._scratch is None:
            self._scratch = np.zeros(_cext.scratch_bytes(self.capacity), dtype=np.uint8)
        return self._scratch

    def _row_views(self) -> list[memoryview]:
        if self._rows is None:
            self._rows = [row.data for row in self._data]
        return self._rows


# ---------------------------------------------------------------------------------------------------
# Argument normalisation


def _as_rows(data: Any) -> np.ndarray:
    if not isinstance(data, np.ndarray):
        data = np.frombuffer(memoryview(data), dtype=np.uint8)
    if data.ndim == 1:
        data = data.reshape(1, -1)
    if data.ndim != 2 or data.dtype.itemsize != 1:
        raise ValueError(f"data must be (m, width) bytes, got shape {data.shape} of {data.dtype}")
    if data.dtype != np.uint8:
        data = data.view(np.uint8)
    if (data.shape[1] > 1 and data.strides[1] != 1) or data.strides[0] < 0:
        data = np.ascontiguousarray(data)
    return data


def _as_ints(values: Any, m: int, what: str, int32_ok: bool) -> np.ndarray | int:
    if isinstance(values, int | np.integer):
        return int(values)
    arr = np.asarray(values)
    if arr.ndim == 0 and arr.dtype.kind in "iu":
        return int(arr)
    if arr.shape != (m,) or arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be an int or {m} ints, got shape {arr.shape} of {arr.dtype}")
    if arr.dtype == np.int64 or (int32_ok and arr.dtype == np.int32):
        return np.ascontiguousarray(arr)
    return arr.astype(np.int64)


def _check_ranges(lens: np.ndarray | int, keys: np.ndarray | int, width: int) -> None:
    """What the C extension checks per row, for the Python paths: rows stay inside data, keys are keys."""
    lo, hi = (lens, lens) if isinstance(lens, int) else (int(lens.min()), int(lens.max()))
    if lo < 0 or hi > width:
        raise ValueError(f"datagram lengths must be in 0..{width} (the row width), got {lo}..{hi}")
    lo, hi = (keys, keys) if isinstance(keys, int) else (int(keys.min()), int(keys.max()))
    if lo < 0 or hi >= 1 << 48:
        raise ValueError(f"address keys must be in 0..2**48-1 (see addr_key), got {lo}..{hi}")


def _wait_ms(seconds: float) -> int:
    return max(1, min(math.ceil(seconds * 1000.0), 2**31 - 1))


# ---------------------------------------------------------------------------------------------------
# The socket


class BatchSocket:
    """A bound IPv4 UDP socket that receives into ``RxBatch`` rows and sends byte matrices, in batches."""

    def __init__(
        self,
        sock: socket.socket,
        io: str | None = None,
        *,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        gro: bool = True,
    ) -> None:
        if sock.family != socket.AF_INET or sock.type != socket.SOCK_DGRAM:
            raise ValueError("BatchSocket needs an AF_INET SOCK_DGRAM (IPv4 UDP) socket")
        self.io: str = _resolve_io(io)
        self.io_note = ""  # why io is not what was asked for (the kernel refused GSO or GRO), or ""
        self.sock = sock
        sock.setblocking(False)
        self._fd = sock.fileno()
        self.stats = BatchStats()
        self._gro: np.ndarray | None = None
        self._gso_segs = 0
        if self.io == "gso-c" and gro:
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
            except OSError as exc:
                self.io = "mmsg-c"
                self.io_note = f"UDP_GRO refused ({os.strerror(exc.errno or 0)}): mmsg-c"
                log.warning("BatchSocket: %s", self.io_note)
            else:
                self._gso_segs = gso_max_segments()
                self._gro = np.zeros(_cext.gro_staging_bytes(GRO_MESSAGES), dtype=np.uint8)
                _cext.gro_staging_init(self._gro, GRO_MESSAGES)
        self.stall_timeout_s = stall_timeout_s
        self._rpoll = select.poll()
        self._rpoll.register(self._fd, select.POLLIN)
        self._wpoll = select.poll()
        self._wpoll.register(self._fd, select.POLLOUT)
        self._tx_vec: _MsgVec | None = None
        self._key_cache: dict[tuple[str, int], int] = {}
        self._addr_cache: dict[int, tuple[str, int]] = {}
        if self.io == "gso-c" and not gro:  # sends GSO trains, receives one datagram per message
            self._gso_segs = gso_max_segments()
        self._recv_once: Callable[[RxBatch, int], int] = {
            "gso-c": self._recv_gro if self._gro is not None else self._recv_c,
            "mmsg-c": self._recv_c,
            "mmsg-ctypes": self._recv_ctypes,
            "plain": self._recv_plain,
        }[self.io]
        log.debug("BatchSocket fd=%d on %s uses %s", self._fd, sock.getsockname(), self.io)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> BatchSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BatchSocket(fd={self._fd}, io={self.io!r})"

    # --- receive -----------------------------------------------------------------------------------

    def recv(self, rx: RxBatch, timeout_s: float = 0.0) -> int:
        """Receive up to ``rx.capacity`` queued datagrams into rows 0..n-1 of ``rx``; returns n.

        Waits up to ``timeout_s`` for the first one (0: not at all, < 0: without limit), then takes what
        is queued without waiting further. ECONNREFUSED (an ICMP port-unreachable answering an earlier
        send) is skipped.
        """
        if timeout_s == 0:
            return self._recv_once(rx, 0)
        if timeout_s < 0:
            while True:
                n = self._recv_once(rx, -1)
                if n:
                    return n
        deadline = time.monotonic() + timeout_s
        wait = _wait_ms(timeout_s)
        while True:
            n = self._recv_once(rx, wait)
            if n:
                return n
            left = deadline - time.monotonic()
            if left <= 0:
                return 0
            wait = _wait_ms(left)

    @property
    def pending(self) -> bool:
        """Whether datagrams already taken from the kernel wait for the next ``recv`` (``gso-c`` only: a
        coalesced buffer larger than the rows left): poll the socket only when this is False."""
        return self._gro is not None and bool(_cext.gro_pending(self._gro))

    def _recv_gro(self, rx: RxBatch, wait_ms: int) -> int:
        return _cext.recv_gro(
            self._fd, rx._data, rx._lens, rx._keys, rx._data.shape[0], wait_ms, self.stats.counts, self._gro
        )

    def _recv_c(self, rx: RxBatch, wait_ms: int) -> int:
        scratch = rx._scratch if rx._scratch is not None else rx._c_scratch()
        return _cext.recv_batch(
            self._fd, rx._data, rx._lens, rx._keys, rx._data.shape[0], wait_ms, self.stats.counts, scratch
        )

    def _recv_ctypes(self, rx: RxBatch, wait_ms: int) -> int:
        vec = rx._msgvec()
        cap = rx._data.shape[0]
        recvmmsg = _recvmmsg
        assert recvmmsg is not None  # "mmsg-ctypes" is chosen only where libc has it
        total = calls = refused = 0
        polled = False
        try:
            while total < cap:
                chunk = min(cap - total, _MAX_VLEN)
                r = recvmmsg(self._fd, vec.addr + total * _MM_SIZE, chunk, _MSG_DONTWAIT, None)
                calls += 1
                if r > 0:
                    total += r
                    if r < chunk:
                        break  # the queue ran dry
                    continue
                err = ctypes.get_errno()
                if err == errno.ECONNREFUSED and refused < _MAX_REFUSED_RETRIES:
                    refused += 1
                    continue
                if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNREFUSED):
                    if total == 0 and wait_ms and not polled:
                        polled = True
                        if self._rpoll.poll(wait_ms):
                            continue
                    break
                if err == errno.EINTR:
                    continue
                if total:
                    break  # the kernel reports the error again on the next call
                raise OSError(err, os.strerror(err))
        finally:
            self.stats.py[_SYSCALLS_RECV] += calls
        if total:
            rx._lens[:total] = vec.msg_len[:total]
            vec.keys_into(rx._keys, total)
            flags = vec.msg_flags[:total]
            if flags.any():
                self.stats.py[_RECV_TRUNCATED] += int(np.count_nonzero(flags & _MSG_TRUNC))
            self.stats.py[_PACKETS_RECEIVED] += total
        return total

    def _key_of(self, addr: tuple[str, int]) -> int:
        key = self._key_cache.get(addr)
        if key is None:
            if len(self._key_cache) >= _KEY_CACHE_MAX:
                self._key_cache.clear()
            key = self._key_cache[addr] = addr_key(addr)
        return key

    def _addr_of(self, key: int) -> tuple[str, int]:
        addr = self._addr_cache.get(key)
        if addr is None:
            if len(self._addr_cache) >= _KEY_CACHE_MAX:
                self._addr_cache.clear()
            addr = self._addr_cache[key] = key_addr(key)
        return addr

    def _recv_plain(self, rx: RxBatch, wait_ms: int) -> int:
        rows = rx._row_views()
        recvfrom_into = self.sock.recvfrom_into
        key_of = self._key_of
        lens: list[int] = []
        keys: list[int] = []
        cap = len(rows)
        i = calls = refused = 0
        polled = False
        try:
            while i < cap:
                calls += 1
                try:
                    nbytes, addr = recvfrom_into(rows[i])
                except BlockingIOError:
                    if i == 0 and wait_ms and not polled:
                        polled = True
                        if self._rpoll.poll(wait_ms):
                            continue
                    break
                except ConnectionRefusedError:
                    refused += 1
                    if refused < _MAX_REFUSED_RETRIES:
                        continue
                    break
                except OSError:
                    if i:
                        break
                    raise
                lens.append(nbytes)
                keys.append(key_of(addr))
                i += 1
        finally:
            self.stats.py[_SYSCALLS_RECV] += calls
        if i:
            rx._lens[:i] = lens
            rx._keys[:i] = keys
            self.stats.py[_PACKETS_RECEIVED] += i
        return i

    # --- send --------------------------------------------------------------------------------------

    def send(
        self,
        data: np.ndarray,
        lens: np.ndarray | int,
        keys: np.ndarray | int,
        index: np.ndarray | None = None,
        trains: np.ndarray | None = None,
    ) -> int:
        """Send row i of ``data`` (its first ``lens[i]`` bytes) to ``keys[i]`` for every row; returns the
        number sent.

        ``trains`` (int64, one per datagram; ``gso-c`` only, ignored elsewhere): a GSO train never holds
        datagrams of two different values, so a receiver that steers whole trains by their first datagram
        (a sharded softswitch, :mod:`softswitch.shards`) sees each train's datagrams belong together.

        ``data`` is (m, width) uint8 with contiguous rows (any row stride); ``lens`` and ``keys`` are one
        int for every row or one per row. ``index`` (int64, one per datagram) sends datagram i from row
        ``index[i]`` instead, so one row goes to several receivers without copies; ``lens`` and ``keys``
        are then per datagram. Where the socket has no room (EAGAIN/ENOBUFS) it waits; after
        ``stall_timeout_s`` without progress it gives the datagram up, and until something goes out again
        gives each further one a single try. Datagrams refused by the network (unreachable, too big) are
        given up too; both count in ``stats.send_errors``. Raises only for errors of the socket itself.
        """
        data = _as_rows(data)
        m = data.shape[0] if index is None else len(index)
        if m == 0:
            return 0
        lens = _as_ints(lens, m, "lens", int32_ok=True)
        keys = _as_ints(keys, m, "keys", int32_ok=False)
        rows: np.ndarray | None = None
        if index is not None:
            rows = np.ascontiguousarray(index, dtype=np.int64)
            if rows.ndim != 1:
                raise ValueError(f"index must be a 1-D array of row numbers, got shape {rows.shape}")
        if self.io == "gso-c":
            train_keys = None if trains is None else _as_ints(trains, m, "trains", int32_ok=False)
            return self._send_gso(data, lens, keys, m, rows, train_keys)
        if self.io == "mmsg-c":
            return _cext.send_batch(
                self._fd, data, lens, keys, m, self.stall_timeout_s * 1000.0, self.stats.counts, rows
            )
        _check_ranges(lens, keys, data.shape[1])
        if rows is not None:
            lo, hi = int(rows.min()), int(rows.max())
            if lo < 0 or hi >= data.shape[0]:
                raise ValueError(f"index rows must be in 0..{data.shape[0] - 1}, got {lo}..{hi}")
        if self.io == "mmsg-ctypes":
            return self._send_ctypes(data, lens, keys, m, rows)
        return self._send_plain(data, lens, keys, m, rows)

    def send_rows(self, data: np.ndarray, key: int, trains: np.ndarray | None = None) -> int:
        """:meth:`send` of every whole row of ``data``, a (m, width) uint8 array with contiguous rows, to
        ``key``, without :meth:`send`'s normalisation of its arguments (the C call checks that each row
        lies in ``data``): the reduce engine's packet rows, a few dozen calls a reduce. ``trains`` as
        :meth:`send` takes them, int64."""
        m = data.shape[0]
        if m == 0:
            return 0
        if self.io == "gso-c":
            return self._send_gso(data, data.shape[1], key, m, None, trains)
        return self.send(data, data.shape[1], key)

    def _send_gso(
        self,
        data: np.ndarray,
        lens: np.ndarray | int,
        keys: np.ndarray | int,
        m: int,
        rows: np.ndarray | None,
        trains: np.ndarray | int | None,
    ) -> int:
        sent, refused = _cext.send_gso(
            self._fd,
            data,
            lens,
            keys,
            m,
            self.stall_timeout_s * 1000.0,
            self.stats.counts,
            rows,
            self._gso_segs,
            trains,
        )
        if refused:
            self.io = "mmsg-c"
            self.io_note = (
                f"GSO refused by the kernel ({os.strerror(refused)}): sending mmsg-c, receiving GRO"
            )
            log.warning("BatchSocket fd=%d: %s", self._fd, self.io_note)
        return int(sent)

    def _send_ctypes(
        self,
        data: np.ndarray,
        lens: np.ndarray | int,
        keys: np.ndarray | int,
        m: int,
        rows: np.ndarray | None = None,
    ) -> int:
        vec = self._tx_vec
        if vec is None or len(vec.idx) < min(m, _MAX_VLEN):
            vec = self._tx_vec = _MsgVec(max(min(m, _MAX_VLEN), 16))
        base: int = data.ctypes.data
        stride: int = data.strides[0]
        fd = self._fd
        addr = vec.addr
        sendmmsg = _sendmmsg
        assert sendmmsg is not None  # "mmsg-ctypes" is chosen only where libc has it

        def attempt(off: int, end: int) -> tuple[int, int, int]:
            r = sendmmsg(fd, addr + off * _MM_SIZE, end - off, _MSG_DONTWAIT)
            return (r, 0, 1) if r > 0 else (0, ctypes.get_errno() if r < 0 else errno.EAGAIN, 1)

        sent = 0
        progress = _Progress()
        filled = vec.filled
        for start in range(0, m, _MAX_VLEN):
            c = min(m - start, _MAX_VLEN)
            first = (base + start * stride, stride)
            if rows is not None:  # datagram i from row rows[i]: the bases change with every call
                iov_base = vec.iov_base[:c]
                np.multiply(rows[start : start + c].astype(np.uintp), stride, out=iov_base)
                iov_base += base
                filled[0] = None
            elif filled[0] != first or filled[1] < c:
                iov_base = vec.iov_base[:c]
                np.multiply(vec.idx[:c], stride, out=iov_base)
                iov_base += first[0]
                filled[0:2] = first, c
            if not isinstance(lens, int):
                vec.iov_len[:c] = lens[start : start + c]
                filled[2] = None
            elif filled[2] != lens or filled[3] < c:
                vec.iov_len[:c] = lens
                filled[2:4] = lens, c
            if not isinstance(keys, int):
                vec.set_dests(keys[start : start + c], c)
                filled[4] = None
            elif filled[4] != keys or filled[5] < c:
                vec.set_dests(keys, c)
                filled[4:6] = keys, c
            sent += self._drive(c, attempt, progress)
        return sent

    def _send_plain(
        self,
        data: np.ndarray,
        lens: np.ndarray | int,
        keys: np.ndarray | int,
        m: int,
        rows: np.ndarray | None = None,
    ) -> int:
        sendto = self.sock.sendto
        stride = data.strides[0]
        row_of = range(m) if rows is None else rows.tolist()
        len_list = [lens] * m if isinstance(lens, int) else lens.tolist()
        if isinstance(keys, int):
            addrs = [self._addr_of(keys)] * m
        else:
            addr_of = self._addr_of
            addrs = [addr_of(k) for k in keys.tolist()]
        if data.flags.c_contiguous:
            flat = data.reshape(-1).data

            def payload(i: int) -> Any:
                r = row_of[i]
                return flat[r * stride : r * stride + len_list[i]]

        else:

            def payload(i: int) -> Any:
                return data[row_of[i], : len_list[i]]

        def attempt(off: int, end: int) -> tuple[int, int, int]:
            for i in range(off, end):
                try:
                    sendto(payload(i), addrs[i])
                except OSError as exc:
                    return i - off, exc.errno or 0, i - off + 1
            return end - off, 0, end - off

        return self._drive(m, attempt, _Progress())

    def _drive(self, n: int, attempt: Callable[[int, int], tuple[int, int, int]], progress: _Progress) -> int:
        """Send messages 0..n-1 with ``attempt(off, n) -> (sent, errno, syscalls)``, which sends from ``off``
        until the first failure; handles waiting for room, giving up, and per-datagram errors."""
        off = sent = errors = waits = calls = 0
        counts = self.stats.py
        try:
            while off < n:
                k, err, c = attempt(off, n)
                calls += c
                if k:
                    off += k
                    sent += k
                    progress.mark()
                if not err or off >= n:
                    continue
                if err in _SKIP_ERRNOS:
                    errors += 1
                    off += 1
                elif err in _ROOM_ERRNOS:
                    left = progress.last + self.stall_timeout_s - time.monotonic()
                    if progress.stalled or left <= 0:
                        errors += 1
                        off += 1
                        progress.stalled = True
                    else:
                        waits += 1
                        if err in _SLEEP_ERRNOS:
                            time.sleep(_ENOBUFS_SLEEP_S)
                        else:
                            self._wpoll.poll(min(_POLLOUT_SLICE_MS, _wait_ms(left)))
                elif err != errno.EINTR:
                    raise OSError(err, os.strerror(err))
        finally:
            counts[_SYSCALLS_SEND] += calls
            counts[_PACKETS_SENT] += sent
            counts[_SEND_ERRORS] += errors
            counts[_SEND_WAITS] += waits
        return sent


class _Progress:
    """When a send last made progress, and whether it has given up a datagram since."""

    __slots__ = ("last", "stalled")

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.stalled = False

    def mark(self) -> None:
        self.last = time.monotonic()
        self.stalled = False
