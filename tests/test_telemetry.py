"""Step telemetry (hostlib/emulation/telemetry.py), its Prometheus endpoint (hostlib/torch_ext/metrics.py) and
``lta metrics watch`` (lta/metrics_cli.py).

EWMAs are checked against values worked out by hand; the endpoint is scraped with urllib and its text
read with a regular expression, not with the library that wrote it.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.request

import numpy as np
import pytest

from hostlib.emulation.telemetry import (
    DEFAULT_ALPHA,
    CounterDelta,
    Ewma,
    Telemetry,
    alpha_from_env,
    transport_counters,
)
from hostlib.errors import UsageError
from hostlib.torch_ext.metrics import PrometheusExporter, StepMeter
from hostlib.transport import Fallback, TransportStats
from lta import cli
from lta.metrics_cli import parse_targets
from tests.conftest import run_workers

SAMPLE = re.compile(r'^(lta_\w+)\{job="([^"]*)",worker="([^"]*)"\} (\S+)$', re.M)


def test_ewma_by_hand():
    e = Ewma(0.25)
    assert e.value is None
    assert e.update(4.0) == 4.0  # the first sample is taken as it is
    assert e.update(8.0) == pytest.approx(5.0)  # 4 + 0.25·(8 − 4)
    assert e.update(2.0) == pytest.approx(4.25)  # 5 + 0.25·(2 − 5)
    assert e.samples == 3
    for bad in (0, 1.5, -0.1, float("nan")):
        with pytest.raises(UsageError):
            Ewma(bad)


def hand_telemetry() -> Telemetry:
    t = Telemetry(alpha=0.5, job="run-a", worker=2)
    t.record_step(1000, 0.5, 0.1, {"chunks": 10, "chunks_partial": 2, "chunks_fallback": 1})
    t.record_step(1000, 0.25, 0.2, {"chunks": 10, "chunks_partial": 6, "chunks_fallback": 0}, staleness=3)
    t.record_step(500, 0.25, 0.05, {"chunks": 0}, staleness=1)  # no chunk: ratios keep their value
    return t


def test_record_step_ewmas_and_totals_by_hand():
    snap = hand_telemetry().snapshot()
    ewma, totals = snap["ewma"], snap["totals"]
    # step s: 0.5 → 0.5 + .5(0.25 − 0.5) = 0.375 → 0.375 + .5(0.25 − 0.375) = 0.3125
    assert ewma["step_seconds"] == pytest.approx(0.3125)
    # comm s: 0.1 → 0.15 → 0.1
    assert ewma["comm_seconds"] == pytest.approx(0.1)
    # tokens/s: 2000 → 2000 + .5(4000 − 2000) = 3000 → 3000 + .5(2000 − 3000) = 2500
    assert ewma["tokens_per_second"] == pytest.approx(2500.0)
    # partial: 0.2 → 0.4 (third step reduced nothing); fallback: 0.1 → 0.05
    assert ewma["chunks_partial_ratio"] == pytest.approx(0.4)
    assert ewma["chunks_fallback_ratio"] == pytest.approx(0.05)
    # staleness: 3 → 2
    assert ewma["staleness_steps"] == pytest.approx(2.0)
    assert totals == {
        "steps": 3,
        "tokens": 2500,
        "step_seconds": pytest.approx(1.0),
        "comm_seconds": pytest.approx(0.35),
        "chunks": 20,
        "chunks_partial": 8,
        "chunks_fallback": 1,
    }
    assert (snap["job"], snap["worker"], snap["alpha"]) == ("run-a", 2, 0.5)


def test_alpha_from_the_environment():
    assert alpha_from_env({}) == DEFAULT_ALPHA
    assert alpha_from_env({"TELEMETRY_ALPHA": "0.3"}) == 0.3
    for bad in ("zero", "0", "1.5", "nan"):
        with pytest.raises(UsageError, match="TELEMETRY_ALPHA"):
            alpha_from_env({"TELEMETRY_ALPHA": bad})


def test_counter_delta_follows_transport_stats():
    stats = TransportStats()
    delta = CounterDelta(lambda: transport_counters(stats))
    stats.chunks, stats.chunks_partial, stats.fallback_prev, stats.fallback_zero = 8, 3, 1, 1
    stats.elapsed_s = 0.5
    assert delta.delta() == {"chunks": 8, "chunks_partial": 3, "chunks_fallback": 2, "comm_seconds": 0.5}
    stats.chunks += 4
    assert delta.delta() == {"chunks": 4, "chunks_partial": 0, "chunks_fallback": 0, "comm_seconds": 0.0}


def scrape(port: int) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(m[0], m[1], m[2]): float(m[3]) for m in SAMPLE.findall(text)}


def test_prometheus_endpoint_serves_the_lta_names_with_their_values():
    exporter = PrometheusExporter(hand_telemetry()).serve(0)
    try:
        got = scrape(exporter.port)
    finally:
        exporter.close()
    label = ("run-a", "2")
    want = {
        "lta_step_seconds": 0.3125,
        "lta_comm_seconds": 0.1,
        "lta_tokens_per_second": 2500.0,
        "lta_chunks_partial_ratio": 0.4,
        "lta_chunks_fallback_ratio": 0.05,
        "lta_staleness_steps": 2.0,
        "lta_telemetry_alpha": 0.5,
        "lta_steps_total": 3.0,
        "lta_tokens_total": 2500.0,
        "lta_step_seconds_total": 1.0,
        "lta_comm_seconds_total": 0.35,
        "lta_chunks_total": 20.0,
        "lta_chunks_partial_total": 8.0,
        "lta_chunks_fallback_total": 1.0,
    }
    assert {name for name, *_ in got} == set(want)
    for name, value in want.items():
        assert got[(name, *label)] == pytest.approx(value), name


def test_exporter_switches_runs_and_shows_gauges_after_their_first_sample():
    exporter = PrometheusExporter().serve(0)
    try:
        assert scrape(exporter.port) == {}  # nothing tracked yet
        fresh = Telemetry(alpha=0.1, job="run-b", worker=0)
        exporter.track(fresh)
        names = {name for name, *_ in scrape(exporter.port)}
        assert "lta_steps_total" in names and "lta_step_seconds" not in names
        fresh.record_step(10, 0.1, 0.0, {})
        got = scrape(exporter.port)
        assert got[("lta_step_seconds", "run-b", "0")] == pytest.approx(0.1)
        assert "lta_staleness_steps" not in {name for name, *_ in got}  # no stale tracker: no value
    finally:
        exporter.close()


def test_step_meter_counts_what_the_reduces_returned(make_cluster):
    n, chunks = 3, 40
    cluster = make_cluster(n, up=0.3, elems_per_packet=64, exp_copies=6)
    telemetry = [Telemetry(alpha=1.0, job="j", worker=w) for w in range(n)]
    meters = [StepMeter(w, t) for w, t in zip(cluster.workers, telemetry, strict=True)]
    rng = np.random.default_rng(0)
    seen = [{"chunks": 0, "partial": 0, "fallback": 0} for _ in range(n)]
    for step in range(3):
        inputs = [rng.normal(size=chunks * 64).astype(np.float32) for _ in range(n)]
        results = run_workers(cluster.workers, lambda w, i, x=inputs, s=step: w.allreduce(x[i], step=s))
        for i, result in enumerate(results):
            meters[i].step(tokens=100)
            seen[i]["chunks"] += len(result.count)
            seen[i]["partial"] += int(np.sum((result.count > 0) & (result.count < n)))
            seen[i]["fallback"] += int(np.sum(result.fallback != Fallback.NONE))
    for i, t in enumerate(telemetry):
        totals = t.snapshot()["totals"]
        assert totals["steps"] == 3 and totals["tokens"] == 300
        assert (totals["chunks"], totals["chunks_partial"], totals["chunks_fallback"]) == (
            seen[i]["chunks"],
            seen[i]["partial"],
            seen[i]["fallback"],
        )
        assert totals["chunks_partial"] > 0  # the loss showed up
        assert 0 < totals["comm_seconds"] <= totals["step_seconds"]


def test_parse_targets():
    assert parse_targets(["127.0.0.1:9100-9102"]) == [
        "http://127.0.0.1:9100/metrics",
        "http://127.0.0.1:9101/metrics",
        "http://127.0.0.1:9102/metrics",
    ]
    assert parse_targets(["http://h:80/m,h2:81"]) == ["http://h:80/m", "http://h2:81/metrics"]
    for bad in ("nohost", "h:0", "h:9102-9100", "ftp://h:21", "h:99999"):
        with pytest.raises(UsageError):
            parse_targets([bad])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lta_metrics_watch_json_and_table(capsys):
    exporter = PrometheusExporter(hand_telemetry()).serve(0)
    dead = free_port()
    try:
        assert cli.main(["metrics", "watch", f"127.0.0.1:{exporter.port}", "--count", "1", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["schema"] == "lta.metrics.watch/1" and doc["errors"] == []
        (row,) = doc["rows"]
        assert (row["job"], row["worker"]) == ("run-a", "2")
        assert row["lta_tokens_per_second"] == pytest.approx(2500.0)
        assert row["lta_steps_total"] == 3.0
        targets = f"127.0.0.1:{exporter.port},127.0.0.1:{dead}"
        assert cli.main(["metrics", "watch", targets, "--count", "1", "--timeout", "1"]) == 0
        out = capsys.readouterr().out
        assert "run-a" in out and "2500" in out and "312.5" in out  # tokens/s, step ms
        assert f"unreachable: http://127.0.0.1:{dead}/metrics" in out
    finally:
        exporter.close()
    assert cli.main(["metrics", "watch", f"127.0.0.1:{dead}", "--count", "1", "--timeout", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert "no endpoint answered" in err and len(err.splitlines()) == 1
