"""Step telemetry for a training loop, and its Prometheus endpoint.

    telemetry = Telemetry(job="gpt-small", worker=rank)        # hostlib.emulation.telemetry
    meter = StepMeter(opt, telemetry)                          # opt: ShardedOptimizer, LtaHookState, ...
    exporter = PrometheusExporter(telemetry).serve(9100 + rank)
    for batch in data:
        loss = model(batch); loss.backward(); opt.step(); opt.zero_grad()
        meter.step(tokens=batch.numel())

``StepMeter`` reads what the LTA objects already count (the transport's chunk counters and reduce
time, the sharded optimizer's parameter-exchange wait and stale ages) and feeds
:meth:`Telemetry.record_step` once per step. ``PrometheusExporter`` serves the telemetry in the
Prometheus text format, with these names (labels ``job`` and ``worker``; a Prometheus server keeps
a scraped ``job`` label as ``exported_job`` unless its scrape config sets ``honor_labels``):

| name | type | what |
| --- | --- | --- |
| ``lta_step_seconds`` | gauge | EWMA of the step's wall time |
| ``lta_comm_seconds`` | gauge | EWMA of the time in reduces and parameter collection |
| ``lta_tokens_per_second`` | gauge | EWMA of tokens (or samples) per second |
| ``lta_chunks_partial_ratio`` | gauge | EWMA of the fraction of chunks renormalized from 0 < count < N |
| ``lta_chunks_fallback_ratio`` | gauge | EWMA of the fraction of chunks that used the fallback |
| ``lta_staleness_steps`` | gauge | EWMA of the age of the oldest parameter copy (sharded mode) |
| ``lta_telemetry_alpha`` | gauge | the EWMA's α |
| ``lta_steps_total``, ``lta_tokens_total`` | counter | steps and tokens so far |
| ``lta_step_seconds_total``, ``lta_comm_seconds_total`` | counter | seconds so far |
| ``lta_chunks_total``, ``lta_chunks_partial_total``, ``lta_chunks_fallback_total`` | counter | chunks |

A gauge appears after its first sample. Rates over a Grafana window come from the counters
(``rate(lta_tokens_total[1m])``, ``rate(lta_chunks_fallback_total[5m]) / rate(lta_chunks_total[5m])``).
Each exporter has its own registry, so several workers in one process, or a test, do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from hostlib.emulation.telemetry import GAUGES, CounterDelta, Telemetry, transport_counters
from hostlib.torch_ext.health import _worker_of

LABELS = ("job", "worker")

_GAUGE_HELP = {
    "step_seconds": "EWMA of the training step's wall time (s)",
    "comm_seconds": "EWMA of the step's time in reduces and parameter collection (s)",
    "tokens_per_second": "EWMA of tokens (or samples) processed per second",
    "chunks_partial_ratio": "EWMA of the fraction of chunks renormalized from a partial count",
    "chunks_fallback_ratio": "EWMA of the fraction of chunks that used the fallback",
    "staleness_steps": "EWMA of the age in steps of the oldest parameter copy held",
}
_COUNTER_HELP = {
    "steps": "training steps recorded",
    "tokens": "tokens (or samples) processed",
    "step_seconds": "wall time of the recorded steps (s)",
    "comm_seconds": "time in reduces and parameter collection (s)",
    "chunks": "gradient chunks reduced",
    "chunks_partial": "chunks renormalized from a partial count (0 < count < N)",
    "chunks_fallback": "chunks that used the fallback",
}


class StepMeter:
    """Feeds ``telemetry`` once per step from ``source``: a ShardedOptimizer (comm time includes its
    parameter collection; staleness from its stale tracker), an LtaHookState, an lta ProcessGroup
    (None: the default group), a session or an LtaWorker."""

    def __init__(self, source: Any, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.worker = _worker_of(source)
        self.exchange = getattr(source, "exchange", None)  # the sharded optimizer's ParamExchange
        self._counters = CounterDelta(self._read)
        self._t0 = time.perf_counter()

    def _read(self) -> dict[str, float]:
        counters = transport_counters(self.worker.stats)
        if self.exchange is not None:
            counters["comm_seconds"] += self.exchange.stats.wait_s
        return counters

    def restart_clock(self) -> None:
        """Start the next step's clock now (after evaluation, checkpointing or other non-step work)."""
        self._t0 = time.perf_counter()

    def step(self, tokens: float) -> None:
        """Record the step that ends now: it started at the previous call (or construction, or
        :meth:`restart_clock`) and processed ``tokens``."""
        now = time.perf_counter()
        step_s = max(now - self._t0, 1e-9)
        self._t0 = now
        delta = self._counters.delta()
        staleness = None
        if self.exchange is not None and len(self.exchange.tracker.age):
            staleness = float(self.exchange.tracker.age.max())
        comm_s = min(max(delta.pop("comm_seconds", 0.0), 0.0), step_s)
        self.telemetry.record_step(tokens, step_s, comm_s, delta, staleness)


class TelemetryCollector(Collector):
    """A prometheus_client collector that reads a Telemetry at scrape time."""

    def __init__(self, telemetry: Telemetry | None = None) -> None:
        self.telemetry = telemetry

    def collect(self) -> Iterator[Metric]:
        if self.telemetry is None:
            return
        snap = self.telemetry.snapshot()
        labels = [snap["job"], str(snap["worker"])]
        alpha = GaugeMetricFamily(
            "lta_telemetry_alpha", "the newest step's weight in the EWMAs", labels=LABELS
        )
        alpha.add_metric(labels, snap["alpha"])
        yield alpha
        for name in GAUGES:
            value = snap["ewma"][name]
            if value is None:
                continue
            gauge = GaugeMetricFamily(f"lta_{name}", _GAUGE_HELP[name], labels=LABELS)
            gauge.add_metric(labels, value)
            yield gauge
        for name, value in snap["totals"].items():
            counter = CounterMetricFamily(f"lta_{name}", _COUNTER_HELP[name], labels=LABELS)
            counter.add_metric(labels, value)
            yield counter


class PrometheusExporter:
    """Serves a Telemetry over HTTP in the Prometheus text format (``/metrics``, any path works).

    ``track(telemetry)`` switches to another Telemetry (a new run in the same process); the
    endpoint then shows that one only."""

    def __init__(self, telemetry: Telemetry | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = TelemetryCollector(telemetry)
        self.registry.register(self.collector)
        self._server: Any = None
        self._thread: Any = None
        self.port = 0

    def track(self, telemetry: Telemetry | None) -> None:
        self.collector.telemetry = telemetry

    def serve(self, port: int, addr: str = "127.0.0.1") -> PrometheusExporter:
        """Listen on ``addr:port`` (port 0: any free port, read back from ``.port``) in a daemon
        thread. The default address is loopback; pass ``0.0.0.0`` for a Prometheus on another host."""
        if self._server is not None:
            raise RuntimeError(f"already serving on port {self.port}")
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror} (is the port in use?)"
            ) from None
        self.port = int(self._server.server_address[1])
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
