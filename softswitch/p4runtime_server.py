"""The softswitch behind a P4Runtime server, so one control plane drives BMv2 and the softswitch alike.

It speaks the subset of P4Runtime that ``controlplane`` uses: StreamChannel arbitration,
Set/GetForwardingPipelineConfig with LTA's P4Info, Write/Read of LTA's tables, multicast group entries
(PacketReplicationEngineEntry) and indirect counter reads/writes. Table entries are kept as the
P4 switch would keep them and reconciled onto :class:`softswitch.pipeline.SoftSwitch`:

- a job-lookup entry plus worker-port entries for workers 0..N-1 make a job (``add_job``); a change of
  shape re-adds it, a change of generation alone is a reset (``reset_job``);
- policy entries become ``set_drop_policy`` calls (worker wildcard = all workers);
- the multicast group is stored and read back; the softswitch multicasts to the job's workers itself.

Workers are identified by their switch port number (``port_key="port"``, raw-port and in-process use)
or by their (IPv4, UDP port) address from the worker-address table (``port_key="address"``, the UDP
daemon on loopback).

A softswitch started with a jobs file (``lta softswitch --config FILE --p4runtime ...``) runs LTA's
compiled pipeline from the start (:meth:`SoftSwitchP4Runtime.load_pipeline`, as if ``lta ctl load`` had
run) and holds its jobs as table entries (:meth:`SoftSwitchP4Runtime.install_jobs`, the entries
``lta ctl`` would write), so ``lta ctl`` lists, resets and removes them like any other.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, status_pb2

from hostlib.jobconfig import JobEntry, WorkerEntry
from hostlib.p4.info import P4Names, P4Type, from_proto, load_p4info, missing_names, to_proto, update
from hostlib.p4.jobentries import (
    job_lookup_entry,
    multicast_group_id,
    place_pools,
    role_entries,
    worker_entries,
)
from hostlib.p4.proto import p4info_pb2, p4runtime_pb2, p4runtime_pb2_grpc
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
from hostlib.protocol import COUNTERS, DEFAULT_ELEMS_PER_PACKET, MAX_JOBS, MAX_WORKERS, WORKER_COUNTER, Role
from softswitch.pipeline import JobConfig, Port, SoftSwitch

log = logging.getLogger(__name__)
API_VERSION = "1.4.1"
WRITABLE_TABLES = (JOBS_TABLE, WORKER_PORTS_TABLE, WORKER_ADDRESSES_TABLE, JOB_ROLES_TABLE) + tuple(
    policy_table(d) for d in POLICY_CONTROLS
)


class _UpdateError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _apply_update(store: dict, kind: str, key: object, value: object, what: str) -> None:
    """P4Runtime's INSERT / MODIFY / DELETE on a dict, with its error codes."""
    if kind == "INSERT":
        if key in store:
            raise _UpdateError(code_pb2.ALREADY_EXISTS, f"{what} exists")
        store[key] = value
    elif kind == "MODIFY":
        if key not in store:
            raise _UpdateError(code_pb2.NOT_FOUND, f"{what} does not exist")
        store[key] = value
    elif store.pop(key, None) is None:
        raise _UpdateError(code_pb2.NOT_FOUND, f"{what} does not exist")


@dataclass
class _Pipeline:
    names: P4Names
    config: p4runtime_pb2.ForwardingPipelineConfig
    tables: dict[str, dict[tuple, Entry]] = field(default_factory=dict)
    groups: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


