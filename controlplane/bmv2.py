"""Run BMv2's ``simple_switch_grpc`` locally on veth pairs, for tests, benchmarks and demos.

Each switch port ``i`` is a veth pair ``<prefix><i>s`` (given to the switch as ``-i i@<prefix><i>s``)
and ``<prefix><i>h`` (where :meth:`Bmv2Switch.send` injects frames and :meth:`Bmv2Switch.receive`
captures what the switch sends). The switch process is stopped by its PID and the veths deleted by
name; nothing else on the machine is touched. Needs root (veths, AF_PACKET sockets).
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from controlplane.jobs import WorkerSpec
from hostlib.protocol import LTA_PORT

ETH_P_ALL = 0x0003
SWITCH_MAC = "02:00:00:00:ff:ff"  # the address workers send to; egress echoes it as the source
SWITCH_IP = "10.0.255.254"


def host_worker(port: int) -> WorkerSpec:
    """The worker attached to switch port ``port`` in local harnesses: predictable addresses."""
    return WorkerSpec(port=port, mac=f"02:00:00:00:00:{port:02x}", ip=f"10.0.0.{port}", udp_port=40000 + port)


def worker_frame(lta: bytes, worker: WorkerSpec) -> bytes:
    """Ethernet / IPv4 / UDP to the switch's LTA port, from ``worker``, carrying LTA bytes."""
    frame = (
        Ether(src=worker.mac, dst=SWITCH_MAC)
        / IP(src=worker.ip, dst=SWITCH_IP)
        / UDP(sport=worker.udp_port, dport=LTA_PORT)
        / Raw(lta)
    )
    return bytes(frame)


def lta_of(frame: bytes) -> tuple[bytes, Ether] | None:
    """The LTA bytes (UDP payload) of a frame the switch sent, with the parsed frame; None if not UDP."""
    packet = Ether(frame)
    if UDP not in packet:
        return None
    udp = packet[UDP]
    return bytes(udp.payload)[: udp.len - 8], packet


