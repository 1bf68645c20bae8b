"""DropCompute (seed 004): gradient accumulation with a compute threshold, and the automatic threshold.

A synchronous step waits for its slowest worker. With DropCompute each worker accumulates its M
micro-batches only until ``tau`` seconds of compute have passed (Algorithm 1), then reduces what it has.
The reduce carries the worker's sample count as the packet ``weight``; the switch sums the weights with
the gradients and, under ``TransportConfig(renormalize="weight")``, every host divides by the summed
weight, so the result is the **per-sample mean over the samples that were computed**, whoever computed
them (the batch size becomes a random variable; Theorem 4.1 bounds the convergence in samples).

    acc = DropComputeAccumulator(M, params=model.parameters(), warmup_steps=10, exchange=gloo_exchange())
    for step, micro_batches in enumerate(loader):
        acc.start_step()
        for x, y in micro_batches:
            if not acc.should_continue():        # tau passed (or all M done): stop computing
                break
            loss_fn(model(x), y).backward()      # the micro-batch's mean loss
            acc.mark_done(samples=len(x))        # folds p.grad into the sum, counts the samples
        acc.reduce(worker, step=step)            # p.grad = per-sample mean over every worker's samples
        opt.step()
        acc.end_step()                           # after warm-up: picks tau* (Algorithm 2)

**Automatic tau (Algorithm 2, appendix C.1).** For ``warmup_steps`` (I) iterations nothing is dropped and
every worker records its micro-batch latencies t_{i,n}^(m) and its iteration's non-compute time. Then the
workers exchange these over a reliable channel (``exchange``: :func:`gloo_exchange` for a torch.distributed
group, or any callable that returns every worker's record in rank order) and each evaluates

    S_i(tau) = (T_i + T^c_i) / (min(tau, T_i) + T^c_i) * Mtilde_i(tau) / M,   S_eff(tau) = mean_i S_i(tau)

(T_i: the slowest worker's compute time in iteration i; Mtilde_i(tau): the mean number of micro-batches
finished by tau) and takes tau* = argmax S_eff. Every worker holds the same numbers, so every worker
computes the same tau* with no further agreement. S_eff is throughput (samples per second) relative to
waiting for all; :attr:`DropComputeAccumulator.choice` keeps the predicted value.

Two details the paper leaves open, decided here:

- T^c_i, the serial part of an iteration (the reduce, the optimizer step), is measured as iteration time
  minus compute time on every worker, and the **smallest** over the workers is used: a fast worker's
  reduce also contains its wait for the stragglers, which is the very time DropCompute removes; the last
  worker to arrive waits for no one.
- Thresholds below M*mu/2 (mu: the mean micro-batch latency) are not considered (Assumption C.3, "the
  minimum threshold allowed"). Without that floor S_eff can peak at a single micro-batch per step when
  T^c is small: more samples per second, but a batch of 1/M the size.

**Zero micro-batches.** A worker whose threshold passed before its first micro-batch finished still
takes part in the reduce (every worker of a job must issue the same reduces in the same order: the slot
and round of each packet follow from that order). It sends zeros with weight 0: its contribution is
counted but adds nothing to the sum or to the summed weight. If every worker sent weight 0 the result is
zero (hosts fall back to dividing by the count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from hostlib.transport import LtaWorker, ReduceResult

Exchange = Callable[[np.ndarray], np.ndarray]
_T = TypeVar("_T")


# ---- Algorithm 2 -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ThresholdChoice:
    """tau* and what Algorithm 2 predicts at it (``tau_s`` inf: no threshold pays, drop nothing)."""

    tau_s: float
    s_eff: float  # predicted throughput relative to waiting for all (samples/s ratio)
    step_speedup: float  # predicted mean over iterations of (T + T^c) / (min(tau, T) + T^c)
    completed_fraction: float  # predicted share of micro-batches finished by tau (Mtilde / M)
    min_tau_s: float  # the floor the search respected (Assumption C.3)
    candidates: int  # thresholds evaluated

    @property
    def dropped_fraction(self) -> float:
        return 1.0 - self.completed_fraction


def _check_samples(latencies: np.ndarray, comm_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lat = np.asarray(latencies, dtype=np.float64)
    comm = np.asarray(comm_s, dtype=np.float64)
    if lat.ndim != 3 or 0 in lat.shape:
        raise ValueError(f"latencies must have shape (iterations, workers, micro_batches), got {lat.shape}")
    if comm.shape != lat.shape[:1]:
        raise ValueError(f"comm_s must have one value per iteration ({lat.shape[0]}), got shape {comm.shape}")
    if not (np.isfinite(lat).all() and np.isfinite(comm).all()) or (lat < 0).any() or (comm < 0).any():
        raise ValueError("latencies and comm_s must be finite times >= 0")
    if (lat.sum(axis=2).max(axis=1) + comm <= 0).any():
        raise ValueError("an iteration with no compute and no communication time has no speedup to measure")
    return lat, comm


def threshold_curves(
    latencies: np.ndarray, comm_s: np.ndarray, taus: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Algorithm 2 at every threshold of ``taus``: ``(s_eff, step_speedup, completed_fraction)``.

    ``latencies[i, n, m]`` is t_{i,n}^(m), the seconds worker n spent on micro-batch m of iteration i
    (all M computed); ``comm_s[i]`` is T^c_i. A micro-batch counts when it finishes by tau
    (T_{i,n}^(m) <= tau; the paper writes <, which differs only where tau equals a sample exactly and
    makes the supremum over tau attained at a sample)."""
    lat, comm = _check_samples(latencies, comm_s)
    taus = np.asarray(taus, dtype=np.float64).reshape(-1)
    iters, workers, m = lat.shape
    cum = np.cumsum(lat, axis=2)  # T_{i,n}^(m)
    slowest = cum[:, :, -1].max(axis=1)  # T_i
    finished = np.sort(cum.reshape(iters, workers * m), axis=1)
    done = np.stack([np.searchsorted(row, taus, side="right") for row in finished])  # (I, C)
    completed = done / (workers * m)  # Mtilde_i(tau) / M
    full = (slowest + comm)[:, None]
    step = full / (np.minimum(taus[None, :], slowest[:, None]) + comm[:, None])
    return (step * completed).mean(axis=0), step.mean(axis=0), completed.mean(axis=0)


