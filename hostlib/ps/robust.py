"""Byzantine-robust aggregation of the per-worker contributions that arrived for one chunk.

A summing switch can only add; a parameter server that keeps every worker's contribution can
instead apply a rule that survives ``f`` workers sending arbitrary vectors. Every rule here takes
``contribs`` of shape ``(n, d)`` (one row per worker whose contribution *arrived*: loss shrinks ``n``)
and returns a float64 vector of length ``d``. All work is vectorized over the ``d`` coordinates.

Rules and the largest ``f`` each tolerates with ``n`` arrived contributions (``tolerated_f``):

================ ==================================================== ====================
rule             what it returns                                      tolerated ``f``
================ ==================================================== ====================
``mean``         coordinate-wise mean                                 0
``trimmed_mean`` per coordinate, drop the ``t = floor(beta·n)``       ``floor(beta·n)``
                 largest and ``t`` smallest values, average the rest
``median``       coordinate-wise median (mean of the two middle       ``floor((n-1)/2)``
                 values when ``n`` is even)
``krum``         the row with the lowest Krum score                   ``floor((n-3)/2)``
``multi_krum``   the mean of the ``m`` rows with the lowest scores    ``floor((n-3)/2)``
                 (``m`` defaults to ``n - f``)
``bulyan``       ``theta = n-2f`` rows chosen by iterated Krum, then  ``floor((n-3)/4)``
                 per coordinate the mean of the ``theta-2f`` values
                 closest to their median
================ ==================================================== ====================

``beta`` is ``trim_ratio`` and trims ``floor(beta·n)`` values *on each side* (the seed protocol's
``trim_ratio`` counts both sides; here it is per side, so ``trim_ratio=0.1`` with 10 workers drops
the largest and the smallest value of each coordinate). ``floor(beta·n)`` is taken after adding
1e-9, so that decimal ratios behave as written (``0.29 · 100`` is 28.999999999999996 in binary).

The Krum score of row ``i`` is the sum of its squared distances to its ``n - f - 2`` nearest other
rows (Blanchard et al., 2017); it needs ``n >= 2f + 3`` so that the honest rows' neighbourhoods
hold a majority of honest rows. Bulyan (El Mhamdi et al., 2018) needs ``n >= 4f + 3``. The squared
distances come from one matrix product, ``|a-b|^2 = |a|^2 + |b|^2 - 2a·b``, in float64 (absolute
error about 2^-52·|a|^2: negligible for gradients, whose rows are not nearly equal far from 0).
Bulyan's iterated Krum scores, at each of its ``theta`` rounds, the ``r`` rows not yet selected with
``r - f - 2`` neighbours, but at least 1 while another row remains (its last rounds have few rows).

Ties are broken deterministically and independently of anything but the values and the row order:
Krum picks the lowest row index among equal scores; Multi-Krum keeps the lowest indices among equal
scores; Bulyan's selection does the same at every iteration, and in its final step a value below the
median wins a tie in distance against a value above it.

When fewer contributions arrived than a rule needs for the requested ``f``, ``aggregate`` raises
``InsufficientContributions`` (a ``ValueError``) naming the rule, ``f``, ``n`` and the minimum, so the
caller can fall back to a rule that fits (``tolerated_f`` says which ``f`` each one supports) or
refuse the step. Contributions must be finite: a row holding NaN or Inf is no gradient at all, and
it would poison distances and means; ``finite_rows`` lets a caller drop and count such rows first.
"""

from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger(__name__)

RULES: tuple[str, ...] = ("mean", "trimmed_mean", "median", "krum", "multi_krum", "bulyan")

# Slack for floor(beta·n): keeps decimal trim ratios exact (0.29 · 100 -> 29, not 28).
_RATIO_SLACK = 1e-9


class InsufficientContributions(ValueError):
    """Too few contributions arrived for ``rule`` to tolerate ``f`` Byzantine workers."""

    def __init__(self, rule: str, f: int, n: int, minimum: int) -> None:
        self.rule = rule
        self.f = f
        self.n = n
        self.minimum = minimum
        super().__init__(
            f"{rule} tolerating f={f} Byzantine workers needs at least {minimum} contributions, "
            f"{n} arrived; fall back to a rule whose tolerated_f covers {n} or refuse the step"
        )


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; choose one of {', '.join(RULES)}")


def _check_trim_ratio(trim_ratio: float) -> None:
    if not 0.0 <= trim_ratio < 0.5:
        raise ValueError(f"trim_ratio must be in [0, 0.5) (the share trimmed on each side), got {trim_ratio}")


