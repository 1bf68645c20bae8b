"""In-process drop simulator: the aggregation semantics of one reduce for many workers at once.

What the switch and the hosts do to one reduce (exponent round, stochastically rounded data round,
per-chunk counts, renormalization, fallback), with every packet's fate drawn from the same drop models
the softswitch uses, but as whole-array numpy operations instead of packets. It scales past the 64
workers a bitmap can name (the scaling benchmark runs it to 1024) and needs no sockets. It models
loss, not timing: no deadlines, no FLUSH races.

Two levels. :func:`simulate_reduce` is one stateless reduce as every worker sees it. The step-by-step
pieces below it serve simulated training (lta/train/simulated.py): :class:`FabricStreams` keeps one drop
stream per (direction, worker) across reduces, as the softswitch does, so Gilbert–Elliott bursts run on
from step to step; :func:`exponent_round`, :func:`quantize_round` and :func:`sum_contributions` are the
switch's two rounds (the last also replays a contributor set read from a real reduce's bitmaps);
:func:`simulate_round` chains them under the fabric's losses; :func:`worker_values` is what one worker's
``allreduce`` returns under each aggregation method (``renormalize`` count or none, ``fallback`` prev,
zero or local: hostlib/transport/config.py), :func:`fallback_codes` its decision alone (for N workers at
once: the simulated workers' lost-contribution feedback reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hostlib import codec
from hostlib.emulation.dropmodels import DIRECTIONS, NO_LOSS, DropPolicy, DropStream
from hostlib.transport.config import FALLBACK_POLICIES, Fallback
from hostlib.transport.result import fallback_codes as result_rule
from hostlib.transport.result import renormalize_divisor


@dataclass
class SimulatedReduce:
    values: np.ndarray  # (N, n) float32: what each worker ends up with
    count: np.ndarray  # (C,) contributions that reached the switch per chunk
    delivered: np.ndarray  # (N, C) bool: the RESULT reached worker w
    contributed: np.ndarray  # (N, C) bool: worker w's data was summed


def simulate_reduce(
    inputs: np.ndarray,
    *,
    elems_per_packet: int = 64,
    up: DropPolicy = NO_LOSS,
    down: DropPolicy = NO_LOSS,
    exp_copies: int = 2,
    fallback: np.ndarray | None = None,
    seed: int = 0,
    leaf_of: np.ndarray | None = None,
    spine_up: DropPolicy = NO_LOSS,
    spine_down: DropPolicy = NO_LOSS,
    partial_tries: int = 2,
) -> SimulatedReduce:
    """Reduce ``inputs`` (N workers × n values) as the fabric would under the given loss.

    ``fallback`` (N × n) is what a worker keeps where no RESULT reaches it (default: zeros).

    ``leaf_of`` (N ints): a leaf-spine tree (docs/protocol.md, "Hierarchy") instead of one switch; worker
    w sends to leaf ``leaf_of[w]`` (``up``/``down`` are the worker links), each leaf sends its partial of
    each round to the spine (``spine_up``) and gets the RESULT back (``spine_down``). A leaf's partial and
    the spine's RESULT to a leaf are lost only when all ``partial_tries`` tries are (the leaf sends its
    partial again at its workers' first FLUSH, and a FLUSH brings a lost RESULT back); a worker's data
    counts when its GRAD reached its leaf and its leaf's partial reached the spine."""
    n_workers, n = inputs.shape
    k = elems_per_packet
    c = -(-n // k)
    e_units = -(-c // k)
    rng = np.random.default_rng(seed)
    streams = [DropStream(up, seed * 7919 + 1), DropStream(down, seed * 7919 + 2)]

    def lost(stream: DropStream, shape: tuple[int, ...]) -> np.ndarray:
        return stream.drop_many(int(np.prod(shape))).reshape(shape)

    def leaf_links(policy: DropPolicy, stream_seed: int, units: int) -> np.ndarray:
        """(N, units) bool: the link from/to each worker's leaf and the spine held (some try got through)."""
        if leaf_of is None:
            return np.ones((n_workers, units), dtype=bool)
        tries = lost(DropStream(policy, stream_seed), (partial_tries, n_leaves, units))
        return ~np.all(tries, axis=0)[leaf_of]

    n_leaves = 0
    if leaf_of is not None:
        leaf_of = np.asarray(leaf_of, dtype=np.int64)
        if leaf_of.shape != (n_workers,) or leaf_of.min() < 0:
            raise ValueError(
                f"leaf_of needs one leaf index >= 0 per worker ({n_workers}), got {leaf_of.shape}"
            )
        if partial_tries < 1:
            raise ValueError(f"partial_tries must be >= 1, got {partial_tries}")
        n_leaves = int(leaf_of.max()) + 1

    chunks = np.zeros((n_workers, c * k), dtype=np.float32)
    chunks[:, :n] = inputs
    chunks = chunks.reshape(n_workers, c, k)
    proposals = codec.exponent_proposals(chunks.reshape(-1, k)).reshape(n_workers, c)

    # Exponent round: a worker's proposal counts if any of its copies got through; each worker learns
    # the agreed exponents if that unit's RESULT reaches it.
    e_up = np.all(lost(streams[0], (exp_copies, n_workers, e_units)), axis=0)  # all copies lost
    e_up |= ~leaf_links(spine_up, seed * 7919 + 3, e_units)  # the leaf's partial never reached the spine
    e_in = np.repeat(~e_up, k, axis=1)[:, :c]
    agreed = np.where(e_in, proposals, np.iinfo(np.int32).min).max(axis=0)
    e_back = ~lost(streams[1], (n_workers, e_units)) & leaf_links(spine_down, seed * 7919 + 4, e_units)
    e_known = np.repeat(e_back, k, axis=1)[:, :c]
    e_known &= e_in.any(axis=0, keepdims=True)

    shifts = codec.data_shifts(agreed, n_workers)
    ints, saturated = codec.quantize(chunks.reshape(-1, k), np.tile(shifts, n_workers), n_workers, rng)
    ints = ints.reshape(n_workers, c, k)
    # Data round: sent if the exponent is known and fits; summed if the GRAD survives the up link.
    contributed = e_known & ~saturated.reshape(n_workers, c) & ~lost(streams[0], (n_workers, c))
    contributed &= leaf_links(spine_up, seed * 7919 + 5, c)
    count = contributed.sum(axis=0)
    sums = np.einsum("wc,wck->ck", contributed.astype(np.int64), ints.astype(np.int64))
    mean = codec.dequantize(sums, shifts, np.maximum(count, 1))
    delivered = ~lost(streams[1], (n_workers, c)) & (count > 0)[None, :]
    delivered &= leaf_links(spine_down, seed * 7919 + 6, c)
    base = (
        np.zeros((n_workers, c * k), np.float32)
        if fallback is None
        else np.pad(fallback, ((0, 0), (0, c * k - n)))
    )
    out = np.where(delivered[:, :, None], mean[None, :, :], base.reshape(n_workers, c, k))
    return SimulatedReduce(out.reshape(n_workers, -1)[:, :n], count, delivered, contributed)


# ---- one reduce step by step, with drop streams that persist across steps -----------------------------


def bursty_policy(mean_loss: float, mean_burst: float = 4.0) -> DropPolicy:
    """Gilbert–Elliott loss at a given long-run rate: the bad state loses every packet, the good state
    none (Gilbert's model), and a bad spell lasts ``mean_burst`` packets on average (``r = 1/mean_burst``);
    ``p = r·m/(1−m)`` makes the stationary loss ``p/(p+r)`` equal ``mean_loss``."""
    if not 0.0 <= mean_loss < 1.0:
        raise ValueError(f"mean loss must be in [0, 1), got {mean_loss}")
    if mean_burst < 1.0:
        raise ValueError(f"a burst lasts at least one packet, got mean_burst={mean_burst}")
    r = 1.0 / mean_burst
    p = r * mean_loss / (1.0 - mean_loss)
    if p > 1.0:
        raise ValueError(
            f"mean loss {mean_loss} with bursts of {mean_burst} packets needs p={p:.3f} > 1: "
            "use shorter bursts or a lower rate"
        )
    return DropPolicy(model="gilbert_elliott", p=p, r=r, loss_good=0.0, loss_bad=1.0)


def loss_policy(loss_model: str, mean_loss: float, mean_burst: float = 4.0) -> DropPolicy:
    """The drop policy of one experiment cell: ``bernoulli`` (independent losses at ``mean_loss``) or
    ``ge`` / ``gilbert_elliott`` (:func:`bursty_policy` at the same mean rate). 0 gives NO_LOSS."""
    if loss_model not in ("bernoulli", "ge", "gilbert_elliott"):
        raise ValueError(f"unknown loss model {loss_model!r}: use 'bernoulli' or 'ge'")
    if mean_loss == 0.0:
        return NO_LOSS
    if loss_model == "bernoulli":
        return DropPolicy(p=mean_loss)
    return bursty_policy(mean_loss, mean_burst)


class FabricStreams:
    """One seeded drop stream per (direction, worker), kept across reduces as the softswitch keeps its
    own: ``up`` decides a worker's GRAD packets, ``down`` the RESULTs sent to a worker, ``param`` the PARAM
    copies a worker receives. A direction without loss draws nothing, and a worker's stream is consumed
    only by packets that worker's link carries, so decisions on one link never shift another's."""

    def __init__(self, n_workers: int, policies: dict[str, DropPolicy], seed: int) -> None:
        unknown = set(policies) - set(DIRECTIONS)
        if unknown:
            raise ValueError(f"unknown directions {sorted(unknown)}: use {', '.join(DIRECTIONS)}")
        self.n_workers = n_workers
        self.policies = {d: p for d, p in policies.items() if p != NO_LOSS}
        self._streams = {
            d: [DropStream(p, _stream_seed(seed, d, w)) for w in range(n_workers)]
            for d, p in self.policies.items()
        }

    def lossy(self, direction: str) -> bool:
        return direction in self.policies

    def lost(self, direction: str, sent: np.ndarray) -> np.ndarray:
        """``sent``: (N, m) bool, the packets on each worker's link this round, in the order they go.
        Returns which of them are lost (False where nothing was sent): one decision per packet sent."""
        lost = np.zeros(sent.shape, dtype=bool)
        for w, stream in enumerate(self._streams.get(direction, ())):
            where = np.flatnonzero(sent[w])
            if len(where):
                lost[w, where] = stream.drop_many(len(where))
        return lost


def _stream_seed(seed: int, direction: str, worker: int) -> int:
    entropy = [seed, DIRECTIONS.index(direction), worker]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


@dataclass
class ChunkRound:
    """What the switch summed in one reduce, per chunk (chunk c is row c)."""

    sums: (
        np.ndarray
    )  # (C, K) int32: the contributors' quantized values summed (never wraps: hostlib/codec.py)
    shifts: np.ndarray  # (C,) int32: the data round's fixed-point shift
    count: np.ndarray  # (C,) int64: contributions summed
    contributed: np.ndarray  # (N, C) bool: worker w's chunk c was summed

    def error_bound(self) -> np.ndarray:
        """Per chunk: |dequantized mean − exact mean over the contributors| < this (``2^-shift``)."""
        return codec.error_bound(self.shifts)


@dataclass
class ExponentRound:
    """The exponent round of one reduce, per chunk."""

    agreed: np.ndarray  # (C,) int32: the max over the proposals that reached the switch
    known: np.ndarray  # (N, C) bool: worker w learned chunk c's agreed exponent (its RESULT arrived)
    counted: np.ndarray  # (N, C) bool: worker w's own proposal reached the switch


def exponent_round(
    chunks: np.ndarray, fabric: FabricStreams, exp_copies: int = 2, *, spared: bool = False
) -> ExponentRound:
    """The exponent round of a reduce of ``chunks`` (N × C × K): every worker sends ``exp_copies`` copies
    of each exponent packet (K proposals each); the switch keeps the max over the proposals that got
    through and sends the result back over each worker's ``down`` link. ``spared``: the ``up`` link
    loses no exponent packet (the transport's exact mode marks them critical)."""
    n_workers, c, k = chunks.shape
    e_units = -(-c // k)
    proposals = codec.exponent_proposals(chunks.reshape(-1, k)).reshape(n_workers, c)
    if spared:
        copies = np.zeros((n_workers, exp_copies * e_units), dtype=bool)
    else:
        copies = fabric.lost("up", np.ones((n_workers, exp_copies * e_units), dtype=bool))
    counted_unit = ~copies.reshape(n_workers, exp_copies, e_units).all(axis=1)
    counted = np.repeat(counted_unit, k, axis=1)[:, :c]
    agreed = np.where(counted, proposals, np.iinfo(np.int32).min).max(axis=0)
    # A unit nobody's proposal reached closes with count 0 (FLUSH): no RESULT worth hearing.
    closed = np.asarray(counted_unit.any(axis=0))
    heard = ~fabric.lost("down", np.repeat(closed[None, :], n_workers, axis=0)) & closed[None, :]
    return ExponentRound(agreed, np.repeat(heard, k, axis=1)[:, :c], counted)


def quantize_round(
    chunks: np.ndarray, agreed: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every worker's chunks (N × C × K) stochastically rounded with the agreed exponents. Returns
    (int32 values N × C × K, shift per chunk, (N, C) bool: would saturate, so the transport withholds it)."""
    n_workers, c, k = chunks.shape
    shifts = codec.data_shifts(agreed, n_workers)
    ints, saturated = codec.quantize(chunks.reshape(-1, k), np.tile(shifts, n_workers), n_workers, rng)
    return ints.reshape(n_workers, c, k), shifts, saturated.reshape(n_workers, c)


def sum_contributions(ints: np.ndarray, shifts: np.ndarray, contributed: np.ndarray) -> ChunkRound:
    """What the switch sums when exactly the workers in ``contributed`` (N × C bool) reach it: with a
    contributor set read from a real reduce's bitmaps this replays that reduce. ``ints`` is not kept."""
    # At most 2^L contributions of at most 2^(30-L) each: the int32 sum cannot wrap (hostlib/codec.py).
    sums = np.einsum("wc,wck->ck", contributed.astype(np.int32), ints.astype(np.int32, copy=False))
    return ChunkRound(sums, shifts, contributed.sum(axis=0), contributed.copy())


def simulate_round(
    chunks: np.ndarray,
    fabric: FabricStreams,
    rng: np.random.Generator,
    exp_copies: int = 2,
    *,
    withhold_uncounted: bool = True,
    exact: bool = False,
) -> tuple[ChunkRound, np.ndarray]:
    """Both rounds of a reduce of ``chunks`` (N × C × K) under the fabric's losses; the GRADs that survive
    the ``up`` link are summed. A worker sends a chunk when it learned the agreed exponent and (the
    transport's rule, ``withhold_uncounted``) that exponent counted its own proposal, whatever the
    values: value-independent, so the renormalized mean stays unbiased. ``withhold_uncounted=False``
    replays the transport's rule before issue K: withhold only the chunks whose values exceed the agreed
    bound (a decision on the values, biased against the largest contributor). Returns the round and
    (N, C) bool: chunk c's RESULT reached worker w (the round closed with count > 0 and the ``down``
    link kept it). ``exact``: as the transport's exact mode, exponent packets are spared."""
    n_workers = chunks.shape[0]
    exps = exponent_round(chunks, fabric, exp_copies, spared=exact)
    ints, shifts, saturated = quantize_round(chunks, exps.agreed, rng)
    sent = exps.known & (exps.counted if withhold_uncounted else ~saturated)
    summed = sum_contributions(ints, shifts, sent & ~fabric.lost("up", sent))
    closed: np.ndarray = summed.count > 0
    delivered = ~fabric.lost("down", np.repeat(closed[None, :], n_workers, axis=0)) & closed[None, :]
    return summed, delivered


def fallback_codes(
    count: np.ndarray,
    delivered: np.ndarray,
    n_workers: int,
    *,
    renormalize: str = "count",
    fallback: str = "prev",
) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk, whether a worker's ``allreduce`` keeps the RESULT's sum and the Fallback code it
    reports, as :func:`worker_values` (and the transport) decide them from the round's ``count`` (C,)
    and whether the RESULT reached the worker (``delivered``: (C,) for one worker, (N, C) for N at
    once). Returns (got, codes), both shaped like ``delivered``."""
    if renormalize not in ("count", "none"):
        raise ValueError(f"renormalize must be 'count' or 'none' here, got {renormalize!r}")
    if fallback not in FALLBACK_POLICIES:
        raise ValueError(f"fallback must be one of {sorted(FALLBACK_POLICIES)}, got {fallback!r}")
    return result_rule(delivered & (count > 0), count, n_workers, renormalize, FALLBACK_POLICIES[fallback])


def worker_values(
    summed: ChunkRound,
    delivered: np.ndarray,
    n_workers: int,
    *,
    renormalize: str = "count",
    fallback: str = "prev",
    prev: np.ndarray | None = None,
    local: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """What ``LtaWorker.allreduce`` returns for each chunk (C × K float32) and the Fallback code per chunk,
    given whether the chunk's RESULT reached the worker (``delivered``, C bools: a row of
    :func:`simulate_round`'s answer, or any mix of workers, one per chunk).

    ``renormalize="count"``: a chunk with a RESULT and count > 0 is sum / count (unbiased for any
    value-independent loss), else the fallback. ``"none"``: sum / N; with ``fallback="zero"`` any
    chunk with count > 0 keeps sum / N (lost contributions count as zeros), otherwise only complete
    chunks (count == N) do; every chunk short of N is marked with the fallback either way.
    Fallback rows: ``prev`` (the worker's last result for the tensor; zeros when None), ``zero``, or
    ``local`` (its own values; required then)."""
    count = summed.count
    got, codes = fallback_codes(count, delivered, n_workers, renormalize=renormalize, fallback=fallback)
    policy = FALLBACK_POLICIES[fallback]
    divisor = renormalize_divisor(count, None, renormalize, n_workers)
    if policy == Fallback.LOCAL:
        if local is None:
            raise ValueError("fallback='local' needs the worker's own values (local=...)")
        values = local.astype(np.float32, copy=True)
    elif policy == Fallback.PREV and prev is not None:
        values = prev.astype(np.float32, copy=True)
    else:
        values = np.zeros(summed.sums.shape, dtype=np.float32)
    if got.any():
        values[got] = codec.dequantize(summed.sums[got], summed.shifts[got], divisor[got])
    return values, codes
