"""Mininet switch nodes for LTA: BMv2 (``simple_switch_grpc``) or the softswitch on raw ports.

Both run one process in the root namespace that serves the node's interfaces as numbered ports
(``-i N@intf``, Mininet's port numbers) and a P4Runtime endpoint on loopback, so the same control plane
(:mod:`controlplane`) programs either. The process is started and stopped by PID; its output goes to
a log file whose tail is quoted when the switch fails to come up.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mininet_topos.mnenv import import_mininet

import_mininet()
from mininet.node import Switch  # noqa: E402  (importable only after import_mininet)

from hostlib.p4.schema import BMV2_JSON_PATH  # noqa: E402
from hostlib.protocol import SWITCH_MAC  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SWITCH_KINDS = ("softswitch", "bmv2")


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bmv2_problem() -> str | None:
    """Why the BMv2 switch cannot run here, or None."""
    if shutil.which("simple_switch_grpc") is None:
        return (
            "simple_switch_grpc is not on PATH: build BMv2 with PI from p4lang's sources "
            "(README, 'BMv2 and p4c')"
        )
    if not BMV2_JSON_PATH.exists():
        return f"{BMV2_JSON_PATH} is missing: compile p4/v1model with p4c-bm2-ss (p4/README.md)"
    return None


class LtaSwitchNode(Switch):
    """A switch whose data plane is an external process serving its interfaces as raw ports.

    ``switch_ip``/``switch_mac`` are the address workers send to; ``grpc_port`` the P4Runtime port on
    127.0.0.1; ``log_dir`` where the process's output goes."""

    kind = "abstract"

    def __init__(
        self,
        name: str,
        switch_ip: str = "10.0.0.254",
        switch_mac: str = SWITCH_MAC,
        grpc_port: int | None = None,
        log_dir: str = "/tmp",
        **params: Any,
    ) -> None:
        super().__init__(name, **params)
        self.switch_ip, self.switch_mac = switch_ip, switch_mac
        self.grpc_port = grpc_port or free_tcp_port()
        self.log_path = Path(log_dir) / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def port_map(self) -> dict[int, str]:
        return {self.ports[intf]: intf.name for intf in self.intfList() if intf.name != "lo"}

    def port_args(self) -> list[str]:
        return [arg for number, intf in sorted(self.port_map().items()) for arg in ("-i", f"{number}@{intf}")]

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self, controllers: list[Any]) -> None:
        for intf in self.intfList():
            if intf.name != "lo":
                self.cmd("ip", "link", "set", "dev", intf.name, "up")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Wait until the P4Runtime port accepts connections; raise with the log's tail otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} switch {self.name} exited early:\n{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.grpc_port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(
            f"{self.kind} switch {self.name} did not open P4Runtime on {self.grpc_target} within "
            f"{timeout_s:g} s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, deleteIntfs: bool = True) -> None:  # noqa: N803  (Mininet's signature)
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the session we started for it
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5)
        super().stop(deleteIntfs)


class SoftRawSwitch(LtaSwitchNode):
    """The softswitch (``python -m softswitch.rawport``) on the node's interfaces.

    ``config``: a jobs TOML instead of (or besides) P4Runtime, with ``ingress_key`` ``"port+ip"`` where
    several workers share a port (leaf-spine); ``stats_file``: counters written there on exit."""

    kind = "softswitch"

    def __init__(
        self,
        name: str,
        config: str | None = None,
        ingress_key: str = "port",
        stats_file: str | None = None,
        **params: Any,
    ) -> None:
        self.config, self.ingress_key, self.stats_file = config, ingress_key, stats_file
        super().__init__(name, **params)

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "softswitch.rawport", *self.port_args(), "--ip", self.switch_ip,
                "--mac", self.switch_mac, "--ingress-key", self.ingress_key]  # fmt: skip
        if self.config:
            argv += ["--config", self.config]
        if self.ingress_key == "port":
            argv += ["--p4runtime", self.grpc_target]
        if self.stats_file:
            argv += ["--stats-file", self.stats_file]
        return argv

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        if self.ingress_key == "port":
            return super().wait_ready(timeout_s)
        deadline = time.monotonic() + timeout_s  # no P4Runtime: ready once it printed its banner
        while "rawport switch" not in self.log_tail(5):
            if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"softswitch {self.name} did not start:\n{self.log_tail()}")
            time.sleep(0.1)
        return None


class Bmv2Switch(LtaSwitchNode):
    """BMv2's ``simple_switch_grpc`` with no program: the control plane pushes p4/build's JSON."""

    kind = "bmv2"

    def __init__(self, name: str, device_id: int = 0, **params: Any) -> None:
        self.device_id = device_id
        self.thrift_port = free_tcp_port()
        super().__init__(name, **params)

    def argv(self) -> list[str]:
        return ["simple_switch_grpc", "--device-id", str(self.device_id), *self.port_args(),
                "--thrift-port", str(self.thrift_port), "--no-p4",
                "--", "--grpc-server-addr", self.grpc_target]  # fmt: skip
