"""``lta train --simulate-workers N --jobs J``: a sweep's simulated runs in J processes at once.

Each run is independent (its own seed's weights, batches and drop streams: lta/train/simulated.py), so
J spawned processes, one torch thread each, run J of them at a time and return the same results as the
sequential sweep, bit for bit (a run does not depend on what else its process ran). Every finished run
is written at once to ``<out>/runs/<name>.json``; a later sweep with the same settings into the same
folder loads those instead of training them again, so a sweep cut short keeps what it finished and
more seeds can be added to a folder afterwards (the table then covers every seed asked for).
``<out>/runs/settings.json`` holds the settings the runs belong to; a sweep with other settings is
refused in one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from hostlib.errors import TrainingDiverged, UsageError
from hostlib.lifetime import spawn_context
from lta.train.experiment import RunSpec, TrainConfig, with_new_fields
from lta.train.sweep import RunResult

_cluster: Any = None  # the process's SimulatedCluster (built once: the corpus is read once)


def _start(n_workers: int, cfg: TrainConfig) -> None:
    import torch

    from lta.train.simulated import SimulatedCluster

    torch.set_num_threads(1)  # J processes share the cores: one thread each
    global _cluster
    _cluster = SimulatedCluster(n_workers, cfg)


def _run(spec: RunSpec, directions: tuple[str, ...]) -> dict[str, Any]:
    result: RunResult = _cluster.run(spec, directions)
    return result.to_json()


class RunStore:
    """``<out>/runs``: one JSON file per finished run and the settings they were trained with."""

    def __init__(self, out: Path, settings: dict[str, Any]) -> None:
        self.root = out / "runs"
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / "settings.json"
        if marker.exists():
            saved = with_new_fields(json.loads(marker.read_text()))
            if saved != settings:
                differs = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
                raise UsageError(
                    f"{self.root} holds runs trained with other settings ({', '.join(differs)}): name "
                    "another --out, or remove that folder"
                )
        else:
            marker.write_text(json.dumps(settings, indent=1, sort_keys=True))

    def _path(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def load(self, spec: RunSpec) -> RunResult | None:
        path = self._path(spec.name)
        if not path.exists():
            return None
        from lta.train.simulated import SimulatedRunResult

        result = SimulatedRunResult.from_json(json.loads(path.read_text()))
        return result if result.spec == spec else None

    def save(self, data: dict[str, Any]) -> None:
        path = self._path(data["spec"]["name"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)  # a sweep killed mid-write leaves no half file


def run_parallel(
    specs: list[RunSpec],
    n_workers: int,
    cfg: TrainConfig,
    directions: tuple[str, ...],
    jobs: int,
    store: RunStore,
    on_done: Callable[[RunResult, bool], None] | None = None,
) -> list[RunResult]:
    """Every spec's result, in ``specs``' order: loaded from ``store`` when it holds the run, else
    trained in one of ``jobs`` processes (and saved to ``store`` as soon as it ends). ``on_done(result,
    loaded)`` after each."""
    from lta.train.simulated import SimulatedRunResult

    results: dict[str, RunResult] = {}
    todo = []
    for spec in specs:
        found = store.load(spec)
        if found is None:
            todo.append(spec)
        else:
            results[spec.name] = found
            if on_done is not None:
                on_done(found, True)
    if todo:
        context = spawn_context()  # no forked torch state; dies with its parent
        with ProcessPoolExecutor(
            max_workers=jobs, mp_context=context, initializer=_start, initargs=(n_workers, cfg)
        ) as pool:
            for data in _as_finished(pool, todo, directions, store.root):
                store.save(data)
                result = SimulatedRunResult.from_json(data)
                results[result.spec.name] = result
                if on_done is not None:
                    on_done(result, False)
    return [results[spec.name] for spec in specs]


def _as_finished(
    pool: ProcessPoolExecutor, specs: list[RunSpec], directions: tuple[str, ...], kept: Path
) -> Iterator[dict[str, Any]]:
    """Each run's result as it ends. A run that diverges does not stop the others: once every run has
    ended, TrainingDiverged names the ones that did (the others are saved as they end)."""
    pending: set[Future[dict[str, Any]]] = {pool.submit(_run, spec, directions) for spec in specs}
    diverged: list[TrainingDiverged] = []
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            try:
                data = future.result()
            except TrainingDiverged as exc:
                diverged.append(exc)
                continue
            yield data
    if diverged:
        which = ", ".join(f"{d.run} at step {d.step}" for d in sorted(diverged, key=lambda d: d.run))
        rest = (
            f"the other runs finished and are kept in {kept}, but no table was written"
            if len(diverged) < len(specs)
            else "no table was written"
        )
        raise TrainingDiverged(
            f"{len(diverged)} of {len(specs)} runs trained diverged ({which}: a worker's loss or gradient "
            f"was not finite); {rest}: leave those runs out (--drops, --mechanism, --lr) and run the "
            "command again"
        )
