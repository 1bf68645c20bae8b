"""Never train silently on nothing: the join probe and the health of reduces during training.

The probe's expectations come from the switch contract (docs/protocol.md): a FLUSH of a round newer
than the slot's closes it empty and multicasts (``flush_empty``), the same FLUSH again is answered by
unicast (``flush_resend``), and a packet from an address the job does not map to its worker id is
dropped (``drop_bad_worker``) with no answer.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.errors import HealthCheckError, UnhealthyTraining
from hostlib.protocol import PROBE_SEQ, Op
from hostlib.transport import Fallback, LtaWorker, TransportConfig
from softswitch.pipeline import JobConfig, SoftSwitch
from softswitch.server import SoftSwitchServer
from tests.conftest import check_mean_over_bitmap, run_workers
from tests.ranks import start_and_collect

K = 64


def _silent_port() -> tuple[socket.socket, tuple[str, int]]:
    """A bound UDP socket that never answers: a switch address where nothing listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()


def test_probe_is_answered_when_the_switch_knows_the_job(make_cluster):
    cluster = make_cluster(3, elems_per_packet=K, pool_size=16)
    probes = 0
    for w in cluster.workers:
        sent = w.stats.packets_sent
        assert w.check_switch(2.0) < 2.0
        probes += w.stats.packets_sent - sent  # one probe, more if an answer came later than 50 ms
    # The first probe closes round PROBE_SEQ of slot P-1 empty (multicast to all three: workers 1 and 2
    # may take that as their answer), every later one is a unicast resend; nothing is lost here. The
    # switch thread may still be handling the last probes when the workers return.
    give_up = time.monotonic() + 2.0
    while (
        cluster.switch.read_counters(cluster.job_id)["flush_resend"] < probes - 1
        and time.monotonic() < give_up
    ):
        time.sleep(0.01)
    c = cluster.switch.read_counters(cluster.job_id)
    assert probes >= 3
    assert (c["flush_empty"], c["flush_resend"]) == (1, probes - 1)
    # and the probe leaves the units' slots alone: a reduce afterwards is exact and complete
    inputs = [np.full(10 * K, float(i + 1), np.float32) for i in range(3)]
    for r in cluster.reduce_all(inputs, step=1):
        assert np.all(r.count == 3)
        np.testing.assert_allclose(r.values, 2.0, rtol=1e-6)


def test_probe_survives_result_loss(make_cluster):
    # Half of the RESULT replicas are dropped (seeded: the first answers are among them): the probe's
    # backoff resends until one arrives.
    # No heartbeats: their relays (PARAM, hostlib.protocol.ALIVE_CHUNK) would add to tx_packets.
    cluster = make_cluster(2, down=0.5, elems_per_packet=K, pool_size=16, seed=0, heartbeat_interval_s=0)
    for w in cluster.workers:
        w.check_switch(5.0)  # raises HealthCheckError if no answer came
    c = cluster.switch.read_counters(cluster.job_id)
    # Answers were lost, and the workers probed again: more FLUSHes than the two first probes.
    assert c["drop_policy_down"] >= 1
    assert c["flush_empty"] == 1 and c["flush_empty"] + c["flush_resend"] > 2, c
    # Every answer is accounted for: the first one multicast to both workers, each resend unicast;
    # each was sent or dropped by the down policy, and each worker got at least one.
    assert 2 * c["flush_empty"] + c["flush_resend"] == c["tx_packets"] + c["drop_policy_down"], c
    assert c["tx_packets"] >= 2


def test_probe_during_training_does_not_disturb_units(make_cluster):
    cluster = make_cluster(2, elems_per_packet=K, pool_size=8)  # 7 data slots: units wrap many times
    inputs = [np.arange(50 * K, dtype=np.float32) * (i + 1) for i in range(2)]
    cluster.reduce_all(inputs, step=0)
    cluster.workers[1].check_switch(2.0)  # a late probe: RESULT of slot P-1 multicast to both workers
    for r in cluster.reduce_all(inputs, step=1):
        assert np.all(r.count == 2), "a probe answer was taken for a unit's RESULT"
        np.testing.assert_allclose(r.values, np.arange(50 * K) * 1.5, rtol=1e-6)


