"""Seed 003's names at the torch API: ``window_size`` is the quorum, ``max_wait_s`` the step deadline
(``TransportConfig.reduce_timeout_s``); a name and its alias that disagree are an error."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hostlib.torch_ext.rendezvous import LtaOptions, join_job
from hostlib.transport import TransportConfig
from tests.ranks import join_in_threads


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
    world = 2
    options = LtaOptions(window_size=1, job_id=5, transport=TransportConfig(health_timeout_s=2.0))
    sessions = join_in_threads(world, options)
    try:
        assert sessions[0].switch.jobs[5].cfg.quorum == 1
    finally:
        for s in sessions:
            if s is not None:
                s.close()
    with pytest.raises(ValueError, match="quorum \\(window_size\\) 3 is more than the 2 workers"):
        join_job(dist.HashStore(), 0, 2, LtaOptions(quorum=3))
