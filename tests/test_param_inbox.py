"""The parameter inbox (hostlib/transport/inbox.py): PARAM rows kept in growing arrays, the newest
arrival of each chunk handed out in arrival order, rows put back ahead of what came since. Checked on
hand-made rows and on PARAM packets built by hand and sent to a worker's socket, against the floats sent."""

from __future__ import annotations

import socket
import time

import numpy as np

from hostlib.protocol import ALIVE_CHUNK, HEAL_CHUNK_BASE, Op, make_packet
from hostlib.transport import LtaWorker, TransportConfig
from hostlib.transport.inbox import ParamInbox

K = 8


def _rows(chunks: list[int], base: float) -> tuple[np.ndarray, ...]:
    m = len(chunks)
    values = (base + np.arange(m * K, dtype=np.float32).reshape(m, K)).astype(">f4")  # wire byte order
    return np.array(chunks), np.arange(m) + 10, np.full(m, 3), np.full(m, K), values


def test_the_newest_arrival_of_each_chunk_in_arrival_order_and_growth_past_the_first_capacity():
    inbox = ParamInbox(K)
    inbox.add(*_rows(list(range(50)), 0.0))
    inbox.add(*_rows([7, 100, 3] + list(range(200, 230)), 1000.0))  # 7 and 3 again: newer copies
    assert len(inbox) == 83
    got = inbox.take()
    assert len(inbox) == 0
    expected = [c for c in range(50) if c not in (3, 7)] + [7, 100, 3] + list(range(200, 230))
    assert got.chunk.tolist() == expected
    assert got.values.dtype == np.float32 and got.values.dtype.isnative
    i7 = expected.index(7)
    np.testing.assert_array_equal(got.values[i7], 1000.0 + np.arange(K))  # the second batch's row 0
    assert got.step[i7] == 10 and got.sender[i7] == 3 and got.nelem[i7] == K
    i49 = expected.index(49)
    np.testing.assert_array_equal(got.values[i49], 49 * K + np.arange(K))


def test_rows_put_back_come_before_what_arrived_since_and_a_newer_copy_wins():
    inbox = ParamInbox(K)
    inbox.add(*_rows([1, 2], 0.0))
    later = inbox.take()
    inbox.add(*_rows([2, 5], 500.0))  # chunk 2 again, newer, while the reader held the first batch
    inbox.put_back(later)
    got = inbox.take()
    assert got.chunk.tolist() == [1, 2, 5]
    np.testing.assert_array_equal(got.values[0], np.arange(K))  # chunk 1: the copy put back
    np.testing.assert_array_equal(got.values[1], 500.0 + np.arange(K))  # chunk 2: the newer copy


def test_a_worker_files_hand_built_params_and_keeps_heal_rows_and_relays_out():
    sw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sw.bind(("127.0.0.1", 0))
    cfg = TransportConfig(elems_per_packet=K, heartbeat_interval_s=0)
    with LtaWorker(1, 0, 3, sw.getsockname(), config=cfg) as worker:
        sent = {}
        for chunk, sender, step in ((4, 1, 7), (9, 2, 7), (4, 2, 8)):
            values = np.float32(chunk * 100 + step) + np.arange(K, dtype=np.float32)
            sent[(chunk, step)] = values
            packet = make_packet(
                Op.PARAM, job_id=1, worker_id=sender, chunk=chunk, step=step, elems_per_packet=K,
                payload=values.view(np.int32), nelem=K,
            )  # fmt: skip
            sw.sendto(packet, worker.address)
        relay = make_packet(Op.PARAM, job_id=1, worker_id=1, chunk=ALIVE_CHUNK, elems_per_packet=K, nelem=0)
        heal = make_packet(
            Op.PARAM, job_id=1, worker_id=2, chunk=HEAL_CHUNK_BASE + 1, step=5, elems_per_packet=K,
            payload=np.full(K, 2.5, np.float32).view(np.int32), nelem=3,
        )  # fmt: skip
        sw.sendto(relay, worker.address)
        sw.sendto(heal, worker.address)
        deadline = time.monotonic() + 5.0
        while (len(worker.param_inbox) < 3 or not worker.heal_inbox) and time.monotonic() < deadline:
            worker.poll(0.05)
        got = worker.param_inbox.take()
        assert got.chunk.tolist() == [9, 4]  # chunk 4's newer copy (step 8) replaced the first
        assert got.step.tolist() == [7, 8] and got.sender.tolist() == [2, 2]
        np.testing.assert_array_equal(got.values[0], sent[(9, 7)])
        np.testing.assert_array_equal(got.values[1], sent[(4, 8)])
        np.testing.assert_array_equal(worker.heal_inbox[(2, 5)][1], np.full(3, 2.5, np.float32))
        assert worker.stats.heartbeats_relayed == 1
    sw.close()
