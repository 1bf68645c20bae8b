"""A rank that fell behind its peers (stopped past ``catch_up_reduces`` reduces) takes a live peer's state
and goes on at their step instead of raising (hostlib/torch_ext/heal.py), in the sharded doors and the
DDP hook. Workers are threads on one softswitch; a "stop" is a thread that sleeps with its heartbeat off
(the liveness monitor marks it offline and lowers the quorum, as for a SIGSTOPped process) until its
peers are ``AHEAD`` steps past it, then comes back with its heartbeat on.

Expectations are independent of the healing code: the sharded doors' replicas after a reliable
``synchronize`` are identical (every owner's shard, the design's claim), the step counters of every rank
meet, the rank behind made fewer steps of its own than its peers (it skipped ahead); the hook's rank
holds, right after healing, exactly the parameters and momentum its donor held at the step boundary it
served from (read off the donor's own model and optimizer at that moment), and its replica ends within
the hook's bound of its peers: (re-broadcast period + 1) x the largest one-step change.
"""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest
import torch

from hostlib.liveness import LivenessMonitor
from hostlib.torch_ext.ddp_hook import LtaHookState
from hostlib.torch_ext.sharded import ShardedOptimizer
from hostlib.transport.heartbeat import Heartbeat
from tests.conftest import run_workers

torch.set_num_threads(1)

N, STEPS, STOP_AT, AHEAD = 4, 24, 3, 10
LIVENESS_S = 0.5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


class _Stop:
    """Rank ``N - 1`` stops at its step ``STOP_AT``: heartbeat off, asleep until rank 0 has reached step
    ``STOP_AT + AHEAD`` (its peers ran on at the quorum the monitor lowered), then heartbeat on."""

    def __init__(self) -> None:
        self.peers_ahead = threading.Event()
        self.stopped = False

    def maybe_stop(self, worker, rank: int, step: int) -> None:
        if rank == 0 and step >= STOP_AT + AHEAD:
            self.peers_ahead.set()
        if rank != N - 1 or self.stopped or step != STOP_AT:
            return
        self.stopped = True
        beat = worker.heartbeat
        beat.stop()
        assert self.peers_ahead.wait(60), "the peers did not run on without the stopped rank"
        worker.heartbeat = Heartbeat(
            worker.sock,
            worker.switch_addr,
            job_id=worker.job_id,
            worker_id=worker.worker_id,
            elems_per_packet=worker.config.elems_per_packet,
            interval_s=beat.interval_s,
        ).start()


def _cluster(make_cluster):
    # A pool of 64 slots: a few steps (41 chunks each) reuse every slot, so the stored RESULTs of the
    # rounds the stopped rank missed are gone (with more slots it would replay them: no rank behind).
    return make_cluster(N, elems_per_packet=16, pool_size=64, heartbeat_interval_s=0.1, catch_up_reduces=2)


