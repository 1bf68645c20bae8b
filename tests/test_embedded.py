"""The embedded softswitch (rank 0 without LTA_SWITCH) shares its process's GIL with training: while it
runs, the interpreter hands the GIL over every 0.5 ms instead of 5 ms, and gets its setting back on stop."""

from __future__ import annotations

import sys

import pytest

from hostlib.torch_ext.embedded import SWITCH_INTERVAL_S, EmbeddedSwitch
from tests.ranks import join_in_threads


@pytest.mark.parametrize("before", [0.005, 0.0001])
def test_switch_interval_lowered_while_running_and_restored(before: float) -> None:
    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(before)
        switch = EmbeddedSwitch(0, ("127.0.0.1", 0))
        try:
            assert sys.getswitchinterval() == pytest.approx(
                min(before, SWITCH_INTERVAL_S), abs=2e-6
            )  # kept in µs
        finally:
            switch.stop()
        assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)
    finally:
        sys.setswitchinterval(saved)


@pytest.mark.parametrize("force", [True, False])
@pytest.mark.parametrize("sockets", [1, 4])
def test_self_hosted_windows_fit_the_switch_receive_buffers(force: bool, sockets: int, monkeypatch) -> None:  # noqa: ANN001
    """The windows of 64 KiB datagrams in flight at once of every worker steered to one socket of the
    softswitch must fit its receive buffer (the kernel reports twice the usable bytes; a datagram takes
    its length plus ~64 of it), else the switch drops GRADs at 0% loss. Without CAP_NET_ADMIN
    (``force=False``) a buffer is what SO_RCVBUF grants (net.core.rmem_max) and the windows shrink to
    it; with one socket per worker (the default) each worker has a whole buffer to itself."""
    from hostlib.protocol import packet_bytes
    from hostlib.torch_ext.rendezvous import LtaOptions
    from hostlib.transport import LtaWorker, TransportConfig
    from softswitch import reuseport

    if not force:
        monkeypatch.setattr(reuseport, "force_receive_buffer", lambda sock, size: None)
    world, k = 4, 16367
    transport = TransportConfig(elems_per_packet=k, health_timeout_s=2.0)
    options = LtaOptions(job_id=7, transport=transport, switch_sockets=None if sockets == world else sockets)
    sessions = join_in_threads(world, options)
    try:
        assert sessions[0].embedded.sockets == sockets
        usable = sessions[0].embedded.rcvbuf_bytes // 2
        windows = [s.worker.window for s in sessions]
        assert all(w >= 2 for w in windows)
        for first in range(sockets):  # workers first, first + sockets, ... share socket `first`
            assert sum(windows[first::sockets]) * (packet_bytes(k) + 64) <= usable
        if sockets == world:  # a whole buffer each: the window a worker alone with that buffer gets
            with LtaWorker(7, 0, world, sessions[0].embedded.address, config=options.transport) as fresh:
                alone = min(fresh.window, fresh.units_in_buffer(2 * usable, 1))
            assert windows == [alone] * world
    finally:
        for s in sessions:
            s.close()


def test_the_switch_steers_each_worker_to_socket_worker_id_mod_sockets() -> None:
    """Three sockets share the switch's address; a datagram whose LTA header names worker w (byte 6,
    docs/protocol.md) lands in socket w mod 3, whichever port it came from: hand-built datagrams from
    one client socket, worker ids 0..5 once each, then worker 4 five times."""
    import socket
    import time

    from softswitch.pipeline import SoftSwitch
    from softswitch.server import SoftSwitchServer

    def datagram(worker: int) -> bytes:
        header = bytearray(36)
        header[6] = worker
        return bytes(header)

    with (
        SoftSwitchServer(SoftSwitch(), sockets=3) as srv,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c,
    ):
        assert srv.sockets == 3
        for w in range(6):
            c.sendto(datagram(w), srv.address)
        for _ in range(5):
            c.sendto(datagram(4), srv.address)
        deadline = time.monotonic() + 10
        while sum(srv.rx_datagrams) < 11 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.rx_datagrams == [2, 2 + 5, 2]


def test_an_allreduce_through_four_sockets_is_the_mean() -> None:
    """Four workers, one socket each: every chunk of an allreduce equals numpy's mean of the four inputs
    (no loss: count 4 everywhere), and each socket received packets."""
    import numpy as np

    from hostlib import codec
    from hostlib.transport import LtaWorker, TransportConfig
    from softswitch.pipeline import JobConfig, SoftSwitch
    from softswitch.server import SoftSwitchServer
    from tests.conftest import run_workers

    switch = SoftSwitch()
    with SoftSwitchServer(switch, sockets=4) as srv:
        cfg = TransportConfig(elems_per_packet=256)
        workers = [LtaWorker(1, w, 4, srv.address, config=cfg) for w in range(4)]
        try:
            switch.add_job(JobConfig(1, [w.address for w in workers], elems_per_packet=256))
            rng = np.random.default_rng(3)
            x = [rng.standard_normal(256 * 40 + 7).astype(np.float32) for _ in range(4)]
            results = run_workers(workers, lambda w, i: w.allreduce(x[i]))
            expected = np.stack(x).astype(np.float64).mean(axis=0)
            for r in results:
                assert np.all(r.count == 4)
                bound = np.repeat(codec.error_bound(r.shift), 256)[: expected.size]
                assert np.all(np.abs(r.values - expected) <= bound + np.abs(expected) * 2**-23)
            assert all(n > 0 for n in srv.rx_datagrams)
        finally:
            for w in workers:
                w.close()


def test_a_window_set_by_the_user_is_kept() -> None:
    from hostlib.torch_ext.rendezvous import LtaOptions
    from hostlib.transport import TransportConfig

    transport = TransportConfig(elems_per_packet=16367, window=200, health_timeout_s=2.0)
    sessions = join_in_threads(2, LtaOptions(job_id=8, transport=transport))
    try:
        assert [s.worker.window for s in sessions] == [200, 200]
    finally:
        for s in sessions:
            s.close()
