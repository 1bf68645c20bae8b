"""NaN and Inf in one worker's gradient: every worker gets NaN in those chunks, never a silent finite value.

The expectation is gloo's: a non-finite contribution makes the reduced element non-finite on every rank, so
a GradScaler that found an overflow on one rank skips the step on all of them. LTA's unit is the chunk
(docs/protocol.md, "Non-finite values"): the whole chunk comes back NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hostlib import codec
from hostlib.transport import Fallback

K = 16


def _inputs(n_workers: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 1 + w, n).astype(np.float32) for w in range(n_workers)]


def _bound_from_inputs(inputs: list[np.ndarray], chunk: int) -> float:
    """The codec's error bound for ``chunk``, from the values themselves: shift = 30 - L - E with E the
    largest frexp exponent of the chunk's max |x| over the workers (docs/protocol.md, "Numbers")."""
    lo, hi = chunk * K, (chunk + 1) * K
    top = max(float(np.abs(x[lo:hi]).max()) for x in inputs)
    exponent = math.frexp(top)[1]
    shift = 30 - math.ceil(math.log2(len(inputs))) - exponent
    return 2.0**-shift


def test_proposals_mark_nonfinite_chunks_only_when_asked():
    chunks = np.ones((4, K), dtype=np.float32)
    chunks[1, 3] = np.inf
    chunks[2, 0] = -np.inf
    chunks[3, 5] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.exponent_proposals(chunks)
    marked = codec.exponent_proposals(chunks, mark_nonfinite=True)
    assert marked[0] == 1  # max |x| = 1 < 2^1
    assert list(marked[1:]) == [codec.NONFINITE_EXPONENT] * 3
    # Above every float32 exponent, so the switch's max keeps it; and the data round's shift is the
    # lowest, so a finite peer's values quantize to (almost) nothing and cannot wrap.
    assert codec.NONFINITE_EXPONENT > math.frexp(np.finfo(np.float32).max)[1]
    assert codec.data_shifts(np.array([codec.NONFINITE_EXPONENT]), 64)[0] == -codec.SHIFT_LIMIT
    assert list(codec.nonfinite_agreed(marked)) == [False, True, True, True]


def test_nonfinite_chunks_come_back_nan_on_every_worker(make_cluster):
    n_workers, n = 3, 10 * K + 5  # the last chunk is short
    cluster = make_cluster(n_workers, elems_per_packet=K)
    inputs = _inputs(n_workers, n, seed=1)
    poisoned = {2: np.inf, 5: np.nan, 10: -np.inf}  # chunk -> the value worker 1 holds there
    for chunk, value in poisoned.items():
        inputs[1][chunk * K + 1] = value
    results = cluster.reduce_all(inputs)
    expected_nan = np.zeros(11, dtype=bool)
    expected_nan[list(poisoned)] = True
    clean = [x.copy() for x in inputs]
    for x in clean:
        for chunk in poisoned:
            x[chunk * K : (chunk + 1) * K] = 0.0
    mean = np.mean(np.stack(clean).astype(np.float64), axis=0)
    for w, r in enumerate(results):
        assert list(r.nonfinite) == list(expected_nan), f"worker {w}"
        for chunk in range(11):
            lo, hi = chunk * K, min((chunk + 1) * K, n)
            if expected_nan[chunk]:
                assert np.isnan(r.values[lo:hi]).all(), (w, chunk)
            else:
                assert r.count[chunk] == n_workers and r.fallback[chunk] == Fallback.NONE
                err = np.abs(r.values[lo:hi] - mean[lo:hi])
                assert np.all(err <= _bound_from_inputs(clean, chunk) + np.abs(mean[lo:hi]) * 2**-23), (
                    w,
                    chunk,
                )
        assert cluster.workers[w].stats.nonfinite_chunks == 3
    # The next reduce, all finite, is exact again on every worker: nothing of the NaN stayed behind.
    again = cluster.reduce_all(clean)
    for r in again:
        assert not r.nonfinite.any() and np.isfinite(r.values).all()
        assert np.all(r.count == n_workers)


@pytest.mark.parametrize("seed", [0, 1])
def test_under_loss_no_worker_takes_a_finite_value_that_counted_the_nonfinite_one(make_cluster, seed):
    """Under loss a worker may miss the exponent RESULT (and fall back), or the poisoned worker's proposal
    may be lost (it then withholds the chunk: the others' mean is a correct estimate without it). What
    must never happen: a finite value on a worker whose RESULT counted the worker that held the Inf."""
    n_workers, n = 3, 24 * K
    cluster = make_cluster(n_workers, up=0.15, down=0.15, seed=seed, elems_per_packet=K)
    poisoned = np.arange(0, 24, 3)
    seen_nan = seen_without = 0
    for step in range(3):
        inputs = _inputs(n_workers, n, seed=10 * seed + step)
        for chunk in poisoned:
            inputs[2][chunk * K] = np.inf
        results = cluster.reduce_all(inputs, step=step)
        for w, r in enumerate(results):
            for chunk in range(24):
                vals = r.values[chunk * K : (chunk + 1) * K]
                if chunk not in poisoned:
                    assert np.isfinite(vals).all(), (step, w, chunk)
                    continue
                if r.nonfinite[chunk]:
                    assert np.isnan(vals).all(), (step, w, chunk)
                    seen_nan += 1
                    continue
                # Finite: either nothing came back (a fallback), or worker 2 is not among the counted.
                assert np.isfinite(vals).all()
                assert r.fallback[chunk] != Fallback.NONE or 2 not in r.contributors(chunk), (step, w, chunk)
                seen_without += r.fallback[chunk] == Fallback.NONE
    assert seen_nan > 0, "no poisoned chunk came back NaN"
    assert seen_nan + seen_without > 0
