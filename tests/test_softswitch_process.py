"""softswitch.process: a softswitch in a process of its own, configured over a pipe, its state handed back."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.protocol import HEADER_BYTES, Header, Op, make_packet
from softswitch.pipeline import JobConfig
from softswitch.process import SoftSwitchProcess

K = 8


def _socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(10)
    return s


def _grad(w: int, slot: int, values: np.ndarray) -> bytes:
    return make_packet(
        Op.GRAD, job_id=3, worker_id=w, slot=slot, seq=1, payload=values, elems_per_packet=K, nelem=K
    )


def test_a_switch_process_sums_hand_built_grads_and_hands_its_state_back():
    """Two workers' GRADs for one slot, sent by hand: each gets a RESULT with numpy's sum, count 2 and both
    bits; after stop the parent's switch reads the child's counters (2 packets in: a start, an add, a
    quorum close) and the slot's registers."""
    socks = [_socket(), _socket()]
    values = np.array([[1, -2, 3, 4, 5, 6, 7, 8], [10, 20, -30, 40, 50, 60, 70, 80]], dtype=np.int32)
    proc = SoftSwitchProcess(seed=5).start()
    try:
        proc.add_job(JobConfig(3, [s.getsockname() for s in socks], pool_size=4, elems_per_packet=K))
        for w, s in enumerate(socks):
            s.sendto(_grad(w, 2, values[w]), proc.address)
        for s in socks:
            data, source = s.recvfrom(4096)
            assert source == proc.address
            header = Header.unpack(data)
            got = (header.op, header.slot, header.seq, header.count, header.bitmap)
            assert got == (Op.RESULT, 2, 1, 2, 0b11)
            payload = np.frombuffer(data, dtype=">i4", offset=HEADER_BYTES)
            assert np.array_equal(payload, values.sum(axis=0))
    finally:
        proc.stop()
        for s in socks:
            s.close()
    counters = proc.switch.read_counters(3)
    assert counters["rx_packets"] == 2
    assert (counters["grad_start"], counters["grad_add"], counters["result_quorum"]) == (1, 1, 1)
    assert counters["tx_packets"] == 2
    slots = proc.switch.jobs[3].slots
    assert slots.seq[2] == 1 and slots.count[2] == 2 and slots.closed[2] == 1 and slots.bitmap[2] == 0b11
    assert np.array_equal(slots.acc[2], values.sum(axis=0))
    assert proc.switch.read_worker_rx(3) == [1, 1]


def test_a_switch_process_applies_drop_policies_and_raises_the_childs_errors():
    """An up policy dropping everything reaches the child (the GRAD is counted as dropped, nothing comes
    back); adding the job twice raises the child's ValueError in the parent."""
    sock = _socket()
    sock.settimeout(0.5)
    with SoftSwitchProcess() as proc:
        cfg = JobConfig(3, [sock.getsockname()], pool_size=4, elems_per_packet=K)
        proc.add_job(cfg)
        proc.set_drop_policy(3, "up", DropPolicy(p=1.0))
        with pytest.raises(ValueError, match="job 3 exists"):
            proc.add_job(cfg)
        sock.sendto(_grad(0, 0, np.ones(K, np.int32)), proc.address)
        with pytest.raises(TimeoutError):
            sock.recvfrom(4096)
    sock.close()
    counters = proc.switch.read_counters(3)
    assert counters["rx_packets"] == 1 and counters["drop_policy_up"] == 1 and counters["grad_start"] == 0


def test_a_switch_process_that_cannot_listen_says_so():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        proc = SoftSwitchProcess(listen=("127.0.0.1", port))
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
            proc.start()
