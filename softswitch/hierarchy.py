"""Leaf-spine aggregation (docs/protocol.md, "Hierarchy"): the jobs of a two-level tree, and an in-process
fabric that wires leaves and a spine together over lossy links.

A job of N workers is split over L leaves in contiguous blocks (:func:`leaf_blocks`). Leaf j serves its
block under the workers' global ids (its other entries are None), sends closed rounds to the spine as
contributor j and multicasts the spine's RESULTs; the spine's contributors are the leaves. Every worker
still sees the global count and bitmap, so renormalization is exact at any depth.

:class:`Fabric` runs the tree without sockets: packets are delivered tick by tick, each switch taking
its packets of a tick as one batch (:meth:`SoftSwitch.process_batch`, the native engine where built),
and every link drops each packet (GRAD, FLUSH, partial, RESULT alike) with its level's probability,
from one seeded generator, so a run replays. Tests, the unbiasedness check and ``lta demo --sim`` use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hostlib.protocol import (
    DEFAULT_ELEMS_PER_PACKET,
    HEADER_BYTES,
    MAX_LEAVES,
    Flag,
    Header,
    Op,
    Role,
    make_packet,
)
from softswitch.pipeline import JobConfig, Port, SoftSwitch


def leaf_blocks(n_workers: int, n_leaves: int) -> list[list[int]]:
    """Worker ids of each leaf: contiguous blocks, sizes differing by at most one (the first ones larger)."""
    if not 1 <= n_leaves <= min(n_workers, MAX_LEAVES):
        raise ValueError(
            f"leaves must be in 1..{min(n_workers, MAX_LEAVES)} for {n_workers} workers, got {n_leaves}"
        )
    base, extra = divmod(n_workers, n_leaves)
    blocks, start = [], 0
    for j in range(n_leaves):
        size = base + (1 if j < extra else 0)
        blocks.append(list(range(start, start + size)))
        start += size
    return blocks


def leaf_job(
    job_id: int,
    workers: dict[int, Port],
    n_workers: int,
    uplink: Port,
    leaf_id: int,
    *,
    pool_size: int = 0,
    elems_per_packet: int = DEFAULT_ELEMS_PER_PACKET,
    quorum: int | None = None,
) -> JobConfig:
    """Leaf ``leaf_id``'s job: ``workers`` maps the global ids it serves to their ports/addresses."""
    ports: list[Port | None] = [None] * n_workers
    for w, port in workers.items():
        ports[w] = port
    return JobConfig(
        job_id, ports, quorum, pool_size, elems_per_packet, role=Role.LEAF, uplink=uplink, leaf_id=leaf_id
    )


def spine_job(
    job_id: int,
    leaves: Sequence[Port],
    *,
    pool_size: int = 0,
    elems_per_packet: int = DEFAULT_ELEMS_PER_PACKET,
    quorum: int | None = None,
) -> JobConfig:
    """The spine's job: contributor j is leaf j, whose partials come from ``leaves[j]``."""
    return JobConfig(job_id, list(leaves), quorum, pool_size, elems_per_packet, role=Role.SPINE)


@dataclass
class Delivered:
    """A RESULT as a worker received it."""

    header: Header
    payload: np.ndarray  # int32 (K,)