@pytest.mark.parametrize("critical", [None, "default"], ids=["sharded", "sharded-critical"])
def test_a_stopped_rank_takes_a_peers_copies_and_ends_identical_in_the_sharded_doors(make_cluster, critical):
    cluster = _cluster(make_cluster)
    base = _model()
    models = [copy.deepcopy(base) for _ in range(N)]
    inputs = [torch.randn(16, 12, generator=torch.Generator().manual_seed(i)) for i in range(N)]
    stop = _Stop()

    def train(worker, i):
        opt = ShardedOptimizer(
            torch.optim.SGD(models[i].parameters(), lr=0.05, momentum=0.9),
            worker,
            critical=critical,
            module=models[i],
            liveness_timeout_s=LIVENESS_S,
        )
        calls = 0
        while opt.lta_step < STEPS:  # the door's step, which healing moves to its peers'
            stop.maybe_stop(worker, i, opt.lta_step)
            models[i](inputs[i]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            calls += 1
        opt.synchronize()  # every owner's current shard to every rank, reliably
        return opt, calls

    with LivenessMonitor(cluster.switch, cluster.job_id, N, timeout_s=LIVENESS_S, poll_s=0.05):
        done = run_workers(cluster.workers, train)
    opts, calls = [d[0] for d in done], [d[1] for d in done]
    assert stop.stopped
    assert opts[N - 1].healer.healed >= 1, "the rank behind never took a peer's state"
    assert calls[N - 1] < min(calls[: N - 1]), f"the rank behind made as many steps as its peers: {calls}"
    assert {o.lta_step for o in opts} == {STEPS + 1}
    want = _flat(models[0])
    assert (want - _flat(base)).abs().max() > 1e-2, "nothing trained"
    for i in range(1, N):
        torch.testing.assert_close(
            _flat(models[i]), want, atol=0, rtol=0, msg=lambda m, i=i: f"rank {i}: {m}"
        )


def test_a_stopped_rank_takes_a_peers_parameters_and_momentum_in_the_hook(make_cluster):
    """The DDP hook without DDP (one bucket per step: the flat gradient, reduced by
    ``LtaHookState.reduce_bucket`` as DDP's hook would), so that the ranks can be threads."""
    cluster = _cluster(make_cluster)
    base = _model()
    models = [copy.deepcopy(base) for _ in range(N)]
    inputs = [torch.randn(16, 12, generator=torch.Generator().manual_seed(i)) for i in range(N)]
    stop = _Stop()
    served: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # donor's step -> its params, momentum
    healed: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    changes = [0.0] * N
    period = 5

    def momentum(opt: torch.optim.Optimizer, model: torch.nn.Module) -> torch.Tensor:
        return torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()]).clone()

    def train(worker, i):
        model = models[i]
        state = LtaHookState(worker, rebroadcast_every=period)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state.attach(model, opt)
        healer = state.healer
        answer, heal = worker.engine.heal_responder, healer.heal

        def answer_recorded():
            held = (_flat(model), momentum(opt, model))  # what this rank holds when asked
            before = healer.served
            answer()
            if healer.served > before:
                served[state.step] = held

        def heal_recorded():
            step = heal()
            healed.append((step, _flat(model), momentum(opt, model)))
            return step

        worker.engine.heal_responder, healer.heal = answer_recorded, heal_recorded
        params = list(model.parameters())
        while state.step < STEPS:
            stop.maybe_stop(worker, i, state.step)
            before = _flat(model)
            loss = model(inputs[i]).pow(2).mean()  # the forward pre-hook heals, re-broadcasts, serves
            loss.backward()
            bucket = torch.cat([p.grad.reshape(-1) for p in params])
            state.reduce_bucket(0, bucket, is_last=True)
            offset = 0
            for p in params:
                p.grad.copy_(bucket[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            opt.step()
            opt.zero_grad()
            if not healed or i != N - 1 or healed[-1][0] != state.step - 1:
                changes[i] = max(changes[i], float((_flat(model) - before).abs().max()))
        return state

    with LivenessMonitor(cluster.switch, cluster.job_id, N, timeout_s=LIVENESS_S, poll_s=0.05):
        states = run_workers(cluster.workers, train)
    assert stop.stopped
    assert healed, "the rank behind never took a peer's state"
    assert {s.step for s in states} == {STEPS}
    for step, params, moment in healed:
        assert step in served, f"healed at step {step}, which no donor served ({sorted(served)})"
        torch.testing.assert_close(params, served[step][0], atol=0, rtol=0)
        torch.testing.assert_close(moment, served[step][1], atol=0, rtol=0)
    final = torch.stack([_flat(m) for m in models])
    assert (final[0] - _flat(base)).abs().max() > 1e-2, "nothing trained"
    bound = (period + 1) * max(changes)
    apart = float((final - final[0]).abs().max())
    assert apart <= bound, f"replicas apart by {apart:.3g} > {bound:.3g}"


def test_the_donors_state_travels_whole_and_exact_through_the_heal_stream(make_cluster):
    """Wire level: one rank's state (values that are not round in float32, and counters past 2^24)
    reaches a rank that asks for it bit for bit, with the donor's unit counter, which the rank's
    transport takes; only the donor asked answers."""
    from hostlib.torch_ext.heal import Healer

    cluster = make_cluster(3, elems_per_packet=16, heartbeat_interval_s=0)
    rng = np.random.default_rng(5)
    state = rng.standard_normal(1000).astype(np.float32)
    got: list = []

    def body(worker, i):
        if i == 2:
            healer = Healer(worker, lambda: (0, 0, [], state), lambda *a: got.append(a), timeout_s=20)
            worker.health.behind = True
            return healer.heal(), worker.codec_state()["next_unit"]
        healer = Healer(worker, lambda: (7 + 2**30, 12345, [2**40 + 3], state * (i + 1)), lambda *a: None)
        end = time.perf_counter() + 5
        while time.perf_counter() < end and not healer.served:
            worker.poll(0.01)  # the transport answers a request as it arrives
        return healer.served

    out = run_workers(cluster.workers, body)
    assert out[2] == (7 + 2**30, 12345)
    step, counters, values = got[0]
    assert counters == [2**40 + 3]
    donor = 0  # rank 2 asks (2 + 1) % 3 = 0 first
    np.testing.assert_array_equal(values, state * (donor + 1))
    assert out[0] == 1 and out[1] == 0


class _Killed(Exception):
    pass


@pytest.mark.parametrize("door", ["sharded", "sharded-critical", "hook"])
def test_a_restarted_rank_rejoins_takes_its_peers_state_and_ends_identical(make_cluster, door):
    """Rank ``N - 1`` is killed at step ``STOP_AT`` (its socket and heartbeat closed: the monitor marks it
    offline, the quorum drops) and started again once its peers are ``AHEAD`` steps on: a new worker
    on the address the switch knows, a freshly built model (other initial values) and optimizer; it
    rejoins, taking a live peer's state, and trains to the end with them. Sharded doors: after a
    reliable ``synchronize`` every replica is identical. Hook: the restarted rank holds right after
    rejoining exactly what its donor held when asked, and every replica ends within the hook's bound."""
    from hostlib.transport import LtaWorker

    cluster = _cluster(make_cluster)
    base = _model()
    models = [copy.deepcopy(base) for _ in range(N)]
    inputs = [torch.randn(16, 12, generator=torch.Generator().manual_seed(i)) for i in range(N)]
    peers_ahead = threading.Event()
    served: dict[int, torch.Tensor] = {}
    period = 5
    largest = [0.0]  # a steady rank's largest one-step change of a parameter

    def build(worker, model):
        if door == "hook":
            state = LtaHookState(worker, rebroadcast_every=period)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            state.attach(model, opt)
            return state, opt
        opt = ShardedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            worker,
            critical="default" if door == "sharded-critical" else None,
            module=model,
            liveness_timeout_s=LIVENESS_S,
        )
        return opt, opt

    def step_of(front) -> int:
        return front.step if door == "hook" else front.lta_step

    def one_step(front, opt, model, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        if door == "hook":
            params = list(model.parameters())
            bucket = torch.cat([p.grad.reshape(-1) for p in params])
            front.reduce_bucket(0, bucket, is_last=True)
            offset = 0
            for p in params:
                p.grad.copy_(bucket[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        opt.step()
        opt.zero_grad()

    def train(worker, i):
        front, opt = build(worker, models[i])
        if i == 0:
            answer = worker.engine.heal_responder

            def answer_recorded():
                held = _flat(models[0])
                before = front.healer.served
                answer()
                if front.healer.served > before:
                    served[step_of(front)] = held

            worker.engine.heal_responder = answer_recorded
        while step_of(front) < STEPS:
            if i == 0 and step_of(front) >= STOP_AT + AHEAD:
                peers_ahead.set()
            if i == N - 1 and step_of(front) == STOP_AT:
                address = worker.address
                worker.close()
                assert peers_ahead.wait(60), "the peers did not run on without the killed rank"
                worker = LtaWorker(
                    cluster.job_id, i, N, cluster.server.address, config=worker.config, bind=address
                )
                torch.manual_seed(99)  # the new process builds its model afresh
                models[i] = torch.nn.Sequential(
                    torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)
                )
                front, opt = build(worker, models[i])
                joined = front.rejoin()
                assert joined >= STOP_AT + AHEAD
                if door == "hook":
                    torch.testing.assert_close(_flat(models[i]), served[joined], atol=0, rtol=0)
            before = _flat(models[i])
            one_step(front, opt, models[i], inputs[i])
            if i == 0:
                largest[0] = max(largest[0], float((_flat(models[i]) - before).abs().max()))
        if door != "hook":
            opt.synchronize()
        return front, worker

    with LivenessMonitor(cluster.switch, cluster.job_id, N, timeout_s=LIVENESS_S, poll_s=0.05):
        done = run_workers(cluster.workers, train)
    try:
        fronts = [d[0] for d in done]
        assert len({step_of(f) for f in fronts}) == 1
        final = torch.stack([_flat(m) for m in models])
        assert (final[0] - _flat(base)).abs().max() > 1e-2, "nothing trained"
        if door == "hook":
            apart, bound = float((final - final[0]).abs().max()), (period + 1) * largest[0]
            assert apart <= bound, f"replicas apart by {apart:.3g} > {bound:.3g}"
        else:
            for i in range(1, N):
                torch.testing.assert_close(final[i], final[0], atol=0, rtol=0)
    finally:
        done[N - 1][1].close()


def test_lingering_ends_when_the_caller_says_no_rank_will_step_again(make_cluster):
    """A finished rank lingers while a peer is silent (stopped or dead: nobody can tell), up to ``max_s``;
    ``until`` (a launcher that saw every rank finish or die for good, as ``lta chaos`` does) ends it at
    once, and without ``until`` the same silence keeps it the whole ``max_s``."""
    from hostlib.torch_ext.heal import Healer

    cluster = make_cluster(2, elems_per_packet=16, heartbeat_interval_s=0.1, peer_alive_s=0.5)
    done, gone = cluster.workers[0], cluster.workers[1]
    done.poll(0.3)
    gone.close()
    done.poll(0.4)  # two heartbeat intervals without it: silent
    healer = Healer(done, lambda: (0, 0, [], np.zeros(1, np.float32)), lambda *a: None)
    t0 = time.perf_counter()
    told = t0 + 0.5
    spent = healer.linger(max_s=20.0, until=lambda: time.perf_counter() >= told)
    assert 0.5 <= spent < 2.0, spent
    assert 1.5 <= healer.linger(max_s=1.5) < 3.0  # the silent peer alone: max_s


def test_a_rank_behind_whose_peers_are_gone_fails_loud_naming_that(make_cluster):
    """Its peers finished (here: closed, their heartbeats stopped) while it was stopped: nobody can give
    it their state. It raises UnhealthyTraining saying that no peer has been heard, once their relayed
    heartbeats have been silent for ``peer_alive_s``, not after the whole ``timeout_s`` (the message
    names which of the two ended it)."""
    from hostlib.errors import UnhealthyTraining
    from hostlib.torch_ext.heal import Healer

    cluster = make_cluster(2, elems_per_packet=16, heartbeat_interval_s=0.1, peer_alive_s=0.5)
    behind, peer = cluster.workers[1], cluster.workers[0]
    peer.poll(0.3)
    behind.poll(0.3)  # it hears the peer's relayed heartbeats
    peer.close()
    healer = Healer(behind, lambda: (0, 0, [], np.zeros(1, np.float32)), lambda *a: None, ask_s=0.2)
    with pytest.raises(UnhealthyTraining, match="none of them has been heard"):
        healer.heal()
    assert healer.healed == 0


@pytest.mark.parametrize("critical", [None, "default"], ids=["sharded", "sharded-critical"])
def test_a_rank_stopped_past_its_peers_last_step_takes_their_final_state(make_cluster, critical):
    """Rank ``N - 1`` stops at step ``STOP_AT`` and comes back only after its peers have ended their run;
    they linger (``Healer.linger``) while it is silent, until it has finished (as a launcher tells them;
    without that, 10 s past its return), so it still takes their final state and ends
    with exactly their replica: its own shard as they froze it (the reduces it skipped on its way back
    did not step it), every other copy theirs. On dd81131 it raised UnhealthyTraining."""
    cluster = _cluster(make_cluster)
    base = _model()
    models = [copy.deepcopy(base) for _ in range(N)]
    inputs = [torch.randn(16, 12, generator=torch.Generator().manual_seed(i)) for i in range(N)]
    finished = threading.Semaphore(0)
    behind_done = threading.Event()  # what a launcher knows (lta chaos: its ``finished`` file)
    lingered = [0.0] * N

    def train(worker, i):
        opt = ShardedOptimizer(
            torch.optim.SGD(models[i].parameters(), lr=0.05, momentum=0.9),
            worker,
            critical=critical,
            module=models[i],
            liveness_timeout_s=LIVENESS_S,
        )
        while opt.lta_step < STEPS:
            if i == N - 1 and opt.lta_step == STOP_AT and not lingered[i]:
                beat = worker.heartbeat
                beat.stop()
                for _ in range(N - 1):  # every peer ended its run
                    assert finished.acquire(timeout=60), "the peers did not finish without it"
                lingered[i] = -1.0
                worker.heartbeat = Heartbeat(
                    worker.sock,
                    worker.switch_addr,
                    job_id=worker.job_id,
                    worker_id=worker.worker_id,
                    elems_per_packet=worker.config.elems_per_packet,
                    interval_s=beat.interval_s,
                ).start()
            models[i](inputs[i]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if i != N - 1:
            finished.release()
            lingered[i] = opt.healer.linger(max_s=30.0, until=behind_done.is_set)
        else:
            behind_done.set()
        return opt

    with LivenessMonitor(cluster.switch, cluster.job_id, N, timeout_s=LIVENESS_S, poll_s=0.05):
        opts = run_workers(cluster.workers, train)
    assert opts[N - 1].healer.healed >= 1
    assert all(o.lta_step == STEPS for o in opts)
    want = _flat(models[0])
    assert (want - _flat(base)).abs().max() > 1e-2, "nothing trained"
    for i in range(1, N):
        torch.testing.assert_close(
            _flat(models[i]), want, atol=0, rtol=0, msg=lambda m, i=i: f"rank {i}: {m}"
        )


def test_rejoin_default_group_binds_the_address_the_first_process_published(make_cluster, tmp_path):
    """A restarted rank finds its job's keys in the run's store where join_default_group put them (a
    one-rank gloo group over a FileStore stands for the first process's default group), binds the
    address its first process had, keeps the run's incarnation, and the switch answers its health probe
    (it knows the rank by that address: no HealthCheckError)."""
    import torch.distributed as dist

    from hostlib.torch_ext.health import rejoin_default_group
    from hostlib.torch_ext.rendezvous import LtaOptions

    cluster = make_cluster(2, elems_per_packet=16, heartbeat_interval_s=0)
    store = dist.FileStore(str(tmp_path / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        keys = dist.PrefixStore("lta-hook", dist.distributed_c10d._get_default_store())
    finally:
        dist.destroy_process_group()
    first = cluster.workers[1]
    host, port = first.address
    keys.set("lta/job1/ready", "1")
    keys.set("lta/job1/incarnation", "7")
    keys.set("lta/job1/worker1", f"{host}:{port}")
    first.close()  # the first process died
    options = LtaOptions(switch=cluster.server.address, job_id=cluster.job_id)
    options.transport = cluster.workers[0].config
    session = rejoin_default_group(store, 1, 2, options)
    try:
        assert session.worker.address == (host, port)
        assert session.worker.config.incarnation == 7
    finally:
        session.close()


class _Bucket:
    """A DDP GradBucket stand-in: one flat buffer holding ``params``' gradients in the given order."""

    def __init__(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        self._params = params
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._views, at = [], 0
        for g in grads:
            self._views.append(self._buffer[at : at + g.numel()].view_as(g))
            at += g.numel()

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._views


def test_the_hook_puts_a_bucket_on_the_wire_in_one_order_whatever_ddps_layout(make_cluster):
    """DDP lays a bucket out in the module's order in its first iteration and in the gradients' ready
    order after its bucket rebuild; a rank that rejoined a running job has its first iteration when its
    peers have rebuilt long ago. Rank 0's bucket here is in the module's order, rank 1's reversed: each
    parameter's reduced gradient is still the mean of the two ranks' gradients of that parameter (numpy),
    on both ranks, in each one's own layout."""
    from hostlib.torch_ext.ddp_hook import lta_hook

    cluster = make_cluster(2, elems_per_packet=16, heartbeat_interval_s=0)
    models = [_model(), _model()]
    rng = np.random.default_rng(3)
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in m.parameters()] for m in models]
    want = [(a + b) / 2 for a, b in zip(grads[0], grads[1], strict=True)]

    def body(worker, i):
        state = LtaHookState(worker)
        state.attach(models[i])
        params = list(models[i].parameters())
        ts = [torch.from_numpy(g.copy()) for g in grads[i]]
        order = list(range(len(params))) if i == 0 else list(reversed(range(len(params))))
        bucket = _Bucket([params[j] for j in order], [ts[j] for j in order])
        lta_hook(state, bucket).wait()
        return {order[k]: v.clone() for k, v in enumerate(bucket.gradients())}

    out = run_workers(cluster.workers, body)
    for i in range(2):
        for j, w in enumerate(want):
            np.testing.assert_allclose(out[i][j].numpy(), w, atol=1e-4, err_msg=f"rank {i}, parameter {j}")
