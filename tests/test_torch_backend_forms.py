"""The lta process group takes every call form torch and torchft use (hostlib/torch_ext/callforms.py), keeps
what the switch would degrade on the reliable path (float64, sparse, integers), and serves
monitored_barrier through gloo. Two spawned ranks; each expectation is written from the ranks' inputs
(rank r sends values that depend on r), not from the code's output.

The switch runs exact (``LTA_EXACT_MS``: rounds close by seeded drops only, none here), so the lossy path
returns every rank's contribution and differs from the exact sum by its fixed-point rounding alone.
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
from torch._C._distributed_c10d import AllgatherOptions

from hostlib.torch_ext import callforms
from tests.ranks import start_and_collect

WORLD = 2
K = 8
ENV = {"LTA_ELEMS_PER_PACKET": str(K), "LTA_EXACT_MS": "3000", "OMP_NUM_THREADS": "1"}


def spawn(target, tmp_path, world: int = WORLD) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_guarded, args=(target, r, world, store, results)) for r in range(world)]
    return start_and_collect(procs, results, world, 120)


def _guarded(target, rank, world, store, results) -> None:
    os.environ.update(ENV)
    torch.set_num_threads(1)
    try:
        import hostlib.torch_ext.backend  # noqa: F401  (registers "lta")

        dist.init_process_group(
            "lta", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        try:
            results.put((rank, True, target(rank, world)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _values(rank: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """Rank r's tensor: (r + 1) · (1, 2, ..., n) / 8 (exact in every float dtype used here)."""
    return (rank + 1) * torch.arange(1, n + 1, dtype=dtype) / 8


