"""End to end over UDP: workers reduce through a softswitch with loss; results checked against numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from hostlib import batchio
from hostlib.transport import Fallback, LtaWorker, TransportConfig
from softswitch.pipeline import JobConfig
from tests.conftest import check_mean_over_bitmap, run_workers

K = 64


@pytest.fixture(params=["auto", "plain"], autouse=True)
def io_path(request, monkeypatch) -> str:
    """Every test here runs on the batched I/O path (auto: GSO/GRO trains where the kernel has them, else
    recvmmsg/sendmmsg) and on the forced plain
    fallback (one system call per packet): both must give the same, exact results."""
    if request.param == "plain":
        monkeypatch.setenv("LTA_IO", "plain")
    return request.param


def test_the_io_path_in_use_is_reported(make_cluster, io_path):
    cluster = make_cluster(2)
    modes = {w.stats.io for w in cluster.workers} | {cluster.server.io}
    if io_path == "plain":
        assert modes == {"plain"}
    else:
        assert modes == {batchio.available_modes()[0]}


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("loss", [0.0, 0.1, 0.5])
def test_every_chunk_is_the_mean_over_its_bitmap(make_cluster, n, loss):
    length = 1000 * n + 37  # not a multiple of K
    if loss == 0.0:
        # Nothing is lost, so only a timer could close a round short. On a loaded machine a thread
        # descheduled past the sync deadline has its exponent proposal flushed out (it then withholds the
        # whole unit), and one descheduled past the RTO has its last units flushed by a peer that has
        # sent all of its own (the tail of a reduce waits one RTO, min_deadline_ms, not the lag
        # deadline): count < n at zero loss, 1 in 3 loaded runs of n = 8. Late is not lost here: give
        # every timer seconds.
        deadlines = {f"{name}_deadline_ms": 5000 for name in ("sync", "lag", "min", "max")}
    else:
        # Generous deadlines: threads on a shared 2-core machine jitter; rounds closed by a timer (a lost
        # packet, or a late one) are part of what is checked for exactness here.
        deadlines = {"sync_deadline_ms": 300, "min_deadline_ms": 50}
    cluster = make_cluster(n, up=loss, down=loss / 2, seed=n, **deadlines)
    rng = np.random.default_rng(n)
    checked = 0
    counted = []
    every = n * -(-length // K)  # chunks of all workers' results
    # At zero loss every chunk full; with loss some short, and at 50% some lost on every worker (the
    # fallback, prev: the worker's previous result, zeros the first time). How many are full is left
    # open: a worker descheduled past the sync deadline withholds a whole reduce (see above).
    if loss == 0:
        expect: dict = dict(full=every, partial=0, fallback=0)
    else:
        expect = dict(full=(0, None), partial=(1, None), fallback=(0, None))
    prev = None
    for step in range(3):
        inputs = [
            (rng.standard_normal(length) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for _ in range(n)
        ]
        results = cluster.reduce_all(inputs, step=step)
        checked += check_mean_over_bitmap(
            results, inputs, K, prev=prev, slack_bits=cluster.slack_bits, **expect
        )
        prev = [r.values for r in results]
        counts = np.concatenate([r.count[r.fallback == Fallback.NONE] for r in results])
        if loss == 0.0:
            assert np.all(counts == n)
            assert all(np.all(r.fallback == Fallback.NONE) for r in results)
        counted.append(counts)
    assert checked > 0
    counts = np.concatenate(counted)
    totals = cluster.switch.read_counters(cluster.job_id)
    if loss > 0:
        # The loss was applied: the switch dropped its share of the GRADs (every copy is drawn on its own,
        # tail probes included: TransportConfig.tail_probe), and rounds closed short. How many
        # contributions arrive is checked against the loss law in exact mode below, where no timer
        # closes a round and nothing is probed.
        grads = sum(v for name, v in totals.items() if name.startswith("grad_"))
        sent = grads + totals["drop_policy_up"]
        sigma = np.sqrt(loss * (1 - loss) / sent)
        assert abs(totals["drop_policy_up"] / sent - loss) < 5 * sigma, (totals["drop_policy_up"], sent)
        assert (counts < n).any()
    assert totals["grad_exp_mismatch"] == 0


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("loss", [0.1, 0.5])
def test_arrivals_follow_the_loss_law_when_no_timer_closes_a_round(make_cluster, n, loss):
    """Exact mode (rounds close by the drop policy's decisions, exponents spared): each data GRAD arrives
    with probability 1 - loss, independently, so a chunk that got a RESULT has count ~ Binomial(n, 1 -
    loss) given count > 0. A transport that withheld or lost contributions of its own falls below."""
    wait = 20_000  # a safety net only: a timer could fire after 20 s
    cluster = make_cluster(
        n,
        up=loss,
        seed=n,
        exact=True,
        sync_deadline_ms=wait,
        lag_deadline_ms=wait,
        min_deadline_ms=wait,
        max_deadline_ms=wait,
    )
    rng = np.random.default_rng(n)
    per_chunk = []
    prev = None
    for step in range(3):
        inputs = [rng.standard_normal(1000 * n + 37).astype(np.float32) for _ in range(n)]
        results = cluster.reduce_all(inputs, step=step)
        # no timer closes a round: a chunk is full, short, or (every GRAD lost) empty, each with some
        # probability (how many of each: the loss law, below); short ones show up every step
        every = n * -(-len(inputs[0]) // K)
        checked = check_mean_over_bitmap(
            results, inputs, K, full=(0, None), partial=(1, None), fallback=(0, None), prev=prev
        )
        prev = [r.values for r in results]
        assert checked + int(sum(np.sum(r.count == 0) for r in results)) == every
        for r in results[1:]:  # no down loss: every worker got every RESULT
            assert np.array_equal(r.count, results[0].count) and np.array_equal(r.bitmap, results[0].bitmap)
        per_chunk.append(results[0].count[results[0].count > 0])
    assert all(w.stats.flushes_on_timer == 0 and w.stats.withheld_chunks == 0 for w in cluster.workers)
    counts = np.concatenate(per_chunk).astype(np.float64)
    q = 1 - loss
    mean = n * q / (1 - loss**n)  # E[count | count > 0]
    second = (n * q * loss + (n * q) ** 2) / (1 - loss**n)  # E[count^2 | count > 0]
    sigma = np.sqrt((second - mean**2) / counts.size)
    assert abs(counts.mean() - mean) < 5 * sigma, (counts.mean(), mean, sigma)


def test_zero_loss_results_are_identical_on_every_worker(make_cluster):
    # Nothing is lost, so only a timer could make a round short: a thread descheduled past the sync
    # deadline has its exponent proposal flushed out, and then withholds every chunk (whatever its
    # values), and one past the RTO has its last units flushed by a peer in the tail of its reduce. Late
    # is not lost here: give every timer seconds.
    cluster = make_cluster(4, **{f"{name}_deadline_ms": 5000 for name in ("sync", "lag", "min", "max")})
    inputs = [np.random.default_rng(i).standard_normal(777).astype(np.float32) for i in range(4)]
    results = cluster.reduce_all(inputs)
    for r in results[1:]:
        assert np.array_equal(r.values, results[0].values)
    assert np.allclose(results[0].values, np.mean(inputs, axis=0), atol=1e-6)


def test_renormalization_is_unbiased_where_prev_and_zero_are_not(make_cluster):
    """30% loss on GRADs, data whose mean drifts each round. Average over rounds of (estimate - true
    mean): renormalized ~ 0; zero-fill is scaled by ~(1 - p); prev lags behind the drift.

    A round costs its loss timers whatever its length (~0.2-0.5 s here at 4 or 16 chunks), so the
    samples come from long tensors rather than many rounds: 8 rounds of 32 chunks draw as many chunk
    losses and element errors as 64 rounds of 4, and the mean drifts 0.4 a round so that it spans the
    same range (1 to ~4)."""
    n, rounds, length, loss, drift = 4, 8, 32 * K, 0.3, 0.4
    errors = {}
    for name, renorm, fallback in [
        ("renorm", "count", "prev"),
        ("zero", "none", "zero"),
        ("prev", "none", "prev"),
    ]:
        cluster = make_cluster(
            n,
            up=loss,
            seed=11,
            job_id=len(errors) + 1,
            renormalize=renorm,
            fallback=fallback,
            sync_deadline_ms=50,
        )
        rng = np.random.default_rng(5)
        diffs = []
        for t in range(rounds):
            base = 1.0 + drift * t  # the true mean drifts up every round
            inputs = [(base + rng.standard_normal(length)).astype(np.float32) for _ in range(n)]
            results = cluster.reduce_all(inputs, step=t)
            truth = np.mean(inputs, axis=0)
            ok = (
                results[0].fallback != Fallback.PREV
                if fallback == "prev" and renorm == "count"
                else slice(None)
            )
            v = results[0].values.reshape(-1, K)[ok].ravel() - truth.reshape(-1, K)[ok].ravel()
            diffs.append(v)
        d = np.concatenate(diffs)
        errors[name] = (d.mean(), d.std() / np.sqrt(d.size))
    mean, se = errors["renorm"]
    assert abs(mean) < 4 * se + 1e-6, errors
    z_mean, z_se = errors["zero"]
    assert z_mean < -0.1 and abs(z_mean) > 8 * z_se, errors  # about -p·E[x] ~ -0.3·2.5
    p_mean, p_se = errors["prev"]
    assert p_mean < -0.01 and abs(p_mean) > 4 * p_se, errors  # lags a drifting mean


def _reduce_worker_0_first(cluster, inputs: list[np.ndarray]) -> list:
    """Both workers reduce concurrently (run_workers), worker 1 starting only once worker 0's exponent GRAD
    has opened its round at the switch. Started the other way round on a loaded host (threads, the GIL),
    worker 1's sync FLUSH (500 ms) could close the exponent round before worker 0's proposal arrived:
    worker 0 would then withhold its whole contribution (protocol.md), which is right, but not what these
    tests check."""
    started = cluster.switch.read_counters(cluster.job_id)["grad_start"]

    def reduce(worker: LtaWorker, i: int):
        if i == 1:
            deadline = time.monotonic() + 30
            while cluster.switch.read_counters(cluster.job_id)["grad_start"] == started:
                assert time.monotonic() < deadline, "worker 0's exponent GRAD never reached the switch"
                time.sleep(0.001)
        return worker.allreduce(inputs[i])

    return run_workers(cluster.workers, reduce)


def test_fallback_policies(make_cluster):
    # All RESULTs to worker 1 are lost: it must fall back, by its policy.
    for policy, expect in [("zero", "zero"), ("local", "local"), ("prev", "prev")]:
        cluster = make_cluster(
            2,
            fallback=policy,
            job_id={"zero": 1, "local": 2, "prev": 3}[policy],
            # Long enough that a lossless round never flushes out a late thread's data.
            sync_deadline_ms=500,
            max_flushes=1,
        )
        first = [np.full(100, 1.0, np.float32), np.full(100, 3.0, np.float32)]
        _reduce_worker_0_first(cluster, first)  # lossless round: prev = 2.0 everywhere
        from hostlib.emulation.dropmodels import DropPolicy

        cluster.switch.set_drop_policy(cluster.job_id, "down", DropPolicy(p=1.0), worker=1)
        second = [np.full(100, 5.0, np.float32), np.full(100, 7.0, np.float32)]
        r0, r1 = _reduce_worker_0_first(cluster, second)
        # speculated exponents: worker 1's GRADs went at the first reduce's exponent + 3
        if cluster.slack_bits:
            assert np.allclose(r0.values, 6.0) and np.all(r0.count == 2)
        else:  # worker 1 never learns the agreed exponent either, so it contributes nothing (protocol.md)
            assert np.allclose(r0.values, 5.0) and np.all(r0.count == 1)
        want = {"zero": 0.0, "local": 7.0, "prev": 2.0}[expect]
        assert np.allclose(r1.values, want) and np.all(r1.fallback == Fallback[expect.upper()])
        assert np.all(r1.count == 0)


def test_second_job_on_the_same_switch_is_unaffected(make_cluster):
    # Nothing is dropped here, so every chunk must hold every worker of its job. The default 200 ms
    # sync (and lag) deadline would let a thread started late on a loaded machine be flushed out (an honest
    # count of 2, but not what this test is about): the deadline is set far above any start skew.
    a = make_cluster(2, job_id=1, sync_deadline_ms=10_000, lag_deadline_ms=10_000)
    b = make_cluster(3, job_id=2, shared_with=a, sync_deadline_ms=10_000, lag_deadline_ms=10_000)
    xa = [np.random.default_rng(i).standard_normal(500).astype(np.float32) for i in range(2)]
    xb = [np.random.default_rng(10 + i).standard_normal(900).astype(np.float32) for i in range(3)]
    out: dict = {}
    run_workers(a.workers + b.workers, lambda w, i: out.__setitem__(i, w.allreduce((xa + xb)[i])))
    assert np.allclose(out[0].values, np.mean(xa, axis=0), atol=1e-6)
    assert np.allclose(out[3].values, np.mean(xb, axis=0), atol=1e-6)
    assert all(np.all(out[i].count == 2) for i in range(2))
    assert all(np.all(out[i].count == 3) for i in range(2, 5))


_CHILD = textwrap.dedent(
    """
    import sys, numpy as np
    from hostlib.transport import LtaWorker, TransportConfig
    host, port = sys.argv[1], int(sys.argv[2])
    w = LtaWorker(1, 2, 3, (host, port), config=TransportConfig(sync_deadline_ms=1000, pool_size=512))
    print(w.address[1], flush=True)
    sys.stdin.readline()
    x = np.full(50000, 9.0, np.float32)
    reduces = 0
    while True:
        print(reduces, flush=True)  # the test kills this worker once it is inside reduce 1
        w.allreduce(x)
        reduces += 1
    """
)


def test_worker_killed_mid_reduce_others_finish_with_count_n_minus_1(make_cluster):
    from softswitch.pipeline import SoftSwitch
    from softswitch.server import SoftSwitchServer

    switch = SoftSwitch()
    with SoftSwitchServer(switch) as server:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, *map(str, server.address)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            child_port = int(child.stdout.readline())
            # The child process may start slowly here. A pool of 512 (the default before 2048) holds the
            # others at unit 255 by the peer rule while it starts; with 2048 the whole reduce (~800 units)
            # goes at once and closes without a child slower than the sync deadline.
            cfg = TransportConfig(sync_deadline_ms=1000, pool_size=512)
            workers = [LtaWorker(1, w, 3, server.address, config=cfg) for w in range(2)]
            addrs = [w.address for w in workers] + [("127.0.0.1", child_port)]
            switch.add_job(JobConfig(1, addrs, pool_size=512))
            child.stdin.write("go\n")
            child.stdin.flush()
            x = [np.full(50000, 1.0, np.float32), np.full(50000, 2.0, np.float32)]
            first = run_workers(workers, lambda w, i: w.allreduce(x[i]))
            # Each chunk is the mean over its bitmap of (1, 2, 9); on a loaded machine the child may
            # miss a deadline, so not every chunk need have all three.
            full = first[0].count == 3
            assert full.mean() > 0.5
            per_value = np.repeat(full, 64)[: x[0].size]
            assert np.allclose(first[0].values[per_value], 4.0)
            # Kill the third worker while it is inside its next reduce: it announced reduce 1, and the
            # switch has counted packets of it since (its exponent proposals, sent exp_copies times).
            assert child.stdout.readline().strip() == "0"
            assert child.stdout.readline().strip() == "1"
            seen = switch.read_worker_rx(1)[2]
            give_up = time.monotonic() + 60
            while switch.read_worker_rx(1)[2] < seen + 2 and time.monotonic() < give_up:
                time.sleep(0.001)
            assert switch.read_worker_rx(1)[2] >= seen + 2, "worker 2 sent nothing of its reduce 1"
            child.kill()
            child.wait()
            results = run_workers(workers, lambda w, i: [w.allreduce(x[i]) for _ in range(2)][-1])
        finally:
            child.kill()
        for r in results:
            assert np.all(r.count == 2) and np.all(r.bitmap == 0b011)
            assert np.allclose(r.values, 1.5)
        # Bounded, by mechanism: the survivors presume worker 2 dead (absent from a window of RESULTs),
        # so its absence no longer costs a deadline per round.
        for w in workers:
            assert w.deadlines.presumed_dead == 0b100
            w.close()


def test_bad_arguments_are_rejected_clearly():
    with pytest.raises(ValueError, match="worker_id"):
        LtaWorker(1, 3, 3, ("127.0.0.1", 9))
    with pytest.raises(ValueError, match="fallback"):
        TransportConfig(fallback="retry")
    with LtaWorker(1, 0, 1, ("127.0.0.1", 9)) as w:
        with pytest.raises(ValueError, match="empty"):
            w.allreduce(np.zeros(0, np.float32))
        with pytest.raises(TypeError, match="numeric"):
            w.allreduce(np.array(["a"]))


def test_lta_demo_is_exact_on_the_forced_plain_fallback(io_path):
    if io_path != "plain":
        pytest.skip("this test forces the plain path itself")
    env = dict(os.environ, LTA_IO="plain")
    argv = [
        sys.executable,
        "-m",
        "lta.cli",
        "demo",
        "--workers",
        "3",
        "--mib",
        "0.25",
        "--loss",
        "0.05",
        "--json",
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["exact"] is True
    assert {w["stats"]["io"] for w in out["workers"]} == {"plain"}


def test_tail_units_wait_the_lag_deadline_for_a_peer_that_has_not_sent_them(make_cluster):
    """A worker that has sent everything (the tail) still waits ``lag_deadline_ms`` for a unit a live
    peer has not provably sent: worker 1 pauses 0.4 s before its last packets (descheduled), far past
    the RTO (at most max_deadline_ms = 60 ms here) and well inside the lag deadline (3 s). At zero loss
    every chunk must then come back with both workers counted; flushing the tail on the RTO closed those
    rounds with worker 0 alone."""
    from hostlib.protocol import HEADER_DTYPE

    cluster = make_cluster(
        2, elems_per_packet=64, window=8, sync_deadline_ms=3000, lag_deadline_ms=3000,
        min_deadline_ms=20, max_deadline_ms=60, reduce_timeout_s=30,
    )  # fmt: skip
    slot_at = HEADER_DTYPE.fields["slot"][1]
    late = cluster.workers[1]
    send = late.io.send_rows
    paused = []

    def send_late(rows: np.ndarray, slots_sent: np.ndarray | None = None) -> int:
        slots = rows[:, slot_at].astype(np.int64) << 8 | rows[:, slot_at + 1]
        if not paused and len(rows) and int(slots.max()) >= 60:  # its last units: 64 data + 1 exponent
            paused.append(True)
            time.sleep(0.4)
        return send(rows)

    late.io.send_rows = send_late  # type: ignore[method-assign]
    inputs = [np.full(64 * 64, float(w + 1), np.float32) for w in range(2)]
    results = cluster.reduce_all(inputs)
    assert paused
    for r in results:
        assert (r.count == 2).all(), np.flatnonzero(r.count != 2)
        np.testing.assert_allclose(r.values, 1.5, rtol=1e-6)


def test_a_quiet_network_gets_each_packet_once_and_a_loss_brings_the_copies_back(make_cluster):
    """The extra copies of the exponent units (``exp_copies``) and of the last data units (``tail_units`` x
    ``tail_copies``) go only while packets are lost: after ``quiet_units`` units settled with no sign of
    loss, a reduce sends each packet once, and a reduce that loses one brings the copies back from the
    next reduce on. Counted as each worker hands its packets to the kernel (the switch would see a
    reduce's last copies only after the reduce ended), against the reduce's layout: 40 data units and one
    exponent unit (K = 64). Every timer is 300 ms or more and the tail probe is off: a thread late by an
    RTO on a loaded host would send a probe (a sign of loss, and a packet more) and is not what this holds."""
    from hostlib.emulation.dropmodels import DropPolicy

    chunks, k = 40, 64
    once = chunks + 1  # 40 data units, 1 exponent unit
    with_copies = once + 1 + 2  # the exponent unit's second copy, the last two data units' second copies
    cluster = make_cluster(
        2, elems_per_packet=k, quiet_units=3 * once, heartbeat_interval_s=0, exp_copies=2, tail_units=2,
        tail_copies=2, tail_probe=False, min_deadline_ms=300, initial_deadline_ms=300,
        **{f"{name}_deadline_ms": 5000 for name in ("sync", "lag", "max")},
    )  # fmt: skip
    sent = [0, 0]
    for w, worker in enumerate(cluster.workers):

        def counted(rows: np.ndarray, *args: object, _w: int = w, _send=worker.io.send_rows) -> int:
            sent[_w] += len(rows)
            return _send(rows, *args)

        worker.io.send_rows = counted  # type: ignore[method-assign]
    rng = np.random.default_rng(7)
    last: list[np.ndarray] = []  # each worker's previous result (the prev fallback of a lossy reduce)

    def reduce_counted(quiet: bool = True) -> list[int]:
        before = list(sent)
        inputs = [rng.standard_normal(chunks * k).astype(np.float32) for _ in range(2)]
        results = cluster.reduce_all(inputs)
        slack = cluster.slack_bits
        if quiet:
            check_mean_over_bitmap(
                results, inputs, k, full=2 * chunks, partial=0, fallback=0, slack_bits=slack
            )
        else:
            check_mean_over_bitmap(
                results,
                inputs,
                k,
                full=(0, None),
                partial=(1, None),
                fallback=(0, None),
                prev=last,
                slack_bits=slack,
            )
        last[:] = [r.values.copy() for r in results]
        return [a - b for a, b in zip(sent, before, strict=True)]

    # three quiet reduces (3 x 41 units) with the copies, then each packet once
    assert [reduce_counted() for _ in range(3)] == [[with_copies] * 2] * 3
    assert [reduce_counted() for _ in range(2)] == [[once] * 2] * 2
    assert [w.stats.single_copy_reduces for w in cluster.workers] == [2, 2]
    # a lossy reduce: its FLUSHes are extra packets, and it is a sign of loss for every worker (a FLUSH of
    # its own, or a RESULT short of the peer whose GRAD was lost)
    cluster.switch.set_drop_policy(cluster.job_id, "up", DropPolicy(p=0.1))
    lossy = reduce_counted(quiet=False)
    assert sum(lossy) > 2 * once, lossy  # each packet once, and the FLUSHes of its losses
    cluster.switch.set_drop_policy(cluster.job_id, "up", None)
    assert reduce_counted() == [with_copies] * 2


def test_a_result_short_of_a_peer_is_a_sign_of_loss_without_a_flush_of_ones_own():
    """A worker whose peer FLUSHed the round of a lost GRAD (the designated one) gets a RESULT short of a
    worker and sends nothing itself: that is a loss too, and the copies stay. So is a unit found lost
    whose stored RESULT came back whole (a probe while RESULT loss dominates), and a unit given up. A chunk
    another worker owns (no RESULT comes here) is not."""
    from types import SimpleNamespace

    from hostlib.transport.engine import ReduceEngine
    from hostlib.transport.plan import DONE, GAVE_UP, ReducePlan

    plan = ReducePlan(10 * 64, 64)
    plan.state[:] = DONE
    plan.count[:] = 2
    engine = SimpleNamespace(n_workers=2)
    assert ReduceEngine._quiet(engine, plan)
    plan.elsewhere[4], plan.count[4] = True, 0
    assert ReduceEngine._quiet(engine, plan)
    plan.count[7] = 1
    assert not ReduceEngine._quiet(engine, plan)
    plan.count[7] = 2
    plan.state[2] = GAVE_UP
    assert not ReduceEngine._quiet(engine, plan)
    plan.state[2] = DONE
    for name in ("proven_lost", "flushes", "probes", "retx"):
        getattr(plan, name)[3] = 1
        assert not ReduceEngine._quiet(engine, plan), name
        getattr(plan, name)[3] = 0


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("loss", [0.0, 0.1])
def test_owner_only_chunks_reach_their_owner_alone(make_cluster, n, loss):
    """A reduce-scatter's chunks (``owners``, interleaved as the process group sends them): each worker's
    own chunks equal numpy's mean over the workers in their bitmap, the others' chunks never reach it (no
    RESULT received, no FLUSH sent for them) and count nothing in its stats; the last chunk is every
    worker's (its RESULT shows who passed the whole reduce), and so is every M-th chunk, M = 1/8 of the
    units the slot-reuse rule lets a worker run ahead (docs/protocol.md, "Owner-only units")."""
    if loss == 0.0:  # late is not lost here (see test_every_chunk_is_the_mean_over_its_bitmap)
        deadlines = {f"{name}_deadline_ms": 5000 for name in ("sync", "lag", "min", "max")}
    else:
        deadlines = {"sync_deadline_ms": 300, "min_deadline_ms": 50}
    # No heartbeats: their relays (PARAMs) would add to the packets counted below.
    cluster = make_cluster(n, up=loss, down=loss / 2, seed=n, heartbeat_interval_s=0, **deadlines)
    chunks = 40 * n
    owners = np.arange(chunks) % n
    last = np.arange(chunks) == chunks - 1
    # the pool's data slots D = P - 1, A = D // 2, M = A // 8: 2047, 1023, 127 at the default pool of K = 64
    every = max(1, (cluster.workers[0].config.pool_size - 1) // 2 // 8)
    news = (np.arange(chunks) % every == every - 1) & ~last
    assert news.any() == (chunks > every)
    waited = [(owners == w) | last | news for w in range(n)]  # worker w's own chunks, the last, every M-th
    rng = np.random.default_rng(n)
    prev = None
    for step in range(3):
        inputs = [rng.standard_normal(chunks * K).astype(np.float32) for _ in range(n)]
        results = cluster.reduce_all(inputs, step=step, owners=owners)
        for w, r in enumerate(results):
            theirs = ~waited[w]
            assert np.all(r.count[theirs] == 0) and np.all(r.fallback[theirs] == Fallback.NONE)
        # only the chunks each worker waits for are checked: the others' values are unspecified
        mine = sum(int(m.sum()) for m in waited)
        expect = (
            dict(full=mine, partial=0, fallback=0) if loss == 0 else dict(full=(1, None), partial=(1, None))
        )
        checked = check_mean_over_bitmap(
            results, inputs, K, only=waited, prev=prev, **{"fallback": (0, None), **expect}
        )
        assert checked == mine if loss == 0 else checked > 0
        prev = [r.values for r in results]
        if loss == 0.0:
            for w, r in enumerate(results):
                assert np.all(r.count[waited[w]] == n)
    exp_units = -(-chunks // K)
    for w in cluster.workers:
        # RESULTs: the exponent units (every worker's), its own chunks and the last, each once or
        # resent; never another chunk of another worker's
        mine = int(waited[w.worker_id].sum())  # per reduce
        assert w.stats.chunks == 3 * mine
        if loss == 0.0:
            assert w.stats.flushes_sent == 0
            # (an exponent unit's second copy, exp_copies, may find its round closed: its RESULT is
            # resent, and ignored)
            assert w.stats.packets_received - w.stats.packets_ignored == 3 * (exp_units + mine)
    counters = cluster.switch.read_counters(cluster.job_id)
    if loss == 0.0:  # every data RESULT left once, to its owner (the last to all); exponent RESULTs to all
        resent = counters["grad_late_resend"] + counters["flush_resend"]
        every_workers = 1 + int(news.sum())  # the last chunk and every M-th: n RESULTs each
        assert counters["tx_packets"] - resent == 3 * (
            exp_units * n + chunks - every_workers + every_workers * n
        )


@pytest.mark.parametrize("pool_size", [64, 2048])
def test_contiguous_shards_reach_their_owners_in_full_without_loss(make_cluster, pool_size):
    """Shards one after the other (worker w owns the w-th quarter of the chunks, not every 4th), longer
    than the slot pool: without loss every worker gets every chunk it owns with all 4 workers counted, as
    numpy's mean, and no FLUSH goes. Every M-th chunk is every worker's, so a worker that owns none of a
    long run still hears its peers there; before, it heard nothing, was held, excused them and drifted a
    pool apart (90-100% of each worker's chunks without an aggregate, an UnhealthyTraining)."""
    n = 4
    deadlines = {f"{name}_deadline_ms": 5000 for name in ("sync", "lag", "min", "max")}
    cluster = make_cluster(n, seed=3, heartbeat_interval_s=0, pool_size=pool_size, **deadlines)
    chunks = 4 * pool_size + 10 if pool_size < 1024 else 3000  # 266 or 3000 chunks: past every pool
    owners = np.arange(chunks) * n // chunks
    rng = np.random.default_rng(5)
    for step in range(2):
        inputs = [rng.standard_normal(chunks * K).astype(np.float32) for _ in range(n)]
        results = cluster.reduce_all(inputs, step=step, owners=owners)
        mean = np.mean(inputs, axis=0).reshape(chunks, K)
        for w, r in enumerate(results):
            mine = owners == w
            assert np.all(r.count[mine] == n), np.flatnonzero(r.count[mine] != n)
            np.testing.assert_allclose(r.values.reshape(chunks, K)[mine], mean[mine], rtol=0, atol=1e-5)
    assert all(w.stats.flushes_sent == 0 for w in cluster.workers)
