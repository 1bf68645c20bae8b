"""``lta ctl apply FILE``: make the switches hold the jobs and drop policies of a jobs file.

The file is the one ``lta softswitch --config`` reads (schema: ``hostlib/jobconfig.py``,
docs/jobs_file.md). Example::

    [[switches]]                  # optional: without it the jobs go to `lta ctl --target`
    name = "s1"
    target = "127.0.0.1:9559"     # P4Runtime address: simple_switch_grpc or the softswitch's server
    device_id = 0

    [[jobs]]
    job_id = 1
    switch = "s1"                 # may be left out when the file names one switch
    quorum = 3                    # default: all workers
    pool_size = 512
    workers = [                   # lta ctl needs each worker's switch port
        { port = 1, mac = "02:00:00:00:00:01", ip = "10.0.0.1", udp_port = 40000 },
        { port = 2, mac = "02:00:00:00:00:02", ip = "10.0.0.2", udp_port = 40001 },
        { port = 3 },             # ip, mac, udp_port left out: 10.0.0.3, 02:00:00:00:00:03, 40002
    ]

    [[jobs.drop]]
    direction = "up"              # up = GRAD by sender, down = RESULT / param = PARAM by receiver
    worker = 2                    # optional: one worker (wins over the job-wide policy)
    model = "bernoulli"           # or "gilbert_elliott" with p, r, loss_good, loss_bad; "none" removes
    p = 0.05

Unknown keys, wrong types and out-of-range values are refused, naming the file, the table and the key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from controlplane import DEFAULT_TARGET, DEFAULT_TIMEOUT_S
from controlplane.jobs import JobSpec, WorkerSpec, check_distinct_addresses
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.errors import ConfigError
from hostlib.jobconfig import JobEntry, JobFile, SwitchEntry, load_jobs, parse_jobs
from hostlib.p4.schema import describe
from hostlib.protocol import DEFAULT_ELEMS_PER_PACKET, Role

logger = logging.getLogger(__name__)


# A switch of a deployment is the jobs file's [[switches]] entry as parsed.
SwitchSpec = SwitchEntry
# A leaf's partials go to this MAC when its uplink has none: a switch running LTA does not check it.
UPLINK_BROADCAST_MAC = "ff:ff:ff:ff:ff:ff"


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


def job_spec(job: JobEntry, job_file: JobFile) -> JobSpec:
    """A file's job as the control plane installs it; refuses what a P4Runtime switch cannot hold."""
    if job.elems_per_packet != DEFAULT_ELEMS_PER_PACKET:
        raise job_file.error(
            job.where,
            f"elems_per_packet = {job.elems_per_packet}: a P4 switch runs its compiled "
            f"K = {DEFAULT_ELEMS_PER_PACKET} and P4Runtime cannot change it; leave the key out for lta ctl",
        )
    # A leaf's workers are global ids worker_base, worker_base + 1, ... (docs/protocol.md, "Hierarchy").
    workers: list[WorkerSpec | None] = [None] * job.worker_base
    for w, worker in enumerate(job.workers):
        try:
            workers.append(WorkerSpec.from_entry(worker, job.worker_base + w))
        except ValueError as exc:
            raise job_file.error(f"{job.where}.workers[{w}]", str(exc)) from None
    try:
        check_distinct_addresses(tuple(workers))
    except ValueError as exc:
        raise job_file.error(job.where, f"{exc} (after filling in the addresses left out)") from None
    uplink = None
    if job.role == "leaf":
        assert job.uplink is not None  # the schema requires it
        if job.uplink_port is None:
            raise job_file.error(
                f"{job.where}.uplink",
                "lta ctl needs the leaf's switch port toward the spine: "
                'uplink = { ip = "...", udp_port = N, port = P, mac = "..." }',
            )
        host, udp_port = job.uplink
        try:
            uplink = WorkerSpec(
                job.uplink_port, mac=job.uplink_mac or UPLINK_BROADCAST_MAC, ip=host, udp_port=udp_port
            )
        except ValueError as exc:
            raise job_file.error(f"{job.where}.uplink", str(exc)) from None
    try:
        return JobSpec(
            job.job_id,
            tuple(workers),
            quorum=job.quorum,
            pool_size=job.pool_size,
            slot_base=job.slot_base,
            role=Role[job.role.upper()],
            uplink=uplink,
            leaf_id=job.leaf_id,
        )
    except ValueError as exc:
        raise job_file.error(job.where, str(exc)) from None


def from_jobs(job_file: JobFile, target: str = DEFAULT_TARGET, device_id: int = 0) -> Deployment:
    """The deployment a jobs file describes; with no ``[[switches]]`` its jobs go to ``target``."""
    if job_file.switches:
        switches = {s.name: s for s in job_file.switches}
    else:
        switches = {target: SwitchSpec(target, target, device_id)}
    deployment = Deployment(switches, {n: [] for n in switches}, {n: [] for n in switches})
    only = next(iter(switches))
    for job in job_file.jobs:
        name = job.switch or only  # the schema checked that a job names a switch when there are several
        deployment.jobs[name].append(job_spec(job, job_file))
        deployment.drops[name] += [
            DropSpec(
                job.job_id, d.direction, d.policy, None if d.worker is None else job.worker_base + d.worker
            )
            for d in job.drops
        ]
    return deployment


def parse(
    text: str, source: str = "<deployment>", target: str = DEFAULT_TARGET, device_id: int = 0
) -> Deployment:
    """Parse a jobs file's text; every problem is a :class:`ConfigError` naming the file and table."""
    return from_jobs(parse_jobs(text, source), target, device_id)


def load(path: Path, target: str = DEFAULT_TARGET, device_id: int = 0) -> Deployment:
    if not path.exists():
        raise ConfigError(f"no jobs file {path}; see `lta ctl apply --help` for an example")
    return from_jobs(load_jobs(path), target, device_id)


def _same_job(wanted: JobSpec, present: JobSpec) -> bool:
    pinned = wanted.slot_base is not None
    a = replace(
        wanted,
        generation=0,
        slot_base=wanted.slot_base if pinned else 0,
        quorum=wanted.quorum or len(wanted.local),
    )
    b = replace(present, generation=0, slot_base=present.slot_base if pinned else 0)
    return a == b


def apply(
    deployment: Deployment,
    prune: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    log: Callable[[str], None] = logger.info,
) -> None:
    """Make every switch of the deployment hold exactly its jobs and policies: load the pipeline where
    another (or none) runs, add missing jobs, re-add changed ones, set policies. Jobs not in the file
    stay unless ``prune``. Needs the p4rt extra."""
    from controlplane.switch import LtaSwitch  # late: keeps `lta --help` free of gRPC

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
                switch.set_drop_policy(drop.job_id, drop.direction, drop.policy, drop.worker)
                who = "all workers" if drop.worker is None else f"worker {drop.worker}"
                what = describe(drop.policy) if drop.policy else "removed"
                log(f"{name}: job {drop.job_id} {drop.direction} ({who}): {what}")
