"""The softswitch on raw ports: AF_PACKET sockets on network interfaces, like ``simple_switch -i N@intf``.

Each interface is a numbered port. A frame that parses as Ethernet / IPv4 (no options, no fragments,
valid checksum and lengths) / UDP to ``LTA_PORT`` is handed to :class:`~softswitch.pipeline.SoftSwitch`
with its ingress port; the pipeline's replies leave as Ethernet / IPv4 / UDP frames from the switch's
own address (``ip``:``LTA_PORT``, ``mac``) to the worker behind the egress port. ARP requests for ``ip`` are
answered, so hosts need no static neighbour entries. A frame to ``LTA_PORT`` with a damaged IPv4 or
UDP header is dropped and counted (``rx_bad_ipv4``, and ``rx_bad_<reason>``); replies are built from
scratch, never from a received header. Everything else is ignored (and counted).

Workers are learned from their packets: the first LTA packet on a port records the sender's MAC, IP
and UDP port, which is where RESULT and PARAM replicas for that port go. For a port not heard from
yet, ``resolve`` (when given) supplies the address, e.g. from the worker-address table the control
plane wrote over P4Runtime (as the P4 program readdresses every replica); otherwise the replica is
dropped and counted as ``tx_no_neighbor``.

The pipeline sees an ingress port as an ``int`` (``ingress_key="port"``, BMv2's view: one worker per
port), or as ``(port, source_ip)`` (``"port+ip"``), which lets several workers share a port, e.g.
behind a leaf switch that only forwards. Job configs name workers the same way (see
:func:`load_rawport_switch`).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import select
import signal
import socket
import struct
import sys
import threading
import tomllib
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.jobconfig import parse_mac
from hostlib.protocol import LTA_PORT, SWITCH_MAC
from softswitch.pipeline import JobConfig, SoftSwitch
from softswitch.server import BackgroundServer

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
ETH_P_ARP = 0x0806
SOL_PACKET = 263  # not exported by the socket module
PACKET_OUTGOING = 4  # sll_pkttype of frames this host sent
PACKET_IGNORE_OUTGOING = 23  # setsockopt: do not capture our own transmissions (Linux >= 4.20)
INGRESS_KEYS = ("port", "port+ip")

_ETH = struct.Struct("!6s6sH")
_IPV4 = struct.Struct("!BBHHHBBH4s4s")
_UDP = struct.Struct("!HHHH")
_ARP = struct.Struct("!HHBBH6s4s6s4s")
_HEADERS = _ETH.size + _IPV4.size + _UDP.size  # 42

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Neighbor:
    """Where replicas for one port (or port and IP) go: the worker's MAC, IP and UDP port."""

    mac: bytes
    ip: bytes
    udp_port: int


def parse_port_map(specs: list[str]) -> dict[int, str]:
    """``["1@s1-eth1", "2@s1-eth2"]`` -> ``{1: "s1-eth1", 2: "s1-eth2"}`` (simple_switch's ``-i`` syntax)."""
    ports: dict[int, str] = {}
    for spec in specs:
        number, sep, intf = spec.partition("@")
        if not sep or not number.isdigit() or not intf:
            raise ValueError(f"port {spec!r} is not NUMBER@INTERFACE (e.g. 1@s1-eth1)")
        if int(number) in ports:
            raise ValueError(f"port {number} is given twice")
        ports[int(number)] = intf
    return ports


def ipv4_checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def build_udp_frame(
    src_mac: bytes, dst: Neighbor, src_ip: bytes, payload: bytes, src_port: int = LTA_PORT
) -> bytes:
    """Ethernet / IPv4 (DF, TTL 64) / UDP (checksum 0: none, as IPv4 allows) around ``payload``."""
    total = _IPV4.size + _UDP.size + len(payload)
    ip = bytearray(_IPV4.pack(0x45, 0, total, 0, 0x4000, 64, 17, 0, src_ip, dst.ip))
    struct.pack_into("!H", ip, 10, ipv4_checksum(bytes(ip)))
    udp = _UDP.pack(src_port, dst.udp_port, _UDP.size + len(payload), 0)
    return _ETH.pack(dst.mac, src_mac, ETH_P_IP) + bytes(ip) + udp + payload


@dataclass(frozen=True)
class LtaFrame:
    src_mac: bytes
    src_ip: bytes
    src_port: int
    payload: memoryview


