"""Deployment files and the `lta ctl` CLI, against the softswitch's P4Runtime server over gRPC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from controlplane import deployment
from controlplane.bmv2 import free_tcp_port
from controlplane.switch import LtaSwitch
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.errors import ConfigError
from hostlib.jobconfig import DEFAULT_POOL_SIZE
from hostlib.protocol import COUNTERS, Op, make_packet
from lta.cli import main as lta
from softswitch.p4runtime_server import serve
from softswitch.pipeline import SoftSwitch

REPO = Path(__file__).resolve().parent.parent

DEPLOY = """
[[switches]]
name = "s1"
target = "{target}"

[[jobs]]
job_id = 1
quorum = 2
pool_size = 64
workers = [
    {{ port = 1, mac = "02:00:00:00:00:01", ip = "10.0.0.1", udp_port = 40001 }},
    {{ port = 2, mac = "02:00:00:00:00:02", ip = "10.0.0.2" }},
    {{ port = 3, mac = "02:00:00:00:00:03", ip = "10.0.0.3" }},
]

[[jobs.drop]]
direction = "up"
worker = 2
model = "bernoulli"
p = 1.0

[[jobs.drop]]
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


ONE_WORKER = "[[jobs]]\njob_id = 1\nworkers = [{ port = 1 }]\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[job]]\nid = 1\n", r"unknown table \[\[job\]\] \(did you mean \[\[jobs\]\]\?\)"),
        (
            '[[switch]]\ntarget = "127.0.0.1:1"\n',
            r"unknown table \[\[switch\]\] \(did you mean \[\[switches\]\]\?\)",
        ),
        ("[[jobs]]\njob_id = 1\n", "workers is missing"),
        (
            "[[jobs]]\njob_id = 1\nworkers = [{ port = 1, colour = 2 }]\n",
            "workers\\[0\\]: unknown key 'colour'",
        ),
        (ONE_WORKER + '[[jobs.drop]]\ndirection = "sideways"\n', "direction must be one of up, down"),
        ('[[switches]]\nname = "a"\n[[switches]]\nname = "b"\n' + ONE_WORKER, "say which switch"),
        (ONE_WORKER + '[[jobs.drop]]\ndirection = "up"\np = 2.0\n', "must be a probability"),
        (
            '[[jobs]]\njob_id = 1\nworkers = [{ ip = "127.0.0.1", udp_port = 41001 }]\n',
            "needs its switch port",
        ),
        ('[[jobs]]\njob_id = 1\nworkers = ["127.0.0.1:41001"]\n', "needs its switch port"),
        (ONE_WORKER + "elems_per_packet = 128\n", "elems_per_packet = 128: a P4 switch runs its compiled K"),
        ("[[switch]\n", "not valid TOML"),
    ],
)
def test_bad_deployment_files_name_the_problem(text, message):
    with pytest.raises(ConfigError, match=f"^deploy.toml: .*{message}"):
        deployment.parse(text, "deploy.toml")


def test_cli_job_drop_stats_watch(softswitch, capsys):
    switch, target = softswitch
    base = ["ctl", "--target", target]
    assert lta([*base, "load"]) == 0
    assert lta([*base, "job", "add", "3", "--port", "1", "--port", "2", "--quorum", "2"]) == 0
    assert f"job 3: 2 workers, quorum 2, slots 0..{DEFAULT_POOL_SIZE - 1}" in capsys.readouterr().out
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


