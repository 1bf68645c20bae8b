"""The reduce engine's trace hook (hostlib/transport/trace.py): a tracer sees every step of a reduce
without patching the engine, and `lta bench lossy_tail`'s tracer builds its per-reduce record from it."""

from __future__ import annotations

import numpy as np

from hostlib.transport.trace import EngineTrace
from tests.conftest import check_mean_over_bitmap

K, CHUNKS = 16, 40


class Recorder(EngineTrace):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.settled: set[int] = set()
        self.flushed = 0
        self.recv_ok = True
        self.exp_units = 0

    def on_reduce_start(self, engine, plan) -> None:  # noqa: ANN001
        self.events.append("start")
        self.exp_units = plan.exp_units

    def on_sent(self, engine, plan) -> None:  # noqa: ANN001
        self.events.append("sent")

    def on_recv(self, engine, timeout_s, n, t_in, t_out) -> None:  # noqa: ANN001
        self.events.append("recv")
        self.recv_ok &= t_out >= t_in and n >= 0 and timeout_s >= 0

    def on_settled(self, engine, plan, units) -> None:  # noqa: ANN001
        self.settled.update(int(u) for u in units)

    def on_flushes(self, engine, plan, units) -> None:  # noqa: ANN001
        self.flushed += len(units)

    def on_reduce_end(self, engine, plan, result) -> None:  # noqa: ANN001
        self.events.append("end")


def test_a_tracer_sees_each_reduce_from_start_to_end_and_every_unit_settled(make_cluster):
    cluster = make_cluster(2, up=0.1, seed=4, elems_per_packet=K)
    tracers = [Recorder() for _ in cluster.workers]
    for worker, tracer in zip(cluster.workers, tracers, strict=True):
        worker.engine.trace = tracer
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal(CHUNKS * K).astype(np.float32) for _ in range(2)]
    previous: list = [None, None]  # the prev fallback's values: each worker's last result (none at first)
    for step in range(2):
        results = cluster.reduce_all(inputs, step=step)
        # 10% up loss, 2 workers: about 81% of the chunks full, 18% partial, 1% lost both ways.
        checked = check_mean_over_bitmap(
            results,
            inputs,
            K,
            slack_bits=cluster.slack_bits,
            full=(2 * CHUNKS // 2, None),
            partial=(1, None),
            fallback=(0, 2 * CHUNKS // 8),
            prev=previous,
        )
        previous = [r.values.copy() for r in results]
        assert checked >= 2 * CHUNKS - 2 * CHUNKS // 8
    for worker, tracer, result in zip(cluster.workers, tracers, results, strict=True):
        marks = [e for e in tracer.events if e in ("start", "end")]
        assert marks == ["start", "end", "start", "end"]
        assert "sent" in tracer.events and "recv" in tracer.events and tracer.recv_ok
        # Every chunk that came back with a count was settled by a RESULT the tracer was told of.
        got = {tracer.exp_units + int(c) for c in np.flatnonzero(result.count > 0)}
        assert got <= tracer.settled
        assert tracer.flushed == worker.stats.flushes_sent  # told of every FLUSH, before it went


def test_lossy_tail_tracer_records_one_entry_per_reduce(make_cluster):
    from lta.bench.lossy_tail import _Tracer

    cluster = make_cluster(2, seed=5, elems_per_packet=K)
    tracer = _Tracer()
    cluster.workers[0].engine.trace = tracer
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(CHUNKS * K).astype(np.float32) for _ in range(2)]
    results = cluster.reduce_all(inputs, step=0)
    assert len(tracer.reduces) == 1
    rec = tracer.reduces[0]
    assert rec["elapsed_ms"] == round(results[0].elapsed_s * 1e3, 3)
    assert rec["missing"] == int(np.count_nonzero(results[0].count == 0)) == 0
    assert rec["first_result_ms"] is not None and rec["all_sent_ms"] is not None
    assert rec["packets_sent"] == cluster.workers[0].stats.packets_sent
