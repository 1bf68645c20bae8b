"""What a training loop touches: a DDP comm hook, a sharded optimizer (the paper's Algorithm 1), a
torch.distributed backend ("lta") and the ``lta train`` job.

Names are imported lazily so that ``lta`` subcommands that do not train never import torch:

    from hostlib.torch_ext import ShardedOptimizer, LtaHookState, lta_hook, register_backend
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ShardedOptimizer": "hostlib.torch_ext.sharded",
    "LtaHookState": "hostlib.torch_ext.ddp_hook",
    "lta_hook": "hostlib.torch_ext.ddp_hook",
    "ParamExchange": "hostlib.torch_ext.exchange",
    "ShardLayout": "hostlib.torch_ext.layout",
    "HostMirror": "hostlib.torch_ext.staging",
    "DriftMonitor": "hostlib.torch_ext.drift",
    "paper_drift": "hostlib.torch_ext.drift",
    "iid_drift": "hostlib.torch_ext.drift",
    "receiver_pair_drift": "hostlib.torch_ext.drift",
    "LtaOptions": "hostlib.torch_ext.rendezvous",
    "join_job": "hostlib.torch_ext.rendezvous",
    "ProcessGroupLta": "hostlib.torch_ext.backend",
}

__all__ = [*_EXPORTS, "register_backend"]


def register_backend() -> None:
    """Make ``"lta"`` a torch.distributed backend (``init_process_group("lta")``)."""
    importlib.import_module("hostlib.torch_ext.backend").register()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hostlib.torch_ext' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
