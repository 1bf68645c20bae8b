"""Shared fixtures: a softswitch on loopback and a set of workers that reduce in threads."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from hostlib import codec
from hostlib.dropmodels import DropPolicy
from hostlib.transport import Fallback, LtaWorker, ReduceResult, TransportConfig
from softswitch.pipeline import JobConfig, SoftSwitch
from softswitch.server import SoftSwitchServer


@dataclass
class Cluster:
    switch: SoftSwitch
    server: SoftSwitchServer
    workers: list[LtaWorker]
    job_id: int

    def reduce_all(self, inputs: list[np.ndarray], **kwargs) -> list[ReduceResult]:
        """Every worker reduces its input concurrently (one thread each); returns their results."""
        return run_workers(self.workers, lambda w, i: w.allreduce(inputs[i], **kwargs))


def check_mean_over_bitmap(results: list[ReduceResult], inputs: list[np.ndarray], k: int) -> int:
    """Every chunk that got a RESULT equals numpy's float64 mean over exactly the workers in its bitmap
    (all of them among the ``len(inputs)`` workers), within the codec's bound plus float32 rounding.
    Returns how many chunks were checked."""
    stacked = np.stack(inputs).astype(np.float64)
    checked = 0
    for r in results:
        bound = codec.error_bound(r.shift)
        for c in np.flatnonzero(r.fallback == Fallback.NONE):
            who = r.contributors(c)
            assert len(who) == r.count[c] > 0
            assert max(who) < len(inputs)
            lo, hi = c * k, min((c + 1) * k, stacked.shape[1])
            expected = stacked[who, lo:hi].mean(axis=0)
            tolerance = bound[c] + np.abs(expected) * 2**-23  # float32 output: its rounding on top
            assert np.all(np.abs(r.values[lo:hi] - expected) <= tolerance), (c, who)
            checked += 1
    return checked


def run_workers(workers: list[LtaWorker], fn: Callable[[LtaWorker, int], object]) -> list:
    results: list = [None] * len(workers)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            results[i] = fn(workers[i], i)
        except BaseException as exc:  # surfaced below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker hung past 120 s"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    """make_cluster(n, up=0.0, down=0.0, job_id=1, quorum=None, **transport_config) -> Cluster."""
    made: list[Cluster] = []
    switches: dict[int, tuple[SoftSwitch, SoftSwitchServer]] = {}

    def make(
        n: int,
        *,
        up: float = 0.0,
        down: float = 0.0,
        job_id: int = 1,
        quorum: int | None = None,
        seed: int = 0,
        shared_with: Cluster | None = None,
        **config,
    ) -> Cluster:
        if shared_with is not None:
            switch, server = shared_with.switch, shared_with.server
        else:
            switch = SoftSwitch(seed=seed)
            server = SoftSwitchServer(switch).start()
            switches[id(switch)] = (switch, server)
        cfg = TransportConfig(seed=seed, **config)
        workers = [LtaWorker(job_id, w, n, server.address, config=cfg) for w in range(n)]
        switch.add_job(
            JobConfig(
                job_id,
                [w.address for w in workers],
                quorum=quorum,
                pool_size=cfg.pool_size,
                elems_per_packet=cfg.elems_per_packet,
            )
        )
        if up:
            switch.set_drop_policy(job_id, "up", DropPolicy(p=up))
        if down:
            switch.set_drop_policy(job_id, "down", DropPolicy(p=down))
        cluster = Cluster(switch, server, workers, job_id)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        for w in cluster.workers:
            w.close()
    for _, server in switches.values():
        server.stop()


def netns_skip_reason() -> str | None:
    """Why tests that build network namespaces cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc", "nft") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)}: apt-get install -y iproute2 nftables"
    probe = subprocess.run(["ip", "netns", "add", f"ltaskip-{os.getpid()}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"ltaskip-{os.getpid()}"], capture_output=True)
    return None


@pytest.fixture
def udp() -> Iterator:
    """Makes bound loopback UDP sockets (4 MiB receive buffers) and closes them afterwards."""
    made: list[socket.socket] = []

    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.bind(("127.0.0.1", 0))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
