"""hostlib.batchio: batched UDP send/receive over loopback, in every I/O mode that works here."""

from __future__ import annotations

import errno
import itertools
import select
import socket
import threading
import time

import numpy as np
import pytest

from hostlib import batchio
from hostlib.batchio import IO_MODES, BatchSocket, RxBatch, addr_key, key_addr

MODES = [
    pytest.param(m, marks=pytest.mark.skipif(bool(batchio._MISSING[m]), reason=batchio._MISSING[m] or "-"))
    for m in IO_MODES
]
PAIRS = [
    pytest.param(
        tx,
        rx,
        id=f"{tx}->{rx}",
        marks=pytest.mark.skipif(
            bool(batchio._MISSING[tx] or batchio._MISSING[rx]),
            reason=batchio._MISSING[tx] or batchio._MISSING[rx] or "-",
        ),
    )
    for tx, rx in itertools.product(IO_MODES, IO_MODES)
]
SIZES = [1, 292, 9000, 65507, 0, 37]


def key_of(s: socket.socket | BatchSocket) -> int:
    sock = s.sock if isinstance(s, BatchSocket) else s
    return addr_key(sock.getsockname())


def closed_port_key() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    key = key_of(s)
    s.close()
    return key


def payloads(sizes: list[int], width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    data = np.zeros((len(sizes), width), dtype=np.uint8)
    for i, n in enumerate(sizes):
        data[i, :n] = rng.integers(0, 256, n, dtype=np.uint8)
    return data


def recv_all(bs: BatchSocket, rx: RxBatch, want: int, timeout_s: float = 2.0) -> list[tuple[bytes, int]]:
    """(bytes, source key) of each datagram, until `want` came or nothing came for timeout_s."""
    got: list[tuple[bytes, int]] = []
    while len(got) < want:
        n = bs.recv(rx, timeout_s)
        if n == 0:
            break
        got += [(rx.row(i).tobytes(), int(rx.keys[i])) for i in range(n)]
    return got


# ---------------------------------------------------------------------------------------------------


def test_addr_key_round_trip() -> None:
    for addr in [("127.0.0.1", 0), ("10.1.2.3", 48879), ("255.255.255.255", 65535), ("0.0.0.0", 1)]:
        key = addr_key(addr)
        assert 0 <= key < 1 << 48
        assert key_addr(key) == addr
    assert addr_key(("1.2.3.4", 5)) == (0x01020304 << 16) | 5
    assert key_addr(np.int64(addr_key(("1.2.3.4", 5)))) == ("1.2.3.4", 5)
    for bad in [("localhost", 1), ("1.2.3", 1), ("::1", 1), ("1.2.3.4", 65536), ("1.2.3.4", -1)]:
        with pytest.raises(ValueError):
            addr_key(bad)
    for bad_key in [-1, 1 << 48]:
        with pytest.raises(ValueError):
            key_addr(bad_key)


@pytest.mark.parametrize("mode", MODES)
def test_batch_round_trip(mode: str, udp) -> None:
    tx, rx_sock = BatchSocket(udp(), mode), BatchSocket(udp(), mode)
    assert tx.io == rx_sock.io == mode
    data = payloads(SIZES, 65507)
    assert tx.send(data, np.array(SIZES), key_of(rx_sock)) == len(SIZES)
    rx = RxBatch(16, 65507)
    n = rx_sock.recv(rx, timeout_s=2.0)
    assert n == len(SIZES)
    assert rx.lens[:n].tolist() == SIZES
    assert rx.keys[:n].tolist() == [key_of(tx)] * n
    for i, size in enumerate(SIZES):
        assert rx.data[i, :size].tobytes() == data[i, :size].tobytes()
    assert tx.stats.packets_sent == len(SIZES) and tx.stats.send_errors == 0
    assert rx_sock.stats.packets_received == len(SIZES)
    if mode != "plain":
        assert tx.stats.syscalls_send == 1
        assert rx_sock.stats.syscalls_recv == 1


@pytest.mark.parametrize("mode", MODES)
def test_per_row_destinations_and_strided_rows(mode: str, udp) -> None:
    tx, a, b = BatchSocket(udp(), mode), BatchSocket(udp(), mode), BatchSocket(udp(), mode)
    big = payloads([800] * 12, 800, seed=3)
    data = big[::2, :300]  # row-strided view: 6 rows of 300 bytes, 1600 bytes apart
    lens = np.array([300, 1, 292, 17, 0, 299], dtype=np.int32)
    keys = np.array([key_of(a), key_of(b)] * 3, dtype=np.int64)
    assert tx.send(data, lens, keys) == 6
    rx = RxBatch(8, 512)
    want_a = [(data[i, : lens[i]].tobytes(), key_of(tx)) for i in (0, 2, 4)]
    want_b = [(data[i, : lens[i]].tobytes(), key_of(tx)) for i in (1, 3, 5)]
    assert recv_all(a, rx, 3) == want_a
    assert recv_all(b, rx, 3) == want_b


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_row_and_bytes_input(mode: str, udp) -> None:
    tx, dst = BatchSocket(udp(), mode), BatchSocket(udp(), mode)
    row = np.arange(292, dtype=np.uint8)
    assert tx.send(np.broadcast_to(row, (5, 292)), 292, key_of(dst)) == 5  # row stride 0
    assert tx.send(b"hello", 5, key_of(dst)) == 1
    rx = RxBatch(8, 292)
    assert recv_all(dst, rx, 6) == [(row.tobytes(), key_of(tx))] * 5 + [(b"hello", key_of(tx))]


@pytest.mark.parametrize("mode", MODES)
def test_index_sends_rows_again_without_copies(mode: str, udp) -> None:
    """index[i] names the row datagram i comes from: rows repeat (replicas), skip, come out of order;
    lens and keys are per datagram; every datagram goes whole, in order, from a row-strided view too."""
    tx, a, b = BatchSocket(udp(), mode), BatchSocket(udp(), mode), BatchSocket(udp(), mode)
    big = payloads([900] * 8, 900, seed=5)
    data = big[::2, :600]  # 4 rows of 600 bytes, 1800 bytes apart
    index = np.array([2, 2, 0, 3, 0, 2, 1], dtype=np.int64)
    lens = np.array([600, 600, 17, 300, 17, 1, 0], dtype=np.int64)
    keys = np.array([key_of(a), key_of(b), key_of(a), key_of(b), key_of(b), key_of(a), key_of(a)])
    assert tx.send(data, lens, keys, index=index) == len(index)
    rx = RxBatch(8, 1024)
    sent = [(data[r, : lens[i]].tobytes(), int(keys[i])) for i, r in enumerate(index)]
    want_a = [(payload, key_of(tx)) for payload, key in sent if key == key_of(a)]
    want_b = [(payload, key_of(tx)) for payload, key in sent if key == key_of(b)]
    assert recv_all(a, rx, len(want_a)) == want_a
    assert recv_all(b, rx, len(want_b)) == want_b
    assert tx.stats.packets_sent == len(index)
    for bad in ([0, 4, 1, 1, 1, 1, 1], [-1, 0, 0, 0, 0, 0, 0]):  # a row outside data: nothing sent
        with pytest.raises(ValueError, match="row"):
            tx.send(data, lens, keys, index=np.array(bad))
    assert tx.stats.packets_sent == len(index)


@pytest.mark.parametrize("mode", MODES)
def test_recv_timeout_returns_zero(mode: str, udp) -> None:
    bs = BatchSocket(udp(), mode)
    rx = RxBatch(4, 292)
    assert bs.recv(rx) == 0
    t0 = time.monotonic()
    assert bs.recv(rx, timeout_s=0.1) == 0
    assert time.monotonic() - t0 >= 0.09  # it waited (no upper bound: a loaded machine may add any delay)


@pytest.mark.parametrize("mode", MODES)
def test_recv_wakes_on_arrival(mode: str, udp) -> None:
    bs, tx = BatchSocket(udp(), mode), udp()
    rx = RxBatch(4, 292)
    # The datagram is sent once recv is waiting: recv must return it, not wait out its 60 s timeout.
    threading.Timer(0.05, tx.sendto, (b"x" * 10, bs.sock.getsockname())).start()
    t0 = time.monotonic()
    assert bs.recv(rx, timeout_s=60.0) == 1
    assert time.monotonic() - t0 < 30.0  # half the timeout: woken by the arrival
    assert rx.row(0).tobytes() == b"x" * 10


@pytest.mark.parametrize("mode", MODES)
def test_more_queued_than_capacity_in_order(mode: str, udp) -> None:
    tx, dst = BatchSocket(udp(), mode), BatchSocket(udp(), mode)
    m = 50
    data = np.zeros((m, 292), dtype=np.uint8)
    data[:, :4] = np.arange(m, dtype=">u4").view(np.uint8).reshape(m, 4)
    assert tx.send(data, 292, key_of(dst)) == m
    rx = RxBatch(8, 292)
    seen: list[int] = []
    calls = 0
    while len(seen) < m:
        n = dst.recv(rx, timeout_s=1.0)
        assert 0 < n <= 8
        calls += 1
        seen += rx.data[:n, :4].copy().view(">u4").ravel().tolist()
    assert seen == list(range(m))
    assert calls == 7  # 6 full batches of 8, then 2
    assert dst.recv(rx) == 0


@pytest.mark.parametrize("mode", MODES)
def test_more_than_uio_maxiov_per_call(mode: str, udp) -> None:
    """sendmmsg/recvmmsg take at most 1024 messages per call: larger batches are split."""
    tx, dst = BatchSocket(udp(), mode), BatchSocket(udp(), mode)
    m = 1500
    data = np.zeros((m, 64), dtype=np.uint8)
    data[:, :4] = np.arange(m, dtype=">u4").view(np.uint8).reshape(m, 4)
    assert tx.send(data, 64, key_of(dst)) == m
    rx = RxBatch(2048, 64)
    seen: list[int] = []
    while len(seen) < m:
        n = dst.recv(rx, timeout_s=1.0)
        assert n > 0
        seen += rx.data[:n, :4].copy().view(">u4").ravel().tolist()
    assert seen == list(range(m))
    if mode == "gso-c":  # one sendmmsg of GSO messages of up to 64 or 128 datagrams
        assert tx.stats.syscalls_send == 1
        assert tx.stats.gso_trains_sent == -(-m // batchio.gso_max_segments())
    elif mode != "plain":
        assert tx.stats.syscalls_send == 2


@pytest.mark.parametrize("mode", MODES)
def test_alternating_rx_batches(mode: str, udp) -> None:
    """Each RxBatch keeps its own receive headers: switching between batches must not mix them up."""
    tx, dst = udp(), BatchSocket(udp(), mode)
    small, big = RxBatch(3, 16), RxBatch(5, 400)
    for rnd in range(3):
        for rx, size in ((small, 16), (big, 400), (small, 16)):
            msgs = [bytes([rnd, i]) * (size // 2) for i in range(rx.capacity)]
            for msg in msgs:
                tx.sendto(msg, dst.sock.getsockname())
            assert recv_all(dst, rx, len(msgs)) == [(msg, key_of(tx)) for msg in msgs]


@pytest.mark.parametrize("mode", MODES)
def test_truncation(mode: str, udp) -> None:
    tx, dst = udp(), BatchSocket(udp(), mode)
    tx.sendto(bytes(range(200)), dst.sock.getsockname())
    rx = RxBatch(2, 100)
    assert dst.recv(rx, 1.0) == 1
    assert rx.lens[0] == 100 and rx.row(0).tobytes() == bytes(range(100))
    if mode != "plain":
        assert dst.stats.recv_truncated == 1


@pytest.mark.parametrize("mode", MODES)
def test_send_to_closed_port_does_not_raise(mode: str, udp) -> None:
    tx, live = BatchSocket(udp(), mode), BatchSocket(udp(), mode)
    dead = closed_port_key()
    data = payloads([100] * 4, 100)
    keys = np.array([dead, key_of(live), dead, key_of(live)], dtype=np.int64)
    for _ in range(3):
        assert tx.send(data, 100, keys) >= 2
    rx = RxBatch(8, 100)
    assert len(recv_all(live, rx, 6, timeout_s=0.5)) == 6
    assert tx.recv(rx, timeout_s=0.05) == 0  # nothing pending that raises


@pytest.mark.parametrize("mode", MODES)
def test_oversized_datagram_is_counted_not_raised(mode: str, udp) -> None:
    tx, dst = BatchSocket(udp(), mode), BatchSocket(udp(), mode)
    data = payloads([70000] * 3, 70000, seed=5)
    assert tx.send(data, np.array([10, 65508, 20]), key_of(dst)) == 2  # 65508 > the UDP/IPv4 maximum
    assert tx.stats.send_errors == 1
    rx = RxBatch(4, 64)
    assert recv_all(dst, rx, 2) == [
        (data[0, :10].tobytes(), key_of(tx)),
        (data[2, :20].tobytes(), key_of(tx)),
    ]


def _error_pending(sock: socket.socket, timeout_s: float = 5.0) -> None:
    """Wait until the ICMP error reached the socket: a pending error makes it readable (POLLERR)."""
    select.select([sock], [], [], timeout_s)


def _icmp_errors_reported() -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind(("127.0.0.1", 0))
        s.connect(key_addr(closed_port_key()))
        s.send(b"x")
        _error_pending(s)
        return s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED
    finally:
        s.close()


@pytest.mark.parametrize("mode", MODES)
def test_connection_refused_is_swallowed(mode: str, udp) -> None:
    """A connected UDP socket gets ECONNREFUSED from an ICMP port-unreachable: recv skips it, send counts
    the datagram it failed as an error, and both carry on."""
    if not _icmp_errors_reported():
        pytest.skip("this kernel reports no ICMP port-unreachable to a connected UDP socket")
    raw, peer = udp(), BatchSocket(udp(), mode)
    dead = closed_port_key()
    raw.connect(key_addr(dead))
    bs = BatchSocket(raw, mode)
    rx = RxBatch(4, 64)
    row = np.frombuffer(b"ping", dtype=np.uint8)

    bs.send(row, 4, dead)
    _error_pending(raw)
    assert bs.recv(rx, timeout_s=0.05) == 0  # ECONNREFUSED pending: swallowed
    assert raw.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0

    bs.send(row, 4, dead)
    _error_pending(raw)
    peer.send(row, 4, key_of(bs))  # (the connected socket only takes datagrams from `dead`)
    assert bs.send(np.stack([row, row]), 4, key_of(peer)) >= 1  # the first may carry the pending error
    assert bs.stats.send_errors + bs.stats.packets_sent >= 3
    assert recv_all(peer, rx, 1, timeout_s=0.5)[0] == (b"ping", key_of(bs))


@pytest.mark.parametrize("mode", MODES)
def test_bad_arguments(mode: str, udp) -> None:
    bs = BatchSocket(udp(), mode)
    data = np.zeros((2, 10), dtype=np.uint8)
    with pytest.raises(ValueError):
        bs.send(data, 11, key_of(bs))  # longer than a row
    with pytest.raises(ValueError):
        bs.send(data, np.array([1, -1]), key_of(bs))
    with pytest.raises(ValueError):
        bs.send(data, 5, np.array([key_of(bs)] * 3))  # 3 keys for 2 rows
    with pytest.raises(ValueError):
        bs.send(data, 5, 1 << 48)
    with pytest.raises(ValueError):
        bs.send(np.zeros((2, 10), dtype=np.float32), 5, key_of(bs))
    assert bs.stats.packets_sent == 0
    assert bs.send(data[:0], 5, key_of(bs)) == 0


@pytest.mark.parametrize("tx_mode,rx_mode", PAIRS)
def test_cross_mode(tx_mode: str, rx_mode: str, udp) -> None:
    tx, dst = BatchSocket(udp(), tx_mode), BatchSocket(udp(), rx_mode)
    data = payloads(SIZES, 65507, seed=7)
    assert tx.send(data, np.array(SIZES), key_of(dst)) == len(SIZES)
    rx = RxBatch(8, 65507)
    want = [(data[i, :n].tobytes(), key_of(tx)) for i, n in enumerate(SIZES)]
    assert recv_all(dst, rx, len(SIZES)) == want


# ---------------------------------------------------------------------------------------------------
# Mode selection


def test_env_forces_plain(udp, monkeypatch) -> None:
    monkeypatch.setenv("LTA_IO", "plain")
    assert BatchSocket(udp()).io == "plain"
    assert BatchSocket(udp(), io=batchio.available_modes()[0]).io == batchio.available_modes()[0]  # io= wins


def test_default_is_first_available(udp, monkeypatch) -> None:
    monkeypatch.delenv("LTA_IO", raising=False)
    assert BatchSocket(udp()).io == batchio.available_modes()[0]
    monkeypatch.setenv("LTA_IO", "auto")
    assert BatchSocket(udp()).io == batchio.available_modes()[0]


def test_fallback_order(udp, monkeypatch) -> None:
    monkeypatch.delenv("LTA_IO", raising=False)
    monkeypatch.setitem(batchio._MISSING, "gso-c", "no UDP GSO (test)")
    assert BatchSocket(udp()).io == ("mmsg-c" if not batchio._CEXT_MISSING else "mmsg-ctypes")
    monkeypatch.setitem(batchio._MISSING, "mmsg-c", "not built (test)")
    assert BatchSocket(udp()).io == ("mmsg-ctypes" if not batchio._CTYPES_MISSING else "plain")
    monkeypatch.setitem(batchio._MISSING, "mmsg-ctypes", "no libc (test)")
    assert BatchSocket(udp()).io == "plain"


def test_bad_or_unavailable_mode(udp, monkeypatch) -> None:
    monkeypatch.setenv("LTA_IO", "fast")
    with pytest.raises(ValueError, match="LTA_IO='fast' is not an I/O mode") as info:
        BatchSocket(udp())
    assert "\n" not in str(info.value)
    monkeypatch.delenv("LTA_IO")
    with pytest.raises(ValueError, match="not an I/O mode"):
        BatchSocket(udp(), io="mmsg")
    monkeypatch.setitem(batchio._MISSING, "mmsg-c", "not built (test)")
    monkeypatch.setenv("LTA_IO", "mmsg-c")
    with pytest.raises(ValueError, match="not available here: not built") as info:
        BatchSocket(udp())
    assert "\n" not in str(info.value)


def test_rejects_non_udp_socket() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(ValueError):
        BatchSocket(s)


def test_send_gives_up_after_stall(udp) -> None:
    """The Python send loop: no room for stall_timeout_s -> that datagram is given up, and the rest of the
    call gets one try each instead of another full wait."""
    bs = BatchSocket(udp(), "plain", stall_timeout_s=0.1)
    tries: list[int] = []

    def no_room(off: int, end: int) -> tuple[int, int, int]:
        tries.append(off)
        return 0, errno.EAGAIN, 1

    t0 = time.monotonic()
    assert bs._drive(5, no_room, batchio._Progress()) == 0
    assert time.monotonic() - t0 >= 0.09  # the first datagram waited out the stall timeout
    assert bs.stats.send_errors == 5
    # The mechanism: datagram 0 was tried until the stall timeout; each later one exactly once.
    assert tries[-4:] == [1, 2, 3, 4] and set(tries[:-4]) == {0}
