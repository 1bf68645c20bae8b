"""Stale-shard tracking: how many steps old each locally held copy of a shard (or chunk) is.

A receiver that lost a parameter broadcast keeps its previous copy; the copy's age grows by one per
step until a broadcast gets through. The tracker keeps those ages, summarises them, and names the
shards whose age passed the bound so the caller can ask for a reliable resend.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class StaleTracker:
    """Ages of ``n_shards`` copies. ``update(received)`` advances one step."""

    def __init__(self, n_shards: int, bound: int = 8) -> None:
        if n_shards < 0 or bound < 0:
            raise ValueError(f"n_shards and bound must be >= 0, got {n_shards}, {bound}")
        self.bound = bound
        self.age = np.zeros(n_shards, dtype=np.int64)
        self.max_seen = 0
        self._hist = np.zeros(bound + 2, dtype=np.int64)  # ages 0..bound, and one bin for > bound
        self.steps = 0

    def update(self, received: np.ndarray) -> np.ndarray:
        """Record one step: shards with ``received`` True are fresh (age 0), the rest get older.
        Returns the indices of shards now older than the bound (they need a reliable resend)."""
        received = np.asarray(received, dtype=bool)
        if received.shape != self.age.shape:
            raise ValueError(f"received mask has shape {received.shape}, tracker holds {self.age.shape}")
        self.age += 1
        self.age[received] = 0
        self.steps += 1
        if len(self.age):
            self.max_seen = max(self.max_seen, int(self.age.max()))
        self._hist += np.bincount(np.minimum(self.age, self.bound + 1), minlength=self.bound + 2)
        return np.flatnonzero(self.age > self.bound)

    def refreshed(self, shards: np.ndarray) -> None:
        """Mark shards as fresh outside a step (a reliable resend arrived)."""
        self.age[shards] = 0

    def within_bound(self) -> bool:
        return bool(np.all(self.age <= self.bound))

    def state_dict(self) -> dict[str, Any]:
        """Everything :meth:`update` and :meth:`summary` depend on (copies): ages, histogram, counters."""
        return {
            "bound": self.bound,
            "age": self.age.copy(),
            "max_seen": self.max_seen,
            "histogram": self._hist.copy(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ValueError if it tracks another number of shards or bound."""
        age = np.array(state["age"], dtype=np.int64)
        if age.shape != self.age.shape or int(state["bound"]) != self.bound:
            raise ValueError(
                f"stale-tracker state holds {age.size} shards with bound {int(state['bound'])}; "
                f"this tracker holds {self.age.size} with bound {self.bound}"
            )
        self.age = age
        self.max_seen = int(state["max_seen"])
        self._hist = np.array(state["histogram"], dtype=np.int64).reshape(self._hist.shape)
        self.steps = int(state["steps"])

    def summary(self) -> dict:
        """Current max/mean age, the worst age ever seen, and the histogram of ages over all steps."""
        return {
            "max_age": int(self.age.max()) if len(self.age) else 0,
            "mean_age": float(self.age.mean()) if len(self.age) else 0.0,
            "max_age_seen": self.max_seen,
            "bound": self.bound,
            "histogram": {
                **{str(a): int(c) for a, c in enumerate(self._hist[:-1])},
                f">{self.bound}": int(self._hist[-1]),
            },
        }
