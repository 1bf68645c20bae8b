"""Addresses of the emulated workers and switch, shared by the topologies and the demo's control plane
(which must tell the switch where each worker is before any packet flows)."""

from __future__ import annotations

from typing import Any

SUBNET = "10.0.0"
SWITCH_IP = f"{SUBNET}.254"
WORKER_UDP_BASE = 40000  # worker w sends from and receives on UDP port WORKER_UDP_BASE + w


def worker_ip(w: int) -> str:
    return f"{SUBNET}.{w + 1}"


def worker_mac(w: int) -> str:
    return f"02:00:00:00:{(w + 1) >> 8:02x}:{(w + 1) & 0xFF:02x}"


def worker_udp_port(w: int) -> int:
    return WORKER_UDP_BASE + w


def add_worker_host(topo: Any, prefix: str, w: int) -> str:
    """Add worker ``w`` to a Mininet ``Topo`` as ``<prefix>h<w+1>``; returns its name."""
    return topo.addHost(f"{prefix}h{w + 1}", ip=f"{worker_ip(w)}/24", mac=worker_mac(w))
