"""``LtaWorker.allreduce(x, out=buf)``: the result is written into the caller's buffer (even ``x``'s own
memory), equals what a call without ``out`` returns, and the ``prev`` fallback keeps its own copy; with or
without ``out``, a returned result is the caller's (no later reduce changes it, and changing it changes
no later reduce)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.transport import Fallback, ReduceResult
from tests.conftest import run_workers

K = 64
LENGTH = 9 * K + 13


def _inputs(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(LENGTH).astype(np.float32) for _ in range(n)]


def test_out_buffer_holds_what_a_fresh_result_holds(make_cluster):
    """Two clusters with the same seed and the same exact loss pattern reduce the same inputs, one into
    fresh arrays, one into reused caller buffers and one in place (out is x): bit-identical results."""
    n, steps = 3, 4
    runs = []
    for mode in ("fresh", "buffer", "in_place"):
        cluster = make_cluster(n, up=0.2, elems_per_packet=K, seed=3, exact=True, job_id=7)
        buffers = [np.full(LENGTH, np.nan, dtype=np.float32) for _ in range(n)]
        got = []
        for step in range(steps):
            inputs = _inputs(n, step)

            def body(w, i, inputs=inputs, step=step, mode=mode, buffers=buffers):
                if mode == "fresh":
                    return w.allreduce(inputs[i], step=step).values
                target = buffers[i] if mode == "buffer" else inputs[i]
                r = w.allreduce(inputs[i], step=step, out=target)
                assert r.values is target  # the caller's own array, no copy
                return target.copy()

            got.append(run_workers(cluster.workers, body))
        runs.append(got)
    fresh, buffered, in_place = runs
    for step in range(steps):
        for w in range(n):
            np.testing.assert_array_equal(buffered[step][w], fresh[step][w])
            np.testing.assert_array_equal(in_place[step][w], fresh[step][w])


def test_prev_fallback_keeps_its_own_copy_of_an_out_buffer(make_cluster):
    """After a reduce into a caller's buffer, the caller overwrites the buffer; a reduce that loses every
    GRAD falls back to the previous result, which must be the reduced values, not what the caller wrote."""
    n = 2
    cluster = make_cluster(n, elems_per_packet=K, seed=1, exact=True, fallback="prev")
    inputs = _inputs(n, 0)
    buffers = [np.empty(LENGTH, dtype=np.float32) for _ in range(n)]
    first = run_workers(cluster.workers, lambda w, i: w.allreduce(inputs[i], step=0, out=buffers[i]))
    reduced = [r.values.copy() for r in first]
    expected = np.mean(np.stack(inputs).astype(np.float64), axis=0)
    for values in reduced:
        assert np.max(np.abs(values - expected)) < 1e-3
    for b in buffers:
        b[:] = 1234.5  # the caller reuses its buffer (DDP writes the next step's gradients into it)
    cluster.switch.set_drop_policy(cluster.job_id, "up", DropPolicy(p=1.0))
    second = run_workers(cluster.workers, lambda w, i: w.allreduce(inputs[i], step=1, out=buffers[i]))
    for r, values in zip(second, reduced, strict=True):
        assert np.all(r.fallback == Fallback.PREV)
        np.testing.assert_array_equal(r.values, values)


def test_prev_fallback_is_not_the_array_handed_to_the_caller(make_cluster):
    """Without ``out`` a reduce returns a new array; the caller may scale or clip it in place (as a
    training loop does with its gradients). A later reduce that loses every GRAD falls back to the
    previous result: the numpy mean of the first inputs, not what the caller made of it. Before the fix
    the returned array was the fallback itself, and the fallback came back times 100."""
    n = 2
    cluster = make_cluster(n, elems_per_packet=K, seed=1, exact=True, fallback="prev")
    inputs = _inputs(n, 0)
    first = run_workers(cluster.workers, lambda w, i: w.allreduce(inputs[i], step=0))
    expected = np.mean(np.stack(inputs).astype(np.float64), axis=0)
    reduced = [r.values.copy() for r in first]
    for r in first:
        assert np.max(np.abs(r.values - expected)) < 1e-3
        r.values *= 100.0  # the caller's own use of its result
    cluster.switch.set_drop_policy(cluster.job_id, "up", DropPolicy(p=1.0))
    second = run_workers(cluster.workers, lambda w, i: w.allreduce(inputs[i], step=1))
    third = run_workers(cluster.workers, lambda w, i: w.allreduce(inputs[i], step=2))
    for r2, r3, values in zip(second, third, reduced, strict=True):
        assert np.all(r2.fallback == Fallback.PREV) and np.all(r3.fallback == Fallback.PREV)
        np.testing.assert_array_equal(r2.values, values)
        r2.values[:] = -1.0  # the fallback handed out is the caller's too
        np.testing.assert_array_equal(r3.values, values)


@pytest.mark.parametrize("into", ["fresh", "buffer"])
def test_a_result_stays_what_it_was_after_later_reduces(make_cluster, into: str):
    """Every array of a returned ReduceResult is the caller's: later reduces of the same length (the same
    plan, its buffers reused) with other inputs, loss and fallbacks change none of them. Independent
    expectation: a deep copy taken when each result came back (``buffer``: a buffer of the caller's per
    reduce, which it does not touch again)."""
    n, steps = 2, 4
    cluster = make_cluster(n, up=0.3, down=0.1, elems_per_packet=K, seed=4, exact=True, fallback="prev")
    buffers = [[np.empty(LENGTH, dtype=np.float32) for _ in range(steps)] for _ in range(n)]
    kept: list[list] = [[] for _ in range(n)]
    for step in range(steps):
        inputs = _inputs(n, 10 + step)

        def body(w, i, inputs=inputs, step=step):
            out = buffers[i][step] if into == "buffer" else None
            return w.allreduce(inputs[i], step=step, out=out)

        for i, r in enumerate(run_workers(cluster.workers, body)):
            kept[i].append((r, copy.deepcopy(r)))
    fields = [f.name for f in dataclasses.fields(ReduceResult) if f.name != "elapsed_s"]
    for i in range(n):
        for r, then in kept[i]:
            for name in fields:
                np.testing.assert_array_equal(getattr(r, name), getattr(then, name), err_msg=name)
    assert any((then.fallback != Fallback.NONE).any() for _, then in kept[0] + kept[1])  # loss happened


def test_prev_fallback_of_keys_sharing_a_length_stays_per_key(make_cluster):
    """Two tensors of one length (two keys, one plan) reduced in turn into caller buffers, three rounds;
    then every GRAD is lost: each key falls back to its own last result (the numpy mean of its own last
    inputs), not the other key's, and not what the caller wrote into its buffers since. The engine hands
    its output rows over to the prev fallback instead of copying them, so this checks the hand-over."""
    n = 2
    cluster = make_cluster(n, elems_per_packet=K, seed=2, exact=True, fallback="prev")
    buffers = [[np.empty(LENGTH, dtype=np.float32) for _ in range(n)] for _ in range(2)]
    last: dict[str, list[np.ndarray]] = {}
    for step in range(3):
        for j, key in enumerate(("a", "b")):
            inputs = _inputs(n, 10 * step + j)

            def body(w, i, inputs=inputs, key=key, j=j, step=step):
                return w.allreduce(inputs[i], step=step, key=key, out=buffers[j][i]).values.copy()

            last[key] = run_workers(cluster.workers, body)
            expected = np.mean(np.stack(inputs).astype(np.float64), axis=0)
            for values in last[key]:
                assert np.max(np.abs(values - expected)) < 1e-3
            for b in buffers[j]:
                b[:] = -99.0  # the caller reuses its buffers
    cluster.switch.set_drop_policy(cluster.job_id, "up", DropPolicy(p=1.0))
    for j, key in enumerate(("b", "a")):
        lost = run_workers(
            cluster.workers,
            lambda w, i, key=key, j=j: w.allreduce(_inputs(n, 99)[i], step=3, key=key, out=buffers[j][i]),
        )
        for r, values in zip(lost, last[key], strict=True):
            assert np.all(r.fallback == Fallback.PREV)
            np.testing.assert_array_equal(r.values, values)


@pytest.mark.parametrize(
    "bad",
    [
        np.empty(LENGTH - 1, dtype=np.float32),  # wrong size
        np.empty(LENGTH, dtype=np.float64),  # wrong dtype
        np.empty(2 * LENGTH, dtype=np.float32)[::2],  # not contiguous
    ],
)
def test_a_bad_out_buffer_is_refused_before_anything_is_sent(make_cluster, bad):
    cluster = make_cluster(1, elems_per_packet=K)
    w = cluster.workers[0]
    with pytest.raises(ValueError, match="out must be"):
        w.allreduce(np.ones(LENGTH, dtype=np.float32), out=bad)
    assert w.stats.packets_sent == 0


@pytest.mark.parametrize("into", ["fresh", "buffer"])
def test_scaled_result_is_the_float32_product_and_prev_keeps_the_mean(make_cluster, into: str) -> None:
    """``scale=3``: every value is numpy's float32 product of the unscaled result (from a cluster with the
    same seed and loss pattern) and 3; when every GRAD is then lost, the ``prev`` fallback is the previous
    mean times 3, not times 9 (the fallback keeps the mean, the scale is applied on the way out)."""
    n, scale = 3, 3.0
    plain = make_cluster(n, up=0.2, elems_per_packet=K, seed=4, exact=True, job_id=7)
    scaled = make_cluster(n, up=0.2, elems_per_packet=K, seed=4, exact=True, job_id=7)
    buffers = [np.empty(LENGTH, dtype=np.float32) for _ in range(n)]
    inputs = _inputs(n, 5)
    first = run_workers(plain.workers, lambda w, i: w.allreduce(inputs[i], step=0))
    assert any(np.any((r.count > 0) & (r.count < n)) for r in first)  # renormalized chunks are scaled too
    means = [r.values.copy() for r in first]

    def scaled_body(w, i, step=0):
        out = buffers[i] if into == "buffer" else None
        return w.allreduce(inputs[i], step=step, out=out, scale=scale).values.copy()

    got = run_workers(scaled.workers, scaled_body)
    for mean, values in zip(means, got, strict=True):
        np.testing.assert_array_equal(values, mean * np.float32(scale))
    scaled.switch.set_drop_policy(scaled.job_id, "up", DropPolicy(p=1.0))
    lost = run_workers(
        scaled.workers, lambda w, i: w.allreduce(inputs[i], step=1, out=buffers[i], scale=scale)
    )
    for r, mean in zip(lost, means, strict=True):
        assert np.all(r.fallback == Fallback.PREV)
        np.testing.assert_array_equal(r.values, mean * np.float32(scale))


def test_local_fallback_is_the_workers_own_input(make_cluster) -> None:
    """``fallback="local"`` with every GRAD lost: each worker gets its own input back, bit for bit, in the
    whole chunks (quantized where the caller holds them, never staged) and in the partial last one."""
    n = 2
    cluster = make_cluster(n, elems_per_packet=K, seed=6, exact=True, fallback="local")
    cluster.switch.set_drop_policy(cluster.job_id, "up", DropPolicy(p=1.0))
    inputs = _inputs(n, 7)
    buffers = [np.full(LENGTH, np.nan, dtype=np.float32) for _ in range(n)]
    got = run_workers(cluster.workers, lambda w, i: w.allreduce(inputs[i], step=0, out=buffers[i]))
    for r, x in zip(got, inputs, strict=True):
        assert np.all(r.fallback == Fallback.LOCAL)
        np.testing.assert_array_equal(r.values, x)
