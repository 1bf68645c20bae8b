"""One owner of a rank's LTA state in the torch layer; the hook, the process group and the optimizers
are thin wrappers over it (torchft's ``Manager`` shape).

    manager = LtaManager(worker)                          # or LtaManager(session), LtaManager(ps_client)
    state = LtaHookState(manager)                         # DDP comm hook
    opt = ShardedOptimizer(torch.optim.AdamW(...), manager)
    lta_stats(manager); should_commit(manager)

What it owns, and nothing else does:

- the **link**: the switch worker (``LtaWorker``, with the ``LtaSession`` that may host a softswitch) or,
  for ``PSOptimizer``, the parameter-server client (``PsClient``); :meth:`close` closes them;
- the **staging buffers**: one ``HostMirror`` per key (:meth:`mirror`), rebuilt when the tensor behind a
  key changes; mirrors of short-lived tensors (``transient=True``, the process group's) are bounded;
- the **step counters**: ``step`` (training steps ended, :meth:`end_step`) and ``reduces`` (lossy
  reduces issued: the transport's step number for callers that have no step of their own);
- the **statistics**: one :class:`ReduceStats` row per stream (``"ddp"``, ``"sharded"``,
  ``"allreduce"``, ``"reduce_scatter"``, ``"all_gather"``), filled by :meth:`allreduce` from the
  per-chunk result; the wrappers' public counters (``LtaHookState.stats``,
  ``ShardedOptimizer.grad_chunks``, ``ProcessGroupLta.collective_stats()``) are views of these rows;
- the **call keys** (``callkeys.CallKeys``) that name a collective across steps, and the lossy
  all-gather's copies (``gather.StaleGather``, created on first use: it reads the worker's PARAM inbox,
  so one per worker).

A wrapper given an ``LtaWorker`` builds a manager of its own around it (what one wrapper needed before);
wrappers given the same manager share its counters and buffers (``LtaHookState(pg.manager)``).
A manager is not thread-safe, as the transport is not.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from hostlib.ps.client import PsClient
from hostlib.torch_ext.callkeys import CallKeys
from hostlib.torch_ext.gather import StaleGather
from hostlib.torch_ext.rendezvous import LtaSession
from hostlib.torch_ext.staging import HostMirror
from hostlib.transport import Fallback, LtaWorker, ReduceResult

MAX_TRANSIENT_MIRRORS = 64  # pinned host buffers kept for short-lived device tensors


@dataclass
class ReduceStats:
    """One stream's running totals on this rank. ``chunks``/``contributions`` are over the chunks this rank
    uses (its own shard of a sharded reduce or a reduce-scatter): loss seen = 1 - contributions / (N ·
    chunks). ``calls``, ``lossy_calls``, ``reliable_calls``, ``resyncs`` and ``lossy_s`` are what the
    wrapper decided per call; the chunk counts are the manager's, per lossy reduce."""

    calls: int = 0
    lossy_calls: int = 0
    reliable_calls: int = 0  # not eligible (dtype, op, size), not enabled, or a key's first gather
    reduces: int = 0  # lossy reduces through the switch (a call may make several: one per tensor)
    chunks: int = 0
    contributions: int = 0
    chunks_full: int = 0  # every worker's contribution arrived
    chunks_partial: int = 0  # renormalized from 0 < count < N
    chunks_fallback: int = 0  # no aggregate: the fallback
    chunks_critical: int = 0  # chunks marked critical
    chunks_critical_full: int = 0  # ... that came back with every worker counted
    resyncs: int = 0  # all-gather: calls made reliable because some rank's copy would be older than S
    # reduce-scatter: chunks whose RESULT this rank waited for, against ``chunks``, the ones it keeps
    # (RESULTs are owner-only but for each call's last chunk and every news_every-th: docs/protocol.md,
    # "Owner-only units")
    chunks_received: int = 0
    lossy_s: float = 0.0

    def count(self, result: ReduceResult, n_workers: int, sel: slice | np.ndarray = slice(None)) -> None:
        """Add the chunks ``sel`` of ``result`` (a slice or index array; default: all)."""
        count = result.count[sel]
        self.chunks += len(count)
        self.contributions += int(count.sum())
        self.chunks_full += int(np.sum(count == n_workers))
        self.chunks_partial += int(np.sum((count > 0) & (count < n_workers)))
        self.chunks_fallback += int(np.sum(result.fallback[sel] != Fallback.NONE))
        critical = result.critical[sel] if len(result.critical) else None
        if critical is not None and critical.any():
            self.chunks_critical += int(critical.sum())
            self.chunks_critical_full += int(np.sum(critical & (count == n_workers)))

    def as_dict(self, n_workers: int) -> dict[str, Any]:
        row: dict[str, Any] = asdict(self)
        row["loss_seen"] = 1.0 - self.contributions / (n_workers * self.chunks) if self.chunks else 0.0
        return row


