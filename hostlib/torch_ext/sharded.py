"""The paper's Algorithm 1 as an optimizer wrapper (ZeRO style): reduce, step your shard, broadcast.

``ShardedOptimizer(torch.optim.AdamW(model.parameters(), ...), worker)`` and the training loop stays
``loss.backward(); opt.step(); opt.zero_grad()``. Each ``step``:

1. the full local gradient is reduced through the switch; every chunk comes back renormalized by its
   arrival count (unbiased under loss), or with the transport's fallback where nothing arrived;
2. this worker's optimizer steps **its shard only** (a contiguous run of chunks, ZeRO style);
3. it broadcasts the shard's absolute values (PARAM); every other worker overwrites its copy of the
   chunks that arrive and keeps the stale copy of the rest; a copy older than ``stale_bound`` steps is
   resent reliably, so no copy is ever more than ``stale_bound + 1`` steps old (see ``exchange.py``).

``ShardedOptimizer(opt, worker, critical="default", module=model)`` (or globs, or a predicate; see
``critical.py``) marks parameters critical: their gradient chunks come back with every worker counted
and their shards' broadcasts are delivered (the reliable exchange path), every step.

``ShardedOptimizer(opt, worker, retrieve=True)``: parameter copies lost on the way are asked for and
resent within the step (ParamExchange's retrieval): no stale copies, one resend per lost copy.

An owner that dies keeps its shard where its last publish left it: nobody steps it while it is away.
Under PARAM loss that is where each survivor's own copy was left, so the lowest-numbered survivor serves
its copy of the shard again and every survivor adopts it (``exchange.py``, "A dead owner's shard is
served again"): the survivors hold one copy of it. ``reserve=False`` turns that off (each keeps its own).
Its peers stop waiting for its copies once their transports presume it dead, or once it has sent nothing
for a step for ``liveness_timeout_s`` (default: the liveness monitor's 3 s; set it to the job's monitor
timeout) of their wait: a rank killed between its reduce and its publish (see ``exchange.py``).

``ShardedOptimizer(opt, worker, rotate_seed=s)``: the gradient is reduced in a seeded randomized Hadamard
basis (hostlib/emulation/rotation.py; signs from (s, step, 0), the same on every worker): rotated before
quantization and packetization, rotated back after renormalization, so a lost packet costs a little of every
value of its block instead of K neighbouring values. A chunk that falls back to ``prev`` gets the previous
result rotated into this step's basis. Not combined with feedback, privacy or critical chunks.

``ShardedOptimizer(opt, worker, feedback=True)``: lost-contribution feedback (hostlib/emulation/feedback.py).
After each reduce the worker reads its own bit in every chunk's RESULT bitmap; where the reduce did
not count its contribution (lost on the way up, withheld, a RESULT that never came, or a sum its
allreduce discarded for a fallback) it keeps what it sent for those chunks and adds it to its next
gradient for them, once: a lost contribution is missing from the aggregate at step t and enters it at
t+1, delayed, not dropped, at no extra traffic. Pair it with a transport that divides by N
(``renormalize="none"``, ``fallback="zero"``), as ``lta train --mechanism feedback`` does: on top of
renormalization, which already stands for the lost contribution, the expected aggregate would be
g/(1−p) (hostlib/emulation/feedback.py). Critical chunks
follow the same rule (they come back with every worker counted, so they carry nothing unless a
critical RESULT came back short). With ``privacy=...`` the residual is added *before* clipping and
is the clipped value this worker meant to send, without its noise share (the top-up already made up
for the lost share): every message is still clipped to C, so the accountant's per-step sensitivity
holds, but clipping may shrink the carried part: under DP the feedback is delayed and possibly scaled
down, not exact.

The wrapped optimizer's parameter groups are rebound to this worker's shard, so its hyperparameters,
per-group settings and any LR scheduler attached to it keep working. Exact (equal to the unwrapped
optimizer at zero loss, up to the codec's rounding) for element-wise optimizers: SGD, Adam(W), RMSprop,
Adagrad, ...; an optimizer that takes norms over a whole tensor (LAMB, LARS) would see shard pieces.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import Any

import numpy as np
import torch

from hostlib.emulation.feedback import ResidualFeedback, counted_by_result, feedback_stats
from hostlib.emulation.rotation import Rotation
from hostlib.liveness import DEFAULT_TIMEOUT_S as DEFAULT_LIVENESS_TIMEOUT_S
from hostlib.torch_ext.critical import CriticalSpec, chunk_mask, critical_parameters, describe
from hostlib.torch_ext.dp import GaussianPrivacy
from hostlib.torch_ext.drift import DriftMonitor
from hostlib.torch_ext.exchange import ParamExchange
from hostlib.torch_ext.flat import FlatParams
from hostlib.torch_ext.heal import Healer
from hostlib.torch_ext.layout import ShardLayout
from hostlib.torch_ext.manager import LtaManager
from hostlib.transport import Fallback, LtaWorker

_GRAD_KEY = "lta.sharded.grad"  # the transport's `prev` fallback remembers the last reduce under this key
STATE_FORMAT = "lta.sharded/1"  # ShardedOptimizer.state_dict's layout version
_COUNTERS = ("grad_chunks", "grad_chunks_partial", "grad_chunks_fallback", "grad_contributions")
STREAM = "sharded"  # the manager's statistics row of the gradient reduces (over this worker's shard)


def _stream_counter(field: str, doc: str) -> property:
    """A counter of this optimizer that is a field of its manager's ``sharded`` row."""

    def get(self: ShardedOptimizer) -> int:
        return int(getattr(self.manager.stream(STREAM), field))

    def put(self: ShardedOptimizer, value: int) -> None:
        setattr(self.manager.stream(STREAM), field, int(value))

    return property(get, put, doc=doc)


