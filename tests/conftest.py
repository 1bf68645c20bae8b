"""Shared fixtures: a softswitch on loopback and a set of workers that reduce in threads."""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.transport import Fallback, LtaWorker, ReduceResult, TransportConfig
from hostlib.verify import slack_bits
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

    @property
    def slack_bits(self) -> int:
        """How much coarser than the exponent round's bound a result may be, in bits, by the workers'
        config (speculated exponents: docs/protocol.md; hostlib.verify.slack_bits)."""
        return slack_bits(self.workers[0].config)


Expected = int | tuple[int, int | None]  # an exact number, or (at least, at most; None: no upper bound)


def codec_bound(inputs: list[np.ndarray], k: int, n_workers: int | None = None) -> np.ndarray:
    """Per chunk, the codec's error bound worked out from the inputs alone (docs/protocol.md, "Numbers"):
    the agreed exponent is at most ``E``, the frexp exponent of max|x| over every worker's chunk, so the
    data shift is at least ``s = 30 - ceil(log2 N) - E`` and a mean over any contributors is off by less
    than ``2^-s``. Nothing here is read from a RESULT (a worker that used a coarser shift fails)."""
    n = len(inputs) if n_workers is None else n_workers
    stacked = np.abs(np.stack(inputs).astype(np.float64))
    chunks = -(-stacked.shape[1] // k)
    padded = np.zeros((stacked.shape[0], chunks * k))
    padded[:, : stacked.shape[1]] = stacked
    maxabs = padded.reshape(stacked.shape[0], chunks, k).max(axis=(0, 2))
    exponent = np.frexp(maxabs)[1].astype(np.int64)
    exponent[maxabs == 0] = -127
    shift = np.clip(30 - math.ceil(math.log2(n)) - exponent, -127, 127)
    return np.ldexp(1.0, -shift)


def _within(what: str, got: int, expected: Expected) -> None:
    lo, hi = (expected, expected) if isinstance(expected, int) else expected
    assert got >= lo and (hi is None or got <= hi), f"{got} {what} chunks, expected {expected}"


def check_mean_over_bitmap(
    results: list[ReduceResult],
    inputs: list[np.ndarray],
    k: int,
    *,
    full: Expected,
    partial: Expected,
    fallback: Expected,
    n_workers: int | None = None,
    workers: list[int] | None = None,
    prev: list[np.ndarray | None] | None = None,
    only: list[np.ndarray] | None = None,
    slack_bits: int = 0,
) -> int:
    """Checks every chunk of every result and returns how many came from a RESULT (full + partial).

    ``results[i]`` is worker ``workers[i]``'s (default ``i``) of a job of ``n_workers`` (default
    ``len(inputs)``) workers, ``inputs[w]`` worker w's input.
    - A chunk renormalized from a RESULT equals numpy's float64 mean over exactly the workers in its
      bitmap (all among the job's), within :func:`codec_bound` (from the inputs, never from the RESULT)
      plus float32 rounding; it is full when all ``n_workers`` are counted, partial otherwise.
    - A fallback chunk came without a RESULT (count 0) and holds what its rule says: zeros (zero), the
      worker's own input (local), or its previous result for the tensor (prev: ``prev[i]``, zeros when
      absent or None: the first reduce of that tensor).
    - ``only[i]`` (a bool mask over chunks), where given, limits the check to the chunks worker i
      waits for (a reduce-scatter's owners); the others are unspecified.
    - ``slack_bits``: the bound is 2^slack_bits times coarser (speculated exponents: a chunk's first round
      is final only when no contributor's values lay more than TransportConfig.speculate_guard_bits below
      the speculated exponent, docs/protocol.md, "Speculated exponents").
    - The totals over all results of full, partial and fallback chunks are as ``full``, ``partial``,
      ``fallback`` expect (an exact number or (at least, at most)): a test names what it expects of
      every chunk, so a partial RESULT thrown away for the fallback cannot pass as "some chunk checked".
    """
    tally = _tally(results, inputs, k, n_workers, workers, prev, only, slack_bits)
    for what, expected in (("full", full), ("partial", partial), ("fallback", fallback)):
        _within(what, tally[what], expected)
    return tally["full"] + tally["partial"]


def check_reduces(
    per_worker: list[list[ReduceResult]],
    inputs: list[list[np.ndarray]],
    k: int,
    *,
    full: Expected,
    partial: Expected,
    fallback: Expected,
    slack_bits: int = 0,
) -> int:
    """:func:`check_mean_over_bitmap` over a run of reduces of one tensor: ``per_worker[w][r]`` is worker
    w's result of reduce r (a worker that stopped early has fewer), ``inputs[r][w]`` its input. The prev
    fallback of reduce r is the worker's result of reduce r - 1; the expected totals are over all reduces.
    Returns the chunks that came from a RESULT, over all reduces."""
    totals = {"full": 0, "partial": 0, "fallback": 0}
    for r in range(len(inputs)):
        who = [w for w, res in enumerate(per_worker) if len(res) > r]
        if not who:
            break
        prev = [per_worker[w][r - 1].values if r else None for w in who]
        tally = _tally([per_worker[w][r] for w in who], inputs[r], k, None, who, prev, None, slack_bits)
        for what in totals:
            totals[what] += tally[what]
    for what, expected in (("full", full), ("partial", partial), ("fallback", fallback)):
        _within(what, totals[what], expected)
    return totals["full"] + totals["partial"]


def _tally(
    results: list[ReduceResult],
    inputs: list[np.ndarray],
    k: int,
    n_workers: int | None,
    workers: list[int] | None,
    prev: list[np.ndarray | None] | None,
    only: list[np.ndarray] | None,
    slack_bits: int = 0,
) -> dict[str, int]:
    """The checks of :func:`check_mean_over_bitmap`, chunk by chunk; returns the numbers of full,
    partial and fallback chunks."""
    n = len(inputs) if n_workers is None else n_workers
    who_is = list(range(len(results))) if workers is None else workers
    stacked = np.stack(inputs).astype(np.float64)
    bound = codec_bound(inputs, k, n) * 2.0**slack_bits
    tally = {"full": 0, "partial": 0, "fallback": 0}
    for i, r in enumerate(results):
        assert len(r.values) == stacked.shape[1] and len(r.fallback) == len(bound)
        for c in np.flatnonzero(np.ones(len(bound), dtype=bool) if only is None else only[i]).tolist():
            lo, hi = c * k, min((c + 1) * k, stacked.shape[1])
            got = r.values[lo:hi]
            if r.fallback[c] == Fallback.NONE:
                who = r.contributors(c)
                assert len(who) == r.count[c] > 0, (i, c, who, r.count[c])
                assert max(who) < n
                expected = stacked[who, lo:hi].mean(axis=0)
                tolerance = bound[c] + np.abs(expected) * 2**-23  # float32 output: its rounding on top
                worst = np.max(np.abs(got - expected) / tolerance)
                assert worst <= 1, f"worker {who_is[i]} chunk {c} over {who}: {worst:.3g} x the bound"
                tally["full" if len(who) == n else "partial"] += 1
                continue
            assert r.count[c] == 0, (i, c, r.count[c])  # a fallback only where no RESULT counted anything
            rule = Fallback(int(r.fallback[c]))
            if rule == Fallback.LOCAL:
                want = stacked[who_is[i], lo:hi]
            elif rule == Fallback.PREV and prev is not None and prev[i] is not None:
                want = np.asarray(prev[i], dtype=np.float64)[lo:hi]
            else:  # zero, or prev the first time
                want = np.zeros(hi - lo)
            assert np.array_equal(got.astype(np.float64), want), (who_is[i], c, rule.name)
            tally["fallback"] += 1
    return tally


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


@pytest.fixture(autouse=True)
def restore_root_logging() -> Iterator[None]:
    """``lta.cli.main`` run in-process configures the root logger as a command does (``-q`` sets it to
    ERROR); put it back after every test, so a later test's caplog sees its warnings whichever test ran
    before it in the same process (``make test`` runs the files in one process per core, in any order)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


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