def classify_frame(frame: bytes) -> LtaFrame | str | None:
    """The LTA payload of an Ethernet/IPv4/UDP frame to ``LTA_PORT``; None for a frame that is not for
    LTA; for one addressed to ``LTA_PORT`` whose IPv4/UDP headers are damaged, the reason (a short
    name), so the caller drops and counts it. Whatever the switch sends is built from scratch
    (:func:`build_udp_frame`), so nothing of a damaged header can reach a RESULT.

    Checked, as a host's stack would: version 4 and IHL 5 (no options), a valid header checksum, no
    fragment bits (MF or an offset; DF is fine), total length equal to what follows the Ethernet header
    (no trailing bytes, nothing cut), UDP length equal to the IPv4 payload."""
    if len(frame) < _HEADERS:
        return None
    _dst, src_mac, ethertype = _ETH.unpack_from(frame)
    if ethertype != ETH_P_IP:
        return None
    vihl, _tos, total, _id, frag, _ttl, proto, _csum, src_ip, _dst_ip = _IPV4.unpack_from(frame, _ETH.size)
    ihl = (vihl & 0x0F) * 4
    if proto != 17 or ihl < _IPV4.size or len(frame) < _ETH.size + ihl + _UDP.size:
        return None
    sport, dport, length, _ = _UDP.unpack_from(frame, _ETH.size + ihl)
    if dport != LTA_PORT:
        return None
    if vihl != 0x45:
        return "ipv4_options" if vihl >> 4 == 4 else "ipv4_version"
    if ipv4_checksum(frame[_ETH.size : _ETH.size + _IPV4.size]) != 0:
        return "ipv4_checksum"
    if frag & 0x3FFF:
        return "ipv4_fragment"
    if total != len(frame) - _ETH.size:
        return "ipv4_length"
    if length != total - _IPV4.size:
        return "udp_length"
    return LtaFrame(src_mac, src_ip, sport, memoryview(frame)[_HEADERS:])


def parse_lta_frame(frame: bytes) -> LtaFrame | None:
    """The LTA payload of a well-formed Ethernet/IPv4/UDP frame to ``LTA_PORT``; None otherwise."""
    parsed = classify_frame(frame)
    return parsed if isinstance(parsed, LtaFrame) else None


def arp_reply(frame: bytes, ip: bytes, mac: bytes) -> bytes | None:
    """The reply to an ARP request for ``ip``; None if ``frame`` is not one."""
    if len(frame) < _ETH.size + _ARP.size or _ETH.unpack_from(frame)[2] != ETH_P_ARP:
        return None
    htype, ptype, hlen, plen, oper, sha, spa, _tha, tpa = _ARP.unpack_from(frame, _ETH.size)
    if (htype, ptype, hlen, plen, oper) != (1, ETH_P_IP, 6, 4, 1) or tpa != ip:
        return None
    return _ETH.pack(sha, mac, ETH_P_ARP) + _ARP.pack(1, ETH_P_IP, 6, 4, 2, mac, ip, sha, spa)


