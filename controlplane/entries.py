"""Table entries by name: an :class:`Entry` says which table, key values, action and parameters, and
converts to and from the P4Runtime ``TableEntry`` of one P4Info. The softswitch's P4Runtime server
decodes with the same code, so the two ends cannot disagree on an encoding."""

from __future__ import annotations

from dataclasses import dataclass, field

from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2
from p4runtime_sh.context import P4Type

from controlplane.p4info import P4Names, decode, encode

Ternary = tuple[int, int]  # (value, mask)


@dataclass(frozen=True)
class Entry:
    """One table entry. ``match`` maps a key field to an int (exact) or (value, mask) (ternary); a
    ternary field left out matches anything. ``action`` is the full action name."""

    table: str
    match: dict[str, int | Ternary]
    action: str = ""
    params: dict[str, int] = field(default_factory=dict)
    priority: int = 0

    def key(self) -> tuple:
        """What identifies the entry in its table (P4Runtime: match fields and priority)."""
        return (self.table, tuple(sorted(self.match.items())), self.priority)


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
            m.exact.value = encode(int(value), mf.bitwidth)
        elif mf.match_type == p4info_pb2.MatchField.TERNARY:
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
