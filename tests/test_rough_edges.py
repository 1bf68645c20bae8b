"""What a new user hits first (issue 25): outputs checked before any work, reruns that do not silently
replace results, results on stdout and everything else on stderr, exit codes as the README states them,
sizes and probabilities refused at parse time, and messages that name the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lta import cli


class Started(Exception):
    """Raised by a stand-in cluster: the command got as far as starting work."""


def _no_cluster(*args, **kwargs):
    raise Started


# ---- 1, 2: lta train's --out ---------------------------------------------------------------------------
def test_train_refuses_an_out_that_is_a_file_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)  # starting a run would raise
    target = tmp_path / "results"
    target.write_text("not a folder")
    assert cli.main(["train", "--quick", "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lta train: error: --out ")
    assert "is a file" in err
    assert target.read_text() == "not a folder"


def test_train_refuses_an_out_under_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)
    (tmp_path / "f").write_text("")
    assert cli.main(["train", "--quick", "--out", str(tmp_path / "f" / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot make the folder" in err


def test_train_refuses_to_replace_an_earlier_sweep_unless_told(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)
    out = tmp_path / "lta-train"
    out.mkdir()
    (out / "results.json").write_text('{"earlier": true}')
    assert cli.main(["train", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds the results" in err and "--overwrite" in err
    assert (out / "results.json").read_text() == '{"earlier": true}'
    # --overwrite goes on to train (here: to the stand-in cluster), saying on stderr what it replaces
    with pytest.raises(Started):
        cli.main(["train", "--quick", "--out", str(out), "--overwrite"])
    assert "replacing the results of an earlier sweep" in capsys.readouterr().err


def test_train_accepts_a_folder_without_results(tmp_path, monkeypatch):
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)
    (tmp_path / "notes.txt").write_text("mine")  # other files are not an earlier sweep's
    with pytest.raises(Started):
        cli.main(["train", "--quick", "--out", str(tmp_path)])


def test_quick_train_has_its_own_default_folder(tmp_path, monkeypatch):
    # make run ARGS=--quick must not land on a full sweep's lta-train/
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lta-train").mkdir()
    (tmp_path / "lta-train" / "results.json").write_text("{}")
    with pytest.raises(Started):
        cli.main(["train", "--quick"])
    assert (tmp_path / "lta-train-quick").is_dir()
    assert cli.main(["train"]) == 2  # the full sweep's default folder holds results: refused


def test_simulated_train_log_results_header_and_drift_note(tmp_path):
    """Not on a terminal: each run is listed once on stderr, the 'wrote' line is one line however long,
    stdout has the table only, and results.json leads with the same header as --json documents."""
    out = tmp_path / ("a-folder-name-long-enough-that-the-wrote-line-runs-well-past-eighty-columns" * 2)
    cmd = [sys.executable, "-m", "lta", "train", "--quick", "--simulate-workers", "3", "--drops", "0,0.1"]
    cmd += ["--methods", "renorm", "--steps", "4", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    for name in ("lossless-s0", "renorm-p0.10-s0"):
        assert sum(name in line for line in lines) == 1, proc.stderr
    wrote = [line for line in lines if line.startswith("wrote ")]
    assert len(wrote) == 1
    names = ("results.json", "table.md", "loss_curves.png", "drift.png", "val_ppl_change.png")
    assert wrote[0] == "wrote " + ", ".join(str(out / n) for n in names)
    assert proc.stdout.startswith("# lta train") and "wrote " not in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == "lta.train/2"
    assert list(results)[:3] == ["schema", "lta_version", "torch_version"]
    table = (out / "table.md").read_text()
    assert "lets a stale copy lag one step only" in table and "2p/(1−p)²σ²" in table
    assert Path(out / "drift.png").read_bytes()[:4] == b"\x89PNG"


# ---- 6, 7, 9: daemons: status on stderr, JSON alone on stdout, Ctrl-C exits 130, port 0 accepted ------
# `python -m lta ARGV` with Ctrl-C raising KeyboardInterrupt, however the test process was started.
_AS_FOREGROUND = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('lta', run_name='__main__', alter_sys=True)"
)


def _daemon(*argv: str) -> subprocess.Popen:
    """The daemon as a terminal's foreground job starts it: with Ctrl-C's default action. A background
    job of a non-interactive shell (`make test &`, CI runners) inherits SIGINT ignored, and Python then
    leaves it ignored — rightly, the daemon keeps running there — which is not what these tests test.
    The handler is set by the child's own first line, not by a ``preexec_fn``: that forces a plain
    fork(), and once an earlier test has loaded gRPC, gRPC's fork handlers log into the child's stderr
    before exec (CI failed on such a line, where the status line was expected)."""
    cmd = [sys.executable, "-c", _AS_FOREGROUND, *argv]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _listening_port(proc: subprocess.Popen) -> int:
    line = proc.stderr.readline()
    assert "listening on 127.0.0.1:" in line, line
    return int(line.split("listening on 127.0.0.1:")[1].split()[0])


@pytest.mark.parametrize(
    "argv",
    [
        ("softswitch", "--listen", "127.0.0.1:0", "--stats-every", "0.1"),
        ("ps", "--listen", "127.0.0.1:0", "--job-id", "1", "--workers", "1", "--stats-every", "0.1"),
    ],
    ids=["softswitch", "ps"],
)
def test_daemon_on_port_0_keeps_stdout_for_json_and_exits_130_on_ctrl_c(argv):
    proc = _daemon(*argv)
    try:
        port = _listening_port(proc)  # the status line is on stderr, with the port the system chose
        assert 0 < port < 65536
        first = proc.stdout.readline()  # the first stats document: stdout's very first line
        assert isinstance(json.loads(first), dict)
        proc.send_signal(2)  # SIGINT, as Ctrl-C sends
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    for line in out.splitlines():
        json.loads(line)  # nothing but JSON documents: `| jq` reads them all
    assert "Traceback" not in err


def test_sharded_softswitch_refuses_port_0():
    proc = subprocess.run(
        [sys.executable, "-m", "lta", "softswitch", "--listen", "127.0.0.1:0", "--shards", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("lta softswitch: error: --shards N > 1 share one UDP port")


@pytest.mark.parametrize(
    "argv, prog",
    [
        (["ctl", "stats", "1"], "lta ctl stats"),
        (["ctl", "job", "ls", "extra"], "lta ctl job ls"),
        (["demo", "--bogus"], "lta demo"),
        (["--bogus"], "lta"),
    ],
)
def test_unrecognized_arguments_are_blamed_on_their_subcommand(argv, prog, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"{prog}: error: unrecognized arguments: {argv[-1]} (see {prog} --help)\n")


# ---- 7, 8: lta demo refuses what cannot work while parsing, before any process starts ------------------
@pytest.mark.parametrize("flag", ["--loss", "--down-loss"])
def test_demo_refuses_total_loss_at_parse_time(flag, monkeypatch, capsys):
    monkeypatch.setattr("lta.demo.run_job", _no_cluster)
    assert cli.main(["demo", flag, "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"lta demo: error: argument {flag}: loss must be in [0, 1)")
    assert cli.main(["bench", "allreduce", "--loss", "1"]) == 2  # as bench does
    assert "loss must be in [0, 1)" in capsys.readouterr().err


def test_demo_refuses_a_size_that_cannot_fit_before_starting(monkeypatch, capsys):
    from lta import demo

    monkeypatch.setattr("lta.demo.run_job", _no_cluster)
    monkeypatch.setattr(demo, "memory_available", lambda: 8 << 30)  # an 8 GiB machine
    # 4 workers x 256 MiB: each worker holds the 4 inputs it checks against and 4 arrays of its own,
    # 4 x 8 x 256 MiB = 8 GiB, plus the rest: does not fit
    assert cli.main(["demo", "--mib", "257"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lta demo: error: --mib 257 with 4 workers needs")
    assert "8.0 GiB is available" in err
    with pytest.raises(Started):  # 255 MiB fits: the demo goes on to start its workers
        cli.main(["demo", "--mib", "255"])
    monkeypatch.setattr(demo, "memory_available", lambda: None)  # unknown: no refusal
    with pytest.raises(Started):
        cli.main(["demo", "--mib", "100000"])


def test_demo_refuses_a_size_no_machine_has(capsys):
    # the case, on whatever machine runs the tests: 1e6 MiB x 4 workers x 8 copies is 30 TiB
    assert cli.main(["demo", "--mib", "1000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lower --mib or --workers" in err


# ---- 6: lta ctl liveness reports each event once ------------------------------------------------------
class _Counters:
    """A switch's per-worker packet counters and quorum, as LivenessMonitor reads and sets them."""

    def __init__(self, n: int) -> None:
        self.rx = [0] * n
        self.quorum: int | None = None

    def read_worker_rx(self, job_id: int, n_workers: int) -> list[int]:
        return list(self.rx)

    def set_quorum(self, job_id: int, quorum: int) -> None:
        self.quorum = quorum


