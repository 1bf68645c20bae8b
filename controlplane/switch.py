"""The control plane's one code path to an LTA switch (BMv2, Tofino later, or the softswitch's
P4Runtime server): load the pipeline, add / remove / reset jobs, set drop policies, read counters.

Nothing here reads or writes registers (BMv2 cannot over P4Runtime): a reset gives the job a new
generation in its job-lookup entry, so every slot written under the old one reads as unused, and
zeroes the job's counters.
"""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from pathlib import Path

from controlplane.errors import ControlPlaneError, PipelineMismatch
from controlplane.jobs import (
    JobSpec,
    WorkerSpec,
    job_entry,
    mac_str,
    multicast_group,
    new_generation,
    role_entries,
    worker_entries,
)
from controlplane.session import DEFAULT_TARGET, DEFAULT_TIMEOUT_S, P4RuntimeSession
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.p4 import info as p4info
from hostlib.p4.info import P4InfoMismatch, P4Names, load_p4info, missing_names, p4info_fingerprint
from hostlib.p4.jobentries import place_pools
from hostlib.p4.proto import p4runtime_pb2
from hostlib.p4.schema import (
    BMV2_JSON_PATH,
    JOB_ROLES_TABLE,
    JOBS_TABLE,
    P4INFO_PATH,
    POLICY_CONTROLS,
    SET_LEAF,
    SET_SPINE,
    UPLINK_WORKER_ID,
    WORKER_ADDRESSES_TABLE,
    WORKER_PORTS_TABLE,
    Entry,
    policy_entry,
    policy_of,
    policy_table,
)
from hostlib.protocol import COUNTERS, MAX_WORKERS, WORKER_COUNTER, Role, worker_counter_index


