"""Which earlier collective a call repeats: call keys that survive FSDP2's fresh buffers.

A lossy all-gather hands out the previous copy of a lost shard, and a lossy reduce's ``prev`` fallback the
previous result of a lost chunk: both need to know which earlier call *this* call repeats. FSDP2 allocates
new all-gather and reduce-scatter buffers every time, so a buffer's address names nothing. What repeats is
the order: a training step makes the same collectives, of the same sizes, in the same order, every step.

The key of a call is ``(op, numel, dtype, ordinal)``: the ordinal counts the calls of that op, size and dtype
since the last step boundary. A boundary is every ``optimizer.step()`` of any torch optimizer (torch's public
``register_optimizer_step_post_hook``), so stock training loops need no change; :func:`step_boundary` marks
one by hand (a loop without a torch optimizer). Identical layers (same size) get distinct keys by their
position in the step. Calls outside the repeating pattern (evaluation, a first step of another shape) get
keys never seen before, and a key's first call is reliable: a wrong copy is never handed out for want of a
key, only a correct one withheld.

Every rank must make the same calls in the same order (as every collective requires) and step its
optimizer at the same points: then every rank computes the same keys.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

_registries: weakref.WeakSet[CallKeys] = weakref.WeakSet()
_hook: Any = None


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    step_boundary()


def step_boundary() -> None:
    """Start a new step for every lta process group of this process (``optimizer.step()`` does it)."""
    for registry in list(_registries):
        registry.boundary()


class CallKeys:
    """Hands out call keys; one per process group."""

    def __init__(self) -> None:
        global _hook
        self._ordinal: Counter[tuple[str, int, str]] = Counter()
        self.steps = 0  # boundaries seen
        _registries.add(self)
        if _hook is None:
            _hook = register_optimizer_step_post_hook(_on_optimizer_step)

    def key(self, op: str, numel: int, dtype: Any) -> tuple[str, int, str, int]:
        """The key of this call (and count it)."""
        sig = (op, int(numel), str(dtype))
        ordinal = self._ordinal[sig]
        self._ordinal[sig] = ordinal + 1
        return (*sig, ordinal)

    def boundary(self) -> None:
        self._ordinal.clear()
        self.steps += 1
