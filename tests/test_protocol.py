"""The wire format against hand-written expectations, the scapy layer, and the batch codec."""

from __future__ import annotations

import struct

import numpy as np
from scapy.layers.inet import IP, UDP
from scapy.packet import Raw, raw

from hostlib import protocol
from hostlib.p4.scapy_layer import LTA
from hostlib.protocol import HEADER_BYTES, LTA_PORT, Op, make_packet


def test_header_layout_is_the_documented_one():
    # Offsets and sizes as written in docs/protocol.md, independently of the dtype.
    documented = [
        ("version", 0, 1),
        ("op", 1, 1),
        ("flags", 2, 1),
        ("exp", 3, 1),
        ("job_id", 4, 2),
        ("worker_id", 6, 1),
        ("count", 7, 1),
        ("slot", 8, 2),
        ("nelem", 10, 2),
        ("seq", 12, 4),
        ("step", 16, 4),
        ("chunk", 20, 4),
        ("weight", 24, 4),
        ("bitmap", 28, 8),
    ]
    dt = protocol.HEADER_DTYPE
    assert [(n, dt.fields[n][1], dt.fields[n][0].itemsize) for n in dt.names] == documented
    assert HEADER_BYTES == 36


def test_make_packet_matches_hand_packed_bytes():
    payload = np.array([1, -2, 2**31 - 1, -(2**31)], dtype=np.int64)
    pkt = make_packet(
        Op.RESULT,
        job_id=513,
        worker_id=7,
        slot=300,
        seq=70000,
        payload=payload,
        elems_per_packet=4,
        flags=0x0A,
        exp=-5,
        count=3,
        step=9,
        chunk=12,
        weight=96,
        bitmap=(1 << 63) | 5,
    )
    expected = struct.pack(
        ">BBBbHBBHHIIIIQ", 1, 2, 0x0A, -5, 513, 7, 3, 300, 4, 70000, 9, 12, 96, (1 << 63) | 5
    ) + struct.pack(">4i", 1, -2, 2**31 - 1, -(2**31))
    assert pkt == expected


def test_batch_encode_decode_roundtrip():
    k = 8
    batch = protocol.empty_batch(3, k)
    batch["op"] = Op.GRAD
    batch["slot"] = [0, 1, 65535]
    batch["payload"] = np.arange(24).reshape(3, 8) - 12
    rows = protocol.batch_rows(batch)
    assert rows.shape == (3, protocol.packet_bytes(k))
    again = protocol.decode_batch(rows.copy(), k)
    assert list(again["slot"]) == [0, 1, 65535]
    assert again["payload"][2, 7] == 11
    # Row bytes are the packed header: slot of the last row at offset 8..10.
    assert rows[2, 8:10].tobytes() == b"\xff\xff"


def test_scapy_layer_dissects_a_udp_capture():
    payload = np.arange(64, dtype=np.int64) - 32
    data = make_packet(Op.GRAD, job_id=4, worker_id=2, slot=9, seq=5, payload=payload, exp=-3)
    wire = raw(IP(src="10.0.0.2", dst="10.0.0.1") / UDP(sport=40000, dport=LTA_PORT) / Raw(data))
    dissected = IP(wire)
    lta = dissected[LTA]
    assert (lta.op, lta.job_id, lta.worker_id, lta.slot, lta.seq, lta.exp) == (1, 4, 2, 9, 5, -3)
    assert np.array_equal(lta.payload_values(), payload)
    # The layer's fields are the protocol's fields, in order, with the same widths.
    widths = {n: protocol.HEADER_BITS[n] for n, _ in protocol.HEADER_FIELDS}
    assert [f.name for f in LTA.fields_desc] == list(widths)
    assert [f.sz * 8 for f in LTA.fields_desc] == list(widths.values())


def test_header_unpack_rejects_short_data():
    import pytest

    with pytest.raises(ValueError, match="36 bytes"):
        protocol.Header.unpack(b"\x01\x02")


def test_header_offsets_are_the_dtypes():
    """HEADER_OFFSETS (what the native switch engine and the shard steering read) against numpy's layout."""
    from hostlib.protocol import HEADER_DTYPE, HEADER_OFFSETS

    assert HEADER_OFFSETS == {name: HEADER_DTYPE.fields[name][1] for name in HEADER_DTYPE.names}
    assert HEADER_OFFSETS["slot"] == 8 and HEADER_OFFSETS["bitmap"] == 28