# ---- call forms -------------------------------------------------------------------------------------
def _forms_rank(rank: int, world: int) -> dict:
    pg = dist.distributed_c10d._get_default_group()
    n = 2 * K  # two packets: the lossy path
    out: dict[str, object] = {}

    def lossy_then(name, call):
        before = pg.lossy_calls
        result = call()
        out[name + ".lossy"] = pg.lossy_calls - before
        return result

    t = _values(rank, n)
    lossy_then("allreduce()", lambda: pg.allreduce([t]).wait())  # no opts: SUM
    out["allreduce()"] = t.numpy().copy()
    t = _values(rank, n)
    lossy_then("allreduce(SUM)", lambda: pg.allreduce([t], dist.ReduceOp.SUM).wait())
    out["allreduce(SUM)"] = t.numpy().copy()
    t = _values(rank, n)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    lossy_then("allreduce(opts=AVG)", lambda: pg.allreduce([t], opts=opts).wait())
    out["allreduce(opts=AVG)"] = t.numpy().copy()
    t = _values(rank, n)
    lossy_then(
        "allreduce(t, MAX, timeout)", lambda: pg.allreduce(t, dist.ReduceOp.MAX, timedelta(seconds=30)).wait()
    )
    out["allreduce(t, MAX, timeout)"] = t.numpy().copy()
    ints = torch.arange(n) * (rank + 1)
    pg.allreduce([ints], dist.ReduceOp.SUM).wait()
    out["allreduce(int)"] = ints.numpy().copy()

    a, b = _values(rank, n), _values(rank, 3)
    pg.allreduce_coalesced([a, b]).wait()
    out["allreduce_coalesced()"] = (a.numpy().copy(), b.numpy().copy())
    a = _values(rank, n)
    pg.allreduce_coalesced([a], dist.ReduceOp.MAX).wait()
    out["allreduce_coalesced(MAX)"] = a.numpy().copy()

    t = _values(rank, 5)
    pg.broadcast([t]).wait()  # root 0
    out["broadcast([t])"] = t.numpy().copy()
    t = _values(rank, 5)
    pg.broadcast(t, 1).wait()
    out["broadcast(t, 1)"] = t.numpy().copy()
    t = _values(rank, 5)
    bopts = dist.BroadcastOptions()
    bopts.rootRank = 1
    pg.broadcast([t], bopts).wait()
    out["broadcast([t], opts)"] = t.numpy().copy()

    outs = [torch.zeros(5) for _ in range(world)]
    pg.allgather(outs, _values(rank, 5)).wait()
    out["allgather(o, i)"] = [o.numpy().copy() for o in outs]
    outs = [torch.zeros(5) for _ in range(world)]
    pg.allgather([outs], [_values(rank, 5)], AllgatherOptions()).wait()
    out["allgather([o], [i], opts)"] = [o.numpy().copy() for o in outs]
    flat = torch.zeros(world * n)
    lossy_then("_allgather_base", lambda: pg._allgather_base(flat, _values(rank, n)).wait())
    out["_allgather_base"] = flat.numpy().copy()
    flat = torch.zeros(world * n)
    pg.all_gather_single(flat, _values(rank, n), timedelta(seconds=30)).wait()
    out["all_gather_single(timeout)"] = flat.numpy().copy()
    o0, o1 = torch.zeros(world), torch.zeros(world * 2)
    pg.allgather_into_tensor_coalesced([o0, o1], [torch.tensor([rank + 1.0]), _values(rank, 2)]).wait()
    out["allgather_into_tensor_coalesced"] = (o0.numpy().copy(), o1.numpy().copy())

    shard = torch.zeros(n)
    lossy_then(
        "_reduce_scatter_base()", lambda: pg._reduce_scatter_base(shard, _values(rank, world * n)).wait()
    )
    out["_reduce_scatter_base()"] = shard.numpy().copy()
    shard = torch.zeros(n)
    lossy_then(
        "reduce_scatter_single(AVG)",
        lambda: pg.reduce_scatter_single(shard, _values(rank, world * n), dist.ReduceOp.AVG).wait(),
    )
    out["reduce_scatter_single(AVG)"] = shard.numpy().copy()
    shard = torch.zeros(n)
    rs = dist.ReduceScatterOptions()
    rs.reduceOp = dist.ReduceOp.SUM
    pg.reduce_scatter_tensor_coalesced([shard], [_values(rank, world * n)], rs).wait()
    out["reduce_scatter_tensor_coalesced"] = shard.numpy().copy()

    t = _values(rank, 5)
    pg.reduce(t, 0).wait()  # root 0, SUM
    out["reduce(t, 0)"] = t.numpy().copy()
    t = _values(rank, 5)
    ropts = dist.ReduceOptions()
    ropts.rootRank, ropts.reduceOp = 1, dist.ReduceOp.MAX
    pg.reduce([t], ropts).wait()
    out["reduce([t], opts)"] = t.numpy().copy()

    gathered = [torch.zeros(3) for _ in range(world)] if rank == 0 else []
    pg.gather(gathered, _values(rank, 3), 0).wait()
    out["gather(o, i, 0)"] = [g.numpy().copy() for g in gathered]
    got = torch.zeros(3)
    pg.scatter(got, [_values(r, 3) for r in range(world)] if rank == 1 else [], 1).wait()
    out["scatter(o, i, 1)"] = got.numpy().copy()

    a2a = torch.zeros(world)
    pg.alltoall_base(a2a, torch.arange(world, dtype=torch.float32) + 10 * rank, [], []).wait()
    out["alltoall_base"] = a2a.numpy().copy()
    lists = [torch.zeros(1) for _ in range(world)]
    pg.alltoall(lists, [torch.tensor([100.0 * rank + r]) for r in range(world)]).wait()
    out["alltoall"] = [x.item() for x in lists]

    if rank == 0:
        pg.send(torch.tensor([42.0]), 1).wait()  # a tensor and no tag
    else:
        box = torch.zeros(1)
        pg.recv([box], 0).wait()
        out["recv"] = box.item()

    pg.barrier().wait()
    pg.barrier(timedelta(seconds=30)).wait()
    pg.barrier(dist.BarrierOptions()).wait()
    errors = []
    for bad in (lambda: pg.allreduce([torch.zeros(3)], "sum"), lambda: pg.barrier(dist.ReduceOp.SUM)):
        try:
            bad()
        except TypeError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out


def _expected_forms(world: int) -> dict:
    n = 2 * K
    base = np.arange(1, n + 1, dtype=np.float64) / 8
    ranks = np.arange(1, world + 1)  # rank r's factor is r + 1
    vals = {r: (r + 1) * base for r in range(world)}
    total = ranks.sum() * base
    five = np.arange(1, 6) / 8
    world_n = np.arange(1, world * n + 1) / 8
    return {
        "allreduce()": total,
        "allreduce(SUM)": total,
        "allreduce(opts=AVG)": total / world,
        "allreduce(t, MAX, timeout)": world * base,
        "allreduce(int)": np.arange(n) * ranks.sum(),
        "allreduce_coalesced(MAX)": world * base,
        "broadcast([t])": five,
        "broadcast(t, 1)": 2 * five,
        "broadcast([t], opts)": 2 * five,
        "allgather(o, i)": [(r + 1) * five for r in range(world)],
        "allgather([o], [i], opts)": [(r + 1) * five for r in range(world)],
        "_allgather_base": np.concatenate([vals[r] for r in range(world)]),
        "all_gather_single(timeout)": np.concatenate([vals[r] for r in range(world)]),
        "rs_total": ranks.sum() * world_n,
    }


