"""How a job is written into the P4 program's tables: one job-lookup entry (p4/v1model/job_lookup.p4),
and per worker w one worker-port entry (worker_check.p4) and one worker-address entry
(worker_address.p4); the job's multicast group is numbered like the job and replica w goes to worker
w's port (result_emit.p4, egress.p4). A leaf or spine job (docs/protocol.md, "Hierarchy") also has a
job-role entry, and a leaf the address of its uplink (worker-address key ``UPLINK_WORKER_ID``); a leaf
has entries only for the workers it serves.

``controlplane`` writes these entries over P4Runtime; the softswitch's P4Runtime server writes the same
ones for the jobs of its ``--config`` file, as if a controller had, so ``lta ctl`` sees every job the
same way. Standard library and :mod:`hostlib` only, like :mod:`hostlib.p4.schema`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from hostlib.jobconfig import WorkerEntry, parse_mac
from hostlib.p4.schema import (
    EXPECT_PORT,
    JOB_ROLES_TABLE,
    JOBS_TABLE,
    SET_ADDRESS,
    SET_JOB,
    SET_LEAF,
    SET_SPINE,
    UPLINK_WORKER_ID,
    WORKER_ADDRESSES_TABLE,
    WORKER_PORTS_TABLE,
    Entry,
)
from hostlib.protocol import MAX_LEAVES, Role


def multicast_group_id(job_id: int) -> int:
    """One multicast group per job, numbered like the job (group 0 is reserved, job ids start at 1)."""
    return job_id


def job_lookup_entry(
    job_id: int, n_workers: int, quorum: int, pool_size: int, slot_base: int, generation: int
) -> Entry:
    """The job-lookup entry: a packet of ``job_id`` is accepted once this is in place."""
    params = {
        "n_workers": n_workers,
        "quorum": quorum,
        "pool_size": pool_size,
        "slot_base": slot_base,
        "mcast_grp": multicast_group_id(job_id),
        "generation": generation,
    }
    return Entry(JOBS_TABLE, {"job_id": job_id}, SET_JOB, params)


def _address(job_id: int, worker_id: int, worker: WorkerEntry, what: str) -> Entry:
    if worker.port is None or worker.ip is None or worker.mac is None or worker.udp_port is None:
        raise ValueError(f"job {job_id} {what}: port, ip, mac and udp_port are all needed, got {worker}")
    address = {
        "mac": int.from_bytes(parse_mac(worker.mac), "big"),
        "ipv4": int(ipaddress.IPv4Address(worker.ip)),
        "udp_port": worker.udp_port,
    }
    return Entry(WORKER_ADDRESSES_TABLE, {"job_id": job_id, "worker_id": worker_id}, SET_ADDRESS, address)


def worker_entries(job_id: int, workers: Sequence[WorkerEntry | None]) -> list[Entry]:
    """Worker w's port entry (checked on every packet) and address entry (where replicas go), for
    every worker but a leaf's None (served by another leaf); each must have all four fields
    (:meth:`WorkerEntry.filled`)."""
    entries = []
    for w, worker in enumerate(workers):
        if worker is None:
            continue
        address = _address(job_id, w, worker, f"worker {w}")
        assert worker.port is not None
        key = {"job_id": job_id, "worker_id": w}
        entries.append(Entry(WORKER_PORTS_TABLE, key, EXPECT_PORT, {"port": worker.port}))
        entries.append(address)
    return entries


def role_entries(job_id: int, role: Role, leaf_id: int = 0, uplink: WorkerEntry | None = None) -> list[Entry]:
    """A job's role entry (none for a flat job); a leaf's also the address of its ``uplink`` (the
    spine: its switch port toward it, and the MAC, IPv4 and UDP port its partials are sent to)."""
    role = Role(role)
    if role == Role.FLAT:
        return []
    key = {"job_id": job_id}
    if role == Role.SPINE:
        return [Entry(JOB_ROLES_TABLE, key, SET_SPINE, {})]
    if uplink is None:
        raise ValueError(f"job {job_id}: a leaf needs its uplink (the spine's port and address)")
    if not 0 <= leaf_id < MAX_LEAVES:
        raise ValueError(f"job {job_id}: leaf_id must be in 0..{MAX_LEAVES - 1}, got {leaf_id}")
    address = _address(job_id, UPLINK_WORKER_ID, uplink, "uplink")
    assert uplink.port is not None
    return [Entry(JOB_ROLES_TABLE, key, SET_LEAF, {"uplink_port": uplink.port, "leaf_id": leaf_id}), address]


def place_pool(pool_size: int, used: Sequence[tuple[int, int]], capacity: int) -> int:
    """The first slot base where ``pool_size`` slots fit between the (base, size) ranges in ``used``."""
    base = 0
    for start, size in sorted(used):
        if base + pool_size <= start:
            return base
        base = max(base, start + size)
    if base + pool_size <= capacity:
        return base
    free = capacity - sum(size for _, size in used)
    raise ValueError(
        f"no room for a pool of {pool_size} slots: the switch holds {capacity} slots and {free} are free "
        f"(in pieces); use a smaller pool_size or remove a job (lta ctl job rm ID)"
    )


Pool = tuple[int, int, int]  # (job_id, slot_base, pool_size) of a placed pool


def check_pool(job_id: int, base: int, pool_size: int, used: Sequence[Pool], capacity: int) -> None:
    """Refuse a pinned pool that runs past the switch's slots or overlaps another job's pool: two jobs
    writing the same slot registers would corrupt each other's sums."""
    last = base + pool_size - 1
    if base + pool_size > capacity:
        raise ValueError(
            f"job {job_id}: slots {base}..{last} exceed the switch's {capacity} slots; "
            f"lower slot_base or pool_size"
        )
    for other, start, size in used:
        if base < start + size and start < base + pool_size:
            raise ValueError(
                f"job {job_id}: slots {base}..{last} overlap job {other}'s slots "
                f"{start}..{start + size - 1}; choose another slot_base"
            )


def place_pools(
    pools: Sequence[tuple[int, int | None, int]], used: Sequence[Pool], capacity: int
) -> dict[int, int]:
    """Slot bases for ``(job_id, slot_base or None, pool_size)``: pinned pools where asked (checked by
    :func:`check_pool`), then the others in the first free slots, in order. ``used``: pools already placed."""
    placed = list(used)
    bases: dict[int, int] = {}
    for job_id, base, size in pools:
        if base is not None:
            check_pool(job_id, base, size, placed, capacity)
            placed.append((job_id, base, size))
            bases[job_id] = base
    for job_id, base, size in pools:
        if base is None:
            bases[job_id] = place_pool(size, [(start, n) for _, start, n in placed], capacity)
            placed.append((job_id, bases[job_id], size))
    return bases
