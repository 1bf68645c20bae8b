"""softswitch.server.SharedLoopServer: the switches of a leaf-spine tree served by one thread, over real
UDP sockets on loopback. Hand-built GRADs from worker sockets; every worker must get the spine's RESULT
(through its leaf) with the global count, bitmap and numpy's sum of what was sent."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from hostlib.protocol import HEADER_BYTES, Header, Op, make_packet
from softswitch.hierarchy import leaf_job, spine_job
from softswitch.pipeline import JobConfig, SoftSwitch
from softswitch.server import SharedLoopServer, SoftSwitchServer

K = 8


def _udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5.0)
    return sock


def _grad(w: int, values: np.ndarray, slot: int) -> bytes:
    return make_packet(
        Op.GRAD, job_id=1, worker_id=w, slot=slot, seq=1, payload=values.tolist(), elems_per_packet=K
    )


def _tree(n_leaves: int, per_leaf: int):
    """Worker sockets, and the switches (leaves, then the spine) with their servers, jobs installed."""
    n = n_leaves * per_leaf
    workers = [_udp() for _ in range(n)]
    switches = [SoftSwitch() for _ in range(n_leaves + 1)]
    servers = [SoftSwitchServer(sw) for sw in switches]
    spine_addr = servers[-1].address
    for j in range(n_leaves):
        mine = {w: workers[w].getsockname() for w in range(j * per_leaf, (j + 1) * per_leaf)}
        switches[j].add_job(leaf_job(1, mine, n, spine_addr, j, pool_size=16, elems_per_packet=K))
    leaves = [s.address for s in servers[:-1]]
    switches[-1].add_job(spine_job(1, leaves, pool_size=16, elems_per_packet=K))
    return workers, switches, servers


@pytest.mark.parametrize(("n_leaves", "per_leaf"), [(2, 1), (4, 1), (2, 3)])
def test_one_thread_serves_a_whole_tree(n_leaves: int, per_leaf: int):
    workers, switches, servers = _tree(n_leaves, per_leaf)
    n, slots = len(workers), 5
    rng = np.random.default_rng(n)
    values = rng.integers(-1000, 1000, size=(n, slots, K), dtype=np.int64)
    before = {t.name for t in threading.enumerate()}
    loop = SharedLoopServer(servers).start()
    try:
        started = [t.name for t in threading.enumerate() if t.name not in before]
        assert started == ["softswitch-loop"]  # one thread for every switch of the tree
        for w, sock in enumerate(workers):
            for s in range(slots):
                sock.sendto(_grad(w, values[w, s], s), servers[w // per_leaf].address)
        want = values.sum(axis=0)
        for sock in workers:
            got = {}
            while len(got) < slots:
                data = sock.recv(2048)
                h = Header.unpack(data)
                assert (h.op, h.count, h.bitmap) == (Op.RESULT, n, (1 << n) - 1)
                got[h.slot] = np.frombuffer(data, ">i4", count=K, offset=HEADER_BYTES)
            for s in range(slots):
                np.testing.assert_array_equal(got[s], want[s])
    finally:
        loop.stop()
    for j in range(n_leaves):
        c = switches[j].read_counters(1)
        assert (c["up_partial"], c["down_result"]) == (slots, slots)
    assert switches[-1].read_counters(1)["result_quorum"] == slots
    assert all(s.sock.fileno() == -1 for s in servers)  # stop() closed every switch's socket
    for sock in workers:
        sock.close()


def test_a_flat_switch_on_the_loop_answers_as_on_its_own_thread():
    workers = [_udp() for _ in range(3)]
    sw = SoftSwitch()
    server = SoftSwitchServer(sw)
    sw.add_job(JobConfig(1, [s.getsockname() for s in workers], None, 16, K))
    with SharedLoopServer([server]):
        x = np.arange(3 * K).reshape(3, K)
        for w, sock in enumerate(workers):
            sock.sendto(_grad(w, x[w], 0), server.address)
        for sock in workers:
            data = sock.recv(2048)
            assert Header.unpack(data).count == 3
            np.testing.assert_array_equal(np.frombuffer(data, ">i4", count=K, offset=HEADER_BYTES), x.sum(0))
    for sock in workers:
        sock.close()


def test_needs_a_server():
    with pytest.raises(ValueError, match="at least one"):
        SharedLoopServer([])