def test_dead_switch_raises_within_its_timeout():
    silent, addr = _silent_port()
    with silent, LtaWorker(1, 0, 2, addr, config=TransportConfig(elems_per_packet=K)) as worker:
        t0 = time.perf_counter()
        with pytest.raises(HealthCheckError, match="did not answer worker 0 of job 1"):
            worker.check_switch(0.5)
        elapsed = time.perf_counter() - t0
        assert elapsed >= 0.5  # it waited its whole timeout
        # It kept asking with backoff: probes at 0, 50, 150, 350 ms (gaps 50, 100, 200, 400 ms...), and
        # no more than that schedule allows in the time it took (a slow machine only delays them).
        schedule = np.cumsum([0.0, 0.05, 0.1, 0.2, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5])
        allowed = int(np.sum(schedule <= elapsed))
        silent.settimeout(0)
        seen = 0
        while True:
            try:
                data = silent.recv(65536)
            except BlockingIOError:
                break
            if data[1] in (Op.HEARTBEAT, Op.PARAM):  # the liveness beat and its relay, besides the probes
                continue
            seen += 1
            assert data[1] == 3 and int.from_bytes(data[12:16], "big") == PROBE_SEQ  # op FLUSH, seq
        assert 2 <= seen <= allowed, (seen, allowed, elapsed)


def test_wrong_worker_address_raises_and_the_switch_counts_it():
    switch = SoftSwitch()
    server = SoftSwitchServer(switch).start()
    try:
        cfg = TransportConfig(elems_per_packet=K, pool_size=16)
        with LtaWorker(1, 0, 2, server.address, config=cfg) as worker:
            host, port = worker.address
            # the job expects worker 0 a few ports off (LTA_BIND_PORT_BASE off by a few)
            switch.add_job(
                JobConfig(1, [(host, port + 3), (host, port + 4)], pool_size=16, elems_per_packet=K)
            )
            with pytest.raises(HealthCheckError, match="drop_bad_worker"):
                worker.check_switch(0.4)
        assert switch.read_counters(1)["drop_bad_worker"] >= 2
    finally:
        server.stop()


def test_elems_per_packet_mismatch_raises():
    switch = SoftSwitch()
    server = SoftSwitchServer(switch).start()
    try:
        with LtaWorker(1, 0, 1, server.address, config=TransportConfig(elems_per_packet=K)) as worker:
            switch.add_job(JobConfig(1, [worker.address], pool_size=512, elems_per_packet=2 * K))
            with pytest.raises(HealthCheckError, match=f"elems_per_packet is {K}"):
                worker.check_switch(0.4)
        assert switch.read_counters(1)["drop_malformed"] >= 1
    finally:
        server.stop()


# ---- during training -----------------------------------------------------------------------------------
def _starved(make_cluster, on_unhealthy: str):
    # Every GRAD is dropped: each reduce ends with count-0 RESULTs (FLUSHes) for every chunk.
    return make_cluster(
        2,
        up=1.0,
        elems_per_packet=K,
        pool_size=64,
        on_unhealthy=on_unhealthy,
        unhealthy_reduces=3,
        unhealthy_min_chunks=32,
        min_deadline_ms=5,
        initial_deadline_ms=5,
        sync_deadline_ms=20,
    )


def test_reduces_that_get_nothing_raise_after_the_configured_run(make_cluster):
    cluster = _starved(make_cluster, "raise")
    x = [np.ones(16 * K, np.float32)] * 2  # 16 chunks a reduce: 3 reduces make 48 >= 32
    for step in range(2):
        for r in cluster.reduce_all(x, step=step):
            assert np.all(r.count == 0)
        assert all(not w.healthy for w in cluster.workers)
    with pytest.raises(UnhealthyTraining, match="3 reduces in a row"):
        cluster.reduce_all(x, step=2)


