"""A leaf-spine tree of network namespaces: L leaf switches with their workers and one spine, every switch
a host of its own (a UDP softswitch runs there), lossy links at both levels.

::

    h0 h1 ..  (10.79.1.x)       h_W ..  (10.79.2.x)         workers
     ╲  │  ╱                     ╲  │  ╱        worker links: loss ``worker_link``
      bl0 ── d0 ─ leaf0           bl1 ── d1 ─ leaf1       leaf j: eth0 10.79.(j+1).254 (its workers' side)
                   │ eth1 10.79.0.1             │ eth1 10.79.0.2
                   u0 ─────────── bs ───────── u1         uplinks: loss ``uplink``
                                   │ sp
                                 spine (10.79.0.254)

The bridges (``bs`` for the spine's segment, ``bl<j>`` for leaf j's) live in one namespace (``-br``);
each switch and each worker has its own. A worker talks only to its leaf and a leaf to its workers and
the spine, so each segment is one /24 and nothing is routed. Loss comes from nftables ``numgen random``
rules in the bridges' forward path (:func:`~mininet_topos.linkshape.nft_bridge_loss_script`), per port
and direction: worker ports drop with ``worker_link`` (GRADs up, RESULT replicas down), leaf uplink
ports with ``uplink`` (partials up, the spine's RESULTs down); the spine's and the leaves' down ports
are lossless, so every packet meets its level's loss once. A bridge's forward path sees single
datagrams (segmentation happens before it), so GSO trains need no special care here.

Names: ``<prefix>-<pid>-<tag>-<role>`` as in :mod:`mininet_topos.netns`, so :func:`netns.remove_stale`
reclaims a killed run's namespaces and ``leftovers(prefix)`` lists what a run left behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mininet_topos.linkshape import (
    LinkSpec,
    LossCounters,
    loss_key,
    nft_bridge_loss_script,
    parse_loss_counters,
    shape_egress,
)
from mininet_topos.netns import (
    DEFAULT_PREFIX,
    LOSS_TABLE,
    Host,
    NamespaceSet,
    NetnsError,
    require_root,
    run_checked,
)

MAX_TREE_LEAVES = 32  # one /24 per leaf below 10.x.(j+1); the protocol's MAX_LEAVES is 32 as well
MAX_WORKERS_PER_LEAF = 250
UPLINK_DEV = "eth1"
SPINE_BRIDGE = "bs"
LOSSLESS = LinkSpec(rate_mbit=None)


@dataclass(frozen=True)
class Leaf:
    """Leaf switch j: its namespace, its address towards its workers (``ip``, eth0) and towards the
    spine (``uplink_ip``, eth1)."""

    index: int
    netns: str
    ip: str
    uplink_ip: str

    @property
    def host(self) -> Host:
        return Host(f"leaf{self.index}", self.netns, self.ip)


class NetnsTree(NamespaceSet):
    """Leaf j serves ``leaf_sizes[j]`` workers, in order: ``workers[w]`` is global worker w, the first
    ``leaf_sizes[0]`` behind leaf 0 and so on; one spine. See the module doc. Loss is always nftables'
    in the bridges (no netem), so both levels drop alike."""

    def __init__(
        self,
        leaf_sizes: Sequence[int],
        worker_link: LinkSpec | None = None,
        uplink: LinkSpec | None = None,
        *,
        subnet: str = "10.79",
        prefix: str = DEFAULT_PREFIX,
        max_runtime_s: float = 600.0,
    ) -> None:
        if not 1 <= len(leaf_sizes) <= MAX_TREE_LEAVES:
            raise ValueError(f"a tree has 1..{MAX_TREE_LEAVES} leaves, got {len(leaf_sizes)}")
        if not all(1 <= size <= MAX_WORKERS_PER_LEAF for size in leaf_sizes):
            raise ValueError(f"every leaf serves 1..{MAX_WORKERS_PER_LEAF} workers, got {list(leaf_sizes)}")
        super().__init__(prefix, max_runtime_s)
        self.worker_link = worker_link or LinkSpec(rate_mbit=None)
        self.uplink = uplink or LinkSpec(rate_mbit=None)
        self.bridge_ns = f"{self.tag}-br"
        self.spine = Host("spine", f"{self.tag}-sp", f"{subnet}.0.254")
        self.leaves = [
            Leaf(j, f"{self.tag}-l{j}", f"{subnet}.{j + 1}.254", f"{subnet}.0.{j + 1}")
            for j in range(len(leaf_sizes))
        ]
        self.workers: list[Host] = []
        self._leaf_of: list[int] = []
        for j, size in enumerate(leaf_sizes):
            for i in range(size):
                w = len(self.workers)
                self.workers.append(Host(f"h{w}", f"{self.tag}-h{w}", f"{subnet}.{j + 1}.{i + 1}"))
                self._leaf_of.append(j)

    def leaf_of(self, worker: int) -> Leaf:
        return self.leaves[self._leaf_of[worker]]

    # ---- building ------------------------------------------------------------------------------
    def setup(self) -> None:
        require_root()
        for ns in [self.bridge_ns, self.spine.netns, *(lf.netns for lf in self.leaves),
                   *(h.netns for h in self.workers)]:  # fmt: skip
            self.add_namespace(ns)
        for bridge in [SPINE_BRIDGE, *(f"bl{lf.index}" for lf in self.leaves)]:
            self._ns(self.bridge_ns, "ip", "link", "add", bridge, "type", "bridge")
            self._ns(self.bridge_ns, "ip", "link", "set", bridge, "up")
        links: dict[str, LinkSpec] = {}
        self._attach(self.spine.netns, "eth0", self.spine.ip, "sp", SPINE_BRIDGE, LOSSLESS)
        for lf in self.leaves:
            self._attach(lf.netns, UPLINK_DEV, lf.uplink_ip, f"u{lf.index}", SPINE_BRIDGE, self.uplink)
            self._attach(lf.netns, "eth0", lf.ip, f"d{lf.index}", f"bl{lf.index}", LOSSLESS)
            links[f"u{lf.index}"] = self.uplink
        for w, host in enumerate(self.workers):
            leaf = self.leaf_of(w)
            self._attach(host.netns, host.dev, host.ip, self.port_of(w), f"bl{leaf.index}", self.worker_link)
            links[self.port_of(w)] = self.worker_link
        self._ns(self.bridge_ns, "nft", "-f", "-", stdin=nft_bridge_loss_script(LOSS_TABLE, links))
        self.start_watchdog()

    def port_of(self, worker: int) -> str:
        """The bridge port of worker ``worker``'s link."""
        return f"w{worker}"

    def _attach(self, ns: str, dev: str, ip: str, port: str, bridge: str, spec: LinkSpec) -> None:
        run_checked(["ip", "link", "add", dev, "netns", ns, "type", "veth",
                     "peer", "name", port, "netns", self.bridge_ns])  # fmt: skip
        self._ns(self.bridge_ns, "ip", "link", "set", port, "master", bridge)
        self._ns(self.bridge_ns, "ip", "link", "set", port, "up")
        self._ns(ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
        self._ns(ns, "ip", "link", "set", dev, "up")
        # Rate (tbf, when the spec has one) on the sending side of each direction; loss is the bridge's.
        shape_egress(lambda argv, stdin: self._ns(ns, *argv, stdin=stdin), dev, spec, 0.0, False)
        shape_egress(lambda argv, stdin: self._ns(self.bridge_ns, *argv, stdin=stdin), port, spec, 0.0, False)

    # ---- what happened on the links ------------------------------------------------------------
    def loss_counters(self) -> dict[str, LossCounters]:
        """Packets seen and dropped per lossy link: ``"w<i>"`` worker i's, ``"u<j>"`` leaf j's uplink."""
        if not self._created:
            raise NetnsError(f"network {self.tag} is not set up")
        listing = self.check(self.bridge_ns, ["nft", "-j", "list", "table", "bridge", LOSS_TABLE])
        counters = parse_loss_counters(listing)
        names = [
            *(f"u{lf.index}" for lf in self.leaves),
            *(self.port_of(w) for w in range(len(self.workers))),
        ]
        return {name: counters.get(loss_key(name), LossCounters()) for name in names}
