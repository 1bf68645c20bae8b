"""Multi-process test harness shared by the torch tests: start the ranks, collect one result each."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import Any


def start_and_collect(procs: Sequence[Any], results: Any, world: int, timeout_s: float) -> list:
    """Start ``procs`` and return the value each rank puts on ``results`` as ``(rank, ok, value)``, in rank
    order; a rank that failed (``ok`` false) or silence for ``timeout_s`` fails the test. The processes
    are joined, and terminated if still alive, whatever happens."""
    for proc in procs:
        proc.start()
    out: dict[int, object] = {}
    try:
        while len(out) < world:
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    except queue.Empty:
        raise AssertionError(
            f"ranks {sorted(set(range(world)) - set(out))} sent nothing within {timeout_s:g} s"
        ) from None
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.terminate()
    return [out[r] for r in range(world)]


def train_regression(model: Any, rank: int, steps: int) -> list[float]:
    """``steps`` SGD steps of ``model`` (20 inputs, 4 outputs) towards a random linear target, on the
    rank's own seeded batches; the per-step losses. The target's weights come from torch's global
    generator, as the model's did."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.nn.Linear(20, 4)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 20, generator=gen)
        with torch.no_grad():
            y = target(x)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def join_in_threads(world: int, options: Any) -> list:
    """Every rank of ``world`` joins a self-hosted LTA job (rendezvous.join_job) from its own thread on one
    HashStore; returns the sessions, or closes those that joined and raises the first error."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from hostlib.torch_ext.rendezvous import join_job

    store, sessions, errors = dist.HashStore(), [None] * world, []

    def join(rank: int) -> None:
        try:
            sessions[rank] = join_job(store, rank, world, options, timedelta(seconds=20))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errors:
        for s in sessions:
            if s is not None:
                s.close()
        raise errors[0]
    return sessions
