"""A job as the switch sees it, and the table entries that configure it: the job lookup entry
(p4/v1model/job_lookup.p4), one worker-port entry and one worker-address entry per worker
(worker_check.p4, worker_address.p4) and a multicast group whose replica i goes to worker i's port
with egress_rid = i (result_emit.p4, egress.p4)."""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hostlib import jobentries
from hostlib.jobconfig import DEFAULT_POOL_SIZE, MAX_SWITCH_PORT, WorkerEntry, format_mac, parse_mac
from hostlib.jobentries import place_pool
from hostlib.p4schema import Entry
from hostlib.protocol import LTA_PORT, MAX_JOBS, MAX_WORKERS

if TYPE_CHECKING:
    from p4.v1 import p4runtime_pb2

__all__ = [
    "DEFAULT_POOL_SIZE",
    "JobSpec",
    "WorkerSpec",
    "check_distinct_addresses",
    "job_entry",
    "mac_bytes",
    "mac_str",
    "multicast_group",
    "new_generation",
    "place_pool",
    "worker_entries",
]


@dataclass(frozen=True)
class WorkerSpec:
    """Where worker ``w`` of a job is: the switch port it sends from (checked on every packet) and the
    addresses RESULT and PARAM packets are sent to."""

    port: int
    mac: str = "02:00:00:00:00:01"
    ip: str = "10.0.0.1"
    udp_port: int = LTA_PORT

    def __post_init__(self) -> None:
        if not 0 <= self.port <= MAX_SWITCH_PORT:
            raise ValueError(
                f"worker port must be in 0..{MAX_SWITCH_PORT} ({MAX_SWITCH_PORT + 1} is BMv2's drop port), "
                f"got {self.port}"
            )
        parse_mac(self.mac)
        try:
            ipaddress.IPv4Address(self.ip)
        except ValueError:
            raise ValueError(f"ip {self.ip!r} is not an IPv4 address") from None
        if not 0 < self.udp_port < 65536:
            raise ValueError(f"udp_port must be in 1..65535, got {self.udp_port}")

    @classmethod
    def from_entry(cls, entry: WorkerEntry, w: int) -> WorkerSpec:
        """Worker ``w`` of a jobs file: the switch port must be given (a P4 switch checks it on every
        packet); ip, mac and udp_port left out take ``hostlib.jobconfig.default_worker(w)``."""
        if entry.port is None:
            raise ValueError(
                f"worker {w} needs its switch port (port = N): the switch checks it on every packet"
            )
        full = entry.filled(w)
        assert full.ip is not None and full.mac is not None and full.udp_port is not None
        return cls(entry.port, mac=full.mac, ip=full.ip, udp_port=full.udp_port)

    def entry(self) -> WorkerEntry:
        return WorkerEntry(ip=self.ip, udp_port=self.udp_port, port=self.port, mac=self.mac)


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
        return jobentries.multicast_group_id(self.job_id)


def check_distinct_addresses(workers: tuple[WorkerSpec, ...]) -> None:
    """Refuse two workers with one (ip, udp_port): RESULTs for both would go to one socket."""
    seen: dict[tuple[str, int], int] = {}
    for w, worker in enumerate(workers):
        address = (worker.ip, worker.udp_port)
        if address in seen:
            raise ValueError(
                f"workers {seen[address]} and {w} both have address {worker.ip}:{worker.udp_port}"
            )
        seen[address] = w


def new_generation() -> int:
    return secrets.randbelow(0xFFFFFFFF) + 1  # never 0, the value of never-written slot registers


def mac_bytes(mac: str) -> bytes:
    return parse_mac(mac)


def mac_str(value: int) -> str:
    return format_mac(value.to_bytes(6, "big"))


def job_entry(job: JobSpec) -> Entry:
    assert job.slot_base is not None, "place the job's slot pool first"
    return jobentries.job_lookup_entry(
        job.job_id, job.n_workers, job.quorum or job.n_workers, job.pool_size, job.slot_base, job.generation
    )


def worker_entries(job: JobSpec) -> list[Entry]:
    return jobentries.worker_entries(job.job_id, [w.entry() for w in job.workers])


def multicast_group(job: JobSpec) -> p4runtime_pb2.PacketReplicationEngineEntry:
    from p4.v1 import p4runtime_pb2  # late: building jobs needs no gRPC/protobuf

    pre = p4runtime_pb2.PacketReplicationEngineEntry()
    group = pre.multicast_group_entry
    group.multicast_group_id = job.mcast_grp
    for w, worker in enumerate(job.workers):
        group.replicas.add(egress_port=worker.port, instance=w)
    return pre
