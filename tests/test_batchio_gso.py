"""hostlib.batchio's segmentation-offload path (gso-c): UDP GSO trains out, GRO buffers cut back into rows.

Every check compares against what was sent, computed here with numpy (the rows by their index, grouped by
destination in the order given), and against the mmsg path, which sends one datagram per message."""

from __future__ import annotations

import errno
import socket

import numpy as np
import pytest

from hostlib import batchio
from hostlib.batchio import BatchSocket, RxBatch, addr_key
from tests.test_batchio import key_of

pytestmark = pytest.mark.skipif(
    bool(batchio._MISSING["gso-c"]) or not batchio.gso_max_segments(),
    reason=batchio._MISSING["gso-c"] or "no UDP GSO here",
)


def drain(bs: BatchSocket, rx: RxBatch, want: int) -> list[tuple[bytes, int]]:
    got: list[tuple[bytes, int]] = []
    while len(got) < want:
        n = bs.recv(rx, 1.0)
        if n == 0:
            break
        got += [(rx.row(i).tobytes(), int(rx.keys[i])) for i in range(n)]
    return got


def mixed_batch(seed: int, dests: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows, per-datagram lengths, destinations and row index: runs of equal sizes (GSO trains), sizes that
    change mid-run, an empty datagram, replicas of one row to several destinations."""
    rng = np.random.default_rng(seed)
    sizes = [292] * 150 + [100] * 3 + [292] * 40 + [0] + [1472] * 30 + [37] + [8936] * 9 + [292] * 200
    n = len(sizes)
    width = max(sizes)
    data = rng.integers(0, 256, (n, width), dtype=np.uint8)
    data[:, :4] = np.arange(n, dtype=">u4").view(np.uint8).reshape(n, 4)[:, :4]
    index = np.repeat(np.arange(n), len(dests))  # every row to every destination, as a RESULT's replicas
    keys = np.tile(np.array(dests, dtype=np.int64), n)
    lens = np.repeat(np.array(sizes, dtype=np.int64), len(dests))
    return data, lens, keys, index


def expected_for(data, lens, keys, index, dest: int, src: int) -> list[tuple[bytes, int]]:
    sel = np.flatnonzero(keys == dest)
    return [(data[index[i], : lens[i]].tobytes(), src) for i in sel]


@pytest.mark.parametrize("rx_mode", ["gso-c", "mmsg-c"])
def test_gso_trains_deliver_every_datagram_per_destination_in_order(udp, rx_mode):
    tx = BatchSocket(udp(), "gso-c")
    receivers = [BatchSocket(udp(), rx_mode) for _ in range(3)]
    dests = [key_of(r) for r in receivers]
    data, lens, keys, index = mixed_batch(1, dests)
    assert tx.send(data, lens, keys, index) == len(index)
    assert tx.io == "gso-c" and tx.stats.send_errors == 0
    # Trains: far fewer system calls and messages than datagrams.
    assert tx.stats.gso_trains_sent > 0 and tx.stats.syscalls_send < len(index) // 64
    for r, dest in zip(receivers, dests, strict=True):
        want = expected_for(data, lens, keys, index, dest, key_of(tx))
        got = drain(r, RxBatch(1024, 9000), len(want))
        assert got == want
    if rx_mode == "gso-c":  # the kernel handed trains over whole, and they were cut into rows
        assert receivers[0].stats.gro_trains_received > 0
        assert receivers[0].stats.syscalls_recv < receivers[0].stats.packets_received // 8


def test_gso_and_mmsg_senders_deliver_the_same(udp):
    """The same batch through gso-c and mmsg-c senders: identical datagrams at the receiver."""
    a, b = BatchSocket(udp(), "gso-c"), BatchSocket(udp(), "mmsg-c")
    ra, rb = BatchSocket(udp(), "gso-c"), BatchSocket(udp(), "gso-c")
    data, lens, keys, index = mixed_batch(2, [0])
    assert a.send(data, lens, key_of(ra), index) == b.send(data, lens, key_of(rb), index) == len(index)
    got_a = [d for d, _ in drain(ra, RxBatch(512, 9000), len(index))]
    got_b = [d for d, _ in drain(rb, RxBatch(512, 9000), len(index))]
    assert got_a == got_b == [data[i, :n].tobytes() for i, n in zip(index, lens, strict=True)]


def test_a_train_larger_than_the_rows_left_waits_for_the_next_recv(udp):
    tx, rx_sock = BatchSocket(udp(), "gso-c"), BatchSocket(udp(), "gso-c")
    m = 300
    data = np.zeros((m, 292), dtype=np.uint8)
    data[:, :4] = np.arange(m, dtype=">u4").view(np.uint8).reshape(m, 4)
    assert tx.send(data, 292, key_of(rx_sock)) == m
    rx = RxBatch(7, 292)
    seen: list[int] = []
    calls = 0
    while len(seen) < m:
        n = rx_sock.recv(rx, 1.0)
        assert 0 < n <= 7
        calls += 1
        seen += rx.data[:n, :4].copy().view(">u4").ravel().tolist()
        assert rx_sock.pending == (len(seen) < m)
    assert seen == list(range(m)) and calls == -(-m // 7)
    assert rx_sock.recv(rx) == 0 and not rx_sock.pending


def test_rows_narrower_than_the_segments_truncate_as_mmsg_does(udp):
    tx, rx_sock = BatchSocket(udp(), "gso-c"), BatchSocket(udp(), "gso-c")
    data = np.arange(20 * 100, dtype=np.uint8).reshape(20, 100)
    tx.send(data, 100, key_of(rx_sock))
    rx = RxBatch(64, 60)
    got = drain(rx_sock, rx, 20)
    assert [d for d, _ in got] == [data[i, :60].tobytes() for i in range(20)]
    assert rx_sock.stats.recv_truncated == 20


def test_kernel_refusing_segmentation_falls_back_to_mmsg(udp):
    """SO_NO_CHECK makes the kernel refuse UDP_SEGMENT (EINVAL): the train goes out one datagram per message,
    the socket says so, and sends mmsg-c from then on."""
    raw = udp()
    raw.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_NO_CHECK", 11), 1)
    tx, rx_sock = BatchSocket(raw, "gso-c"), BatchSocket(udp(), "gso-c")
    data = np.arange(50 * 64, dtype=np.uint8).reshape(50, 64)
    assert tx.send(data, 64, key_of(rx_sock)) == 50
    assert tx.io == "mmsg-c" and "GSO refused" in tx.io_note and "Invalid argument" in tx.io_note
    assert tx.stats.gso_trains_sent == 0
    assert tx.send(data[:5], 64, key_of(rx_sock)) == 5
    got = drain(rx_sock, RxBatch(64, 64), 55)
    assert [d for d, _ in got] == [data[i].tobytes() for i in range(50)] + [
        data[i].tobytes() for i in range(5)
    ]


class _NoGroSocket(socket.socket):
    def setsockopt(self, level, opt, value, *rest):  # type: ignore[override]
        if level == batchio.SOL_UDP and opt == batchio.UDP_GRO:
            raise OSError(errno.ENOPROTOOPT, "Protocol not available")
        return super().setsockopt(level, opt, value, *rest)


def test_kernel_without_gro_starts_the_socket_as_mmsg():
    s = _NoGroSocket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind(("127.0.0.1", 0))
        bs = BatchSocket(s, "gso-c")
        assert bs.io == "mmsg-c" and "UDP_GRO refused" in bs.io_note
        data = np.arange(10 * 16, dtype=np.uint8).reshape(10, 16)
        assert bs.send(data, 16, addr_key(s.getsockname())) == 10
        assert [d for d, _ in drain(bs, RxBatch(16, 16), 10)] == [data[i].tobytes() for i in range(10)]
    finally:
        s.close()


def test_the_probe_found_the_kernels_segment_limit(udp):
    """A GSO message of the probed segment count goes through; one more is refused by the kernel."""
    segs = batchio.gso_max_segments()
    assert segs in (64, 128)
    tx, dst = udp(), udp()
    cmsg = [(batchio.SOL_UDP, batchio.UDP_SEGMENT, (8).to_bytes(2, "little" if np.little_endian else "big"))]
    tx.sendmsg([bytes(8 * segs)], cmsg, 0, dst.getsockname())
    with pytest.raises(OSError) as info:
        tx.sendmsg([bytes(8 * (segs + 1))], cmsg, 0, dst.getsockname())
    assert info.value.errno == errno.EINVAL


@pytest.mark.parametrize("size", [292, 8936, 32736, 32737, batchio.MAX_DATAGRAM // 2 + 1, 16367 * 4 + 28])
def test_gro_coalesces_only_where_the_kernel_does(udp, size):
    """gro_coalesces against the kernel: where it says yes, a GSO message of two datagrams of ``size`` to a
    UDP_GRO socket arrives as one buffer of both; past half the largest datagram the kernel refuses such a
    message (no two fit one buffer). Between the two it says no where the kernel may still pair them (a
    little headroom below its limit): harmless, a gro=False socket gets every datagram either way."""
    assert batchio.gro_coalesces(size) == (size <= 32736)
    tx, dst = udp(), udp()
    dst.setsockopt(batchio.SOL_UDP, batchio.UDP_GRO, 1)
    cmsg = [(batchio.SOL_UDP, batchio.UDP_SEGMENT, size.to_bytes(2, "little" if np.little_endian else "big"))]
    if batchio.gro_coalesces(size):
        tx.sendmsg([bytes(2 * size)], cmsg, 0, dst.getsockname())
        assert len(dst.recv(1 << 17)) == 2 * size
    elif 2 * size > batchio.MAX_DATAGRAM:
        with pytest.raises(OSError) as info:
            tx.sendmsg([bytes(2 * size)], cmsg, 0, dst.getsockname())
        assert info.value.errno == errno.EMSGSIZE


def test_a_socket_without_gro_receives_64k_datagrams_straight_into_the_rows(udp):
    """gro=False on a gso-c socket: no staging buffer; every 64 KiB datagram lands in its own row, as
    sent, as it does on a GRO socket."""
    size = 16367 * 4 + 28
    data = np.random.default_rng(3).integers(0, 256, (12, size), dtype=np.uint8)
    got = {}
    for gro in (False, True):
        tx, dst = BatchSocket(udp(), "gso-c"), BatchSocket(udp(), "gso-c", gro=gro)
        assert (dst._gro is None) == (not gro) and dst.io == "gso-c"
        assert tx.send(data, size, key_of(dst)) == len(data)
        got[gro] = [d for d, _ in drain(dst, RxBatch(len(data), size + 4), len(data))]
    assert got[False] == got[True] == [row.tobytes() for row in data]
