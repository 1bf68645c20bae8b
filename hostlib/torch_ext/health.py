"""Public health and statistics of an LTA group, whichever way a training loop uses it.

    dist.init_process_group("lta")
    ...
    loss.backward(); optimizer.step()
    if not should_commit():          # some reduce of this step got (almost) nothing from the network
        restore_last_checkpoint()    # or skip the step, or log it
    print(lta_stats()["chunks_partial"])

``should_commit``/``step_healthy`` look at every lossy reduce since the previous call (torchft's
per-step signal); unhealthy means at least ``TransportConfig.unhealthy_fraction`` of a reduce's
chunks came back with no aggregate, or the reduce ended with this rank locked out of its peers' rounds
(``TransportConfig.lockout_fraction``). A *run* of unhealthy reduces raises ``UnhealthyTraining`` by
itself (``LTA_ON_UNHEALTHY``). ``join_default_group`` gives the DDP comm hook and the sharded optimizer
a worker from the default process group's store, without reaching for torch's private helpers.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hostlib.torch_ext.manager import LtaManager
from hostlib.torch_ext.rendezvous import LtaOptions, LtaSession, join_job
from hostlib.transport import LtaWorker


def _resolve(group: Any) -> Any:
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("no default process group: call dist.init_process_group('lta') first")
        return dist.group.WORLD
    return group


def _manager_of(group: Any) -> LtaManager | None:
    """The LtaManager behind ``group`` (itself, or a wrapper's ``.manager``), if any."""
    if isinstance(group, LtaManager):
        return group
    manager = getattr(group, "manager", None)
    return manager if isinstance(manager, LtaManager) else None


def _worker_of(group: Any = None) -> LtaWorker:
    """The LtaWorker behind ``group``: None (the default group), an lta ProcessGroup, an LtaManager, an
    object with a ``.manager`` or a ``.worker`` (LtaHookState, ShardedOptimizer, LtaSession) or an
    LtaWorker."""
    if isinstance(group, LtaWorker):
        return group
    group = _resolve(group)
    manager = _manager_of(group)
    if manager is not None and manager.has_worker:
        return manager.worker
    worker = getattr(group, "worker", None)
    if worker is None and isinstance(group, dist.ProcessGroup):
        try:
            worker = getattr(group._get_backend(torch.device("cpu")), "worker", None)
        except RuntimeError:
            worker = None
    if not isinstance(worker, LtaWorker):
        raise TypeError(
            f"{type(group).__name__} is not an lta group: pass the group of init_process_group('lta'), "
            "an LtaManager, an LtaHookState, a ShardedOptimizer or an LtaWorker"
        )
    return worker


def lta_stats(group: Any = None) -> dict[str, Any]:
    """The worker's running totals (``TransportStats.as_dict()``) plus its health: chunks full,
    partial, empty or without RESULT, fallbacks used, packets, reduce times (p50/p99). For an lta
    process group, ``collectives`` has one row per collective (allreduce, reduce_scatter, all_gather):
    calls lossy and reliable, chunks, loss seen, and for the all-gather the stale copies handed out,
    the oldest copy's age (``max_age``, calls of its key, never above ``stale_bound``) and resyncs; for
    another wrapper of an LtaManager (the DDP hook: ``ddp``; the sharded optimizer: ``sharded``) the rows
    of its manager. For a PSOptimizer (or its manager): the parameter-server client's counters."""
    source = group if isinstance(group, LtaWorker) else _resolve(group)
    manager = _manager_of(source)
    if manager is not None and not manager.has_worker and not isinstance(source, dist.ProcessGroup):
        return manager.stats()  # a parameter-server client's
    worker = _worker_of(source)
    out = worker.stats.as_dict()
    out["healthy"] = worker.healthy
    out["last_nothing_fraction"] = worker.last_nothing_fraction
    per_collective = getattr(source, "collective_stats", None)
    if per_collective is not None:
        out["collectives"] = per_collective()
    elif manager is not None and manager.streams:
        out["collectives"] = manager.collective_stats()
    return out


def should_commit(group: Any = None) -> bool:
    """True when no lossy reduce since the previous call came back (almost) empty; resets the window."""
    return not _worker_of(group).unhealthy_since_mark(reset=True)


step_healthy = should_commit


def join_default_group(
    options: LtaOptions | None = None, *, prefix: str = "lta-hook", timeout: timedelta | None = None
) -> LtaSession:
    """Join an LTA job through the store of the default process group (any backend, e.g. gloo), for
    the DDP comm hook or the sharded optimizer: ``LtaHookState(join_default_group().worker)``."""
    if not dist.is_initialized():
        raise RuntimeError("join_default_group needs dist.init_process_group(...) first")
    store = dist.distributed_c10d._get_default_store()
    return join_job(
        dist.PrefixStore(prefix, store),
        dist.get_rank(),
        dist.get_world_size(),
        options or LtaOptions.from_env(),
        timeout,
    )


def rejoin_default_group(
    store: Any,
    rank: int,
    world_size: int,
    options: LtaOptions | None = None,
    *,
    prefix: str = "lta-hook",
    timeout: timedelta | None = None,
    default_group_name: str = "0",
) -> LtaSession:
    """A rank restarted into a running job whose ranks joined with :func:`join_default_group`: it cannot
    join their default group again (its membership is fixed at init), so it rejoins the LTA job through
    the store that group was built over (``store``: the same FileStore or TCPStore, passed to
    ``init_process_group`` or built from its init method), binding the address its first process had.
    Then take the peers' state (``LtaHookState.rejoin()``, ``ShardedOptimizer.rejoin()``)."""
    options = options or LtaOptions.from_env()
    # join_default_group's keys sit under the default group's store: ``store`` prefixed with the
    # group's name ("0", the first group made), and before that with "default_pg" when
    # init_process_group built the store from an init method (env://) rather than being passed one.
    ready = f"lta/job{options.job_id}/ready"
    group = f"{default_group_name}/"
    for base in (
        dist.PrefixStore(group, store),
        dist.PrefixStore(group, dist.PrefixStore("default_pg", store)),
        store,
    ):
        lta_store = dist.PrefixStore(prefix, base)
        if lta_store.check([ready]):
            break
    return join_job(lta_store, rank, world_size, options, timeout, rejoin=True)
