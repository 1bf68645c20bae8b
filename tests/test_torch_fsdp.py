"""FSDP2, DeviceMesh, DTensor, new_group and distributed checkpoint on ``init_process_group("lta")``, and
its lossy reduce-scatter and all-gather, in spawned processes.

Ranks meet through a FileStore; rank 0 of every lta group hosts a softswitch (self-hosted mode). Each rank
first trains with gloo, then the same model with lta, so one spawn gives both; assertions run here.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hostlib import codec
from tests.ranks import start_and_collect

K = 64  # small packets: every layer below is many chunks, so its gathers and reduce-scatters go lossy
EXACT = {"LTA_EXACT_MS": "2000"}  # rounds close by the drop policy only: exact however ranks are scheduled
ALL_LOSSY = "allreduce,reduce_scatter,all_gather"
WORLD = 2
RS_CALLS, RS_NUMEL = 8, WORLD * 16 * K
S = 2  # the all-gather's staleness bound
AG_STEPS, AG_NUMEL = 25, 6 * K
HSDP_STEPS = 6
LOSSY_ENV = {  # 25% GRAD loss, 30% PARAM loss, S=2
    "LTA_LOSSY_OPS": "reduce_scatter,all_gather",
    "LTA_DROP_UP": "0.25",
    "LTA_DROP_PARAM": "0.3",
    "LTA_STALE_BOUND": str(S),
    "LTA_SEED": "5",
}


def spawn(target, world: int, tmp_path, env: dict[str, str], *args) -> list:
    """Run ``target(rank, world, tmp_path, *args)`` on ``world`` ranks with ``env`` set; their results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_guarded, args=(target, r, world, str(tmp_path), env, results, *args))
        for r in range(world)
    ]
    return start_and_collect(procs, results, world, 150)