@dataclass
class Fabric:
    """Leaves and a spine in-process, linked with loss ``worker_loss`` (worker-leaf links, both ways) and
    ``spine_loss`` (leaf-spine links, both ways). Ports are ints: worker w is ``WORKER + w``, leaf j
    ``LEAF + j``, the spine ``SPINE``."""

    n_workers: int
    n_leaves: int
    job_id: int = 1
    pool_size: int = 64
    elems_per_packet: int = 8
    worker_loss: float = 0.0
    spine_loss: float = 0.0
    seed: int = 0
    batched: bool = True  # process_batch (the native engine where built) or process (the reference)
    inbox: list[list[Delivered]] = field(init=False)

    WORKER = 100
    LEAF = 1000
    SPINE = 2000

    def __post_init__(self) -> None:
        self.blocks = leaf_blocks(self.n_workers, self.n_leaves)
        self.leaf_of = {w: j for j, block in enumerate(self.blocks) for w in block}
        self.rng = np.random.default_rng(self.seed)
        pool, k = self.pool_size, self.elems_per_packet
        self.leaves = []
        for j, block in enumerate(self.blocks):
            sw = SoftSwitch(seed=self.seed * 131 + j)
            ports = {w: self.WORKER + w for w in block}
            sw.add_job(
                leaf_job(
                    self.job_id, ports, self.n_workers, self.SPINE, j, pool_size=pool, elems_per_packet=k
                )
            )
            self.leaves.append(sw)
        self.spine = SoftSwitch(seed=self.seed * 131 + 127)
        leaf_ports = [self.LEAF + j for j in range(self.n_leaves)]
        self.spine.add_job(spine_job(self.job_id, leaf_ports, pool_size=pool, elems_per_packet=k))
        self.inbox = [[] for _ in range(self.n_workers)]
        self._pending: list[tuple[int, int, bytes]] = []  # (from, to, packet)
        self.link_drops = 0

    # ---- sending and delivery ----------------------------------------------------------------------
    def send(self, w: int, packet: bytes) -> None:
        """Worker ``w`` sends ``packet`` to its leaf."""
        self._pending.append((self.WORKER + w, self.LEAF + self.leaf_of[w], packet))

    def _lost(self, a: int, b: int) -> bool:
        p = self.spine_loss if self.SPINE in (a, b) else self.worker_loss
        if p > 0 and self.rng.random() < p:
            self.link_drops += 1
            return True
        return False

    def _switch(self, port: int) -> SoftSwitch:
        return self.spine if port == self.SPINE else self.leaves[port - self.LEAF]

    def run(self, max_ticks: int = 100) -> None:
        """Deliver until no packet is in flight (each tick: every switch takes its packets as one batch)."""
        for _ in range(max_ticks):
            if not self._pending:
                return
            pending, self._pending = self._pending, []
            by_switch: dict[int, list[tuple[int, bytes]]] = {}
            for src, dst, packet in pending:
                if self._lost(src, dst):
                    continue
                if dst < self.LEAF:
                    self._receive(dst - self.WORKER, packet)
                else:
                    by_switch.setdefault(dst, []).append((src, packet))
            for port, packets in by_switch.items():
                for egress, packet in self._process(self._switch(port), packets):
                    self._pending.append((port, egress, packet))
        raise RuntimeError(f"packets still in flight after {max_ticks} ticks")

    def _process(self, sw: SoftSwitch, packets: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        if not self.batched:
            out: list[tuple[int, bytes]] = []
            for src, data in packets:
                out += [
                    (int(egress), packet) for egress, packet in sw.process(data, src)
                ]  # ports are ints here
            return out
        width = max(len(p) for _, p in packets)
        data = np.zeros((len(packets), width), dtype=np.uint8)
        lens = np.zeros(len(packets), dtype=np.int64)
        ingress = np.zeros(len(packets), dtype=np.int64)
        for i, (src, packet) in enumerate(packets):
            data[i, : len(packet)] = np.frombuffer(packet, dtype=np.uint8)
            lens[i], ingress[i] = len(packet), src
        return sw.process_batch(data, lens, ingress).packets()

    def _receive(self, w: int, packet: bytes) -> None:
        header = Header.unpack(packet)
        payload = np.frombuffer(packet, dtype=">i4", offset=HEADER_BYTES).astype(np.int32)
        self.inbox[w].append(Delivered(header, payload))

    # ---- one round, as hosts would run it ---------------------------------------------------------
    def result_of(self, w: int, slot: int, seq: int) -> Delivered | None:
        for d in self.inbox[w]:
            if d.header.op == Op.RESULT and d.header.slot == slot and d.header.seq == seq:
                return d
        return None

    def round(
        self,
        slot: int,
        seq: int,
        values: np.ndarray,
        *,
        exp: int = 0,
        flags: int = 0,
        weights: Sequence[int] | None = None,
        max_flushes: int = 8,
    ) -> list[Delivered | None]:
        """Every worker sends GRAD(slot, seq) with its row of ``values`` (int32, (N, K)); then, as long as
        some worker lacks the RESULT, each such worker FLUSHes (at most ``max_flushes`` times; every
        FLUSH after a worker's first carries RETX, as hosts do). Returns
        the RESULT each worker got (None: none came)."""
        k = self.elems_per_packet
        for w in range(self.n_workers):
            weight = 1 if weights is None else int(weights[w])
            self.send(w, self._packet(Op.GRAD, w, slot, seq, values[w], exp, flags, weight, k))
        self.run()
        for attempt in range(max_flushes):
            waiting = [w for w in range(self.n_workers) if self.result_of(w, slot, seq) is None]
            if not waiting:
                break
            # as hosts do: a worker's repeated FLUSH carries RETX
            fl = (flags & int(Flag.MAX)) | (int(Flag.RETX) if attempt else 0)
            for w in waiting:
                self.send(w, self._packet(Op.FLUSH, w, slot, seq, None, exp, fl, 0, k))
            self.run()
        out = [self.result_of(w, slot, seq) for w in range(self.n_workers)]
        for w in range(self.n_workers):
            self.inbox[w] = [d for d in self.inbox[w] if (d.header.slot, d.header.seq) != (slot, seq)]
        return out

    def _packet(
        self, op: Op, w: int, slot: int, seq: int, values, exp: int, flags: int, weight: int, k: int
    ) -> bytes:
        return make_packet(
            op, job_id=self.job_id, worker_id=w, slot=slot, seq=seq, payload=values, elems_per_packet=k,
            exp=exp, flags=flags, weight=weight, nelem=k,
        )  # fmt: skip
