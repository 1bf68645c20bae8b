"""DDP communication hook (replicated mode): every bucket is reduced through the switch, renormalized.

    state = LtaHookState(worker, rebroadcast_every=50)
    ddp.register_comm_hook(state, lta_hook)
    state.attach(ddp.module)          # only needed for the periodic re-broadcast

Each worker applies the renormalized mean of the gradients that reached the switch (DDP's own hook
divides a sum by the world size; this one divides by the arrival count, chunk by chunk). Where a
worker got no RESULT for a chunk it uses the transport's fallback (``prev``: the bucket's previous
reduced values, kept per bucket under the key ``(bucket index, numel)``), so replicas can drift apart.
With ``rebroadcast_every=K`` the owners of each contiguous shard broadcast their absolute parameters every
K steps, before the forward pass, and receivers overwrite what arrives: drift is reset.

The hook blocks until the bucket's reduce is done and returns a completed future (the transport's
engine is not thread-safe, and on CPU there is no idle device to overlap with).

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations as real objects.)
"""

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hostlib.torch_ext.exchange import ParamExchange
from hostlib.torch_ext.layout import ShardLayout
from hostlib.torch_ext.staging import HostMirror
from hostlib.transport import Fallback, LtaWorker


@dataclass
class HookStats:
    steps: int = 0
    buckets: int = 0
    chunks: int = 0
    chunks_full: int = 0  # every worker's contribution arrived
    chunks_partial: int = 0  # renormalized from fewer than N
    chunks_fallback: int = 0  # no RESULT (or count 0): the fallback was used
    rebroadcasts: int = 0
    rebroadcast_chunks_fresh: int = 0
    rebroadcast_chunks_expected: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class LtaHookState:
    """What :func:`lta_hook` keeps between calls (the PowerSGD-state pattern): the worker, the step
    counter, each bucket's previous reduced values, staging buffers and statistics."""

    def __init__(
        self,
        worker: LtaWorker,
        *,
        rebroadcast_every: int = 0,
        collect_deadline_ms: float = 200.0,
        force_host_staging: bool = False,
    ) -> None:
        if rebroadcast_every < 0:
            raise ValueError(f"rebroadcast_every must be >= 0 (0: never), got {rebroadcast_every}")
        self.worker = worker
        self.rebroadcast_every = rebroadcast_every
        self.collect_deadline_ms = collect_deadline_ms
        self.force_host_staging = force_host_staging
        self.step = 0
        self.prev: dict[tuple[int, int], torch.Tensor] = {}  # (bucket index, numel) -> last reduced values
        self.stats = HookStats()
        self._staging: dict[tuple[int, int], HostMirror] = {}
        self._module: torch.nn.Module | None = None
        self._exchange: ParamExchange | None = None
        self._flat: torch.Tensor | None = None
        self._flat_host: HostMirror | None = None
        self._rebroadcast_done = -1

    # ---- the bucket reduce ---------------------------------------------------------------------------
    def reduce_bucket(self, index: int, buffer: torch.Tensor, is_last: bool) -> torch.Tensor:
        """Renormalized mean of ``buffer`` over the workers; written into ``buffer`` and returned."""
        key = (index, buffer.numel())
        mirror = self._staging.get(key)
        if mirror is None or mirror.tensor.data_ptr() != buffer.data_ptr():
            mirror = self._staging[key] = HostMirror(buffer, force_staging=self.force_host_staging)
        host = mirror.pull()
        result = self.worker.allreduce(host, step=self.step, key=("ddp-bucket", *key))
        mirror.writable()[:] = result.values  # unstaged, this array is the bucket's own memory
        mirror.push()
        self.prev[key] = torch.from_numpy(result.values)
        self._count(result.count, result.fallback)
        if is_last:
            self.step += 1
            self.stats.steps += 1
        return buffer

    def _count(self, count: np.ndarray, fallback: np.ndarray) -> None:
        st = self.stats
        n = self.worker.n_workers
        st.buckets += 1
        st.chunks += len(count)
        st.chunks_full += int(np.sum(count == n))
        st.chunks_partial += int(np.sum((count > 0) & (count < n)))
        st.chunks_fallback += int(np.sum(fallback != Fallback.NONE))

    # ---- periodic owner re-broadcast -----------------------------------------------------------------
    def attach(self, module: torch.nn.Module) -> None:
        """Re-broadcast ``module``'s parameters every ``rebroadcast_every`` steps, before its forward."""
        self._module = module
        params = [p for p in module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        k = self.worker.config.elems_per_packet
        layout = ShardLayout.contiguous(numel, k, self.worker.n_workers)
        device = params[0].device
        self._flat = torch.zeros(layout.padded, dtype=torch.float32, device=device)
        self._flat_host = HostMirror(self._flat, force_staging=self.force_host_staging)
        rows = self._flat_host.array.reshape(layout.n_chunks, k)
        self._exchange = ParamExchange(
            self.worker,
            layout,
            rows,
            stale_bound=max(1, self.rebroadcast_every),
            deadline_ms=self.collect_deadline_ms,
        )
        module.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        k = self.rebroadcast_every
        if k and self.step > 0 and self.step % k == 0 and self._rebroadcast_done != self.step:
            self.rebroadcast()

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
        self.stats.rebroadcasts += 1
        self.stats.rebroadcast_chunks_fresh += len(fresh)
        self.stats.rebroadcast_chunks_expected += len(self._exchange.foreign)


def lta_hook(state: LtaHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's renormalized mean over the workers whose packets arrived."""
    reduced = state.reduce_bucket(bucket.index(), bucket.buffer(), bucket.is_last())
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(reduced)
    return future