Link = LtaWorker | LtaSession | PsClient


class LtaManager:
    """The worker (or parameter-server client), staging buffers, step counters and statistics of one rank
    (module docstring). ``LtaManager(worker)``, ``LtaManager(session)`` (then :meth:`close` also stops
    the softswitch the session hosts) or ``LtaManager(ps_client)``."""

    def __init__(self, link: Link | None, *, world: int | None = None) -> None:
        self.session: LtaSession | None = link if isinstance(link, LtaSession) else None
        self._worker: LtaWorker | None = link.worker if isinstance(link, LtaSession) else None
        self._ps: PsClient | None = None
        if isinstance(link, LtaWorker):
            self._worker = link
        elif isinstance(link, PsClient):
            self._ps = link
        elif self._worker is None and not (link is None and world is not None):
            raise TypeError(
                f"LtaManager takes an LtaWorker, an LtaSession or a PsClient, got {type(link).__name__}"
            )
        # A manager without a link (``LtaManager(None, world=N)``) only counts: a process group whose
        # collectives all stay reliable (a sub-group on an external switch, a group of one).
        self._world = world
        self._closed = False
        self.step = 0  # training steps ended (end_step)
        self.reduces = 0  # lossy reduces issued through this manager
        self.streams: dict[str, ReduceStats] = {}
        self.last_reduce: ReduceResult | None = None  # the last lossy reduce's per-chunk result
        self.keys = CallKeys()
        self._gatherer: StaleGather | None = None
        self._mirrors: dict[Hashable, HostMirror] = {}
        self._transient: dict[Hashable, HostMirror] = {}
        # reduce-scatter: per call key, the interleaved staging buffer, chunk owners and this rank's
        # chunks (ProcessGroupLta._interleaved)
        self.scatter_staging: dict[Hashable, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @classmethod
    def of(cls, source: LtaManager | Link) -> LtaManager:
        """``source`` if it is a manager, else a new manager around it (what a wrapper does)."""
        return source if isinstance(source, LtaManager) else cls(source)

    # ---- the link ------------------------------------------------------------------------------------
    @property
    def worker(self) -> LtaWorker:
        """The switch worker (TypeError for a parameter-server manager)."""
        if self._worker is None:
            raise TypeError("this LtaManager talks to a parameter server (PsClient), not to a switch")
        return self._worker

    @property
    def ps_client(self) -> PsClient:
        """The parameter-server client (TypeError for a switch manager)."""
        if self._ps is None:
            raise TypeError("this LtaManager talks to a switch (LtaWorker), not to a parameter server")
        return self._ps

    @property
    def has_worker(self) -> bool:
        return self._worker is not None

    @property
    def n_workers(self) -> int:
        if self._worker is None and self._world is not None:
            return self._world
        return self.worker.n_workers

    @property
    def rank(self) -> int:
        return self._worker.worker_id if self._worker is not None else self.ps_client.worker_id

    def __repr__(self) -> str:
        link = "switch" if self._worker is not None else "ps" if self._ps is not None else "none"
        return f"LtaManager(link={link}, step={self.step}, reduces={self.reduces})"

    def close(self) -> None:
        """Close the link (and stop a softswitch the session hosts); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.session is not None:
            self.session.close()
        elif self._worker is not None:
            self._worker.close()
        elif self._ps is not None:
            self._ps.close()

    # ---- reduces -------------------------------------------------------------------------------------
    def stream(self, name: str) -> ReduceStats:
        """The statistics row of ``name`` (created empty on first use)."""
        row = self.streams.get(name)
        if row is None:
            row = self.streams[name] = ReduceStats()
        return row

    def allreduce(
        self,
        values: np.ndarray,
        *,
        stream: str,
        key: Any,
        step: int | None = None,
        critical: Any = None,
        out: np.ndarray | None = None,
        mine: tuple[int, int] | np.ndarray | None = None,
        owners: np.ndarray | None = None,
        scale: float = 1.0,
    ) -> ReduceResult:
        """``LtaWorker.allreduce`` (renormalized mean over the workers whose packets arrived), counted in
        ``stream``'s row over the chunks this rank uses: ``mine = (first, last)`` or an index array
        (default: all). ``step`` is the transport's step number (default: the manager's ``reduces``);
        ``owners``: per chunk, the one rank its result goes to; ``scale``: the values times it
        (``LtaWorker.allreduce``)."""
        worker = self.worker
        t0 = time.perf_counter()
        result = worker.allreduce(
            values,
            step=self.reduces if step is None else step,
            key=key,
            critical=critical,
            out=out,
            owners=owners,
            scale=scale,
        )
        self.reduces += 1
        self.last_reduce = result
        row = self.stream(stream)
        row.reduces += 1
        if isinstance(mine, tuple):
            row.count(result, worker.n_workers, slice(*mine))
        else:
            row.count(result, worker.n_workers, slice(None) if mine is None else mine)
        row.lossy_s += time.perf_counter() - t0
        return result

    def end_step(self) -> int:
        """A training step ended; returns the new step count."""
        self.step += 1
        return self.step

    def gatherer(self, stale_bound: int | None = None) -> StaleGather:
        """The lossy all-gather's copies, made on first use (one per worker: it reads the worker's PARAM
        inbox); ``stale_bound`` sets its S."""
        if self._gatherer is None:
            self._gatherer = StaleGather(self.worker)
        if stale_bound is not None:
            if stale_bound < 1:
                raise ValueError(f"stale_bound (S) must be >= 1 call, got {stale_bound}")
            self._gatherer.stale_bound = stale_bound
        return self._gatherer

    @property
    def has_gatherer(self) -> bool:
        return self._gatherer is not None

    # ---- staging -------------------------------------------------------------------------------------
    def mirror(
        self, key: Hashable, tensor: torch.Tensor, *, force_staging: bool = False, transient: bool = False
    ) -> HostMirror:
        """The host float32 mirror of the 1-D ``tensor`` under ``key``: the one made before when ``key``
        still names the same tensor memory, else a new one (kept under ``key``). ``transient``: the
        tensor is short-lived (a collective's argument); an unstaged mirror (the tensor's own memory)
        is then not kept, and at most ``MAX_TRANSIENT_MIRRORS`` staged ones are."""
        table = self._transient if transient else self._mirrors
        held = table.get(key)
        if (
            held is not None
            and held.tensor.data_ptr() == tensor.data_ptr()
            and held.tensor.numel() == tensor.numel()
            and held.tensor.dtype == tensor.dtype
            and held.tensor.device == tensor.device
        ):
            return held
        mirror = HostMirror(tensor, force_staging=force_staging)
        if transient:
            if not mirror.staged:  # free to rebuild: the tensor's own memory
                return mirror
            if len(table) >= MAX_TRANSIENT_MIRRORS:
                table.clear()
        table[key] = mirror
        return mirror

    @property
    def staging_buffers(self) -> int:
        """Host mirrors held (the wrappers' named ones and the transient ones)."""
        return len(self._mirrors) + len(self._transient)

    # ---- statistics and health -----------------------------------------------------------------------
    def collective_stats(self, streams: tuple[str, ...] | None = None) -> dict[str, dict[str, Any]]:
        """One row per stream (those named, created empty if need be; default: every stream used): calls,
        chunks and loss seen; the all-gather's row has the stale copies handed out, the oldest copy's age
        (``max_age``, in calls of its key), the resyncs and S."""
        names = tuple(self.streams) if streams is None else streams
        n = self.n_workers
        out = {name: self.stream(name).as_dict(n) for name in names}
        if "all_gather" in out and self._gatherer is not None:
            totals = self._gatherer.totals
            out["all_gather"].update(
                chunks=totals.chunks_expected,
                chunks_fresh=totals.chunks_fresh,
                stale_copies=totals.stale_copies,
                max_age=totals.max_age,
                markers_missed=totals.markers_missed,
                # nothing expected, nothing lost: no lossy all-gather ran (0 chunks)
                loss_seen=(1.0 - totals.chunks_fresh / totals.chunks_expected)
                if totals.chunks_expected
                else 0.0,
                stale_bound=self._gatherer.stale_bound,
            )
        return out

    def stats(self) -> dict[str, Any]:
        """What ``lta_stats`` reports: the transport's running totals and health plus the stream rows (a
        switch manager), or the parameter-server client's counters and version."""
        if self._ps is not None:
            return {"step": self.step, "version": self._ps.version, **self._ps.stats.as_dict()}
        worker = self.worker
        out: dict[str, Any] = worker.stats.as_dict()
        out["healthy"] = worker.healthy
        out["last_nothing_fraction"] = worker.last_nothing_fraction
        out["step"] = self.step
        if self.streams:
            out["collectives"] = self.collective_stats()
        return out

    def should_commit(self) -> bool:
        """True when no lossy reduce since the previous call came back (almost) empty; resets the window."""
        return not self.worker.unhealthy_since_mark(reset=True)