@pytest.mark.parametrize("with_receiver", [True, False])
def test_liveness_event_is_reported_once(with_receiver, caplog):
    import logging

    from hostlib.liveness import LivenessMonitor

    now = [0.0]
    switch = _Counters(3)
    received = []
    monitor = LivenessMonitor(
        switch,
        1,
        3,
        timeout_s=1.0,
        clock=lambda: now[0],
        on_event=received.append if with_receiver else None,
    )
    caplog.set_level(logging.WARNING)
    now[0] = 0.5
    switch.rx = [1, 1, 0]
    monitor.poll()
    now[0] = 1.6  # worker 2 silent for 1.6 s > 1 s: offline, quorum 3 -> 2
    switch.rx = [2, 2, 0]
    events = monitor.poll()
    assert [(e.worker, e.state, e.quorum) for e in events] == [(2, "offline", 2)]
    assert switch.quorum == 2
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if with_receiver:  # lta ctl liveness prints it (stdout): the log must not say it again on stderr
        assert received == events and warnings == []
    else:  # nobody else reports it: the log does, once
        assert len(warnings) == 1 and "offline" in warnings[0].getMessage()


# ---- 9: help and messages ------------------------------------------------------------------------------
def _commands(parser, path=()):
    import argparse

    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def test_no_help_page_shows_restructuredtext(capsys):
    pages = 0
    for path in _commands(cli.build_parser()):
        assert cli.main([*path, "--help"]) == 0
        out = capsys.readouterr().out
        assert "``" not in out, f"lta {' '.join(path)} --help"
        pages += 1
    assert pages > 20  # every subcommand and sub-subcommand was visited


