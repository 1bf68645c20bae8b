"""DDP with the LTA comm hook, and stock DDP over ``init_process_group("lta")``, in spawned processes.

Each test spawns a few ranks that meet through a FileStore; rank 0 hosts the softswitch (self-hosted
mode of hostlib.torch_ext.rendezvous). Ranks report back through a queue; assertions run here.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hostlib import codec
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.torch_ext.ddp_hook import LtaHookState, lta_hook
from hostlib.torch_ext.rendezvous import LtaOptions, join_job
from hostlib.transport import Fallback, TransportConfig
from tests.conftest import run_workers
from tests.ranks import start_and_collect, train_regression

WORLD = 3


def spawn(target, tmp_path, *args) -> list:
    """Run ``target(rank, world, store_path, results, *args)`` on WORLD ranks; return their results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_path = str(tmp_path / "store")
    procs = [
        ctx.Process(target=_guarded, args=(target, r, WORLD, store_path, results, *args))
        for r in range(WORLD)
    ]
    return start_and_collect(procs, results, WORLD, 120)


def _guarded(target, rank, world, store_path, results, *args) -> None:
    torch.set_num_threads(1)
    try:
        results.put((rank, True, target(rank, world, store_path, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    )


# ---- the comm hook ----------------------------------------------------------------------------------
def _hook_rank(rank: int, world: int, store_path: str) -> dict:
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    base = _model()
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)  # small buckets: several per step
    direct, staged = (
        DDP(copy.deepcopy(base), bucket_cap_mb=0.01),
        DDP(copy.deepcopy(base), bucket_cap_mb=0.01),
    )
    # Lossless: only a timer could close a round short, mistaking a rank descheduled for a moment (two
    # ranks and the switch share 2 cores) for a lost packet. A late exponent proposal costs the whole
    # bucket (the rank withholds it whatever its values), so give late ranks seconds, not 200 ms. The
    # tail of a reduce waits one RTO (min..max_deadline_ms), not the lag deadline: seconds there too.
    patient = TransportConfig(**{f"{name}_deadline_ms": 5000.0 for name in ("sync", "lag", "min", "max")})
    session = join_job(dist.PrefixStore("hook", store), rank, world, LtaOptions(job_id=1, transport=patient))
    direct.register_comm_hook(LtaHookState(session.worker), lta_hook)
    staged.register_comm_hook(LtaHookState(session.worker, force_host_staging=True), lta_hook)
    x = torch.randn(32, 20, generator=torch.Generator().manual_seed(rank))
    out: dict = {"diff": [], "bound": [], "max_grad": 0.0}
    for step in range(3):
        for model in (plain, direct, staged):
            model.zero_grad()
            (model(x * (step + 1)).pow(2).mean()).backward()
        local = copy.deepcopy(base)
        (local(x * (step + 1)).pow(2).mean()).backward()
        biggest = torch.tensor([max(p.grad.abs().max().item() for p in local.parameters())])
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
        for name, model in (("direct", direct), ("staged", staged)):
            diff = max(
                (a.grad - b.grad).abs().max().item()
                for a, b in zip(model.parameters(), plain.parameters(), strict=True)
            )
            out["diff"].append((name, diff))
        out["bound"].append(float(biggest))
        out["max_grad"] = max(out["max_grad"], max(p.grad.abs().max().item() for p in plain.parameters()))
    out["stats"] = session.worker.stats.as_dict()

    # Drift and its reset: with RESULTs lost on the way down, replicas that fall back drift apart; the
    # owners' periodic re-broadcast (lossless PARAM here) makes them identical again.
    # No FLUSH retries: a lost RESULT falls back at its first deadline (keeps the test short). Without
    # FLUSHes a round closes only when every rank has sent, so a rank whose peers reach a reduce later
    # than its deadline falls back on all of it; three such reduces in a row (four ranks on two busy
    # cores) tripped the health check in a full run. Falling back is what this part provokes: warn.
    hasty = TransportConfig(max_flushes=0, max_deadline_ms=50.0, on_unhealthy="warn")
    options = LtaOptions(job_id=2, drop={"down": DropPolicy(p=0.2)}, transport=hasty)
    lossy = join_job(dist.PrefixStore("drift", store), rank, world, options)
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    state = LtaHookState(lossy.worker, rebroadcast_every=3)
    model.register_comm_hook(state, lta_hook)
    state.attach(model.module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spread = []
    for _ in range(4):  # steps 0..2 drift; the forward of step 3 re-broadcasts first
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        gathered = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        spread.append(max((g - gathered[0]).abs().max().item() for g in gathered))
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    model(x)  # forward of step 4: 4 % 3 != 0, nothing; call rebroadcast explicitly to check the reset
    state.rebroadcast()
    after = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    gathered = [torch.zeros_like(after) for _ in range(world)]
    dist.all_gather(gathered, after)
    out["spread_before_reset"] = max(spread[:3])
    out["spread_after_reset"] = max((g - gathered[0]).abs().max().item() for g in gathered)
    out["changed_by_reset"] = (after - before).abs().max().item()
    out["hook_stats"] = state.stats.as_dict()
    dist.barrier()
    session.close()
    lossy.close()
    dist.destroy_process_group()
    return out


def test_hook_equals_gloo_ddp_without_loss_and_rebroadcast_resets_drift(tmp_path):
    results = spawn(_hook_rank, tmp_path)
    # codec bound per chunk: 2^-shift <= 2·max|x|·2^(L-30); float32 rounding of the mean on top
    bound_factor = 2.0 * 2.0 ** (codec.headroom_bits(WORLD) - 30)
    for rank, out in enumerate(results):
        assert out["max_grad"] > 1e-3
        for (name, diff), biggest in zip(out["diff"], np.repeat(out["bound"], 2), strict=True):
            assert diff <= bound_factor * biggest + 1e-6 * out["max_grad"], (rank, name, diff)
        assert out["stats"]["chunks_partial"] == 0 and out["stats"]["fallback_prev"] == 0
        assert out["hook_stats"]["chunks_fallback"] > 0, "down loss never triggered a fallback"
        assert out["spread_before_reset"] > 1e-4, "replicas did not drift: nothing to reset"
        assert out["spread_after_reset"] == 0.0
        assert out["hook_stats"]["rebroadcasts"] == 2  # at step 3 (by the forward hook) and explicitly
    assert any(out["changed_by_reset"] > 0 for out in results)


def test_rebroadcast_never_rolls_a_replica_back_to_a_late_copy(make_cluster):
    """Chaos seed 91 (hook, kill, PARAM loss): a receiver whose re-broadcast ended at its deadline before
    an owner published got that owner's copies late, and they waited in its inbox; at the next
    re-broadcast, wherever the owner's new copy was lost, the old one was taken, rolling those chunks back
    by a whole period while its peers kept theirs. Survivors then differed by ~1e-2 and exited 0.

    Here, deterministically: the receiver (worker 1) collects step 5 alone (its deadline passes, worker
    0's copies come later); both replicas then take the same update; at step 10 every PARAM to worker 1 is
    lost (the end markers are spared). Both replicas must equal the update computed with numpy."""
    cluster = make_cluster(2, seed=3, heartbeat_interval_s=0)  # no relayed heartbeats in param_fwd below
    modules = [torch.nn.Linear(16, 16) for _ in range(2)]
    init = torch.nn.utils.parameters_to_vector(modules[0].parameters()).detach().numpy().copy()
    for module in modules[1:]:
        torch.nn.utils.vector_to_parameters(torch.from_numpy(init.copy()), module.parameters())
    states = [LtaHookState(w, rebroadcast_every=5, collect_deadline_ms=50.0) for w in cluster.workers]
    for state, module in zip(states, modules, strict=True):
        state.attach(module)
        state.manager.step = 5
    states[1].rebroadcast()  # worker 0 has not published: worker 1 gives up on it at the deadline
    states[0].rebroadcast()  # worker 0's step-5 copies reach worker 1 now, after its step was accounted
    # rebroadcast() returns once its own collect is done, not once the switch has relayed what it sent: a
    # loaded switch thread could still hold worker 0's copies when the PARAM drop policy below is set, and
    # drop them (a full run saw no late copy). Wait for every copy and each owner's end marker to be relayed.
    relayed = sum(state._exchange.stats.chunks_expected + 1 for state in states)
    deadline = time.monotonic() + 10.0
    while cluster.switch.read_counters(cluster.job_id)["param_fwd"] < relayed:
        assert time.monotonic() < deadline, "the switch did not relay the step-5 copies within 10 s"
        time.sleep(0.01)
    update = np.linspace(-1.0, 1.0, init.size, dtype=np.float32)
    for state, module in zip(states, modules, strict=True):
        flat = torch.nn.utils.parameters_to_vector(module.parameters()).detach()
        torch.nn.utils.vector_to_parameters(flat + torch.from_numpy(update), module.parameters())
        state.manager.step = 10
    cluster.switch.set_drop_policy(cluster.job_id, "param", DropPolicy(p=1.0), worker=1)
    run_workers(cluster.workers, lambda worker, i: states[i].rebroadcast())
    expected = init + update
    for rank, module in enumerate(modules):
        got = torch.nn.utils.parameters_to_vector(module.parameters()).detach().numpy()
        np.testing.assert_array_equal(got, expected, err_msg=f"worker {rank}'s replica")
    assert states[1]._exchange.stats.late_copies_dropped > 0, "no late copy reached the receiver"


# ---- the process-group backend ------------------------------------------------------------------------
def _backend_rank(rank: int, world: int, store_path: str) -> dict:
    import hostlib.torch_ext.backend  # noqa: F401  (registers "lta")

    options = LtaOptions(drop={"up": DropPolicy(p=0.1)}, seed=3)
    dist.init_process_group(
        "lta", init_method=f"file://{store_path}", rank=rank, world_size=world, pg_options=options
    )
    pg = dist.distributed_c10d._get_default_group()
    model = DDP(_model())  # broadcasts rank 0's weights (reliable path)
    losses = train_regression(model, rank, 40)
    ranks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(ranks, torch.tensor([float(rank)]))
    count = torch.tensor([rank + 1])
    dist.all_reduce(count)  # integer: reliable, exact
    # Record the transport's result of the next two lossy reduces: their bitmaps say whose chunks arrived.
    reduced = []
    allreduce = pg.worker.allreduce

    def recording(*args, **kwargs):
        result = allreduce(*args, **kwargs)
        reduced.append((result.bitmap.tolist(), result.fallback.tolist()))
        return result

    pg.worker.allreduce = recording
    total = torch.full((1000,), float(rank))
    dist.all_reduce(total)  # float SUM, lossy path: the estimate of 0+1+2
    mean = torch.full((1000,), float(rank))
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    pg.worker.allreduce = allreduce
    dist.barrier()
    out = {
        "backend": dist.get_backend(),
        "losses": losses,
        "ranks": [float(r) for r in ranks],
        "count": int(count),
        "total": total.numpy().copy(),
        "mean": mean.numpy().copy(),
        "reduced": reduced,
        "elems_per_packet": pg.worker.config.elems_per_packet,
        "partial": pg.worker.stats.chunks_partial,
        "lossy_calls": pg.lossy_calls,
        "weights": torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy(),
    }
    dist.destroy_process_group()
    return out


def test_init_process_group_lta_trains_stock_ddp(tmp_path):
    results = spawn(_backend_rank, tmp_path)
    for out in results:
        assert out["backend"] == "lta"
        first, last = np.mean(out["losses"][:5]), np.mean(out["losses"][-5:])
        assert last < 0.5 * first, f"loss went from {first:.3f} to {last:.3f}"
        assert out["ranks"] == [0.0, 1.0, 2.0]
        assert out["count"] == 6
        assert out["lossy_calls"] >= 40 + 2
        assert out["partial"] > 0, "10% up loss never left a chunk partial"
        # Rank r sent r: a chunk that came back is the mean over the ranks in its bitmap (AVG), times
        # the world size for SUM (0+1+2 = 3 where all three arrived).
        assert len(out["reduced"]) == 2, "SUM and AVG of a float tensor must take the lossy path"
        k = out["elems_per_packet"]
        for (bitmaps, fallbacks), values, scale in zip(
            out["reduced"], (out["total"], out["mean"]), (WORLD, 1), strict=True
        ):
            arrived = [c for c, f in enumerate(fallbacks) if f == Fallback.NONE]
            assert arrived, "no chunk of the reduce came back"
            for c in arrived:
                who = [r for r in range(WORLD) if bitmaps[c] >> r & 1]
                expected = scale * np.mean(who)
                np.testing.assert_allclose(values[c * k : (c + 1) * k], expected, rtol=1e-6, atol=1e-6)
    # up loss is seen identically by every rank, so the replicas stay equal
    for out in results[1:]:
        np.testing.assert_allclose(out["weights"], results[0]["weights"], atol=1e-6)


def test_options_from_environment():
    env = {
        "LTA_SWITCH": "10.0.0.1:48879",
        "LTA_JOB_ID": "7",
        "LTA_FALLBACK": "zero",
        "LTA_BIND_PORT_BASE": "41000",
    }
    options = LtaOptions.from_env(env)
    assert options.switch == ("10.0.0.1", 48879) and options.job_id == 7
    assert options.transport.fallback == "zero" and options.bind_port_base == 41000
    with pytest.raises(ValueError, match="LTA_JOB_ID"):
        LtaOptions.from_env({"LTA_JOB_ID": "x"})
    with pytest.raises(ValueError, match="self-hosted"):
        LtaOptions.from_env({**env, "LTA_DROP_UP": "0.1"})
