"""A GradScaler overflow on one rank skips the step on every rank over "lta", as over gloo.

Stock DDP on ``init_process_group("lta")``, fp16 autocast on CPU, ``torch.amp.GradScaler``. At one step
rank 0's input is scaled so far that its fp16 forward overflows: its gradients hold Inf/NaN, its peer's
do not. gloo hands the non-finite values to every rank; LTA returns the chunks they fall in as NaN on every
rank (docs/protocol.md, "Non-finite values"). Either way each rank's scaler finds an Inf, skips
``optimizer.step`` and halves its scale, and the replicas stay equal. Before, the overflowing rank raised
and its peer trained on a silent zero gradient.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.ranks import start_and_collect

WORLD = 2
OVERFLOW_STEP = 2
STEPS = 5


def _rank(rank: int, world: int, store_path: str, backend: str) -> dict:
    torch.set_num_threads(1)
    if backend == "lta":
        import hostlib.torch_ext.backend  # noqa: F401  (registers "lta")
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.Tanh(), torch.nn.Linear(100, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    gen = torch.Generator().manual_seed(rank)
    out: dict = {"scale": [], "changed": [], "nonfinite_grad": [], "params": []}
    for step in range(STEPS):
        x = torch.randn(16, 200, generator=gen)
        if step == OVERFLOW_STEP and rank == 0:
            x = x * 6e4  # fp16 max is 65504: the first Linear overflows on this rank only
        before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        out["nonfinite_grad"].append(
            any(not bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        )
        scaler.step(opt)
        scaler.update()
        after = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        out["scale"].append(float(scaler.get_scale()))
        out["changed"].append(bool((after != before).any()))
    out["params"] = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
    dist.destroy_process_group()
    return out


def _guarded(rank, world, store_path, results, backend) -> None:
    try:
        results.put((rank, True, _rank(rank, world, store_path, backend)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


@pytest.mark.parametrize("backend", ["gloo", "lta"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path, backend):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_guarded, args=(r, WORLD, store, results, backend)) for r in range(WORLD)]
    outs = start_and_collect(procs, results, WORLD, 120)
    for rank, out in enumerate(outs):
        # Every rank sees the non-finite gradient after the reduce, at the overflow step only.
        assert out["nonfinite_grad"] == [s == OVERFLOW_STEP for s in range(STEPS)], (backend, rank)
        # ... so every rank skips that step (parameters unchanged) and halves its scale; others train.
        assert out["changed"] == [s != OVERFLOW_STEP for s in range(STEPS)], (backend, rank)
        assert out["scale"][OVERFLOW_STEP] == out["scale"][OVERFLOW_STEP - 1] / 2, (backend, rank)
    np.testing.assert_array_equal(outs[0]["scale"], outs[1]["scale"])
    np.testing.assert_allclose(outs[0]["params"], outs[1]["params"], atol=1e-6)
