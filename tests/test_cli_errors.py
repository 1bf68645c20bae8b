"""The ``lta`` command's one error front, its ``--json`` documents and ``--version``.

The convention checked here (documented in lta/cliparse.py and lta/cli.py):

- a bad command line: exactly one line on stderr, ``lta <command>: error: argument <flag>: <why>
  (see lta <command> --help)``, nothing on stdout, exit status 2, and nothing started;
- a user error found later (:class:`hostlib.errors.LtaError`): one line ``lta <command>: error:
  <message>``, the error's exit status (2 for a usage error, 1 otherwise);
- Ctrl-C: nothing printed, exit status 130; a closed stdout: nothing printed, exit status 141.

Bad inputs run in-process through ``lta.cli.main`` with process creation made to fail, so a case that
started anything would fail loudly.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing.process
import os
import pty
import re
import select
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from hostlib.errors import ConfigError, HealthCheckError, UsageError
from hostlib.protocol import MAX_ELEMS_PER_PACKET
from lta import cli, demo, jsonout
from lta.launch import JobSpec, run_job
from lta.progress import level_from

REPO = Path(__file__).resolve().parents[1]
ONE_LINE_ERROR = re.compile(r"^lta [a-z -]+: error: argument (?P<flags>\S+): .+ \(see lta [a-z -]+ --help\)$")

# (command line, the flag the message must name)
BAD_INPUTS = [
    (["demo", "--workers", "0"], "--workers"),
    (["demo", "--workers", "65"], "--workers"),
    (["demo", "--workers", "two"], "--workers"),
    (["demo", "--mib", "-1"], "--mib"),
    (["demo", "--mib", "0"], "--mib"),
    (["demo", "--mib", "nan"], "--mib"),
    (["demo", "--rounds", "0"], "--rounds"),
    (["demo", "--loss", "1.5"], "--loss"),
    (["demo", "--loss", "-0.1"], "--loss"),
    (["demo", "--down-loss", "2"], "--down-loss"),
    (["demo", "--elems-per-packet", "0"], "--elems-per-packet"),
    (["demo", "--elems-per-packet", str(MAX_ELEMS_PER_PACKET + 1)], "--elems-per-packet"),
    (["demo", "--fallback", "none"], "--fallback"),
    (["demo", "--seed", "-1"], "--seed"),
    (["bench", "allreduce", "--workers", "0"], "--workers"),
    (["bench", "allreduce", "--workers", "2,65"], "--workers"),
    (["bench", "allreduce", "--mib", "0"], "--mib"),
    (["bench", "allreduce", "--mib", "4,-1"], "--mib"),
    (["bench", "allreduce", "--iters", "0"], "--iters"),
    (["bench", "allreduce", "--warmup", "-1"], "--warmup"),
    (["bench", "allreduce", "--loss", "1"], "--loss"),
    (["bench", "allreduce", "--io", "bogus"], "--io"),
    (["bench", "ddp", "--workers", "0"], "--workers"),
    (["bench", "ddp", "--workers", "65"], "--workers"),
    (["bench", "ddp", "--steps", "0"], "--steps"),
    (["bench", "ddp", "--warmup", "-2"], "--warmup"),
    (["bench", "fsdp", "--workers", "0"], "--workers"),
    (["bench", "fsdp", "--loss", "1.5"], "--loss"),
    (["bench", "fsdp", "--stale-bound", "0"], "--stale-bound"),
    (["bench", "scaling", "--workers", "0"], "--workers"),
    (["bench", "scaling", "--sim-workers", "16,0"], "--sim-workers"),
    (["bench", "scaling", "--kib", "0"], "--kib"),
    (["bench", "scaling", "--loss", "2"], "--loss"),
    (["bench", "scaling", "--iters", "0"], "--iters"),
    (["bench", "scaling", "--elems-per-packet", "0"], "--elems-per-packet"),
    (["bench", "lossy", "--workers", "0"], "--workers"),
    (["bench", "lossy", "--mib", "0"], "--mib"),
    (["bench", "lossy", "--loss", "0,1.5"], "--loss"),
    (["bench", "lossy", "--rate", "0"], "--rate"),
    (["bench", "lossy", "--rate", "fast"], "--rate"),
    (["bench", "lossy", "--iters", "0"], "--iters"),
    (["bench", "lossy", "--mtu", "10"], "--mtu"),
    (["bench", "lossy", "--window", "0"], "--window"),
    (["bench", "lossy", "--min-deadline-ms", "0"], "--min-deadline-ms"),
    (["bench", "lossy", "--systems", "tcp"], "--systems"),
    (["bench", "lossy-train", "--workers", "65"], "--workers"),
    (["bench", "lossy-train", "--loss", "0,2"], "--loss"),
    (["bench", "lossy-train", "--rate-mbit", "0"], "--rate-mbit"),
    (["bench", "lossy-train", "--steps", "0"], "--steps"),
    (["bench", "lossy-train", "--lr", "-1"], "--lr"),
    (["bench", "lossy-train", "--rebroadcast-every", "-1"], "--rebroadcast-every"),
    (["train", "--workers", "2"], "--workers"),
    (["train", "--workers", "65"], "--workers"),
    (["train", "--drops", "1"], "--drops"),
    (["train", "--methods", "mean"], "--methods"),
    (["train", "--seeds", "x"], "--seeds"),
    (["train", "--steps", "0"], "--steps"),
    (["train", "--stale-bound", "-1"], "--stale-bound"),
    (["mininet", "--hosts", "0"], "--hosts"),
    (["mininet", "--loss", "2"], "--loss"),
    (["mininet", "--rate-mbit", "-1"], "--rate-mbit"),
    (["mininet", "--rounds", "0"], "--rounds"),
    (["mininet", "--elems", "0"], "--elems"),
    (["mininet", "--timeout", "0"], "--timeout"),
    (["mininet", "--topo", "ring"], "--topo"),
    # the same front for the switch and the control plane (their flags are theirs, the parser is shared)
    (["softswitch", "--listen", "127.0.0.1:99999"], "--listen"),
    (["softswitch", "--stats-every", "-1"], "--stats-every"),
    (["ctl", "--timeout", "-1", "stats"], "--timeout"),
]


@pytest.fixture
def nothing_starts(monkeypatch):
    """Any process start (multiprocessing or subprocess) fails the test."""

    def started(*args, **kwargs):
        raise AssertionError("a process was started for a bad command line")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", started)
    monkeypatch.setattr(subprocess.Popen, "__init__", started)


@pytest.mark.parametrize("argv, flag", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_starts_nothing(argv, flag, nothing_starts, capsys):
    assert cli.main(argv) == 2  # refused before anything starts (the fixture fails any process start)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    match = ONE_LINE_ERROR.match(lines[0])
    assert match, lines[0]
    assert flag in match["flags"].split("/"), lines[0]
    command = []
    for word in argv:
        if word.startswith("-"):
            break
        command.append(word)
    assert lines[0].startswith(f"lta {' '.join(command)}: error: "), lines[0]
    assert "Traceback" not in captured.err


def test_bad_command_line_from_a_shell_is_one_line(tmp_path):
    # the installed entry point, as a user runs it: demo --workers 0 used to "succeed" with no workers
    lta = REPO / ".venv" / "bin" / "lta"
    if not lta.exists():
        pytest.skip("no .venv/bin/lta (the project is not installed in .venv)")
    done = subprocess.run([str(lta), "demo", "--workers", "0"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        "lta demo: error: argument --workers: worker count must be 1..64, got 0 (see lta demo --help)\n"
    )


def test_a_missing_subcommand_is_one_line(capsys):
    assert cli.main(["bench"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("lta bench: error: ") and "BENCH" in line


# ---- errors found after parsing ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "error, status",
    [
        (UsageError("bench allreduce --io: mmsg-c is not available here"), 2),
        (ConfigError("jobs.toml: unknown key 'quroum' in [[jobs]]"), 2),
        (HealthCheckError("switch at 127.0.0.1:9 did not answer\nwithin 2 s: is it running?"), 1),
    ],
)
def test_user_errors_are_one_line_with_their_exit_status(error, status, monkeypatch, capsys):
    def fails(args: argparse.Namespace) -> int:
        raise error

    monkeypatch.setattr(demo, "run", fails)  # register() binds lta.demo.run when main builds the parser
    assert cli.main(["demo"]) == status
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "lta demo: error: " + " ".join(str(error).split()) + "\n"


def test_ctrl_c_is_quiet_and_exits_130(monkeypatch, capsys):
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run", interrupted)
    assert cli.main(["demo"]) == 130
    assert capsys.readouterr() == ("", "")


def test_a_bug_keeps_its_traceback(monkeypatch):
    def buggy(args: argparse.Namespace) -> int:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(demo, "run", buggy)
    with pytest.raises(ZeroDivisionError):
        cli.main(["demo"])


def fail_in_worker(worker, rank: int) -> None:
    """A job body (module level: spawned workers import it) that hits a user error on rank 1."""
    if rank == 1:
        raise HealthCheckError("the switch does not know this job")
    return None


def test_a_user_error_in_a_worker_reaches_the_parent_as_itself():
    with pytest.raises(HealthCheckError) as exc:
        run_job(JobSpec(n_workers=2, timeout_s=60), fail_in_worker)
    assert str(exc.value) == "worker 1: the switch does not know this job"


def test_closed_stdout_is_quiet_and_exits_141():
    argv = [
        sys.executable,
        "-m",
        "lta.cli",
        "demo",
        "--workers",
        "2",
        "--mib",
        "0.01",
        "--rounds",
        "1",
        "--json",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the document is written
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert err.splitlines() == [
        "lta demo: 2 workers, 0.01 MiB x 1 rounds, up loss 10%, down loss 0%, fallback prev"
    ]


# ---- --json and --version ------------------------------------------------------------------------------
def test_demo_json_is_one_document_with_schema_and_versions():
    argv = [
        sys.executable,
        "-m",
        "lta.cli",
        "demo",
        "--workers",
        "2",
        "--mib",
        "0.01",
        "--rounds",
        "2",
        "--json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)  # all of stdout is one JSON document
    assert doc["schema"] == "lta.demo/1"
    assert doc["lta_version"] == metadata.version("lta")
    assert doc["torch_version"] == metadata.version("torch")
    assert doc["exact"] is True and len(doc["workers"]) == 2
    # 0.01 MiB = 2621 float32 in chunks of 64: 41 chunks per reduce, 2 reduces, on every worker
    assert all(w["stats"]["chunks"] == 2 * 41 for w in doc["workers"])
    # stderr is not a terminal here: the start line, and nothing else
    assert done.stderr.splitlines() == [
        "lta demo: 2 workers, 0.01 MiB x 2 rounds, up loss 10%, down loss 0%, fallback prev"
    ]


def test_on_a_terminal_progress_shows_while_it_runs_and_stdout_stays_clean():
    """stderr on a pseudo-terminal (as a user at a shell has it), stdout on a pipe. Progress is live: the
    start line reaches the terminal before the workers start, not in one piece when the run ends."""
    master, slave = pty.openpty()
    argv = [sys.executable, "-m", "lta.cli", "demo", "--workers", "2", "--mib", "0.05", "--rounds", "3"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, cwd=REPO)
    os.close(slave)
    seen, first_chunk = b"", None
    try:
        while select.select([master], [], [], 60)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the process closed its end
                break
            if not chunk:
                break
            if first_chunk is None:
                first_chunk = chunk
            seen += chunk
    finally:
        os.close(master)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, seen[-2000:]
    # The first read returned as soon as anything was on the terminal: the start line, written before
    # the worker processes start, so it cannot already hold their progress.
    assert first_chunk is not None and first_chunk.startswith(b"lta demo: 2 workers")
    assert b"round 1/3 done" not in first_chunk and b"round 3/3 done" not in first_chunk
    text = seen.decode(errors="replace")
    assert text.startswith("lta demo: 2 workers, 0.05 MiB x 3 rounds")
    assert "starting 2 worker processes" in text and "round 3/3 done" in text  # the live line
    table = out.decode()
    assert "every chunk equals the mean over its bitmap" in table and "\x1b[" not in table


def test_json_header_says_null_without_torch(monkeypatch):
    monkeypatch.setattr(jsonout, "package_version", lambda name: None if name == "torch" else "9.9.9")
    doc = jsonout.document("lta.bench.ddp/1", {"rows": [1, 2]})
    assert doc == {"schema": "lta.bench.ddp/1", "lta_version": "9.9.9", "torch_version": None, "rows": [1, 2]}
    assert "torch not installed" in jsonout.version_line()
    with pytest.raises(ValueError, match="schema"):
        jsonout.document("lta.demo/1", {"schema": "mine"})


def test_version_names_lta_torch_and_numpy(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    expected = (
        f"lta {metadata.version('lta')} (torch {metadata.version('torch')}, "
        f"numpy {metadata.version('numpy')}, python {sys.version.split()[0]})\n"
    )
    assert out == expected


def test_version_does_not_import_torch():
    code = "import sys; from lta.cli import main; main(['--version']); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False"


# ---- help -----------------------------------------------------------------------------------------------
OWN_COMMANDS = ("train", "demo", "bench", "mininet")


def _options(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif action.option_strings:
            yield path, action


def test_every_flag_of_train_demo_bench_and_mininet_has_help():
    missing = [
        (" ".join(path), action.option_strings)
        for path, action in _options(cli.build_parser(), ("lta",))
        if len(path) > 1 and path[1] in OWN_COMMANDS and not action.help
    ]
    assert missing == []


def test_help_shows_defaults_and_no_rst_markup(capsys):
    assert cli.main(["train", "--help"]) == 0
    raw = capsys.readouterr().out
    assert "``" not in raw
    text = " ".join(raw.split())
    assert "(default: 4)" in text and "(default: 0,0.1,0.2,0.3,0.4)" in text
    assert cli.main(["demo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "worker processes, 1..64 (default: 4)" in text
    assert "drop probability of GRAD packets (up), [0, 1) (default: 0.1)" in text


# ---- logging ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "verbose, quiet, env, level",
    [
        (0, 0, None, logging.WARNING),
        (1, 0, None, logging.INFO),
        (2, 0, None, logging.DEBUG),
        (5, 0, None, logging.DEBUG),
        (0, 1, None, logging.ERROR),
        (0, 0, "debug", logging.DEBUG),
        (0, 0, "INFO", logging.INFO),
        (0, 0, "40", 40),
        (1, 0, "error", logging.INFO),  # the flag wins over the variable
    ],
)
def test_log_level_from_flags_and_environment(verbose, quiet, env, level):
    assert level_from(verbose, quiet, env) == level


def test_bad_lta_log_is_one_line(monkeypatch, capsys, nothing_starts):
    monkeypatch.setenv("LTA_LOG", "loud")
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == (
        "lta: error: LTA_LOG='loud' is not a log level: use debug, info, warning or error\n"
    )


_VERBOSE_SCRIPT = """
import logging, sys
from lta import cli, demo

def logs(args):
    logging.getLogger("lta.test").info("a diagnostic")
    logging.getLogger("lta.test").debug("a detail")
    print("the result")
    return 0

demo.run = logs
sys.exit(cli.main([sys.argv[1], "demo"]))
"""


def test_verbose_logs_go_to_stderr(monkeypatch, capsys):
    # In a process of its own: the root logger is global state that other tests in a full run touch.
    for flag, err in (("-v", "INFO lta.test: a diagnostic\n"), ("-q", "")):
        done = subprocess.run(
            [sys.executable, "-c", _VERBOSE_SCRIPT, flag], capture_output=True, text=True, timeout=60
        )
        assert (done.returncode, done.stdout, done.stderr) == (0, "the result\n", err), flag

    def logs(args: argparse.Namespace) -> int:
        logging.getLogger("lta.test").info("a diagnostic")
        print("the result")
        return 0

    monkeypatch.setattr(demo, "run", logs)
    assert cli.main(["-q", "demo"]) == 0
    assert capsys.readouterr().err == ""
