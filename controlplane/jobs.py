"""A job as the switch sees it, and the table entries that configure it: the job lookup entry
(p4/v1model/job_lookup.p4), one worker-port entry and one worker-address entry per worker
(worker_check.p4, worker_address.p4) and a multicast group whose replica i goes to worker i's port
with egress_rid = i (result_emit.p4, egress.p4). A leaf or spine job (docs/protocol.md, "Hierarchy")
adds its job-role entry, and a leaf its uplink's address; a leaf has entries, and replicas, only for
the workers it serves."""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hostlib.job import Job
from hostlib.jobconfig import DEFAULT_POOL_SIZE, MAX_SWITCH_PORT, WorkerEntry, format_mac, parse_mac
from hostlib.p4 import jobentries
from hostlib.p4.jobentries import place_pool
from hostlib.p4.schema import Entry
from hostlib.protocol import DEFAULT_ELEMS_PER_PACKET, LTA_PORT, Role

if TYPE_CHECKING:
    from hostlib.p4.proto import p4runtime_pb2

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
    "role_entries",
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
    is chosen by the control plane (a new one resets every slot of the job).

    ``role`` (docs/protocol.md, "Hierarchy"): a LEAF serves the workers whose entry is not None (the
    others, global worker ids of the same job, sit behind other leaves) and sends closed rounds to
    ``uplink`` (the spine: switch port and address) as contributor ``leaf_id``; a SPINE's workers are
    its leaves (entry l: leaf l's port and address). The quorum counts the workers (leaves) served here."""

    job_id: int
    workers: tuple[WorkerSpec | None, ...]
    quorum: int | None = None
    pool_size: int = DEFAULT_POOL_SIZE
    slot_base: int | None = None
    generation: int = field(default_factory=lambda: new_generation())
    role: Role = Role.FLAT
    uplink: WorkerSpec | None = None
    leaf_id: int = 0

    def __post_init__(self) -> None:
        job = Job.of(
            self.job_id,
            self.workers,
            quorum=self.quorum,
            pool_size=self.pool_size,
            elems_per_packet=DEFAULT_ELEMS_PER_PACKET,  # a P4 switch runs its compiled K
            role=self.role,
            uplink=self.uplink,
            leaf_id=self.leaf_id,
            only_leaf_uplink=True,
        )
        object.__setattr__(self, "role", job.role)
        object.__setattr__(self, "pool_size", job.pool_size)

    @property
    def n_workers(self) -> int:
        """Worker ids 0..n_workers-1 are valid (a leaf's include those served by other leaves)."""
        return len(self.workers)

    @property
    def local(self) -> list[int]:
        """The worker ids served here (replicas go to them): all but a leaf's None entries."""
        return [w for w, worker in enumerate(self.workers) if worker is not None]

    @property
    def mcast_grp(self) -> int:
        return jobentries.multicast_group_id(self.job_id)


def check_distinct_addresses(workers: tuple[WorkerSpec | None, ...]) -> None:
    """Refuse two workers with one (ip, udp_port): RESULTs for both would go to one socket."""
    seen: dict[tuple[str, int], int] = {}
    for w, worker in enumerate(workers):
        if worker is None:
            continue
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
        job.job_id, job.n_workers, job.quorum or len(job.local), job.pool_size, job.slot_base, job.generation
    )


def worker_entries(job: JobSpec) -> list[Entry]:
    return jobentries.worker_entries(job.job_id, [None if w is None else w.entry() for w in job.workers])


def role_entries(job: JobSpec) -> list[Entry]:
    """The job-role entry (none for a flat job) and a leaf's uplink address."""
    uplink = None if job.uplink is None else job.uplink.entry()
    return jobentries.role_entries(job.job_id, job.role, job.leaf_id, uplink)


def multicast_group(job: JobSpec) -> p4runtime_pb2.PacketReplicationEngineEntry:
    from hostlib.p4.proto import p4runtime_pb2  # late: building jobs needs no gRPC/protobuf

    pre = p4runtime_pb2.PacketReplicationEngineEntry()
    group = pre.multicast_group_entry
    group.multicast_group_id = job.mcast_grp
    for w, worker in enumerate(job.workers):
        if worker is not None:  # a leaf replicates to its own workers only
            group.replicas.add(egress_port=worker.port, instance=w)
    return pre
