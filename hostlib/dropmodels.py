"""Emulated packet loss: Bernoulli and Gilbert–Elliott, shared by the softswitch and host-side emulation.

Names and parameters follow netem's ``gemodel``: ``p`` moves good→bad, ``r`` moves bad→good, and each
state has its own loss probability. A :class:`DropStream` is one seeded, replayable sequence of
decisions (one per packet); the switch keeps one per (job, direction, worker).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

DIRECTIONS = ("up", "down", "param")


@dataclass(frozen=True)
class DropPolicy:
    """A loss model. ``bernoulli``: every packet is lost with probability ``p``.
    ``gilbert_elliott``: two-state Markov chain (good→bad with ``p``, bad→good with ``r``) losing
    packets with ``loss_good`` / ``loss_bad`` in each state."""

    model: str = "bernoulli"
    p: float = 0.0
    r: float = 1.0
    loss_good: float = 0.0
    loss_bad: float = 1.0

    def __post_init__(self) -> None:
        if self.model not in ("bernoulli", "gilbert_elliott"):
            raise ValueError(f"unknown drop model {self.model!r}: use 'bernoulli' or 'gilbert_elliott'")
        for name in ("p", "r", "loss_good", "loss_bad"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"drop policy {name}={value} is not a probability in [0, 1]")

    @property
    def mean_loss(self) -> float:
        """Long-run fraction of packets lost."""
        if self.model == "bernoulli":
            return self.p
        if self.p + self.r == 0:
            return self.loss_good
        bad = self.p / (self.p + self.r)
        return bad * self.loss_bad + (1 - bad) * self.loss_good

    @classmethod
    def from_dict(cls, spec: dict) -> DropPolicy:
        """Build from a config table such as ``{model = "bernoulli", p = 0.1}``."""
        known = {"model", "p", "r", "loss_good", "loss_bad"}
        unknown = set(spec) - known - {"direction", "worker"}
        if unknown:
            raise ValueError(f"unknown drop policy keys {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**{k: v for k, v in spec.items() if k in known})


NO_LOSS = DropPolicy()


class DropStream:
    """A seeded sequence of drop decisions under one policy (stateful for Gilbert–Elliott)."""

    def __init__(self, policy: DropPolicy, seed: int) -> None:
        self.policy = policy
        self._rng = random.Random(seed)
        self._np_rng = np.random.default_rng(seed)
        self.bad = False

    def drop(self) -> bool:
        """Decide for one packet."""
        pol = self.policy
        if pol.model == "bernoulli":
            return pol.p > 0 and self._rng.random() < pol.p
        if self.bad:
            if self._rng.random() < pol.r:
                self.bad = False
        elif self._rng.random() < pol.p:
            self.bad = True
        loss = pol.loss_bad if self.bad else pol.loss_good
        return loss > 0 and self._rng.random() < loss

    def drop_many(self, n: int) -> np.ndarray:
        """Decide for ``n`` packets at once (boolean array); same law as ``n`` calls of :meth:`drop`."""
        pol = self.policy
        rng = self._np_rng
        if pol.model == "bernoulli":
            return rng.random(n) < pol.p
        bad = np.empty(n, dtype=bool)
        # The state sequence from run lengths. Each packet first moves the state, so the current state
        # keeps (geometric - 1) more packets (possibly none); every later state keeps a geometric run
        # that includes the packet that entered it. Same law as n calls of `drop`.
        filled, state, first = 0, self.bad, True
        while filled < n:
            leave = pol.r if state else pol.p
            run = n - filled if leave == 0 else int(rng.geometric(leave)) - (1 if first else 0)
            run = min(run, n - filled)
            bad[filled : filled + run] = state
            filled += run
            state, first = not state, False
        if n:
            self.bad = bool(bad[-1])
        loss = np.where(bad, pol.loss_bad, pol.loss_good)
        return rng.random(n) < loss
