"""Self-checking reduces: seeded inputs every worker can rebuild, and the check of a result against them.

Each worker's input is a function of ``(seed, round, worker)``, so any worker can rebuild all inputs
and check its own result: a chunk that came back with count > 0 must equal the mean of the
contributors named in its bitmap, within the codec's bound ``2^-s`` (docs/protocol.md) plus half an ulp
of the float32 result. ``s`` is worked out from the inputs (:func:`input_bound`), never read from the
result: a transport that quantized with a coarser shift than the inputs call for fails the check.
With speculated exponents (``TransportConfig.speculate_bits``) a first round's result may be up to
``2^speculate_guard_bits`` coarser (docs/protocol.md, "Speculated exponents"): :func:`slack_bits` of the
worker's config widens the bound by that, and no more. Used by ``lta demo``, the Mininet demo and the
lossy benchmark.
"""

from __future__ import annotations

import numpy as np

from hostlib import codec
from hostlib.transport import ReduceResult, TransportConfig


def seeded_input(seed: int, round_: int, worker: int, elems: int) -> np.ndarray:
    return np.random.default_rng([seed, round_, worker]).standard_normal(elems).astype(np.float32)


def slack_bits(config: TransportConfig) -> int:
    """The bits a result of a worker with ``config`` may be coarser than the exponent round's bound."""
    return config.speculate_guard_bits if config.speculate_bits else 0


def input_bound(inputs: np.ndarray, elems_per_packet: int, slack: int = 0) -> np.ndarray:
    """Per chunk, the codec's error bound for ``inputs`` ((workers, values), all N of the job): the agreed
    exponent is at most the proposal of the max |x| over every worker, so the data shift is at least
    :func:`codec.data_shifts` of it, and a mean over any contributors is off by less than its
    ``2^-shift``; ``slack``: that times ``2^slack`` (:func:`slack_bits`)."""
    n_workers, n = inputs.shape
    k = elems_per_packet
    chunks = -(-n // k)
    maxabs = np.zeros(chunks * k, dtype=np.float32)
    maxabs[:n] = np.abs(inputs).max(axis=0)
    shifts = codec.data_shifts(codec.exponent_proposals(maxabs.reshape(chunks, k)), n_workers)
    return codec.error_bound(shifts) * 2.0**slack


def check_result(
    result: ReduceResult,
    inputs: np.ndarray,
    elems_per_packet: int,
    mean_all: np.ndarray | None = None,
    bound: np.ndarray | None = None,
    slack: int = 0,
) -> tuple[int, float]:
    """(chunks checked, worst |error| / tolerance) over the chunks renormalized from a RESULT.
    ``inputs`` is (workers, values). A worst ratio below 1 passes.

    The chunks every worker contributed to (the usual case) are compared in one vectorized pass against
    the mean over all workers: ``mean_all`` (float64, ``inputs.astype(np.float64).mean(axis=0)``) and
    ``bound`` (:func:`input_bound`) are computed here when absent. The others go chunk by chunk
    (:func:`check_chunks`, the reference). Inputs checked many times: :class:`InputCheck`. ``slack``: the
    bound's widening in bits (:func:`slack_bits`)."""
    return InputCheck(inputs, elems_per_packet, mean_all=mean_all, bound=bound, slack=slack)(result)


class InputCheck:
    """:func:`check_result` for one set of inputs checked again and again (a benchmark's rounds): what
    depends only on the inputs (the mean over every worker, the codec's bound, each value's tolerance) is
    worked out once, so a check is four passes over the values. On a 2-core host the check runs beside
    the transport it checks (a 1 MiB check took ~3 ms worked out afresh each time, ~41% of a worker's
    CPU in ``lta bench lossy`` at 1 Gbit/s)."""

    def __init__(
        self,
        inputs: np.ndarray,
        elems_per_packet: int,
        mean_all: np.ndarray | None = None,
        bound: np.ndarray | None = None,
        slack: int = 0,
    ) -> None:
        self.inputs = inputs
        self.k = elems_per_packet
        n_workers, n = inputs.shape
        self.bound = input_bound(inputs, self.k, slack) if bound is None else bound
        self.mean = inputs.astype(np.float64).mean(axis=0) if mean_all is None else mean_all
        self._all = np.uint64((1 << n_workers) - 1)
        self._starts = np.arange(0, n, self.k)
        self._inverse: np.ndarray | None = None  # 1 / tolerance per value, at the first full chunk
        self._scratch = np.empty(n, dtype=np.float64)

    def __call__(self, result: ReduceResult) -> tuple[int, float]:
        n_workers = self.inputs.shape[0]
        full = (result.count == n_workers) & (result.bitmap == self._all)
        checked, worst = 0, 0.0
        if full.any():  # every value at once (no gathers), then the worst of each full chunk
            if self._inverse is None:
                n = self.inputs.shape[1]
                tolerance = (
                    np.repeat(self.bound, self.k)[:n] + np.spacing(np.abs(self.mean).astype(np.float32)) / 2
                )
                self._inverse = 1.0 / tolerance
            ratio = self._scratch
            ratio[...] = result.values  # to float64 first: a mixed-type subtract is slower
            ratio -= self.mean
            np.abs(ratio, out=ratio)
            ratio *= self._inverse
            worst = float(np.maximum.reduceat(ratio, self._starts)[full].max())
            checked = int(np.count_nonzero(full))
        partial = np.flatnonzero((result.count > 0) & ~full)
        rest, rest_worst = check_chunks(result, self.inputs, self.k, partial, self.bound)
        return checked + rest, max(worst, rest_worst)


def check_chunks(
    result: ReduceResult,
    inputs: np.ndarray,
    elems_per_packet: int,
    chunks: np.ndarray,
    bound: np.ndarray | None = None,
) -> tuple[int, float]:
    """:func:`check_result` for the given ``chunks``, one at a time against the mean of the contributors
    named in each chunk's bitmap."""
    if bound is None:
        bound = input_bound(inputs, elems_per_packet)
    checked, worst = 0, 0.0
    for c in chunks.tolist():
        contributors = result.contributors(int(c))
        lo, hi = c * elems_per_packet, min((c + 1) * elems_per_packet, inputs.shape[1])
        expected = inputs[contributors, lo:hi].astype(np.float64).mean(axis=0)
        error = np.abs(result.values[lo:hi] - expected)
        tolerance = bound[c] + np.spacing(np.abs(expected).astype(np.float32)) / 2
        worst = max(worst, float((error / tolerance).max()))
        checked += 1
    return checked, worst