def test_every_call_form_torch_and_torchft_use(tmp_path):
    results = spawn(_forms_rank, tmp_path)
    world, n = WORLD, 2 * K
    want = _expected_forms(world)
    tol = {"rtol": 1e-6, "atol": 1e-6}  # the lossy path's fixed-point rounding; reliable ones are exact
    for rank, out in enumerate(results):
        for name in ("allreduce()", "allreduce(SUM)", "allreduce(opts=AVG)"):
            np.testing.assert_allclose(out[name], want[name], **tol, err_msg=name)
            assert out[name + ".lossy"] == 1, f"{name} (float SUM/AVG, 2 packets) must go through the switch"
        assert out["allreduce(t, MAX, timeout).lossy"] == 0, "MAX is reliable"
        for name in ("allreduce(t, MAX, timeout)", "allreduce(int)", "allreduce_coalesced(MAX)"):
            np.testing.assert_array_equal(out[name], want[name], err_msg=name)
        a, b = out["allreduce_coalesced()"]
        np.testing.assert_array_equal(a, want["allreduce()"])
        np.testing.assert_array_equal(b, 3 * np.arange(1, 4) / 8)
        for name in ("broadcast([t])", "broadcast(t, 1)", "broadcast([t], opts)"):
            np.testing.assert_array_equal(out[name], want[name], err_msg=name)
        for name in ("allgather(o, i)", "allgather([o], [i], opts)"):
            for got, exp in zip(out[name], want[name], strict=True):
                np.testing.assert_array_equal(got, exp, err_msg=name)
        for name in ("_allgather_base", "all_gather_single(timeout)"):
            np.testing.assert_array_equal(out[name], want[name], err_msg=name)
        o0, o1 = out["allgather_into_tensor_coalesced"]
        np.testing.assert_array_equal(o0, np.arange(1, world + 1))
        np.testing.assert_array_equal(
            o1, np.concatenate([(r + 1) * np.arange(1, 3) / 8 for r in range(world)])
        )
        mine = want["rs_total"][rank * n : (rank + 1) * n]
        np.testing.assert_allclose(out["_reduce_scatter_base()"], mine, **tol)
        assert out["_reduce_scatter_base().lossy"] == 1
        np.testing.assert_allclose(out["reduce_scatter_single(AVG)"], mine / world, **tol)
        np.testing.assert_allclose(out["reduce_scatter_tensor_coalesced"], mine, **tol)
        np.testing.assert_array_equal(out["scatter(o, i, 1)"], (rank + 1) * np.arange(1, 4) / 8)
        np.testing.assert_array_equal(out["alltoall_base"], [10.0 * r + rank for r in range(world)])
        assert out["alltoall"] == [100.0 * r + rank for r in range(world)]
        assert len(out["errors"]) == 2 and all("opts must be" in e for e in out["errors"]), out["errors"]
        assert all("\n" not in e for e in out["errors"])
    np.testing.assert_array_equal(results[0]["reduce(t, 0)"], 3 * np.arange(1, 6) / 8)  # the root's sum
    np.testing.assert_array_equal(results[1]["reduce([t], opts)"], 2 * np.arange(1, 6) / 8)  # MAX at 1
    for got, r in zip(results[0]["gather(o, i, 0)"], range(world), strict=True):
        np.testing.assert_array_equal(got, (r + 1) * np.arange(1, 4) / 8)
    assert results[1]["recv"] == 42.0


def test_callforms_reject_what_no_overload_takes():
    with pytest.raises(TypeError, match="allreduce: opts must be AllreduceOptions, a ReduceOp"):
        callforms.allreduce([torch.zeros(1)], 3.0, None)
    with pytest.raises(TypeError, match="barrier: opts must be BarrierOptions, a timedelta"):
        callforms.barrier(dist.ReduceOp.SUM)
    with pytest.raises(TypeError, match="expected a tensor or a list of tensors"):
        callforms.allreduce("x", None, None)
    given = dist.AllreduceOptions()
    assert callforms.allreduce([torch.zeros(1)], given, None)[1] is given  # an options object is kept
    _, made = callforms.allreduce(torch.zeros(1), dist.ReduceOp.MAX, timedelta(seconds=7))
    assert made.reduceOp == dist.ReduceOp.MAX and made.timeout == timedelta(seconds=7)
    _, made = callforms.broadcast(torch.zeros(1), 3, None)
    assert made.rootRank == 3


