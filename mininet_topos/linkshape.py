"""Rate limits and random loss on emulated links, as commands for the kernel (tc and nftables).

One :class:`LinkSpec` describes a worker's link: a rate (tbf), and a Bernoulli loss probability per
direction (``up`` = host to switch, ``down`` = switch to host). Loss is applied by the kernel so that
TCP (gloo) and UDP (lta) see the same drops, and where neither end can notice it, as on a wire:

- with **netem** where the kernel has it (``sch_netem``): ``netem loss`` as the root qdisc of the
  sending side of each direction, tbf as its child (netem drops silently);
- otherwise with **nftables** ``numgen random`` rules in the forward path of the bridge that joins
  the links (:func:`nft_bridge_loss_script`), or, for switches reading raw ports, at the host's own
  interface (:func:`nft_device_loss_script`). Never in a host's ``output`` hook: a packet dropped
  there fails the sender's ``send()`` with EPERM and TCP simply resends it, which is not loss.

Only TCP and UDP are dropped (not ARP), so a lossy link cannot stall neighbour resolution.
Segmentation offload is switched off on shaped interfaces (``gso_max_segs 1``): otherwise TCP hands
64 KiB super-packets to the filter and one "packet" drop would remove 40 wire packets at once. That
segmentation happens when the veth transmits, after the qdiscs and the netdev egress hook: a bridge's
forward path sees single datagrams, but netem and :func:`nft_device_loss_script` see a UDP GSO train
(LTA's default I/O) whole and would drop it whole. Senders on such links use one datagram per message
(:func:`per_datagram_env`, ``LTA_IO=mmsg-c``), so a loss is always one datagram.

Everything here builds argument lists and nft scripts; the caller runs them in the right namespace
(``ip netns exec`` for :mod:`mininet_topos.netns`, ``node.cmd`` for Mininet), through a
:data:`Runner`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

# Runs argv (with optional stdin text) where the caller decides; raises on a non-zero exit.
Runner = Callable[[Sequence[str], str | None], str]

PPM = 1_000_000  # nftables loss resolution: parts per million
LOSS_BACKENDS = ("auto", "nftables", "netem")


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link: tbf rate (``None``: unlimited) and random loss per direction."""

    rate_mbit: float | None = 200.0
    loss_up: float = 0.0  # probability a packet from the host towards the switch is dropped
    loss_down: float = 0.0  # probability a packet from the switch towards the host is dropped
    queue_ms: float = 50.0  # tbf queue: packets waiting longer than this are dropped
    burst_bytes: int | None = None  # tbf bucket; None: enough for 1 ms at line rate, at least 32 KiB

    def __post_init__(self) -> None:
        for name in ("loss_up", "loss_down"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} is a probability in [0, 1], got {p}")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive (or None for unlimited), got {self.rate_mbit}")

    @classmethod
    def symmetric(cls, loss: float, rate_mbit: float | None = 200.0, **kw: float) -> LinkSpec:
        return cls(rate_mbit=rate_mbit, loss_up=loss, loss_down=loss, **kw)

    @property
    def burst(self) -> int:
        if self.burst_bytes is not None:
            return self.burst_bytes
        assert self.rate_mbit is not None
        return max(32 * 1024, int(self.rate_mbit * 1e6 / 8 / 1000))


def per_datagram_env(loss_before_segmentation: bool) -> dict[str, str] | None:
    """The environment for LTA processes on a link whose loss is applied before the kernel segments a UDP GSO
    train (netem, or a netdev egress hook): ``LTA_IO=mmsg-c`` unless the caller forced a path already;
    None (inherit) where the loss sees single datagrams (a bridge's forward path)."""
    if not loss_before_segmentation or os.environ.get("LTA_IO"):
        return None
    return {**os.environ, "LTA_IO": "mmsg-c"}


def loss_threshold_ppm(p: float) -> int:
    """The nftables threshold: ``numgen random mod 1000000 < threshold`` holds with probability p."""
    return round(p * PPM)


def disable_offload_argv(dev: str, mtu: int = 1500) -> list[str]:
    """One wire packet per skb on ``dev`` (see the module docstring for why); ``mtu``: the link's."""
    return ["ip", "link", "set", "dev", dev, "gso_max_segs", "1", "gso_max_size", str(max(mtu, 1500))]


def tbf_argv(dev: str, spec: LinkSpec, parent: str = "root") -> list[str]:
    assert spec.rate_mbit is not None
    where = ["root"] if parent == "root" else ["parent", parent]
    return [
        "tc", "qdisc", "replace", "dev", dev, *where, "handle", "20:", "tbf",
        "rate", f"{spec.rate_mbit:g}mbit", "burst", str(spec.burst), "latency", f"{spec.queue_ms:g}ms",
    ]  # fmt: skip


def egress_argvs(dev: str, spec: LinkSpec, loss: float, use_netem: bool) -> list[list[str]]:
    """tc commands shaping the sending side ``dev`` of one direction: netem loss (if used), then tbf."""
    argvs: list[list[str]] = []
    parent = "root"
    if use_netem and loss > 0:
        argvs.append(["tc", "qdisc", "replace", "dev", dev, "root", "handle", "10:", "netem",
                      "loss", f"{loss * 100:.6g}%"])  # fmt: skip
        parent = "10:1"
    if spec.rate_mbit is not None:
        argvs.append(tbf_argv(dev, spec, parent))
    return argvs