class SoftSwitchP4Runtime(p4runtime_pb2_grpc.P4RuntimeServicer):
    """P4Runtime servicer for one :class:`SoftSwitch` (one device)."""

    def __init__(
        self,
        switch: SoftSwitch,
        device_id: int = 0,
        port_key: str = "port",
        elems_per_packet: int = DEFAULT_ELEMS_PER_PACKET,
    ) -> None:
        if port_key not in ("port", "address"):
            raise ValueError(f"port_key must be 'port' or 'address', got {port_key!r}")
        self.switch = switch
        self.device_id = device_id
        self.port_key = port_key
        self.elems_per_packet = elems_per_packet
        self.pipeline: _Pipeline | None = None
        self._lock = threading.RLock()
        self._elections: dict[int, tuple[int, int]] = {}  # stream id -> election id
        self._next_stream = 0
        self._active: dict[int, tuple[JobConfig, int]] = {}  # job -> (config, generation) installed
        self._policies: dict[int, set[tuple[str, int | None]]] = {}
        self._counter_offset: dict[tuple[int, str], int] = {}
        # K of the jobs installed from a jobs file; P4Runtime cannot say it, so others get elems_per_packet.
        self._job_elems: dict[int, int] = {}

    # ---- arbitration -----------------------------------------------------------------------------
    def _primary(self) -> tuple[int, int] | None:
        return max(self._elections.values(), default=None)

    def StreamChannel(self, request_iterator, context) -> Iterator[p4runtime_pb2.StreamMessageResponse]:
        with self._lock:
            stream = self._next_stream
            self._next_stream += 1
        try:
            for request in request_iterator:
                if not request.HasField("arbitration"):
                    continue  # packet-out, digests: not used by LTA
                arbitration = request.arbitration
                if arbitration.device_id != self.device_id:
                    context.abort(grpc.StatusCode.NOT_FOUND, f"no device {arbitration.device_id} here")
                election = (arbitration.election_id.high, arbitration.election_id.low)
                with self._lock:
                    self._elections[stream] = election
                    primary = self._primary() == election
                response = p4runtime_pb2.StreamMessageResponse()
                response.arbitration.CopyFrom(arbitration)
                response.arbitration.status.code = code_pb2.OK if primary else code_pb2.ALREADY_EXISTS
                yield response
        finally:
            with self._lock:
                self._elections.pop(stream, None)

    def _check_primary(self, request, context) -> None:
        if request.device_id != self.device_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no device {request.device_id} here")
        election = (request.election_id.high, request.election_id.low)
        if self._primary() != election:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not the primary controller")

    # ---- pipeline --------------------------------------------------------------------------------
    def SetForwardingPipelineConfig(self, request, context):
        with self._lock:
            self._check_primary(request, context)
            missing = missing_names(request.config.p4info)
            if missing:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "this softswitch runs LTA's program only; the P4Info lacks " + ", ".join(missing[:4]),
                )
            self._set_pipeline(request.config)
        return p4runtime_pb2.SetForwardingPipelineConfigResponse()

    def _set_pipeline(self, request_config: p4runtime_pb2.ForwardingPipelineConfig) -> None:
        self._clear()
        config = p4runtime_pb2.ForwardingPipelineConfig()
        config.CopyFrom(request_config)
        self.pipeline = _Pipeline(P4Names(config.p4info), config)
        self.pipeline.tables = {name: {} for name in WRITABLE_TABLES}

    def load_pipeline(
        self, p4info_path: Path = P4INFO_PATH, device_config_path: Path = BMV2_JSON_PATH
    ) -> None:
        """Run LTA's compiled pipeline (the P4Info and BMv2 JSON that ``lta ctl load`` pushes) without a
        controller; clears every job, as a SetForwardingPipelineConfig does."""
        config = p4runtime_pb2.ForwardingPipelineConfig()
        config.p4info.CopyFrom(load_p4info(p4info_path))
        if device_config_path.exists():
            config.p4_device_config = device_config_path.read_bytes()
        with self._lock:
            self._set_pipeline(config)

    def install_jobs(self, jobs: Sequence[JobEntry]) -> None:
        """Install jobs the way a controller would: their job-lookup, worker and policy entries and
        multicast groups, through the same code as a Write, so ``lta ctl`` reads them back. Pools go
        where the job says (``slot_base``) or in the first free slots (``hostlib.p4.jobentries.place_pools``);
        workers' fields left out take ``hostlib.jobconfig.default_worker``. Raises ValueError when a
        job does not fit."""
        with self._lock:
            if self.pipeline is None:
                raise ValueError("load a pipeline before installing jobs (load_pipeline)")
            names = self.pipeline.names
            used = [
                (e.match["job_id"], e.params["slot_base"], e.params["pool_size"])
                for e in self.pipeline.tables[JOBS_TABLE].values()
            ]
            pools = [(job.job_id, job.slot_base, job.pool_size) for job in jobs]
            bases = place_pools(pools, used, names.slot_capacity())
            for job in jobs:
                base = bases[job.job_id]
                # A leaf's workers are global ids worker_base, worker_base + 1, ...
                workers: list[WorkerEntry | None] = [None] * job.worker_base
                workers += [worker.filled(job.worker_base + w) for w, worker in enumerate(job.workers)]
                uplink = None
                if job.uplink is not None:  # a leaf; its uplink port matters only to a port-keyed switch
                    port = job.uplink_port or 0
                    uplink = WorkerEntry(
                        job.uplink[0], job.uplink[1], port, job.uplink_mac or "ff:ff:ff:ff:ff:ff"
                    )
                role = Role[job.role.upper()]
                entries = [
                    job_lookup_entry(
                        job.job_id, len(workers), job.quorum or job.n_workers, job.pool_size, base, 1
                    ),
                    *worker_entries(job.job_id, workers),
                    *role_entries(job.job_id, role, job.leaf_id, uplink),
                    *(
                        policy_entry(
                            job.job_id,
                            d.direction,
                            d.policy,
                            None if d.worker is None else job.worker_base + d.worker,
                        )
                        for d in job.drops
                        if d.policy
                    ),
                ]
                group = p4runtime_pb2.PacketReplicationEngineEntry()
                group.multicast_group_entry.multicast_group_id = multicast_group_id(job.job_id)
                for w, worker in enumerate(workers):
                    if worker is not None:
                        group.multicast_group_entry.replicas.add(egress_port=worker.port, instance=w)
                updates = [update("INSERT", group), *(update("INSERT", to_proto(names, e)) for e in entries)]
                if job.elems_per_packet != self.elems_per_packet:
                    self._job_elems[job.job_id] = job.elems_per_packet
                try:
                    for u in updates:
                        self._apply(u)
                except _UpdateError as exc:
                    raise ValueError(f"job {job.job_id}: {exc}") from None
                self._reconcile(job.job_id)
                if job.job_id not in self._active:
                    raise ValueError(f"job {job.job_id} could not be installed (see the log)")

    def _clear(self) -> None:
        for job_id in list(self.switch.jobs):
            self.switch.remove_job(job_id)
        self._active.clear()
        self._policies.clear()
        self._job_elems.clear()
        for job_id in range(MAX_JOBS):
            for name, value in self.switch.read_counters(job_id).items():
                self._counter_offset[(job_id, name)] = value

    def GetForwardingPipelineConfig(self, request, context):
        if request.device_id != self.device_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no device {request.device_id} here")
        response = p4runtime_pb2.GetForwardingPipelineConfigResponse()
        with self._lock:
            if self.pipeline is not None:
                response.config.p4info.CopyFrom(self.pipeline.config.p4info)
                response.config.cookie.CopyFrom(self.pipeline.config.cookie)
        return response

    def Capabilities(self, request, context):
        return p4runtime_pb2.CapabilitiesResponse(p4runtime_api_version=API_VERSION)

    # ---- write -----------------------------------------------------------------------------------
    def Write(self, request, context):
        with self._lock:
            self._check_primary(request, context)
            if self.pipeline is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no pipeline loaded")
            results: list[tuple[int, str]] = []
            touched: set[int] = set()
            for update in request.updates:
                try:
                    touched |= self._apply(update)
                    results.append((code_pb2.OK, ""))
                except _UpdateError as exc:
                    results.append((exc.code, str(exc)))
            for job_id in sorted(touched):
                self._reconcile(job_id)
        if any(code != code_pb2.OK for code, _ in results):
            status = status_pb2.Status(code=code_pb2.UNKNOWN, message="some updates failed")
            for code, message in results:
                detail = any_pb2.Any()
                detail.Pack(p4runtime_pb2.Error(canonical_code=code, message=message))
                status.details.append(detail)
            context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
            context.abort(grpc.StatusCode.UNKNOWN, "some updates failed")
        return p4runtime_pb2.WriteResponse()

    def _apply(self, update: p4runtime_pb2.Update) -> set[int]:
        kind = p4runtime_pb2.Update.Type.Name(update.type)
        entity = update.entity
        which = entity.WhichOneof("entity")
        if which == "table_entry":
            return self._write_table(kind, entity.table_entry)
        if which == "counter_entry":
            self._write_counter(kind, entity.counter_entry)
            return set()
        if which == "packet_replication_engine_entry":
            self._write_group(kind, entity.packet_replication_engine_entry)
            return set()
        raise _UpdateError(code_pb2.UNIMPLEMENTED, f"{which} writes are not supported by the softswitch")

    def _write_table(self, kind: str, proto: p4runtime_pb2.TableEntry) -> set[int]:
        names = self.pipeline.names
        try:
            table_info = names.by_id(proto.table_id)
        except KeyError:
            raise _UpdateError(code_pb2.NOT_FOUND, f"no table with id {proto.table_id}") from None
        table = table_info.preamble.name
        if table not in WRITABLE_TABLES:
            raise _UpdateError(code_pb2.PERMISSION_DENIED, f"table {table} is not writable (const entries)")
        if proto.is_default_action:
            raise _UpdateError(code_pb2.UNIMPLEMENTED, "LTA's tables keep their default actions")
        try:
            entry = from_proto(names, proto)
        except (KeyError, ValueError) as exc:
            raise _UpdateError(code_pb2.INVALID_ARGUMENT, f"{table}: bad entry: {exc}") from None
        self._validate(table_info, entry, with_action=kind != "DELETE")
        rows = self.pipeline.tables[table]
        key = entry.key()
        if kind not in ("INSERT", "MODIFY", "DELETE"):
            raise _UpdateError(code_pb2.INVALID_ARGUMENT, f"unknown update type {kind}")
        _apply_update(rows, kind, key, entry, f"{table}: entry {entry.match}")
        return {entry.match["job_id"]}

    def _validate(self, table_info, entry: Entry, with_action: bool) -> None:
        table = table_info.preamble.name
        for mf in table_info.match_fields:
            value = entry.match.get(mf.name)
            if mf.match_type == p4info_pb2.MatchField.EXACT and value is None:
                raise _UpdateError(code_pb2.INVALID_ARGUMENT, f"{table}: key {mf.name} missing")
            number = value[0] if isinstance(value, tuple) else value
            if number is not None and number >= 1 << mf.bitwidth:
                raise _UpdateError(code_pb2.OUT_OF_RANGE, f"{table}: {mf.name} exceeds {mf.bitwidth} bits")
        ternary = any(mf.match_type == p4info_pb2.MatchField.TERNARY for mf in table_info.match_fields)
        if ternary and entry.priority <= 0:
            raise _UpdateError(code_pb2.INVALID_ARGUMENT, f"{table}: ternary entries need a priority > 0")
        if not with_action:
            return
        allowed = {ref.id for ref in table_info.action_refs if ref.scope != p4info_pb2.ActionRef.DEFAULT_ONLY}
        action_info = self.pipeline.names.action(entry.action) if entry.action else None
        if action_info is None or action_info.preamble.id not in allowed:
            raise _UpdateError(code_pb2.INVALID_ARGUMENT, f"{table}: action {entry.action!r} not allowed")
        for p in action_info.params:
            if p.name not in entry.params:
                raise _UpdateError(code_pb2.INVALID_ARGUMENT, f"{entry.action}: parameter {p.name} missing")
            if entry.params[p.name] >= 1 << p.bitwidth:
                raise _UpdateError(
                    code_pb2.OUT_OF_RANGE, f"{entry.action}: {p.name} exceeds {p.bitwidth} bits"
                )

    def _write_group(self, kind: str, proto: p4runtime_pb2.PacketReplicationEngineEntry) -> None:
        if not proto.HasField("multicast_group_entry"):
            raise _UpdateError(code_pb2.UNIMPLEMENTED, "only multicast group entries are supported")
        group = proto.multicast_group_entry
        groups = self.pipeline.groups
        gid = group.multicast_group_id
        if gid == 0:
            raise _UpdateError(code_pb2.INVALID_ARGUMENT, "multicast group id 0 is reserved")
        replicas = []
        for r in group.replicas:
            port = int.from_bytes(r.port, "big") if r.WhichOneof("port_kind") == "port" else r.egress_port
            replicas.append((port, r.instance))
        _apply_update(groups, kind, gid, replicas, f"multicast group {gid}")

    def _write_counter(self, kind: str, proto: p4runtime_pb2.CounterEntry) -> None:
        if kind != "MODIFY":
            raise _UpdateError(code_pb2.INVALID_ARGUMENT, "counter entries can only be modified")
        if not proto.HasField("index"):
            raise _UpdateError(code_pb2.UNIMPLEMENTED, "write counters one index at a time")
        if proto.counter_id == self.pipeline.names.id(P4Type.counter, WORKER_COUNTER):
            index = proto.index.index
            if not 0 <= index < MAX_JOBS * MAX_WORKERS:
                raise _UpdateError(code_pb2.OUT_OF_RANGE, f"counter index {index} not in 0..4095")
            self._counter_offset[(index, WORKER_COUNTER)] = self._worker_rx(index) - proto.data.packet_count
            return
        name = self._counter_name(proto.counter_id)
        job_id = proto.index.index
        if not 0 <= job_id < MAX_JOBS:
            raise _UpdateError(code_pb2.OUT_OF_RANGE, f"counter index {job_id} not in 0..{MAX_JOBS - 1}")
        current = self.switch.read_counters(job_id)[name]
        self._counter_offset[(job_id, name)] = current - proto.data.packet_count

    def _counter_name(self, counter_id: int) -> str:
        try:
            name = self.pipeline.names.name(counter_id)
        except KeyError:
            raise _UpdateError(code_pb2.NOT_FOUND, f"no counter with id {counter_id}") from None
        if name not in COUNTERS:
            raise _UpdateError(code_pb2.NOT_FOUND, f"{name} is not an LTA counter")
        return name

    # ---- reconcile tables -> SoftSwitch ------------------------------------------------------------
    def _worker_port(self, job_id: int, worker: int) -> Port | None:
        tables = self.pipeline.tables
        if self.port_key == "port":
            entry = tables[WORKER_PORTS_TABLE].get(
                (WORKER_PORTS_TABLE, (("job_id", job_id), ("worker_id", worker)), 0)
            )
            return None if entry is None else entry.params["port"]
        entry = tables[WORKER_ADDRESSES_TABLE].get(
            (WORKER_ADDRESSES_TABLE, (("job_id", job_id), ("worker_id", worker)), 0)
        )
        if entry is None:
            return None
        return (str(ipaddress.IPv4Address(entry.params["ipv4"])), entry.params["udp_port"])

    def _desired(self, job_id: int) -> tuple[JobConfig, int] | None:
        entry = self.pipeline.tables[JOBS_TABLE].get((JOBS_TABLE, (("job_id", job_id),), 0))
        if entry is None:
            return None
        p = entry.params
        workers = [self._worker_port(job_id, w) for w in range(p["n_workers"])]
        role_entry = self.pipeline.tables[JOB_ROLES_TABLE].get((JOB_ROLES_TABLE, (("job_id", job_id),), 0))
        role, uplink, leaf_id = Role.FLAT, None, 0
        if role_entry is not None and role_entry.action == SET_SPINE:
            role = Role.SPINE
        elif role_entry is not None and role_entry.action == SET_LEAF:
            # A leaf: workers without entries are served by other leaves (None); the uplink is its port
            # (a port-keyed switch) or the address of its worker-address entry UPLINK_WORKER_ID.
            role, leaf_id = Role.LEAF, role_entry.params["leaf_id"]
            if self.port_key == "port":
                uplink = role_entry.params["uplink_port"]
            else:
                uplink = self._worker_port(job_id, UPLINK_WORKER_ID)
                if uplink is None:
                    log.warning("job %d: the leaf's uplink address is missing; not installed yet", job_id)
                    return None
        if role != Role.LEAF and any(port is None for port in workers):
            log.warning("job %d: worker entries incomplete; not installed yet", job_id)
            return None
        try:
            config = JobConfig(
                job_id,
                workers,
                quorum=p["quorum"],
                pool_size=p["pool_size"],
                elems_per_packet=self._job_elems.get(job_id, self.elems_per_packet),
                role=role,
                uplink=uplink,
                leaf_id=leaf_id,
            )
        except ValueError as exc:
            log.warning("job %d not installed: %s", job_id, exc)
            return None
        return config, p["generation"]

    def _reconcile(self, job_id: int) -> None:
        desired = self._desired(job_id)
        current = self._active.get(job_id)
        if desired is None:
            if current is not None:
                self.switch.remove_job(job_id)
                del self._active[job_id]
                self._policies.pop(job_id, None)
                self._job_elems.pop(job_id, None)  # a job added again over P4Runtime gets the default K
            return
        config, generation = desired
        if (
            current is not None
            and current[1] == generation
            and current[0] != config
            and dataclasses.replace(current[0], quorum=config.quorum) == config
        ):
            # Only the quorum changed (liveness lowers it for offline workers): keep the slots.
            self.switch.set_quorum(job_id, config.quorum or config.n_workers)
        elif current is None or current[0] != config:
            if current is not None:
                self.switch.remove_job(job_id)
                self._policies.pop(job_id, None)
            self.switch.add_job(config)
            self._zero_offsets(job_id)
        elif current[1] != generation:
            self.switch.reset_job(job_id)
            self._zero_offsets(job_id)
        self._active[job_id] = desired
        self._reconcile_policies(job_id, config.n_workers)

    def _zero_offsets(self, job_id: int) -> None:
        for name in COUNTERS:
            self._counter_offset[(job_id, name)] = 0
        for w in range(MAX_WORKERS):  # the switch zeroed the job's per-worker counters with its slots
            self._counter_offset.pop((job_id * MAX_WORKERS + w, WORKER_COUNTER), None)

    def _reconcile_policies(self, job_id: int, n_workers: int) -> None:
        wanted = {}
        for direction in POLICY_CONTROLS:
            for entry in self.pipeline.tables[policy_table(direction)].values():
                if entry.match["job_id"] == job_id:
                    _, _, worker, policy = policy_of(entry)
                    if worker is None or worker < n_workers:  # the P4 table would never match others
                        wanted[(direction, worker)] = policy
        for direction, worker in self._policies.get(job_id, set()) - set(wanted):
            self.switch.set_drop_policy(job_id, direction, None, worker)
        for (direction, worker), policy in wanted.items():
            self.switch.set_drop_policy(job_id, direction, policy, worker)
        self._policies[job_id] = set(wanted)

    # ---- read ------------------------------------------------------------------------------------
    def Read(self, request, context):
        if request.device_id != self.device_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no device {request.device_id} here")
        with self._lock:
            if self.pipeline is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no pipeline loaded")
            response = p4runtime_pb2.ReadResponse()
            for entity in request.entities:
                which = entity.WhichOneof("entity")
                if which == "table_entry":
                    self._read_tables(entity.table_entry, response)
                elif which == "counter_entry":
                    try:
                        self._read_counters(entity.counter_entry, response)
                    except _UpdateError as exc:
                        context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
                elif which == "packet_replication_engine_entry":
                    self._read_groups(entity.packet_replication_engine_entry, response)
                else:
                    context.abort(grpc.StatusCode.UNIMPLEMENTED, f"reading {which} is not supported")
        yield response

    def _read_tables(self, query: p4runtime_pb2.TableEntry, response) -> None:
        names = self.pipeline.names
        for table in WRITABLE_TABLES:
            if query.table_id and names.table(table).preamble.id != query.table_id:
                continue
            for entry in self.pipeline.tables[table].values():
                response.entities.add().table_entry.CopyFrom(to_proto(names, entry))

    def _read_counters(self, query: p4runtime_pb2.CounterEntry, response) -> None:
        names = self.pipeline.names
        if query.counter_id and query.counter_id == names.id(P4Type.counter, WORKER_COUNTER):
            self._read_worker_rx(query, response)
            return
        wanted = [self._counter_name(query.counter_id)] if query.counter_id else list(COUNTERS)
        indices = [query.index.index] if query.HasField("index") else list(range(MAX_JOBS))
        for job_id in indices:
            if not 0 <= job_id < MAX_JOBS:
                raise _UpdateError(code_pb2.OUT_OF_RANGE, f"counter index {job_id} not in 0..{MAX_JOBS - 1}")
            values = self.switch.read_counters(job_id)
            for name in wanted:
                c = response.entities.add().counter_entry
                c.counter_id = names.id(P4Type.counter, name)
                c.index.index = job_id
                c.data.packet_count = values[name] - self._counter_offset.get((job_id, name), 0)

    def _read_worker_rx(self, query: p4runtime_pb2.CounterEntry, response) -> None:
        """``WORKER_COUNTER``, index ``job_id * MAX_WORKERS + worker_id`` (0 where no such worker)."""
        size = MAX_JOBS * MAX_WORKERS
        indices = [query.index.index] if query.HasField("index") else list(range(size))
        per_job: dict[int, list[int]] = {}
        for index in indices:
            if not 0 <= index < size:
                raise _UpdateError(code_pb2.OUT_OF_RANGE, f"counter index {index} not in 0..{size - 1}")
            job_id, worker = divmod(index, MAX_WORKERS)
            if job_id not in per_job:
                per_job[job_id] = self.switch.read_worker_rx(job_id) if job_id in self.switch.jobs else []
            counts = per_job[job_id]
            c = response.entities.add().counter_entry
            c.counter_id = query.counter_id
            c.index.index = index
            count = counts[worker] if worker < len(counts) else 0
            c.data.packet_count = count - self._counter_offset.get((index, WORKER_COUNTER), 0)

    def _worker_rx(self, index: int) -> int:
        job_id, worker = divmod(index, MAX_WORKERS)
        if job_id not in self.switch.jobs:
            return 0
        counts = self.switch.read_worker_rx(job_id)
        return counts[worker] if worker < len(counts) else 0

    def _read_groups(self, query: p4runtime_pb2.PacketReplicationEngineEntry, response) -> None:
        wanted = query.multicast_group_entry.multicast_group_id
        for gid, replicas in sorted(self.pipeline.groups.items()):
            if wanted and gid != wanted:
                continue
            group = response.entities.add().packet_replication_engine_entry.multicast_group_entry
            group.multicast_group_id = gid
            for port, instance in replicas:
                group.replicas.add(egress_port=port, instance=instance)


