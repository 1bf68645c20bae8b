"""``python -m lta.bench.worker_cpu``: one short run reports each worker's CPU inside its reduces, and the
input refill the benchmark does before each reduce apart from it. No timing is asserted beyond the bounds
that hold by construction: the CPU counted is within the calls, the refill outside them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_short_run_reports_the_reduces_cpu_and_the_refill_apart() -> None:
    argv = ["--workers", "2", "--mib", "0.25", "--reduces", "4", "--warmup", "1", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "lta.bench.worker_cpu", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert (doc["k"], doc["workers"], doc["reduces"]) == (64, 2, 4)
    for key in ("cpu_ms_per_reduce", "user_ms", "sys_ms", "refresh_ms"):
        assert len(doc[key]) == 2 and all(v >= 0 for v in doc[key]), (key, doc[key])
    # Every reduce costs its worker some CPU, and refilling 256 KiB costs far less than a reduce of them
    # (16 x 4096 datagrams each way, a plan, a result).
    assert all(c > 0 for c in doc["cpu_ms_per_reduce"])
    assert all(r < c for r, c in zip(doc["refresh_ms"], doc["cpu_ms_per_reduce"], strict=True))
    assert doc["wall_p50_ms"] > 0


def test_the_refill_is_counted_apart_from_the_reduce() -> None:
    """A stand-in worker whose reduce does nothing, refilling 32 MiB before each: all the CPU is the
    refill's (memory copies of milliseconds), none of it the reduce's (a call that returns at once)."""
    import numpy as np

    from lta.bench.worker_cpu import _cpu_worker

    class Idle:
        def allreduce(self, y: np.ndarray, step: int, out: np.ndarray) -> None:
            pass

    out = _cpu_worker(Idle(), 0, 8 << 20, reduces=5, warmup=1, profile=False)  # type: ignore[arg-type]
    assert out["refresh_ms"] > 1.0  # 32 MiB: several ms on this machine
    assert out["cpu_ms"] < out["refresh_ms"] / 10  # (counted with the reduce, it would be more than it)
    assert len(out["walls_ms"]) == 5
