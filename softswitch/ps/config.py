"""Parameter-server jobs: their settings, and the TOML file ``lta ps --config FILE`` reads::

    seed = 0                          # optional: seeds the emulated-loss decisions (a run replays)

    [[jobs]]
    job_id = 1
    workers = 4                       # a count (each worker's address is learned from its first
                                      # packet) or addresses: ["127.0.0.1:41001", ...]
    mode = "sync"                     # sync | async
    elems_per_packet = 64             # K: lanes per packet; workers must use the same
    n_params = 2848                   # optional: refuse an INIT of another size
    lr = 0.05                         # used when a push carries no learning rate
    momentum = 0.9                    # SGD with momentum: v = momentum·v + g; p -= lr·v
    compression = "none"              # none | fp16 | int8 (alias quantize) | topk: how pushes are encoded
    # sync: a step is applied once window_size workers finished their push, or max_wait_s after the
    # window's first packet, with a rule over the contributions that arrived
    window_size = 4                   # optional, default: all workers
    max_wait_s = 1.0
    rule = "trimmed_mean"             # mean | trimmed_mean | median | krum | multi_krum | bulyan
    f = 1                             # optional: Byzantine workers to tolerate (default: what n allows)
    trim_ratio = 0.25                 # trimmed_mean: share cut on each side
    multi_krum_m = 2                  # optional: rows Multi-Krum averages (default n - f)
    fallback = "median"               # too few arrived for the rule: median | mean | refuse
    # async: every accepted push is applied at once; staleness = global step - the push's step
    max_staleness = 5
    adaptive_staleness = true         # per-worker bounds max_staleness / speed, clamped to
    min_staleness = 1                 # [min_staleness, max_staleness x max_staleness_multiplier]
    max_staleness_multiplier = 10.0
    ewma_alpha = 0.2                  # smoothing of the submission intervals

    [[jobs.drop]]                     # emulated loss, as for the softswitch
    direction = "up"                  # up = PUSH by sender; down = PARAM by receiver
    model = "bernoulli"               # or gilbert_elliott (p, r, loss_good, loss_bad)
    p = 0.1
    worker = 0                        # optional: this worker only

Every key is checked: an unknown one or a value out of range is a :class:`~hostlib.errors.ConfigError`
naming the file, the table and the key.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostlib import robust
from hostlib.dropmodels import DropPolicy
from hostlib.errors import ConfigError, UsageError
from hostlib.protocol import MAX_ELEMS_PER_PACKET, MAX_JOBS, MAX_WORKERS, parse_address
from hostlib.ps_wire import check_k, codec_of
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
_DROP_KEYS = ("direction", "model", "worker", "p", "r", "loss_good", "loss_bad")


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
        if not 1 <= self.job_id < MAX_JOBS:
            raise ValueError(f"job_id must be in 1..{MAX_JOBS - 1}, got {self.job_id}")
        if not 1 <= self.n_workers <= MAX_WORKERS:
            raise ValueError(f"a job has 1..{MAX_WORKERS} workers, got {self.n_workers}")
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
    """``(seed, jobs)`` of a parameter-server file; every problem is a ConfigError naming the file."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"parameter-server config {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read parameter-server config {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_ps_config(doc, str(path))


def parse_ps_config(doc: dict[str, Any], source: str = "<ps config>") -> tuple[int, list[PsJobConfig]]:
    def fail(where: str, message: str) -> ConfigError:
        return ConfigError(f"{source}: {where}: {message}")

    _only_keys(doc, _TOP_KEYS, "the top level", fail)
    seed = doc.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise fail("the top level", f"seed must be an integer >= 0, got {seed!r}")
    tables = doc.get("jobs", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise fail("the top level", "jobs must be written as [[jobs]] tables")
    jobs: list[PsJobConfig] = []
    for i, table in enumerate(tables):
        where = f"jobs[{i}]"
        _only_keys(table, JOB_KEYS, where, fail)
        try:
            job = _job(table, where, fail)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise fail(where, str(exc)) from None
        if any(j.job_id == job.job_id for j in jobs):
            raise fail(where, f"job_id {job.job_id} appears twice")
        jobs.append(job)
    return seed, jobs


def _only_keys(table: dict[str, Any], allowed: tuple[str, ...], where: str, fail: Any) -> None:
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise fail(where, f"unknown key {key!r}{hint}; allowed: {', '.join(allowed)}")


def _typed(table: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, fail: Any) -> Any:
    value = table[key]
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise fail(where, f"{key} must be a {name}, got {value!r}")
    return value


def _job(table: dict[str, Any], where: str, fail: Any) -> PsJobConfig:
    if "job_id" not in table:
        raise fail(where, "job_id = N is missing")
    raw_workers = table.get("workers")
    addresses: tuple[tuple[str, int], ...] | None = None
    if isinstance(raw_workers, int) and not isinstance(raw_workers, bool):
        n_workers = raw_workers
    elif isinstance(raw_workers, list) and raw_workers and all(isinstance(a, str) for a in raw_workers):
        addresses = tuple(parse_address(a) for a in raw_workers)
        if len(set(addresses)) != len(addresses):
            raise fail(where, "two workers have the same address")
        n_workers = len(addresses)
    else:
        raise fail(where, 'workers must be a count (workers = 4) or addresses (workers = ["IP:PORT", ...])')
    kw: dict[str, Any] = {}
    for key, kind in (
        ("mode", str),
        ("elems_per_packet", int),
        ("n_params", int),
        ("lr", float),
        ("momentum", float),
        ("compression", str),
        ("window_size", int),
        ("max_wait_s", float),
        ("rule", str),
        ("f", int),
        ("trim_ratio", float),
        ("multi_krum_m", int),
        ("fallback", str),
    ):
        if key in table:
            kw[key] = _typed(table, key, kind, where, fail)
    stale: dict[str, Any] = {}
    for key, name, kind in (
        ("max_staleness", "max_staleness", int),
        ("adaptive_staleness", "adaptive", bool),
        ("min_staleness", "min_staleness", int),
        ("max_staleness_multiplier", "max_staleness_multiplier", float),
        ("ewma_alpha", "ewma_alpha", float),
    ):
        if key in table:
            stale[name] = _typed(table, key, kind, where, fail)
    drops = []
    raw_drops = table.get("drop", [])
    if not isinstance(raw_drops, list) or not all(isinstance(d, dict) for d in raw_drops):
        raise fail(where, "drop must be written as [[jobs.drop]] tables")
    for d, spec in enumerate(raw_drops):
        dwhere = f"{where}.drop[{d}]"
        _only_keys(spec, _DROP_KEYS, dwhere, fail)
        direction = spec.get("direction", "up")
        worker = spec.get("worker")
        try:
            policy = DropPolicy.from_dict(spec)
        except (TypeError, ValueError) as exc:
            raise fail(dwhere, str(exc)) from None
        drops.append(PsDrop(direction, policy, worker))
    return PsJobConfig(
        job_id=_typed(table, "job_id", int, where, fail),
        n_workers=n_workers,
        workers=addresses,
        staleness=StalenessConfig(**stale),
        drops=tuple(drops),
        **kw,
    )
