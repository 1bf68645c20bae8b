"""Parameter drift between replicas: the formulas, the measurement, and an owner-side predictor.

Drift is ``D = θ^(i,j) − θ^(k,j)``, the difference between two receivers' copies of shard j (the owner's
own copy is always fresh). With per-step updates of per-element variance σ² and independent Bernoulli(p)
loss of each broadcast at each receiver:

- the paper's Theorem 3.1 gives ``E[D²] = 2p/(1+p)·σ²``; its proof lets a stale copy lag one step only;
- for independent updates the exact value is ``2p/(1−p²)·σ²``: each copy's age is geometric and
  ``E|a−b| = 2p/(1−p²)`` for independent geometric ages a, b;
- correlated updates (momentum) drift more, up to ``2p/(1−p)²·σ²`` when consecutive updates are equal.

For updates of any correlation the expectation is ``Σ_a Σ_b π(a)π(b) |θ_{t−a} − θ_{t−b}|²`` over the
stationary age distribution π; :class:`DriftMonitor` evaluates it on the owner's recent history, with π
truncated by the staleness bound S (a copy older than S is resent reliably, so ages stop at S+1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hostlib.torch_ext.layout import ShardLayout


def paper_drift(p: float, sigma2: float) -> float:
    """Theorem 3.1: ``2p/(1+p)·σ²``."""
    return 2 * p / (1 + p) * sigma2


def iid_drift(p: float, sigma2: float) -> float:
    """Exact for independent updates and independent geometric ages: ``2p/(1−p²)·σ²``."""
    return 2 * p / (1 - p * p) * sigma2


def perfectly_correlated_drift(p: float, sigma2: float) -> float:
    """Upper end when every update equals the last (``E[(a−b)²]·σ²``): ``2p/(1−p)²·σ²``."""
    return 2 * p / (1 - p) ** 2 * sigma2


def age_distribution(p: float, bound: int | None) -> np.ndarray:
    """Stationary age distribution of one copy: ``π(a) ∝ p^a``, ages ``0..S+1`` when a copy older than
    the bound S is resent reliably (``bound=None``: untruncated, cut where the tail is below 1e-12)."""
    if not 0 <= p < 1:
        raise ValueError(f"loss probability must be in [0, 1), got {p}")
    if bound is None:
        top = 1 if p == 0 else int(np.ceil(np.log(1e-12) / np.log(p)))
    else:
        top = bound + 1
    weights = p ** np.arange(top + 1, dtype=np.float64)
    return weights / weights.sum()


def receiver_pair_drift(replicas: np.ndarray, layout: ShardLayout) -> float:
    """Measured ``E[D²]``: the mean over every value and every pair of workers that both *receive* that
    value (neither owns it) of the squared difference of their copies. ``replicas``: (N, ≥numel)."""
    n_workers = replicas.shape[0]
    values = replicas[:, : layout.numel].astype(np.float64, copy=False)
    owner = layout.element_owners()
    total, count = 0.0, 0
    for i in range(n_workers):
        for k in range(i + 1, n_workers):
            both_receive = (owner != i) & (owner != k)
            diff = values[i, both_receive] - values[k, both_receive]
            total += float(np.dot(diff, diff))
            count += int(both_receive.sum())
    if count == 0:
        raise ValueError("no value has two receivers: drift needs at least 3 workers")
    return total / count


class DriftMonitor:
    """Owner side: watches the owned shard after every update.

    ``sigma2`` is the per-value mean squared update ``E[Δθ²]`` (exponential average over ~``window``
    steps); ``predicted(p)`` is ``Σ π(a)π(b)·mean|θ_{t−a} − θ_{t−b}|²`` over the last S+2 published copies,
    which equals ``iid_drift`` for independent updates and exceeds it for momentum-correlated ones."""

    def __init__(self, shard: np.ndarray, stale_bound: int, window: int = 20) -> None:
        self.shard = shard  # a live view of the owned values
        self.bound = stale_bound
        self.history = np.zeros((stale_bound + 2, shard.size), dtype=np.float32)
        self.recorded = 0
        self.sigma2 = 0.0
        self.sigma2_sum = 0.0
        self._alpha = 2.0 / (window + 1)

    def record(self) -> None:
        """Call once per step, after the owner's update (before or after it is published)."""
        slot = self.recorded % len(self.history)
        if self.recorded > 0 and self.shard.size:
            last = self.history[(self.recorded - 1) % len(self.history)]
            delta = self.shard - last
            step_sigma2 = float(np.dot(delta, delta)) / self.shard.size
            self.sigma2_sum += step_sigma2
            weight = 1.0 if self.recorded == 1 else self._alpha
            self.sigma2 += weight * (step_sigma2 - self.sigma2)
        self.history[slot] = self.shard
        self.recorded += 1

    def state_dict(self) -> dict[str, Any]:
        """The recent history and the σ² averages (copies); the live shard view is not part of it."""
        return {
            "bound": self.bound,
            "history": self.history.copy(),
            "recorded": self.recorded,
            "sigma2": self.sigma2,
            "sigma2_sum": self.sigma2_sum,
            "alpha": self._alpha,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ValueError if taken over another shard size or bound."""
        history = np.array(state["history"], dtype=np.float32)
        if history.shape != self.history.shape or int(state["bound"]) != self.bound:
            raise ValueError(
                f"drift-monitor state has history {history.shape} with bound {int(state['bound'])}; "
                f"this monitor has {self.history.shape} with bound {self.bound}"
            )
        self.history = history
        self.recorded = int(state["recorded"])
        self.sigma2 = float(state["sigma2"])
        self.sigma2_sum = float(state["sigma2_sum"])
        self._alpha = float(state["alpha"])

    def predicted(self, p: float) -> float:
        """Drift expected between two receivers of this shard under independent Bernoulli(p) loss."""
        available = min(self.recorded, len(self.history))
        if available == 0 or self.shard.size == 0:
            return 0.0
        pi = age_distribution(p, self.bound)[:available]
        pi = pi / pi.sum()
        newest = (self.recorded - 1) % len(self.history)
        ages = (newest - np.arange(available)) % len(self.history)
        copies = self.history[ages].astype(np.float64)  # row a: the copy of age a
        # Σ_ab π_a π_b |v_a − v_b|² = 2(Σ_a π_a |v_a|² − |Σ_a π_a v_a|²), per value; then the mean.
        mean = pi @ copies
        second = pi @ np.einsum("an,an->a", copies, copies)
        return float(2 * (second - np.dot(mean, mean)) / self.shard.size)
