"""Leaf-spine: two leaves (plain Linux bridges) with half the workers each, one spine (the LTA switch).

::

    h1 h2 ...        ... hN
     \\ |              | /
     leaf1          leaf2        (Linux bridges: forwarding only)
         \\          /
          spine (port 1: leaf1, port 2: leaf2; BMv2 or softswitch, 10.0.0.254)

Aggregation happens at the spine, so the workers behind one leaf share a spine port. BMv2's worker
check accepts that (it keys workers by (job, worker id) and compares the port); the softswitch
identifies a worker by its ingress, so it runs with ``ingress_key = "port+ip"`` and a jobs file.
"""

from __future__ import annotations

from typing import Any

from mininet_topos.addressing import add_worker_host
from mininet_topos.mnenv import import_mininet

import_mininet()
from mininet.nodelib import LinuxBridge  # noqa: E402
from mininet.topo import Topo  # noqa: E402


def leaf_of(worker: int, n_hosts: int) -> int:
    """0 for the first half of the workers (rounded up), 1 for the rest."""
    return 0 if worker < (n_hosts + 1) // 2 else 1


class LeafSpineTopo(Topo):
    def build(self, n_hosts: int, prefix: str, switch_cls: type, switch_params: dict[str, Any]) -> None:
        spine = self.addSwitch(f"{prefix}sp1", cls=switch_cls, **switch_params)
        leaves = [self.addSwitch(f"{prefix}lf{j + 1}", cls=LinuxBridge) for j in range(2)]
        for j, leaf in enumerate(leaves):
            self.addLink(leaf, spine, port2=j + 1)
        for i in range(n_hosts):
            host = add_worker_host(self, prefix, i)
            self.addLink(host, leaves[leaf_of(i, n_hosts)])

    @staticmethod
    def worker_ports(n_hosts: int) -> list[int]:
        """The spine port each worker's packets arrive on: its leaf's uplink."""
        return [leaf_of(i, n_hosts) + 1 for i in range(n_hosts)]
