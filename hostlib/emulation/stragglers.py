"""Emulated compute stragglers: seeded, per (worker, step, micro-batch), replayable in any call order.

DropCompute (seed 004) is about *compute* variance: a synchronous step waits for the slowest worker, so a
worker whose micro-batch happens to be slow stalls every other one. On one machine that variance has to
be made, and made the same way twice (a baseline and DropCompute must see the same stragglers), so every
decision here is a pure function of ``(seed, worker, step, micro_batch)``: the uniforms of one micro-batch
come from ``np.random.SeedSequence([seed, worker, step, micro_batch])``, never from a shared stream, so
asking in another order, from another process, or twice gives the same answer.

A micro-batch's time is ``base_s x multiplier`` with the multiplier the product of

- **random stragglers**: with probability ``prob`` (q) the micro-batch takes ``factor`` (k) times its base
  time (the issue's "q = 4 % per micro-batch at 3x");
- **one slow host**: worker ``slow_host`` always takes ``factor`` times longer (a bad node, the case where
  Local-SGD does not help, paper appendix B.3);
- **log-normal noise** (optional, the paper's simulated delay of appendix B.1): an additive
  ``min(Z / alpha, beta)`` with ``Z ~ LogNormal(4, 1)``, ``alpha = 2 e^4.5``, ``beta = 5.5``; the mean
  micro-batch then takes about 1.5x its base time and at most 6.5x.

:meth:`StragglerEmulator.sleep` spends that time, and can stop at a deadline: that is how an emulated
micro-batch is preempted at the compute threshold (DropCompute's Algorithm 1 stops the worker mid
micro-batch; a sleep is the one kind of compute that can actually be interrupted).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Appendix B.1's noise: Z ~ LogNormal(4, 1), scaled by 1/alpha and bounded by beta.
LOGNORMAL_MEAN, LOGNORMAL_SIGMA = 4.0, 1.0
LOGNORMAL_ALPHA = 2.0 * math.exp(4.5)
LOGNORMAL_BETA = 5.5
_STANDARD_NORMAL = statistics.NormalDist()


@dataclass(frozen=True)
class StragglerModel:
    """What makes a micro-batch slow (see the module docstring); ``base_s`` is its time when nothing does."""

    base_s: float = 0.0
    prob: float = 0.0  # q: chance that one micro-batch straggles
    factor: float = 3.0  # k: a straggling micro-batch (or the slow host's every one) takes k x base_s
    slow_host: int | None = None  # this worker always takes k x base_s
    lognormal: bool = False  # add the paper's bounded log-normal noise (appendix B.1)
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.base_s >= 0.0 and math.isfinite(self.base_s)):
            raise ValueError(f"base_s must be a finite time >= 0, got {self.base_s}")
        if not 0.0 <= self.prob <= 1.0:
            raise ValueError(f"straggle probability must be in [0, 1], got {self.prob}")
        if not (self.factor >= 1.0 and math.isfinite(self.factor)):
            raise ValueError(f"straggle factor must be a finite number >= 1, got {self.factor}")
        if self.slow_host is not None and self.slow_host < 0:
            raise ValueError(f"slow_host must be a worker id >= 0, got {self.slow_host}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0 (it feeds numpy's SeedSequence), got {self.seed}")

    @property
    def active(self) -> bool:
        """Whether any micro-batch can take longer than ``base_s``."""
        return (self.prob > 0 and self.factor > 1) or self.slow_host is not None or self.lognormal


class StragglerEmulator:
    """Replayable micro-batch delays of one :class:`StragglerModel`.

    ``multiplier(w, i, m)`` is a pure function of the model and ``(w, i, m)``: equal on every call and
    in every process, whatever was asked before."""

    def __init__(
        self,
        model: StragglerModel,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleeper: Callable[[float], None] = time.sleep,
    ) -> None:
        self.model = model
        self._clock, self._sleep = clock, sleeper

    def _uniforms(self, worker: int, step: int, micro_batch: int) -> np.ndarray:
        if min(worker, step, micro_batch) < 0:
            raise ValueError(f"worker, step and micro-batch must be >= 0, got {(worker, step, micro_batch)}")
        seq = np.random.SeedSequence([self.model.seed, worker, step, micro_batch])
        # Two draws, always both: the straggle coin and the log-normal noise's uniform (turning a model
        # option on or off changes no other decision).
        return np.random.default_rng(seq).random(2)

    def straggles(self, worker: int, step: int, micro_batch: int) -> bool:
        """Whether this micro-batch is a random straggler (probability ``prob``)."""
        return bool(self._uniforms(worker, step, micro_batch)[0] < self.model.prob)

    def multiplier(self, worker: int, step: int, micro_batch: int) -> float:
        """This micro-batch's time as a multiple of ``base_s`` (1.0: not slowed)."""
        m = self.model
        coin, noise_u = self._uniforms(worker, step, micro_batch)
        mult = 1.0
        if coin < m.prob:
            mult *= m.factor
        if m.slow_host is not None and worker == m.slow_host:
            mult *= m.factor
        if m.lognormal:
            mult += lognormal_noise(float(noise_u))
        return mult

    def latency_s(self, worker: int, step: int, micro_batch: int) -> float:
        """Seconds this micro-batch takes: ``base_s x multiplier``."""
        return self.model.base_s * self.multiplier(worker, step, micro_batch)

    def extra_s(self, worker: int, step: int, micro_batch: int) -> float:
        """Seconds beyond ``base_s``: what a straggler adds to a micro-batch of real compute."""
        return self.model.base_s * (self.multiplier(worker, step, micro_batch) - 1.0)

    def multipliers(self, worker: int, steps: range, micro_batches: int) -> np.ndarray:
        """``multiplier`` for every (step, micro-batch) of ``steps`` x ``range(micro_batches)``, shape
        ``(len(steps), micro_batches)``: the same numbers, for analysis."""
        return np.array(
            [[self.multiplier(worker, i, m) for m in range(micro_batches)] for i in steps], dtype=np.float64
        )

    def sleep(
        self,
        worker: int,
        step: int,
        micro_batch: int,
        *,
        until: float | None = None,
        extra_only: bool = False,
    ) -> bool:
        """Spend this micro-batch's time (``extra_only``: only what a straggler adds), stopping at the
        clock time ``until`` if that comes first. Returns True when the whole time was spent, False when
        ``until`` cut it short (the micro-batch was preempted and must not count)."""
        seconds = (self.extra_s if extra_only else self.latency_s)(worker, step, micro_batch)
        start = self._clock()
        end = start + seconds
        if until is not None and end > until:
            if until > start:
                self._sleep(until - start)
            return False
        if seconds > 0:
            self._sleep(seconds)
        return True


def lognormal_noise(u: float) -> float:
    """Appendix B.1's additive noise ``min(Z / alpha, beta)`` for the uniform ``u`` (inverse CDF of
    ``Z ~ LogNormal(4, 1)``), in units of the base micro-batch time."""
    u = min(max(u, 1e-12), 1.0 - 1e-12)
    z = math.exp(LOGNORMAL_MEAN + LOGNORMAL_SIGMA * _STANDARD_NORMAL.inv_cdf(u))
    return min(z / LOGNORMAL_ALPHA, LOGNORMAL_BETA)
