"""`lta softswitch --shards N`: N processes on one UDP address, the kernel steers the slot's block of 128
((slot >> 7) % N) to shard i."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from hostlib import codec
from hostlib.batchio import available_modes
from hostlib.protocol import HEADER_BYTES, SLOT_BLOCK_BITS, Header, Op, make_packet
from hostlib.transport import LtaWorker, TransportConfig
from softswitch.shards import ShardedSoftSwitch, shard_sockets, steering_program
from tests.conftest import run_workers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT steering is Linux")

JOB = 3
K = 64
SLOTS = 512  # the pool of write_config: 4 blocks of 128 slots


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bound_sockets(n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.settimeout(5.0)
        socks.append(s)
    return socks


def write_config(path, worker_addrs, pool_size=512) -> str:
    workers = ", ".join(f'"{h}:{p}"' for h, p in worker_addrs)
    path.write_text(
        f"seed = 1\n[[jobs]]\njob_id = {JOB}\nworkers = [{workers}]\n"
        f"pool_size = {pool_size}\nelems_per_packet = {K}\n"
    )
    return str(path)


def shard_of(slot: int, n: int) -> int:
    return (slot >> SLOT_BLOCK_BITS) % n


@pytest.mark.parametrize("n", [2, 3, 4])
def test_kernel_steers_slot_blocks_mod_n_to_socket_in_bind_order(n):
    """The BPF program sees the UDP payload at offset 0: socket i gets exactly the slots whose block of
    128 is i mod n. Slots above 255 too, so both bytes of the big-endian u16 matter."""
    socks = shard_sockets(("127.0.0.1", 0), n)
    port = socks[0].getsockname()[1]
    assert all(s.getsockname() == ("127.0.0.1", port) for s in socks)
    slots = [*range(0, SLOTS, 7), 127, 128, 255, 256, 257, 1000, 65535]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            for slot in slots:
                tx.sendto(make_packet(Op.GRAD, job_id=JOB, slot=slot, seq=1), ("127.0.0.1", port))
        got: list[list[int]] = [[] for _ in range(n)]
        for i, s in enumerate(socks):
            s.settimeout(0.5)
            while len(got[i]) < len([x for x in slots if shard_of(x, n) == i]):
                got[i].append(Header.unpack(s.recv(2048)).slot)
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(2048)
        for i in range(n):
            assert got[i] == [x for x in slots if shard_of(x, n) == i]
    finally:
        for s in socks:
            s.close()


def test_steering_program_shape():
    # ldh [8]; rsh #7; and #3; ret a
    assert steering_program(4) == [(0x28, 0, 0, 8), (0x74, 0, 0, 7), (0x54, 0, 0, 3), (0x16, 0, 0, 0)]
    assert steering_program(3)[2] == (0x94, 0, 0, 3)  # mod #3
    for bad in (0, -1, 65):
        with pytest.raises(ValueError, match="shards"):
            steering_program(bad)


def _recv_results(
    sock: socket.socket, n: int, switch: tuple[str, int]
) -> dict[int, tuple[Header, np.ndarray]]:
    out = {}
    for _ in range(n):
        data, src = sock.recvfrom(4096)
        assert src == switch  # every shard answers from the one address
        hdr = Header.unpack(data)
        assert hdr.op == Op.RESULT
        out[hdr.slot] = (hdr, np.frombuffer(data[HEADER_BYTES:], dtype=">i4").astype(np.int64))
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_shards_serve_their_slots_and_complete_rounds(tmp_path, n):
    workers = bound_sockets(2)
    cfg = write_config(tmp_path / "switch.toml", [w.getsockname() for w in workers])
    rng = np.random.default_rng(n)
    with ShardedSoftSwitch(cfg, ("127.0.0.1", 0), n, report_every=30.0) as sharded:
        switch = sharded.address
        before = sharded.collect()
        assert [r["counters"][JOB]["rx_packets"] for r in before] == [0] * n
        # One phase per shard: only slots of its blocks, and only shard i may count them.
        for i in range(n):
            slots = [s for s in range(0, SLOTS, 5) if shard_of(s, n) == i]
            payload = rng.integers(-(2**29), 2**29, size=(2, len(slots), K), dtype=np.int64)
            for j, slot in enumerate(slots):
                for w in range(2):
                    pkt = make_packet(
                        Op.GRAD, job_id=JOB, worker_id=w, slot=slot, seq=1, payload=payload[w, j]
                    )
                    workers[w].sendto(pkt, switch)
            expected = payload.sum(axis=0)  # int64: the exact sums, below 2^31
            for w in range(2):
                got = _recv_results(workers[w], len(slots), switch)
                assert sorted(got) == slots
                for j, slot in enumerate(slots):
                    hdr, acc = got[slot]
                    assert (hdr.count, hdr.bitmap, hdr.seq) == (2, 0b11, 1)
                    np.testing.assert_array_equal(acc, expected[j])
            reports = sharded.collect()
            for k, report in enumerate(reports):
                c, was = report["counters"][JOB], before[k]["counters"][JOB]
                grown = {name: c[name] - was[name] for name in c if c[name] != was[name]}
                if k == i:
                    m = len(slots)
                    assert grown == {
                        "rx_packets": 2 * m,
                        "grad_start": m,
                        "grad_add": m,
                        "result_quorum": m,
                        "tx_packets": 2 * m,
                    }
                else:
                    assert grown == {}, f"shard {k} counted packets of shard {i}'s slots"
            before = reports
        totals = sharded.totals()
        sent = len(range(0, SLOTS, 5))
        assert totals[JOB]["result_quorum"] == sent and totals[JOB]["rx_packets"] == 2 * sent
        pids = sharded.pids
    assert sharded.error is None
    for pid in pids:  # stopped and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for w in workers:
        w.close()


def start_daemon(port: int, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "lta.cli", "softswitch", "--listen", f"127.0.0.1:{port}", *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_shard_daemon_reduces_end_to_end(tmp_path):
    """Real workers, which send GSO trains: every slot's datagrams must reach the shard that owns it (a train
    steered whole by its first datagram never spans two blocks), or rounds would split between shards."""
    pool = 256  # two blocks, one per shard; a reduce of 40,000 values takes several rounds of every slot
    ports = [free_udp_port() for _ in range(2)]
    switch_port = free_udp_port()
    cfg = write_config(tmp_path / "switch.toml", [("127.0.0.1", p) for p in ports], pool_size=pool)
    proc = start_daemon(switch_port, "--config", cfg, "--shards", "2", "--stats-every", "0.2")
    try:
        assert "listening" in proc.stderr.readline()
        config = TransportConfig(elems_per_packet=K, pool_size=pool, sync_deadline_ms=1000)
        workers = [
            LtaWorker(JOB, w, 2, ("127.0.0.1", switch_port), config=config, bind=("127.0.0.1", p))
            for w, p in enumerate(ports)
        ]
        rng = np.random.default_rng(5)
        for _ in range(3):
            x = [rng.standard_normal(40_000).astype(np.float32) * 10 ** rng.uniform(-3, 3) for _ in range(2)]
            exact = np.stack(x).astype(np.float64).mean(axis=0)
            results = run_workers(workers, lambda w, i, x=x: w.allreduce(x[i]))
            for r in results:
                assert np.all(r.count == 2)
                bound = np.repeat(codec.error_bound(r.shift), K)[: len(exact)]
                assert np.all(np.abs(r.values - exact) < bound + np.abs(exact) * 2**-24)
        if "gso-c" in available_modes():  # the case this test is about: trains, steered whole
            assert all(w.io.batch.stats.gso_trains_sent > 0 for w in workers)
        for w in workers:
            w.close()
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    last = json.loads(out.strip().splitlines()[-1])  # the final totals, summed over both shards
    assert last[str(JOB)]["grad_start"] == last[str(JOB)]["result_quorum"] > 0
    assert last[str(JOB)]["drop_bad_worker"] == 0


def test_shards_zero_and_p4runtime_are_refused():
    for args, message in (
        (["--shards", "0"], "--shards: must be in 1..64"),
        (["--shards", "x"], "--shards: not an integer"),
        (["--shards", "2", "--p4runtime", "127.0.0.1:1"], "cannot be combined with --p4runtime"),
    ):
        # refused at once: a softswitch that started would serve until the timeout raised
        proc = subprocess.run(
            [sys.executable, "-m", "lta.cli", "softswitch", "--listen", "127.0.0.1:1", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