def choose_threshold(
    latencies: np.ndarray,
    comm_s: np.ndarray,
    *,
    candidates: np.ndarray | None = None,
    min_tau_s: float | None = None,
    max_drop: float | None = None,
) -> ThresholdChoice:
    """tau* = argmax S_eff(tau) over ``candidates`` (Algorithm 2; see :func:`threshold_curves`).

    ``candidates`` default: every finish time T_{i,n}^(m) in the samples. Between two consecutive ones
    the same micro-batches finish and only min(tau, T_i) grows, so S_eff falls there: the maximum over
    all tau lies at a finish time, and this set holds it exactly. ``min_tau_s`` (default M*mu/2, Assumption
    C.3) and ``max_drop`` (a cap on the predicted dropped share) restrict the search. Ties go to the
    larger tau (fewer drops for the same throughput). When no candidate beats waiting for all
    (S_eff <= 1), ``tau_s`` is inf."""
    lat, comm = _check_samples(latencies, comm_s)
    m = lat.shape[2]
    floor = m * float(lat.mean()) / 2.0 if min_tau_s is None else float(min_tau_s)
    taus = np.unique(np.cumsum(lat, axis=2)) if candidates is None else np.unique(np.asarray(candidates))
    taus = taus[np.isfinite(taus) & (taus >= floor)]
    no_threshold = ThresholdChoice(math.inf, 1.0, 1.0, 1.0, floor, int(taus.size))
    if not taus.size:
        return no_threshold
    s_eff, step, completed = threshold_curves(lat, comm, taus)
    ok = np.ones(taus.size, dtype=bool) if max_drop is None else (1.0 - completed) <= max_drop + 1e-12
    if not ok.any():
        return no_threshold
    best = float(s_eff[ok].max())
    if best <= 1.0:
        return no_threshold
    j = int(np.flatnonzero(ok & (s_eff >= best - 1e-12 * best))[-1])
    return ThresholdChoice(
        float(taus[j]), float(s_eff[j]), float(step[j]), float(completed[j]), floor, int(taus.size)
    )


# ---- the reliable exchange -------------------------------------------------------------------------
def gloo_exchange(group: Any = None) -> Exchange:
    """An ``exchange`` over torch.distributed: all_gather of every worker's record on ``group`` (default:
    the default group; with the "lta" backend that collective takes its reliable gloo path)."""

    def exchange(local: np.ndarray) -> np.ndarray:
        mine = torch.from_numpy(np.ascontiguousarray(local, dtype=np.float64))
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, mine, group=group)
        return np.stack([t.numpy() for t in out])

    return exchange


# ---- Algorithm 1 -----------------------------------------------------------------------------------
@dataclass
class StepRecord:
    """What one iteration of one worker did."""

    micro_batches: int  # micro-batches accumulated
    samples: int  # their samples: the weight sent
    compute_s: float  # start of the step to the last accumulated micro-batch
    iteration_s: float  # start_step to end_step
    tau_s: float  # the threshold in force (inf: none)


