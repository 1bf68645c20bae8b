"""Issue 42, item 4: the inputs that raised tracebacks end in one line on stderr and a non-zero exit;
every LTA_* variable's error names the variable and what it accepts; "port in use" has one exit status;
a collective that sent nothing reports no loss."""

from __future__ import annotations

import socket
import subprocess
import sys
from unittest import mock

import pytest

from hostlib.errors import AddressInUseError
from hostlib.torch_ext.rendezvous import LtaOptions

LTA = [sys.executable, "-m", "lta"]


def _lta(args: list[str], stdout=subprocess.PIPE) -> subprocess.CompletedProcess:  # noqa: ANN001
    return subprocess.run([*LTA, *args], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)


def _one_line(out: subprocess.CompletedProcess, code: int) -> str:
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, out.stderr
    return errors[0]


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--mib", "inf"],
        ["bench", "allreduce", "--mib", "inf"],
        ["demo", "--mib", "nan"],
    ],
)
def test_an_infinite_size_is_a_usage_error(args):
    line = _one_line(_lta(args), 2)
    assert "--mib" in line


def test_a_size_beyond_memory_is_refused_before_any_worker_starts():
    line = _one_line(_lta(["bench", "allreduce", "--mib", "100000", "--workers", "2"]), 2)
    assert "GiB" in line and "lower --mib" in line


def test_json_to_a_full_device_is_one_line():
    with open("/dev/full", "w") as full:
        out = _lta(
            ["demo", "--workers", "1", "--rounds", "1", "--mib", "0.01", "--loss", "0", "--json"], stdout=full
        )
    line = _one_line(out, 1)
    assert "cannot write the JSON document" in line


@pytest.mark.parametrize("out_dir", ["/sys/lta-chaos-test", "/proc/self"])
def test_chaos_out_that_cannot_be_written_fails_before_any_run(out_dir):
    line = _one_line(_lta(["chaos", "--seeds", "0", "--out", out_dir, "--no-netns"]), 1)
    assert out_dir in line


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        ("LTA_SWITCH", "junk", "HOST:PORT"),
        ("LTA_DROP_UP", "1.5", "[0, 1)"),
        ("LTA_DROP_UP", "abc", "[0, 1)"),
        ("LTA_DROP_DOWN", "-0.1", "[0, 1)"),
        ("LTA_DROP_PARAM", "inf", "[0, 1)"),
        ("LTA_FALLBACK", "last", "prev, zero, local"),
        ("LTA_RENORMALIZE", "mean", "count, weight, none"),
        ("LTA_ON_UNHEALTHY", "panic", "raise, warn, ignore"),
        ("LTA_JOB_ID", "64", "1..63"),
        ("LTA_JOB_ID", "one", "1..63"),
        ("LTA_ELEMS_PER_PACKET", "0", "1..16367"),
        ("LTA_POOL_SIZE", "1", "2..65535"),
        ("LTA_BIND_PORT_BASE", "70000", "0..65535"),
        ("LTA_HEALTH_TIMEOUT", "-1", "[0, inf)"),
        ("LTA_EXACT_MS", "x", "[0, inf)"),
        ("LTA_SEED", "1.5", "integer"),
        ("LTA_STALE_BOUND", "0", ">= 1"),
        ("LTA_LIVENESS_TIMEOUT", "soon", "[0, inf)"),
        ("LTA_SWITCH_SOCKETS", "65", "0..64"),
        ("LTA_LOSSY_OPS", "broadcast", "allreduce"),
    ],
)
def test_every_variable_error_names_the_variable_and_what_it_accepts(name, value, accepted):
    with pytest.raises(ValueError) as info:
        LtaOptions.from_env({name: value})
    message = str(info.value)
    assert name in message and accepted in message and "\n" not in message


def test_good_variables_still_read():
    opts = LtaOptions.from_env(
        {"LTA_SWITCH": "10.0.0.1:48879", "LTA_DROP_UP": "", "LTA_JOB_ID": "5", "LTA_FALLBACK": "zero"}
    )
    assert opts.switch == ("10.0.0.1", 48879) and opts.job_id == 5 and opts.transport.fallback == "zero"
    assert opts.drop == {}


def test_port_in_use_is_exit_1_for_listen_and_metrics_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
        udp.bind(("127.0.0.1", 0))
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        listen = _one_line(_lta(["softswitch", "--listen", f"127.0.0.1:{udp.getsockname()[1]}"]), 1)
        assert "in use" in listen
        metrics = _lta(
            ["train", "--quick", "--metrics-port", str(tcp.getsockname()[1]), "--out", "/tmp/lta-z-none"]
        )
        line = _one_line(metrics, AddressInUseError.exit_code)
        assert "metrics" in line and "in use" in line


def test_a_lossy_all_gather_that_never_ran_reports_no_loss():
    from hostlib.torch_ext.manager import LtaManager
    from hostlib.transport import LtaWorker, TransportConfig, TransportStats

    worker = mock.create_autospec(LtaWorker, instance=True)
    worker.n_workers, worker.worker_id = 2, 0
    worker.config = TransportConfig(elems_per_packet=8)
    worker.stats = TransportStats()
    manager = LtaManager(worker)
    manager.gatherer()  # made (FSDP2 asks for it), never called: 0 chunks expected
    row = manager.collective_stats(("all_gather",))["all_gather"]
    assert row["chunks"] == 0 and row["loss_seen"] == 0.0


def test_chaos_shows_a_start_line_and_one_line_per_run_on_stderr(tmp_path, capsys, monkeypatch):
    """The runs themselves are replaced (each takes a minute); what is checked is what the user sees."""
    from lta import cli
    from lta.chaos import cli as chaos_cli
    from lta.chaos.runner import Outcome

    monkeypatch.setattr(chaos_cli, "run_one", lambda spec, bound, keep: Outcome(spec, "ok", "fine", 1.0))
    assert cli.main(["chaos", "--seeds", "3,4", "--out", str(tmp_path), "--no-netns"]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert err[0].startswith("lta chaos: 2 runs (seeds 3..4)")
    runs = [line for line in err if line.startswith("seed ")]
    assert [line.split()[1] for line in runs] == ["3", "4"] and all(" ok " in line for line in runs)
    out = captured.out.strip().splitlines()  # the door x fault kind table, then the counts
    assert out[-1] == "ok=2 ok-after-restart=0 loud=0 hang=0 silent=0"
    assert any("door" in line and "fault" in line for line in out[:-1])
