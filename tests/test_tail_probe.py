"""The tail probe (``TransportConfig.tail_probe``): in the tail of a reduce, a unit that waits the lag
deadline for a possibly late peer sends its GRAD again one RTO after its send. A lost GRAD is then added
and a lost RESULT answered with the stored copy (``grad_late_resend``) about an RTO after the send,
instead of the FLUSH at the lag deadline, which closes the round without the lost contribution. Each
test drops one packet of the last data unit by hand and checks the RESULTs against numpy over both
workers; the same drop with the probe turned off shows what the probe changed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from hostlib.protocol import HEADER_DTYPE, Flag, Op
from hostlib.transport import LtaWorker, ReduceResult
from tests.conftest import Cluster, check_mean_over_bitmap

K = 16
CHUNKS = 6  # one exponent unit, then data units 1..6: the last data unit is chunk 5
# The lag deadline is long against the RTO (20-300 ms), so a FLUSH on it is easy to tell apart. No tail
# copies (the last two data units sent twice) unless a test says so: one would bring the dropped GRAD in.
TIMING = dict(
    lag_deadline_ms=1500, sync_deadline_ms=1500, min_deadline_ms=20, max_deadline_ms=300, tail_units=0
)


def _headers(rows: np.ndarray) -> np.ndarray:
    return np.ndarray((len(rows),), dtype=HEADER_DTYPE, buffer=rows, strides=(rows.strides[0],))


def _last_data_unit(hdr: np.ndarray, op: Op, chunk: int = CHUNKS - 1) -> np.ndarray:
    return (hdr["op"] == op) & (hdr["chunk"] == chunk) & ((hdr["flags"] & Flag.MAX) == 0)


def _drop_first_grad_of_last_unit(worker: LtaWorker, chunk: int = CHUNKS - 1) -> list[int]:
    """Worker ``worker`` loses its first GRAD of the last data chunk (or of ``chunk``) on the way up."""
    dropped: list[int] = []
    send: Callable[..., int] = worker.io.send_rows

    def lossy_send(rows: np.ndarray, slots: np.ndarray | None = None) -> int:  # (slots: read from the rows)
        hit = np.flatnonzero(_last_data_unit(_headers(rows), Op.GRAD, chunk))
        if hit.size and not dropped:
            dropped.append(int(hit[0]))
            keep = np.ones(len(rows), dtype=bool)
            keep[hit[0]] = False
            return send(np.ascontiguousarray(rows[keep])) + 1
        return send(rows)

    worker.io.send_rows = lossy_send  # type: ignore[method-assign]
    return dropped


def _drop_first_result_of_last_unit(worker: LtaWorker) -> list[int]:
    """Worker ``worker`` loses the first RESULT of the last data chunk on the way down (it arrives with a
    job id no worker has, so the worker ignores it)."""
    dropped: list[int] = []
    handle = worker._handle

    def lossy_handle(n: int, plan) -> None:  # noqa: ANN001
        data = worker.io.rx.data
        hdr = np.ndarray((n,), dtype=HEADER_DTYPE, buffer=data, strides=(data.strides[0],))
        hit = np.flatnonzero(_last_data_unit(hdr, Op.RESULT))
        if hit.size and not dropped:
            dropped.append(int(hit[0]))
            hdr["job_id"][hit[0]] = worker.job_id + 1
        handle(n, plan)

    worker._handle = lossy_handle  # type: ignore[method-assign]
    return dropped


def _reduce_with_one_drop(
    cluster: Cluster,
    drop: Callable[[LtaWorker], list[int]],
    seed: int,
    partial: int,
    owners: np.ndarray | None = None,
) -> list[ReduceResult]:
    """Two workers reduce seeded inputs once, worker 1 losing the packet ``drop`` picks; every chunk of
    both results is numpy's mean over its bitmap, ``partial`` of them with one worker counted and the
    others with both (with ``owners``, every chunk a worker waits for: its own and the last)."""
    dropped = drop(cluster.workers[1])
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(CHUNKS * K).astype(np.float32) for _ in range(2)]
    results = cluster.reduce_all(inputs, step=0, owners=owners)
    assert dropped, "the packet to drop never went by"
    if owners is not None:  # the others' chunks are unspecified: not checked
        waited = [(owners == w) | (np.arange(CHUNKS) == CHUNKS - 1) for w in range(2)]
        total = sum(int(m.sum()) for m in waited)
        checked = check_mean_over_bitmap(
            results, inputs, K, full=total - partial, partial=partial, fallback=0, only=waited
        )
        assert checked == total
        return results
    checked = check_mean_over_bitmap(
        results, inputs, K, full=2 * CHUNKS - partial, partial=partial, fallback=0
    )
    assert checked == 2 * CHUNKS
    return results


@pytest.mark.parametrize("probe", [True, False])
def test_a_lost_grad_of_the_last_unit_is_added_by_the_probe_not_flushed_out(make_cluster, probe):
    cluster = make_cluster(2, seed=3, elems_per_packet=K, tail_probe=probe, **TIMING)
    results = _reduce_with_one_drop(
        cluster, _drop_first_grad_of_last_unit, seed=11, partial=0 if probe else 2
    )
    last = [int(r.count[CHUNKS - 1]) for r in results]
    stats = [w.stats for w in cluster.workers]
    if probe:
        assert last == [2, 2]  # worker 1's probe brought its values in
        assert [s.flushes_sent for s in stats] == [0, 0]
        assert stats[1].tail_probes >= 1
    else:  # the lag deadline's FLUSH closed the round with worker 0 alone
        assert last == [1, 1]
        assert sum(s.flushes_sent for s in stats) >= 1 and sum(s.tail_probes for s in stats) == 0
    assert all(int(r.count[c]) == 2 for r in results for c in range(CHUNKS - 1))


@pytest.mark.parametrize("probe", [True, False])
def test_a_lost_result_of_the_last_unit_comes_back_for_the_probe(make_cluster, probe):
    cluster = make_cluster(2, seed=4, elems_per_packet=K, tail_probe=probe, **TIMING)
    results = _reduce_with_one_drop(cluster, _drop_first_result_of_last_unit, seed=12, partial=0)
    assert [int(r.count[CHUNKS - 1]) for r in results] == [2, 2]  # the stored round: both counted
    assert np.array_equal(results[0].values, results[1].values)
    w1 = cluster.workers[1].stats
    assert w1.results_retx >= 1  # the switch's stored copy, resent by unicast
    if probe:
        assert w1.tail_probes >= 1 and w1.flushes_sent == 0  # answered before the lag deadline
    else:
        assert w1.tail_probes == 0 and w1.flushes_sent >= 1  # recovered by a FLUSH, at the deadline


def test_an_owners_last_unit_is_flushed_at_once_when_a_peers_grad_of_it_is_lost(make_cluster):
    """Owner-only chunks (a reduce-scatter, interleaved: chunks 0, 2, 4 are worker 0's), worker 1's GRAD
    of chunk 4, worker 0's last own chunk, lost. Worker 0 hears no RESULT of a later chunk it owns; the
    last chunk is every worker's, so its RESULT shows worker 1 past chunk 4, and worker 0 flushes chunk 4
    at once (a FLUSH, none on the lag timer) with itself alone in it. Before the last chunk was every
    worker's, worker 0 waited the lag deadline for worker 1 (1.5 s here: a timer FLUSH)."""
    cluster = make_cluster(2, seed=5, elems_per_packet=K, **TIMING)
    owners = np.arange(CHUNKS) % 2
    results = _reduce_with_one_drop(
        cluster, lambda w: _drop_first_grad_of_last_unit(w, CHUNKS - 2), seed=13, partial=1, owners=owners
    )
    w0 = cluster.workers[0].stats
    assert int(results[0].count[CHUNKS - 2]) == 1 and int(results[0].bitmap[CHUNKS - 2]) == 0b01
    assert w0.flushes_sent >= 1 and w0.flushes_on_timer == 0
    assert [int(r.count[CHUNKS - 1]) for r in results] == [2, 2]  # the last chunk reached both


@pytest.mark.parametrize("exact", [False, True])
def test_the_last_two_units_go_twice_so_one_lost_grad_of_them_costs_nothing(make_cluster, exact):
    """Tail copies (``tail_units`` = 2, the default): worker 1's first GRAD of the last data unit lost, its
    second copy (sent right after) brings it in: both workers count 2 everywhere, with no tail probe and
    no FLUSH. Worker 0 sent each of its last two data units twice and the others once. In exact mode no
    data unit goes twice (a copy would draw the drop policy again): the lost GRAD stays out."""
    timing = {**TIMING, "tail_units": 2}
    cluster = make_cluster(2, seed=6, elems_per_packet=K, exact=exact, **timing)
    dropped = _drop_first_grad_of_last_unit(cluster.workers[1])
    sent: list[int] = []  # the data chunks of worker 0's GRADs, every copy
    send = cluster.workers[0].io.send_rows

    def counting_send(rows: np.ndarray, slots: np.ndarray | None = None) -> int:
        hdr = _headers(rows)
        data = (hdr["op"] == Op.GRAD) & ((hdr["flags"] & Flag.MAX) == 0)
        sent.extend(hdr["chunk"][data].tolist())
        return send(rows)

    cluster.workers[0].io.send_rows = counting_send  # type: ignore[method-assign]
    rng = np.random.default_rng(14)
    inputs = [rng.standard_normal(CHUNKS * K).astype(np.float32) for _ in range(2)]
    results = cluster.reduce_all(inputs, step=0)
    assert dropped
    copies = [sent.count(c) for c in range(CHUNKS)]
    if exact:  # (the fence, a critical zero chunk after the data, is not a data chunk of the input)
        assert copies[:CHUNKS] == [1] * CHUNKS
        assert int(results[0].count[CHUNKS - 1]) == 1  # closed at the fence's FLUSH without worker 1
        checked = check_mean_over_bitmap(results, inputs, K, full=2 * CHUNKS - 2, partial=2, fallback=0)
        assert checked == 2 * CHUNKS
        return
    assert copies == [1] * (CHUNKS - 2) + [2, 2]
    assert check_mean_over_bitmap(results, inputs, K, full=2 * CHUNKS, partial=0, fallback=0) == 2 * CHUNKS
    assert all(int(r.count[c]) == 2 for r in results for c in range(CHUNKS))
    stats = [w.stats for w in cluster.workers]
    assert [s.flushes_sent for s in stats] == [0, 0] and [s.tail_probes for s in stats] == [0, 0]