def trim_count(n: int, trim_ratio: float) -> int:
    """How many values ``trimmed_mean`` drops on each side of a coordinate: ``floor(trim_ratio · n)``."""
    _check_trim_ratio(trim_ratio)
    return math.floor(trim_ratio * n + _RATIO_SLACK)


def min_count(rule: str, f: int, trim_ratio: float = 0.1) -> int:
    """The fewest arrived contributions with which ``rule`` tolerates ``f`` Byzantine ones.

    ``mean`` tolerates none and ``trimmed_mean`` with ``trim_ratio == 0`` tolerates none: asking them
    for ``f > 0`` is a configuration error (ValueError), not a shortage of contributions."""
    _check_rule(rule)
    if f < 0:
        raise ValueError(f"f must be >= 0, got {f}")
    if rule == "mean":
        if f > 0:
            raise ValueError(f"mean tolerates no Byzantine worker (f={f} asked); pick another rule")
        return 1
    if rule == "trimmed_mean":
        _check_trim_ratio(trim_ratio)
        if f == 0:
            return 1
        if trim_ratio == 0.0:
            raise ValueError(f"trimmed_mean with trim_ratio=0 tolerates no Byzantine worker (f={f} asked)")
        n = max(1, math.ceil(f / trim_ratio) - 1)  # within a step or two of the answer
        while trim_count(n, trim_ratio) < f:
            n += 1
        while n > 1 and trim_count(n - 1, trim_ratio) >= f:
            n -= 1
        return n
    if rule == "median":
        return 2 * f + 1
    if rule in ("krum", "multi_krum"):
        return 2 * f + 3
    return 4 * f + 3  # bulyan


def tolerated_f(rule: str, n: int, trim_ratio: float = 0.1) -> int:
    """The largest ``f`` that ``rule`` tolerates with ``n`` arrived contributions.

    ``-1`` when the rule cannot run on ``n`` contributions at all (``n < min_count(rule, 0)``: no
    contribution, or fewer than 3 for Krum and Bulyan)."""
    _check_rule(rule)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n < min_count(rule, 0, trim_ratio):
        return -1
    if rule == "mean":
        return 0
    if rule == "trimmed_mean":
        return trim_count(n, trim_ratio)
    if rule == "median":
        return (n - 1) // 2
    if rule in ("krum", "multi_krum"):
        return (n - 3) // 2
    return (n - 3) // 4  # bulyan


def finite_rows(contribs: np.ndarray) -> np.ndarray:
    """Boolean mask of the rows that hold only finite values (the ones ``aggregate`` accepts)."""
    return np.isfinite(contribs).all(axis=1)


def squared_distances(contribs: np.ndarray) -> np.ndarray:
    """``(n, n)`` matrix of squared Euclidean distances between rows, from one Gram matrix (float64).

    The diagonal is exactly 0 and rounding never makes an entry negative."""
    x = np.asarray(contribs, dtype=np.float64)
    gram = x @ x.T
    norms = np.diagonal(gram).copy()
    dist = norms[:, None] + norms[None, :] - 2.0 * gram
    np.maximum(dist, 0.0, out=dist)
    np.fill_diagonal(dist, 0.0)
    return dist


def krum_scores(dist: np.ndarray, f: int) -> np.ndarray:
    """Per row, the sum of squared distances to its ``len(dist) - f - 2`` nearest other rows.

    ``dist`` is a squared-distance matrix (``squared_distances``). The neighbour count is clamped to
    at least 1 while another row exists (Bulyan's last iterations run Krum on few remaining rows)."""
    n = len(dist)
    neighbours = min(max(n - f - 2, 1), n - 1)
    if neighbours <= 0:
        return np.zeros(n)
    others = dist + np.diag(np.full(n, np.inf))  # a row is not its own neighbour
    nearest = np.partition(others, neighbours - 1, axis=1)[:, :neighbours]
    return nearest.sum(axis=1)


def _krum_order(contribs: np.ndarray, f: int) -> np.ndarray:
    """Row indices by increasing Krum score; ties keep the lower index first."""
    return np.argsort(krum_scores(squared_distances(contribs), f), kind="stable")


def _mean(contribs: np.ndarray) -> np.ndarray:
    return contribs.mean(axis=0, dtype=np.float64)