def loss_key(dev: str) -> str:
    """The nftables chain suffix for device ``dev`` (chain names cannot hold every interface name)."""
    return "".join(c if c.isalnum() else "_" for c in dev)


def _loss_rules(match: str, p: float) -> list[str]:
    """Count every TCP/UDP packet, then drop a random fraction ``p`` of them and count the drops."""
    rules = [f"    {match} counter"]
    if p > 0:
        rules.append(f"    {match} numgen random mod {PPM} < {loss_threshold_ppm(p)} counter drop")
    return rules


def nft_bridge_loss_script(table: str, links: Mapping[str, LinkSpec]) -> str:
    """An nft script (for ``nft -f -``) dropping packets inside a Linux bridge, per bridge port.

    ``links`` maps a bridge port to its link: ``loss_up`` applies to what the port receives from its
    host, ``loss_down`` to what the bridge sends to it. Dropped in the middle of the path, neither end
    can tell the drop from a lost packet on a wire, which is what TCP's loss recovery must face."""
    lines = [f"table bridge {table} {{", "  chain links {",
             "    type filter hook forward priority 0; policy accept;"]  # fmt: skip
    for dev in links:
        lines += [
            f'    iifname "{dev}" jump up_{loss_key(dev)}',
            f'    oifname "{dev}" jump down_{loss_key(dev)}',
        ]
    lines.append("  }")
    for dev, spec in links.items():
        for direction, p in (("up", spec.loss_up), ("down", spec.loss_down)):
            lines += [f"  chain {direction}_{loss_key(dev)} {{", *_loss_rules(_L4, p), "  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def nft_device_loss_script(table: str, dev: str, spec: LinkSpec) -> str:
    """An nft script dropping packets at a host's own interface (netdev egress for up, ingress for down).

    For switches that read their ports with packet sockets (BMv2, softswitch raw ports), which see a
    frame before any ingress hook on the switch side could drop it. A UDP sender does not notice an
    egress drop; a TCP sender does (its cwnd shrinks and it resends at once), so compare TCP only on
    bridged links (:func:`nft_bridge_loss_script`)."""
    lines = [f"table netdev {table} {{"]
    # Down counts only frames addressed to this host: a bridge floods unknown unicast to every port,
    # and those copies were never the host's traffic.
    directions = (
        ("up", "egress", "", spec.loss_up),
        ("down", "ingress", "meta pkttype host ", spec.loss_down),
    )
    for direction, hook, to_host, p in directions:
        lines += [
            f"  chain {direction}_{loss_key(dev)} {{",
            f'    type filter hook {hook} device "{dev}" priority 0; policy accept;',
            *_loss_rules(f"{to_host}ip protocol {{ tcp, udp }}", p),
            "  }",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"


_L4 = "meta l4proto { tcp, udp }"


@dataclass(frozen=True)
class LossCounters:
    """Packets seen and dropped by a link's nftables loss rules, per direction."""

    seen_up: int = 0
    dropped_up: int = 0
    seen_down: int = 0
    dropped_down: int = 0

    def loss_rate(self, direction: str) -> float:
        seen, dropped = getattr(self, f"seen_{direction}"), getattr(self, f"dropped_{direction}")
        return dropped / seen if seen else 0.0


def parse_loss_counters(nft_json: str) -> dict[str, LossCounters]:
    """Counters of ``nft -j list table ...`` per link, keyed by :func:`loss_key` of the device."""
    totals: dict[str, dict[str, int]] = {}
    for item in json.loads(nft_json)["nftables"]:
        rule = item.get("rule")
        direction, _, key = rule["chain"].partition("_") if rule else ("", "", "")
        if direction not in ("up", "down"):
            continue
        exprs = rule["expr"]
        packets = next((e["counter"]["packets"] for e in exprs if "counter" in e), 0)
        kind = "dropped" if any("drop" in e for e in exprs) else "seen"
        link = totals.setdefault(key, {})
        link[f"{kind}_{direction}"] = link.get(f"{kind}_{direction}", 0) + packets
    return {key: LossCounters(**fields) for key, fields in totals.items()}


def shape_egress(
    run: Runner, dev: str, spec: LinkSpec, loss: float, use_netem: bool, mtu: int = 1500
) -> None:
    """Shape the sending side ``dev`` of one direction: offload off, netem loss (if used), tbf."""
    run(disable_offload_argv(dev, mtu), None)
    for argv in egress_argvs(dev, spec, loss, use_netem):
        run(argv, None)


def resolve_backend(backend: str) -> bool:
    """True when loss should use netem. ``auto`` picks netem only where the kernel has it."""
    if backend not in LOSS_BACKENDS:
        raise ValueError(f"loss backend must be one of {LOSS_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return netem_available()
    if backend == "netem" and not netem_available():
        raise RuntimeError(
            "this kernel has no netem (sch_netem): use loss backend 'nftables' (or 'auto'), "
            "or load the module with `modprobe sch_netem`"
        )
    return backend == "netem"


@functools.cache
def netem_available() -> bool:
    """Whether ``tc qdisc ... netem`` works here: tried once on the loopback of a scratch namespace."""
    ns = f"ltaprobe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    try:
        probe = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "loss", "0%"],
            capture_output=True,
        )
        return probe.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
