"""Per-worker training telemetry: what one step cost and what the network did to it, smoothed.

A training loop (or :class:`hostlib.torch_ext.metrics.StepMeter`, which reads the numbers from the LTA
objects) calls :meth:`Telemetry.record_step` once per step with the tokens (or samples) it processed,
the step's wall time, the part of it spent communicating, and the change of the transport's chunk
counters over the step. ``Telemetry`` keeps

- an exponentially weighted moving average (EWMA) of each per-step quantity: step seconds, comm
  seconds, tokens per second, the fraction of chunks renormalized from a partial count, the fraction
  that fell back, and the staleness of the worker's parameter copies;
- running totals (steps, tokens, seconds, chunks), from which any rate over any window follows.

The EWMA is ``m_1 = x_1``, then ``m_t = α·x_t + (1-α)·m_{t-1}``: a sample's weight halves every
``ln 2 / -ln(1-α)`` steps (about 6.6 at the default α = 0.1), responsive to a slowdown yet steady
through one slow step. α comes from the ``alpha`` argument, else the ``TELEMETRY_ALPHA`` environment
variable (the knob's name in the parameter-server design this follows), else 0.1.

numpy and the standard library only, like the rest of the ``hostlib`` core; the Prometheus exporter is
in the torch layer (``hostlib/torch_ext/metrics.py``).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from hostlib.errors import UsageError
from hostlib.transport.result import TransportStats

TELEMETRY_ALPHA_ENV = "TELEMETRY_ALPHA"
DEFAULT_ALPHA = 0.1

# The smoothed per-step quantities, in the order reports list them.
GAUGES = (
    "step_seconds",
    "comm_seconds",
    "tokens_per_second",
    "chunks_partial_ratio",
    "chunks_fallback_ratio",
    "staleness_steps",
)


def check_alpha(alpha: float, where: str = "alpha") -> float:
    """``alpha`` if it is a number in (0, 1], else :class:`UsageError` naming ``where``."""
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and 0 < alpha <= 1):
        raise UsageError(f"{where} must be a number in (0, 1] (the newest step's EWMA weight), got {alpha!r}")
    return float(alpha)


def alpha_from_env(environ: Mapping[str, str] | None = None) -> float:
    """α from ``TELEMETRY_ALPHA`` when set, else :data:`DEFAULT_ALPHA`."""
    text = (os.environ if environ is None else environ).get(TELEMETRY_ALPHA_ENV, "").strip()
    if not text:
        return DEFAULT_ALPHA
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{TELEMETRY_ALPHA_ENV} must be a number in (0, 1], got {text!r}") from None
    return check_alpha(value, TELEMETRY_ALPHA_ENV)


class Ewma:
    """Exponentially weighted moving average; ``value`` is None until the first sample."""

    def __init__(self, alpha: float) -> None:
        self.alpha = check_alpha(alpha)
        self.value: float | None = None
        self.samples = 0

    def update(self, x: float) -> float:
        """Fold in one sample and return the new average (the first sample is taken as it is)."""
        x = float(x)
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.samples += 1
        return self.value


@dataclass
class TelemetryTotals:
    """Running totals since the Telemetry was made (what Prometheus counters export)."""

    steps: int = 0
    tokens: float = 0.0
    step_seconds: float = 0.0
    comm_seconds: float = 0.0
    chunks: int = 0
    chunks_partial: int = 0
    chunks_fallback: int = 0


def transport_counters(stats: TransportStats) -> dict[str, float]:
    """The cumulative counters of a worker's transport that telemetry differences step by step:
    chunks reduced, chunks renormalized from a partial count (0 < count < N), chunks that used a
    fallback (no RESULT, count 0, or incomplete under ``renormalize='none'``), seconds in reduces."""
    return {
        "chunks": stats.chunks,
        "chunks_partial": stats.chunks_partial,
        "chunks_fallback": stats.fallback_prev + stats.fallback_zero + stats.fallback_local,
        "comm_seconds": stats.elapsed_s,
    }


class CounterDelta:
    """Remembers cumulative counters read by ``read()`` and returns how much each grew since the last
    call (the first call: since construction)."""

    def __init__(self, read: Callable[[], Mapping[str, float]]) -> None:
        self._read = read
        self._last = dict(read())

    def delta(self) -> dict[str, float]:
        now = dict(self._read())
        out = {name: value - self._last.get(name, 0) for name, value in now.items()}
        self._last = now
        return out


class Telemetry:
    """One worker's step telemetry: EWMAs of the per-step quantities and running totals.

    Thread-safe: a Prometheus scrape thread may call :meth:`snapshot` while the loop records."""

    def __init__(self, *, alpha: float | None = None, job: str = "", worker: int = 0) -> None:
        self.alpha = alpha_from_env() if alpha is None else check_alpha(alpha)
        self.job, self.worker = str(job), int(worker)
        self.ewma = {name: Ewma(self.alpha) for name in GAUGES}
        self.totals = TelemetryTotals()
        self.last: dict[str, float] = {}
        self._lock = threading.Lock()

    def record_step(
        self,
        tokens: float,
        step_s: float,
        comm_s: float,
        stats_delta: Mapping[str, float],
        staleness: float | None = None,
    ) -> None:
        """One training step: ``tokens`` (or samples) processed, its wall time ``step_s`` (> 0), the
        part ``comm_s`` spent communicating, and ``stats_delta``, the growth over the step of
        ``chunks``, ``chunks_partial`` and ``chunks_fallback`` (see :func:`transport_counters`;
        missing keys count as 0). ``staleness``: the age in steps of the worker's oldest parameter
        copy (sharded mode), None where there is no such copy. A step that reduced no chunk leaves
        the two chunk ratios' averages where they were."""
        if not step_s > 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        if tokens < 0 or comm_s < 0:
            raise ValueError(f"tokens and comm_s must be >= 0, got {tokens}, {comm_s}")
        chunks = int(stats_delta.get("chunks", 0))
        partial = int(stats_delta.get("chunks_partial", 0))
        fallback = int(stats_delta.get("chunks_fallback", 0))
        sample = {
            "step_seconds": float(step_s),
            "comm_seconds": float(comm_s),
            "tokens_per_second": tokens / step_s,
        }
        if chunks > 0:
            sample["chunks_partial_ratio"] = partial / chunks
            sample["chunks_fallback_ratio"] = fallback / chunks
        if staleness is not None:
            sample["staleness_steps"] = float(staleness)
        with self._lock:
            for name, value in sample.items():
                self.ewma[name].update(value)
            t = self.totals
            t.steps += 1
            t.tokens += tokens
            t.step_seconds += step_s
            t.comm_seconds += comm_s
            t.chunks += chunks
            t.chunks_partial += partial
            t.chunks_fallback += fallback
            self.last = sample

    def snapshot(self) -> dict[str, Any]:
        """``{"job", "worker", "alpha", "ewma": {gauge: value or None}, "last": {...}, "totals": {...}}``."""
        with self._lock:
            return {
                "job": self.job,
                "worker": self.worker,
                "alpha": self.alpha,
                "ewma": {name: e.value for name, e in self.ewma.items()},
                "last": dict(self.last),
                "totals": asdict(self.totals),
            }
