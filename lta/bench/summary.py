"""What every benchmark reports about its times, written once: percentiles of a run's times, the
slowest rank per iteration, a collective's time from its last rank's entry, ratios between systems,
and the JSON-or-table ending of a run.

Percentiles are numpy's default (linear interpolation between the two nearest samples), taken of the
times in ms. A statistic is named as it appears in the JSON: ``mean``, ``max`` or ``pQ`` for the Q-th
percentile with ``.`` written ``_`` (``p50``, ``p99``, ``p99_9``); the key is ``{prefix}{stat}_ms``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from lta.jsonout import emit

_PERCENTILE = re.compile(r"p(\d+)(?:_(\d+))?")


def _percentile_of(stat: str) -> float:
    match = _PERCENTILE.fullmatch(stat)
    if match is None:
        raise ValueError(f"unknown statistic {stat!r}: mean, max or pQ (p50, p99, p99_9)")
    return float(f"{match[1]}.{match[2] or 0}")


def time_stats(
    times_s: Sequence[float] | np.ndarray, stats: Iterable[str] = ("p50", "p99", "mean"), prefix: str = ""
) -> dict[str, float]:
    """``{prefix}{stat}_ms`` for each of ``stats`` in the order given, of ``times_s`` (seconds) in ms."""
    t = np.asarray(times_s, dtype=np.float64) * 1e3
    out = {}
    for stat in stats:
        if stat == "mean":
            value = t.mean()
        elif stat == "max":
            value = t.max()
        else:
            value = np.percentile(t, _percentile_of(stat))
        out[f"{prefix}{stat}_ms"] = float(value)
    return out


def slowest_rank(per_rank_times: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    """An iteration is over when its slowest rank is done: the per-iteration max over ranks (rows)."""
    return np.max(np.asarray(per_rank_times, dtype=np.float64), axis=0)


def collective_times(
    per_rank_starts: Sequence[Sequence[float]] | np.ndarray,
    per_rank_times: Sequence[Sequence[float]] | np.ndarray,
) -> np.ndarray:
    """Each iteration's time from the last rank's entry to the last rank's exit (ranks are rows; starts
    on one clock, ``time.monotonic``, which every process of a host shares). No collective can end
    before its last rank enters, so this is the collective's own time: what :func:`slowest_rank` adds
    to it is the skew between the ranks' entries, which work a rank does between iterations (a check
    of each result, say) puts there."""
    starts = np.asarray(per_rank_starts, dtype=np.float64)
    ends = starts + np.asarray(per_rank_times, dtype=np.float64)
    return ends.max(axis=0) - starts.max(axis=0)


def pool_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One system's runs over R rounds (``--rounds``), as one: the step-time stats of every round's
    ``steps_s`` pooled, ``cpu_ms_per_step`` (a number, or one per rank) averaged over the rounds, and the
    rest (losses, parameters, what the system saw) the first round's."""
    first = {key: value for key, value in runs[0].items() if key != "steps_s" and not key.endswith("_ms")}
    cpu = np.mean([run["cpu_ms_per_step"] for run in runs], axis=0).tolist()
    return {**first, **time_stats(np.concatenate([run["steps_s"] for run in runs])), "cpu_ms_per_step": cpu}


def median_known(values: Iterable[float | None]) -> float | None:
    """The median of the ratios that were measured (None where a round measured nothing); None if none."""
    known = [v for v in values if v is not None]
    return float(np.median(known)) if known else None


def ratio(a: float, b: float) -> float | None:
    """``a / b``; None where ``b`` is not positive (a system that measured nothing)."""
    return a / b if b > 0 else None


def report(as_json: bool, schema: str, out: Mapping[str, Any], table: Callable[[], Iterable[str]]) -> int:
    """The end of every benchmark run: with ``--json`` the one JSON document (:func:`lta.jsonout.emit`),
    else the lines of ``table()`` on stdout. Returns the exit status, 0."""
    if as_json:
        emit(schema, out)
    else:
        print("\n".join(table()))
    return 0


def mean_std_cells(stats: Mapping[str, Any]) -> tuple[str, str]:
    """A seed summary's mean and std as table cells (``nan`` and blank where a run gave none)."""
    mean = "nan" if stats["mean"] is None else f"{stats['mean']:.4f}"
    std = "" if stats["std"] is None else f"{stats['std']:.4f}"
    return mean, std
