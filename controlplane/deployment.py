"""A deployment file (TOML) says which switches exist, which jobs each holds and which drop policies
apply; ``apply`` makes the switches match it. Example (docs in ``lta ctl apply --help``)::

    [[switch]]
    name = "s1"
    target = "127.0.0.1:9559"     # P4Runtime address: simple_switch_grpc or the softswitch server
    device_id = 0

    [[job]]
    switch = "s1"                 # may be left out when there is one switch
    id = 1
    quorum = 3                    # default: all workers
    pool_size = 512
    workers = [
        { port = 1, mac = "02:00:00:00:00:01", ip = "10.0.0.1", udp_port = 48879 },
        { port = 2, mac = "02:00:00:00:00:02", ip = "10.0.0.2" },
        { port = 3, mac = "02:00:00:00:00:03", ip = "10.0.0.3" },
    ]

    [[drop]]
    job = 1
    direction = "up"              # up = GRAD by sender, down = RESULT / param = PARAM by receiver
    worker = 2                    # optional: one worker (wins over the job-wide policy)
    model = "bernoulli"           # or "gilbert_elliott" with p, r, loss_good, loss_bad; "none" removes
    p = 0.05
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from controlplane.errors import ControlPlaneError
from controlplane.jobs import DEFAULT_POOL_SIZE, JobSpec, WorkerSpec
from controlplane.session import DEFAULT_TARGET
from hostlib.dropmodels import DIRECTIONS, DropPolicy
from hostlib.p4schema import describe


@dataclass(frozen=True)
class SwitchSpec:
    name: str
    target: str = DEFAULT_TARGET
    device_id: int = 0


@dataclass(frozen=True)
class DropSpec:
    job_id: int
    direction: str
    policy: DropPolicy | None  # None: remove
    worker: int | None = None


@dataclass
class Deployment:
    switches: dict[str, SwitchSpec]
    jobs: dict[str, list[JobSpec]] = field(default_factory=dict)  # switch name -> jobs
    drops: dict[str, list[DropSpec]] = field(default_factory=dict)


def _only_keys(where: str, table: dict, allowed: set[str]) -> None:
    unknown = set(table) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")


def _switch_of(where: str, table: dict, switches: dict[str, SwitchSpec]) -> str:
    name = table.get("switch")
    if name is None:
        if len(switches) != 1:
            raise ValueError(f'{where}: say which switch (switch = "..."); the file has {sorted(switches)}')
        return next(iter(switches))
    if name not in switches:
        raise ValueError(f"{where}: no [[switch]] named {name!r}; the file has {sorted(switches)}")
    return name


def parse(text: str, source: str = "<deployment>") -> Deployment:
    """Parse a deployment file's text; errors name the file and the offending table."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source}: not valid TOML: {exc}") from None
    _only_keys(source, doc, {"switch", "job", "drop"})
    switches: dict[str, SwitchSpec] = {}
    for i, s in enumerate(doc.get("switch", [])):
        where = f"{source}: [[switch]] #{i + 1}"
        _only_keys(where, s, {"name", "target", "device_id"})
        spec = SwitchSpec(s.get("name", f"s{i + 1}"), s.get("target", DEFAULT_TARGET), s.get("device_id", 0))
        if spec.name in switches:
            raise ValueError(f"{where}: two switches are named {spec.name!r}")
        switches[spec.name] = spec
    if not switches:
        raise ValueError(f'{source}: no [[switch]] table; add one with target = "host:port"')
    deployment = Deployment(switches, {n: [] for n in switches}, {n: [] for n in switches})
    for i, j in enumerate(doc.get("job", [])):
        where = f"{source}: [[job]] #{i + 1}"
        _only_keys(where, j, {"switch", "id", "quorum", "pool_size", "slot_base", "workers"})
        if "id" not in j or not j.get("workers"):
            raise ValueError(f"{where}: a job needs id = N and workers = [{{ port = ... }}, ...]")
        try:
            workers = tuple(WorkerSpec.from_dict(w) for w in j["workers"])
            job = JobSpec(
                j["id"],
                workers,
                quorum=j.get("quorum"),
                pool_size=j.get("pool_size", DEFAULT_POOL_SIZE),
                slot_base=j.get("slot_base"),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        deployment.jobs[_switch_of(where, j, switches)].append(job)
    for i, d in enumerate(doc.get("drop", [])):
        where = f"{source}: [[drop]] #{i + 1}"
        _only_keys(
            where, d, {"switch", "job", "direction", "worker", "model", "p", "r", "loss_good", "loss_bad"}
        )
        if "job" not in d or d.get("direction") not in DIRECTIONS:
            raise ValueError(f"{where}: needs job = N and direction = one of {', '.join(DIRECTIONS)}")
        model = d.get("model", "bernoulli")
        try:
            policy = (
                None
                if model == "none"
                else DropPolicy.from_dict({k: v for k, v in d.items() if k not in ("switch", "job")})
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        deployment.drops[_switch_of(where, d, switches)].append(
            DropSpec(d["job"], d["direction"], policy, d.get("worker"))
        )
    return deployment


def load(path: Path) -> Deployment:
    if not path.exists():
        raise FileNotFoundError(f"no deployment file {path}; see `lta ctl apply --help` for an example")
    return parse(path.read_text(), str(path))


def _same_job(wanted: JobSpec, present: JobSpec) -> bool:
    pinned = wanted.slot_base is not None
    a = replace(
        wanted,
        generation=0,
        slot_base=wanted.slot_base if pinned else 0,
        quorum=wanted.quorum or len(wanted.workers),
    )
    b = replace(present, generation=0, slot_base=present.slot_base if pinned else 0)
    return a == b


def apply(deployment: Deployment, prune: bool = False, timeout_s: float = 2.0, log=print) -> None:
    """Make every switch of the deployment hold exactly its jobs and policies: load the pipeline where
    another (or none) runs, add missing jobs, re-add changed ones, set policies. Jobs not in the file
    stay unless ``prune``."""
    from controlplane.switch import LtaSwitch  # late: keeps `lta --help` free of gRPC start-up

    for name, spec in deployment.switches.items():
        with LtaSwitch.connect(spec.target, spec.device_id, timeout_s=timeout_s) as switch:
            if switch.ensure_pipeline():
                log(f"{name}: loaded the LTA pipeline on {spec.target}")
            present = switch.jobs()
            wanted = {job.job_id: job for job in deployment.jobs[name]}
            for job_id, job in wanted.items():
                if job_id in present and _same_job(job, present[job_id]):
                    log(f"{name}: job {job_id} unchanged")
                    continue
                if job_id in present:
                    switch.remove_job(job_id)
                placed = switch.add_job(job)
                log(
                    f"{name}: job {job_id} {'replaced' if job_id in present else 'added'}: "
                    f"{placed.n_workers} workers, quorum {placed.quorum or placed.n_workers}, "
                    f"slots {placed.slot_base}..{placed.slot_base + placed.pool_size - 1}"
                )
            if prune:
                for job_id in sorted(set(present) - set(wanted)):
                    switch.remove_job(job_id)
                    log(f"{name}: job {job_id} removed (not in the file)")
            for drop in deployment.drops[name]:
                if drop.job_id not in wanted and drop.job_id not in present:
                    raise ControlPlaneError(
                        f"{name}: a drop policy names job {drop.job_id}, which is not there"
                    )
                switch.set_drop_policy(drop.job_id, drop.direction, drop.policy, drop.worker)
                who = "all workers" if drop.worker is None else f"worker {drop.worker}"
                what = describe(drop.policy) if drop.policy else "removed"
                log(f"{name}: job {drop.job_id} {drop.direction} ({who}): {what}")
