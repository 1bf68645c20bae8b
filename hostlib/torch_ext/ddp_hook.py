"""DDP communication hook (replicated mode): every bucket is reduced through the switch, renormalized.

    state = LtaHookState(worker, rebroadcast_every=50)
    ddp.register_comm_hook(state, lta_hook)
    state.attach(ddp.module)          # only needed for the periodic re-broadcast

Each worker applies the renormalized mean of the gradients that reached the switch (DDP's own hook
divides a sum by the world size; this one divides by the arrival count, chunk by chunk). Where a
worker got no RESULT for a chunk it uses the transport's fallback (``prev``: the bucket's previous
reduced values, kept per bucket under the key ``(bucket index, numel)``), so replicas can drift apart.
With ``rebroadcast_every=K`` the owners of each contiguous shard broadcast their absolute parameters every
K steps, before the forward pass, and receivers overwrite what arrives of that step: drift is reset. A
copy of an earlier re-broadcast that comes late is dropped (``ParamExchange(replicated=True)``): taken,
it would undo the updates the receiver has made since, and exact replicas would part.

After ``attach`` a bucket goes on the wire with the module's parameters last to first, whatever DDP's
own layout (``wire_order``: DDP changes it after its first iteration, and a rank that rejoined a running
job is in its first iteration while its peers are not); a rank that fell behind or restarted takes a
live peer's parameters and optimizer state (``heal.py``, ``rejoin``).

The hook blocks until the bucket's reduce is done and returns a completed future (the transport's
engine is not thread-safe, and on CPU there is no idle device to overlap with).

``LtaHookState(worker, critical="default")`` (or globs, or a predicate; see ``critical.py``) makes the
chunks holding those parameters' gradients critical: they come back with every worker counted (the
transport resends them, never FLUSHes them), and their parameters go by the reliable path in the
re-broadcast. Names need the module: call ``state.attach(ddp.module)``.

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations as real objects.)
"""

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from hostlib.torch_ext.critical import CriticalSpec, chunk_mask, critical_parameters, flat_ranges
from hostlib.torch_ext.exchange import ParamExchange
from hostlib.torch_ext.heal import Healer
from hostlib.torch_ext.layout import ShardLayout
from hostlib.torch_ext.manager import LtaManager
from hostlib.torch_ext.staging import HostMirror
from hostlib.transport import LtaWorker

STREAM = "ddp"  # the manager's statistics row of the hook's bucket reduces


@dataclass
class HookStats:
    """A snapshot of the hook's counters (``LtaHookState.stats``): the manager's ``ddp`` row and the
    re-broadcasts."""

    steps: int = 0
    buckets: int = 0
    chunks: int = 0
    chunks_full: int = 0  # every worker's contribution arrived
    chunks_partial: int = 0  # renormalized from fewer than N
    chunks_fallback: int = 0  # no RESULT (or count 0): the fallback was used
    chunks_critical: int = 0  # chunks marked critical (critical=...)
    chunks_critical_full: int = 0  # ... that came back with every worker counted
    rebroadcasts: int = 0
    rebroadcast_chunks_fresh: int = 0
    rebroadcast_chunks_expected: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Rebroadcasts:
    count: int = 0
    chunks_fresh: int = 0
    chunks_expected: int = 0


