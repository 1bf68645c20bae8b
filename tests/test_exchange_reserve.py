"""A dead owner's shard is served again: every survivor ends with the same copy of it.

Workers are threads on one softswitch with emulated PARAM loss (seeded), so each survivor holds its own
mix of the dead owner's earlier publishes. The independent expectation: the copy the re-server (the
lowest-numbered survivor) held when the owner died, bit for bit, on every survivor; and, as the test's
precondition, that the survivors' copies differed then (what the old code kept for good).
"""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.torch_ext.exchange import ParamExchange
from hostlib.torch_ext.layout import ShardLayout
from hostlib.torch_ext.sharded import ShardedOptimizer
from tests.conftest import run_workers

torch.set_num_threads(1)


class _Killed(Exception):
    """Raised in the thread of a rank that 'dies' (its socket and heartbeat closed) mid-step."""


class _Meet:
    """A barrier that keeps its threads' transports polled while they wait, as a rank blocked between
    steps should (exchange.py: it answers requests only from inside its transport)."""

    def __init__(self, parties: int) -> None:
        self.parties, self.arrived, self.lock = parties, {}, threading.Lock()

    def wait(self, worker, key: int) -> None:
        with self.lock:
            self.arrived[key] = self.arrived.get(key, 0) + 1
        _wait_for(lambda: self.arrived[key] >= self.parties, f"every party met at {key}", poll=worker.poll)


def _wait_for(condition, what: str, limit_s: float = 60.0, poll=None) -> None:
    """Block until ``condition()`` (an ordering device between threads, not a timed assertion),
    calling ``poll(0.01)`` meanwhile if given."""
    done = threading.Event()
    for _ in range(int(limit_s / 0.01)):
        if condition():
            return
        if poll is not None:
            poll(0.01)
        else:
            done.wait(0.01)
    raise AssertionError(f"never happened: {what}")


@pytest.mark.parametrize("late", [0, 2])
def test_survivors_end_with_the_reservers_copy_of_a_dead_owners_shard(make_cluster, late):
    """Rank 3 dies before it publishes step ``t``. The survivors give it up one liveness timeout into
    their wait for its end marker, at different moments: survivor ``late`` starts its collect only
    after the other two have given rank 3 up (late=0: the re-server itself learns of the death from
    their requests; late=2: the re-served copy is in its inbox before it gives rank 3 up)."""
    n, k, per_owner, dies_at, extra = 4, 16, 12, 3, 2
    cluster = make_cluster(n, elems_per_packet=k, seed=3)
    cluster.switch.set_drop_policy(cluster.job_id, "param", DropPolicy(p=0.3))
    layout = ShardLayout.contiguous(n * per_owner * k, k, n)
    rows = [np.zeros((layout.n_chunks, k), np.float32) for _ in range(n)]
    exchanges = [
        ParamExchange(w, layout, rows[i], deadline_ms=20_000.0, resend_timeout_s=10.0, liveness_timeout_s=0.5)
        for i, w in enumerate(cluster.workers)
    ]
    dead_chunks = layout.chunks_of(n - 1)
    at_death: dict[int, np.ndarray] = {}
    meet = _Meet(n - 1)

    def body(worker, i):
        ex = exchanges[i]
        rng = np.random.default_rng(100 + i)
        for t in range(dies_at + 1 + extra):
            mine = layout.chunks_of(i)
            rows[i][mine] += rng.standard_normal((len(mine), k)).astype(np.float32)
            if i == n - 1 and t == dies_at:
                worker.close()  # dies before its publish
                return
            ex.publish(t)
            if t == dies_at:
                at_death[i] = rows[i][dead_chunks].copy()
                if i == late:
                    others = [r for r in range(n - 1) if r != late]
                    _wait_for(
                        lambda o=others: all(exchanges[r].stats.owners_given_up for r in o),
                        "the other survivors gave rank 3 up",
                    )
            ex.collect(t)
            if t >= dies_at:
                meet.wait(worker, t)  # (survivors only) every one through the step before the next

    run_workers(cluster.workers, body)
    reserver_copy = at_death[0]
    assert any(not np.array_equal(at_death[i], reserver_copy) for i in (1, 2)), (
        "the survivors' copies agreed when the owner died: PARAM loss did not set them apart"
    )
    for i in range(n - 1):
        np.testing.assert_array_equal(rows[i][dead_chunks], reserver_copy, err_msg=f"survivor {i}")
    assert exchanges[0].stats.reserved_chunks_sent >= len(dead_chunks)
    assert all(exchanges[i].stats.reserved_chunks_taken > 0 for i in (1, 2))
    assert all(exchanges[i].stats.reserved_chunks_sent == 0 for i in (1, 2))