def one_line_error(capsys) -> str:
    """The one stderr line of a failed command (and nothing on stdout)."""
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_cli_errors_are_one_line_and_nonzero(softswitch, capsys):
    _, target = softswitch
    unreachable = f"127.0.0.1:{free_tcp_port()}"
    assert lta(["ctl", "--target", unreachable, "--timeout", "0.2", "stats"]) == 1
    err = one_line_error(capsys)
    assert err.startswith("lta") and f": error: switch at {unreachable} did not answer within 0.2 s" in err
    assert lta(["ctl", "--target", target, "stats"]) == 1
    assert "no pipeline loaded" in one_line_error(capsys)
    assert lta(["ctl", "--target", target, "load"]) == 0
    capsys.readouterr()
    assert lta(["ctl", "--target", target, "job", "add", "3"]) == 2
    assert "a job needs workers" in one_line_error(capsys)
    assert lta(["ctl", "--target", target, "drop", "set", "4", "up", "bernoulli", "--p", "0.1"]) == 2
    assert "no job 4" in one_line_error(capsys)
    assert lta(["ctl", "--target", target, "apply", "/nonexistent.toml"]) == 2
    assert "no jobs file" in one_line_error(capsys)
    # Ranges are checked while parsing: one line, exit 2, nothing sent.
    for argv, message in (
        (["job", "add", "64", "--port", "1"], "job id must be 1..63, got 64"),
        (["job", "add", "1", "--port", "511"], "port must be 0..510, got 511"),
        (["drop", "set", "1", "up", "bernoulli", "--p", "1.5"], "probability must be in [0.0, 1.0], got 1.5"),
        (["watch", "--interval", "0"], "must be in (0.0, inf), got 0"),
        (["--target", "127.0.0.1:99999", "stats"], "port in 1..65535"),
        (["--timeout", "-1", "stats"], "got -1"),
    ):
        assert lta(["ctl", *argv]) == 2
        assert message in one_line_error(capsys)


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


