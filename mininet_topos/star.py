"""Star: N worker hosts on one LTA switch (BMv2 or softswitch), worker i on switch port i+1.

::

    h1 ─┐
    h2 ─┤ s1 (LTA switch, 10.0.0.254)
    ... │
    hN ─┘
"""

from __future__ import annotations

from typing import Any

from mininet_topos.addressing import add_worker_host
from mininet_topos.mnenv import import_mininet

import_mininet()
from mininet.topo import Topo  # noqa: E402


class StarTopo(Topo):
    """``n_hosts`` hosts named ``<prefix>h1..`` with 10.0.0.1.., on switch ``<prefix>s1`` of class
    ``switch_cls`` (params ``switch_params``)."""

    def build(self, n_hosts: int, prefix: str, switch_cls: type, switch_params: dict[str, Any]) -> None:
        switch = self.addSwitch(f"{prefix}s1", cls=switch_cls, **switch_params)
        for i in range(n_hosts):
            host = add_worker_host(self, prefix, i)
            self.addLink(host, switch, port2=i + 1)

    @staticmethod
    def worker_ports(n_hosts: int) -> list[int]:
        """The switch port each worker sends from (what the control plane's worker check expects)."""
        return [i + 1 for i in range(n_hosts)]
