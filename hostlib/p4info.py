"""Our P4Info through protobuf: load it, look names up, convert :class:`~hostlib.p4schema.Entry` to and
from P4Runtime ``TableEntry`` messages. Needs the ``p4rt`` extra (protobuf, p4runtime, p4runtime-shell).

The softswitch's P4Runtime server decodes with the same code ``controlplane`` encodes with, so the two
ends cannot disagree; nothing depends on the numeric ids, which the compiler chooses.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2
from p4runtime_sh.context import Context, P4Type

from hostlib.p4schema import (
    P4INFO_PATH,
    ROLE_NAMES,
    SLOT_REGISTER,
    Entry,
    Ternary,
    decode,
    encode,
    required_names,
)


class P4InfoMismatch(ValueError):
    """A P4Info that is not LTA's program (some name the control plane needs is missing)."""


def load_p4info(path: Path = P4INFO_PATH) -> p4info_pb2.P4Info:
    if not path.exists():
        raise FileNotFoundError(f"no P4Info at {path}: compile p4/v1model/lta.p4 (see p4/build/README.md)")
    info = p4info_pb2.P4Info()
    text_format.Merge(path.read_text(), info, allow_unknown_field=True)
    return info


def p4info_fingerprint(info: p4info_pb2.P4Info) -> str:
    """A short digest of a P4Info, to tell two pipelines apart in messages."""
    return hashlib.sha256(info.SerializeToString(deterministic=True)).hexdigest()[:12]


def missing_names(info: p4info_pb2.P4Info) -> list[str]:
    """Names the control plane needs that ``info`` lacks ("" when it is our program)."""
    missing = []
    for kind, names in required_names().items():
        present = {obj.preamble.name for obj in getattr(info, kind)}
        missing += [f"{kind[:-1]} {name}" for name in names if name not in present]
    return missing


@dataclass
class P4Names:
    """Name <-> id lookups over one P4Info (a thin layer over p4runtime-shell's Context)."""

    info: p4info_pb2.P4Info

    def __post_init__(self) -> None:
        missing = missing_names(self.info)
        if missing:
            raise P4InfoMismatch(
                "the P4Info is not LTA's v1model program; missing: "
                + ", ".join(missing[:6])
                + (" ..." if len(missing) > 6 else "")
                + " — recompile p4/v1model/lta.p4 and load p4/build/ (lta ctl apply)"
            )
        self.ctx = Context()
        self.ctx.set_p4info(self.info)

    def id(self, kind: P4Type, name: str) -> int:
        return self.ctx.get_obj_id(kind, name)

    def name(self, obj_id: int) -> str:
        return self.ctx.get_name_from_id(obj_id)

    def table(self, name: str):
        return self.ctx.get_obj(P4Type.table, name)

    def action(self, name: str):
        return self.ctx.get_obj(P4Type.action, name)

    def match_field(self, table: str, field: str):
        return self.ctx.get_mf(table, field)

    def param(self, action: str, param: str):
        return self.ctx.get_param(action, param)

    def counter_size(self, name: str) -> int:
        return self.ctx.get_obj(P4Type.counter, name).size

    def has_roles(self) -> bool:
        """Whether the program has job roles (docs/protocol.md, "Hierarchy"): the v1model one does."""
        return all(
            name in {obj.preamble.name for obj in getattr(self.info, kind)}
            for kind, names in ROLE_NAMES.items()
            for name in names
        )

    def slot_capacity(self) -> int:
        return next(r.size for r in self.info.registers if r.preamble.name == SLOT_REGISTER)


def to_proto(names: P4Names, entry: Entry, with_action: bool = True) -> p4runtime_pb2.TableEntry:
    table = names.table(entry.table)
    proto = p4runtime_pb2.TableEntry(table_id=table.preamble.id, priority=entry.priority)
    for mf in table.match_fields:
        if mf.name not in entry.match:
            if mf.match_type == p4info_pb2.MatchField.EXACT:
                raise ValueError(f"{entry.table}: exact key field {mf.name!r} needs a value")
            continue
        value = entry.match[mf.name]
        m = proto.match.add(field_id=mf.id)
        if mf.match_type == p4info_pb2.MatchField.EXACT:
            if isinstance(value, tuple):
                raise ValueError(f"{entry.table}: exact key {mf.name!r} takes one value, got {value!r}")
            m.exact.value = encode(int(value), mf.bitwidth)
        elif mf.match_type == p4info_pb2.MatchField.TERNARY:
            if isinstance(value, int):
                raise ValueError(f"{entry.table}: ternary key {mf.name!r} takes (value, mask), got {value}")
            v, mask = value
            m.ternary.value = encode(v & mask, mf.bitwidth)
            m.ternary.mask = encode(mask, mf.bitwidth)
        else:
            raise ValueError(f"{entry.table}.{mf.name}: match type {mf.match_type} is not used by LTA")
    if with_action and entry.action:
        action = names.action(entry.action)
        proto.action.action.action_id = action.preamble.id
        for p in action.params:
            if p.name not in entry.params:
                raise ValueError(f"{entry.action}: parameter {p.name!r} needs a value")
            proto.action.action.params.add(param_id=p.id, value=encode(int(entry.params[p.name]), p.bitwidth))
    return proto


def from_proto(names: P4Names, proto: p4runtime_pb2.TableEntry) -> Entry:
    table = names.ctx.get_obj_by_id(proto.table_id)
    fields = {mf.id: mf for mf in table.match_fields}
    match: dict[str, int | Ternary] = {}
    for m in proto.match:
        mf = fields[m.field_id]
        kind = m.WhichOneof("field_match_type")
        if kind == "exact":
            match[mf.name] = decode(m.exact.value)
        elif kind == "ternary":
            match[mf.name] = (decode(m.ternary.value), decode(m.ternary.mask))
        else:
            raise ValueError(f"{table.preamble.name}.{mf.name}: match kind {kind} is not used by LTA")
    action, params = "", {}
    if proto.action.HasField("action"):
        action_info = names.ctx.get_obj_by_id(proto.action.action.action_id)
        action = action_info.preamble.name
        param_names = {p.id: p.name for p in action_info.params}
        params = {param_names[p.param_id]: decode(p.value) for p in proto.action.action.params}
    return Entry(table.preamble.name, match, action, params, proto.priority)


def update(kind: str, proto) -> p4runtime_pb2.Update:
    """An Update of type ``kind`` (INSERT, MODIFY, DELETE) for a TableEntry, CounterEntry or PRE entry."""
    u = p4runtime_pb2.Update(type=p4runtime_pb2.Update.Type.Value(kind))
    if isinstance(proto, p4runtime_pb2.TableEntry):
        u.entity.table_entry.CopyFrom(proto)
    elif isinstance(proto, p4runtime_pb2.CounterEntry):
        u.entity.counter_entry.CopyFrom(proto)
    elif isinstance(proto, p4runtime_pb2.PacketReplicationEngineEntry):
        u.entity.packet_replication_engine_entry.CopyFrom(proto)
    else:
        raise TypeError(f"cannot write a {type(proto).__name__}")
    return u


def table_wildcard(names: P4Names, table: str) -> p4runtime_pb2.Entity:
    """A Read request entity for every entry of ``table``."""
    entity = p4runtime_pb2.Entity()
    entity.table_entry.table_id = names.id(P4Type.table, table)
    return entity
