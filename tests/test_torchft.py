"""torchft with an lta replica group (hostlib/torch_ext/ft.py, examples/torchft_lta.py): two replica groups
train with torchft's Manager, DDP and optimizer wrappers, their gradients reduced through LTA.

torchft is the ft extra (make setup installs it with dev, beside the p4rt extra): these tests skip where it
is not installed."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip(
    "torchft.coordination", reason="torchft is not installed (optional; hostlib/torch_ext/ft.py)"
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchft_lta.py"
ENV = {"LTA_ELEMS_PER_PACKET": "256", "LTA_EXACT_MS": "2000", "OMP_NUM_THREADS": "1"}


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("torchft_lta", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replica(replica: int, lighthouse: str, env: dict[str, str], queue: Any) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        queue.put((replica, _example().train_replica(replica, lighthouse)))
    except BaseException as exc:
        queue.put((replica, {"error": f"{type(exc).__name__}: {exc}"}))


def _run(env: dict[str, str]) -> dict[int, dict[str, Any]]:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(r, lighthouse.address(), env, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    errors = [f"replica {r}: {v['error']}" for r, v in results.items() if "error" in v]
    assert not errors, errors
    return results


def _reference(example: Any, lr: float = 0.1) -> np.ndarray:
    """Plain SGD on the mean of the two replicas' gradients (what data parallelism means), no torchft."""
    model = example.make_model()
    for step in range(example.STEPS):
        grads = []
        for replica in range(2):
            model.zero_grad()
            x, y = example.batch(replica, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= lr * (grads[0][i] + grads[1][i]) / 2
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()


def test_torchft_over_lta_is_mean_gradient_sgd() -> None:
    example = _example()
    out = _run(ENV)
    expected = _reference(example)
    for r in (0, 1):
        assert out[r]["steps"] == example.STEPS
        assert out[r]["lossy_calls"] >= example.STEPS  # every step's bucket went through the switch
        np.testing.assert_allclose(out[r]["params"], expected, rtol=0, atol=2e-5)  # codec rounding only


def test_torchft_over_lta_trains_under_loss() -> None:
    example = _example()
    out = _run({**ENV, "LTA_DROP_UP": "0.3", "LTA_SEED": "3"})
    for r in (0, 1):
        assert out[r]["steps"] == example.STEPS
        assert out[r]["chunks_partial"] > 0  # some gradients were renormalized from one replica
        assert np.all(np.isfinite(out[r]["params"]))
    # RESULTs are multicast (no downlink loss here): both replicas apply the same renormalized gradients
    np.testing.assert_array_equal(out[0]["params"], out[1]["params"])
    assert not np.allclose(out[0]["params"], _reference(example), atol=2e-5)  # the loss did change them
