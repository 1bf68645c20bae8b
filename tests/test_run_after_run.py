"""Run after run (docs/protocol.md, "Run after run"): a switch that served earlier runs of a job starts
each new run clean. Hand-built packets against the reference, the native engine against the reference
across the reset, and successive torchrun-style runs (new processes, same job and addresses) against one
running softswitch, each checked against numpy."""

from __future__ import annotations

import multiprocessing as mp
import sys
import traceback
from datetime import timedelta

import numpy as np
import pytest

from hostlib.protocol import PROBE_SEQ, Op, make_packet
from softswitch.pipeline import JobConfig, SoftSwitch
from softswitch.server import SoftSwitchServer
from tests.ranks import start_and_collect
from tests.test_softswitch import PORTS, K, decode
from tests.test_softswitch_batch import Spec, assert_same, random_sizes

POOL = 8
PROBE_SLOT = POOL - 1


def grad(w: int, slot: int, seq: int, values, step: int = 0) -> bytes:
    return make_packet(
        Op.GRAD,
        job_id=1,
        worker_id=w,
        slot=slot,
        seq=seq,
        step=step,
        payload=np.asarray(values),
        elems_per_packet=K,
    )


def probe(w: int, incarnation: int) -> bytes:
    return make_packet(
        Op.FLUSH,
        job_id=1,
        worker_id=w,
        slot=PROBE_SLOT,
        seq=PROBE_SEQ,
        step=incarnation,
        nelem=0,
        elems_per_packet=K,
    )


def two_worker_switch() -> SoftSwitch:
    sw = SoftSwitch(seed=0)
    sw.add_job(JobConfig(1, PORTS[:2], pool_size=POOL, elems_per_packet=K))
    return sw


def results(out) -> list[tuple[dict, np.ndarray]]:
    return [decode(pkt) for _, pkt in out if decode(pkt)[0]["op"] == int(Op.RESULT)]


def test_a_new_incarnation_forgets_the_slots_and_the_next_run_sums_alone():
    sw = two_worker_switch()
    # Run 1 went to round 5 of slot 0 and left round 6 open with worker 0's values (a crash).
    old = np.array([1000, 1000, 1000, 1000])
    for q in range(1, 6):
        sw.process(grad(0, 0, q, old), PORTS[0])
        sw.process(grad(1, 0, q, old), PORTS[1])
    sw.process(grad(0, 0, 6, old), PORTS[0])
    assert int(sw.jobs[1].slots.seq[0]) == 6
    # Without a new incarnation, run 2's round 1 is stale: nothing is summed, nothing answered.
    before = sw.read_counters(1)["grad_stale"]
    assert sw.process(grad(0, 0, 1, [1, 2, 3, 4]), PORTS[0]) == []
    assert sw.read_counters(1)["grad_stale"] == before + 1
    # Run 2 probes with its incarnation: answered as a job's first probe (closed empty, to every worker).
    out = results(sw.process(probe(1, 0xA1), PORTS[1]))
    assert len(out) == 2 and all(h["count"] == 0 and h["seq"] == PROBE_SEQ for h, _ in out)
    assert int(sw.jobs[1].slots.seq[0]) == 0 and not sw.jobs[1].slots.acc.any()
    # Run 2's rounds start at 1 and hold exactly run 2's values (numpy over the two contributions).
    a, b = np.array([1, 2, 3, 4]), np.array([10, -20, 30, -40])
    assert sw.process(grad(0, 0, 1, a), PORTS[0]) == []
    out = results(sw.process(grad(1, 0, 1, b), PORTS[1]))
    assert len(out) == 2
    for head, values in out:
        assert (head["count"], head["bitmap"], head["seq"]) == (2, 0b11, 1)
        np.testing.assert_array_equal(values, a + b)


def test_the_same_incarnation_again_keeps_the_runs_rounds():
    sw = two_worker_switch()
    sw.process(probe(0, 7), PORTS[0])
    sw.process(grad(0, 0, 1, [5, 5, 5, 5]), PORTS[0])  # run 7's round 1, open
    # Worker 1 of the same run probes (it started later, or rejoins): the open round stays.
    out = results(sw.process(probe(1, 7), PORTS[1]))
    assert len(out) == 1 and out[0][0]["count"] == 0  # a unicast resend of the probe round
    out = results(sw.process(grad(1, 0, 1, [1, 1, 1, 1]), PORTS[1]))
    assert [h["count"] for h, _ in out] == [2, 2]
    np.testing.assert_array_equal(out[0][1], [6, 6, 6, 6])


