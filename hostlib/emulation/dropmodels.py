"""Emulated packet loss: Bernoulli and Gilbert–Elliott, shared by the softswitch and host-side emulation.

Names and parameters follow netem's ``gemodel``: ``p`` moves good→bad, ``r`` moves bad→good, and each
state has its own loss probability. A :class:`DropStream` is one seeded, replayable sequence of
decisions (one per packet); the switch keeps one per (job, direction, worker), and for ``param`` one per
(job, receiver, sender).
"""

from __future__ import annotations

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


# Uniforms are drawn from the generator in blocks of this size, always the same size, so the stream of
# uniforms a DropStream consumes does not depend on how its decisions are asked for.
_BLOCK = 4096


class DropStream:
    """A seeded sequence of drop decisions under one policy (stateful for Gilbert–Elliott).

    Every decision consumes a fixed number of uniforms from one buffered stream: one for Bernoulli, two for
    Gilbert–Elliott (the state transition, then the loss). So ``drop()`` called ``n`` times and
    ``drop_many(n)`` give exactly the same decisions, and any interleaving of the two continues the same
    sequence: the per-packet switch and the batched one take identical decisions."""

    def __init__(self, policy: DropPolicy, seed: int) -> None:
        self.policy = policy
        self._rng = np.random.default_rng(seed)
        self._per = 1 if policy.model == "bernoulli" else 2
        self._buf = np.empty(0, dtype=np.float64)
        self._pos = 0
        self.bad = False
        self._peeked: np.ndarray | None = None  # GE states of the last peek(), for advance()
        # Bernoulli: the decisions of the whole buffer, made once per buffer (peek slices them): the
        # batched switch peeks once per receiver and batch, a few packets at a time under RESULT loss.
        self._decisions: tuple[np.ndarray, np.ndarray] | None = None  # (the buffer, its decisions)
        self.used = 0  # uniforms consumed so far: with the seed, where the stream stands

    def _take(self, k: int) -> np.ndarray:
        """The next ``k`` uniforms of the stream."""
        self.used += k
        pos, buf = self._pos, self._buf
        if pos + k <= len(buf):
            self._pos = pos + k
            return buf[pos : pos + k]
        rest = buf[pos:]
        blocks = -(-(k - len(rest)) // _BLOCK)
        fresh = np.concatenate([self._rng.random(_BLOCK) for _ in range(blocks)])
        need = k - len(rest)
        self._buf, self._pos = fresh, need
        return np.concatenate([rest, fresh[:need]])

    def drop(self) -> bool:
        """Decide for one packet."""
        pol = self.policy
        if self._pos + self._per > len(self._buf):
            u = self._take(self._per)
        else:
            u = self._buf[self._pos : self._pos + self._per]
            self._pos += self._per
            self.used += self._per
        if self._per == 1:
            return bool(u[0] < pol.p)
        move, lose = float(u[0]), float(u[1])
        if self.bad:
            if move < pol.r:
                self.bad = False
        elif move < pol.p:
            self.bad = True
        return lose < (pol.loss_bad if self.bad else pol.loss_good)

    def peek(self, n: int) -> np.ndarray:
        """The next ``n`` decisions (uint8, 1 = drop) without consuming them: :meth:`advance` then consumes
        the first k of them, as ``drop_many(k)`` would (the batched switch peeks a batch's worth and takes
        what its packets used)."""
        need = n * self._per
        if self._pos + need > len(self._buf):  # the same uniforms, in fixed blocks, as _take would draw
            blocks = -(-(self._pos + need - len(self._buf)) // _BLOCK)
            rest = self._buf[self._pos :]
            self._buf = np.concatenate([rest, *(self._rng.random(_BLOCK) for _ in range(blocks))])
            self._pos = 0
        pol = self.policy
        if self._per == 1:
            self._peeked = None
            if self._decisions is None or self._decisions[0] is not self._buf:
                self._decisions = self._buf, (self._buf < pol.p).view(np.uint8)
            return self._decisions[1][self._pos : self._pos + need]
        u = self._buf[self._pos : self._pos + need]
        bad = self._ge_states(u.reshape(n, 2)[:, 0], self.bad)
        self._peeked = bad
        return (u.reshape(n, 2)[:, 1] < np.where(bad, pol.loss_bad, pol.loss_good)).view(np.uint8)

    def advance(self, k: int) -> None:
        """Consume the first ``k`` decisions of the last :meth:`peek`."""
        if k <= 0:
            return
        self._pos += k * self._per
        self.used += k * self._per
        if self._per == 2:
            assert self._peeked is not None and k <= len(self._peeked), "advance() past what peek() saw"
            self.bad = bool(self._peeked[k - 1])

    def _ge_states(self, move: np.ndarray, bad0: bool) -> np.ndarray:
        """Gilbert–Elliott: the state (True = bad) after each packet's transition, from state ``bad0``."""
        pol = self.policy
        n = len(move)
        to_bad = move < pol.p  # the move a good state makes
        to_good = move < pol.r  # the move a bad state makes
        # Per packet the new state is a function of the old one: "set" (bad if to_bad, whatever the old
        # state) when to_bad != to_good, "flip" when both, "keep" when neither. So the state after packet i
        # is the value of the last set at or before i, flipped once per flip since then.
        is_set = to_bad != to_good
        flips = np.cumsum(to_bad & to_good, dtype=np.int64)
        last = np.maximum.accumulate(np.where(is_set, np.arange(n), -1))
        seen = last >= 0
        at = np.where(seen, last, 0)
        base = np.where(seen, to_bad[at], bad0)
        flips_before = np.where(seen, flips[at], 0)
        return base ^ ((flips - flips_before) & 1).astype(bool)

    def drop_many(self, n: int) -> np.ndarray:
        """Decide for ``n`` packets at once (boolean array): exactly the next ``n`` calls of :meth:`drop`."""
        pol = self.policy
        if n <= 0:
            return np.zeros(0, dtype=bool)
        if self._per == 1:
            return self._take(n) < pol.p
        u = self._take(2 * n).reshape(n, 2)
        bad = self._ge_states(u[:, 0], self.bad)
        self.bad = bool(bad[-1])
        return u[:, 1] < np.where(bad, pol.loss_bad, pol.loss_good)
