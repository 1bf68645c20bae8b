"""softswitch.rawport without root: frames built and read by scapy (an independent parser), the switch's
ports backed by socket pairs instead of AF_PACKET sockets."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether

from hostlib.p4.scapy_layer import LTA
from hostlib.protocol import LTA_PORT, Flag, Op, make_packet
from softswitch.pipeline import JobConfig, SoftSwitch
from softswitch.rawport import (
    SWITCH_MAC,
    Neighbor,
    RawPortSwitch,
    arp_reply,
    build_udp_frame,
    classify_frame,
    load_neighbors,
    load_rawport_switch,
    parse_lta_frame,
    parse_port_map,
)

SWITCH_IP = "10.0.0.254"
HOSTS = {  # worker -> (port, mac, ip, udp port)
    0: (1, "02:00:00:00:00:01", "10.0.0.1", 40001),
    1: (2, "02:00:00:00:00:02", "10.0.0.2", 40002),
}


def _grad_frame(worker: int, values: list[int], ip: str | None = None, port: int | None = None) -> bytes:
    _, mac, host_ip, udp_port = HOSTS[worker]
    lta = make_packet(Op.GRAD, job_id=1, worker_id=worker, slot=3, seq=1, payload=np.array(values))
    frame = Ether(src=mac, dst=SWITCH_MAC) / IP(src=ip or host_ip, dst=SWITCH_IP)
    return bytes(frame / UDP(sport=port or udp_port, dport=LTA_PORT) / lta)


class _PairedPorts(RawPortSwitch):
    """Ports are one end of a datagram socket pair; the test holds the other ends."""

    def __init__(self, *args, **kwargs) -> None:
        self.far_ends: dict[str, socket.socket] = {}
        super().__init__(*args, **kwargs)

    def _open(self, intf: str) -> socket.socket:  # type: ignore[override]
        near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        far.setblocking(False)
        self.far_ends[intf] = far
        return near

    def sent_on(self, intf: str) -> list[Ether]:
        frames = []
        while True:
            try:
                frames.append(Ether(self.far_ends[intf].recv(65535)))
            except BlockingIOError:
                return frames


@pytest.fixture
def raw_switch():
    switch = SoftSwitch()
    switch.add_job(JobConfig(1, workers=[1, 2]))
    raw = _PairedPorts(switch, {1: "s1-eth1", 2: "s1-eth2"}, SWITCH_IP)
    yield raw
    raw.close()


def test_parse_lta_frame_returns_payload_and_sender() -> None:
    frame = _grad_frame(0, [5, 6])
    parsed = parse_lta_frame(frame)
    assert parsed is not None
    assert bytes(parsed.payload) == bytes(Ether(frame)[LTA])
    assert parsed.src_mac == bytes.fromhex("020000000001") and parsed.src_port == 40001
    assert socket.inet_ntoa(parsed.src_ip) == "10.0.0.1"


@pytest.mark.parametrize(
    "frame",
    [
        Ether() / IP(dst=SWITCH_IP) / UDP(dport=LTA_PORT + 1) / (b"x" * 100),  # another UDP port
        Ether() / IP(dst=SWITCH_IP, options=b"\x01\x01\x01\x01") / UDP(dport=LTA_PORT) / (b"x" * 100),
        Ether() / IP(dst=SWITCH_IP, frag=1) / UDP(dport=LTA_PORT) / (b"x" * 100),  # a fragment
        Ether() / ARP(pdst=SWITCH_IP),
    ],
    ids=["other-port", "ip-options", "fragment", "arp"],
)
def test_parse_lta_frame_ignores_what_the_p4_parser_ignores(frame) -> None:
    assert parse_lta_frame(bytes(frame)) is None


def _damaged(worker: int, values: list[int], how: str) -> bytes:
    """A GRAD frame whose IPv4/UDP header is damaged one way (the BMv2 fuzzing findings of issue F)."""
    frame = Ether(_grad_frame(worker, values))
    ip = frame[IP]
    if how == "ipv4_checksum":
        ip.chksum ^= 0x0101
    elif how == "ipv4_options":
        frame = (
            Ether(src=frame.src, dst=frame.dst)
            / IP(src=ip.src, dst=ip.dst, options=b"\x01\x01\x01\x01")
            / ip[UDP]
        )
    elif how == "ipv4_fragment":
        ip.flags, ip.frag = 1, 1  # MF, offset 8 bytes: flags/fragment word 0x2001
        del ip.chksum
    elif how == "ipv4_length":
        ip.len = 512  # shorter than what follows
        del ip.chksum
    elif how == "trailing":
        return bytes(frame) + b"\xaa" * 10  # total length right, 10 bytes after the datagram
    elif how == "udp_length":
        frame[UDP].len -= 4
    return bytes(frame)


DAMAGE = {
    "ipv4_checksum": "ipv4_checksum",
    "ipv4_options": "ipv4_options",
    "ipv4_fragment": "ipv4_fragment",
    "ipv4_length": "ipv4_length",
    "trailing": "ipv4_length",
    "udp_length": "udp_length",
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_headers_to_the_lta_port_are_named(how: str) -> None:
    assert classify_frame(_damaged(0, [1], how)) == DAMAGE[how]
    assert parse_lta_frame(_damaged(0, [1], how)) is None


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_grad_never_closes_a_round(raw_switch: _PairedPorts, how: str) -> None:
    # worker 0's GRAD opens the round; worker 1's damaged GRAD would close it (quorum 2)
    raw_switch.handle_frame(1, _grad_frame(0, [1, 2]))
    raw_switch.handle_frame(2, _damaged(1, [10, 20], how))
    assert raw_switch.sent_on("s1-eth1") == [] and raw_switch.sent_on("s1-eth2") == []
    assert raw_switch.stats["rx_bad_ipv4"] == 1 and raw_switch.stats[f"rx_bad_{DAMAGE[how]}"] == 1
    assert raw_switch.switch.read_counters(1)["rx_packets"] == 1  # the job never saw it
    # counted on index 0, like the P4 program, except where the P4 parser never reads UDP (options)
    malformed = 0 if how == "ipv4_options" else 1
    assert raw_switch.switch.read_counters(0)["drop_malformed"] == malformed
    # the same GRAD, undamaged but with TTL 1: the RESULT replicas carry headers of the switch's own
    good = Ether(_grad_frame(1, [10, 20]))
    good[IP].ttl = 1
    del good[IP].chksum
    raw_switch.handle_frame(2, bytes(good))
    for intf in ("s1-eth1", "s1-eth2"):
        (frame,) = raw_switch.sent_on(intf)
        ip = frame[IP]
        assert (ip.version, ip.ihl, ip.ttl, ip.frag, int(ip.flags)) == (4, 5, 64, 0, 2)  # DF only
        assert ip.len == len(bytes(frame)) - 14 and frame[UDP].len == ip.len - 20
        assert list(frame[LTA].payload_values()[:2]) == [11, 22]


def test_build_udp_frame_is_valid_for_an_independent_parser() -> None:
    dst = Neighbor(bytes.fromhex("020000000002"), socket.inet_aton("10.0.0.2"), 40002)
    payload = make_packet(Op.RESULT, job_id=1, count=2, payload=np.array([7, -8]))
    frame = Ether(build_udp_frame(bytes.fromhex("024c54410001"), dst, socket.inet_aton(SWITCH_IP), payload))
    assert frame.dst == "02:00:00:00:00:02" and frame.src == SWITCH_MAC
    ip = frame[IP]
    assert (ip.src, ip.dst, ip.ttl) == (SWITCH_IP, "10.0.0.2", 64)
    rebuilt = IP(bytes(ip))
    del rebuilt.chksum  # scapy computes it afresh
    assert IP(bytes(rebuilt)).chksum == ip.chksum
    assert (frame[UDP].sport, frame[UDP].dport, frame[UDP].len) == (LTA_PORT, 40002, 8 + len(payload))
    assert frame[LTA].count == 2 and list(frame[LTA].payload_values()[:2]) == [7, -8]


def test_arp_request_for_the_switch_gets_our_mac_and_others_get_nothing() -> None:
    mac = bytes.fromhex("024c54410001")
    request = Ether(src="02:00:00:00:00:01", dst="ff:ff:ff:ff:ff:ff") / ARP(
        op=1, hwsrc="02:00:00:00:00:01", psrc="10.0.0.1", pdst=SWITCH_IP
    )
    reply = Ether(arp_reply(bytes(request), socket.inet_aton(SWITCH_IP), mac))
    assert reply[ARP].op == 2 and reply[ARP].hwsrc == SWITCH_MAC and reply[ARP].psrc == SWITCH_IP
    assert reply[ARP].pdst == "10.0.0.1" and reply.dst == "02:00:00:00:00:01"
    other = request.copy()
    other[ARP].pdst = "10.0.0.9"
    assert arp_reply(bytes(other), socket.inet_aton(SWITCH_IP), mac) is None


def test_results_go_back_to_each_learned_worker_with_the_sum(raw_switch: _PairedPorts) -> None:
    raw_switch.handle_frame(1, _grad_frame(0, [1, 2, 3]))
    assert raw_switch.sent_on("s1-eth1") == [] and raw_switch.sent_on("s1-eth2") == []
    raw_switch.handle_frame(2, _grad_frame(1, [10, 20, 30]))
    for worker, intf in ((0, "s1-eth1"), (1, "s1-eth2")):
        (frame,) = raw_switch.sent_on(intf)
        _, mac, ip, udp_port = HOSTS[worker]
        assert (frame.dst, frame[IP].dst, frame[UDP].dport) == (mac, ip, udp_port)
        assert (frame[IP].src, frame[UDP].sport) == (SWITCH_IP, LTA_PORT)
        result = frame[LTA]
        assert (result.op, result.count, result.bitmap, result.slot) == (Op.RESULT, 2, 0b11, 3)
        assert list(result.payload_values()[:3]) == [11, 22, 33]


def test_a_grad_on_the_wrong_port_is_dropped_as_bad_worker(raw_switch: _PairedPorts) -> None:
    raw_switch.handle_frame(2, _grad_frame(0, [1]))  # worker 0 belongs on port 1
    assert raw_switch.switch.read_counters(1)["drop_bad_worker"] == 1


def test_late_grad_gets_a_unicast_retransmission_on_its_own_port(raw_switch: _PairedPorts) -> None:
    raw_switch.handle_frame(1, _grad_frame(0, [1]))
    raw_switch.handle_frame(2, _grad_frame(1, [2]))
    raw_switch.sent_on("s1-eth1"), raw_switch.sent_on("s1-eth2")
    raw_switch.handle_frame(2, _grad_frame(1, [2]))  # worker 1 lost the RESULT and resends
    assert raw_switch.sent_on("s1-eth1") == []
    (frame,) = raw_switch.sent_on("s1-eth2")
    assert frame[LTA].flags & Flag.RETX and frame[LTA].count == 2


def test_port_plus_ip_lets_two_workers_share_a_port() -> None:
    switch = SoftSwitch()
    switch.add_job(JobConfig(1, workers=[(1, "10.0.0.1"), (1, "10.0.0.2")]))
    raw = _PairedPorts(switch, {1: "uplink"}, SWITCH_IP, ingress_key="port+ip")
    try:
        raw.handle_frame(1, _grad_frame(0, [4]))
        raw.handle_frame(1, _grad_frame(1, [5]))
        frames = raw.sent_on("uplink")
    finally:
        raw.close()
    assert sorted(f[IP].dst for f in frames) == ["10.0.0.1", "10.0.0.2"]
    assert all(f[LTA].payload_values()[0] == 9 for f in frames)


def test_replica_for_a_port_never_heard_from_is_counted_not_sent() -> None:
    switch = SoftSwitch()
    switch.add_job(JobConfig(1, workers=[1, 2]))
    raw = _PairedPorts(switch, {1: "a", 2: "b"}, SWITCH_IP)
    try:
        lta = make_packet(Op.PARAM, job_id=1, worker_id=0)
        frame = (
            Ether(src=HOSTS[0][1]) / IP(src="10.0.0.1", dst=SWITCH_IP) / UDP(sport=1, dport=LTA_PORT) / lta
        )
        raw.handle_frame(1, bytes(frame))
        assert raw.sent_on("b") == [] and raw.stats["tx_no_neighbor"] == 1
    finally:
        raw.close()


def test_port_map_and_config_parse_like_simple_switch(tmp_path: Path) -> None:
    assert parse_port_map(["1@s1-eth1", "2@s1-eth2"]) == {1: "s1-eth1", 2: "s1-eth2"}
    with pytest.raises(ValueError, match="NUMBER@INTERFACE"):
        parse_port_map(["s1-eth1"])
    config = tmp_path / "jobs.toml"
    config.write_text(
        '[[jobs]]\njob_id = 2\nworkers = ["1@10.0.0.1", "1@10.0.0.2"]\n'
        '[[jobs.drop]]\ndirection = "down"\np = 0.5\n'
        '[[neighbors]]\nport = 1\nip = "10.0.0.2"\nmac = "02:00:00:00:00:02"\nudp_port = 40001\n'
    )
    switch = load_rawport_switch(config, ingress_key="port+ip")
    assert switch.jobs[2].cfg.workers == [(1, "10.0.0.1"), (1, "10.0.0.2")]
    neighbors = load_neighbors(config, ingress_key="port+ip")
    assert neighbors == {
        (1, "10.0.0.2"): Neighbor(bytes.fromhex("020000000002"), bytes([10, 0, 0, 2]), 40001)
    }
    with pytest.raises(ValueError, match="port number"):
        load_rawport_switch(config, ingress_key="port")


def test_resolver_addresses_a_port_never_heard_from(raw_switch: _PairedPorts) -> None:
    _, mac, ip, udp_port = HOSTS[1]
    neighbor = Neighbor(bytes.fromhex(mac.replace(":", "")), socket.inet_aton(ip), udp_port)
    raw_switch.resolve = lambda port: neighbor if port == 2 else None
    flush = make_packet(Op.FLUSH, job_id=1, worker_id=0, slot=0, seq=1)  # closes an empty round
    frame = (
        Ether(src=HOSTS[0][1]) / IP(src="10.0.0.1", dst=SWITCH_IP) / UDP(sport=40001, dport=LTA_PORT) / flush
    )
    raw_switch.handle_frame(1, bytes(frame))
    (result,) = raw_switch.sent_on("s1-eth2")
    assert (result.dst, result[IP].dst, result[UDP].dport) == (mac, ip, udp_port)
    assert result[LTA].count == 0 and raw_switch.stats["tx_no_neighbor"] == 0


def test_p4runtime_resolver_reads_the_addresses_the_control_plane_wrote() -> None:
    pytest.importorskip("grpc")
    from controlplane.jobs import JobSpec, WorkerSpec
    from controlplane.switch import LtaSwitch
    from softswitch.p4runtime_server import serve
    from softswitch.rawport import p4runtime_resolver

    server, port, servicer = serve(SoftSwitch(), "127.0.0.1:0", port_key="port")
    try:
        with LtaSwitch.connect(f"127.0.0.1:{port}") as ctl:
            ctl.ensure_pipeline()
            workers = (
                WorkerSpec(port=5, mac="02:00:00:00:00:07", ip="10.0.0.7", udp_port=40006),
                WorkerSpec(port=6, mac="02:00:00:00:00:08", ip="10.0.0.8", udp_port=40007),
            )
            ctl.add_job(JobSpec(1, workers))
        resolve = p4runtime_resolver(servicer)
        assert resolve(6) == Neighbor(bytes.fromhex("020000000008"), socket.inet_aton("10.0.0.8"), 40007)
        assert resolve(9) is None
    finally:
        server.stop(None)