def test_incarnation_zero_announces_nothing():
    sw = two_worker_switch()
    sw.process(grad(0, 3, 4, [1, 1, 1, 1]), PORTS[0])
    sw.process(probe(0, 0), PORTS[0])
    assert int(sw.jobs[1].slots.seq[3]) == 4  # kept


def test_a_probe_from_a_stranger_resets_nothing():
    sw = two_worker_switch()
    sw.process(grad(0, 3, 4, [1, 1, 1, 1]), PORTS[0])
    sw.process(probe(0, 99), 55)  # worker 0's id from a port that is not worker 0's: drop_bad_worker
    assert int(sw.jobs[1].slots.seq[3]) == 4
    assert sw.read_counters(1)["drop_bad_worker"] == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_native_engine_matches_the_reference_across_runs(seed):
    """Three runs of one job through one switch, with old-run packets before each new run's probes, in
    random batches: the batched engine (native between the resets) gives the reference's packets,
    counters and slot registers. The reset happens in place, so the engine's next batch sees it."""
    rng = np.random.default_rng(seed)
    spec = Spec(1, PORTS[:2], pool=POOL, k=K)
    packets: list[tuple[bytes, object]] = []
    for run, incarnation in enumerate((0x11, 0x22, 0x33)):
        for w in (0, 1):
            packets.append((probe(w, incarnation), PORTS[w]))
        rounds = int(rng.integers(2, 30))
        for g in range(rounds):
            slot, q = g % (POOL - 1), g // (POOL - 1) + 1
            for w in rng.permutation(2).tolist():
                if rng.random() < 0.9:
                    values = rng.integers(-1000, 1000, size=K)
                    packets.append((grad(w, slot, q, values, step=run), PORTS[w]))
        # a straggler of this run, late: lands before the next run's probe
        packets.append((grad(0, 0, 1, [9, 9, 9, 9]), PORTS[0]))
    sizes = random_sizes(rng, len(packets), high=16)
    assert_same(packets, [spec], sizes, seed)


# ---- successive torchrun-style runs against one running softswitch --------------------------------------
BASE_PORT = 42600
WORLD = 2
N_ELEMS = 50_000  # > one packet of K = 64: the lossy path, 782 chunks per reduce


