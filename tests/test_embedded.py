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
def test_self_hosted_windows_fit_the_switch_receive_buffer_together(force: bool, monkeypatch) -> None:  # noqa: ANN001
    """Every worker's window of 64 KiB datagrams in flight at once must fit the softswitch's one receive
    buffer (the kernel reports twice the usable bytes; a datagram takes its length plus ~64 of it), else
    the switch drops GRADs at 0% loss. Without CAP_NET_ADMIN (``force=False``) the buffer is what
    SO_RCVBUF grants and the windows shrink to it."""
    from hostlib.protocol import packet_bytes
    from hostlib.torch_ext.rendezvous import LtaOptions
    from hostlib.transport import TransportConfig
    from softswitch import server

    if not force:
        monkeypatch.setattr(server, "_force_receive_buffer", lambda sock, size: None)
    world, k = 4, 16367
    options = LtaOptions(job_id=7, transport=TransportConfig(elems_per_packet=k, health_timeout_s=2.0))
    sessions = join_in_threads(world, options)
    try:
        usable = sessions[0].embedded.rcvbuf_bytes // 2
        windows = [s.worker.window for s in sessions]
        assert all(w >= 2 for w in windows)
        assert sum(windows) * (packet_bytes(k) + 64) <= usable
    finally:
        for s in sessions:
            s.close()


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