def _trimmed_mean(contribs: np.ndarray, trim: int) -> np.ndarray:
    if trim == 0:
        return _mean(contribs)
    ordered = np.sort(contribs, axis=0)
    return ordered[trim : len(contribs) - trim].mean(axis=0, dtype=np.float64)


def _median(contribs: np.ndarray) -> np.ndarray:
    return np.median(contribs.astype(np.float64, copy=False), axis=0)


def _bulyan(contribs: np.ndarray, f: int) -> np.ndarray:
    n = len(contribs)
    theta = n - 2 * f
    remaining = np.arange(n)
    selected = np.empty(theta, dtype=np.intp)
    dist = squared_distances(contribs)
    for i in range(theta):  # iterated Krum over the rows not yet selected
        sub = dist[np.ix_(remaining, remaining)]
        best = int(np.argmin(krum_scores(sub, f)))  # argmin: lowest index among ties
        selected[i] = remaining[best]
        remaining = np.delete(remaining, best)
    keep = theta - 2 * f
    # Sorted first, so that a stable sort by distance to the median breaks ties towards the lower value.
    chosen = np.sort(contribs[selected].astype(np.float64, copy=False), axis=0)
    median = np.median(chosen, axis=0)
    closest = np.argsort(np.abs(chosen - median), axis=0, kind="stable")[:keep]
    return np.take_along_axis(chosen, closest, axis=0).mean(axis=0)


def aggregate(
    rule: str,
    contribs: np.ndarray,
    *,
    f: int | None = None,
    trim_ratio: float = 0.1,
    m: int | None = None,
) -> np.ndarray:
    """Aggregate the ``(n, d)`` arrived contributions with ``rule``; returns ``(d,)`` float64.

    ``f``: Byzantine workers to tolerate. ``None`` means the most the rule tolerates with the ``n``
    that arrived (``tolerated_f``), so Krum and Bulyan adapt to loss; an explicit ``f`` that ``n`` cannot
    support raises ``InsufficientContributions``. ``trimmed_mean`` always trims
    ``floor(trim_ratio · n)`` per side, and an explicit ``f`` is only checked against that.
    ``m``: Multi-Krum's number of averaged rows, ``1 <= m <= n - f`` (default ``n - f``).

    Guarantee, with at most ``f`` rows arbitrary and ``n >= min_count(rule, f)``: every output
    coordinate of ``trimmed_mean`` and ``median`` lies within the range of the honest rows' values in
    that coordinate, however large the others are; ``krum`` returns one arrived row, and ``krum``,
    ``multi_krum`` and ``bulyan`` stay within a distance of the honest mean bounded by the honest
    rows' spread (the papers' theorems), not by the Byzantine rows' magnitude."""
    _check_rule(rule)
    _check_trim_ratio(trim_ratio)
    contribs = np.asarray(contribs)
    if contribs.ndim != 2:
        raise ValueError(f"contribs must be 2-D (workers, values), got shape {contribs.shape}")
    if not np.issubdtype(contribs.dtype, np.floating):
        raise ValueError(f"contribs must be float32 or float64, got {contribs.dtype}")
    n = len(contribs)
    bad = ~finite_rows(contribs)
    if bad.any():
        raise ValueError(
            f"contributions of rows {np.flatnonzero(bad).tolist()} hold NaN or Inf; drop them "
            "(robust.finite_rows) before aggregating"
        )
    if f is None:
        f_used = max(tolerated_f(rule, n, trim_ratio), 0)
    else:
        if f < 0:
            raise ValueError(f"f must be >= 0, got {f}")
        f_used = f
    minimum = min_count(rule, f_used, trim_ratio)
    if n < minimum:
        raise InsufficientContributions(rule, f_used, n, minimum)
    log.debug("aggregate %s over n=%d (f=%d, d=%d)", rule, n, f_used, contribs.shape[1])

    if rule == "mean":
        return _mean(contribs)
    if rule == "trimmed_mean":
        return _trimmed_mean(contribs, trim_count(n, trim_ratio))
    if rule == "median":
        return _median(contribs)
    if rule == "krum":
        return contribs[_krum_order(contribs, f_used)[0]].astype(np.float64)
    if rule == "multi_krum":
        count = n - f_used if m is None else m
        if not 1 <= count <= n - f_used:
            raise ValueError(f"multi_krum needs 1 <= m <= n - f = {n - f_used}, got m={m}")
        best = _krum_order(contribs, f_used)[:count]
        return _mean(contribs[np.sort(best)])
    return _bulyan(contribs, f_used)