class RawPortSwitch(BackgroundServer):
    """A :class:`SoftSwitch` serving numbered raw ports. ``start()`` runs it in a thread."""

    thread_name = "rawport"

    def __init__(
        self,
        switch: SoftSwitch,
        ports: dict[int, str],
        ip: str,
        mac: str = SWITCH_MAC,
        ingress_key: str = "port",
        resolve: Callable[[Hashable], Neighbor | None] | None = None,
    ) -> None:
        if ingress_key not in INGRESS_KEYS:
            raise ValueError(f"ingress_key must be one of {INGRESS_KEYS}, got {ingress_key!r}")
        self.switch = switch
        self.ports = dict(ports)
        self.ip = ipaddress.IPv4Address(ip).packed
        self.mac = parse_mac(mac)
        self.ingress_key = ingress_key
        self.neighbors: dict[Hashable, Neighbor] = {}
        self.resolve = resolve
        self.stats: Counter[str] = Counter()
        self._socks: dict[int, socket.socket] = {}
        self._port_of_fd: dict[int, int] = {}
        super().__init__()
        try:
            for number, intf in self.ports.items():
                self._socks[number] = self._open(intf)
                self._port_of_fd[self._socks[number].fileno()] = number
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open(intf: str) -> socket.socket:
        try:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        except PermissionError:
            raise PermissionError("raw ports need root (or CAP_NET_RAW): run the switch as root") from None
        try:
            sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        except OSError:
            pass  # older kernels: outgoing frames are filtered by pkttype in the loop
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        try:
            sock.bind((intf, ETH_P_ALL))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot open raw port on interface {intf!r}: {exc.strerror} (is it up?)") from exc
        sock.setblocking(False)
        return sock

    # ---- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()

    # ---- data path -----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = select.poll()
        for sock in self._socks.values():
            poller.register(sock, select.POLLIN)
        while not self._stop.is_set():
            for fd, _event in poller.poll(100):
                port = self._port_of_fd[fd]
                try:
                    self._drain(port, self._socks[port])
                except OSError as exc:
                    # The interface went away (its link was deleted): stop serving that port only.
                    poller.unregister(fd)
                    self.stats["ports_lost"] += 1
                    log.warning("raw port %d (%s) lost: %s", port, self.ports[port], exc.strerror)

    def _drain(self, port: int, sock: socket.socket, budget: int = 256) -> None:
        for _ in range(budget):
            try:
                frame, addr = sock.recvfrom(65535)
            except BlockingIOError:
                return
            if addr[2] == PACKET_OUTGOING:
                continue
            self.handle_frame(port, frame)

    def handle_frame(self, port: int, frame: bytes) -> None:
        """Process one frame received on ``port`` and transmit what the pipeline answers."""
        self.stats["rx_frames"] += 1
        lta = classify_frame(frame)
        if isinstance(lta, str):  # for LTA, but its IPv4/UDP header is damaged: dropped, counted
            self.stats["rx_bad_ipv4"] += 1
            self.stats[f"rx_bad_{lta}"] += 1
            if lta not in ("ipv4_options", "ipv4_version"):  # the P4 parser never reads UDP after those
                self.switch.count_damaged_frame()
            return
        if lta is None:
            reply = arp_reply(frame, self.ip, self.mac)
            if reply is not None:
                self.stats["arp_replies"] += 1
                self._transmit(port, reply)
            else:
                self.stats["rx_not_lta"] += 1
            return
        key: Hashable = port if self.ingress_key == "port" else (port, str(ipaddress.IPv4Address(lta.src_ip)))
        self.neighbors[key] = Neighbor(lta.src_mac, lta.src_ip, lta.src_port)
        for egress, packet in self.switch.process(lta.payload, key):
            neighbor = self.neighbors.get(egress)
            if neighbor is None and self.resolve is not None:
                neighbor = self.resolve(egress)
            out_port = egress if isinstance(egress, int) else egress[0]
            if neighbor is None or out_port not in self._socks:
                self.stats["tx_no_neighbor"] += 1
                continue
            self._transmit(out_port, build_udp_frame(self.mac, neighbor, self.ip, packet))

    def _transmit(self, port: int, frame: bytes) -> None:
        sock = self._socks[port]
        for _ in range(100):
            try:
                sock.send(frame)
                self.stats["tx_frames"] += 1
                return
            except BlockingIOError:
                select.select([], [sock], [], 0.01)
            except OSError:
                break  # interface went down: the frame is lost, as on a wire
        self.stats["tx_errors"] += 1


def p4runtime_resolver(servicer: Any) -> Callable[[Hashable], Neighbor | None]:
    """Addresses from the worker-port and worker-address tables of a softswitch P4Runtime servicer."""
    from hostlib.p4.schema import WORKER_ADDRESSES_TABLE, WORKER_PORTS_TABLE

    def resolve(port: Hashable) -> Neighbor | None:
        pipeline = servicer.pipeline
        if pipeline is None:
            return None
        tables = pipeline.tables
        for entry in list(tables.get(WORKER_PORTS_TABLE, {}).values()):
            if entry.params["port"] != port:
                continue
            worker = (entry.match["job_id"], entry.match["worker_id"])
            for address in list(tables.get(WORKER_ADDRESSES_TABLE, {}).values()):
                if (address.match["job_id"], address.match["worker_id"]) == worker:
                    p = address.params
                    return Neighbor(p["mac"].to_bytes(6, "big"), p["ipv4"].to_bytes(4, "big"), p["udp_port"])
        return None

    return resolve


def parse_worker(entry: int | str, ingress_key: str) -> Hashable:
    """A job's worker in a raw-port config: ``3`` (port 3) or ``"3@10.0.0.1"`` (port 3, that IP)."""
    if ingress_key == "port":
        if isinstance(entry, int) or (isinstance(entry, str) and entry.isdigit()):
            return int(entry)
        raise ValueError(f"worker {entry!r}: with ingress_key 'port' a worker is a port number")
    port, sep, ip = str(entry).partition("@")
    if not sep or not port.isdigit():
        raise ValueError(f"worker {entry!r}: with ingress_key 'port+ip' a worker is 'PORT@IP'")
    return int(port), str(ipaddress.IPv4Address(ip))