def _guarded(target, rank, world, tmp, env, results, *args) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        results.put((rank, True, target(rank, world, tmp, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _init(backend: str, rank: int, world: int, path: str) -> None:
    store = dist.FileStore(path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
        torch.nn.Linear(128, 128), torch.nn.Linear(128, 4),
    )  # fmt: skip


def _batches(rank: int, steps: int) -> list[torch.Tensor]:
    data = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(16, 32, generator=data) for _ in range(steps)]


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x[:, :4]).pow(2).mean()


def _train_fsdp(mesh, steps: int, rank: int) -> tuple[torch.nn.Module, list[float]]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x in _batches(rank, steps):
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def _train_one_process(world: int, steps: int) -> list[float]:
    """What data-parallel training computes, in one process: the gradient of the ranks' mean loss."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    per_rank = [_batches(r, steps) for r in range(world)]
    losses = []
    for step in range(steps):
        loss = sum(_loss(model, per_rank[r][step]) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _mean_loss(losses: list[float]) -> list[float]:
    """The loss averaged over ranks (reliably, on the default group), per step."""
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# ---- FSDP2 on a 1-D mesh, DTensor, new_group, distributed checkpoint ---------------------------------------
def _fsdp_rank(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.checkpoint import load, save
    from torch.distributed.device_mesh import init_device_mesh

    from hostlib.torch_ext import lta_stats

    out: dict = {}
    for backend in ("gloo", "lta"):
        _init(backend, rank, world, f"{tmp}/store-{backend}")
        mesh = init_device_mesh("cpu", (world,))
        model, losses = _train_fsdp(mesh, 20, rank)
        out[backend] = _mean_loss(losses)
        if backend == "lta":
            pg = dist.group.WORLD
            out["group_name"] = pg.group_name
            out["stats"] = pg.collective_stats()
            out["lta_stats"] = sorted(lta_stats()["collectives"])  # the public view of the same rows
            # DTensor: the sharded weight gathers back to what every rank holds
            weight = model[2].weight
            out["dtensor_sum"] = float(weight.full_tensor().sum())
            local = torch.tensor([float(weight.to_local().sum())])
            dist.all_reduce(local, group=dist.new_group(list(range(world))))  # a sub-group of its own
            out["shard_sum"] = float(local)
            # distributed checkpoint: save, disturb, load back
            state = {"model": model.state_dict()}
            save(state, checkpoint_id=f"{tmp}/dcp")
            before = float(model[2].weight.full_tensor().sum())
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            load(state, checkpoint_id=f"{tmp}/dcp")
            model.load_state_dict(state["model"])
            out["dcp"] = (before, float(model[2].weight.full_tensor().sum()))
            # a group of its own under emulated loss (a new group reads the LTA_* variables again)
            os.environ.update(LOSSY_ENV)
            lossy = dist.new_group(list(range(world)))
            out["reduce_scatter"] = _reduce_scatters(lossy, RS_CALLS, RS_NUMEL)
            out["all_gather"] = _all_gathers(lossy, AG_STEPS, AG_NUMEL)
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> list:
    """One spawn of WORLD ranks for the tests below: FSDP2 with gloo, then with lta (DTensor, new_group,
    checkpoint), then reduce-scatters and all-gathers on a new lta group under emulated loss."""
    env = {"LTA_ELEMS_PER_PACKET": str(K), "LTA_LOSSY_OPS": ALL_LOSSY, **EXACT}
    return spawn(_fsdp_rank, WORLD, tmp_path_factory.mktemp("fsdp"), env)


def test_fsdp2_on_lta_equals_gloo_and_device_mesh_dtensor_dcp_work(fsdp_runs):
    results = fsdp_runs
    first = results[0]
    assert first["group_name"]  # "ProcessGroup name not set" before
    gloo, lta = np.array(first["gloo"]), np.array(first["lta"])
    assert len(lta) == 20 and gloo[-1] < 0.8 * gloo[0]  # it trains
    np.testing.assert_allclose(lta, gloo, rtol=1e-3)
    for r in results:
        assert r["lta_stats"] == ["all_gather", "allreduce", "reduce_scatter"]
        stats = r["stats"]
        # gradients and parameters went through the switch, after each key's first (reliable) gather
        assert stats["reduce_scatter"]["lossy_calls"] >= 19 * 3
        assert stats["all_gather"]["lossy_calls"] >= 19 * 3
        assert stats["all_gather"]["stale_copies"] == 0 and stats["reduce_scatter"]["loss_seen"] == 0.0
        assert r["dtensor_sum"] == pytest.approx(first["dtensor_sum"], rel=1e-6)
        assert r["shard_sum"] == pytest.approx(first["dtensor_sum"], rel=1e-5)
        before, after = r["dcp"]
        assert after == pytest.approx(before, rel=1e-6) and before != 0.0


# ---- HSDP on a 2-D mesh -----------------------------------------------------------------------------------
def _hsdp_rank(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    _init("lta", rank, world, f"{tmp}/store")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    _, losses = _train_fsdp(mesh, HSDP_STEPS, rank)
    out = {
        "lta": _mean_loss(losses),
        "groups": [type(mesh.get_group(d)).__name__ for d in ("replicate", "shard")],
        "shard_stats": mesh.get_group("shard").collective_stats(),
        "replicate_stats": mesh.get_group("replicate").collective_stats(),
    }
    dist.destroy_process_group()
    return out


def test_hsdp_on_a_2d_mesh_equals_one_process_training(tmp_path):
    env = {"LTA_ELEMS_PER_PACKET": str(K), "LTA_LOSSY_OPS": ALL_LOSSY, **EXACT}
    results = spawn(_hsdp_rank, 4, tmp_path, env)
    # gloo's HSDP equals this too (the 1-D test compares with gloo itself); 4 more ranks cost 20 s here
    expected = _train_one_process(4, HSDP_STEPS)
    np.testing.assert_allclose(results[0]["lta"], expected, rtol=1e-3)
    for r in results:
        assert r["groups"] == ["ProcessGroupLta", "ProcessGroupLta"]
        # each mesh dimension is a job of its own: reduce-scatter over the shard dimension, allreduce of
        # the shards over the replicate dimension, both through a switch
        assert r["shard_stats"]["reduce_scatter"]["lossy_calls"] > 0
        assert r["shard_stats"]["all_gather"]["lossy_calls"] > 0
        assert r["replicate_stats"]["allreduce"]["lossy_calls"] > 0


# ---- lossy reduce-scatter: the sum over the counted set / count, per chunk ---------------------------------
def _rs_inputs(rank: int, call: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([rank, call])
    return rng.standard_normal(n).astype(np.float32)


def _reduce_scatters(pg, calls: int, numel: int) -> list:
    rank, world = pg.rank(), pg.size()
    out = []
    for call in range(calls):
        x = torch.from_numpy(_rs_inputs(rank, call, numel))
        y = torch.empty(numel // world)
        dist.reduce_scatter_tensor(y, x, group=pg)
        r = pg.last_reduce
        out.append((y.numpy().copy(), r.count.copy(), r.bitmap.copy(), r.fallback.copy(), r.shift.copy()))
    out.append(pg.collective_stats()["reduce_scatter"])
    return out


def test_lossy_reduce_scatter_is_the_counted_sum_over_count_per_chunk(fsdp_runs):
    world, calls, numel = WORLD, RS_CALLS, RS_NUMEL
    m = numel // world
    partial = 0
    for rank, res in enumerate(r["reduce_scatter"] for r in fsdp_runs):
        stats = res[-1]
        assert stats["lossy_calls"] == calls and 0.1 < stats["loss_seen"] < 0.4
        # Owner-only RESULTs: this rank waited for its own chunks alone and got nothing of the others'.
        assert stats["chunks_received"] == stats["chunks"] == calls * m // K
        for call, (y, count, bitmap, fallback, shift) in enumerate(res[:-1]):
            inputs = np.stack([_rs_inputs(w, call, numel) for w in range(world)]).astype(np.float64)
            # The shards go interleaved: chunk j of rank r's shard is unit chunk j * world + r.
            assert np.all(count.reshape(-1, world)[:, np.arange(world) != rank] == 0)
            for j in range(m // K):  # this rank's chunks (m is whole chunks)
                c = j * world + rank
                if fallback[c] != 0:
                    continue
                who = [w for w in range(world) if int(bitmap[c]) >> w & 1]
                assert len(who) == count[c] > 0
                partial += len(who) < world
                lo = rank * m + j * K
                expected = inputs[who, lo : lo + K].sum(axis=0) / count[c] * world
                got = y[j * K : (j + 1) * K]
                bound = world * codec.error_bound(shift)[c] + np.abs(expected) * 2**-22
                assert np.all(np.abs(got - expected) <= bound), (rank, call, c, who)
    assert partial > 10  # loss happened, and the partial chunks were renormalized


def _small_pool_rank(rank: int, world: int, tmp: str) -> list:
    _init("lta", rank, world, f"{tmp}/store")
    try:
        return _reduce_scatters(dist.group.WORLD, 2, world * 40 * K)
    finally:
        dist.destroy_process_group()


def test_reduce_scatter_in_a_small_pool_waits_for_its_chunks_and_the_news_chunks(tmp_path):
    """A pool of 64 slots (M = 3: docs/protocol.md, "Owner-only units"), 2 ranks, 80 chunks a call, no
    loss: each rank's shard is the exact sum; it waited for its own chunks and every third chunk, whoever
    owns it (``chunks_received``), and those third chunks came back counted on every rank."""
    world, calls, numel = 2, 2, 2 * 40 * K
    env = {"LTA_ELEMS_PER_PACKET": str(K), "LTA_POOL_SIZE": "64", "LTA_LOSSY_OPS": "reduce_scatter", **EXACT}
    results = spawn(_small_pool_rank, world, tmp_path, env)
    chunks = numel // K
    every = (64 - 1) // 2 // 8  # D = P - 1 = 63 data slots, A = 31, M = 3
    news = np.arange(chunks) % every == every - 1
    for rank, res in enumerate(results):
        owned = np.arange(chunks) % world == rank  # interleaved: chunk j of rank r's shard is j * world + r
        stats = res[-1]
        assert stats["chunks"] == calls * int(owned.sum())
        assert stats["chunks_received"] == calls * int((owned | news).sum())
        for call, (y, count, _, fallback, _) in enumerate(res[:-1]):
            assert np.all(count[owned | news] == world) and np.all(fallback == 0)
            assert np.all(count[~owned & ~news] == 0)
            inputs = np.stack([_rs_inputs(w, call, numel) for w in range(world)]).astype(np.float64)
            m = numel // world
            np.testing.assert_allclose(y, inputs[:, rank * m : (rank + 1) * m].sum(axis=0), rtol=0, atol=1e-4)


# ---- lossy all-gather: the previous copy for a lost shard, never older than S -----------------------------


def _shard(rank: int, step: int, layer: int, n: int) -> torch.Tensor:
    """A shard whose values say whose it is, which step and which layer (exact in float32)."""
    return torch.full((n,), 1000.0 * rank + 10.0 * step + layer) + torch.arange(n) / 1024.0


def _all_gathers(pg, steps: int, n: int) -> dict:
    rank, world = pg.rank(), pg.size()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    held = []  # per step and layer: the (step, layer) of every other rank's copy handed out
    for step in range(steps):
        row = []
        for layer in (0, 1):  # two layers of the same size: told apart by their place in the step
            out = torch.empty(world * n)  # a fresh buffer every call, as FSDP2's
            dist.all_gather_into_tensor(out, _shard(rank, step, layer, n), group=pg)
            chunks = (out.view(world, n) - torch.arange(n) / 1024.0).view(world, n // K, K)
            assert torch.all(chunks == chunks[:, :, :1]), "a chunk mixes copies of different calls"
            row.append(chunks[:, :, 0].tolist())  # per rank, per chunk: the copy's marker value
        held.append(row)
        opt.step()  # the step boundary (torch's optimizer-step hook)
    ints = torch.arange(world * 3, dtype=torch.int64)
    gathered_ints = torch.empty(world * world * 3, dtype=torch.int64)
    dist.all_gather_into_tensor(gathered_ints, ints, group=pg)
    tiny = torch.empty(world * 4)
    dist.all_gather_into_tensor(tiny, torch.full((4,), float(rank)), group=pg)
    return {"held": held, "stats": pg.collective_stats()["all_gather"], "tiny": tiny.tolist()}


def test_lossy_all_gather_keeps_previous_copies_never_older_than_s(fsdp_runs):
    world, steps = WORLD, AG_STEPS
    stale = 0
    for rank, res in enumerate(r["all_gather"] for r in fsdp_runs):
        for step, row in enumerate(res["held"]):
            for layer, per_rank in enumerate(row):
                for src, values in enumerate(per_rank):
                    for value in values:  # one chunk's copy
                        src_rank, rest = divmod(round(value), 1000)
                        held_step, held_layer = divmod(rest, 10)
                        assert (src_rank, held_layer) == (src, layer)  # that rank's chunk of that layer
                        age = step - held_step
                        if step == 0 or src == rank:
                            assert age == 0  # the first gather is reliable; a rank's own shard is its own
                        assert 0 <= age <= S
                        stale += age > 0
        stats = res["stats"]
        assert stats["max_age"] <= S and stats["lossy_calls"] == 2 * (steps - 1) - stats["resyncs"]
        assert stats["reliable_calls"] == 2 + 2 + stats["resyncs"]  # first calls, ints, tiny, resyncs
        assert res["tiny"] == [float(w) for w in range(world) for _ in range(4)]
    assert stale > 20  # copies were lost and the previous ones handed out


# ---- the setting ------------------------------------------------------------------------------------------
def test_lossy_ops_and_stale_bound_come_from_the_environment_and_refuse_typos():
    from hostlib.torch_ext.rendezvous import LtaOptions

    assert LtaOptions.from_env({}).lossy_ops == {"allreduce", "reduce_scatter"}
    assert LtaOptions.from_env({}).stale_bound == 8
    chosen = LtaOptions.from_env({"LTA_LOSSY_OPS": " all_gather, reduce_scatter ", "LTA_STALE_BOUND": "3"})
    assert chosen.lossy_ops == {"all_gather", "reduce_scatter"} and chosen.stale_bound == 3
    assert LtaOptions.from_env({"LTA_LOSSY_OPS": "none"}).lossy_ops == frozenset()
    with pytest.raises(ValueError, match=r"unknown collective\(s\) \['allgather'\]"):
        LtaOptions.from_env({"LTA_LOSSY_OPS": "allreduce,allgather"})
    with pytest.raises(ValueError, match=r"LTA_STALE_BOUND='0': must be an integer >= 1"):
        LtaOptions.from_env({"LTA_STALE_BOUND": "0"})
    with pytest.raises(ValueError, match="unknown collective"):
        LtaOptions(lossy_ops=frozenset({"broadcast"}))
    exact = LtaOptions.from_env({"LTA_EXACT_MS": "1500"}).transport
    assert exact.exact and exact.min_deadline_ms == exact.max_deadline_ms == exact.sync_deadline_ms == 1500
    assert not LtaOptions.from_env({}).transport.exact


# ---- the lossy all-gather's copy into its output ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False])
def test_gathered_rows_land_in_the_output_end_to_end(dtype, contiguous):
    """The gather hands out an (N, m) view of its padded rows (m not a multiple of K here); the output gets
    rank r's shard at [r·m, (r+1)·m), converted to its dtype, whatever its layout."""
    from hostlib.torch_ext.backend import _copy_rows_out

    world, m, padded = 3, 37, 2 * 20
    held = np.arange(world * padded, dtype=np.float32).reshape(world, padded) / 8.0
    rows = held[:, :m]  # strided: each row skips its padding
    expected = np.concatenate([held[r, :m] for r in range(world)])
    if contiguous:
        output = torch.empty(world * m, dtype=dtype)
    else:
        output = torch.empty(2 * world * m, dtype=dtype)[::2]
    _copy_rows_out(output, rows)
    assert output.dtype == dtype
    want = torch.from_numpy(expected).to(dtype).float().numpy()
    np.testing.assert_array_equal(output.float().numpy(), want)
