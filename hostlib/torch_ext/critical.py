"""Which parameters are critical (LTP's critical packets): their gradients come back with every worker
counted and their parameter broadcasts are delivered, while the rest of the model stays loss-tolerant.

``critical=`` in :class:`~hostlib.torch_ext.ddp_hook.LtaHookState` and
:class:`~hostlib.torch_ext.sharded.ShardedOptimizer` takes:

- ``None`` (the default): nothing is critical;
- ``"default"``: :data:`DEFAULT_CRITICAL`, the parameters of normalization layers (BatchNorm, SyncBatchNorm,
  InstanceNorm, LayerNorm, GroupNorm, RMSNorm) and every bias. They are a small share of a model (0.1% to
  1% of the values in ResNets and transformers) but scale and shift whole activations, and a lost bias
  update is not averaged away by the thousands of weights around it as a lost weight update is;
- a glob or a list of globs on the parameter names of ``module.named_parameters()`` (``"*.bias"``,
  ``"encoder.layers.0.*"``);
- a predicate ``f(name, parameter) -> bool``.

The transport marks whole chunks (K values): a critical parameter makes every chunk it touches
critical, together with its neighbours' values in those chunks. Every worker must resolve the same set
(the same model and the same spec), since no worker FLUSHes a critical chunk.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

DEFAULT_CRITICAL = "default"
CriticalSpec = None | str | Sequence[str] | Callable[[str, torch.nn.Parameter], bool]

_NORM_LAYERS: tuple[type[torch.nn.Module], ...] = tuple(
    layer
    for layer in (
        getattr(torch.nn, name, None)
        for name in (
            "BatchNorm1d",
            "BatchNorm2d",
            "BatchNorm3d",
            "SyncBatchNorm",
            "InstanceNorm1d",
            "InstanceNorm2d",
            "InstanceNorm3d",
            "LayerNorm",
            "GroupNorm",
            "RMSNorm",
        )  # fmt: skip
    )
    if isinstance(layer, type)
)


def is_default_critical(owner: torch.nn.Module, local_name: str) -> bool:
    """The default set: every parameter of a normalization layer, and every bias."""
    return isinstance(owner, _NORM_LAYERS) or local_name == "bias"


def critical_parameters(module: torch.nn.Module, spec: CriticalSpec) -> set[int]:
    """``id``s of ``module``'s parameters that ``spec`` marks critical (see the module docstring)."""
    if spec is None:
        return set()
    marked: set[int] = set()
    if isinstance(spec, str) and spec == DEFAULT_CRITICAL:
        for _, owner in module.named_modules():
            for local, param in owner.named_parameters(recurse=False):
                if is_default_critical(owner, local):
                    marked.add(id(param))
        return marked
    if callable(spec):
        predicate = spec
    else:
        patterns = [spec] if isinstance(spec, str) else list(spec)
        if not all(isinstance(p, str) for p in patterns):
            raise TypeError(f"critical= takes 'default', globs or a predicate (name, param), not {spec!r}")

        def predicate(name: str, param: torch.nn.Parameter) -> bool:
            return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    for name, param in module.named_parameters():
        if predicate(name, param):
            marked.add(id(param))
    return marked


def flat_ranges(params: Iterable[torch.Tensor], marked: set[int]) -> list[tuple[int, int]]:
    """Value ranges ``[start, stop)`` of the marked parameters when ``params`` lie end to end (the
    order of ``parameters_to_vector`` and of :class:`~hostlib.torch_ext.flat.FlatParams`)."""
    ranges, offset = [], 0
    for p in params:
        if id(p) in marked:
            ranges.append((offset, offset + p.numel()))
        offset += p.numel()
    return ranges


def chunk_mask(ranges: Sequence[tuple[int, int]], n_chunks: int, k: int) -> np.ndarray:
    """Chunks (K values each, ``n_chunks`` of them) that hold any value of ``ranges``."""
    mask = np.zeros(n_chunks, dtype=bool)
    for lo, hi in ranges:
        if hi > lo:
            mask[lo // k : (hi - 1) // k + 1] = True
    return mask


def describe(mask: np.ndarray, numel: int, k: int) -> dict[str, Any]:
    """How much of a model the marking covers: chunks, and values carried in them."""
    return {
        "critical_chunks": int(mask.sum()),
        "chunks": len(mask),
        "critical_values_share": float(min(int(mask.sum()) * k, numel) / max(numel, 1)),
    }