def test_job_add_gives_every_worker_its_own_addresses(softswitch, capsys):
    switch, target = softswitch
    base = ["ctl", "--target", target]
    assert lta([*base, "load"]) == 0
    assert lta([*base, "job", "add", "3", "--port", "1", "--port", "2"]) == 0
    assert lta([*base, "job", "ls", "--json"]) == 0
    out = capsys.readouterr().out
    listing = json.loads(out[out.index("{") :])
    # Worker w gets the Mininet topologies' addresses: 10.0.0.(w+1), 02:00:00:00:00:(w+1), 40000 + w.
    assert listing["3"]["workers"] == [
        {"port": 1, "mac": "02:00:00:00:00:01", "ip": "10.0.0.1", "udp_port": 40000, "packets": 0},
        {"port": 2, "mac": "02:00:00:00:00:02", "ip": "10.0.0.2", "udp_port": 40001, "packets": 0},
    ]
    assert switch.jobs[3].cfg.workers == [1, 2]  # this server names workers by port
    worker = "port=4,ip=127.0.0.1,udp_port=41001"
    assert (
        lta([*base, "job", "add", "4", "--worker", worker, "--worker", "port=5,mac=02:00:00:00:00:99"]) == 0
    )
    assert lta([*base, "job", "ls", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{") :])["4"]["workers"] == [
        {"port": 4, "mac": "02:00:00:00:00:01", "ip": "127.0.0.1", "udp_port": 41001, "packets": 0},
        {"port": 5, "mac": "02:00:00:00:00:99", "ip": "10.0.0.2", "udp_port": 40001, "packets": 0},
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--worker", "ip=127.0.0.1,udp_port=41001"], "worker 0 needs its switch port (port = N)"),
        (["--worker", "port=1", "--port", "2"], "not both"),
        (["--worker", "port=1,colour=red"], "unknown key 'colour'"),
        (["--worker", "port=one"], "port must be an integer, got 'one'"),
        (["--worker", "port=1,ip=localhost"], "ip 'localhost' is not an IPv4 address"),
        (["--worker", "port=1,udp_port=0"], "udp_port must be in 1..65535, got 0"),
        (["--worker", "port=1,ip=10.0.0.2,udp_port=40001", "--worker", "port=2"], "both have address"),
        (["--port", "1", "--quorum", "2"], "--quorum 2: the job has 1 workers"),
    ],
)
def test_job_add_mistakes_are_one_line(softswitch, capsys, args, message):
    switch, target = softswitch
    assert lta(["ctl", "--target", target, "load"]) == 0
    capsys.readouterr()
    assert lta(["ctl", "--target", target, "job", "add", "1", *args]) == 2
    assert message in one_line_error(capsys)
    assert switch.jobs == {}


def test_load_refuses_to_wipe_jobs_or_another_program_without_force(softswitch, capsys):
    switch, target = softswitch
    base = ["ctl", "--target", target]
    assert lta([*base, "load"]) == 0
    assert lta([*base, "load"]) == 0  # no jobs: nothing to lose
    assert lta([*base, "job", "add", "2", "--port", "1"]) == 0
    capsys.readouterr()
    assert lta([*base, "load"]) == 1
    err = one_line_error(capsys)
    assert "holds jobs 2" in err and "--force" in err
    assert sorted(switch.jobs) == [2]
    assert lta([*base, "load", "--force"]) == 0
    assert switch.jobs == {}
    # Another program (our P4Info plus a table of its own) is not replaced without --force either.
    from hostlib.p4.info import load_p4info

    other = load_p4info()
    extra = other.tables.add()
    extra.CopyFrom(other.tables[0])
    extra.preamble.id, extra.preamble.name = 0x02FFFFFF, "Other.program.table"
    with LtaSwitch.connect(target, election_id=(0, 9)) as ctl:
        ctl.session.set_pipeline(other, b"")
    capsys.readouterr()
    assert lta([*base, "--election-id", "10", "load"]) == 1
    assert "runs another P4 program" in one_line_error(capsys)
    assert lta([*base, "--election-id", "10", "load", "--force"]) == 0
    with LtaSwitch.connect(target, read_only=True) as ctl:
        assert ctl.pipeline_state() == "ours"


def test_stats_all_is_an_aligned_table_of_installed_jobs(softswitch, capsys):
    switch, target = softswitch
    base = ["ctl", "--target", target]
    assert lta([*base, "load"]) == 0
    assert lta([*base, "job", "add", "3", "--port", "1", "--port", "2"]) == 0
    assert lta([*base, "job", "add", "5", "--port", "3"]) == 0
    switch.process(make_packet(Op.GRAD, job_id=3, worker_id=0, seq=1), 1)
    switch.process(make_packet(Op.GRAD, job_id=3, worker_id=1, seq=1), 2)
    switch.process(make_packet(Op.GRAD, job_id=9, worker_id=0, seq=1), 1)  # no such job
    capsys.readouterr()
    assert lta([*base, "stats", "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[0].split(), [line.split() for line in lines[1:]]
    # Columns: the installed jobs and the "no job" row of the unknown job's packet, not all 64 indices.
    assert header == ["counter", "no", "job", "job", "3", "job", "5"]
    assert [r[0] for r in rows] == list(COUNTERS)  # --all: every counter, zero or not
    assert len({len(line) for line in lines}) == 1  # every line as wide: columns line up
    cells = {r[0]: [int(v) for v in r[1:]] for r in rows}
    # By hand: two GRADs of job 3 start and complete a round (quorum 2), one RESULT to each worker.
    assert cells["rx_packets"] == [1, 2, 0]
    assert cells["drop_unknown_job"] == [1, 0, 0]
    assert cells["grad_start"] == [0, 1, 0] and cells["grad_add"] == [0, 1, 0]
    assert cells["result_quorum"] == [0, 1, 0] and cells["tx_packets"] == [0, 2, 0]
    # Right-aligned: a column's cells end where its header ends.
    end = lines[0].index("job 3") + len("job 3")
    assert all(line[:end].endswith(str(cells[line.split()[0]][1])) for line in lines[1:])
    assert lta([*base, "stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["3"]["grad_start"] == 1


def test_apply_without_switches_goes_to_the_target(softswitch, tmp_path, capsys):
    switch, target = softswitch
    path = tmp_path / "jobs.toml"
    path.write_text("[[jobs]]\njob_id = 6\nworkers = [{ port = 4 }, { port = 5 }]\nquorum = 1\n")
    assert lta(["ctl", "--target", target, "apply", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{target}: job 6 added: 2 workers, quorum 1" in out
    assert switch.jobs[6].cfg.workers == [4, 5] and switch.jobs[6].cfg.quorum == 1


# ---- without the p4rt extra --------------------------------------------------------------------------
BLOCK_P4RT = """\
import sys
for name in ("grpc", "google", "finsy"):
    sys.modules[name] = None  # `import grpc` now raises ImportError, as when the extra is not installed
"""


def run_without_p4rt(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`lta ARGV` in a fresh interpreter where gRPC, protobuf and the P4Runtime bindings do not import."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK_P4RT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    return subprocess.run(
        [sys.executable, "-m", "lta.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def test_help_works_and_commands_name_the_extra_without_p4rt(tmp_path):
    for argv in (["--help"], ["ctl", "--help"], ["ctl", "job", "add", "--help"], ["softswitch", "--help"]):
        proc = run_without_p4rt(tmp_path, *argv)
        assert proc.returncode == 0 and "usage: lta" in proc.stdout, proc.stderr
    for argv in (["ctl", "stats"], ["ctl", "job", "add", "1", "--port", "1"], ["ctl", "load"]):
        proc = run_without_p4rt(tmp_path, *argv)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "lta ctl needs the p4rt extra: pip install 'lta[p4rt]'" in proc.stderr
    proc = run_without_p4rt(tmp_path, "softswitch", "--listen", "127.0.0.1:1", "--p4runtime", "127.0.0.1:1")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "lta softswitch --p4runtime needs the p4rt extra: pip install 'lta[p4rt]'" in proc.stderr
    # A bad jobs file is reported as such even without the extra (it is read first).
    bad = tmp_path / "bad.toml"
    bad.write_text("[[jobz]]\n")
    proc = run_without_p4rt(tmp_path, "ctl", "apply", str(bad))
    assert proc.returncode == 2 and "unknown table [[jobz]]" in proc.stderr


def test_building_the_parser_imports_no_grpc():
    code = (
        "import sys\nfrom lta.cli import build_parser\nbuild_parser()\n"
        "p4rt = ('grpc', 'finsy', 'google.protobuf', 'google.rpc', 'p4.')\n"
        "print(sorted(m for m in sys.modules if m.startswith(p4rt)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_liveness_marks_a_silent_worker_offline_and_restores_the_quorum_on_exit(softswitch, capsys):
    switch, target = softswitch
    base = ["ctl", "--target", target]
    assert lta([*base, "load"]) == 0
    assert lta([*base, "job", "add", "4", "--port", "1", "--port", "2", "--port", "3"]) == 0
    # Workers 0 and 1 heartbeat between any two reads of the counters (each read is preceded by a beat
    # of theirs), so however late a poll comes they were heard since the last one; worker 2 never sends.
    read_worker_rx = switch.read_worker_rx

    def beating_read(job_id: int, n_workers: int | None = None) -> list[int]:
        if job_id == 4:
            for w in (0, 1):
                switch.process(make_packet(Op.HEARTBEAT, job_id=4, worker_id=w), w + 1)
        return read_worker_rx(job_id, n_workers)

    switch.read_worker_rx = beating_read
    quorums = []
    original = switch.set_quorum

    def recording(job_id: int, quorum: int) -> None:
        quorums.append(quorum)
        original(job_id, quorum)

    switch.set_quorum = recording
    capsys.readouterr()
    # --for 1 outlasts --timeout 0.3: the last poll comes after the command's end, past the timeout
    args = [*base, "liveness", "4", "--timeout", "0.3", "--poll", "0.05", "--for", "1", "--json"]
    assert lta(args) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["worker"], e["state"], e["quorum"]) for e in events] == [(2, "offline", 2)]
    assert quorums == [2, 3]  # lowered while worker 2 was offline, restored when the command ended
    assert switch.jobs[4].cfg.quorum == 3
    assert lta([*base, "job", "ls", "--json"]) == 0
    packets = [w["packets"] for w in json.loads(capsys.readouterr().out)["4"]["workers"]]
    assert packets[0] >= 2 and packets[1] >= 2 and packets[2] == 0  # a beat per read: the start, the polls
