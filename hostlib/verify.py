"""Self-checking reduces: seeded inputs every worker can rebuild, and the check of a result against them.

Each worker's input is a function of ``(seed, round, worker)``, so any worker can rebuild all inputs
and check its own result: a chunk that came back with count > 0 must equal the mean of the
contributors named in its bitmap, within the codec's bound ``2^-shift`` (docs/protocol.md) plus half
an ulp of the float32 result. Used by ``lta demo``, the Mininet demo and the lossy benchmark.
"""

from __future__ import annotations

import numpy as np

from hostlib.transport import ReduceResult


def seeded_input(seed: int, round_: int, worker: int, elems: int) -> np.ndarray:
    return np.random.default_rng([seed, round_, worker]).standard_normal(elems).astype(np.float32)


def check_result(result: ReduceResult, inputs: np.ndarray, elems_per_packet: int) -> tuple[int, float]:
    """(chunks checked, worst |error| / tolerance) over the chunks renormalized from a RESULT.
    ``inputs`` is (workers, values). A worst ratio below 1 passes."""
    checked, worst = 0, 0.0
    for c in np.flatnonzero(result.count > 0):
        contributors = result.contributors(int(c))
        lo, hi = c * elems_per_packet, min((c + 1) * elems_per_packet, inputs.shape[1])
        expected = inputs[contributors, lo:hi].astype(np.float64).mean(axis=0)
        error = np.abs(result.values[lo:hi] - expected)
        tolerance = 2.0 ** -float(result.shift[c]) + np.spacing(np.abs(expected).astype(np.float32)) / 2
        worst = max(worst, float((error / tolerance).max()))
        checked += 1
    return checked, worst
