"""Bounded staleness for the asynchronous parameter server, with per-worker adaptive bounds.

A push computed on parameters of version ``s`` that reaches the server at global step ``g`` has
staleness ``g - s``. It is accepted when ``staleness <= bound(w)`` for its worker ``w``:

- fixed: ``bound(w) = max_staleness`` for every worker;
- adaptive: each worker's submission interval is smoothed, ``I_w <- alpha·dt + (1 - alpha)·I_w`` (the
  first interval initializes it); its speed relative to the cluster is ``speed_w = median_v(I_v) / I_w``
  (2.0: submits twice as often as the median worker), and
  ``bound(w) = clamp(max_staleness / speed_w, min_staleness, max_staleness · max_staleness_multiplier)``.
  A slow worker's gradients are older when they arrive because the others kept pushing meanwhile; its
  bound grows with its interval so that it is not starved. A worker without an interval yet has speed 1.

Times are passed in (``observe(w, now)``), so the rule is a pure function of the submissions it saw and
tests can drive it with a hand-made clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StalenessConfig:
    max_staleness: int = 5
    adaptive: bool = False
    min_staleness: int = 1
    max_staleness_multiplier: float = 10.0
    ewma_alpha: float = 0.2

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.min_staleness < 0:
            raise ValueError(f"min_staleness must be >= 0, got {self.min_staleness}")
        if self.max_staleness_multiplier < 1.0:
            raise ValueError(f"max_staleness_multiplier must be >= 1, got {self.max_staleness_multiplier}")
        if self.adaptive and self.min_staleness > self.max_staleness * self.max_staleness_multiplier:
            raise ValueError(
                f"min_staleness {self.min_staleness} exceeds the upper clamp max_staleness x "
                f"max_staleness_multiplier = {self.max_staleness * self.max_staleness_multiplier:g}"
            )
        if not 0.0 < self.ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha}")


class StalenessPolicy:
    """Accept/reject decisions for one job's pushes; keeps the per-worker interval EWMAs."""

    def __init__(self, n_workers: int, config: StalenessConfig) -> None:
        self.config = config
        self.interval = np.full(n_workers, np.nan)  # EWMA of seconds between submissions; NaN: unknown
        self._last = np.full(n_workers, np.nan)

    def observe(self, worker: int, now: float) -> None:
        """Worker ``worker`` submitted a push at time ``now`` (seconds, any monotonic clock)."""
        last = self._last[worker]
        self._last[worker] = now
        if np.isnan(last):
            return
        dt = max(now - last, 0.0)
        prev = self.interval[worker]
        alpha = self.config.ewma_alpha
        self.interval[worker] = dt if np.isnan(prev) else alpha * dt + (1.0 - alpha) * prev

    def speeds(self) -> np.ndarray:
        """Per worker ``median interval / own interval`` (1.0 while its interval is unknown or zero)."""
        known = self.interval[~np.isnan(self.interval)]
        speed = np.ones(len(self.interval))
        if known.size == 0:
            return speed
        median = float(np.median(known))
        ok = ~np.isnan(self.interval) & (self.interval > 0)
        speed[ok] = median / self.interval[ok]
        return speed

    def bounds(self) -> np.ndarray:
        """Every worker's staleness bound (float: compared with ``<=``)."""
        cfg = self.config
        n = len(self.interval)
        if not cfg.adaptive:
            return np.full(n, float(cfg.max_staleness))
        speed = self.speeds()
        raw = np.divide(cfg.max_staleness, speed, out=np.full(n, np.inf), where=speed > 0)
        return np.clip(raw, cfg.min_staleness, cfg.max_staleness * cfg.max_staleness_multiplier)

    def bound(self, worker: int) -> float:
        return float(self.bounds()[worker])

    def accepts(self, worker: int, staleness: int) -> bool:
        """Whether a push of ``staleness`` from ``worker`` is applied (never one from the future)."""
        return 0 <= staleness <= self.bound(worker)