def _as_tensors(value: Any) -> Any:
    """numpy arrays (at any depth of dicts, lists and tuples) as torch tensors, copied: what
    ``torch.load(weights_only=True)`` reads. Loaders take either (``np.array`` of a CPU tensor)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, dict):
        return {key: _as_tensors(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_as_tensors(item) for item in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def _as_arrays(value: Any) -> Any:
    """The inverse of :func:`_as_tensors`: tensors (at any depth) as numpy arrays, for the numpy layers."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {key: _as_arrays(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_as_arrays(item) for item in value)
    return value


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` (fresh, not yet stepped) so that this worker owns and steps one shard.

    A thin wrapper over an :class:`LtaManager` (``manager.py``): the worker, the host staging buffers of
    the flat parameters, gradients and reduced values, the step counter (``lta_step``) and the gradient
    counters (``grad_chunks``...) are the manager's. ``worker`` may be an ``LtaWorker`` (a manager is
    made around it) or a manager."""

    grad_chunks = _stream_counter("chunks", "gradient chunks of this worker's shard reduced")
    grad_chunks_partial = _stream_counter("chunks_partial", "... renormalized from 0 < count < N")
    grad_chunks_fallback = _stream_counter("chunks_fallback", "... that used the fallback")
    grad_contributions = _stream_counter(
        "contributions", "arrival counts summed: 1 - this / (N · grad_chunks) is the loss seen"
    )

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        worker: LtaWorker | LtaManager,
        *,
        stale_bound: int = 8,
        collect_deadline_ms: float = 200.0,
        resend_timeout_s: float = 30.0,
        liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
        force_host_staging: bool = False,
        privacy: GaussianPrivacy | None = None,
        critical: CriticalSpec = None,
        module: torch.nn.Module | None = None,
        feedback: bool = False,
        retrieve: bool = False,
        rotate_seed: int | None = None,
        reserve: bool = True,
    ) -> None:
        if isinstance(optimizer, ShardedOptimizer):
            raise TypeError("the optimizer is already sharded")
        if any(optimizer.state.values()):
            raise ValueError(
                "wrap the optimizer before its first step: its state cannot be split into shards"
            )
        if rotate_seed is not None and (feedback or privacy is not None or critical is not None):
            raise ValueError(
                "rotate_seed=... reduces in a rotated basis: it does not combine with feedback, privacy "
                "or critical chunks (they act on chunks of the original basis)"
            )
        groups = optimizer.param_groups
        params = [p for g in groups for p in g["params"]]
        self.manager = LtaManager.of(worker)
        worker = self.manager.worker
        k = worker.config.elems_per_packet
        self.inner = optimizer
        self.privacy = privacy  # differential privacy: clip + noise share before, top-up after the reduce
        self.flat = FlatParams(params, k)
        self.layout = ShardLayout.contiguous(self.flat.numel, k, worker.n_workers)
        self.shard = self.layout.shard_range(worker.worker_id)
        first, last = self.layout.owners.searchsorted([worker.worker_id, worker.worker_id + 1])
        self._own_chunks = (int(first), int(last))  # the chunks of this shard
        lo, hi = self.shard
        if critical is not None and module is None:
            raise ValueError(
                "critical=... names parameters: pass module=model (the model the optimizer steps)"
            )
        marked = critical_parameters(module, critical) if module is not None else set()
        ranges = [r for p, r in zip(params, self.flat.ranges, strict=True) if id(p) in marked]
        self.critical_mask = chunk_mask(ranges, self.layout.n_chunks, k)  # chunks sent reliably
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

        staged = {"force_staging": force_host_staging}
        self._params_host = self.manager.mirror((STREAM, "params"), self.flat.data, **staged)
        self._grads_host = self.manager.mirror((STREAM, "grads"), self.flat.grad, **staged)
        self._reduced = torch.zeros(self.flat.padded, dtype=torch.float32, device=self.flat.data.device)
        self._reduced_host = self.manager.mirror((STREAM, "reduced"), self._reduced, **staged)
        rows = self._params_host.pull().reshape(self.layout.n_chunks, k)
        self.exchange = ParamExchange(
            worker,
            self.layout,
            rows,
            stale_bound=stale_bound,
            deadline_ms=collect_deadline_ms,
            resend_timeout_s=resend_timeout_s,
            liveness_timeout_s=liveness_timeout_s,
            critical=self.critical_mask,
            retrieve=retrieve,
            reserve=reserve,
        )
        self.drift = DriftMonitor(self._params_host.array[lo:hi], stale_bound)
        # lost-contribution feedback: what the last reduce did not count of this worker's gradient
        self.feedback = ResidualFeedback(self.layout.n_chunks, k) if feedback else None
        self.rotate_seed = rotate_seed
        self._rotated_prev = np.zeros(self.flat.padded, dtype=np.float32)  # last result, original basis
        # A rank that fell behind its peers takes a live peer's copies and step (heal.py; step()).
        self.healer = Healer(worker, self._heal_snapshot, self._heal_restore)
        # Where a peer behind would join this rank, asked from inside step() (heal.py): the step whose
        # reduce runs and the unit counter at its start, or (after the reduce) the next step.
        self._joining_at: tuple[int, int | None] | None = None

    @property
    def worker(self) -> LtaWorker:
        return self.manager.worker

    @property
    def lta_step(self) -> int:
        """LTA steps taken (``step`` and ``synchronize`` each end one): the manager's step counter."""
        return self.manager.step

    @lta_step.setter
    def lta_step(self, value: int) -> None:
        self.manager.step = int(value)

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
        grads = self._grads_host.pull()  # padded to whole chunks (zeros past numel)
        sent = grads
        if self.feedback is not None:
            self.feedback.add_to(grads.reshape(self.layout.n_chunks, -1))
        if self.privacy is not None:
            if self.feedback is None:
                self.privacy.privatize_(grads[: self.flat.numel])
            else:  # carry the clipped contribution, not the noise share (see the module docstring)
                self.privacy.clip_(grads[: self.flat.numel])
                sent = grads.copy()
                self.privacy.add_share_(grads[: self.flat.numel])
        critical = self.critical_mask if self.critical_mask.any() else None
        self._joining_at = (t, self.worker.engine.next_unit)
        if self.rotate_seed is not None:
            result = self._rotated_allreduce(grads, t)
        else:
            result = self.manager.allreduce(
                grads[: self.flat.numel],
                stream=STREAM,
                step=t,
                key=_GRAD_KEY,
                critical=critical,
                mine=self._own_chunks,
            )
        if self.feedback is not None:
            counted = counted_by_result(result.bitmap, result.fallback, self.worker.worker_id)
            self.feedback.settle(sent, counted)
        self._joining_at = (t + 1, None)  # the reduce is over: a rank behind joins the next one
        if self.privacy is not None:  # only the owned chunks are used here: top up those
            self.privacy.top_up_(result, step=t, chunks=self._own_chunks)
        reduced = self._reduced_host.writable()
        reduced[lo:hi] = result.values[lo:hi]
        self._reduced_host.push(lo, hi)
        for group, (a, b) in zip(self.param_groups, self._segments, strict=True):
            group["params"][0].grad = self._reduced[a:b]
        # A reduce its peers had left before this rank started it (back from a stop) holds fallbacks
        # only: stepping the shard on them would move it where no peer's copy follows (they froze it
        # while this rank was away, and a peer that finished takes no publish); it stays as they hold it.
        if not self.worker.health.last_passed:
            self.inner.step()
        self._params_host.pull(lo, hi)
        self.drift.record()
        self.exchange.publish(t)
        self.exchange.collect(t)
        if self.exchange.changed:
            self._params_host.push()
            self.exchange.changed = False
        self.lta_step += 1
        self._joining_at = None
        if self.healer.behind:  # past catch_up_reduces skipped: its peers' copies and step, from now on
            self.healer.heal()
        else:
            self.healer.serve()
        return loss

    def _heal_snapshot(self) -> tuple[int, int, list[int], np.ndarray]:
        """What a rank behind takes from this one (heal.py): the step it joins at, the unit counter at
        that step's reduce, and this rank's copy of every parameter (a copy mid-exchange is within the
        staleness the exchange allows)."""
        step, unit = (self.lta_step, None) if self._joining_at is None else self._joining_at
        return step, self.worker.engine.next_unit if unit is None else unit, [], self.replica()

    def _heal_restore(self, step: int, counters: list[int], values: np.ndarray) -> None:
        """Take a donor's copy of every parameter and its step (:meth:`adopt`), this rank's own shard
        included: its peers hold that shard as this rank last published it before it fell behind, and
        what it did to it since (back from a stop, on fallbacks or its peers' old aggregates) no peer
        took, nor will a peer that finished its run. The wrapped optimizer keeps its state of the shard
        (nobody else steps a shard)."""
        if len(values) != self.flat.numel:
            raise ValueError(f"a peer's state has {len(values)} values, the model {self.flat.numel}")
        self.adopt(values.copy(), lta_step=step)

    def rejoin(self) -> int:
        """A restarted rank (``rejoin_default_group``) takes a live peer's copy of every parameter,
        its own shard included (its peers kept it as its dead process last published it: nobody steps
        a dead owner's shard), and its step, now, before its first step; returns that step. The wrapped
        optimizer's state of the shard is whatever it holds (fresh, or loaded from a checkpoint)."""
        return self.healer.heal()

    def _rotated_allreduce(self, grads: np.ndarray, t: int) -> Any:
        """Reduce ``grads`` (padded to whole chunks) in step ``t``'s rotated basis; the result's values
        come back in the original basis (every chunk: the inverse mixes them)."""
        rotation = Rotation(self.flat.padded, seed=self.rotate_seed or 0, step=t)
        result = self.manager.allreduce(
            rotation.forward(grads), stream=STREAM, step=t, key=_GRAD_KEY, mine=self._own_chunks
        )
        k = self.layout.elems_per_chunk
        rows = result.values.reshape(self.layout.n_chunks, k)
        stale = result.fallback == Fallback.PREV  # the transport's prev is last step's basis: replace it
        if stale.any():
            rows[stale] = rotation.forward(self._rotated_prev).reshape(self.layout.n_chunks, k)[stale]
        self._rotated_prev = rotation.inverse(result.values)
        result.values = self._rotated_prev
        return result

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

    # ---- checkpoints ---------------------------------------------------------------------------------
    def layout_info(self) -> dict[str, Any]:
        """What this worker's state is valid for: N, its rank, K, the parameter count, its shard
        ``[lo, hi)``, the shard's piece of every parameter group and the staleness bound."""
        return {
            "n_workers": self.worker.n_workers,
            "worker_id": self.worker.worker_id,
            "elems_per_packet": self.layout.elems_per_chunk,
            "numel": self.flat.numel,
            "shard": list(self.shard),
            "segments": [list(seg) for seg in self._segments],
            "stale_bound": self.exchange.tracker.bound,
        }

    def state_dict(self) -> dict[str, Any]:
        """This worker's part of the job's state, per shard (ZeRO style; every worker saves its own):
        the wrapped optimizer's state of the owned shard, ``lta_step`` and the chunk counters, the
        parameter exchange (step of every copy held, stale-tracker ages, resend requests, statistics),
        the drift monitor, the transport's stochastic-rounding generator, unit counter and ``prev``
        fallback, the feedback residuals and counters (``feedback=True``), the last result in the
        original basis (``rotate_seed``: the ``prev`` fallback of a rotated reduce), and the layout
        (``layout_info``) the state belongs to. Copies, not references; only tensors and plain values,
        so ``torch.load(weights_only=True)`` reads it back. The parameters are the model's: save
        ``model.state_dict()`` beside it (hostlib/torch_ext/checkpoint.py does)."""
        return {
            "format": STATE_FORMAT,
            "layout": self.layout_info(),
            "inner": copy.deepcopy(self.inner.state_dict()),
            "lta_step": self.lta_step,
            "counters": {name: getattr(self, name) for name in _COUNTERS},
            "exchange": _as_tensors(self.exchange.state_dict()),
            "drift": _as_tensors(self.drift.state_dict()),
            "transport": _as_tensors(self.worker.codec_state()),
            "privacy": None if self.privacy is None else asdict(self.privacy.stats),
            "feedback": None if self.feedback is None else _as_tensors(self.feedback.state_dict()),
            "rotated_prev": None if self.rotate_seed is None else _as_tensors(self._rotated_prev.copy()),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into this (fresh or used) optimizer. Raises
        CheckpointMismatch, before changing anything, unless it was saved by the same rank of a job
        with the same N, K, parameter count and parameter groups. Load the model's parameters first:
        this refreshes the host copy of them that the exchange reads and writes."""
        from hostlib.torch_ext.checkpoint import CheckpointMismatch

        if state_dict.get("format") != STATE_FORMAT:
            found = state_dict.get("format")
            raise CheckpointMismatch(
                f"not a sharded-optimizer state (format {found!r}, not {STATE_FORMAT!r})"
            )
        saved, mine = state_dict["layout"], self.layout_info()
        differs = [
            f"{key} {saved.get(key)} (here {value})" for key, value in mine.items() if saved.get(key) != value
        ]
        if differs:
            raise CheckpointMismatch(
                "the optimizer state was saved for another layout: " + ", ".join(differs)
            )
        saved_feedback = state_dict.get("feedback")
        if saved_feedback is not None and self.feedback is None:
            raise CheckpointMismatch(
                "the optimizer state was saved with feedback=True: build this one with feedback=True "
                "(lta train --mechanism feedback), or its carried residuals would be dropped"
            )
        self.inner.load_state_dict(copy.deepcopy(state_dict["inner"]))
        # torch's load_state_dict builds new group dicts: share them again (schedulers on either object)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.lta_step = int(state_dict["lta_step"])
        for name in _COUNTERS:
            setattr(self, name, int(state_dict["counters"][name]))
        self._params_host.pull()
        self.exchange.load_state_dict(_as_arrays(state_dict["exchange"]))
        self.exchange.changed = False
        self.drift.load_state_dict(_as_arrays(state_dict["drift"]))
        self.worker.load_codec_state(_as_arrays(state_dict["transport"]))
        if self.feedback is not None:  # a state saved without feedback carries nothing
            if saved_feedback is None:
                self.feedback.clear()
            else:
                self.feedback.load_state_dict(_as_arrays(saved_feedback))
        if self.rotate_seed is not None and state_dict.get("rotated_prev") is not None:
            self._rotated_prev = np.asarray(_as_arrays(state_dict["rotated_prev"]), dtype=np.float32).copy()
        if self.privacy is not None and state_dict.get("privacy") is not None:
            known = {f.name for f in fields(self.privacy.stats)}
            for name, value in state_dict["privacy"].items():
                if name in known:
                    setattr(self.privacy.stats, name, value)

    # ---- statistics ----------------------------------------------------------------------------------
    def drift_stats(self, p: float | None = None) -> dict[str, Any]:
        """What this worker saw: gradient chunks of its shard (partial = renormalized from fewer than N,
        fallback = none arrived), its shard's update variance σ², the drift its receivers should see
        under Bernoulli(p) param loss (``predicted``, momentum-aware), the ages of its stale copies, and
        the feedback counters (``hostlib.emulation.feedback.feedback_stats``)."""
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
            "critical": describe(self.critical_mask, self.flat.numel, self.layout.elems_per_chunk),
            **feedback_stats(self.feedback),  # lost-contribution feedback (zeros without it)
        }
        if p is not None:
            out["predicted_drift"] = self.drift.predicted(p)
        return out

    @torch.no_grad()
    def adopt(self, replica: np.ndarray, *, lta_step: int) -> None:
        """Elastic rejoin: a restarted worker takes a survivor's copy of all parameters (``replica``,
        :meth:`replica`'s output, taken between two steps) and its step counter, and goes on from there
        as if it had held those copies all along. Its optimizer state is whatever it has (fresh, or its
        shard's last checkpoint)."""
        values = np.asarray(replica, dtype=np.float32)
        if values.shape != (self.flat.numel,):
            raise ValueError(f"replica has shape {values.shape}, the model has {self.flat.numel} parameters")
        host = self._params_host.writable()
        host[: self.flat.numel] = values
        self._params_host.push()
        self.exchange.adopt(lta_step)
        if self.feedback is not None:  # what this rank's dead process had carried died with it
            self.feedback.clear()
        lo, hi = self.shard
        self.drift = DriftMonitor(self._params_host.array[lo:hi], self.drift.bound)
        self.lta_step = lta_step

    def replica(self) -> np.ndarray:
        """This worker's copy of all parameters (host float32, ``numel`` values)."""
        return self._params_host.pull()[: self.flat.numel].copy()
