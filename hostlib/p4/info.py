"""Our P4Info through protobuf: load it, look names up, convert :class:`~hostlib.p4.schema.Entry` to and
from P4Runtime ``TableEntry`` messages. Needs the ``p4rt`` extra (protobuf and the p4runtime bindings; not
p4runtime-shell, whose pins on protobuf and p4runtime keep it out of the project's environment).

The softswitch's P4Runtime server decodes with the same code ``controlplane`` encodes with, so the two
ends cannot disagree; nothing depends on the numeric ids, which the compiler chooses.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from hostlib.p4.proto import p4info_pb2, p4runtime_pb2
from hostlib.p4.schema import (
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


class P4Type(enum.Enum):
    """The kinds of P4Info object the control plane looks up by name; the value is the P4Info field."""

    table = "tables"
    action = "actions"
    counter = "counters"
    direct_counter = "direct_counters"
    meter = "meters"
    register = "registers"
    digest = "digests"


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
    """Name <-> id lookups over one P4Info. An object is found by its full name (``LtaIngress.x.y``) or its
    alias, as P4Runtime clients name them."""

    info: p4info_pb2.P4Info
    _by_name: dict[tuple[P4Type, str], Any] = field(init=False, repr=False)
    _by_id: dict[int, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        missing = missing_names(self.info)
        if missing:
            raise P4InfoMismatch(
                "the P4Info is not LTA's v1model program; missing: "
                + ", ".join(missing[:6])
                + (" ..." if len(missing) > 6 else "")
                + " — recompile p4/v1model/lta.p4 and load p4/build/ (lta ctl apply)"
            )
        self._by_name, self._by_id = {}, {}
        for kind in P4Type:
            for obj in getattr(self.info, kind.value):
                self._by_id[obj.preamble.id] = obj
                self._by_name[(kind, obj.preamble.name)] = obj
                if obj.preamble.alias:
                    self._by_name.setdefault((kind, obj.preamble.alias), obj)

    def obj(self, kind: P4Type, name: str) -> Any:
        """The P4Info object (``p4info_pb2.Table``, ``Action``, ...) named ``name``; KeyError naming it."""
        try:
            return self._by_name[(kind, name)]
        except KeyError:
            raise KeyError(f"the P4Info has no {kind.name} named {name!r}") from None

    def by_id(self, obj_id: int) -> Any:
        try:
            return self._by_id[obj_id]
        except KeyError:
            raise KeyError(f"the P4Info has no object with id {obj_id}") from None

    def id(self, kind: P4Type, name: str) -> int:
        return int(self.obj(kind, name).preamble.id)

    def name(self, obj_id: int) -> str:
        return str(self.by_id(obj_id).preamble.name)

    def table(self, name: str) -> Any:
        return self.obj(P4Type.table, name)

    def action(self, name: str) -> Any:
        return self.obj(P4Type.action, name)

    def match_field(self, table: str, field_name: str) -> Any:
        for mf in self.table(table).match_fields:
            if mf.name == field_name:
                return mf
        raise KeyError(f"table {table!r} has no match field {field_name!r}")

    def param(self, action: str, param: str) -> Any:
        for p in self.action(action).params:
            if p.name == param:
                return p
        raise KeyError(f"action {action!r} has no parameter {param!r}")

    def counter_size(self, name: str) -> int:
        return int(self.obj(P4Type.counter, name).size)

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
    table = names.by_id(proto.table_id)
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
        action_info = names.by_id(proto.action.action.action_id)
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