def _rank(rank: int, world: int, store_path: str, env: dict[str, str], run: int, results) -> None:
    try:
        import os

        import torch.distributed as dist

        import hostlib.torch_ext.backend  # noqa: F401  (registers "lta")
        from hostlib.torch_ext import lta_stats

        os.environ.update(env)
        dist.init_process_group(
            "lta",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        sums = []
        for call in range(3):
            t = _tensor(run, call, rank)
            dist.all_reduce(t)  # SUM
            sums.append(t.numpy().copy())
        stats = lta_stats()
        dist.destroy_process_group()
        results.put((rank, True, {"sums": sums, "chunks_full": stats["chunks_full"], "stats": stats}))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _tensor(run: int, call: int, rank: int):
    import torch

    gen = torch.Generator().manual_seed(1000 * run + 10 * call + rank)
    return torch.randn(N_ELEMS, generator=gen)


def _env(server: SoftSwitchServer, workers: list[tuple[str, int]], **extra: str) -> dict[str, str]:
    """The environment a torchrun rank of the job gets: the switch, its bind port, K = 64."""
    host, port = server.address
    return {
        "LTA_SWITCH": f"{host}:{port}",
        "LTA_BIND_PORT_BASE": str(workers[0][1]),
        "LTA_ELEMS_PER_PACKET": "64",
        **extra,
    }


def _check_run(out: list[dict], run: int, label: object) -> None:
    """Every chunk of every reduce of run ``run`` counted both workers (nothing of an earlier run
    interfered), and each sum is numpy's over the ranks' tensors: fixed point, < 2^-s per contribution,
    s = 30 - L - E >= 25 here (|x| < 16, L = 1), plus half a float32 ulp of the sum (< 2^-20 below 16):
    within 2^-19."""
    expected = [
        sum(_tensor(run, call, r).numpy().astype(np.float64) for r in range(WORLD)) for call in range(3)
    ]
    for rank_out in out:
        assert rank_out["chunks_full"] == 3 * -(-N_ELEMS // 64), (label, rank_out["stats"])
        for got, want in zip(rank_out["sums"], expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-19)


@pytest.mark.parametrize("runs", [2, 3])
def test_successive_torchrun_runs_against_one_softswitch_are_exact(tmp_path, runs):
    switch = SoftSwitch()
    workers = [("127.0.0.1", BASE_PORT + runs * 10 + r) for r in range(WORLD)]
    switch.add_job(JobConfig(1, workers, elems_per_packet=64))
    server = SoftSwitchServer(switch).start()
    try:
        env = _env(server, workers)
        ctx = mp.get_context("spawn")
        for run in range(runs):
            queue = ctx.Queue()
            store = str(tmp_path / f"store{run}")
            procs = [ctx.Process(target=_rank, args=(r, WORLD, store, env, run, queue)) for r in range(WORLD)]
            out = start_and_collect(procs, queue, WORLD, 120)
            for proc in procs:
                assert proc.exitcode == 0, f"run {run}: a rank exited {proc.exitcode}"
            _check_run(out, run, run)
    finally:
        server.stop()


def _crashing_rank(rank: int, world: int, store_path: str, env: dict[str, str], results) -> None:
    """Run 0 of the crash test: reduce forever; killed (SIGKILL) by the test mid-reduce."""
    import os

    import torch.distributed as dist

    import hostlib.torch_ext.backend  # noqa: F401  (registers "lta")

    os.environ.update(env)
    dist.init_process_group(
        "lta", init_method=f"file://{store_path}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    call = 0
    while True:
        dist.all_reduce(_tensor(99, call % 3, rank))
        if call == 2:
            results.put((rank, True, "reducing"))
        call += 1


def test_a_job_restarted_after_a_crash_is_exact(tmp_path):
    """Run 0 is killed mid-reduce (rounds left open, GRADs in flight); run 1 of the same job on the same
    switch and addresses sums its own values only."""
    switch = SoftSwitch()
    workers = [("127.0.0.1", BASE_PORT + 50 + r) for r in range(WORLD)]
    switch.add_job(JobConfig(1, workers, elems_per_packet=64))
    server = SoftSwitchServer(switch).start()
    try:
        env = _env(server, workers)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        crashing = [
            ctx.Process(target=_crashing_rank, args=(r, WORLD, str(tmp_path / "store0"), env, queue))
            for r in range(WORLD)
        ]
        try:
            assert start_and_collect_started(crashing, queue) == ["reducing"] * WORLD
        finally:
            for proc in crashing:
                proc.kill()
                proc.join(timeout=20)
        stale_rounds = int((switch.jobs[1].slots.seq > 0).sum())
        assert stale_rounds > 0  # the crashed run left rounds on the switch
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(r, WORLD, str(tmp_path / "store1"), env, 1, queue))
            for r in range(WORLD)
        ]
        out = start_and_collect(procs, queue, WORLD, 120)
        _check_run(out, 1, "after the crash")
    finally:
        server.stop()


def start_and_collect_started(procs, queue) -> list:
    """Start ``procs``; the first message of each (they go on running)."""
    for proc in procs:
        proc.start()
    got = {}
    while len(got) < len(procs):
        rank, ok, value = queue.get(timeout=120)
        got[rank] = value
    return [got[r] for r in sorted(got)]


# ---- a sharded switch: the shard that sees the probe holds it until every shard forgot its slots ----------
def test_a_shard_holds_the_probes_of_a_new_run_until_released():
    sw = two_worker_switch()
    seen: list[tuple[int, int]] = []
    sw.on_new_run = lambda job, incarnation: seen.append((job, incarnation))
    sw.process(grad(0, 2, 9, [1, 1, 1, 1]), PORTS[0])
    assert sw.process(probe(0, 5), PORTS[0]) == []  # new run: slots forgotten, answer held
    assert seen == [(1, 5)] and int(sw.jobs[1].slots.seq[2]) == 0
    assert sw.process(probe(1, 5), PORTS[1]) == []  # the run's other worker: held too
    sw.release_run(1)
    out = results(sw.process(probe(1, 5), PORTS[1]))
    assert len(out) == 1 and out[0][0]["seq"] == PROBE_SEQ
    assert seen == [(1, 5)]  # the same incarnation again starts nothing


def test_start_run_from_the_control_side_forgets_once():
    sw = two_worker_switch()
    sw.process(grad(0, 2, 9, [1, 1, 1, 1]), PORTS[0])
    sw.start_run(1, 8)
    assert int(sw.jobs[1].slots.seq[2]) == 0
    sw.process(grad(0, 2, 1, [1, 1, 1, 1]), PORTS[0])
    sw.start_run(1, 8)  # the incarnation it already holds: the new run's round stays
    assert int(sw.jobs[1].slots.seq[2]) == 1


def test_the_native_engine_matches_the_reference_while_a_run_is_held():
    spec = Spec(1, PORTS[:2], pool=POOL, k=K)
    ref, bat = (two_worker_switch() for _ in range(2))
    for sw in (ref, bat):
        sw.on_new_run = lambda job, incarnation: None
    rng = np.random.default_rng(4)
    packets = [
        (grad(0, 1, 3, [1, 2, 3, 4]), PORTS[0]),
        (probe(0, 0x44), PORTS[0]),
        (probe(1, 0x44), PORTS[1]),
    ]
    packets += [(grad(w, 1, 1, rng.integers(-9, 9, size=K)), PORTS[w]) for w in (0, 1)]
    from tests.test_softswitch_batch import run_batched, run_reference, state

    expected = run_reference(ref, packets)
    got = run_batched(bat, packets, [2, 1, 2], rng)
    assert got == expected and state(bat) == state(ref)
    assert spec.job_id == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT steering is Linux")
def test_successive_runs_against_a_sharded_softswitch_are_exact(tmp_path):
    """Two shards (slots 0-127 on one, 128-255 and the probe slot 255 on the other): the second run's
    probe reaches one shard, which holds its answer until the other has forgotten its slots too."""
    from hostlib import codec
    from hostlib.transport import LtaWorker, TransportConfig
    from softswitch.shards import ShardedSoftSwitch
    from tests.conftest import run_workers

    pool, k = 256, 64
    ports = [BASE_PORT + 70 + w for w in range(WORLD)]
    workers_toml = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    cfg = tmp_path / "switch.toml"
    cfg.write_text(
        f"[[jobs]]\njob_id = 1\nworkers = [{workers_toml}]\npool_size = {pool}\nelems_per_packet = {k}\n"
    )
    rng = np.random.default_rng(11)
    with ShardedSoftSwitch(str(cfg), ("127.0.0.1", 0), 2, report_every=30.0) as sharded:
        for run, incarnation in enumerate((0xA, 0xB, 0xC)):
            config = TransportConfig(elems_per_packet=k, pool_size=pool, incarnation=incarnation)
            workers = [
                LtaWorker(1, w, WORLD, sharded.address, config=config, bind=("127.0.0.1", p))
                for w, p in enumerate(ports)
            ]
            try:
                run_workers(workers, lambda w, i: w.check_switch())
                for _ in range(2):
                    x = [rng.standard_normal(30_000).astype(np.float32) for _ in range(WORLD)]
                    exact = np.stack(x).astype(np.float64).mean(axis=0)
                    for r in run_workers(workers, lambda w, i, x=x: w.allreduce(x[i])):
                        assert np.all(r.count == WORLD), f"run {run}: {np.sum(r.count < WORLD)} chunks short"
                        bound = np.repeat(codec.error_bound(r.shift), k)[: len(exact)]
                        assert np.all(np.abs(r.values - exact) < bound + np.abs(exact) * 2**-24)
            finally:
                for w in workers:
                    w.close()
        totals = sharded.collect()
    stale = sum(
        rep["counters"]["1"]["grad_stale"] if "1" in rep["counters"] else rep["counters"][1]["grad_stale"]
        for rep in totals
    )
    assert stale == 0


def test_different_jobs_one_after_another_are_exact(tmp_path):
    """Job 1, then job 2, then job 1 again, on one switch from the same addresses: each run exact."""
    switch = SoftSwitch()
    workers = [("127.0.0.1", BASE_PORT + 80 + r) for r in range(WORLD)]
    for job_id in (1, 2):
        switch.add_job(JobConfig(job_id, workers, elems_per_packet=64))
    server = SoftSwitchServer(switch).start()
    try:
        ctx = mp.get_context("spawn")
        for run, job_id in enumerate((1, 2, 1)):
            env = _env(server, workers, LTA_JOB_ID=str(job_id))
            queue = ctx.Queue()
            store = str(tmp_path / f"store{run}")
            procs = [ctx.Process(target=_rank, args=(r, WORLD, store, env, run, queue)) for r in range(WORLD)]
            out = start_and_collect(procs, queue, WORLD, 120)
            _check_run(out, run, (run, job_id))
        assert switch.read_counters(1)["grad_stale"] == switch.read_counters(2)["grad_stale"] == 0
    finally:
        server.stop()
