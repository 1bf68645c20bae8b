"""Lost-contribution feedback: what a reduce did not count is sent again with the next gradient.

Renormalization makes a reduce unbiased when contributions are lost, but a lost contribution is gone:
the mean is taken over the workers that arrived and the lost worker's gradient for that chunk never
reaches the optimizer. With feedback a worker reads, per chunk, whether the reduce counted it (its bit
in the RESULT's bitmap, and the host used that RESULT rather than a fallback) and keeps what was not
counted as a residual; before its next reduce it adds the residual to its gradient for those chunks and
clears it. Nothing extra goes on the wire: the residual rides in the next step's packets.

Conservation: over any run, the contributions a worker sent that were counted plus the residual it
still holds equal the sum of its gradients (up to float32 rounding of the additions, and the codec's
rounding of what was summed). Under ``renormalize='count'`` a lost contribution is then *delayed, not
dropped*: it is missing from the mean at step t (divided by that step's count) and enters the mean at
t+1 (divided by that step's count) with the next gradient, once it is counted.

Scale: renormalization alone is already unbiased (the survivors' mean stands for the lost
contributions), so adding them back makes the expected aggregate ``g / (1 − p)`` under i.i.d. loss p
(1.43 g at 30%; measured with this class on constant gradients): a larger step that AdamW mostly
absorbs (it divides by √v) and SGD does not. With ``renormalize='none'`` and zero fill (the ``zero``
method, sum / N) every contribution enters the sum once with weight 1/N, so the expected aggregate is
``g`` and the feedback is exact error feedback: ``lta train --mechanism feedback`` runs it so
(lta/train/experiment.py ``aggregation``).

What "counted" means here (:func:`counted_by_result`, :func:`counted_mask`): the worker's bit is set
(its GRAD reached the switch) *and* the worker's own allreduce used the RESULT's sum (fallback code
NONE, or ZERO where ``renormalize='none'`` keeps sum / N of a partial round). A RESULT that never
reached this worker counts as not counted: the worker cannot tell whether the chunk's owner got it, so
the contribution is carried (a possible double count, only where a RESULT is lost on the way down
while the owner's copy arrives). The ``prev`` baseline (sum / N only when all N arrived) throws a
partial round's sum away, so every contributor of such a round carries its contribution.

numpy only: the sharded optimizer (hostlib/torch_ext/sharded.py) keeps one worker's residual, the
simulated workers of ``lta train`` (lta/train/simulated.py) keep N of them, through the same class.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hostlib.transport.config import Fallback


def aggregate_used(fallback: np.ndarray) -> np.ndarray:
    """Per chunk (any shape of Fallback codes): the worker's value holds the RESULT's sum, i.e. the
    contributions in its bitmap reached the aggregate (NONE; ZERO is the zero-fill of a partial round
    under ``renormalize='none'``, which keeps sum / N; where no sum arrived the bitmap is empty)."""
    codes = np.asarray(fallback)
    return (codes == Fallback.NONE) | (codes == Fallback.ZERO)


def counted_by_result(bitmap: np.ndarray, fallback: np.ndarray, worker_id: int) -> np.ndarray:
    """(C,) bool: the reduce counted ``worker_id``'s contribution to chunk c, from its own
    ``ReduceResult`` (``bitmap`` is 0 where no RESULT came, so those chunks are not counted)."""
    bits = (np.asarray(bitmap, dtype=np.uint64) >> np.uint64(worker_id)) & np.uint64(1)
    return bits.astype(bool) & aggregate_used(fallback)


def counted_mask(contributed: np.ndarray, delivered: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """(N, C) bool, the same rule for N workers at once (the simulator): worker w's data was summed
    (``contributed``), the RESULT reached w (``delivered``) and w's allreduce used it (``fallback``:
    the Fallback code of w's view of each chunk)."""
    return np.asarray(contributed, dtype=bool) & np.asarray(delivered, dtype=bool) & aggregate_used(fallback)