class LtaHookState:
    """What :func:`lta_hook` keeps between calls (the PowerSGD-state pattern), as a thin wrapper over an
    :class:`LtaManager` (``manager.py``), which owns the worker, the bucket staging buffers, the step
    counter and the statistics (each bucket's previous reduced values, for the ``prev`` fallback, are the
    worker's). ``worker`` may be an ``LtaWorker`` (a manager is made around it) or a manager to share."""

    def __init__(
        self,
        worker: LtaWorker | LtaManager,
        *,
        rebroadcast_every: int = 0,
        collect_deadline_ms: float = 200.0,
        force_host_staging: bool = False,
        critical: CriticalSpec = None,
    ) -> None:
        if rebroadcast_every < 0:
            raise ValueError(f"rebroadcast_every must be >= 0 (0: never), got {rebroadcast_every}")
        self.manager = LtaManager.of(worker)
        self.rebroadcast_every = rebroadcast_every
        self.collect_deadline_ms = collect_deadline_ms
        self.force_host_staging = force_host_staging
        self._rebroadcasts = _Rebroadcasts()
        self._module: torch.nn.Module | None = None
        self._exchange: ParamExchange | None = None
        self._flat: torch.Tensor | None = None
        self._flat_host: HostMirror | None = None
        self._rebroadcast_done = -1
        self.critical = critical
        self._critical_ids: set[int] | None = None if critical is not None else set()  # set by attach
        self._optimizer: torch.optim.Optimizer | None = None
        self.healer: Healer | None = None  # set by attach: heals this rank when it falls behind
        self._step_unit: int | None = None  # the unit counter at this step's first bucket, while in it
        self._param_index: dict[int, int] | None = None  # parameter -> position in the module (attach)
        self._reordered: dict[int, torch.Tensor] = {}  # per bucket: its gradients in wire order

    @property
    def worker(self) -> LtaWorker:
        return self.manager.worker

    @property
    def step(self) -> int:
        """Training steps ended (the manager's; a step ends with DDP's last bucket)."""
        return self.manager.step

    @property
    def stats(self) -> HookStats:
        row = self.manager.stream(STREAM)
        return HookStats(
            steps=self.manager.step,
            buckets=row.reduces,
            chunks=row.chunks,
            chunks_full=row.chunks_full,
            chunks_partial=row.chunks_partial,
            chunks_fallback=row.chunks_fallback,
            chunks_critical=row.chunks_critical,
            chunks_critical_full=row.chunks_critical_full,
            rebroadcasts=self._rebroadcasts.count,
            rebroadcast_chunks_fresh=self._rebroadcasts.chunks_fresh,
            rebroadcast_chunks_expected=self._rebroadcasts.chunks_expected,
        )

    # ---- the bucket reduce ---------------------------------------------------------------------------
    def reduce_bucket(
        self,
        index: int,
        buffer: torch.Tensor,
        is_last: bool,
        critical: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """Renormalized mean of ``buffer`` over the workers; written into ``buffer`` and returned.
        ``critical``: value ranges of the buffer that must come back with every worker counted."""
        key = (index, buffer.numel())
        mirror = self.manager.mirror(("ddp-bucket", *key), buffer, force_staging=self.force_host_staging)
        host = mirror.pull()
        # Reduced in place: the result is written straight into the host array (unstaged, the bucket's
        # own memory); pull() left no copy in flight that could still read it.
        self.manager.allreduce(
            host,
            stream=STREAM,
            step=self.manager.step,
            key=("ddp-bucket", *key),
            critical=critical or None,
            out=host,
        )
        mirror.push()
        if is_last:
            self.manager.end_step()
            self._step_unit = None
        return buffer

    def wire_order(self, bucket: dist.GradBucket) -> list[int] | None:
        """The order in which the bucket's gradients go on the wire, when it is not the bucket's own:
        the module's parameters last to first (after attach). DDP lays a bucket out in the module's
        order for its first iteration and in the order the gradients became ready from the second on
        (its bucket rebuild): a rank that rejoined a running job (``rejoin``) has its first iteration
        while its peers have long rebuilt, and the chunks of the same reduce held other parameters'
        gradients on it (chaos seed 19: replicas 0.004 apart). None: the bucket already lies in that
        order (a sequential model after the rebuild), or no module is attached."""
        index = self._param_index
        if index is None:
            return None
        positions = [index.get(id(p), -1) for p in bucket.parameters()]
        if -1 in positions or all(a > b for a, b in zip(positions, positions[1:], strict=False)):
            return None
        return sorted(range(len(positions)), key=lambda i: -positions[i])

    def reduce_reordered(
        self,
        bucket: dist.GradBucket,
        order: list[int],
        critical: list[tuple[int, int]] | None,
    ) -> torch.Tensor:
        """:meth:`reduce_bucket` with the bucket's gradients laid out in ``order`` on the wire."""
        grads = bucket.gradients()
        buffer = bucket.buffer()
        base = buffer.data_ptr()
        offsets = [(g.data_ptr() - base) // g.element_size() for g in grads]
        staged = self._reordered.get(bucket.index())
        if staged is None or staged.numel() != buffer.numel() or staged.dtype != buffer.dtype:
            staged = self._reordered[bucket.index()] = torch.empty_like(buffer)
        placed, at, moved = [], 0, []
        for i in order:
            n = grads[i].numel()
            staged[at : at + n].copy_(grads[i].reshape(-1))
            placed.append((offsets[i], at, n))
            at += n
        if critical:  # value ranges of the bucket, moved with their gradients
            for lo, hi in critical:
                for src, dst, n in placed:
                    a, b = max(lo, src), min(hi, src + n)
                    if a < b:
                        moved.append((dst + a - src, dst + b - src))
        self.reduce_bucket(bucket.index(), staged[:at], bucket.is_last(), moved or None)
        for src, dst, n in placed:
            buffer[src : src + n].copy_(staged[dst : dst + n])
        return buffer

    def bucket_critical(self, bucket: dist.GradBucket) -> list[tuple[int, int]]:
        """Value ranges of the bucket's buffer that hold critical parameters' gradients."""
        if self._critical_ids is None:
            raise RuntimeError(
                "LtaHookState(critical=...) marks parameters by name: call state.attach(ddp.module) "
                "before the first backward"
            )
        if not self._critical_ids:
            return []
        buffer = bucket.buffer()
        base, ranges = buffer.data_ptr(), []
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if id(param) in self._critical_ids:
                offset = (grad.data_ptr() - base) // grad.element_size()
                ranges.append((offset, offset + grad.numel()))
        return ranges

    # ---- periodic owner re-broadcast -----------------------------------------------------------------
    def attach(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Re-broadcast ``module``'s parameters every ``rebroadcast_every`` steps, before its forward,
        and resolve ``critical`` to its parameters (DDP's buckets hold the same parameter objects).

        It also lets a rank that fell behind its peers (stopped past ``catch_up_reduces`` reduces) take
        a live peer's parameters, step and ``optimizer``'s state (momentum, Adam's moments; the state
        of the same optimizer type over the same parameters) before its next forward, instead of
        raising (hostlib/torch_ext/heal.py); every rank serves its state there when asked. Without
        ``optimizer`` only the parameters are taken: the rank keeps its own optimizer state."""
        self._module = module
        self._optimizer = optimizer
        self._critical_ids = critical_parameters(module, self.critical)
        self._param_index = {id(p): i for i, p in enumerate(module.parameters())}
        params = [p for p in module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        k = self.worker.config.elems_per_packet
        layout = ShardLayout.contiguous(numel, k, self.worker.n_workers)
        device = params[0].device
        self._flat = torch.zeros(layout.padded, dtype=torch.float32, device=device)
        self._flat_host = self.manager.mirror(
            "ddp-rebroadcast", self._flat, force_staging=self.force_host_staging
        )
        rows = self._flat_host.array.reshape(layout.n_chunks, k)
        self._exchange = ParamExchange(
            self.worker,
            layout,
            rows,
            stale_bound=max(1, self.rebroadcast_every),
            deadline_ms=self.collect_deadline_ms,
            critical=chunk_mask(flat_ranges(params, self._critical_ids), layout.n_chunks, k),
            replicated=True,  # rows are this replica's parameters: a late copy would roll them back
        )
        self.healer = Healer(self.worker, self._snapshot, self._restore)
        module.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        healer = self.healer
        if healer is not None and healer.behind:  # its peers' step, parameters and optimizer state
            healer.heal()
        k = self.rebroadcast_every
        if k and self.step > 0 and self.step % k == 0 and self._rebroadcast_done != self.step:
            self.rebroadcast()
        if healer is not None:
            healer.serve()
        self._step_unit = self.worker.engine.next_unit  # the step's reduces start here

    # ---- healing a rank behind (heal.py) -------------------------------------------------------------
    def rejoin(self) -> int:
        """A restarted rank (``rejoin_default_group``) takes a live peer's parameters, optimizer state
        and step now, before its first forward (call ``attach(module, optimizer)`` first); returns the
        step it joins at."""
        if self.healer is None:
            raise RuntimeError("call state.attach(module, optimizer) before rejoin()")
        return self.healer.heal()

    def _heal_tensors(self) -> list[torch.Tensor]:
        """What a rank behind takes: the parameters, then the optimizer's floating-point state tensors
        (per parameter, by key), in an order every replica shares."""
        assert self._module is not None
        params = [p for p in self._module.parameters() if p.requires_grad]
        out = list(params)
        if self._optimizer is not None:
            for p in params:
                state = self._optimizer.state.get(p, {})
                out += [state[key] for key in sorted(state) if torch.is_tensor(state[key])]
        return [t for t in out if t.is_floating_point()]

    def _prime_optimizer(self) -> None:
        """A fresh optimizer (a restarted rank's) holds no state yet: one step on zero gradients makes
        it (SGD's momentum buffers, Adam's moments and step), to be overwritten with the donor's. The
        parameters it may move (weight decay) are overwritten too."""
        opt, module = self._optimizer, self._module
        if opt is None or module is None:
            return
        params = [p for p in module.parameters() if p.requires_grad]
        if all(opt.state.get(p) for p in params):
            return
        grads = [p.grad for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, g in zip(params, grads, strict=True):
            p.grad = g

    @torch.no_grad()
    def _snapshot(self) -> tuple[int, int, list[int], Any]:
        """The step's start (heal.py): asked from inside the transport, this rank is in the step's
        bucket reduces or its re-broadcast, where parameters and optimizer state are as the step began
        (the optimizer steps after the last bucket, outside the transport)."""
        tensors = self._heal_tensors()
        flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
        unit = self.worker.engine.next_unit if self._step_unit is None else self._step_unit
        return self.step, unit, [sum(t.numel() for t in tensors)], flat.numpy()

    @torch.no_grad()
    def _restore(self, step: int, counters: list[int], values: Any) -> None:
        from hostlib.errors import UnhealthyTraining

        self._prime_optimizer()
        tensors = self._heal_tensors()
        mine = sum(t.numel() for t in tensors)
        if counters[:1] != [mine] or len(values) != mine:
            raise UnhealthyTraining(
                f"worker {self.worker.worker_id} fell behind its peers, and their state has "
                f"{len(values)} values where its parameters and optimizer state have {mine}: give every "
                "rank the same model and optimizer (attach(module, optimizer)) and step it once first"
            )
        flat = torch.from_numpy(values)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()
        self.manager.step = step
        self._rebroadcast_done = step  # the donor's re-broadcast of this step is over: taken with its state
        if self._exchange is not None:
            self._exchange.adopt(step)

    @torch.no_grad()
    def rebroadcast(self) -> None:
        """Owners send their shard's absolute parameters; receivers overwrite the chunks that arrive.
        Every worker of the job must call it at the same step (``attach`` arranges that)."""
        if self._module is None or self._exchange is None or self._flat is None or self._flat_host is None:
            raise RuntimeError("call state.attach(module) before rebroadcast()")
        params = [p for p in self._module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        self._flat[:numel].copy_(torch.nn.utils.parameters_to_vector(params))
        self._flat_host.pull()
        self._exchange.publish(self.step)
        fresh = self._exchange.collect(self.step)
        if self._exchange.changed:
            self._flat_host.push()
            torch.nn.utils.vector_to_parameters(self._flat[:numel], params)
            self._exchange.changed = False
        self._rebroadcast_done = self.step
        self._rebroadcasts.count += 1
        self._rebroadcasts.chunks_fresh += len(fresh)
        self._rebroadcasts.chunks_expected += len(self._exchange.foreign)


def lta_hook(state: LtaHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's renormalized mean over the workers whose packets arrived."""
    critical = state.bucket_critical(bucket) if state.critical is not None else None
    order = state.wire_order(bucket)
    if order is None:
        reduced = state.reduce_bucket(bucket.index(), bucket.buffer(), bucket.is_last(), critical)
    else:
        reduced = state.reduce_reordered(bucket, order, critical)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(reduced)
    return future
