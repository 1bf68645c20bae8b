"""What a training loop touches: a DDP comm hook, a sharded optimizer (the paper's Algorithm 1), a
torch.distributed backend ("lta") and the ``lta train`` job.

Importing this package registers the ``"lta"`` backend name with torch.distributed (as torch's
``torch.backends`` entry point does on ``import torch``, see ``entry.py``), so it imports torch; the
modules behind the names below are imported lazily, when a name is first used:

    from hostlib.torch_ext import LtaManager, ShardedOptimizer, LtaHookState, lta_hook, register_backend
"""

from __future__ import annotations

import importlib
from typing import Any

from hostlib.torch_ext import entry as _entry

_EXPORTS = {
    "ShardedOptimizer": "hostlib.torch_ext.sharded",
    "LtaManager": "hostlib.torch_ext.manager",
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
    "StaleGather": "hostlib.torch_ext.gather",
    "step_boundary": "hostlib.torch_ext.callkeys",
    "lta_stats": "hostlib.torch_ext.health",
    "should_commit": "hostlib.torch_ext.health",
    "step_healthy": "hostlib.torch_ext.health",
    "join_default_group": "hostlib.torch_ext.health",
    "rejoin_default_group": "hostlib.torch_ext.health",
    "Healer": "hostlib.torch_ext.heal",
    "DropComputeAccumulator": "hostlib.torch_ext.dropcompute",
    "choose_threshold": "hostlib.torch_ext.dropcompute",
    "save_shard": "hostlib.torch_ext.checkpoint",
    "load_shard": "hostlib.torch_ext.checkpoint",
}

__all__ = [*_EXPORTS, "register_backend"]


def register_backend() -> None:
    """Make ``"lta"`` a torch.distributed backend (``init_process_group("lta")``); idempotent. Importing
    this package has done it already; this call raises where it could not (no torch.distributed)."""
    _entry.register()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hostlib.torch_ext' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


# Registers "lta" (never raises: a failure is logged, and register_backend() raises it).
_entry.autoload()