def load_neighbors(path: str | Path, ingress_key: str = "port") -> dict[Hashable, Neighbor]:
    """Static worker addresses from the ``[[neighbors]]`` entries of a raw-port config (the softswitch's
    form of the P4 worker-address table): ``port``, ``ip``, ``mac``, ``udp_port``."""
    found: dict[Hashable, Neighbor] = {}
    for i, entry in enumerate(tomllib.loads(Path(path).read_text()).get("neighbors", [])):
        try:
            ip = str(ipaddress.IPv4Address(entry["ip"]))
            key: Hashable = int(entry["port"]) if ingress_key == "port" else (int(entry["port"]), ip)
            found[key] = Neighbor(
                parse_mac(entry["mac"]), ipaddress.IPv4Address(ip).packed, int(entry["udp_port"])
            )
        except KeyError as exc:
            raise ValueError(
                f"{path}: neighbors[{i}]: missing key {exc} (need port, ip, mac, udp_port)"
            ) from None
    return found


def load_rawport_switch(path: str | Path, ingress_key: str = "port") -> SoftSwitch:
    """A SoftSwitch from the TOML of ``softswitch/config.py``, except that ``workers`` name raw ports
    (``[1, 2]``, or ``["1@10.0.0.1", "1@10.0.0.2"]`` with ``ingress_key = "port+ip"``). The same file
    may list ``[[neighbors]]`` (:func:`load_neighbors`)."""
    path = Path(path)
    doc = tomllib.loads(path.read_text())
    switch = SoftSwitch(seed=int(doc.get("seed", 0)))
    for i, job in enumerate(doc.get("jobs", [])):
        try:
            cfg = JobConfig(
                job_id=int(job["job_id"]),
                workers=[parse_worker(w, ingress_key) for w in job["workers"]],
                quorum=job.get("quorum"),
                pool_size=int(job.get("pool_size", 512)),
                elems_per_packet=int(job.get("elems_per_packet", 64)),
            )
            switch.add_job(cfg)
            for drop in job.get("drop", []):
                policy = DropPolicy.from_dict(drop)
                switch.set_drop_policy(cfg.job_id, drop.get("direction", "up"), policy, drop.get("worker"))
        except KeyError as exc:
            raise ValueError(f"{path}: jobs[{i}]: missing key {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: jobs[{i}]: {exc}") from None
    return switch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m softswitch.rawport", description="Run the softswitch on raw network interfaces."
    )
    parser.add_argument("-i", "--interface", action="append", required=True, metavar="N@INTF",
                        help="port number and interface, repeatable (as simple_switch -i)")  # fmt: skip
    parser.add_argument("--ip", required=True, help="the switch's IPv4 address (workers send to IP:48879)")
    parser.add_argument("--mac", default=SWITCH_MAC)
    parser.add_argument("--config", help="TOML jobs file; workers are port numbers")
    parser.add_argument(
        "--p4runtime", metavar="HOST:PORT", help="also serve P4Runtime here, so `lta ctl` programs the jobs"
    )
    parser.add_argument("--ingress-key", choices=INGRESS_KEYS, default="port")
    parser.add_argument("--stats-file", help="write counters and port stats as JSON here on exit")
    args = parser.parse_args(argv)
    if not args.config and not args.p4runtime:
        parser.error("give --config FILE, --p4runtime HOST:PORT, or both: otherwise the switch has no jobs")
    if args.p4runtime and args.ingress_key != "port":
        parser.error("P4Runtime names workers by port number: use --ingress-key port with --p4runtime")
    switch = load_rawport_switch(args.config, args.ingress_key) if args.config else SoftSwitch()
    raw = RawPortSwitch(switch, parse_port_map(args.interface), args.ip, args.mac, args.ingress_key)
    if args.config:
        raw.neighbors.update(load_neighbors(args.config, args.ingress_key))
    grpc_server = None
    banner = f"rawport switch {args.ip} on ports {raw.ports} with jobs {sorted(switch.jobs)}"
    if args.p4runtime:
        from softswitch.p4runtime_server import serve  # grpc only when asked for

        grpc_server, grpc_port, servicer = serve(switch, args.p4runtime, port_key="port")
        raw.resolve = p4runtime_resolver(servicer)
        banner += f", P4Runtime on {args.p4runtime.rpartition(':')[0]}:{grpc_port}"
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    raw.start()
    print(banner, flush=True)
    while not done.wait(1.0):
        pass
    raw.stop()
    if grpc_server is not None:
        grpc_server.stop(None)
    if args.stats_file:
        report = {"ports": dict(raw.stats), "jobs": {j: switch.read_counters(j) for j in switch.jobs}}
        Path(args.stats_file).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
