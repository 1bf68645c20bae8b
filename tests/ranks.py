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