class ResidualFeedback:
    """The residuals of ``n_workers`` workers (1 for a real worker), one row of K values per chunk.

    Each step: :meth:`add_to` the gradient rows about to be reduced, reduce them, then :meth:`settle`
    with what was sent and which chunks were counted. Vectorized over workers and chunks."""

    def __init__(self, n_chunks: int, elems_per_chunk: int, n_workers: int = 1) -> None:
        shape = (n_workers, n_chunks, elems_per_chunk)
        self.residual = np.zeros(shape, dtype=np.float32)
        self.carried = np.zeros(shape[:2], dtype=bool)  # chunks holding a residual now
        self.chunks_carried = np.zeros(n_workers, dtype=np.int64)  # residual chunks carried, over steps
        self.values_l1 = np.zeros(n_workers, dtype=np.float64)  # Σ|residual| carried, over steps

    def add_to(self, rows: np.ndarray) -> None:
        """``rows`` (N × C × K, or C × K for one worker; float32, in place) += the residuals. The
        residual is exactly 0 where nothing is carried, so those values are unchanged."""
        rows += self.residual.reshape(rows.shape)

    def settle(self, sent: np.ndarray, counted: np.ndarray) -> None:
        """After a reduce of ``sent`` (the rows :meth:`add_to` produced, same shape): keep the rows of
        the chunks not ``counted`` (N × C, or C) as the residual, clear the rest."""
        shape = self.residual.shape
        sent_rows = np.asarray(sent, dtype=np.float32).reshape(shape)
        lost = ~np.asarray(counted, dtype=bool).reshape(shape[:2])
        self.residual.fill(0.0)
        np.copyto(self.residual, sent_rows, where=lost[:, :, None])
        self.carried = lost
        self.chunks_carried += lost.sum(axis=1)
        self.values_l1 += np.abs(self.residual, dtype=np.float64).sum(axis=(1, 2))

    def clear(self) -> None:
        """Forget every residual (a worker that rejoins: its lost contributions left with it)."""
        self.residual.fill(0.0)
        self.carried[:] = False

    def state_dict(self) -> dict[str, Any]:
        """Copies of the residuals and counters (numpy arrays)."""
        return {
            "residual": self.residual.copy(),
            "carried": self.carried.copy(),
            "chunks_carried": self.chunks_carried.copy(),
            "values_l1": self.values_l1.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (arrays, or anything ``np.asarray`` reads: tensors);
        raises ValueError, before changing anything, if its shapes are not this object's."""
        arrays = {
            name: np.asarray(state[name]) for name in ("residual", "carried", "chunks_carried", "values_l1")
        }
        if arrays["residual"].shape != self.residual.shape:
            raise ValueError(
                f"feedback residual has shape {arrays['residual'].shape}, this one {self.residual.shape}"
            )
        self.residual[...] = arrays["residual"]
        self.carried[...] = arrays["carried"]
        self.chunks_carried[...] = arrays["chunks_carried"]
        self.values_l1[...] = arrays["values_l1"]


def feedback_stats(feedback: ResidualFeedback | None, worker: int = 0) -> dict[str, Any]:
    """One worker's feedback counters, as the sharded optimizer's ``drift_stats`` and the simulated
    workers report them (zeros without feedback): ``feedback_chunks``, chunks of its gradient whose
    contribution was carried to the next step, summed over steps (of all C chunks it sends, not only
    its shard); ``feedback_values_l1``, their summed absolute values; ``feedback_chunks_now``, the
    chunks it carries now. Feedback sends no extra packets."""
    if feedback is None:
        return {"feedback": False, "feedback_chunks": 0, "feedback_values_l1": 0.0, "feedback_chunks_now": 0}
    return {
        "feedback": True,
        "feedback_chunks": int(feedback.chunks_carried[worker]),
        "feedback_values_l1": float(feedback.values_l1[worker]),
        "feedback_chunks_now": int(feedback.carried[worker].sum()),
    }
