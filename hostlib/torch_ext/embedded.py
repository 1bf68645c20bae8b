"""The embedded softswitch: with no ``LTA_SWITCH``, rank 0 hosts the switch in a thread on loopback.

This is the one place in :mod:`hostlib.torch_ext` that imports :mod:`softswitch` (the layer contract in
pyproject.toml allows it by name), so a user who points ``LTA_SWITCH`` at a P4 switch or a softswitch
daemon never loads it, and the rest of the torch layer depends only on the host library.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

from hostlib.batchio import addr_key, gro_coalesces
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.liveness import LivenessMonitor
from softswitch.pipeline import JobConfig, SoftSwitch
from softswitch.server import MAX_SOCKETS, SoftSwitchServer

# The switch thread shares the GIL with this rank's training and its own LTA worker. Python hands the GIL
# to a waiting thread only every sys.getswitchinterval() (5 ms by default), so a batch of packets that
# reached the switch while the worker ran Python could wait that long: every round trip of the rank's
# peers too. While the switch runs, the interval is this (restored on stop).
SWITCH_INTERVAL_S = 0.0005


class EmbeddedSwitch:
    """A softswitch serving UDP on ``listen`` from a background thread, configured in-process."""

    def __init__(self, seed: int, listen: tuple[str, int], sockets: int = 1, packet_bytes: int = 0) -> None:
        # Receive sockets (up to MAX_SOCKETS; softswitch/server.py), join_job gives one per rank: each
        # gets a whole net.core.rmem_max of buffer, so the windows need not shrink where the process
        # cannot raise it. ``packet_bytes``: the job's datagrams; where they are too large to coalesce
        # (64 KiB on loopback) the switch receives them without GRO, straight into its rows.
        sockets = max(1, min(sockets, MAX_SOCKETS))
        gro = not packet_bytes or gro_coalesces(packet_bytes)
        self.server = SoftSwitchServer(SoftSwitch(seed=seed), listen, sockets=sockets, gro=gro).start()
        self.address: tuple[str, int] = self.server.address
        self.monitors: list[LivenessMonitor] = []
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, SWITCH_INTERVAL_S))

    @property
    def rcvbuf_bytes(self) -> int:
        """The switch socket's receive buffer as the kernel reports it (twice the usable bytes)."""
        return self.server.rcvbuf_bytes

    @property
    def sockets(self) -> int:
        """How many receive sockets the switch reads (worker w's packets land in socket w mod this)."""
        return self.server.sockets

    @property
    def switch(self) -> SoftSwitch:
        return self.server.switch

    def add_job(
        self,
        job_id: int,
        workers: list[tuple[str, int]],
        *,
        pool_size: int,
        elems_per_packet: int,
        drop: dict[str, DropPolicy] | None = None,
        quorum: int | None = None,
        liveness_timeout_s: float = 0.0,
    ) -> None:
        """Add a job whose worker ``w`` sends from ``workers[w]``, with emulated loss per direction and
        rounds that close at ``quorum`` contributions (None: all workers). ``liveness_timeout_s`` > 0: a
        liveness monitor (hostlib/liveness.py) marks a worker silent that long offline and lowers the
        quorum to the live workers, so the survivors of a dead worker close their rounds as soon as their
        own packets are in instead of waiting a deadline and a FLUSH for every unit."""
        job = JobConfig(
            job_id, list(workers), quorum=quorum, pool_size=pool_size, elems_per_packet=elems_per_packet
        )
        self.switch.add_job(job)
        for direction, policy in (drop or {}).items():
            self.switch.set_drop_policy(job_id, direction, policy)
        if liveness_timeout_s > 0:
            self.monitors.append(
                LivenessMonitor(
                    self.switch,
                    job_id,
                    len(workers),
                    quorum=quorum,
                    timeout_s=liveness_timeout_s,
                    poll_s=min(0.25, liveness_timeout_s / 4),
                ).start()
            )

    def uplink(self, worker: tuple[str, int]) -> Callable[[np.ndarray], int]:
        """For the worker of this process at address ``worker`` (as the job lists it): a function that
        hands its packets to the switch in the caller's thread (``SoftSwitchServer.local_port``)."""
        return self.server.local_port(addr_key(worker))

    def stop(self) -> None:
        for monitor in self.monitors:
            monitor.stop()
        self.server.stop()
        sys.setswitchinterval(self._interval)
