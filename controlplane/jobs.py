"""A job as the switch sees it, and the table entries that configure it: the job lookup entry
(p4/v1model/job_lookup.p4), one worker-port entry and one worker-address entry per worker
(worker_check.p4, worker_address.p4) and a multicast group whose replica i goes to worker i's port
with egress_rid = i (result_emit.p4, egress.p4)."""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass, field

from p4.v1 import p4runtime_pb2

from hostlib.p4schema import (
    EXPECT_PORT,
    JOBS_TABLE,
    SET_ADDRESS,
    SET_JOB,
    WORKER_ADDRESSES_TABLE,
    WORKER_PORTS_TABLE,
    Entry,
)
from hostlib.protocol import LTA_PORT, MAX_JOBS, MAX_WORKERS

DEFAULT_POOL_SIZE = 512


@dataclass(frozen=True)
class WorkerSpec:
    """Where worker ``w`` of a job is: the switch port it sends from (checked on every packet) and the
    addresses RESULT and PARAM packets are sent to."""

    port: int
    mac: str = "02:00:00:00:00:01"
    ip: str = "10.0.0.1"
    udp_port: int = LTA_PORT

    def __post_init__(self) -> None:
        if not 0 <= self.port < 511:
            raise ValueError(f"worker port must be in 0..510 (511 is BMv2's drop port), got {self.port}")
        mac_bytes(self.mac)
        ipaddress.IPv4Address(self.ip)
        if not 0 < self.udp_port < 65536:
            raise ValueError(f"udp_port must be in 1..65535, got {self.udp_port}")

    @classmethod
    def from_dict(cls, spec: dict) -> WorkerSpec:
        unknown = set(spec) - {"port", "mac", "ip", "udp_port"}
        if unknown:
            raise ValueError(f"unknown worker keys {sorted(unknown)}; allowed: port, mac, ip, udp_port")
        return cls(**spec)


@dataclass(frozen=True)
class JobSpec:
    """One aggregation job. ``slot_base`` None lets the control plane place the pool; ``generation``
    is chosen by the control plane (a new one resets every slot of the job)."""

    job_id: int
    workers: tuple[WorkerSpec, ...]
    quorum: int | None = None
    pool_size: int = DEFAULT_POOL_SIZE
    slot_base: int | None = None
    generation: int = field(default_factory=lambda: new_generation())

    def __post_init__(self) -> None:
        if not 1 <= self.job_id < MAX_JOBS:
            raise ValueError(f"job_id must be in 1..{MAX_JOBS - 1}, got {self.job_id}")
        if not 1 <= len(self.workers) <= MAX_WORKERS:
            raise ValueError(f"job {self.job_id} needs 1..{MAX_WORKERS} workers, got {len(self.workers)}")
        if self.quorum is not None and not 1 <= self.quorum <= len(self.workers):
            raise ValueError(
                f"job {self.job_id}: quorum must be in 1..{len(self.workers)}, got {self.quorum}"
            )
        if not 1 <= self.pool_size <= 65535:
            raise ValueError(f"job {self.job_id}: pool_size must be in 1..65535, got {self.pool_size}")

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @property
    def mcast_grp(self) -> int:
        return self.job_id  # one multicast group per job, numbered like the job


def new_generation() -> int:
    return secrets.randbelow(0xFFFFFFFF) + 1  # never 0, the value of never-written slot registers


def mac_bytes(mac: str) -> bytes:
    parts = mac.split(":")
    if len(parts) != 6:
        raise ValueError(f"{mac!r} is not a MAC address like 02:00:00:00:00:01")
    return bytes(int(p, 16) for p in parts)


def mac_str(value: int) -> str:
    return ":".join(f"{b:02x}" for b in value.to_bytes(6, "big"))


def job_entry(job: JobSpec) -> Entry:
    assert job.slot_base is not None, "place the job's slot pool first"
    params = {
        "n_workers": job.n_workers,
        "quorum": job.quorum or job.n_workers,
        "pool_size": job.pool_size,
        "slot_base": job.slot_base,
        "mcast_grp": job.mcast_grp,
        "generation": job.generation,
    }
    return Entry(JOBS_TABLE, {"job_id": job.job_id}, SET_JOB, params)


def worker_entries(job: JobSpec) -> list[Entry]:
    entries = []
    for w, worker in enumerate(job.workers):
        key = {"job_id": job.job_id, "worker_id": w}
        entries.append(Entry(WORKER_PORTS_TABLE, key, EXPECT_PORT, {"port": worker.port}))
        address = {
            "mac": int.from_bytes(mac_bytes(worker.mac), "big"),
            "ipv4": int(ipaddress.IPv4Address(worker.ip)),
            "udp_port": worker.udp_port,
        }
        entries.append(Entry(WORKER_ADDRESSES_TABLE, key, SET_ADDRESS, address))
    return entries


def multicast_group(job: JobSpec) -> p4runtime_pb2.PacketReplicationEngineEntry:
    pre = p4runtime_pb2.PacketReplicationEngineEntry()
    group = pre.multicast_group_entry
    group.multicast_group_id = job.mcast_grp
    for w, worker in enumerate(job.workers):
        group.replicas.add(egress_port=worker.port, instance=w)
    return pre


def place_pool(pool_size: int, used: list[tuple[int, int]], capacity: int) -> int:
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
