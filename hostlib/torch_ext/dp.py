"""Differential privacy under loss: per-worker clipping, a share of Gaussian noise from each worker, and
a top-up after renormalization so the aggregate carries noise of std σ·C *whatever count arrived*.

    privacy = GaussianPrivacy.for_worker(DpConfig(sigma=1.0, clip=1.0), worker, shared_seed=secret)
    opt = ShardedOptimizer(adamw, worker, privacy=privacy)     # does the three steps below
    epsilon(1.0, steps=300, delta=1e-5)                        # the accountant (the ``dp`` extra)

The math. N workers; worker i's gradient g_i (flattened, the whole model) is clipped to L2 norm C,
and it sends ``x_i = clip_C(g_i) + z_i`` with ``z_i ~ N(0, σ²C²/N · I)``, its share of the noise, drawn
from its own private generator. The switch sums the c workers A whose packets arrived::

    S = Σ_{i∈A} clip_C(g_i) + Σ_{i∈A} z_i,        Var(Σ_{i∈A} z_i) = c·σ²C²/N

and the host divides by d: d = c (``renormalize='count'``, the unbiased mean) or d = N (``'none'``).
The value v = S/d carries noise variance c·σ²C²/(N·d²). What DP-SGD's Gaussian mechanism needs is
the *aggregate* d·v = Σ_{i∈A} clip_C(g_i) + Z with Z ~ N(0, σ²C²): sensitivity C (one worker's
clipped contribution), noise multiplier σ, for every c. So the host adds, per chunk,

    t = (σC / d) · √((N − c) / N) · ξ,     ξ ~ N(0, I),

which brings the variance of d·(v + t) to c·σ²C²/N + (N−c)·σ²C²/N = σ²C². The renormalized mean
then has noise std σC/c per value (σC/N at c = N, DP-SGD's sum/N). Dividing by c is
post-processing: c depends on the network, not on the data. ξ comes from a generator seeded by
(shared seed, stream, step, chunk): every worker that got the chunk's RESULT has the same S and c
and draws the same ξ, so replicas stay equal; at c = N nothing is added.

Fallbacks: ``prev`` reuses an earlier result that was already topped up (post-processing) and
``zero`` is data-independent: neither gets noise, except ``renormalize='none'`` with ``zero``, which
keeps S/N from c < N contributions (topped up with d = N). ``local`` is this worker's own x_i, a count
of 1 (topped up with c = d = 1).

Whom it protects. The guarantee covers what the hosts produce from the reduced values (parameters,
the model, checkpoints) against anyone without the shared seed. The wire carries less noise: a GRAD
packet holds one share (σC/√N) and a RESULT with c arrivals c shares, so the switch and the network
are trusted, as the aggregator is in central DP. To protect against them too, multiply σ by √N (each
packet then carries σC on its own: local DP, at N times the noise variance of the aggregate).

numpy on the host copies the training loop already has (the sharded optimizer's host mirrors); the
accountant is Google's ``dp-accounting`` (``pip install 'lta[dp]'``), imported when first used.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hostlib.errors import UsageError
from hostlib.extras import MissingExtra
from hostlib.transport import Fallback, LtaWorker, ReduceResult

DP_EXTRA_HINT = "pip install 'lta[dp]'"
ACCOUNTANTS = ("rdp", "pld")


@dataclass(frozen=True)
class DpConfig:
    """σ (noise multiplier), C (clipping norm) and δ (for the ε the accountant reports)."""

    sigma: float
    clip: float
    delta: float = 1e-5

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise UsageError(f"the DP noise multiplier sigma must be a finite number >= 0, got {self.sigma}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise UsageError(f"the DP clipping norm C must be a finite number > 0, got {self.clip}")
        if not 0 < self.delta < 1:
            raise UsageError(f"the DP delta must be in (0, 1), got {self.delta}")


@dataclass
class PrivacyStats:
    clips: int = 0  # privatized gradients
    clipped: int = 0  # of those, how many were longer than C
    norm_sum: float = 0.0  # sum of the norms before clipping
    chunks_topped_up: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "clips": self.clips,
            "clipped_fraction": self.clipped / self.clips if self.clips else 0.0,
            "mean_norm_before_clip": self.norm_sum / self.clips if self.clips else 0.0,
            "chunks_topped_up": self.chunks_topped_up,
        }


class GaussianPrivacy:
    """One worker's side of the mechanism: clip and add its noise share before the reduce
    (:meth:`privatize_`), top up the missing shares after it (:meth:`top_up_`).

    ``shared_seed`` must be the same secret on every worker of the job (e.g. drawn by rank 0 and sent
    over the rendezvous store) and unknown to whoever the model is protected from. ``own_seed`` seeds
    the worker's private share; None (the default) draws it from the operating system's entropy."""

    def __init__(
        self,
        config: DpConfig,
        n_workers: int,
        elems_per_packet: int,
        *,
        shared_seed: int,
        renormalize: str = "count",
        own_seed: int | None = None,
    ) -> None:
        if renormalize not in ("count", "none"):
            raise UsageError(
                f"differential privacy needs renormalize='count' or 'none', got {renormalize!r} "
                "(weight renormalization would scale each worker's noise share by its sample count)"
            )
        if n_workers < 1 or elems_per_packet < 1 or shared_seed < 0:
            raise ValueError("need n_workers >= 1, elems_per_packet >= 1 and shared_seed >= 0")
        self.config = config
        self.n_workers, self.k = n_workers, elems_per_packet
        self.renormalize = renormalize
        self.shared_seed = int(shared_seed)
        self._own = np.random.default_rng(own_seed)
        self.stats = PrivacyStats()

    @classmethod
    def for_worker(
        cls, config: DpConfig, worker: LtaWorker, *, shared_seed: int, own_seed: int | None = None
    ) -> GaussianPrivacy:
        """The mechanism for ``worker``'s job: its N, K and renormalization."""
        return cls(
            config,
            worker.n_workers,
            worker.config.elems_per_packet,
            shared_seed=shared_seed,
            renormalize=worker.config.renormalize,
            own_seed=own_seed,
        )

    @property
    def share_std(self) -> float:
        """Std of one worker's noise share: σC/√N."""
        return self.config.sigma * self.config.clip / math.sqrt(self.n_workers)

    # ---- before the reduce ---------------------------------------------------------------------------
    def clip_(self, flat: np.ndarray) -> float:
        """Scale ``flat`` (float32, in place) to L2 norm at most C (the norm is taken in float64, so
        the float32 result is within C·(1 + 2⁻²³)); returns the norm before clipping."""
        norm = float(np.sqrt(np.dot(flat.astype(np.float64), flat.astype(np.float64))))
        c = self.config.clip
        self.stats.clips += 1
        self.stats.norm_sum += norm
        if norm > c:
            flat *= np.float32(c / norm)
            self.stats.clipped += 1
        return norm

    def add_share_(self, flat: np.ndarray) -> None:
        """Add this worker's noise share N(0, σ²C²/N) to ``flat`` in place."""
        if self.config.sigma > 0:
            flat += (self.share_std * self._own.standard_normal(flat.shape)).astype(np.float32)

    def privatize_(self, flat: np.ndarray) -> float:
        """Clip to C and add the share, in place (what this worker sends); returns the norm before."""
        norm = self.clip_(flat)
        self.add_share_(flat)
        return norm

    # ---- after the reduce ----------------------------------------------------------------------------
    def top_up_std(self, count: np.ndarray, divisor: np.ndarray) -> np.ndarray:
        """Per chunk, the std of the top-up: (σC/d)·√((N−c)/N) (0 where c >= N or d = 0)."""
        n = self.n_workers
        c = np.minimum(np.asarray(count, dtype=np.float64), n)
        d = np.asarray(divisor, dtype=np.float64)
        std = np.zeros(np.broadcast(c, d).shape)
        ok = d > 0
        std[ok] = (self.config.sigma * self.config.clip / d[ok]) * np.sqrt((n - c[ok]) / n)
        return std

    def _count_and_divisor(self, count: np.ndarray, fallback: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.n_workers
        c = count.astype(np.int64)
        renormalized = fallback == Fallback.NONE
        d = np.where(renormalized, c if self.renormalize == "count" else n, 0)
        if self.renormalize == "none":  # zero-fill keeps S/N from the c that arrived
            filled = (fallback == Fallback.ZERO) & (c > 0) & (c < n)
            d = np.where(filled, n, d)
        local = fallback == Fallback.LOCAL  # this worker's own x_i: one share of N
        return np.where(local, 1, c), np.where(local, 1, d)

    def shared_noise(self, step: int, stream: int, chunk: int, size: int) -> np.ndarray:
        """ξ for (step, stream, chunk): standard normal, the same on every worker holding the seed."""
        seq = np.random.SeedSequence([self.shared_seed, int(stream), int(step), int(chunk)])
        return np.random.Generator(np.random.Philox(seq)).standard_normal(size)

    def top_up_(
        self,
        result: ReduceResult,
        *,
        step: int,
        stream: int = 0,
        chunks: tuple[int, int] | None = None,
    ) -> int:
        """Add the missing noise shares to ``result.values`` in place, chunk by chunk (only chunks
        ``[lo, hi)`` when ``chunks`` is given: those this worker uses). ``step`` and ``stream`` (which
        tensor; one per reduce of a step) must be the same on every worker. Returns the chunks
        topped up."""
        if self.config.sigma == 0:
            return 0
        values, k = result.values, self.k
        n_chunks = len(result.count)
        lo, hi = chunks if chunks is not None else (0, n_chunks)
        count, divisor = self._count_and_divisor(result.count[lo:hi], result.fallback[lo:hi])
        std = self.top_up_std(count, divisor)
        done = 0
        for j in np.flatnonzero(std > 0):
            chunk = lo + int(j)
            a, b = chunk * k, min((chunk + 1) * k, values.size)
            xi = self.shared_noise(step, stream, chunk, b - a)
            values[a:b] += (std[j] * xi).astype(np.float32)
            done += 1
        self.stats.chunks_topped_up += done
        return done


# ---- the accountant --------------------------------------------------------------------------------------
def _dp_accounting() -> Any:
    try:
        return importlib.import_module("dp_accounting")
    except ImportError:
        raise MissingExtra(
            f"the privacy accountant needs the dp extra (Google's dp-accounting): {DP_EXTRA_HINT}"
        ) from None


def require_accountant(command: str) -> None:
    """Raise :class:`MissingExtra` (one line, naming ``command`` and the extra) unless the accountant
    imports: call it before training, so a run does not end without its ε."""
    try:
        _dp_accounting()
    except MissingExtra:
        raise MissingExtra(f"{command} needs the dp extra (privacy accountant): {DP_EXTRA_HINT}") from None


def epsilon(
    sigma: float, steps: int, delta: float, sampling_rate: float = 1.0, accountant: str = "rdp"
) -> float:
    """ε of ``steps`` compositions of the Gaussian mechanism with noise multiplier ``sigma``, each on a
    Poisson sample of rate ``sampling_rate`` (1: every record in every step), at ``delta``; from
    dp-accounting's RDP accountant (``"rdp"``) or its privacy-loss-distribution one (``"pld"``, tighter)."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    if not 0 < sampling_rate <= 1 or steps < 0 or not 0 < delta < 1 or sigma < 0:
        raise ValueError("need 0 < sampling_rate <= 1, steps >= 0, 0 < delta < 1 and sigma >= 0")
    if steps == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    dpa = _dp_accounting()
    event: Any = dpa.GaussianDpEvent(sigma)
    if sampling_rate < 1:
        event = dpa.PoissonSampledDpEvent(sampling_rate, event)
    if accountant == "rdp":
        acc = importlib.import_module("dp_accounting.rdp").RdpAccountant()
    else:
        acc = importlib.import_module("dp_accounting.pld").PLDAccountant()
    acc.compose(dpa.SelfComposedDpEvent(event, steps))
    return float(acc.get_epsilon(delta))


def privacy_report(
    config: DpConfig, steps: int, sampling_rate: float = 1.0, accountant: str = "rdp", unit: str = "worker"
) -> dict[str, Any]:
    """What results files record: σ, C, δ, steps, sampling rate, the accountant and ε; ``unit`` names
    what one record is (``worker``: a worker's whole clipped contribution to each step)."""
    return {
        "sigma": config.sigma,
        "clip": config.clip,
        "delta": config.delta,
        "steps": steps,
        "sampling_rate": sampling_rate,
        "unit": unit,
        "accountant": f"dp-accounting {accountant.upper()}",
        "epsilon": epsilon(config.sigma, steps, config.delta, sampling_rate, accountant),
    }
