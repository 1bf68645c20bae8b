"""The control plane's view of the Tofino program through BfRt, the runtime interface of Intel's SDE.

A Tofino switch is configured by BfRt writes: a table (or counter, register, PRE table) id, key fields and
data fields, each field by id with a value of its exact width. This module turns what ``controlplane``
knows by name (a job, its workers, a drop policy, a counter, a slot range) into such writes, resolving
every name, id and width from the compiled program's ``bf-rt.json`` (``p4/tofino/build/``), so a name the
program lacks or a value too wide for its field is refused here, before any switch sees it.

What it covers: the job lookup, worker-port and worker-address entries (the same :class:`Entry` objects as
on BMv2, from :mod:`hostlib.p4.jobentries`), the drop policies, the job's multicast group in the packet
replication engine, the branch and ``worker_rx`` counters (read and clear), and the reset of a job by
clearing its slot range in the slot and accumulator registers (Tofino has no generation, docs/protocol.md
"Tofino"). What it does not: the gRPC transport to ``bf_switchd`` (the SDE's ``bfrt_grpc`` client is not
part of this project); :func:`job_writes` and the other builders return plain data that such a client
sends one to one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from controlplane.errors import ControlPlaneError
from controlplane.jobs import JobSpec, job_entry, worker_entries
from hostlib.p4.jobentries import place_pools
from hostlib.p4.schema import Entry, policy_entry, required_names
from hostlib.protocol import COUNTERS, MAX_JOBS, MAX_WORKERS, WORKER_COUNTER, worker_counter_index

if TYPE_CHECKING:
    from controlplane.deployment import DropSpec

BFRT_PATH = Path(__file__).resolve().parent.parent / "p4" / "tofino" / "build" / "bf-rt.json"
PIPE = "pipe"  # the Pipeline instance of p4/tofino/lta.p4: BfRt prefixes the program's names with it

# BfRt's own field names (fixed by the SDE, the same in every program).
MATCH_PRIORITY = "$MATCH_PRIORITY"
COUNTER_INDEX = "$COUNTER_INDEX"
COUNTER_PACKETS = "$COUNTER_SPEC_PKTS"
REGISTER_INDEX = "$REGISTER_INDEX"

# The packet replication engine's tables are the SDE's fixed tables, not the program's: they are not in
# the program's bf-rt.json, so their names and fields are written here as the SDE's BfRt schema has them.
PRE_NODE_TABLE = "$pre.node"  # key $MULTICAST_NODE_ID; data $MULTICAST_RID, $MULTICAST_LAG_ID, $DEV_PORT
PRE_MGID_TABLE = "$pre.mgid"  # key $MGID; data node ids with their L1 exclusion ids
PRE_NODE_FIELDS = ("$MULTICAST_RID", "$MULTICAST_LAG_ID", "$DEV_PORT")
PRE_MGID_FIELDS = ("$MULTICAST_NODE_ID", "$MULTICAST_NODE_L1_XID_VALID", "$MULTICAST_NODE_L1_XID")

# BfRt orders ternary entries by $MATCH_PRIORITY, the lower value first; P4Runtime (and hostlib.p4.schema,
# where a per-worker drop policy has priority 2 and a job-wide one 1) the higher first.
BFRT_PRIORITY_TOP = 0xFFFF

# The slot registers and the accumulator pairs a job reset clears over the job's slot range.
SLOT_REGISTERS = tuple(
    f"LtaIngress.slot_update.{r}"
    for r in ("slot_seq", "slot_round", "slot_bitmap", "slot_count", "slot_result")
)
ACCUMULATOR_PREFIX = "LtaIngress.elements.acc_"

# Counters (p4/gen_p4.py's tofino_counters): these have a Counter of their own, indexed by job id; every
# other branch of COUNTERS is counted in ingress in BRANCH_COUNTER at index code * MAX_JOBS + job, where
# code is the branch's position in COUNTERS (its BRANCH_* constant in the program).
OWN_COUNTERS = ("rx_packets", "result_quorum", "drop_policy_down", "drop_policy_param", "tx_packets")
BRANCH_COUNTER = "branches"
COUNTER_TABLES = (*OWN_COUNTERS, BRANCH_COUNTER, WORKER_COUNTER)  # every Counter the control plane names


def required_bfrt_names() -> dict[str, list[str]]:
    """``hostlib.p4.schema.required_names()`` as the Tofino program has them: its counters are
    COUNTER_TABLES, not one per name of COUNTERS."""
    return {**required_names(), "counters": list(COUNTER_TABLES)}


def counter_address(name: str, job_id: int) -> tuple[str, int]:
    """The Counter (its BfRt name) and index where the Tofino program counts branch ``name`` of job
    ``job_id`` (0: packets of no known job)."""
    if name not in COUNTERS:
        raise ControlPlaneError(f"no counter {name!r}: the counters are {', '.join(COUNTERS)}")
    if not 0 <= job_id < MAX_JOBS:
        raise ControlPlaneError(f"job id {job_id} is outside 0..{MAX_JOBS - 1}")
    if name in OWN_COUNTERS:
        return name, job_id
    return BRANCH_COUNTER, COUNTERS.index(name) * MAX_JOBS + job_id


@dataclass(frozen=True)
class Field:
    """A key or data field of a BfRt table: its id, width in bits (0 for BfRt's uint32/uint64/bool
    fields, whose width is the type's) and match type (keys only)."""

    name: str
    id: int
    width: int
    match_type: str = ""


@dataclass(frozen=True)
class Table:
    name: str
    id: int
    table_type: str
    size: int
    keys: dict[str, Field]
    actions: dict[str, tuple[int, dict[str, Field]]]
    data: dict[str, Field]


@dataclass(frozen=True)
class KeyValue:
    field_id: int
    value: bytes
    mask: bytes | None = None  # ternary only


@dataclass(frozen=True)
class DataValue:
    field_id: int
    value: bytes


@dataclass(frozen=True)
class Write:
    """One BfRt table write (or, for a read, its key): what a BfRt client puts in a WriteRequest."""

    table: str
    table_id: int
    key: tuple[KeyValue, ...]
    action_id: int = 0
    data: tuple[DataValue, ...] = ()


def _width(type_: dict | None) -> int:
    return int(type_.get("width", 0)) if type_ and type_.get("type") == "bytes" else 0


def _field(raw: dict) -> Field:
    # Container fields (a hash's configuration) have no type: width 0, never written here.
    return Field(raw["name"], raw["id"], _width(raw.get("type")), raw.get("match_type", ""))


class BfrtSchema:
    """The tables of a bf-rt.json by their names without the pipeline prefix."""

    def __init__(self, bfrt: dict, pipe: str = PIPE) -> None:
        self.tables: dict[str, Table] = {}
        prefix = pipe + "."
        for raw in bfrt.get("tables", []):
            name = raw["name"].removeprefix(prefix)
            actions = {
                a["name"]: (a["id"], {f["name"]: _field(f) for f in a.get("data", [])})
                for a in raw.get("action_specs", [])
            }
            data = {
                d["singleton"]["name"]: _field(d["singleton"])
                for d in raw.get("data", [])
                if "singleton" in d
            }
            keys = {k["name"]: _field(k) for k in raw.get("key", [])}
            self.tables[name] = Table(
                name, raw["id"], raw["table_type"], raw.get("size", 0), keys, actions, data
            )

    @classmethod
    def load(cls, path: Path = BFRT_PATH) -> BfrtSchema:
        if not path.is_file():
            raise ControlPlaneError(
                f"{path} does not exist: compile p4/tofino first (.venv/bin/python p4/tofino_build.py)"
            )
        return cls(json.loads(path.read_text()))

    def table(self, name: str, kind: str | None = None) -> Table:
        table = self.tables.get(name)
        if table is None:
            raise ControlPlaneError(f"bf-rt.json has no table {name!r}: is p4/tofino/build current?")
        if kind is not None and table.table_type != kind:
            raise ControlPlaneError(f"{name} is a {table.table_type} in bf-rt.json, not a {kind}")
        return table

    def slot_capacity(self) -> int:
        return self.table(SLOT_REGISTERS[0], "Register").size

    def accumulators(self) -> list[str]:
        return sorted(
            (
                n
                for n, t in self.tables.items()
                if n.startswith(ACCUMULATOR_PREFIX) and t.table_type == "Register"
            ),
            key=lambda n: int(n.removeprefix(ACCUMULATOR_PREFIX)),
        )


def encode(value: int, field: Field, what: str) -> bytes:
    """``value`` as BfRt bytes: big-endian, ceil(width / 8) bytes; refused when it does not fit."""
    width = field.width or 32
    if not 0 <= value < (1 << width):
        raise ControlPlaneError(f"{what}: {value} does not fit in {width} bits")
    return value.to_bytes((width + 7) // 8, "big")


def bfrt_priority(p4runtime_priority: int) -> int:
    """The BfRt $MATCH_PRIORITY of an entry with this P4Runtime priority (higher wins there, lower here)."""
    if not 0 < p4runtime_priority < BFRT_PRIORITY_TOP:
        raise ControlPlaneError(f"priority {p4runtime_priority} is outside 1..{BFRT_PRIORITY_TOP - 1}")
    return BFRT_PRIORITY_TOP - p4runtime_priority


def entry_write(schema: BfrtSchema, entry: Entry, with_action: bool = True) -> Write:
    """A table entry (names and ints, as on every target) as a BfRt write: ids and exact-width bytes.
    A ternary key left out of ``entry.match`` matches anything (value and mask 0)."""
    table = schema.table(entry.table, "MatchAction_Direct")
    key = []
    for name, field in table.keys.items():
        if name == MATCH_PRIORITY:
            key.append(KeyValue(field.id, bfrt_priority(entry.priority).to_bytes(4, "big")))
            continue
        what = f"{entry.table} key {name}"
        value = entry.match.get(name)
        if field.match_type == "Ternary":
            v, m = (
                value
                if isinstance(value, tuple)
                else (0, 0)
                if value is None
                else (value, (1 << field.width) - 1)
            )
            encode(v, field, what)  # refused when wider than the field, before the mask hides it
            key.append(KeyValue(field.id, encode(v & m, field, what), encode(m, field, what)))
        elif value is None or isinstance(value, tuple):
            raise ControlPlaneError(f"{what} is {field.match_type.lower()}: give one value, got {value!r}")
        else:
            key.append(KeyValue(field.id, encode(value, field, what)))
    unknown = set(entry.match) - set(table.keys)
    if unknown:
        raise ControlPlaneError(f"{entry.table} has no key {', '.join(sorted(unknown))}")
    if not with_action:
        return Write(entry.table, table.id, tuple(key))
    if entry.action not in table.actions:
        raise ControlPlaneError(f"{entry.table} has no action {entry.action!r}")
    action_id, params = table.actions[entry.action]
    if set(entry.params) != set(params):
        raise ControlPlaneError(
            f"{entry.action} takes {', '.join(params) or 'no parameters'}, "
            f"got {', '.join(entry.params) or 'none'}"
        )
    data = tuple(
        DataValue(f.id, encode(entry.params[n], f, f"{entry.action} {n}")) for n, f in params.items()
    )
    return Write(entry.table, table.id, tuple(key), action_id, data)


# ---- jobs and the packet replication engine ------------------------------------------------------


def pre_node_id(job_id: int, worker: int) -> int:
    """The PRE node of one worker of one job (unique per switch: the worker_rx index)."""
    return worker_counter_index(job_id, worker)


@dataclass(frozen=True)
class PreWrite:
    """A write to one of the SDE's fixed PRE tables (not in the program's bf-rt.json, so by name)."""

    table: str
    key: dict[str, int]
    data: dict[str, list[int] | list[bool] | int]


def multicast_writes(job: JobSpec) -> list[PreWrite]:
    """One PRE node per worker (replica with rid = worker id, egress.p4's receiver, on its port) and the
    job's multicast group holding them: a RESULT reaches every worker once."""
    nodes = [
        PreWrite(PRE_NODE_TABLE, {"$MULTICAST_NODE_ID": pre_node_id(job.job_id, w)},
                 {"$MULTICAST_RID": w, "$MULTICAST_LAG_ID": [], "$DEV_PORT": [worker.port]})
        for w, worker in enumerate(job.workers)
    ]  # fmt: skip
    node_ids = [n.key["$MULTICAST_NODE_ID"] for n in nodes]
    group = PreWrite(
        PRE_MGID_TABLE,
        {"$MGID": job.mcast_grp},
        {
            "$MULTICAST_NODE_ID": node_ids,
            "$MULTICAST_NODE_L1_XID_VALID": [False] * len(node_ids),
            "$MULTICAST_NODE_L1_XID": [0] * len(node_ids),
        },
    )
    return [*nodes, group]


def job_writes(schema: BfrtSchema, job: JobSpec) -> tuple[list[PreWrite], list[Write]]:
    """Everything that installs a placed job, in the order to send it: the multicast group, then the
    worker entries, then the job lookup entry (packets are accepted only once all is in place)."""
    if job.slot_base is None:
        raise ControlPlaneError(f"job {job.job_id}: place its slot pool first")
    if job.slot_base + job.pool_size > schema.slot_capacity():
        raise ControlPlaneError(
            f"job {job.job_id}: slots {job.slot_base}..{job.slot_base + job.pool_size - 1} exceed the "
            f"switch's {schema.slot_capacity()} slots per pipe"
        )
    if job.n_workers > 32:
        raise ControlPlaneError(f"job {job.job_id}: a Tofino job has at most 32 workers, got {job.n_workers}")
    entries = [*worker_entries(job), job_entry(job)]
    return multicast_writes(job), [entry_write(schema, e) for e in entries]


# ---- registers: a job reset clears its slot range --------------------------------------------------


def register_clears(schema: BfrtSchema, slot_base: int, pool_size: int) -> list[Write]:
    """Zero every slot register and accumulator pair at indices slot_base .. slot_base + pool_size - 1:
    the job's slots read as never used (q = 0), what a new generation does on BMv2."""
    if slot_base < 0 or pool_size < 1 or slot_base + pool_size > schema.slot_capacity():
        raise ControlPlaneError(
            f"slot range {slot_base}+{pool_size} is outside the switch's {schema.slot_capacity()} slots"
        )
    writes = []
    for name in (*SLOT_REGISTERS, *schema.accumulators()):
        table = schema.table(name, "Register")
        index = table.keys[REGISTER_INDEX]
        zeros = tuple(DataValue(f.id, encode(0, f, name)) for f in table.data.values())
        for i in range(slot_base, slot_base + pool_size):
            writes.append(Write(name, table.id, (KeyValue(index.id, encode(i, index, name)),), 0, zeros))
    return writes


# ---- counters ------------------------------------------------------------------------------------


def counter_keys(schema: BfrtSchema, job_id: int, names: Sequence[str] = COUNTERS) -> list[Write]:
    """The keys to read (or, with :func:`counter_clears`, zero) the branch counters of one job, in the
    order of ``names``: each names the Counter and index :func:`counter_address` gives."""
    out = []
    for name in names:
        counter, at = counter_address(name, job_id)
        table = schema.table(counter, "Counter")
        if at >= table.size:
            raise ControlPlaneError(f"{name} of job {job_id}: index {at} is past {counter}'s {table.size}")
        index = table.keys[COUNTER_INDEX]
        out.append(Write(counter, table.id, (KeyValue(index.id, encode(at, index, name)),)))
    return out


def worker_rx_keys(schema: BfrtSchema, job_id: int, workers: Iterable[int]) -> list[Write]:
    table = schema.table(WORKER_COUNTER, "Counter")
    index = table.keys[COUNTER_INDEX]
    return [
        Write(
            WORKER_COUNTER,
            table.id,
            (KeyValue(index.id, encode(worker_counter_index(job_id, w), index, "worker_rx")),),
        )
        for w in workers
    ]


def counter_clears(schema: BfrtSchema, job_id: int) -> list[Write]:
    """Zero the job's branch counters and its workers' worker_rx counts."""
    keys = counter_keys(schema, job_id) + worker_rx_keys(schema, job_id, range(MAX_WORKERS))
    out = []
    for k in keys:
        packets = schema.table(k.table, "Counter").data[COUNTER_PACKETS]
        out.append(Write(k.table, k.table_id, k.key, 0, (DataValue(packets.id, (0).to_bytes(8, "big")),)))
    return out


def packets_of(schema: BfrtSchema, counter: str, data: dict[int, bytes]) -> int:
    """The packet count in the data fields (by id) a BfRt read returned for ``counter`` (a name of
    COUNTERS, WORKER_COUNTER, or the Counter one of them is counted in)."""
    table = counter_address(counter, 0)[0] if counter in COUNTERS else counter
    packets = schema.table(table, "Counter").data[COUNTER_PACKETS]
    if packets.id not in data:
        raise ControlPlaneError(f"the switch's answer for {counter} has no {COUNTER_PACKETS}")
    return int.from_bytes(data[packets.id], "big")


# ---- a jobs file as BfRt writes ------------------------------------------------------------------


def deployment_writes(schema: BfrtSchema, jobs: Sequence[JobSpec], drops: Iterable[DropSpec]) -> list[dict]:
    """Every write that installs ``jobs`` (pools placed as ``lta ctl apply`` places them) and their drop
    policies on an empty Tofino, in order, as JSON-ready dicts: what ``lta ctl bfrt FILE`` prints."""
    bases = place_pools([(j.job_id, j.slot_base, j.pool_size) for j in jobs], [], schema.slot_capacity())
    out: list[dict] = []
    for job in jobs:
        pre, writes = job_writes(schema, replace(job, slot_base=bases[job.job_id]))
        out += [{"table": p.table, "key": p.key, "data": p.data} for p in pre]
        out += [_as_dict(w) for w in writes + counter_clears(schema, job.job_id)]
    for drop in drops:
        if drop.policy is not None:
            entry = policy_entry(drop.job_id, drop.direction, drop.policy, drop.worker)
            out.append(_as_dict(entry_write(schema, entry)))
    return out


def _as_dict(w: Write) -> dict:
    key = [
        {
            "field_id": k.field_id,
            "value": k.value.hex(),
            **({"mask": k.mask.hex()} if k.mask is not None else {}),
        }
        for k in w.key
    ]
    data = [{"field_id": d.field_id, "value": d.value.hex()} for d in w.data]
    return {"table": w.table, "table_id": w.table_id, "key": key, "action_id": w.action_id, "data": data}