class LtaSwitch:
    """A connected switch. ``LtaSwitch.connect(target)`` opens the session; use it as a context manager."""

    def __init__(self, session: P4RuntimeSession, p4info_path: Path = P4INFO_PATH) -> None:
        self.session = session
        self.p4info_path = p4info_path
        try:
            self.names = P4Names(load_p4info(p4info_path))
        except P4InfoMismatch as exc:
            raise PipelineMismatch(str(exc)) from None

    @classmethod
    def connect(
        cls,
        target: str = DEFAULT_TARGET,
        device_id: int = 0,
        election_id: tuple[int, int] = (0, 1),
        timeout_s: float = DEFAULT_TIMEOUT_S,
        p4info_path: Path = P4INFO_PATH,
        read_only: bool = False,
    ) -> LtaSwitch:
        """Open a session; ``read_only`` skips the arbitration (monitors: stats, watch, listings)."""
        session = P4RuntimeSession(target, device_id, election_id, timeout_s, arbitrate=not read_only).open()
        try:
            return cls(session, p4info_path)
        except Exception:
            session.close()
            raise

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> LtaSwitch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def target(self) -> str:
        return self.session.target

    # ---- pipeline --------------------------------------------------------------------------------
    def load_pipeline(self, device_config_path: Path = BMV2_JSON_PATH) -> None:
        """Push our P4Info and the compiled program (BMv2 JSON); the softswitch accepts an empty one."""
        device_config = device_config_path.read_bytes() if device_config_path.exists() else b""
        self.session.set_pipeline(self.names.info, device_config)

    def check_pipeline(self) -> None:
        """Raise :class:`PipelineMismatch` unless the switch runs our P4Info."""
        running = self.session.get_p4info()
        if running is None:
            raise PipelineMismatch(
                f"switch at {self.target} has no pipeline loaded: run `lta ctl apply FILE` or "
                f"`lta ctl load` first"
            )
        if p4info_fingerprint(running) != p4info_fingerprint(self.names.info):
            missing = missing_names(running)
            detail = f"it lacks {', '.join(missing[:4])}" if missing else "it differs from ours"
            raise PipelineMismatch(
                f"switch at {self.target} runs another P4 program ({detail}; ours is {self.p4info_path}); "
                f"replace it with `lta ctl load --force` (this clears every job)"
            )

    def pipeline_state(self) -> str:
        """Which pipeline runs: "none" (not loaded), "ours" (our P4Info) or "other" (another program)."""
        running = self.session.get_p4info()
        if running is None:
            return "none"
        return "ours" if p4info_fingerprint(running) == p4info_fingerprint(self.names.info) else "other"

    def ensure_pipeline(self, device_config_path: Path = BMV2_JSON_PATH) -> bool:
        """Load our pipeline unless it is already running (loading clears all state); True if loaded."""
        try:
            self.check_pipeline()
            return False
        except PipelineMismatch:
            self.load_pipeline(device_config_path)
            return True

    # ---- tables ----------------------------------------------------------------------------------
    def _write(self, kind: str, items: list) -> None:
        updates = []
        for item in items:
            proto = (
                p4info.to_proto(self.names, item, with_action=kind != "DELETE")
                if isinstance(item, Entry)
                else item
            )
            updates.append(p4info.update(kind, proto))
        self.session.write(updates)

    def read_table(self, table: str) -> list[Entry]:
        found = self.session.read([p4info.table_wildcard(self.names, table)])
        return [p4info.from_proto(self.names, e.table_entry) for e in found]

    # ---- jobs ------------------------------------------------------------------------------------
    def jobs(self) -> dict[int, JobSpec]:
        """The jobs the switch holds, rebuilt from its tables."""
        ports: dict[tuple[int, int], int] = {}
        for e in self.read_table(WORKER_PORTS_TABLE):
            ports[(e.match["job_id"], e.match["worker_id"])] = e.params["port"]
        addresses: dict[tuple[int, int], dict] = {}
        for e in self.read_table(WORKER_ADDRESSES_TABLE):
            addresses[(e.match["job_id"], e.match["worker_id"])] = e.params
        has_roles = self.names.has_roles()  # a program without roles (Tofino) holds flat jobs only
        roles = {e.match["job_id"]: e for e in self.read_table(JOB_ROLES_TABLE)} if has_roles else {}

        def spec(job_id: int, w: int, port: int) -> WorkerSpec:
            a = addresses.get((job_id, w), {"mac": 0, "ipv4": 0, "udp_port": 1})
            return WorkerSpec(
                port=port,
                mac=mac_str(a["mac"]),
                ip=str(ipaddress.IPv4Address(a["ipv4"])),
                udp_port=a["udp_port"],
            )

        found = {}
        for e in self.read_table(JOBS_TABLE):
            job_id, p = e.match["job_id"], e.params
            role_entry = roles.get(job_id)
            role, uplink, leaf_id = Role.FLAT, None, 0
            if role_entry is not None and role_entry.action == SET_SPINE:
                role = Role.SPINE
            elif role_entry is not None and role_entry.action == SET_LEAF:
                role, leaf_id = Role.LEAF, role_entry.params["leaf_id"]
                uplink = spec(job_id, UPLINK_WORKER_ID, role_entry.params["uplink_port"])
            workers: list[WorkerSpec | None] = []
            for w in range(p["n_workers"]):
                if role == Role.LEAF and (job_id, w) not in ports:
                    workers.append(None)  # served by another leaf
                else:
                    workers.append(spec(job_id, w, ports.get((job_id, w), 0)))
            found[job_id] = JobSpec(
                job_id,
                tuple(workers),
                quorum=p["quorum"],
                pool_size=p["pool_size"],
                slot_base=p["slot_base"],
                generation=p["generation"],
                role=role,
                uplink=uplink,
                leaf_id=leaf_id,
            )
        return found

    def add_job(self, job: JobSpec) -> JobSpec:
        """Install a job (job lookup, worker ports and addresses, multicast group); returns it placed."""
        existing = self.jobs()
        if job.job_id in existing:
            raise ControlPlaneError(
                f"job {job.job_id} already exists on {self.target}; "
                f"remove it first (lta ctl job rm {job.job_id})"
            )
        if job.role != Role.FLAT and not self.names.has_roles():
            raise ControlPlaneError(
                f"job {job.job_id} is a {job.role.name.lower()}, but the program on {self.target} has no job "
                f'roles (docs/protocol.md, "Hierarchy": only p4/v1model has them)'
            )
        used = [(j.job_id, j.slot_base, j.pool_size) for j in existing.values()]
        # ValueError when the pool does not fit or overlaps another job's (a user error: lta ctl says so).
        base = place_pools([(job.job_id, job.slot_base, job.pool_size)], used, self.names.slot_capacity())
        job = replace(job, slot_base=base[job.job_id])
        self._write("INSERT", [multicast_group(job)])
        self._write("INSERT", worker_entries(job) + role_entries(job))
        self._write("INSERT", [job_entry(job)])  # last: packets are only accepted once all is in place
        self.clear_counters(job.job_id)
        return job

    def remove_job(self, job_id: int) -> None:
        job = self.jobs().get(job_id)
        if job is None:
            raise ControlPlaneError(f"no job {job_id} on {self.target} (lta ctl stats lists the jobs)")
        self._write("DELETE", [job_entry(job)])  # first: the job stops accepting packets
        self._write("DELETE", worker_entries(job) + role_entries(job))
        policies = [
            e
            for d in POLICY_CONTROLS
            for e in self.read_table(policy_table(d))
            if e.match["job_id"] == job_id
        ]
        self._write("DELETE", policies)
        self._write("DELETE", [multicast_group(job)])

    def reset_job(self, job_id: int) -> JobSpec:
        """Forget every slot of the job (new generation) and zero its counters; keeps its policies."""
        job = self.jobs().get(job_id)
        if job is None:
            raise ControlPlaneError(f"no job {job_id} on {self.target} (lta ctl stats lists the jobs)")
        job = replace(job, generation=new_generation())
        self._write("MODIFY", [job_entry(job)])
        self.clear_counters(job_id)
        return job

    def set_quorum(self, job_id: int, quorum: int) -> JobSpec:
        """Change a running job's quorum (same generation: its slots keep their state). The liveness
        monitor lowers it while workers are offline and restores it when they send again."""
        job = self.jobs().get(job_id)
        if job is None:
            raise ControlPlaneError(f"no job {job_id} on {self.target} (lta ctl stats lists the jobs)")
        local = len(job.local)  # a leaf's quorum counts its own workers, a spine's its leaves
        if not 1 <= quorum <= local:
            raise ControlPlaneError(f"job {job_id} has {local} workers here: quorum must be 1..{local}")
        job = replace(job, quorum=quorum)
        self._write("MODIFY", [job_entry(job)])
        return job

    # ---- drop policies ---------------------------------------------------------------------------
    def set_drop_policy(
        self, job_id: int, direction: str, policy: DropPolicy | None, worker: int | None = None
    ) -> None:
        """Emulated loss for one job and direction (up / down / param), all workers or one; None removes."""
        entry = policy_entry(job_id, direction, policy, worker)
        present = {e.key() for e in self.read_table(entry.table)}
        if policy is None:
            if entry.key() in present:
                self._write("DELETE", [entry])
            return
        self._write("MODIFY" if entry.key() in present else "INSERT", [entry])

    def drop_policies(self, job_id: int | None = None) -> list[tuple[str, int, int | None, DropPolicy]]:
        """(direction, job, worker or None, policy) of every policy entry, optionally of one job."""
        found = []
        for direction in POLICY_CONTROLS:
            for e in self.read_table(policy_table(direction)):
                if job_id is None or e.match["job_id"] == job_id:
                    found.append(policy_of(e))
        return found

    # ---- counters --------------------------------------------------------------------------------
    def read_counters(self, job_id: int | None = None) -> dict[int, dict[str, int]]:
        """Packet counts per job index (0: packets of no known job) and counter name."""
        requests = []
        for name in COUNTERS:
            entity = p4runtime_pb2.Entity()
            entity.counter_entry.counter_id = self.names.id(p4info.P4Type.counter, name)
            if job_id is not None:
                entity.counter_entry.index.index = job_id
            requests.append(entity)
        result: dict[int, dict[str, int]] = {}
        for entity in self.session.read(requests):
            c = entity.counter_entry
            name = self.names.name(c.counter_id)
            result.setdefault(c.index.index, dict.fromkeys(COUNTERS, 0))[name] = c.data.packet_count
        return result

    def read_worker_rx(self, job_id: int, n_workers: int) -> list[int]:
        """Packets from each of the job's first ``n_workers`` workers that passed the worker check
        (``WORKER_COUNTER``; heartbeats included): the liveness signal."""
        counter_id = self.names.id(p4info.P4Type.counter, WORKER_COUNTER)
        requests = []
        for w in range(n_workers):
            entity = p4runtime_pb2.Entity()
            entity.counter_entry.counter_id = counter_id
            entity.counter_entry.index.index = worker_counter_index(job_id, w)
            requests.append(entity)
        counts = [0] * n_workers
        for entity in self.session.read(requests):
            c = entity.counter_entry
            counts[c.index.index - worker_counter_index(job_id, 0)] = c.data.packet_count
        return counts

    def clear_counters(self, job_id: int) -> None:
        updates = []
        for name in COUNTERS:
            c = p4runtime_pb2.CounterEntry(counter_id=self.names.id(p4info.P4Type.counter, name))
            c.index.index = job_id
            c.data.packet_count = 0
            c.data.byte_count = 0
            updates.append(c)
        worker_rx = self.names.id(p4info.P4Type.counter, WORKER_COUNTER)
        for w in range(MAX_WORKERS):
            c = p4runtime_pb2.CounterEntry(counter_id=worker_rx)
            c.index.index = worker_counter_index(job_id, w)
            c.data.packet_count = 0
            c.data.byte_count = 0
            updates.append(c)
        self._write("MODIFY", updates)
