"""Seed 003's names at the torch API: ``window_size`` is the quorum, ``max_wait_s`` the step deadline
(``TransportConfig.reduce_timeout_s``); a name and its alias that disagree are an error."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from hostlib.torch_ext.rendezvous import LtaOptions, join_job
from hostlib.transport import TransportConfig


def test_window_size_is_the_quorum():
    assert LtaOptions(window_size=3).quorum == 3
    assert LtaOptions(quorum=2).window_size == 2
    assert LtaOptions(quorum=2, window_size=2).quorum == 2
    assert LtaOptions().quorum is None
    with pytest.raises(ValueError, match="quorum=2 and window_size=3 disagree"):
        LtaOptions(quorum=2, window_size=3)
    with pytest.raises(ValueError, match=">= 1"):
        LtaOptions(window_size=0)


def test_max_wait_s_is_the_step_deadline():
    assert LtaOptions(max_wait_s=2.5).transport.reduce_timeout_s == 2.5
    same = LtaOptions(max_wait_s=4.0, transport=TransportConfig(reduce_timeout_s=4.0))
    assert same.transport.reduce_timeout_s == 4.0
    with pytest.raises(ValueError, match="reduce_timeout_s=4.0 and max_wait_s=2.5 disagree"):
        LtaOptions(max_wait_s=2.5, transport=TransportConfig(reduce_timeout_s=4.0))
    with pytest.raises(ValueError, match="> 0 seconds"):
        LtaOptions(max_wait_s=0.0)
    assert LtaOptions().transport.reduce_timeout_s == TransportConfig().reduce_timeout_s


def test_the_quorum_reaches_the_self_hosted_switch():
    store = dist.HashStore()
    world = 2
    options = LtaOptions(window_size=1, job_id=5, transport=TransportConfig(health_timeout_s=2.0))
    sessions: list = [None] * world
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            sessions[rank] = join_job(store, rank, world, options, timedelta(seconds=20))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert not errors, errors
        assert sessions[0].switch.jobs[5].cfg.quorum == 1
    finally:
        for s in sessions:
            if s is not None:
                s.close()
    with pytest.raises(ValueError, match="quorum \\(window_size\\) 3 is more than the 2 workers"):
        join_job(dist.HashStore(), 0, 2, LtaOptions(quorum=3))