def test_warn_mode_logs_once_and_keeps_going(make_cluster, caplog):
    cluster = _starved(make_cluster, "warn")
    x = [np.ones(16 * K, np.float32)] * 2
    with caplog.at_level(logging.WARNING, logger="hostlib.transport.health"):
        for step in range(5):
            cluster.reduce_all(x, step=step)
    warnings = [r for r in caplog.records if "training is running on fallbacks" in r.getMessage()]
    assert len(warnings) == 2  # one per worker, when its run reached 3 reduces; not again at 4 and 5
    assert all(w.unhealthy_since_mark() for w in cluster.workers)
    assert not any(w.unhealthy_since_mark() for w in cluster.workers)  # the mark was reset


def test_a_healthy_reduce_ends_the_run(make_cluster):
    cluster = make_cluster(2, elems_per_packet=K, pool_size=64, unhealthy_reduces=2, unhealthy_min_chunks=1)
    x = [np.ones(4 * K, np.float32)] * 2
    for step in range(4):
        cluster.reduce_all(x, step=step)
    assert all(w.healthy and w.last_nothing_fraction == 0.0 for w in cluster.workers)
    assert not any(w.unhealthy_since_mark() for w in cluster.workers)


@pytest.mark.parametrize("down", [0.6, 0.0])
def test_a_worker_locked_out_of_its_peers_rounds_fails_loudly(make_cluster, down):
    """Chaos seed 84 (stock DDP, 36% down loss, a 64-slot pool): a rank fell behind its peers, they
    presumed it dead and closed every round without it, and it fell back for 60-70% of its chunks,
    reduce after reduce, below the 90% check; it exited 0 with an untrained replica. Here worker 1's
    GRADs never count (up loss 1.0 for it alone) and it loses ``down`` of its RESULTs. Independent
    expectations: worker 1's bit is in no RESULT (the premise), worker 0's chunks are the mean over
    their bitmaps (its own input). With down loss it falls back for a quarter or more of its chunks and
    must raise UnhealthyTraining naming the lockout within 8 reduces (before the fix: no error); without
    it, it gets worker 0's aggregate for nearly every chunk, which is training, and must not raise."""
    # Worker 1's uplink is dead to its GRADs; no heartbeats, so that no relayed one (a PARAM, spared by
    # the up policy) tells worker 0 it is alive, as none would over a dead link: worker 0 then presumes it
    # dead and runs on, which is what leaves worker 1 locked out.
    cluster = make_cluster(
        2, seed=4, elems_per_packet=16, pool_size=16, min_deadline_ms=5, max_deadline_ms=50,
        sync_deadline_ms=100, lag_deadline_ms=50, reduce_timeout_s=20, heartbeat_interval_s=0,
    )  # fmt: skip
    cluster.switch.set_drop_policy(cluster.job_id, "up", DropPolicy(p=1.0), worker=1)
    if down:
        cluster.switch.set_drop_policy(cluster.job_id, "down", DropPolicy(p=down), worker=1)
    rng = np.random.default_rng(0)
    inputs = [[rng.standard_normal(200 * 16).astype(np.float32) for _ in range(2)] for _ in range(8)]

    def body(w: LtaWorker, i: int) -> tuple[list, str]:
        done: list = []
        try:
            for step in range(8):
                done.append(w.allreduce(inputs[step][i], step=step))
        except UnhealthyTraining as exc:
            return done, str(exc)
        return done, ""

    (lead, lead_error), (late, late_error) = run_workers(cluster.workers, body)
    assert lead_error == "" and len(lead) == 8
    for step, r in enumerate(lead):  # worker 0 alone in every chunk that came back: its own input
        prev = [lead[step - 1].values] if step else None
        assert check_mean_over_bitmap(
            [r],
            inputs[step],
            16,
            full=0,
            partial=(1, None),
            fallback=(0, None),
            prev=prev,
            slack_bits=cluster.slack_bits,
        )
    assert all(not np.any(r.bitmap & 0b10) for r in lead + late)  # worker 1 never counted
    if down:
        assert "locked out" in late_error and "\n" not in late_error, late_error
        assert len(late) < 8
        # The 90% check stayed quiet: it needs unhealthy_reduces (3) reduces in a row at >= 90% fallback,
        # and the lockout check fired first. (One reduce over 90% alone, the late worker overtaken by a
        # whole reduce on a loaded machine, is no such run: about 1 in 25 runs, before and after 28 Nov.)
        cfg = cluster.workers[1].config
        heavy = [bool(np.mean(r.fallback != Fallback.NONE) >= cfg.unhealthy_fraction) for r in late]
        runs = [
            all(heavy[i : i + cfg.unhealthy_reduces]) for i in range(len(heavy) - cfg.unhealthy_reduces + 1)
        ]
        assert not any(runs), heavy
    else:
        assert late_error == "" and len(late) == 8


