"""One job type and one pool rule (hostlib/job.py, issue 40 item 3): the switch's JobConfig, the control
plane's JobSpec, a jobs file's entry and the torch rendezvous' JobRequest resolve the pool alike and
refuse the same jobs. Expectations written out from the rules (docs/protocol.md), not from the code."""

from __future__ import annotations

import pytest

from controlplane.jobs import JobSpec, WorkerSpec
from hostlib.errors import ConfigError
from hostlib.job import Job, pool_size
from hostlib.jobconfig import parse_jobs
from hostlib.protocol import Role
from hostlib.torch_ext.rendezvous import JobRequest
from hostlib.transport import TransportConfig
from softswitch.pipeline import JobConfig

ADDRS = [("127.0.0.1", 41001), ("127.0.0.1", 41002), ("127.0.0.1", 41003)]


@pytest.mark.parametrize(("k", "pool"), [(1, 2048), (64, 2048), (1024, 2048), (1025, 512), (16367, 512)])
def test_every_side_resolves_the_default_pool_alike(k, pool):
    assert pool_size(None, k) == pool_size(0, k) == pool
    assert JobConfig(1, ADDRS, elems_per_packet=k).pool_size == pool
    assert TransportConfig(elems_per_packet=k).pool_size == pool
    assert JobRequest(1, ADDRS, pool_size=0, elems_per_packet=k).as_job().pool_size == pool
    text = f'[[jobs]]\njob_id = 1\nworkers = ["127.0.0.1:41001"]\nelems_per_packet = {k}\n'
    assert parse_jobs(text).jobs[0].pool_size == pool


def test_a_switch_job_may_have_one_slot_and_a_worker_needs_two():
    assert JobConfig(1, ADDRS, pool_size=1).pool_size == 1
    assert JobSpec(1, (WorkerSpec(1),), pool_size=1).pool_size == 1
    with pytest.raises(ValueError, match="pool_size must be in 2..65535"):
        TransportConfig(pool_size=1)
    for bad in (65536, -1):
        with pytest.raises(ValueError, match="pool_size must be in 1..65535"):
            JobConfig(1, ADDRS, pool_size=bad)
        with pytest.raises(ValueError, match="pool_size must be in 1..65535"):
            JobSpec(1, (WorkerSpec(1),), pool_size=bad)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"job_id": 0}, "job_id must be in 1..63, got 0"),
        ({"job_id": 64}, "job_id must be in 1..63, got 64"),
        ({"quorum": 4}, "quorum must be in 1..3, got 4"),
        ({"quorum": 0}, "quorum must be in 1..3, got 0"),
    ],
)
def test_the_switch_the_control_plane_and_the_rendezvous_refuse_the_same_jobs(fields, message):
    job_id, quorum = fields.get("job_id", 1), fields.get("quorum")
    with pytest.raises(ValueError, match=message):
        JobConfig(job_id, ADDRS, quorum=quorum)
    with pytest.raises(ValueError, match=message):
        JobSpec(job_id, tuple(WorkerSpec(w + 1) for w in range(3)), quorum=quorum)
    with pytest.raises(ValueError, match=message):
        JobRequest(job_id, ADDRS, pool_size=0, elems_per_packet=64, quorum=quorum)


def test_the_tree_rules():
    leaf = Job.of(2, [ADDRS[0], None, ADDRS[2]], role=Role.LEAF, uplink=("10.0.0.9", 9), leaf_id=3)
    assert (leaf.served, leaf.quorum, leaf.leaf_id) == ((0, 2), 2, 3)  # the quorum counts served workers
    with pytest.raises(ValueError, match="a leaf needs an uplink"):
        Job.of(2, ADDRS, role=Role.LEAF)
    with pytest.raises(ValueError, match="leaf_id must be in 0..31, got 32"):
        Job.of(2, ADDRS, role=Role.LEAF, uplink=("10.0.0.9", 9), leaf_id=32)
    with pytest.raises(ValueError, match="only a leaf may leave workers out"):
        Job.of(2, [ADDRS[0], None])
    with pytest.raises(ValueError, match="a spine has at most 32 leaves, got 33"):
        Job.of(2, [("10.0.0.1", 1000 + j) for j in range(33)], role=Role.SPINE)
    with pytest.raises(ValueError, match="only a leaf has an uplink"):  # the control plane's rule
        Job.of(2, ADDRS, uplink=("10.0.0.9", 9), only_leaf_uplink=True)
    with pytest.raises(ValueError, match="needs 1..64 workers, got 65"):
        Job.of(2, [("10.0.0.1", 1000 + w) for w in range(65)])


def test_a_jobs_file_entry_is_checked_as_a_job():
    entry = parse_jobs('[[jobs]]\njob_id = 5\nworkers = ["127.0.0.1:41001", "127.0.0.1:41002"]\n').jobs[0]
    job = entry.as_job()
    assert (job.job_id, job.n_workers, job.quorum, job.pool_size, job.role) == (5, 2, 2, 2048, Role.FLAT)
    with pytest.raises(ConfigError, match="quorum must be 1..2, got 3"):
        parse_jobs('[[jobs]]\njob_id = 5\nworkers = ["127.0.0.1:41001", "127.0.0.1:41002"]\nquorum = 3\n')
