"""Parameter-server jobs: their settings, and the jobs file ``lta ps --config FILE`` reads.

The file's schema, with every key, is in docs/jobs_file.md ("Parameter-server jobs"): the switch's jobs
file layout (``seed``, ``[[jobs]]``, ``[[jobs.drop]]``) with the parameter server's job keys
(``JOB_KEYS``, one ``lta ps`` flag each). It is checked with the jobs file's reader
(:class:`hostlib.jobconfig.TableReader`): an unknown key or a value of the wrong type or out of range is
a :class:`~hostlib.errors.ConfigError` naming the file, the table and the key, in the same words and
with the same "did you mean" as for the switch's file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.errors import ConfigError, UsageError
from hostlib.job import check_job_id, check_worker_count
from hostlib.jobconfig import TableReader, parse_toml, read_text
from hostlib.liveness import DEFAULT_TIMEOUT_S as DEFAULT_LIVENESS_TIMEOUT_S
from hostlib.protocol import MAX_ELEMS_PER_PACKET, MAX_JOBS, parse_address
from hostlib.ps import robust
from hostlib.ps.wire import check_k, codec_of
from softswitch.ps.staleness import StalenessConfig

MODES = ("sync", "async")
FALLBACKS = ("median", "mean", "refuse")
PS_DIRECTIONS = ("up", "down")

_TOP_KEYS = ("seed", "jobs")
JOB_KEYS = (  # a job table's keys; `lta ps` has one flag for each (drop: --drop-up/--drop-down)
    "job_id",
    "workers",
    "mode",
    "elems_per_packet",
    "n_params",
    "lr",
    "momentum",
    "compression",
    "window_size",
    "max_wait_s",
    "liveness_timeout_s",
    "rule",
    "f",
    "trim_ratio",
    "multi_krum_m",
    "fallback",
    "max_staleness",
    "adaptive_staleness",
    "min_staleness",
    "max_staleness_multiplier",
    "ewma_alpha",
    "drop",
)
# Keys of the switch's jobs file (hostlib/jobconfig.py) that a parameter server has no use for.
_SWITCH_ONLY_KEYS = {"": ("switches",), "jobs": ("quorum", "pool_size", "slot_base", "switch")}


@dataclass(frozen=True)
class PsDrop:
    """Emulated loss of one direction (``up``: PUSH, by sender; ``down``: PARAM, by receiver)."""

    direction: str
    policy: DropPolicy
    worker: int | None = None


@dataclass(frozen=True)
class PsJobConfig:
    """One parameter-server job. ``workers`` None: addresses are learned from each worker's first packet
    (and a later packet claiming that worker from elsewhere is dropped)."""

    job_id: int
    n_workers: int
    workers: tuple[tuple[str, int], ...] | None = None
    mode: str = "sync"
    elems_per_packet: int = 64
    n_params: int | None = None
    lr: float = 0.01
    momentum: float = 0.0
    compression: str = "none"
    window_size: int | None = None
    max_wait_s: float = 1.0
    liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S
    rule: str = "mean"
    f: int | None = None
    trim_ratio: float = 0.1
    multi_krum_m: int | None = None
    fallback: str = "median"
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    drops: tuple[PsDrop, ...] = ()

    def __post_init__(self) -> None:
        try:
            self._check()
        except ValueError as exc:
            if isinstance(exc, UsageError):
                raise
            raise UsageError(f"parameter-server job {self.job_id}: {exc}") from None

    def _check(self) -> None:
        check_job_id(self.job_id)  # the rules every job is checked by (hostlib.job)
        check_worker_count(self.job_id, self.n_workers)
        if self.workers is not None and len(self.workers) != self.n_workers:
            raise ValueError(f"{len(self.workers)} worker addresses for {self.n_workers} workers")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 1 <= self.elems_per_packet <= MAX_ELEMS_PER_PACKET:
            raise ValueError(
                f"elems_per_packet must be in 1..{MAX_ELEMS_PER_PACKET}, got {self.elems_per_packet}"
            )
        check_k(codec_of(self.compression), self.elems_per_packet)
        if self.n_params is not None and self.n_params < 1:
            raise ValueError(f"n_params must be >= 1, got {self.n_params}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.window_size is not None and not 1 <= self.window_size <= self.n_workers:
            raise ValueError(f"window_size must be in 1..{self.n_workers}, got {self.window_size}")
        if not (math.isfinite(self.max_wait_s) and self.max_wait_s > 0):
            raise ValueError(f"max_wait_s must be a positive number of seconds, got {self.max_wait_s}")
        if not (math.isfinite(self.liveness_timeout_s) and self.liveness_timeout_s >= 0):
            raise ValueError(
                f"liveness_timeout_s must be a number of seconds >= 0 (0: never presume a worker gone), "
                f"got {self.liveness_timeout_s}"
            )
        if self.rule not in robust.RULES:
            raise ValueError(f"rule must be one of {', '.join(robust.RULES)}, got {self.rule!r}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        if not 0.0 <= self.trim_ratio < 0.5:
            raise ValueError(
                f"trim_ratio must be in [0, 0.5) (the share trimmed on each side), got {self.trim_ratio}"
            )
        if self.f is not None:
            robust.min_count(self.rule, self.f, self.trim_ratio)  # mean with f > 0 etc.: a config error
        if self.multi_krum_m is not None and self.multi_krum_m < 1:
            raise ValueError(f"multi_krum_m must be >= 1, got {self.multi_krum_m}")
        for drop in self.drops:
            if drop.direction not in PS_DIRECTIONS:
                raise ValueError(
                    f"drop direction must be one of {', '.join(PS_DIRECTIONS)}, got {drop.direction!r}"
                )
            if drop.worker is not None and not 0 <= drop.worker < self.n_workers:
                raise ValueError(f"drop worker must be in 0..{self.n_workers - 1}, got {drop.worker}")

    @property
    def window(self) -> int:
        """Finished pushes that close a synchronous step."""
        return self.n_workers if self.window_size is None else self.window_size


def load_ps_config(path: str | Path) -> tuple[int, list[PsJobConfig]]:
    """``(seed, jobs)`` of a parameter-server jobs file; every problem is a ConfigError naming the file."""
    source = str(path)
    return parse_ps_config(parse_toml(read_text(path, "parameter-server jobs file"), source), source)


def parse_ps_config(doc: dict[str, Any], source: str = "<ps jobs file>") -> tuple[int, list[PsJobConfig]]:
    """Check a parsed parameter-server jobs file with the jobs file's reader (same messages, same
    "did you mean") and return its seed and jobs."""
    reader = TableReader(source)
    top = "the top level"
    _only_keys(reader, top, doc, _TOP_KEYS, "")
    seed = reader.integer(top, doc, "seed", 0, 2**63 - 1) or 0
    jobs: list[PsJobConfig] = []
    for i, table in enumerate(reader.tables(top, doc, "jobs", "")):
        where = f"jobs[{i}]"
        _only_keys(reader, where, table, JOB_KEYS, "jobs")
        try:
            job = _job(reader, table, where)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise reader.fail(where, str(exc)) from None
        if any(j.job_id == job.job_id for j in jobs):
            raise reader.fail(where, f"job_id {job.job_id} appears twice")
        jobs.append(job)
    return seed, jobs


def _only_keys(
    reader: TableReader, where: str, table: dict[str, Any], allowed: tuple[str, ...], path: str
) -> None:
    """The jobs file's key check, and a word for a key of the switch's jobs file given here."""
    for key in table:
        if key in _SWITCH_ONLY_KEYS.get(path, ()):
            raise reader.fail(
                where,
                f"{key!r} belongs to the switch's jobs file (lta softswitch, lta ctl apply), not to a "
                f"parameter server's (docs/jobs_file.md, 'Parameter-server jobs')",
            )
    reader.only_keys(where, table, allowed, path)


def _job(reader: TableReader, table: dict[str, Any], where: str) -> PsJobConfig:
    job_id = reader.integer(where, table, "job_id", 1, MAX_JOBS - 1)
    if job_id is None:
        raise reader.fail(where, "job_id = N is missing")
    raw_workers = table.get("workers")
    addresses: tuple[tuple[str, int], ...] | None = None
    if isinstance(raw_workers, int) and not isinstance(raw_workers, bool):
        n_workers = raw_workers
    elif isinstance(raw_workers, list) and raw_workers and all(isinstance(a, str) for a in raw_workers):
        addresses = tuple(parse_address(a) for a in raw_workers)
        if len(set(addresses)) != len(addresses):
            raise reader.fail(where, "two workers have the same address")
        n_workers = len(addresses)
    else:
        raise reader.fail(
            where, 'workers must be a count (workers = 4) or addresses (workers = ["IP:PORT", ...])'
        )
    kw: dict[str, Any] = {}
    for key in ("mode", "compression", "rule", "fallback"):
        kw[key] = reader.string(where, table, key)
    for key in ("elems_per_packet", "n_params", "window_size", "f", "multi_krum_m"):
        kw[key] = reader.integer(where, table, key, 0)
    for key in ("lr", "momentum", "max_wait_s", "liveness_timeout_s", "trim_ratio"):
        kw[key] = reader.number(where, table, key)
    stale = {
        "max_staleness": reader.integer(where, table, "max_staleness", 0),
        "adaptive": reader.boolean(where, table, "adaptive_staleness"),
        "min_staleness": reader.integer(where, table, "min_staleness", 0),
        "max_staleness_multiplier": reader.number(where, table, "max_staleness_multiplier"),
        "ewma_alpha": reader.number(where, table, "ewma_alpha"),
    }
    drops = []
    for d, spec in enumerate(reader.tables(where, table, "drop", "jobs")):
        dwhere = f"{where}.drop[{d}]"
        entry = reader.drop(dwhere, spec, n_workers)  # the jobs file's drop table, checked alike
        if entry.direction not in PS_DIRECTIONS:
            raise reader.fail(
                dwhere,
                f"direction must be one of {', '.join(PS_DIRECTIONS)} for a parameter server "
                f"(up = PUSH, down = PARAM), got {entry.direction!r}",
            )
        if entry.policy is not None:  # model = "none": no loss
            drops.append(PsDrop(entry.direction, entry.policy, entry.worker))
    return PsJobConfig(
        job_id=job_id,
        n_workers=n_workers,
        workers=addresses,
        staleness=StalenessConfig(**{k: v for k, v in stale.items() if v is not None}),
        drops=tuple(drops),
        **{k: v for k, v in kw.items() if v is not None},
    )
