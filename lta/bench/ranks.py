"""Torch ranks as spawned processes on loopback, the way ``lta bench allreduce``, ``ddp`` and ``fsdp``
start them: one free TCP port for the store, one queue every rank puts ``(rank, result)`` on, every
process stopped when the run ends (:func:`lta.launch.running`)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from hostlib.errors import LtaError
from hostlib.lifetime import spawn_context
from lta.launch import running


def free_tcp_port() -> int:
    """A TCP port on loopback that nothing listens on now (for torch.distributed's TCP store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    world: int,
    target: Callable[..., None],
    args_of: Callable[[int, int, Any], tuple[Any, ...]],
    timeout_s: float,
    join_s: float = 10.0,
    daemon: bool | None = True,
) -> dict[int, Any]:
    """``world`` processes, rank r running ``target(*args_of(r, port, queue))``; each puts
    ``(rank, result)`` on ``queue`` once. Returns the results by rank; ``queue.Empty`` where one has not
    come within ``timeout_s``."""
    ctx = spawn_context()
    queue, port = ctx.Queue(), free_tcp_port()
    procs = [ctx.Process(target=target, args=args_of(r, port, queue), daemon=daemon) for r in range(world)]
    with running(procs, join_s=join_s):
        return dict(queue.get(timeout=timeout_s) for _ in range(world))


def raise_rank_errors(label: str, results: dict[int, dict[str, Any]]) -> None:
    """One line naming every rank that reported ``{"error": ...}``: LtaError where all of them were
    user errors (``user_error``: e.g. a health check), RuntimeError otherwise."""
    errors = [f"rank {r}: {v['error']}" for r, v in sorted(results.items()) if "error" in v]
    if errors:
        user = all(v.get("user_error") for v in results.values() if "error" in v)
        raise (LtaError if user else RuntimeError)(f"{label}: " + "; ".join(errors))
