"""Deployment files and the `lta ctl` CLI, against the softswitch's P4Runtime server over gRPC."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from controlplane import deployment
from controlplane.bmv2 import free_tcp_port
from controlplane.switch import LtaSwitch
from hostlib.dropmodels import DropPolicy
from hostlib.protocol import Op, make_packet
from lta.cli import main as lta
from softswitch.p4runtime_server import serve
from softswitch.pipeline import SoftSwitch

DEPLOY = """
[[switch]]
name = "s1"
target = "{target}"

[[job]]
id = 1
quorum = 2
pool_size = 64
workers = [
    {{ port = 1, mac = "02:00:00:00:00:01", ip = "10.0.0.1", udp_port = 40001 }},
    {{ port = 2, mac = "02:00:00:00:00:02", ip = "10.0.0.2" }},
    {{ port = 3, mac = "02:00:00:00:00:03", ip = "10.0.0.3" }},
]

[[drop]]
job = 1
direction = "up"
worker = 2
model = "bernoulli"
p = 1.0

[[drop]]
job = 1
direction = "down"
model = "gilbert_elliott"
p = 0.01
r = 0.3
"""


@pytest.fixture
def softswitch() -> Iterator[tuple[SoftSwitch, str]]:
    switch = SoftSwitch(seed=3)
    server, port, _ = serve(switch)
    try:
        yield switch, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def write_deploy(tmp_path: Path, target: str, text: str = DEPLOY) -> Path:
    path = tmp_path / "deploy.toml"
    path.write_text(text.format(target=target))
    return path


def test_apply_configures_jobs_and_policies(softswitch, tmp_path):
    switch, target = softswitch
    log: list[str] = []
    deployment.apply(deployment.load(write_deploy(tmp_path, target)), log=log.append)
    assert log[0] == f"s1: loaded the LTA pipeline on {target}"
    assert "s1: job 1 added: 3 workers, quorum 2, slots 0..63" in log
    cfg = switch.jobs[1].cfg
    assert (cfg.workers, cfg.quorum, cfg.pool_size) == ([1, 2, 3], 2, 64)
    assert switch.jobs[1].policies == {
        ("up", 2): DropPolicy("bernoulli", p=1.0),
        ("down", None): DropPolicy("gilbert_elliott", p=0.01, r=0.3),
    }
    # The policy works: worker 2's GRAD is dropped, workers 0 and 1 reach the quorum of 2.
    assert switch.process(make_packet(Op.GRAD, job_id=1, worker_id=2, seq=1), 3) == []
    assert switch.process(make_packet(Op.GRAD, job_id=1, worker_id=0, seq=1), 1) == []
    assert switch.read_counters(1)["drop_policy_up"] == 1


def test_apply_twice_changes_nothing_and_prune_removes(softswitch, tmp_path):
    switch, target = softswitch
    path = write_deploy(tmp_path, target)
    deployment.apply(deployment.load(path), log=lambda _: None)
    switch.process(make_packet(Op.GRAD, job_id=1, worker_id=0, seq=1, payload=np.ones(64)), 1)
    log: list[str] = []
    deployment.apply(deployment.load(path), log=log.append)
    assert "s1: job 1 unchanged" in log
    assert switch.jobs[1].slots.seq[0] == 1  # the round in progress survived
    with LtaSwitch.connect(target) as ctl:
        from controlplane.jobs import JobSpec, WorkerSpec

        ctl.add_job(JobSpec(7, (WorkerSpec(5),)))
    log.clear()
    deployment.apply(deployment.load(path), prune=True, log=log.append)
    assert "s1: job 7 removed (not in the file)" in log and sorted(switch.jobs) == [1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[job]]\nid = 1\n", "no \\[\\[switch\\]\\] table"),
        (
            '[[switch]]\ntarget = "x"\n[[job]]\nid = 1\nworkers = [{ port = 1, colour = 2 }]\n',
            "unknown worker keys",
        ),
        (
            '[[switch]]\ntarget = "x"\n[[drop]]\njob = 1\ndirection = "sideways"\n',
            "direction = one of up, down",
        ),
        (
            '[[switch]]\nname = "a"\n[[switch]]\nname = "b"\n[[job]]\nid = 1\nworkers = [{ port = 1 }]\n',
            "which switch",
        ),
        ('[[switch]]\ntarget = "x"\n[[drop]]\njob = 1\ndirection = "up"\np = 2.0\n', "not a probability"),
        ("[[switch]\n", "not valid TOML"),
    ],
)
def test_bad_deployment_files_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        deployment.parse(text, "deploy.toml")


def test_cli_job_drop_stats_watch(softswitch, capsys):
    switch, target = softswitch
    base = ["ctl", "--target", target]
    assert lta([*base, "load"]) == 0
    assert lta([*base, "job", "add", "3", "--port", "1", "--port", "2", "--quorum", "2"]) == 0
    assert "job 3: 2 workers, quorum 2, slots 0..511" in capsys.readouterr().out
    assert lta([*base, "drop", "set", "3", "down", "bernoulli", "--p", "0.25", "--worker", "1"]) == 0
    assert switch.jobs[3].policies == {("down", 1): DropPolicy("bernoulli", p=0.25)}
    switch.process(make_packet(Op.GRAD, job_id=3, worker_id=0, seq=1), 1)
    switch.process(make_packet(Op.GRAD, job_id=3, worker_id=1, seq=1), 2)
    capsys.readouterr()
    assert lta([*base, "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["3"]["grad_start"] == 1 and stats["3"]["grad_add"] == 1 and stats["3"]["result_quorum"] == 1
    assert stats["3"]["rx_packets"] == 2
    assert lta([*base, "stats"]) == 0
    table = capsys.readouterr().out
    assert "job 3" in table and "result_quorum" in table and "flush_stale" not in table
    assert lta([*base, "job", "ls", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["3"]["drop"] == [
        {
            "direction": "down",
            "worker": 1,
            "model": "bernoulli",
            "p": 0.25,
            "r": 1.0,
            "loss_good": 0.0,
            "loss_bad": 1.0,
        }
    ]
    assert lta([*base, "watch", "--interval", "0.05", "--count", "1"]) == 0
    assert "packets/s" in capsys.readouterr().out
    assert lta([*base, "job", "reset", "3"]) == 0
    assert lta([*base, "job", "rm", "3"]) == 0
    assert switch.jobs == {}


def test_cli_errors_are_one_line_and_exit_1(softswitch, capsys):
    _, target = softswitch
    unreachable = f"127.0.0.1:{free_tcp_port()}"
    assert lta(["ctl", "--target", unreachable, "--timeout", "0.2", "stats"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"lta ctl: error: switch at {unreachable} did not answer within 0.2 s")
    assert lta(["ctl", "--target", target, "stats"]) == 1
    assert "no pipeline loaded" in capsys.readouterr().err
    assert lta(["ctl", "--target", target, "load"]) == 0
    assert lta(["ctl", "--target", target, "job", "add", "3"]) == 1
    assert "a job needs workers" in capsys.readouterr().err
    assert lta(["ctl", "--target", target, "drop", "set", "4", "up", "bernoulli", "--p", "0.1"]) == 1
    assert "no job 4" in capsys.readouterr().err
    assert lta(["ctl", "--target", target, "apply", "/nonexistent.toml"]) == 1
    assert "no deployment file" in capsys.readouterr().err


def test_monitors_run_beside_the_primary_controller(softswitch, capsys):
    _, target = softswitch
    with LtaSwitch.connect(target, election_id=(0, 50)) as primary:
        primary.load_pipeline()
        from controlplane.jobs import JobSpec, WorkerSpec

        primary.add_job(JobSpec(2, (WorkerSpec(1),)))
        # Lower election id than the primary: monitors still read, a writer is refused.
        assert lta(["ctl", "--target", target, "stats", "--json"]) == 0
        assert "2" in json.loads(capsys.readouterr().out)
        assert lta(["ctl", "--target", target, "job", "ls"]) == 0
        assert "job 2: quorum 1/1" in capsys.readouterr().out
        assert lta(["ctl", "--target", target, "job", "rm", "2"]) == 1
        assert "another controller is primary" in capsys.readouterr().err
