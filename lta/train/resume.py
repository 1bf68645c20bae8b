"""What ``lta train --checkpoint-dir DIR`` writes and what ``--resume DIR`` does with it.

DIR holds one folder per run of the sweep, named like the run (``lossless-s0``, ``renorm-p0.10-s0``...)::

    DIR/sweep.json                 the settings every run of the sweep shares (checked on resume)
    DIR/<run>/manifest.json        the run's last committed checkpoint (hostlib/torch_ext/checkpoint.py)
    DIR/<run>/rank<r>-step<k>.pt   one file per worker
    DIR/<run>/result.json          written when the run finished: what results.json reports about it

``--resume DIR`` is the same command again with ``--resume DIR`` in place of ``--checkpoint-dir DIR``.
Each run of the sweep is then, by its folder:

- finished (``result.json``): its saved result is reported, it is not trained again;
- interrupted (a committed checkpoint at step k): it is restored at step k and trains on to ``--steps``;
- not started: it trains from the beginning.

The settings in ``sweep.json`` (workers, directions, the model and training configuration except
``--steps``, DP) must match the command's, and each checkpoint's manifest must match the job (workers,
parameter count, K): otherwise the command stops with one line naming the difference. ``--steps`` may
change, but the learning-rate schedule follows it, so only the same ``--steps`` reproduces the run that
was interrupted; ``--stop-after`` interrupts a run on purpose (it saves a checkpoint there and ends the
sweep). The drop rates, methods and seeds may change: runs are matched by name.

A resumed run reports its whole curve (per worker, per step), its drift measurements, its optimizer's
chunk counters and stale-copy statistics from step 0; the transport's packet statistics and the
telemetry cover the part trained since the restore. With ``--dp-sigma`` the noise is fresh after a
restore (its secret is drawn per command), so a DP run resumes with the same statistics, not the same
bits.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostlib.errors import UsageError
from hostlib.torch_ext.checkpoint import CheckpointMismatch, check_manifest, read_manifest
from lta.train.experiment import CheckpointPlan, RunSpec, TrainConfig, config_dict, with_new_fields
from lta.train.sweep import RunResult

SWEEP_FILE = "sweep.json"
RESULT_FILE = "result.json"
FORMAT = "lta.train.checkpoints/1"


def sweep_settings(workers: int, directions: list[str], cfg: TrainConfig, dp: Any) -> dict[str, Any]:
    """What every run of a sweep shares and a resume must not change (``steps`` may change)."""
    train = {k: v for k, v in config_dict(cfg).items() if k != "steps"}
    dp_settings = None if dp is None else {"sigma": dp.sigma, "clip": dp.clip}
    return {"workers": workers, "directions": list(directions), "train": train, "dp": dp_settings}


def _differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """``key saved (this command: current)`` for every setting that differs; top-level ones first."""
    out, nested = [], []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            nested += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a} (this command: {b})")
    return out + nested


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


@dataclass(frozen=True)
class RunStart:
    """How one run of the sweep begins: finished already (``result``), or trained with ``plan``."""

    result: RunResult | None
    plan: CheckpointPlan | None


class SweepCheckpoints:
    """The checkpoint folder of one ``lta train`` sweep (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        settings: dict[str, Any],
        *,
        resume: bool,
        every: int | None,
        stop_after: int | None,
    ) -> None:
        self.root, self.settings = root, settings
        self.every, self.stop_after = every, stop_after
        sweep_file = root / SWEEP_FILE
        if resume:
            if not sweep_file.is_file():
                raise UsageError(
                    f"--resume {root}: no lta train checkpoints there (no {SWEEP_FILE}); "
                    "start a sweep with --checkpoint-dir DIR first"
                )
            try:
                saved = json.loads(sweep_file.read_text())["settings"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise UsageError(f"cannot read {sweep_file}: {exc}") from None
            differs = _differences(with_new_fields(saved), settings)
            if differs:
                raise CheckpointMismatch(
                    f"the checkpoints in {root} belong to another sweep: "
                    + "; ".join(differs[:4])
                    + ("; ..." if len(differs) > 4 else "")
                    + " (resume with the command that made them)"
                )
        else:
            if root.exists() and any(root.iterdir()):
                raise UsageError(
                    f"--checkpoint-dir {root} is not empty; continue what is there with --resume {root}, "
                    "or choose a new folder"
                )
            root.mkdir(parents=True, exist_ok=True)
            _write_json(sweep_file, {"format": FORMAT, "settings": settings})

    def start(self, spec: RunSpec, *, steps: int, world_size: int, numel: int, k: int) -> RunStart:
        """Whether ``spec`` is finished, to resume (checked against the job) or to start."""
        folder = self.root / spec.name
        result_file = folder / RESULT_FILE
        if result_file.is_file():
            try:
                return RunStart(RunResult.from_json(json.loads(result_file.read_text())), None)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise UsageError(
                    f"cannot read {result_file} ({exc}); remove it to train the run again"
                ) from None
        manifest = read_manifest(folder)
        resume_step = 0
        if manifest is not None:
            check_manifest(manifest, folder, world_size=world_size, numel=numel, elems_per_packet=k)
            if manifest.step >= steps:
                raise UsageError(
                    f"the checkpoint of {spec.name} is at step {manifest.step}, not before --steps {steps}"
                )
            resume_step = manifest.step
        plan = CheckpointPlan(str(folder), self.every, resume_step, self.stop_after)
        return RunStart(None, plan)

    def finished(self, result: RunResult) -> None:
        """Record a finished run, so that a resume reports it instead of training it again."""
        folder = self.root / result.spec.name
        folder.mkdir(parents=True, exist_ok=True)
        _write_json(folder / RESULT_FILE, result.to_json())