# ---- what the switch would degrade stays exact ------------------------------------------------------
def _dtypes_rank(rank: int, world: int) -> dict:
    from hostlib.torch_ext import backend

    pg = dist.distributed_c10d._get_default_group()
    gloo = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(100 + rank)
    out: dict[str, object] = {"lossy": {}}
    # float64 with all 53 bits in use: the switch would return float32 precision
    x = torch.randn(4 * K, dtype=torch.float64, generator=gen) * 1e3
    mine = x.clone()
    before = pg.lossy_calls
    dist.all_reduce(mine)
    out["lossy"]["float64"] = pg.lossy_calls - before
    via_gloo = x.clone()
    dist.all_reduce(via_gloo, group=gloo)
    out["float64"] = (x.numpy().copy(), mine.numpy().copy(), via_gloo.numpy().copy())
    for dtype in (torch.float16, torch.bfloat16):
        h = _values(rank, 2 * K, dtype)
        before = pg.lossy_calls
        dist.all_reduce(h)
        out["lossy"][str(dtype)] = pg.lossy_calls - before
        out[str(dtype)] = h.float().numpy().copy()
    c = torch.full((2 * K,), complex(rank + 1, -rank), dtype=torch.complex64)
    before = pg.lossy_calls
    dist.all_reduce(c)
    out["lossy"]["complex64"] = pg.lossy_calls - before
    out["complex64"] = c.numpy().copy()
    # one chunk of K values mixing 1e3 and 1e-3: the shared exponent is 1e3's
    mixed = torch.tensor([1000.0, 0.001] * (K // 2)) * (rank + 1)
    dist.all_reduce(mixed)
    out["mixed"] = mixed.numpy().copy()

    # sparse gradients: stock DDP over a sparse embedding
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Embedding(2000, 16, sparse=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        idx = torch.randint(0, 2000, (64,), generator=torch.Generator().manual_seed(10 * step + rank))
        opt.zero_grad()
        model(idx).pow(2).sum().backward()
        opt.step()
    out["sparse_weights"] = model.module.weight.detach().numpy().copy()

    backend.monitored_barrier(timeout=timedelta(seconds=20))
    backend.monitored_barrier(pg, timeout=timedelta(seconds=20), wait_all_ranks=True)
    out["monitored"] = True
    return out


def _sparse_reference(world: int) -> np.ndarray:
    """Plain SGD on the mean over ranks of each rank's gradient (what DDP promises), no process group."""
    torch.manual_seed(0)
    model = torch.nn.Embedding(2000, 16)
    for step in range(3):
        grads = []
        for rank in range(world):
            idx = torch.randint(0, 2000, (64,), generator=torch.Generator().manual_seed(10 * step + rank))
            model.zero_grad()
            model(idx).pow(2).sum().backward()
            grads.append(model.weight.grad.clone())
        with torch.no_grad():
            model.weight -= 0.5 * sum(grads) / world
    return model.weight.detach().numpy()


def test_float64_sparse_complex_reliable_half_types_switched_monitored_barrier(tmp_path):
    results = spawn(_dtypes_rank, tmp_path)
    world = WORLD
    inputs = [out["float64"][0] for out in results]
    exact = inputs[0] + inputs[1]  # two addends: one IEEE rounding, the same for any summing order
    reference = _sparse_reference(world)
    for out in results:
        # dist.all_reduce hands a complex tensor over as its real view: complex64 is float32 pairs, summed
        # in the switch like any float32 tensor; complex128 would be float64, reliable
        assert out["lossy"] == {"float64": 0, "torch.float16": 1, "torch.bfloat16": 1, "complex64": 1}
        _, mine, via_gloo = out["float64"]
        np.testing.assert_array_equal(mine, exact)
        np.testing.assert_array_equal(mine, via_gloo)
        for dtype in ("torch.float16", "torch.bfloat16"):  # k/8 values: exact in both dtypes
            np.testing.assert_array_equal(out[dtype], 3 * np.arange(1, 2 * K + 1) / 8)
        np.testing.assert_array_equal(out["complex64"], np.full(2 * K, complex(3, -1)))
        # docs: a value is kept to within 2^(E+L-30) per contribution, E the exponent of the chunk's
        # largest |x| (1e3 and 2e3 -> E = 11), L = ceil(log2 N); SUM returns the mean times N
        bound = world * 2.0 ** (11 + 1 - 30)
        want = np.array([3000.0, 0.003] * (K // 2))
        np.testing.assert_array_equal(out["mixed"][0::2], want[0::2])
        assert np.max(np.abs(out["mixed"][1::2] - want[1::2])) <= bound
        np.testing.assert_allclose(out["sparse_weights"], reference, rtol=1e-6, atol=1e-6)
        assert out["monitored"]