def bmv2_missing() -> str | None:
    """Why BMv2 cannot run here, or None when it can."""
    if shutil.which("simple_switch_grpc") is None:
        return (
            "simple_switch_grpc is not on PATH (build BMv2 with PI from p4lang's sources: "
            "README, 'BMv2 and p4c')"
        )
    if os.geteuid() != 0:
        return "BMv2 on veth pairs needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    return None


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Bmv2Switch:
    """``simple_switch_grpc`` with ``n_ports`` veth ports numbered 1..n_ports, no program loaded
    (the control plane loads it: ``LtaSwitch.load_pipeline``)."""

    def __init__(self, n_ports: int, prefix: str | None = None, grpc_port: int | None = None) -> None:
        if not 1 <= n_ports <= 32:
            raise ValueError("n_ports must be in 1..32")
        # Interface names are at most 15 characters: prefix + port number + one letter.
        self.prefix = prefix or f"lb{os.getpid() % 100000}x"
        if len(self.prefix) > 11:
            raise ValueError(f"veth prefix {self.prefix!r} is too long (at most 11 characters)")
        self.n_ports = n_ports
        self.grpc_port = grpc_port or free_tcp_port()
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.process: subprocess.Popen | None = None
        self.log_dir = Path(tempfile.mkdtemp(prefix="lta-bmv2-"))
        self._sockets: dict[int, socket.socket] = {}
        self._veths: list[str] = []

    def switch_side(self, port: int) -> str:
        return f"{self.prefix}{port}s"

    def host_side(self, port: int) -> str:
        return f"{self.prefix}{port}h"

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = 20.0) -> Bmv2Switch:
        missing = bmv2_missing()
        if missing:
            raise RuntimeError(missing)
        try:
            for port in range(1, self.n_ports + 1):
                self._add_veth(port)
            cmd = ["simple_switch_grpc", "--no-p4", "--device-id", "0", "--log-console", "-L", "off"]
            # Own Thrift port and notification socket: several switches may run at once (a tree).
            cmd += ["--thrift-port", str(free_tcp_port())]
            cmd += ["--notifications-addr", f"ipc://{self.log_dir}/notifications.ipc"]
            for port in range(1, self.n_ports + 1):
                cmd += ["-i", f"{port}@{self.switch_side(port)}"]
            cmd += ["--", "--grpc-server-addr", self.target]
            log = open(self.log_dir / "simple_switch_grpc.log", "w")  # closed with the process
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            self._wait_listening(timeout_s)
        except BaseException:
            self.stop(keep_log=True)
            raise
        return self

    def _add_veth(self, port: int) -> None:
        sw, host = self.switch_side(port), self.host_side(port)
        # A run killed before its cleanup leaves its veths behind: same name, so ours to remove.
        subprocess.run(["ip", "link", "del", sw], capture_output=True, check=False)
        _ip("link", "add", sw, "type", "veth", "peer", "name", host)
        self._veths.append(sw)
        for name in (sw, host):
            # No IPv6 chatter (router solicitations, MLD) on the test ports.
            subprocess.run(
                ["sysctl", "-q", "-w", f"net.ipv6.conf.{name}.disable_ipv6=1"],
                capture_output=True,
                check=False,
            )
            _ip("link", "set", name, "up", "mtu", "9000")
        # Protocol 0 until bound: a socket opened for ETH_P_ALL would queue every interface's traffic
        # (loopback included) until bind restricts it to ours.
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        s.bind((host, ETH_P_ALL))
        s.setblocking(False)
        self._sockets[port] = s

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"simple_switch_grpc exited early; see {self.log_dir}/simple_switch_grpc.log"
                )
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.grpc_port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"simple_switch_grpc did not listen on {self.target} within {timeout_s:g} s")

    def stop(self, keep_log: bool = False) -> None:
        """Stop the switch (by PID) and delete our veths (by name); the log goes unless ``keep_log``."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # by PID: only the process this object started
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None
        for s in self._sockets.values():
            s.close()
        self._sockets.clear()
        for name in self._veths:
            subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
        self._veths.clear()
        if not keep_log:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Bmv2Switch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- frames ---------------------------------------------------------------------------------
    def send(self, port: int, frame: bytes) -> None:
        self._sockets[port].send(frame)

    def exchange(
        self, port: int, frame: bytes, expected: int, timeout_s: float = 2.0
    ) -> list[tuple[int, bytes]]:
        """Send one frame in on ``port`` and return the frames it caused (see :meth:`receive`)."""
        self.send(port, frame)
        return self.receive(expected, timeout_s)

    def drain(self) -> None:
        """Discard frames already waiting on the host sides."""
        self.receive(expected=0, quiet_s=0.02)

    def receive(
        self, expected: int, timeout_s: float = 2.0, quiet_s: float = 0.05
    ) -> list[tuple[int, bytes]]:
        """Frames the switch sent, as (port, frame): waits for ``expected`` frames (up to ``timeout_s``),
        then ``quiet_s`` more to catch any unexpected extra."""
        got: list[tuple[int, bytes]] = []
        by_fd = {s.fileno(): port for port, s in self._sockets.items()}
        deadline = time.monotonic() + timeout_s
        quiet_until = None
        while True:
            now = time.monotonic()
            if len(got) >= expected and quiet_until is None:
                quiet_until = now + quiet_s
            end = quiet_until if quiet_until is not None else deadline
            if now >= end:
                return got
            ready, _, _ = select.select(list(by_fd), [], [], end - now)
            for fd in ready:
                port = by_fd[fd]
                while True:
                    try:
                        frame, addr = self._sockets[port].recvfrom(65535)
                    except BlockingIOError:
                        break
                    if addr[0] != self.host_side(port) or addr[2] == socket.PACKET_OUTGOING:
                        continue  # another interface's frame, or our own send on this host side
                    got.append((port, frame))
