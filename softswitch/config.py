"""Softswitch configuration from TOML: jobs, worker addresses and drop policies.

seed = 7
[[jobs]]
job_id = 1
workers = ["127.0.0.1:41001", "127.0.0.1:41002"]   # worker w sends from workers[w]
quorum = 2            # optional, default: all workers
pool_size = 512       # optional
elems_per_packet = 64 # optional
[[jobs.drop]]
direction = "up"      # up | down | param
model = "bernoulli"   # or gilbert_elliott with p, r, loss_good, loss_bad
p = 0.1
worker = 0            # optional: this worker only
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from hostlib.dropmodels import DropPolicy
from hostlib.protocol import parse_address
from softswitch.pipeline import JobConfig, SoftSwitch


def load_switch(path: str | Path) -> SoftSwitch:
    """A SoftSwitch with the jobs and policies of a TOML file. Errors name the file and the entry."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"softswitch config {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from exc
    switch = SoftSwitch(seed=int(doc.get("seed", 0)))
    for i, job in enumerate(doc.get("jobs", [])):
        where = f"{path}: jobs[{i}]"
        try:
            cfg = JobConfig(
                job_id=int(job["job_id"]),
                workers=[parse_address(a) for a in job["workers"]],
                quorum=job.get("quorum"),
                pool_size=int(job.get("pool_size", 512)),
                elems_per_packet=int(job.get("elems_per_packet", 64)),
            )
            switch.add_job(cfg)
            for drop in job.get("drop", []):
                switch.set_drop_policy(
                    cfg.job_id, drop.get("direction", "up"), DropPolicy.from_dict(drop), drop.get("worker")
                )
        except KeyError as exc:
            raise ValueError(f"{where}: missing key {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    return switch