class DropComputeAccumulator:
    """Gradient accumulation over ``micro_batches`` (M) with a compute threshold (module docstring).

    ``params``: the model's parameters; :meth:`mark_done` folds their ``.grad`` into a flat sum and
    clears it, :meth:`reduce` writes the reduced mean back. Without ``params``, give ``numel`` (the flat
    gradient's length: a worker that computes nothing still sends that many zeros), pass each
    micro-batch's flat gradient to :meth:`mark_done` (``grad=``) and read :meth:`reduce`'s values; or
    give neither and only count (the caller then sends :attr:`samples` as the weight itself).

    ``tau_s``: a fixed threshold. ``warmup_steps`` (I > 0) with no ``tau_s``: drop nothing for I steps,
    then choose tau* with Algorithm 2 over ``exchange`` (which must return every worker's record, rank
    order, shape ``(N, I, M + 1)``). Neither: wait for all micro-batches (the baseline)."""

    def __init__(
        self,
        micro_batches: int,
        *,
        params: Iterable[torch.Tensor] | None = None,
        numel: int | None = None,
        tau_s: float | None = None,
        warmup_steps: int = 0,
        exchange: Exchange | None = None,
        min_tau_s: float | None = None,
        max_drop: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if tau_s is not None and not tau_s > 0:
            raise ValueError(f"tau_s must be > 0 seconds, got {tau_s}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if tau_s is not None and warmup_steps:
            raise ValueError("give either a fixed tau_s or warmup_steps for the automatic tau*, not both")
        if warmup_steps and exchange is None:
            raise ValueError(
                "the automatic tau* needs every worker's latencies: pass exchange= (gloo_exchange() on a "
                "torch.distributed group, or a callable returning all workers' records)"
            )
        if max_drop is not None and not 0.0 <= max_drop < 1.0:
            raise ValueError(f"max_drop must be in [0, 1), got {max_drop}")
        self.micro_batches = micro_batches
        self.params = [p for p in params] if params is not None else []
        self.tau_s: float | None = tau_s
        self.warmup_steps = warmup_steps
        self.exchange = exchange
        self.min_tau_s, self.max_drop = min_tau_s, max_drop
        self._clock = clock
        if self.params and numel is not None and numel != sum(p.numel() for p in self.params):
            raise ValueError(f"numel={numel} but the parameters hold {sum(p.numel() for p in self.params)}")
        self._sum: torch.Tensor | None = None
        if self.params:
            n = sum(p.numel() for p in self.params)
            self._sum = torch.zeros(n, dtype=torch.float32, device=self.params[0].device)
        elif numel is not None:
            self._sum = torch.zeros(numel, dtype=torch.float32)
        self.choice: ThresholdChoice | None = None
        self.records: list[StepRecord] = []
        self.exchange_s = 0.0  # time spent in the one exchange of the warm-up samples
        self._warm_latencies: list[np.ndarray] = []
        self._warm_comm: list[float] = []
        self._started = False
        self._t0 = self._last = 0.0
        self._latencies: list[float] = []
        self.samples = 0

    # ---- one step ------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Start the compute clock of a new iteration (and forget the previous one's gradients)."""
        self._t0 = self._last = self._clock()
        self._latencies = []
        self.samples = 0
        self._started = True
        if self._sum is not None:
            self._sum.zero_()

    @property
    def warming_up(self) -> bool:
        return self.tau_s is None and self.choice is None and len(self._warm_comm) < self.warmup_steps

    @property
    def deadline(self) -> float:
        """The clock time at which this iteration's compute must stop (inf: no threshold)."""
        return math.inf if self.tau_s is None else self._t0 + self.tau_s

    def remaining_s(self) -> float:
        """Compute time left before the threshold (inf: none)."""
        return self.deadline - self._clock()

    @property
    def computed(self) -> int:
        """Micro-batches accumulated in this iteration."""
        return len(self._latencies)

    def should_continue(self) -> bool:
        """Whether to start another micro-batch: fewer than M done and the threshold not passed. Work
        that can be interrupted should also stop at :attr:`deadline` (Algorithm 1 preempts)."""
        self._require_started()
        return self.computed < self.micro_batches and self._clock() < self.deadline

    def mark_done(self, samples: int = 1, grad: Any = None) -> None:
        """One micro-batch of ``samples`` is finished: count it and accumulate its gradient, the
        micro-batch's *mean* gradient (``grad``, flat, or the parameters' ``.grad``, which is then
        cleared). A micro-batch started before the threshold is kept even if it ends after it: its
        compute is paid already."""
        self._require_started()
        if samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        if self.computed >= self.micro_batches:
            raise RuntimeError(
                f"mark_done called more than micro_batches={self.micro_batches} times in a step"
            )
        now = self._clock()
        self._latencies.append(now - self._last)
        self._last = now
        self.samples += samples
        if grad is not None:
            flat = torch.as_tensor(grad, dtype=torch.float32).reshape(-1)
            if self._sum is None:
                self._sum = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
            if flat.numel() != self._sum.numel():
                raise ValueError(f"grad has {flat.numel()} values, the accumulator {self._sum.numel()}")
            self._sum.add_(flat.to(self._sum.device), alpha=float(samples))
        elif self._sum is not None and self.params:
            offset = 0
            with torch.no_grad():
                for p in self.params:
                    n = p.numel()
                    if p.grad is not None:
                        self._sum[offset : offset + n].add_(p.grad.reshape(-1), alpha=float(samples))
                        p.grad = None
                    offset += n

    def local_mean(self) -> torch.Tensor:
        """This worker's per-sample mean gradient (zeros when it computed no sample)."""
        if self._sum is None:
            raise RuntimeError(
                "the accumulator does not know the gradient's size: pass params= (or numel= when the "
                "micro-batches' gradients come through mark_done(grad=...))"
            )
        return self._sum / self.samples if self.samples else torch.zeros_like(self._sum)

    def reduce(self, worker: LtaWorker, *, step: int, key: Any = None) -> ReduceResult:
        """Allreduce :meth:`local_mean` with ``weight`` = :attr:`samples` through ``worker`` (which must
        renormalize by weight) and, with ``params``, write the per-sample mean into their ``.grad``."""
        self._require_started()
        if worker.config.renormalize != "weight":
            raise ValueError(
                "DropCompute needs TransportConfig(renormalize='weight'): workers contribute different "
                f"sample counts, and dividing by the count (renormalize={worker.config.renormalize!r}) "
                "would weight a worker's few samples like another's many"
            )
        mean = self.local_mean()
        result = worker.allreduce(mean, step=step, key=key, weight=self.samples)
        if self.params:
            values = torch.from_numpy(result.values).to(self.params[0].device)
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = values[offset : offset + n].view_as(p).clone()
                offset += n
        return result

    def end_step(self) -> ThresholdChoice | None:
        """Close the iteration (its time since :meth:`start_step` counts as compute plus serial work).
        When this ends the warm-up, exchanges the samples and sets tau*; returns the choice then."""
        self._require_started()
        now = self._clock()
        compute = self._last - self._t0
        iteration = now - self._t0
        self.records.append(
            StepRecord(
                self.computed,
                self.samples,
                compute,
                iteration,
                math.inf if self.tau_s is None else self.tau_s,
            )
        )
        self._started = False
        if not self.warming_up:
            return None
        if self.computed != self.micro_batches:
            raise RuntimeError(
                f"warm-up iterations must compute all {self.micro_batches} micro-batches (Algorithm 2 "
                f"samples their latencies); this one did {self.computed}"
            )
        self._warm_latencies.append(np.array(self._latencies))
        self._warm_comm.append(max(iteration - compute, 0.0))
        if len(self._warm_comm) < self.warmup_steps:
            return None
        local = np.column_stack([np.stack(self._warm_latencies), np.array(self._warm_comm)])
        assert self.exchange is not None  # checked in __init__
        t0 = self._clock()
        every = np.asarray(self.exchange(local), dtype=np.float64)
        self.exchange_s = self._clock() - t0
        if every.ndim != 3 or every.shape[1:] != local.shape:
            raise ValueError(f"exchange returned shape {every.shape}, expected (workers, {local.shape[0]}, "
                             f"{local.shape[1]})")  # fmt: skip
        latencies = every[:, :, : self.micro_batches].transpose(1, 0, 2)  # (I, N, M)
        comm = every[:, :, self.micro_batches].min(axis=0)  # the worker that waited for no one
        self.choice = choose_threshold(latencies, comm, min_tau_s=self.min_tau_s, max_drop=self.max_drop)
        self.tau_s = None if math.isinf(self.choice.tau_s) else self.choice.tau_s
        return self.choice

    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError("call start_step() first")


# ---- Theorem 4.1 -----------------------------------------------------------------------------------
class WeightedIterate:
    """Theorem 4.1's theta-bar: one iterate drawn with probability proportional to its iteration's total
    batch size b_i (the guarantee is for that draw), kept in O(1) memory as a weighted reservoir of one:
    iterate i replaces the kept one with probability b_i / (b_1 + ... + b_i).

    Every worker must offer the same weights (the global batch of each step) with the same ``seed`` to
    keep the same iterate."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng([seed, 41])  # a stream of its own (41: Theorem 4.1)
        self.total = 0.0
        self.index: int | None = None
        self.value: Any = None
        self._offered = 0

    def offer(self, weight: float, snapshot: Callable[[], _T]) -> bool:
        """Offer the iterate whose step had total batch ``weight``; ``snapshot`` is called (to copy the
        parameters) only when it is kept. Returns whether it was."""
        if weight < 0:
            raise ValueError(f"weight must be >= 0, got {weight}")
        i = self._offered
        self._offered += 1
        self.total += weight
        if weight > 0 and self._rng.random() * self.total < weight:
            self.index, self.value = i, snapshot()
            return True
        return False
