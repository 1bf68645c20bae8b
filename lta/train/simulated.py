"""Simulated workers for ``lta train``: N workers (16, 64, ...) in one process, Algorithm 1 step by step.

The paper trains with N=64 workers; this machine runs a handful of processes. Here the N workers are
arrays, not processes, and every step does what the real path (lta/train/experiment.py through the
softswitch) does, with the drops drawn by hostlib/emulation/simulate.py instead of a switch:

1. every worker computes the gradient of its own slice of the global batch **at its own replica** of
   the parameters (stale copies included): one autograd pass of ``gpt.stacked_losses`` (the model with
   the replica axis folded into batched matrix products; ``gradients="vmap"``, a ``torch.func.vmap`` of
   ``CharGpt`` over the replicas, is the reference it is tested against, and costs ~20% more CPU);
2. the gradients are reduced chunk by chunk (K values, the transport's layout): exponent round, data
   round with stochastic rounding, per-chunk counts, each packet's fate drawn from per-(direction,
   worker) drop streams that persist across steps (Bernoulli or Gilbert–Elliott), and the aggregation
   method of ``experiment.METHODS`` (renorm: sum / count, else the previous value; prev: sum / N when
   complete, else the previous value; zero: sum / N, lost contributions count as zeros);
3. each chunk's owner (ZeRO layout: ``ShardLayout.contiguous``, as the sharded optimizer) takes the
   value its own ``allreduce`` would return and steps its shard: AdamW as ``lta train``, or SGD with
   momentum. Both are element-wise, so one optimizer over the concatenated shards keeps exactly each
   owner's state for its shard (the same bias-correction step count everywhere);
4. each owner broadcasts its shard; every receiver loses each chunk's copy by its ``param`` stream and
   keeps its stale copy then; a copy older than the stale bound S after a step is resent reliably with
   the next step's broadcast (exempt from loss), so no copy is ever more than S+1 steps old.

Mechanisms (``RunSpec.mechanism``, ``experiment.mechanism_settings``), as on the real path: ``stale1`` /
``stale2`` set S; ``feedback`` gives every worker a residual (hostlib/emulation/feedback.py, the class the
sharded optimizer uses): the chunks its own view of the round did not count (its GRAD lost or withheld, its
RESULT lost, or a sum its method discards) are added to its next gradient for them, and its chunks are divided
by N (experiment.aggregation); ``retrieve`` resends every lost parameter copy within the step (counted in
``resend_requests``), so no copy is stale; ``rotate`` reduces the gradients in a seeded randomized Hadamard
basis (hostlib/emulation/rotation.py: seed, step and tensor 0, as ``ShardedOptimizer(rotate_seed=seed)``):
rotated before quantization, rotated back after renormalization; the ``prev`` fallback of a chunk nobody's
contribution reached is the previous result rotated into this step's basis.

Seeds: the initial weights (``torch.manual_seed(seed)``) and every worker's batches (generator
``seed·1000 + rank``) are drawn as the real path draws them; the drop streams depend on the seed,
direction and worker only (not the drop rate or method), so all methods at one rate see the same losses.
At 0% loss nothing is drawn: no chunk is lost and two runs with the same seed repeat bit for bit.

The global batch is kept from the real N=4 run (``TrainConfig.batch`` × 4 sequences per step, split
evenly: 1 per worker at N=64), so the regimes differ only in how many workers share it.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.func import functional_call, grad_and_value, vmap

from hostlib.emulation.dropmodels import DIRECTIONS
from hostlib.emulation.feedback import ResidualFeedback, counted_mask, feedback_stats
from hostlib.emulation.rotation import Rotation
from hostlib.emulation.simulate import (
    ChunkRound,
    FabricStreams,
    fallback_codes,
    loss_policy,
    simulate_round,
    worker_values,
)
from hostlib.torch_ext.drift import DriftMonitor
from hostlib.torch_ext.layout import ShardLayout
from hostlib.transport import Fallback
from lta.train.experiment import (
    METHODS,
    RunSpec,
    TrainConfig,
    aggregation,
    diverged,
    evaluate,
    lr_factor,
    make_optimizer,
    mechanism_settings,
)
from lta.train.gpt import CharCorpus, CharGpt, stacked_losses
from lta.train.sweep import RunResult

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "sgd")
LOSS_MODELS = ("bernoulli", "ge")
REAL_WORKERS = 4  # the real run's N: its global batch (TrainConfig.batch × 4) is what the workers split
# How the N workers' gradients are computed: "stacked" (gpt.stacked_losses: the replica axis folded into
# batched matrix products, one autograd pass; the default, ~20% less CPU) or "vmap" (torch.func.vmap of
# CharGpt itself over the replicas: the reference the stacked path is tested against).
GRADIENT_PATHS = ("stacked", "vmap")


@dataclass
class SimulatedRunResult(RunResult):
    """A :class:`~lta.train.sweep.RunResult` (same fields, same ``workers[i]["stats"]`` keys, so report.py
    reads it) with what only a simulated run knows up front."""

    n_workers: int = 0
    optimizer: str = "adamw"
    loss_model: str = "bernoulli"
    directions: list[str] = field(default_factory=list)
    batch_per_worker: int = 0
    grad_loss_seen: float = 0.0  # contributions missing from the owners' chunks (1 − Σcount / (N·C·steps))
    param_loss_seen: float = 0.0  # foreign parameter copies not fresh after a step
    max_stale_age: int = 0  # the oldest copy any receiver held after any step (≤ S+1)
    step_s: float = 0.0  # mean wall time of one training step


def run_simulated(
    spec: RunSpec,
    cfg: TrainConfig,
    n_workers: int,
    *,
    optimizer: str = "adamw",
    loss_model: str = "bernoulli",
    directions: tuple[str, ...] = ("up", "param"),
    batch_per_worker: int | None = None,
    sgd_lr: float = 0.2,
    momentum: float = 0.9,
    mean_burst: float = 4.0,
    withhold_uncounted: bool = True,
    corpus: CharCorpus | None = None,
    on_step: Callable[[int], None] | None = None,
    gradients: str = "stacked",
) -> SimulatedRunResult:
    """Train ``cfg.steps`` steps with ``n_workers`` simulated workers at ``spec.drop`` loss on every link
    in ``directions`` and return the run as ``lta train`` reports it.

    ``optimizer``: ``adamw`` (``cfg.lr``, betas (0.9, 0.95), ``cfg.weight_decay``, as ``lta train``) or
    ``sgd`` (``sgd_lr`` peak, ``momentum``, no weight decay), both on ``lr_factor``'s warmup + cosine.
    The SGD default is the best of 0.05/0.1/0.2/0.3/0.5 on the default config (N=16, 0%, one seed).
    ``loss_model``: ``bernoulli`` or ``ge`` (Gilbert–Elliott at the same mean rate, bad spells of
    ``mean_burst`` packets). ``batch_per_worker``: sequences per worker per step (default: the real
    N=4 run's global batch split over ``n_workers``, at least 1). ``withhold_uncounted``: a worker whose
    exponent proposal was lost withholds the chunk whatever its values, as the transport does (False:
    only when they would saturate, the transport's rule before issue K;
    hostlib.emulation.simulate.simulate_round).
    With ``cfg.exact`` (the default) exponent packets are spared, as the real path's exact mode does.
    ``on_step(step)`` after every step. ``gradients``: one of ``GRADIENT_PATHS`` (same estimate)."""
    run = SimulatedRun(
        spec,
        cfg,
        n_workers,
        optimizer=optimizer,
        loss_model=loss_model,
        directions=directions,
        batch_per_worker=batch_per_worker,
        sgd_lr=sgd_lr,
        momentum=momentum,
        mean_burst=mean_burst,
        withhold_uncounted=withhold_uncounted,
        corpus=corpus,
        gradients=gradients,
    )
    return run.train(on_step)


def default_batch_per_worker(cfg: TrainConfig, n_workers: int) -> int:
    """The real N=4 run's global batch split over ``n_workers`` (at least one sequence each)."""
    return max(1, round(cfg.batch * REAL_WORKERS / n_workers))


def pair_drift(replicas: np.ndarray, layout: ShardLayout) -> float:
    """Measured ``E[D²]`` over every value and every pair of its receivers, as
    ``hostlib.torch_ext.drift.receiver_pair_drift`` defines it, in O(N·numel) instead of O(N²·numel):
    for the n receivers of a value, ``Σ_{i<k} (x_i − x_k)² = n·Σx_i² − (Σx_i)²`` (taken on the
    differences from the owner's value, which is exact and free of cancellation)."""
    n_workers = replicas.shape[0]
    if n_workers < 3:
        raise ValueError("no value has two receivers: drift needs at least 3 workers")
    numel = layout.numel
    values = replicas[:, :numel].astype(np.float64)
    owner = layout.element_owners()
    diff = values - values[owner, np.arange(numel)][None, :]  # the owner's row is 0: receivers only
    receivers = n_workers - 1
    s1 = diff.sum(axis=0)
    s2 = np.einsum("wv,wv->v", diff, diff)
    total = float(np.sum(receivers * s2 - s1 * s1))
    return total / (numel * receivers * (receivers - 1) / 2)


class SimulatedRun:
    """One run: N replicas, the owners' optimizer, the drop streams. :meth:`step` is one Algorithm 1
    step for every worker; :meth:`train` runs them all and evaluates."""

    def __init__(
        self,
        spec: RunSpec,
        cfg: TrainConfig,
        n_workers: int,
        *,
        optimizer: str = "adamw",
        loss_model: str = "bernoulli",
        directions: tuple[str, ...] = ("up", "param"),
        batch_per_worker: int | None = None,
        sgd_lr: float = 0.2,
        momentum: float = 0.9,
        mean_burst: float = 4.0,
        withhold_uncounted: bool = True,
        corpus: CharCorpus | None = None,
        gradients: str = "stacked",
    ) -> None:
        if gradients not in GRADIENT_PATHS:
            raise ValueError(f"gradients must be one of {', '.join(GRADIENT_PATHS)}, got {gradients!r}")
        if spec.method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)}, got {spec.method!r}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
        if n_workers < 3:
            raise ValueError(f"simulated training needs at least 3 workers (drift pairs), got {n_workers}")
        unknown = set(directions) - set(DIRECTIONS)
        if unknown:
            raise ValueError(f"unknown directions {sorted(unknown)}: use {', '.join(DIRECTIONS)}")
        settings = mechanism_settings(spec.mechanism, cfg)
        cfg = replace(cfg, stale_bound=settings.stale_bound)  # the bound every stale copy obeys
        self.spec, self.cfg, self.n_workers = spec, cfg, n_workers
        self.optimizer_name, self.loss_model, self.directions = optimizer, loss_model, tuple(directions)
        self.corpus = corpus or CharCorpus()
        self.batch = batch_per_worker or default_batch_per_worker(cfg, n_workers)
        n = n_workers

        torch.manual_seed(spec.seed)  # the real path's initial weights
        self.model = CharGpt(cfg.gpt(self.corpus.vocab))
        named = list(self.model.named_parameters())
        self._names = [name for name, _ in named]
        self._shapes = [p.shape for _, p in named]
        sizes = [p.numel() for _, p in named]
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        self.numel = int(self._offsets[-1])
        k = cfg.elems_per_packet
        self.layout = ShardLayout.contiguous(self.numel, k, n)
        self.n_chunks, self.k = self.layout.n_chunks, k
        self.owners = self.layout.owners
        initial = torch.cat([p.detach().reshape(-1) for _, p in named])

        # Worker w's replica is row w (padded to whole chunks); the owners' values are one flat parameter.
        self.replicas = torch.zeros(n, self.layout.padded)
        self.replicas[:, : self.numel] = initial
        self._replica_rows = self.replicas.numpy().reshape(n, self.n_chunks, k)
        self.owned = torch.nn.Parameter(initial.clone())
        self._owned_rows = np.zeros((self.n_chunks, k), dtype=np.float32)
        chosen = replace(cfg, optimizer=optimizer, sgd_lr=sgd_lr)
        self.opt = make_optimizer([self.owned], chosen, momentum=momentum)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, cfg))
        owned_np = self.owned.detach().numpy()  # shares memory: the optimizer updates in place
        self.shards = [self.layout.shard_range(w) for w in range(n)]
        self.monitors = [DriftMonitor(owned_np[lo:hi], cfg.stale_bound) for lo, hi in self.shards]

        self.policy = loss_policy(loss_model, spec.drop, mean_burst)
        self.fabric = FabricStreams(n, {d: self.policy for d in self.directions}, spec.seed)
        self.rng = np.random.default_rng([spec.seed, 0x5EED])  # stochastic rounding
        self.batches = [torch.Generator().manual_seed(spec.seed * 1000 + w) for w in range(n)]
        self.prev = np.zeros((self.n_chunks, k), dtype=np.float32)  # each owner's last reduce result
        self.withhold_uncounted = withhold_uncounted
        self._grads = np.zeros((n, self.layout.padded), dtype=np.float32)
        self.feedback = ResidualFeedback(self.n_chunks, k, n) if settings.feedback else None
        self.retrieve = settings.retrieve  # lost parameter copies resent within the step
        self.rotate = settings.rotate  # gradients reduced in a rotated basis (hostlib/emulation/rotation.py)
        self.last_round: tuple[ChunkRound, np.ndarray] | None = None  # the last reduce: (round, delivered)

        # Parameter exchange: chunk ages per receiver, copies requested for a reliable resend.
        self.foreign = self.owners[None, :] != np.arange(n)[:, None]  # (N, C): w receives chunk c
        self.age = np.zeros((n, self.n_chunks), dtype=np.int64)
        self.requested = np.zeros((n, self.n_chunks), dtype=bool)
        self.counters = {
            name: np.zeros(n, dtype=np.int64)
            for name in (
                "grad_chunks",
                "grad_chunks_partial",
                "grad_chunks_fallback",
                "grad_contributions",
                "chunks_expected",
                "chunks_fresh",
                "resend_requests",
                "resends_served",
                "max_age_seen",
            )
        }
        self.step_count = 0
        self.gradients = gradients
        self._grad_fn = vmap(grad_and_value(self._worker_loss))

    # ---- one step ------------------------------------------------------------------------------------
    def _worker_loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, params, (x, y))

    def _replica_params(self) -> dict[str, torch.Tensor]:
        """Views of the N replicas, one (N, *shape) tensor per parameter (no copy)."""
        n, off = self.n_workers, self._offsets
        return {
            name: self.replicas[:, off[i] : off[i + 1]].view(n, *shape)
            for i, (name, shape) in enumerate(zip(self._names, self._shapes, strict=True))
        }

    def local_gradients(self) -> tuple[np.ndarray, np.ndarray]:
        """Every worker's gradient at its own replica on its next batch slice: ((N, padded), (N,) loss)."""
        cfg = self.cfg
        pairs = [self.corpus.batch("train", self.batch, cfg.context, g) for g in self.batches]
        x = torch.stack([p[0] for p in pairs])
        y = torch.stack([p[1] for p in pairs])
        if self.gradients == "stacked":
            # Leaves sharing the replicas' memory: the gradient of the summed losses, row w per worker.
            leaves = {name: view.detach().requires_grad_() for name, view in self._replica_params().items()}
            losses = stacked_losses(self.model.cfg, leaves, x, y)
            grads = dict(zip(leaves, torch.autograd.grad(losses.sum(), list(leaves.values())), strict=True))
        else:
            with warnings.catch_warnings():
                # attention has no vmap batching rule on CPU: torch loops over the workers there (measured)
                warnings.filterwarnings("ignore", message="There is a performance drop")
                grads, losses = self._grad_fn(self._replica_params(), x, y)
        off = self._offsets
        for i, name in enumerate(self._names):
            self._grads[:, off[i] : off[i + 1]] = grads[name].reshape(self.n_workers, -1).numpy()
        return self._grads, losses.detach().numpy().astype(np.float64)

    def reduce(self, grads: np.ndarray) -> np.ndarray:
        """The owners' view of one reduce of ``grads`` (N × padded): per chunk, what its owner's
        ``allreduce`` returns under the run's method. Counts what each owner saw, as the sharded
        optimizer does. With feedback, ``grads`` (in place) gets each worker's residual first, and the
        residuals then keep what each worker's own view of the round did not count."""
        n, c, k = self.n_workers, self.n_chunks, self.k
        chunks = grads.reshape(n, c, k)
        if self.feedback is not None:
            self.feedback.add_to(chunks)
        rotation, prev = None, self.prev
        if self.rotate:
            rotation = Rotation(c * k, seed=self.spec.seed, step=self.step_count)
            chunks = rotation.forward(grads).reshape(n, c, k)
            prev = rotation.forward(self.prev.reshape(-1)).reshape(c, k)  # last result, this basis
        summed, delivered = simulate_round(
            chunks,
            self.fabric,
            self.rng,
            self.cfg.exp_copies,
            withhold_uncounted=self.withhold_uncounted,
            exact=self.cfg.exact,  # exponents spared, as the real path's exact mode does
        )
        self.last_round = (summed, delivered)
        if self.feedback is not None:
            _, codes = fallback_codes(summed.count, delivered, n, **METHODS[aggregation(self.spec)])
            self.feedback.settle(chunks, counted_mask(summed.contributed, delivered, codes))
        every = np.arange(c)
        method = METHODS[aggregation(self.spec)]
        values, codes = worker_values(
            summed, delivered[self.owners, every], n, prev=prev, local=chunks[self.owners, every], **method
        )
        if rotation is not None:
            values = self._rotate_back(rotation, values, summed, delivered, prev, chunks)
        self.prev = values
        count = summed.count
        per_owner = np.bincount(self.owners, minlength=n)
        self.counters["grad_chunks"] += per_owner
        self.counters["grad_contributions"] += np.bincount(self.owners, weights=count, minlength=n).astype(
            np.int64
        )
        partial = (count > 0) & (count < n)
        self.counters["grad_chunks_partial"] += np.bincount(self.owners[partial], minlength=n)
        used = codes != Fallback.NONE
        self.counters["grad_chunks_fallback"] += np.bincount(self.owners[used], minlength=n)
        return values.reshape(-1)[: self.numel]

    def _rotate_back(
        self,
        rotation: Rotation,
        values: np.ndarray,
        summed: ChunkRound,
        delivered: np.ndarray,
        prev: np.ndarray,
        chunks: np.ndarray,
    ) -> np.ndarray:
        """The owners' results in the original basis. An owner's shard mixes every rotated chunk of its
        blocks, so it is rotated back from that owner's own view of all chunks; when every worker
        heard the same RESULTs (no ``down`` loss) one view serves all."""
        c, k = self.n_chunks, self.k
        if (delivered == delivered[:1]).all():
            return rotation.inverse(values.reshape(-1)).reshape(c, k)
        out = np.empty((c, k), dtype=np.float32)
        n, method = self.n_workers, METHODS[aggregation(self.spec)]
        for w in range(n):
            mine = self.owners == w
            view, _ = worker_values(
                summed, delivered[w], self.n_workers, prev=prev, local=chunks[w], **method
            )
            out[mine] = rotation.inverse(view.reshape(-1)).reshape(c, k)[mine]
        return out

    def exchange(self) -> np.ndarray:
        """Owners broadcast their shards; returns (N, C) bool: the copies each receiver got fresh."""
        rows = self._owned_rows.reshape(-1)
        rows[: self.numel] = self.owned.detach().numpy()
        lossy = self.foreign & ~self.requested  # requested copies go reliably (critical: never dropped)
        served = self.foreign & self.requested
        fresh = self.foreign & ~self.fabric.lost("param", lossy)
        retrieved = np.zeros_like(fresh)
        if self.retrieve:  # every lost copy is asked for and resent (reliably) within the step
            retrieved = self.foreign & ~fresh
            fresh = fresh | retrieved
            served = served | retrieved
        np.copyto(self._replica_rows, self._owned_rows[None], where=(fresh | ~self.foreign)[:, :, None])
        self.age[self.foreign] += 1
        self.age[fresh] = 0
        overdue = self.foreign & (self.age > self.cfg.stale_bound)
        self.requested = overdue
        n = self.n_workers
        self.counters["resends_served"] += np.bincount(
            np.broadcast_to(self.owners, served.shape)[served], minlength=n
        )
        self.counters["chunks_expected"] += self.foreign.sum(axis=1)
        self.counters["chunks_fresh"] += fresh.sum(axis=1)
        self.counters["resend_requests"] += overdue.sum(axis=1) + retrieved.sum(axis=1)
        np.maximum(self.counters["max_age_seen"], self.age.max(axis=1), out=self.counters["max_age_seen"])
        return fresh

    def step(self) -> np.ndarray:
        """One Algorithm 1 step for every worker; returns each worker's training loss (N,)."""
        grads, losses = self.local_gradients()
        if not (np.isfinite(losses).all() and np.isfinite(grads).all()):
            raise diverged(self.spec.name, self.step_count)
        reduced = self.reduce(grads)
        self.owned.grad = torch.from_numpy(reduced.copy())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step()
        for monitor in self.monitors:
            monitor.record()
        self.exchange()
        self.step_count += 1
        return losses

    # ---- a whole run ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Every replica takes the owners' values (the real path's reliable exchange before evaluating)."""
        self.replicas[:, : self.numel] = self.owned.detach()
        self.age[:] = 0
        self.requested[:] = False

    def validation_loss(self) -> float:
        """Mean loss of the owners' parameters over ``experiment.evaluate``'s validation batches."""
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(self.owned.detach(), self.model.parameters())
        total, count = evaluate(self.model, self.corpus, self.cfg, 0, 1)
        return total / count

    def param_loss_probability(self) -> float:
        return self.policy.mean_loss if "param" in self.directions else 0.0

    def train(self, on_step: Callable[[int], None] | None = None) -> SimulatedRunResult:
        cfg, spec, n = self.cfg, self.spec, self.n_workers
        t0 = time.perf_counter()
        result = SimulatedRunResult(spec, [], 0.0, 0.0, 0.0)
        losses = np.zeros((n, cfg.steps))
        step_time = 0.0
        for step in range(cfg.steps):
            ts = time.perf_counter()
            losses[:, step] = self.step()
            step_time += time.perf_counter() - ts
            if (step + 1) % cfg.drift_every == 0:
                self._record_drift(result, step)
            if on_step is not None:
                on_step(step)
        self.synchronize()
        tail = max(1, cfg.steps // 10)
        result.worker_curves = losses.tolist()
        result.curve = losses.mean(axis=0).tolist()
        result.train_loss = float(losses[:, -tail:].mean())
        result.val_loss = self.validation_loss()
        result.workers = self.worker_stats()
        counters = self.counters
        result.n_workers, result.optimizer = n, self.optimizer_name
        result.loss_model, result.directions = self.loss_model, list(self.directions)
        result.batch_per_worker = self.batch
        chunks = int(counters["grad_chunks"].sum())
        result.grad_loss_seen = 1.0 - int(counters["grad_contributions"].sum()) / (n * chunks)
        result.param_loss_seen = 1.0 - int(counters["chunks_fresh"].sum()) / int(
            counters["chunks_expected"].sum()
        )
        result.max_stale_age = int(counters["max_age_seen"].max())
        result.step_s = step_time / max(1, cfg.steps)
        result.wall_s = time.perf_counter() - t0
        log.debug(
            "simulated run %s: %.3f s per step, val loss %.4f", spec.name, result.step_s, result.val_loss
        )
        return result

    def _record_drift(self, result: RunResult, step: int) -> None:
        sizes = np.array([hi - lo for lo, hi in self.shards], dtype=np.float64)
        p = self.param_loss_probability()
        sigma2 = np.array([m.sigma2 for m in self.monitors])
        predicted = np.array([m.predicted(p) for m in self.monitors])
        result.drift_steps.append(step)
        result.drift_measured.append(pair_drift(self.replicas.numpy(), self.layout))
        result.drift_sigma2.append(float(np.dot(sizes, sigma2) / sizes.sum()))
        result.drift_predicted.append(float(np.dot(sizes, predicted) / sizes.sum()))

    def worker_stats(self) -> list[dict[str, Any]]:
        """Per worker, the keys of ``ShardedOptimizer.drift_stats`` that report.py reads."""
        c = self.counters
        out = []
        for w in range(self.n_workers):
            expected = int(c["chunks_expected"][w])
            ages = self.age[w, self.foreign[w]]
            out.append(
                {
                    "stats": {
                        "step": self.step_count,
                        "grad_chunks": int(c["grad_chunks"][w]),
                        "grad_chunks_partial": int(c["grad_chunks_partial"][w]),
                        "grad_chunks_fallback": int(c["grad_chunks_fallback"][w]),
                        "grad_contributions": int(c["grad_contributions"][w]),
                        "sigma2": self.monitors[w].sigma2,
                        "predicted_drift": self.monitors[w].predicted(self.param_loss_probability()),
                        "stale": {
                            "max_age": int(ages.max()) if len(ages) else 0,
                            "mean_age": float(ages.mean()) if len(ages) else 0.0,
                            "max_age_seen": int(c["max_age_seen"][w]),
                            "bound": self.cfg.stale_bound,
                        },
                        "exchange": {
                            "steps": self.step_count,
                            "chunks_expected": expected,
                            "chunks_fresh": int(c["chunks_fresh"][w]),
                            "fresh_fraction": int(c["chunks_fresh"][w]) / expected if expected else 1.0,
                            "resend_requests": int(c["resend_requests"][w]),
                            "resends_served": int(c["resends_served"][w]),
                        },
                        **feedback_stats(self.feedback, w),
                    }
                }
            )
        return out


class SimulatedCluster:
    """``lta train --simulate-workers N``: runs a sweep's specs in this process (the LocalCluster API)."""

    def __init__(self, n_workers: int, cfg: TrainConfig) -> None:
        self.n_workers, self.cfg = n_workers, cfg
        self.corpus = CharCorpus()

    def __enter__(self) -> SimulatedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run(
        self,
        spec: RunSpec,
        directions: tuple[str, ...],
        on_step: Callable[[int], None] | None = None,
        **_: Any,
    ) -> SimulatedRunResult:
        return run_simulated(
            spec,
            self.cfg,
            self.n_workers,
            optimizer=self.cfg.optimizer,
            loss_model=self.cfg.loss_model,
            directions=directions,
            sgd_lr=self.cfg.sgd_lr,
            corpus=self.corpus,
            on_step=on_step,
        )
