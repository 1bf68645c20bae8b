"""The paper's Algorithm 1 as an optimizer wrapper (ZeRO style): reduce, step your shard, broadcast.

``ShardedOptimizer(torch.optim.AdamW(model.parameters(), ...), worker)`` and the training loop stays
``loss.backward(); opt.step(); opt.zero_grad()``. Each ``step``:

1. the full local gradient is reduced through the switch; every chunk comes back renormalized by its
   arrival count (unbiased under loss), or with the transport's fallback where nothing arrived;
2. this worker's optimizer steps **its shard only** (a contiguous run of chunks, ZeRO style);
3. it broadcasts the shard's absolute values (PARAM); every other worker overwrites its copy of the
   chunks that arrive and keeps the stale copy of the rest; a copy older than ``stale_bound`` steps is
   resent reliably, so no copy is ever more than ``stale_bound + 1`` steps old (see ``exchange.py``).

The wrapped optimizer's parameter groups are rebound to this worker's shard, so its hyperparameters,
per-group settings and any LR scheduler attached to it keep working. Exact (equal to the unwrapped
optimizer at zero loss, up to the codec's rounding) for element-wise optimizers: SGD, Adam(W), RMSprop,
Adagrad, ...; an optimizer that takes norms over a whole tensor (LAMB, LARS) would see shard pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hostlib.torch_ext.dp import GaussianPrivacy
from hostlib.torch_ext.drift import DriftMonitor
from hostlib.torch_ext.exchange import ParamExchange
from hostlib.torch_ext.flat import FlatParams
from hostlib.torch_ext.layout import ShardLayout
from hostlib.torch_ext.staging import HostMirror
from hostlib.transport import Fallback, LtaWorker

_GRAD_KEY = "lta.sharded.grad"  # the transport's `prev` fallback remembers the last reduce under this key


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` (fresh, not yet stepped) so that this worker owns and steps one shard."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        worker: LtaWorker,
        *,
        stale_bound: int = 8,
        collect_deadline_ms: float = 200.0,
        resend_timeout_s: float = 30.0,
        force_host_staging: bool = False,
        privacy: GaussianPrivacy | None = None,
    ) -> None:
        if isinstance(optimizer, ShardedOptimizer):
            raise TypeError("the optimizer is already sharded")
        if any(optimizer.state.values()):
            raise ValueError(
                "wrap the optimizer before its first step: its state cannot be split into shards"
            )
        groups = optimizer.param_groups
        params = [p for g in groups for p in g["params"]]
        k = worker.config.elems_per_packet
        self.worker = worker
        self.inner = optimizer
        self.privacy = privacy  # differential privacy: clip + noise share before, top-up after the reduce
        self.flat = FlatParams(params, k)
        self.layout = ShardLayout.contiguous(self.flat.numel, k, worker.n_workers)
        self.shard = self.layout.shard_range(worker.worker_id)
        lo, hi = self.shard
        # One segment per group: the part of this shard that falls in the group's parameters.
        self._segments: list[tuple[int, int]] = []
        offset = 0
        for g in groups:
            g_lo = offset
            offset += sum(p.numel() for p in g["params"])
            a, b = max(lo, g_lo), min(hi, offset)
            a, b = (a, b) if a < b else (lo, lo)
            self._segments.append((a, b))
            g["params"] = [torch.nn.Parameter(self.flat.data[a:b])]
        super().__init__(groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # one list: schedulers on either object see the same
        self.state = optimizer.state

        self._params_host = HostMirror(self.flat.data, force_staging=force_host_staging)
        self._grads_host = HostMirror(self.flat.grad, force_staging=force_host_staging)
        self._reduced = torch.zeros(self.flat.padded, dtype=torch.float32, device=self.flat.data.device)
        self._reduced_host = HostMirror(self._reduced, force_staging=force_host_staging)
        rows = self._params_host.pull().reshape(self.layout.n_chunks, k)
        self.exchange = ParamExchange(
            worker,
            self.layout,
            rows,
            stale_bound=stale_bound,
            deadline_ms=collect_deadline_ms,
            resend_timeout_s=resend_timeout_s,
        )
        self.drift = DriftMonitor(self._params_host.array[lo:hi], stale_bound)
        self.lta_step = 0
        self.grad_chunks = 0
        self.grad_chunks_partial = 0
        self.grad_chunks_fallback = 0
        self.grad_contributions = 0  # arrival counts summed: 1 - this / (N · grad_chunks) is the loss seen

    # ---- the training loop's API -------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Reduce gradients, step the owned shard, exchange parameters (one LTA step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self.lta_step
        lo, hi = self.shard
        self.flat.gather_grads()
        grads = self._grads_host.pull()
        if self.privacy is not None:
            self.privacy.privatize_(grads[: self.flat.numel])
        result = self.worker.allreduce(grads[: self.flat.numel], step=t, key=_GRAD_KEY)
        if self.privacy is not None:  # only the owned chunks are used here: top up those
            first, last = self.layout.owners.searchsorted([self.worker.worker_id, self.worker.worker_id + 1])
            self.privacy.top_up_(result, step=t, chunks=(int(first), int(last)))
        self._count_chunks(result.count, result.fallback)
        reduced = self._reduced_host.writable()
        reduced[lo:hi] = result.values[lo:hi]
        self._reduced_host.push(lo, hi)
        for group, (a, b) in zip(self.param_groups, self._segments, strict=True):
            group["params"][0].grad = self._reduced[a:b]
        self.inner.step()
        self._params_host.pull(lo, hi)
        self.drift.record()
        self.exchange.publish(t)
        self.exchange.collect(t)
        if self.exchange.changed:
            self._params_host.push()
            self.exchange.changed = False
        self.lta_step += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.flat.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()
        for group in self.param_groups:
            group["params"][0].grad = None

    @torch.no_grad()
    def synchronize(self) -> None:
        """Reliable parameter exchange: afterwards every worker holds every owner's current shard
        (use before evaluating or checkpointing). Every worker of the job must call it."""
        t = self.lta_step
        lo, hi = self.shard
        self._params_host.pull(lo, hi)
        self.exchange.publish(t, critical=True)
        self.exchange.collect(t, require_all=True)
        if self.exchange.changed:
            self._params_host.push()
            self.exchange.changed = False
        self.lta_step += 1

    # ---- statistics ----------------------------------------------------------------------------------
    def _count_chunks(self, count: np.ndarray, fallback: np.ndarray) -> None:
        first, last = self.layout.owners.searchsorted([self.worker.worker_id, self.worker.worker_id + 1])
        mine_count, mine_fallback = count[first:last], fallback[first:last]
        self.grad_chunks += len(mine_count)
        self.grad_contributions += int(mine_count.sum())
        self.grad_chunks_partial += int(np.sum((mine_count > 0) & (mine_count < self.worker.n_workers)))
        self.grad_chunks_fallback += int(np.sum(mine_fallback != Fallback.NONE))

    def drift_stats(self, p: float | None = None) -> dict[str, Any]:
        """What this worker saw: gradient chunks of its shard (partial = renormalized from fewer than N,
        fallback = none arrived), its shard's update variance σ², the drift its receivers should see
        under Bernoulli(p) param loss (``predicted``, momentum-aware), and the ages of its stale copies."""
        out: dict[str, Any] = {
            "step": self.lta_step,
            "grad_chunks": self.grad_chunks,
            "grad_chunks_partial": self.grad_chunks_partial,
            "grad_chunks_fallback": self.grad_chunks_fallback,
            "grad_contributions": self.grad_contributions,
            "sigma2": self.drift.sigma2,
            "sigma2_mean": self.drift.sigma2_sum / max(1, self.drift.recorded - 1),
            "stale": self.exchange.tracker.summary(),
            "exchange": self.exchange.stats.as_dict(),
        }
        if p is not None:
            out["predicted_drift"] = self.drift.predicted(p)
        return out

    def replica(self) -> np.ndarray:
        """This worker's copy of all parameters (host float32, ``numel`` values)."""
        return self._params_host.pull()[: self.flat.numel].copy()