def test_a_rank_that_rejoins_after_the_reserve_takes_the_reserved_copy(make_cluster):
    """Rank 3 dies; rank 0 serves its shard again; then rank 2 'restarts': a new exchange that adopts a
    donor's replica at a later step (chaos seed 26: the restarted rank's made-up held steps were newer
    than the re-serve's tag, so it refused the re-served copies and waited 30 s for them). Its donor
    here had kept its own copy of the dead shard (not the re-served one): the rank must end with the
    re-server's copy all the same."""
    n, k, per_owner, dies_at, extra = 4, 16, 12, 3, 3
    cluster = make_cluster(n, elems_per_packet=k, seed=5)
    cluster.switch.set_drop_policy(cluster.job_id, "param", DropPolicy(p=0.3))
    layout = ShardLayout.contiguous(n * per_owner * k, k, n)
    rows = [np.zeros((layout.n_chunks, k), np.float32) for _ in range(n)]
    options = {"deadline_ms": 20_000.0, "resend_timeout_s": 10.0, "liveness_timeout_s": 0.5}
    exchanges = [ParamExchange(w, layout, rows[i], **options) for i, w in enumerate(cluster.workers)]
    dead_chunks = layout.chunks_of(n - 1)
    at_death: dict[int, np.ndarray] = {}
    meet = _Meet(n - 1)
    rejoin_at = dies_at + 2

    def body(worker, i):
        rng = np.random.default_rng(200 + i)
        for t in range(dies_at + 1 + extra):
            mine = layout.chunks_of(i)
            if i == 2 and t == rejoin_at:  # a new process: a donor's replica, its old copy of 3's shard
                donor = rows[0].copy()
                donor[dead_chunks] = at_death[2]
                rows[2][:] = donor
                exchanges[2] = ParamExchange(worker, layout, rows[2], **options)
                exchanges[2].adopt(t)
            rows[i][mine] += rng.standard_normal((len(mine), k)).astype(np.float32)
            if i == n - 1 and t == dies_at:
                worker.close()
                return
            exchanges[i].publish(t)
            if t == dies_at:
                at_death[i] = rows[i][dead_chunks].copy()
            exchanges[i].collect(t)
            if t >= dies_at:
                meet.wait(worker, t)

    run_workers(cluster.workers, body)
    reserver_copy = at_death[0]
    assert not np.array_equal(at_death[2], reserver_copy), "rank 2's own copy was the re-server's already"
    for i in range(n - 1):
        np.testing.assert_array_equal(rows[i][dead_chunks], reserver_copy, err_msg=f"survivor {i}")
    assert exchanges[2].stats.reserved_chunks_taken >= len(dead_chunks)


def test_sharded_survivors_hold_one_copy_of_a_killed_owners_shard_under_param_loss(make_cluster):
    """Chaos's kill between a sharded owner's reduce and its publish, with 30% PARAM loss on the
    shards' non-critical chunks: the survivors' copies of the dead rank's shard end bit-identical,
    equal to rank 0's (the re-server's) copy at the death; no survivor waits out resend_timeout_s."""
    from hostlib.liveness import LivenessMonitor

    n, steps, dies_at, liveness_s = 4, 7, 3, 1.5
    wait = {f"{name}_deadline_ms": 20_000.0 for name in ("sync", "lag", "min", "max")}
    cluster = make_cluster(n, elems_per_packet=16, heartbeat_interval_s=0.1, seed=7, **wait)
    cluster.switch.set_drop_policy(cluster.job_id, "param", DropPolicy(p=0.3))
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    inputs = [torch.randn(16, 12, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    models = [copy.deepcopy(base) for _ in range(n)]
    at_death: dict[int, np.ndarray] = {}

    def train(worker, i):
        opt = ShardedOptimizer(
            torch.optim.SGD(models[i].parameters(), lr=0.1, momentum=0.9),
            worker,
            critical="default",
            module=models[i],
            resend_timeout_s=10.0,
            liveness_timeout_s=2 * liveness_s,
        )
        lo, hi = opt.layout.shard_range(n - 1)
        owned = opt.layout.owners == n - 1
        assert opt.critical_mask[owned].any() and not opt.critical_mask[owned].all()
        if i == n - 1:

            def die(step, **kwargs):
                if step == dies_at:
                    worker.close()  # after its reduce, before its publish; its heartbeat stops too
                    raise _Killed
                publish(step, **kwargs)

            publish = opt.exchange.publish
            opt.exchange.publish = die
        try:
            for t in range(steps):
                if t == dies_at:
                    at_death[i] = opt.replica()[lo:hi]
                models[i](inputs[i]).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        except _Killed:
            return None
        return opt, opt.replica()[lo:hi]

    with LivenessMonitor(cluster.switch, cluster.job_id, n, timeout_s=liveness_s, poll_s=0.05):
        out = run_workers(cluster.workers, train)
    assert out[n - 1] is None
    reserver_copy = at_death[0]
    assert any(not np.array_equal(at_death[i], reserver_copy) for i in (1, 2)), (
        "the survivors' copies agreed at the death: PARAM loss did not set them apart"
    )
    for i in range(n - 1):
        np.testing.assert_array_equal(out[i][1], reserver_copy, err_msg=f"survivor {i}")
    assert out[0][0].exchange.stats.reserved_chunks_sent > 0
