"""The DDP comm hook and the "lta" process-group backend, unchanged, across a leaf-spine tree.

Four ranks, two behind each of two leaf softswitches, and a spine (UDP, loopback, threads of this test
process). The job configuration says which leaf serves each worker: every rank's ``LTA_SWITCH`` /
``LtaOptions.switch`` is its leaf, and the leaves' jobs list the workers' fixed addresses
(``bind_port_base``). Nothing else in torch_ext knows about the tree.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import random
import socket
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hostlib import codec
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.torch_ext.ddp_hook import LtaHookState, lta_hook
from hostlib.torch_ext.rendezvous import LtaOptions, join_job
from hostlib.transport import Fallback, TransportConfig
from softswitch.hierarchy import leaf_blocks, leaf_job, spine_job
from softswitch.pipeline import SoftSwitch
from softswitch.server import SoftSwitchServer
from tests.ranks import start_and_collect, train_regression

WORLD, LEAVES = 4, 2
K, POOL = 64, 512


def free_port_base(n: int) -> int:
    """A base port with ``n`` consecutive free UDP ports on loopback (checked, then released)."""
    for _ in range(50):
        base = random.randint(20000, 60000)
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


class Tree:
    """Two leaves and a spine serving job ``job_id`` for workers at 127.0.0.1:(base + rank)."""

    def __init__(self, base: int, job_id: int = 1, leaf_up: float = 0.0, spine_up: float = 0.0) -> None:
        self.switches = [SoftSwitch(seed=i) for i in range(LEAVES + 1)]
        self.servers = [SoftSwitchServer(sw).start() for sw in self.switches]
        spine_addr = self.servers[-1].address
        for j, block in enumerate(leaf_blocks(WORLD, LEAVES)):
            ports = {w: ("127.0.0.1", base + w) for w in block}
            self.switches[j].add_job(
                leaf_job(job_id, ports, WORLD, spine_addr, j, pool_size=POOL, elems_per_packet=K)
            )
            if leaf_up:
                self.switches[j].set_drop_policy(job_id, "up", DropPolicy(p=leaf_up))
        self.switches[-1].add_job(
            spine_job(job_id, [s.address for s in self.servers[:-1]], pool_size=POOL, elems_per_packet=K)
        )
        if spine_up:
            self.switches[-1].set_drop_policy(job_id, "up", DropPolicy(p=spine_up))
        self.leaf_address = {
            w: "{}:{}".format(*self.servers[j].address)
            for j, block in enumerate(leaf_blocks(WORLD, LEAVES))
            for w in block
        }

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def spawn(target, tmp_path, *args) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_path = str(tmp_path / "store")
    procs = [ctx.Process(target=_guarded, args=(target, r, store_path, results, *args)) for r in range(WORLD)]
    return start_and_collect(procs, results, WORLD, 180)


def _guarded(target, rank, store_path, results, *args) -> None:
    torch.set_num_threads(1)
    try:
        results.put((rank, True, target(rank, store_path, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


# ---- the comm hook, lossless: equal to gloo's DDP within the codec bound ---------------------------------
def _hook_rank(rank: int, store_path: str, leaf: str, base: int) -> dict:
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=90))
    base_model = _model()
    plain = DDP(copy.deepcopy(base_model), bucket_cap_mb=0.01)
    hooked = DDP(copy.deepcopy(base_model), bucket_cap_mb=0.01)
    patient = TransportConfig(
        elems_per_packet=K,
        pool_size=POOL,
        **{f"{n}_deadline_ms": 5000.0 for n in ("sync", "lag", "min", "max")},
    )
    host, port = leaf.rsplit(":", 1)
    options = LtaOptions(switch=(host, int(port)), job_id=1, bind_port_base=base, transport=patient)
    session = join_job(dist.PrefixStore("hook", store), rank, WORLD, options)
    hooked.register_comm_hook(LtaHookState(session.worker), lta_hook)
    x = torch.randn(32, 20, generator=torch.Generator().manual_seed(rank))
    out: dict = {"diff": [], "bound": []}
    for step in range(3):
        for model in (plain, hooked):
            model.zero_grad()
            model(x * (step + 1)).pow(2).mean().backward()
        biggest = torch.tensor([max(p.grad.abs().max().item() for p in plain.parameters())])
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
        diff = max(
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(hooked.parameters(), plain.parameters(), strict=True)
        )
        out["diff"].append(diff)
        out["bound"].append(float(biggest))
    out["stats"] = session.worker.stats.as_dict()
    dist.barrier()
    session.close()
    dist.destroy_process_group()
    return out


def test_ddp_hook_through_two_leaves_and_a_spine_equals_gloo(tmp_path):
    base = free_port_base(WORLD)
    tree = Tree(base)
    try:
        results = spawn(_hook_rank_env, tmp_path, tree.leaf_address, base)
        counters = [sw.read_counters(1) for sw in tree.switches]
    finally:
        tree.stop()
    bound_factor = 2.0 * 2.0 ** (codec.headroom_bits(WORLD) - 30)
    for out in results:
        for diff, biggest in zip(out["diff"], out["bound"], strict=True):
            assert diff <= bound_factor * biggest + 1e-7, (diff, biggest)
        assert out["stats"]["chunks_partial"] == 0 and out["stats"]["chunks_full"] > 0
    assert all(c["up_partial"] > 0 and c["down_result"] > 0 for c in counters[:LEAVES])
    assert counters[-1]["result_quorum"] > 0


def _hook_rank_env(rank: int, store_path: str, leaf_address: dict, base: int) -> dict:
    return _hook_rank(rank, store_path, leaf_address[rank], base)


# ---- the backend, with loss on both levels -------------------------------------------------------------
def _backend_rank(rank: int, store_path: str, leaf_address: dict, base: int) -> dict:
    import hostlib.torch_ext.backend  # noqa: F401  (registers "lta")

    os.environ.update(
        LTA_SWITCH=leaf_address[rank],
        LTA_BIND_PORT_BASE=str(base),
        LTA_JOB_ID="2",
        LTA_ELEMS_PER_PACKET=str(K),
        LTA_POOL_SIZE=str(POOL),
    )
    dist.init_process_group("lta", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    pg = dist.distributed_c10d._get_default_group()
    model = DDP(_model())
    losses = train_regression(model, rank, 30)
    allreduce = pg.worker.allreduce
    reduced = []

    def recording(*args, **kwargs):
        result = allreduce(*args, **kwargs)
        reduced.append((result.bitmap.tolist(), result.fallback.tolist()))
        return result

    pg.worker.allreduce = recording
    mean = torch.full((4000,), float(rank))
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    pg.worker.allreduce = allreduce
    dist.barrier()
    out = {
        "losses": losses,
        "mean": mean.numpy().copy(),
        "reduced": reduced,
        "partial": pg.worker.stats.chunks_partial,
    }
    dist.destroy_process_group()
    return out


def test_lta_backend_through_the_tree_with_loss_on_both_levels(tmp_path):
    base = free_port_base(WORLD)
    tree = Tree(base, job_id=2, leaf_up=0.1, spine_up=0.1)
    try:
        results = spawn(_backend_rank, tmp_path, tree.leaf_address, base)
    finally:
        tree.stop()
    for out in results:
        first, last = np.mean(out["losses"][:5]), np.mean(out["losses"][-5:])
        assert last < 0.7 * first, f"loss went from {first:.3f} to {last:.3f}"
        assert out["partial"] > 0, "10% loss on both levels never left a chunk partial"
        ((bitmaps, fallbacks),) = out["reduced"]
        arrived = [c for c, f in enumerate(fallbacks) if f == Fallback.NONE]
        assert arrived
        for c in arrived:  # rank r sent r: the chunk is the mean over the ranks in its global bitmap
            who = [r for r in range(WORLD) if bitmaps[c] >> r & 1]
            np.testing.assert_allclose(out["mean"][c * K : (c + 1) * K], np.mean(who), rtol=1e-6, atol=1e-6)
