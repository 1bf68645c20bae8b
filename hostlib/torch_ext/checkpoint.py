"""Checkpoints of a sharded job: one file per rank and a manifest, each written atomically.

A checkpoint directory holds::

    manifest.json            the committed checkpoint: step, world size, parameter count, K, file names
    rank0-step150.pt ...     one per rank (torch.save; read back with weights_only=True)

A rank file holds the worker's model (its replica, stale copies included), its
:meth:`ShardedOptimizer.state_dict` (optimizer state of its shard, stale-copy tables, drift monitor,
the transport's rounding generator and counters), the RNG states (torch, numpy's global generator,
Python's ``random`` and any named ``torch.Generator`` such as the batch sampler), the step, and what
the caller adds (``extra``: tensors and plain values).

Commit protocol, so that a crash at any moment leaves a usable checkpoint: every rank writes its file
for step S under a new name (temporary file, fsync, rename: :func:`save_shard`); once every rank's file
is in, one process (rank 0 after a barrier, or the launcher) writes the manifest naming them
(:func:`commit`, also temporary + rename) and only then removes the files of older steps. Until the
rename the previous manifest and its files are untouched.

:func:`load_shard` reads the manifest, checks it against the job (world size, parameter count, K) and
raises :class:`CheckpointMismatch` with a one-line message otherwise, then restores model, optimizer
and RNG states. Restored workers take the same next steps as the saved ones would have: bitwise at zero
loss with fixed seeds, the same statistics under loss (the switch's drop generator and packets in
flight are not part of a checkpoint).
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hostlib.errors import UsageError

if TYPE_CHECKING:
    from hostlib.torch_ext.sharded import ShardedOptimizer

FORMAT = "lta.checkpoint/1"
MANIFEST = "manifest.json"
_RANK_FILE = re.compile(r"rank(\d+)-step(\d+)\.pt")


class CheckpointMismatch(UsageError):
    """A checkpoint does not belong to this job (other world size, model or K), or is incomplete."""


@dataclass(frozen=True)
class ShardFile:
    """What :func:`save_shard` wrote; :func:`commit` takes one per rank (picklable, for launchers)."""

    name: str  # file name inside the checkpoint directory
    rank: int
    step: int
    world_size: int
    numel: int
    elems_per_packet: int


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    numel: int
    elems_per_packet: int
    files: tuple[str, ...]  # one per rank, rank order
    extra: dict[str, Any] = field(default_factory=dict)  # the committer's own JSON state


@dataclass(frozen=True)
class Restored:
    """What :func:`load_shard` hands back besides the objects it restored in place."""

    step: int
    extra: dict[str, Any]  # the rank's ``extra`` as saved
    manifest: Manifest


def _write_atomically(path: Path, write: Any) -> None:
    """``write(file)`` into a temporary file beside ``path``, fsync, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    try:  # the rename itself is durable once the directory is synced (not possible everywhere)
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rng_states(generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """torch's, numpy's global and Python's RNG states, and those of the named generators."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    keys = np.asarray(keys, dtype=np.uint32)
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.copy()),
            "pos": pos,
            "gauss": [has_gauss, cached],
        },
        "python": random.getstate(),
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
    }


def set_rng_states(states: dict[str, Any], generators: dict[str, torch.Generator] | None = None) -> None:
    """Restore :func:`rng_states`' output; every generator named here must be in the saved states."""
    torch.set_rng_state(states["torch"])
    numpy_state = states["numpy"]
    keys = np.asarray(numpy_state["keys"], dtype=np.uint32)
    np.random.set_state((numpy_state["kind"], keys, int(numpy_state["pos"]), *numpy_state["gauss"]))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    for name, g in (generators or {}).items():
        if name not in states["generators"]:
            raise CheckpointMismatch(f"the checkpoint holds no state for the generator {name!r}")
        g.set_state(states["generators"][name])


def save_shard(
    directory: str | os.PathLike[str],
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: ShardedOptimizer,
    generators: dict[str, torch.Generator] | None = None,
    extra: dict[str, Any] | None = None,
) -> ShardFile:
    """Write this worker's checkpoint for ``step`` (the number of steps done) into ``directory``,
    atomically, under a name no committed checkpoint uses. Not visible to :func:`load_shard` until
    :func:`commit` names it in the manifest."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    worker = optimizer.worker
    record = ShardFile(
        name=f"rank{worker.worker_id}-step{step}.pt",
        rank=worker.worker_id,
        step=step,
        world_size=worker.n_workers,
        numel=optimizer.flat.numel,
        elems_per_packet=optimizer.layout.elems_per_chunk,
    )
    payload = {
        "format": FORMAT,
        "header": asdict(record),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng_states(generators),
        "extra": extra or {},
    }
    _write_atomically(path / record.name, lambda f: torch.save(payload, f))
    return record


def commit(
    directory: str | os.PathLike[str], shards: list[ShardFile], *, extra: dict[str, Any] | None = None
) -> Manifest:
    """Make the checkpoint of ``shards`` (one per rank, all of one step) the directory's current one,
    then remove the rank files of older steps (newer ones may be on their way to the next commit).
    ``extra``: JSON-serializable state of the committer, handed back by :func:`read_manifest`."""
    path = Path(directory)
    if not shards:
        raise ValueError("nothing to commit: no rank files")
    first = shards[0]
    by_rank = {s.rank: s for s in shards}
    if sorted(by_rank) != list(range(first.world_size)) or len(shards) != first.world_size:
        raise ValueError(
            f"commit needs one file per rank 0..{first.world_size - 1}, got ranks {sorted(by_rank)}"
        )
    for s in shards:
        if (s.step, s.world_size, s.numel, s.elems_per_packet) != (
            first.step,
            first.world_size,
            first.numel,
            first.elems_per_packet,
        ):
            raise ValueError(f"rank files disagree: {s} vs {first}")
        if not (path / s.name).is_file():
            raise ValueError(f"rank {s.rank}'s file {path / s.name} is missing")
    manifest = Manifest(
        step=first.step,
        world_size=first.world_size,
        numel=first.numel,
        elems_per_packet=first.elems_per_packet,
        files=tuple(by_rank[r].name for r in range(first.world_size)),
        extra=extra or {},
    )
    text = json.dumps({"format": FORMAT, **asdict(manifest)}, indent=1).encode()
    _write_atomically(path / MANIFEST, lambda f: f.write(text))
    for old in path.iterdir():
        match = _RANK_FILE.fullmatch(old.name)
        if match and int(match.group(2)) < manifest.step:
            old.unlink(missing_ok=True)
    return manifest


def read_manifest(directory: str | os.PathLike[str]) -> Manifest | None:
    """The committed checkpoint of ``directory``; None when there is none (no manifest yet)."""
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointMismatch(f"cannot read the checkpoint manifest {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointMismatch(f"{path} is not an LTA checkpoint manifest (format {FORMAT})")
    try:
        return Manifest(
            step=int(data["step"]),
            world_size=int(data["world_size"]),
            numel=int(data["numel"]),
            elems_per_packet=int(data["elems_per_packet"]),
            files=tuple(data["files"]),
            extra=dict(data.get("extra") or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointMismatch(f"the checkpoint manifest {path} is malformed ({exc!r})") from None


def check_manifest(
    manifest: Manifest,
    directory: str | os.PathLike[str],
    *,
    world_size: int,
    numel: int,
    elems_per_packet: int,
) -> None:
    """CheckpointMismatch, one line naming every difference, unless the checkpoint fits this job."""
    want = {"workers": world_size, "parameters": numel, "K": elems_per_packet}
    have = {"workers": manifest.world_size, "parameters": manifest.numel, "K": manifest.elems_per_packet}
    differs = [f"{name} {have[name]} (this job: {want[name]})" for name in want if have[name] != want[name]]
    if differs:
        raise CheckpointMismatch(
            f"the checkpoint in {directory} (step {manifest.step}) was written by another job: "
            + ", ".join(differs)
            + "; restore it with the same workers, model and K, or use another checkpoint directory"
        )


def load_shard(
    directory: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: ShardedOptimizer,
    generators: dict[str, torch.Generator] | None = None,
) -> Restored:
    """Restore this worker (its rank is the optimizer's worker id) from the directory's committed
    checkpoint: model parameters, optimizer shard state, RNG states and the named generators.
    CheckpointMismatch when there is none, when it does not fit the job, or when a file is damaged."""
    path = Path(directory)
    manifest = read_manifest(path)
    if manifest is None:
        raise CheckpointMismatch(f"no checkpoint in {path} (no {MANIFEST})")
    worker = optimizer.worker
    check_manifest(
        manifest,
        path,
        world_size=worker.n_workers,
        numel=optimizer.flat.numel,
        elems_per_packet=optimizer.layout.elems_per_chunk,
    )
    rank_path = path / manifest.files[worker.worker_id]
    try:
        payload = torch.load(rank_path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointMismatch(
            f"the checkpoint in {path} is incomplete: {rank_path.name} is missing"
        ) from None
    except Exception as exc:  # a damaged file: torch raises several kinds  # noqa: BLE001
        raise CheckpointMismatch(f"cannot read {rank_path}: {' '.join(str(exc).split())[:200]}") from None
    header = payload.get("header", {}) if isinstance(payload, dict) else {}
    if (
        payload.get("format") != FORMAT
        or header.get("rank") != worker.worker_id
        or header.get("step") != manifest.step
    ):
        raise CheckpointMismatch(
            f"{rank_path} does not hold rank {worker.worker_id}'s state at step {manifest.step} "
            f"(its header: {header})"
        )
    model.load_state_dict(payload["model"])  # first: the optimizer refreshes its host copy from it
    optimizer.load_state_dict(payload["optimizer"])
    set_rng_states(payload["rng"], generators)
    return Restored(step=manifest.step, extra=payload["extra"], manifest=manifest)
