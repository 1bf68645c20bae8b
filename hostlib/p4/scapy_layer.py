"""A scapy layer for the LTA header, bound to UDP port ``LTA_PORT`` so captures dissect.

The fields are generated from ``hostlib.protocol.HEADER_FIELDS``: the wire format stays defined once.
``LTA(...) / Raw(payload)`` builds packets in tests and tools; ``LTA.payload_values`` reads the int32s.
"""

from __future__ import annotations

import numpy as np
from scapy.fields import ByteField, IntField, LongField, ShortField, SignedByteField
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from hostlib.protocol import HEADER_FIELDS, LTA_PORT, VERSION, Op

_FIELD_TYPES = {"u1": ByteField, "i1": SignedByteField, ">u2": ShortField, ">u4": IntField, ">u8": LongField}


def _field(name: str, np_type: str):
    default = VERSION if name == "version" else 0
    return _FIELD_TYPES[np_type](name, default)


class LTA(Packet):
    name = "LTA"
    fields_desc = [_field(name, t) for name, t in HEADER_FIELDS]

    def mysummary(self) -> str:
        try:
            op = Op(self.op).name
        except ValueError:
            op = f"op{self.op}"
        return self.sprintf(f"LTA {op} job=%job_id% w=%worker_id% slot=%slot% seq=%seq% count=%count%")

    def payload_values(self) -> np.ndarray:
        """The payload as int32 values (big-endian on the wire)."""
        return np.frombuffer(bytes(self.payload), dtype=">i4").astype(np.int32)


bind_layers(UDP, LTA, dport=LTA_PORT)
bind_layers(UDP, LTA, sport=LTA_PORT)