def test_ctl_help_sentences_are_whole_and_say_jobs_file(capsys):
    assert cli.main(["ctl", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "lower the quorum while they are; restore it when they send again" in text
    assert "lower the job's quorum while they are offline" in text
    assert cli.main(["ctl", "apply", "/nonexistent/jobs.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lta ctl apply: error: no jobs file /nonexistent/jobs.toml; see `lta ctl apply")
    assert err.count("\n") == 1


def test_bmv2_absence_points_at_building_from_source(monkeypatch):
    import shutil

    from controlplane.bmv2 import bmv2_missing

    monkeypatch.setattr(shutil, "which", lambda name: None)  # a machine without BMv2
    reason = bmv2_missing()
    assert "p4lang's sources" in reason and "README" in reason and "package" not in reason


# ---- 3: stock code against a running softswitch: the health error names LTA_BIND_PORT_BASE -------------
def _join_external(switch_address, bind_port_base: int):
    from datetime import timedelta

    import torch.distributed as dist

    from hostlib.torch_ext.rendezvous import LtaOptions, join_job
    from hostlib.transport import TransportConfig

    options = LtaOptions(
        switch=switch_address,
        bind_port_base=bind_port_base,
        transport=TransportConfig(elems_per_packet=64, health_timeout_s=0.5),
    )
    return join_job(dist.HashStore(), 0, 1, options, timeout=timedelta(seconds=10))


def test_health_error_with_a_random_worker_port_says_how_to_fix_it():
    from hostlib.errors import HealthCheckError
    from softswitch.pipeline import JobConfig, SoftSwitch
    from softswitch.server import SoftSwitchServer

    switch = SoftSwitch()
    server = SoftSwitchServer(switch).start()
    try:
        # a jobs file's guess at worker 0's address, which a random bind cannot match
        switch.add_job(JobConfig(1, [("127.0.0.1", 1)], elems_per_packet=64))
        with pytest.raises(HealthCheckError) as info:
            _join_external(server.address, 0)
        message = str(info.value)
        assert "did not answer" in message and "LTA_BIND_PORT_BASE=B" in message
        assert "docs/jobs_file.md" in message
        # with fixed ports the address is the user's own choice: no advice about random ports
        with pytest.raises(HealthCheckError) as info:
            _join_external(server.address, _free_udp_port())
        assert "did not answer" in str(info.value) and "LTA_BIND_PORT_BASE=B" not in str(info.value)
    finally:
        server.stop()


def _free_udp_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- 5: lta ps --config: the jobs file's layout, reader and messages -------------------------------------
REPO = Path(__file__).resolve().parents[1]


def test_documented_parameter_server_file_parses(tmp_path):
    import re

    from softswitch.ps.config import load_ps_config

    doc = (REPO / "docs" / "jobs_file.md").read_text()
    section = doc.split("## Parameter-server jobs", 1)[1]
    (block,) = re.findall(r"```toml\n(.*?)```", section, re.S)
    (tmp_path / "ps.toml").write_text(block)
    seed, (job,) = load_ps_config(tmp_path / "ps.toml")
    assert seed == 0 and job.job_id == 1 and job.n_workers == 4 and job.rule == "trimmed_mean"
    assert (job.lr, job.momentum, job.window, job.f, job.trim_ratio) == (0.05, 0.9, 4, 1, 0.25)
    assert job.staleness.adaptive and job.staleness.max_staleness == 5
    (drop,) = job.drops
    assert (drop.direction, drop.policy.p, drop.worker) == ("up", 0.1, 0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[jbos]]\njob_id = 1\nworkers = 2\n", "unknown table [[jbos]] (did you mean [[jobs]]?)"),
        (
            "[[jobs]]\njob_id = 1\nworkers = 2\n[[jobs.dorp]]\np = 0.1\n",
            "jobs[0]: unknown table [[jobs.dorp]] (did you mean [[jobs.drop]]?)",
        ),
        ("[[jobs]]\njob_id = 1\nworkers = 2\nmdoe = 'sync'\n", "unknown key 'mdoe' (did you mean 'mode'?)"),
        (
            "[[jobs]]\njob_id = 1\nworkers = 2\nquorum = 1\n",
            "jobs[0]: 'quorum' belongs to the switch's jobs file (lta softswitch, lta ctl apply)",
        ),
        (
            "[[switches]]\nname = 's1'\n[[jobs]]\njob_id = 1\nworkers = 2\n",
            "the top level: 'switches' belongs to the switch's jobs file",
        ),
        (
            "[[jobs]]\njob_id = 1\nworkers = 2\n[[jobs.drop]]\ndirection = 'param'\np = 0.1\n",
            "jobs[0].drop[0]: direction must be one of up, down for a parameter server",
        ),
        (
            "[[jobs]]\njob_id = 1\nworkers = 2\n[[jobs.drop]]\ndirection = 'up'\np = 1.5\n",
            "jobs[0].drop[0]: p must be a probability in [0, 1], got 1.5",  # the jobs file's words
        ),
        ("[[jobs]]\njob_id = 1\nworkers = 2\nlr = 'fast'\n", 'jobs[0]: lr must be a number, got "fast"'),
    ],
)
def test_ps_config_errors_are_the_jobs_files(tmp_path, text, message, capsys):
    path = tmp_path / "ps.toml"
    path.write_text(text)
    assert cli.main(["ps", "--config", str(path)]) == 2  # a bad jobs file is refused like a bad flag
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"lta ps: error: {path}: ")
    assert message in err, err


# ---- 7: exit codes as the README states them --------------------------------------------------------
def test_malformed_jobs_file_exits_2_before_serving(tmp_path, capsys):
    bad = tmp_path / "jobs.toml"
    bad.write_text("[[jobs]]\njob_id = 1\nquroum = 2\nworkers = ['127.0.0.1:41000']\n")
    assert cli.main(["softswitch", "--listen", "127.0.0.1:0", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'quroum' (did you mean 'quorum'?)" in err
    assert "listening" not in err  # refused before binding anything


def test_a_sweep_stopped_on_purpose_does_not_need_an_empty_out(tmp_path, monkeypatch):
    # --stop-after writes checkpoints, never results: an --out holding results is no reason to refuse
    monkeypatch.setattr("lta.train.sweep.LocalCluster", _no_cluster)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")
    argv = ["train", "--quick", "--out", str(out), "--checkpoint-dir", str(tmp_path / "ck")]
    with pytest.raises(Started):
        cli.main([*argv, "--checkpoint-every", "5", "--stop-after", "10"])
    assert (out / "results.json").read_text() == "{}"