def serve(
    switch: SoftSwitch,
    address: str = "127.0.0.1:0",
    *,
    load_pipeline: bool = False,
    jobs: Sequence[JobEntry] = (),
    **options,
) -> tuple[grpc.Server, int, SoftSwitchP4Runtime]:
    """Start a P4Runtime server for ``switch`` on ``address`` ("host:port", port 0 picks a free one).
    With ``load_pipeline`` it runs LTA's compiled pipeline from the start and holds ``jobs`` (jobs-file
    jobs, installed as table entries: see :meth:`SoftSwitchP4Runtime.install_jobs`).

    The port is this server's alone: gRPC would otherwise share it (SO_REUSEPORT) with a server already
    there and split the controller's calls between the two, so an occupied port raises OSError.
    Returns the running server, the bound port and the servicer; stop with ``server.stop(None)``."""
    if jobs and not load_pipeline:
        raise ValueError("jobs need the pipeline: serve(..., load_pipeline=True, jobs=...)")
    servicer = SoftSwitchP4Runtime(switch, **options)
    if load_pipeline:
        servicer.load_pipeline()
        servicer.install_jobs(jobs)
    _refuse_occupied(address)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="p4rt"),
        options=[("grpc.so_reuseport", 0)],
    )
    p4runtime_pb2_grpc.add_P4RuntimeServicer_to_server(servicer, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio >= 1.60 raises where older versions returned 0
        port = 0
    if port == 0:
        raise OSError(f"cannot serve P4Runtime on {address}: the port is in use; pick another")
    server.start()
    return server, port, servicer


def _refuse_occupied(address: str) -> None:
    """Raise OSError if a TCP socket already listens on ``address``: said in our words, before gRPC
    tries and logs its own complaint."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not port_text.isdigit() or int(port_text) == 0:
        return
    try:
        infos = socket.getaddrinfo(
            host or None, int(port_text), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return  # gRPC will say what is wrong with the name
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no owner
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise OSError(
                f"cannot serve P4Runtime on {address}: {exc.strerror} (another softswitch or "
                f"simple_switch_grpc?); pick another port"
            ) from None