# ---- through torch.distributed -------------------------------------------------------------------------
def _spawn(target, world: int, *args) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_guarded, args=(target, r, world, results, *args)) for r in range(world)]
    return start_and_collect(procs, results, world, 120)


def _guarded(target, rank, world, results, *args) -> None:
    try:
        results.put((rank, True, target(rank, world, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _stock_ddp_rank(rank: int, world: int, store_path: str, env: dict[str, str]) -> dict:
    """A stock script: init_process_group("lta") from the environment; reports what joining raised."""
    import os

    import torch.distributed as dist

    import hostlib.torch_ext.backend  # noqa: F401  (registers "lta")

    os.environ.update(env)
    t0 = time.perf_counter()
    try:
        dist.init_process_group(
            "lta",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=30),
        )
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - t0}
    dist.destroy_process_group()
    return {"error": None}


def test_stock_ddp_against_a_dead_switch_fails_fast(tmp_path):
    silent, (host, port) = _silent_port()
    with silent:
        env = {"LTA_SWITCH": f"{host}:{port}", "LTA_HEALTH_TIMEOUT": "1"}
        results = _spawn(_stock_ddp_rank, 2, str(tmp_path / "store"), env)
    for out in results:
        # torch may wrap the backend's exception; its message must survive
        assert out["error"] is not None, "joining a dead switch succeeded"
        assert "did not answer" in out["message"] and f"{host}:{port}" in out["message"]
        assert out["seconds"] < 15


def test_stock_ddp_with_worker_addresses_off_by_a_few_fails(tmp_path):
    base = 42100
    switch = SoftSwitch()
    server = SoftSwitchServer(switch).start()
    try:
        switch.add_job(JobConfig(1, [("127.0.0.1", base + 3), ("127.0.0.1", base + 4)], elems_per_packet=K))
        host, port = server.address
        env = {
            "LTA_SWITCH": f"{host}:{port}",
            "LTA_BIND_PORT_BASE": str(base),
            "LTA_ELEMS_PER_PACKET": str(K),
            "LTA_HEALTH_TIMEOUT": "1",
        }
        results = _spawn(_stock_ddp_rank, 2, str(tmp_path / "store"), env)
    finally:
        server.stop()
    for out in results:
        assert out["error"] is not None and "drop_bad_worker" in out["message"]
    assert switch.read_counters(1)["drop_bad_worker"] >= 2


def _stats_rank(rank: int, world: int, store_path: str) -> dict:
    import torch
    import torch.distributed as dist

    from hostlib.torch_ext import lta_stats, should_commit
    from hostlib.torch_ext.backend import register

    register()
    dist.init_process_group("lta", init_method=f"file://{store_path}", rank=rank, world_size=world)
    t = torch.full((40000,), float(rank))  # more than one packet (K): the lossy path
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    stats = lta_stats()
    out = {
        "mean": float(t.mean()),
        "reduces": stats["reduces"],
        "healthy": stats["healthy"],
        "commit": should_commit(),
    }
    dist.destroy_process_group()
    return out


def test_public_stats_and_commit_signal_of_the_lta_group(tmp_path):
    for out in _spawn(_stats_rank, 2, str(tmp_path / "store")):
        assert out["mean"] == pytest.approx(0.5, abs=1e-5)
        assert out["reduces"] == 1 and out["healthy"] and out["commit"]
