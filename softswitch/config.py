"""The softswitch's ``--config FILE``: the jobs file of ``hostlib/jobconfig.py`` (the one ``lta ctl apply``
reads too; docs/jobs_file.md). For example::

    seed = 7                          # seeds the drop decisions: a run replays
    [[jobs]]
    job_id = 1
    workers = ["127.0.0.1:41001", "127.0.0.1:41002"]   # worker w sends from workers[w]
    quorum = 2                        # optional, default: all workers
    pool_size = 512                   # optional
    elems_per_packet = 64             # optional
    [[jobs.drop]]
    direction = "up"                  # up | down | param
    model = "bernoulli"               # or gilbert_elliott with p, r, loss_good, loss_bad
    p = 0.1
    worker = 0                        # optional: this worker only

The UDP softswitch tells workers apart by the address their packets come from, so every worker needs
``ip`` and ``udp_port`` (``"IP:UDP_PORT"``); ``port`` and ``mac`` only matter to ``lta ctl`` (with
``--p4runtime``). Unknown keys, wrong types and out-of-range values are refused, naming the file, the
table and the key (:class:`hostlib.errors.ConfigError`).
"""

from __future__ import annotations

from pathlib import Path

from hostlib.jobconfig import JobEntry, JobFile, load_jobs
from hostlib.protocol import Role
from softswitch.pipeline import JobConfig, Port, SoftSwitch


def softswitch_jobs(job_file: JobFile) -> list[JobEntry]:
    """The file's jobs, checked for what the UDP softswitch needs: each worker's ip and udp_port. A
    file that spreads its jobs over several ``[[switches]]`` is refused (which would this one be?)."""
    if len(job_file.switches) > 1:
        names = [s.name for s in job_file.switches]
        raise job_file.error(
            "[[switches]]",
            f"the file spreads its jobs over {len(names)} switches {names}; give the softswitch a file "
            f"with its own jobs",
        )
    for job in job_file.jobs:
        for w, worker in enumerate(job.workers):
            if worker.address is None:
                raise job_file.error(
                    f"{job.where}.workers[{w}]",
                    "the softswitch tells workers apart by the address their packets come from: give ip "
                    'and udp_port (e.g. "127.0.0.1:41001")',
                )
    return list(job_file.jobs)


def job_config(job: JobEntry) -> JobConfig:
    """A checked jobs-file job as the pipeline holds it (workers by (ip, udp_port); a leaf's at their
    global ids worker_base, worker_base + 1, ...)."""
    workers: list[Port | None] = [None] * job.worker_base + [worker.address for worker in job.workers]
    return JobConfig(
        job.job_id,
        workers,
        quorum=job.quorum,
        pool_size=job.pool_size,
        elems_per_packet=job.elems_per_packet,
        role=Role[job.role.upper()],
        uplink=job.uplink,
        leaf_id=job.leaf_id,
    )


def build_switch(job_file: JobFile) -> SoftSwitch:
    """A SoftSwitch holding the jobs and drop policies of a jobs file."""
    switch = SoftSwitch(seed=job_file.seed)
    for job in softswitch_jobs(job_file):
        switch.add_job(job_config(job))
        for drop in job.drops:
            if drop.policy is not None:
                worker = None if drop.worker is None else job.worker_base + drop.worker
                switch.set_drop_policy(job.job_id, drop.direction, drop.policy, worker)
    return switch


def load_switch(path: str | Path) -> SoftSwitch:
    """A SoftSwitch with the jobs and policies of a jobs file; errors name the file, table and key."""
    return build_switch(load_jobs(path))
