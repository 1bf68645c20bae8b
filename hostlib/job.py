"""What a job is, checked once: the one job type every side builds (:class:`Job`), and the one pool rule
(:func:`pool_size`).

A job is the same thing to the switch (``softswitch.pipeline.JobConfig``), the control plane
(``controlplane.jobs.JobSpec``), the jobs file (:class:`hostlib.jobconfig.JobEntry`), the parameter
server (``softswitch.ps.config.PsJobConfig``) and the torch rendezvous
(:class:`hostlib.torch_ext.rendezvous.JobRequest`): an id, N workers, a role in a leaf/spine tree, a
quorum and a pool of slots. Each of those keeps what only it needs (port numbers, addresses, drop
tables, optimizer settings) and builds a :class:`Job` for the rest, so the rules below are written here
alone. Standard library and :mod:`hostlib.protocol` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hostlib.protocol import (
    DEFAULT_ELEMS_PER_PACKET,
    MAX_JOBS,
    MAX_LEAVES,
    MAX_WORKERS,
    Role,
    check_elems_per_packet,
    default_pool_size,
)

MAX_POOL_SIZE = 65535  # slot indices are 16 bits on the wire
# The fewest slots a job may have: one on a switch; two for a worker, which keeps its pool's last slot
# for the health probe (hostlib.transport.health) and needs at least one slot for its units.
MIN_POOL_SIZE = 1
MIN_WORKER_POOL_SIZE = 2


def pool_size(requested: int | None, elems_per_packet: int, *, minimum: int = MIN_POOL_SIZE) -> int:
    """The pool of a job: ``requested``, or where it is None or 0 the default for K (hostlib.protocol.
    default_pool_size: 2048, 512 above 1024 values a packet; hosts and switches resolve it alike), checked
    to lie in ``minimum``..65535 (:data:`MIN_POOL_SIZE` on a switch, :data:`MIN_WORKER_POOL_SIZE` on a
    worker)."""
    size = default_pool_size(elems_per_packet) if not requested else requested
    if not minimum <= size <= MAX_POOL_SIZE:
        why = " (slot P-1 is the probe's)" if minimum == MIN_WORKER_POOL_SIZE else ""
        raise ValueError(f"pool_size must be in {minimum}..{MAX_POOL_SIZE}{why}, got {size}")
    return size


def check_job_id(job_id: int) -> int:
    """``job_id`` if it is a valid job id (1..MAX_JOBS-1; 0 is no job)."""
    if not 1 <= job_id < MAX_JOBS:
        raise ValueError(f"job_id must be in 1..{MAX_JOBS - 1}, got {job_id}")
    return job_id


def check_worker_count(job_id: int, n_workers: int) -> int:
    """``n_workers`` if a job may have that many (1..MAX_WORKERS)."""
    if not 1 <= n_workers <= MAX_WORKERS:
        raise ValueError(f"job {job_id} needs 1..{MAX_WORKERS} workers, got {n_workers}")
    return n_workers


@dataclass(frozen=True)
class Job:
    """One aggregation job as every side sees it, checked when built (:meth:`of`).

    ``served``: the worker ids the switch holding this job serves (replicas go to them): all of them,
    but for a LEAF the workers behind other leaves are not served (they are global ids of the same job).
    A SPINE's workers are its leaves. ``quorum`` counts served workers (leaves, for a spine) and is
    resolved (never None); ``pool_size`` is resolved by :func:`pool_size`."""

    job_id: int
    n_workers: int
    served: tuple[int, ...]
    quorum: int
    pool_size: int
    elems_per_packet: int = DEFAULT_ELEMS_PER_PACKET
    role: Role = Role.FLAT
    leaf_id: int = 0

    @classmethod
    def of(
        cls,
        job_id: int,
        workers: Sequence[object | None],
        *,
        quorum: int | None = None,
        pool_size: int | None = None,
        elems_per_packet: int = DEFAULT_ELEMS_PER_PACKET,
        role: Role | int = Role.FLAT,
        uplink: object | None = None,
        leaf_id: int = 0,
        only_leaf_uplink: bool = False,
    ) -> Job:
        """The job of these fields, or ValueError naming the first rule they break: the id, the worker
        count, the tree (a LEAF needs an ``uplink`` and a ``leaf_id`` below MAX_LEAVES and alone may
        leave workers out, None: behind another leaf; a SPINE has at most MAX_LEAVES leaves), the quorum
        (1..served workers; None: all of them), K and the pool. ``only_leaf_uplink``: an uplink or a
        leaf_id on a job that is no leaf is an error too (the control plane's entries would carry them
        to the switch; the softswitch ignores them)."""
        check_job_id(job_id)
        check_worker_count(job_id, len(workers))
        role = Role(role)
        if role == Role.LEAF:
            if uplink is None:
                raise ValueError(f"job {job_id}: a leaf needs an uplink (the spine's address or port)")
            if not 0 <= leaf_id < MAX_LEAVES:
                raise ValueError(f"job {job_id}: leaf_id must be in 0..{MAX_LEAVES - 1}, got {leaf_id}")
        elif only_leaf_uplink and (uplink is not None or leaf_id):
            raise ValueError(f"job {job_id}: only a leaf has an uplink and a leaf_id")
        elif None in workers:
            raise ValueError(f"job {job_id}: only a leaf may leave workers out (None: behind another leaf)")
        if role == Role.SPINE and len(workers) > MAX_LEAVES:
            raise ValueError(f"job {job_id}: a spine has at most {MAX_LEAVES} leaves, got {len(workers)}")
        served = tuple(w for w, worker in enumerate(workers) if worker is not None)
        if not served:
            raise ValueError(f"job {job_id}: no worker is served here (every entry is None)")
        local = len(served)
        if quorum is not None and not 1 <= quorum <= local:
            raise ValueError(f"job {job_id}: quorum must be in 1..{local}, got {quorum}")
        check_elems_per_packet(elems_per_packet)
        try:
            pool = _pool_size(pool_size, elems_per_packet)
        except ValueError as exc:
            raise ValueError(f"job {job_id}: {exc}") from None
        return cls(
            job_id=job_id,
            n_workers=len(workers),
            served=served,
            quorum=local if quorum is None else quorum,
            pool_size=pool,
            elems_per_packet=elems_per_packet,
            role=role,
            leaf_id=leaf_id if role == Role.LEAF else 0,
        )


_pool_size = pool_size  # (Job.of has a parameter of that name)
