"""``lta train --dp-sigma/--dp-clip`` and ``--metrics-port``: flags checked before anything starts, ε in
results.json equal to the accountant's own value, per-worker telemetry live at the endpoints."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from lta import cli

STEPS_TOTAL = re.compile(r'^lta_steps_total\{job="([^"]*)",worker="0"\} (\S+)$', re.M)


def free_port_block(count: int) -> int:
    """A first port whose next ``count`` ports are free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65535:
            continue
        probes = []
        try:
            for port in range(first, first + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError("no block of free ports")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dp-sigma", "1"], "--dp-sigma and --dp-clip go together"),
        (["--dp-clip", "1"], "--dp-sigma and --dp-clip go together"),
        (["--dp-sigma", "0", "--dp-clip", "1"], "DP noise multiplier must be in (0.0, inf)"),
        (["--dp-sigma", "1", "--dp-clip", "-2"], "DP clipping norm must be in (0.0, inf)"),
        (["--dp-sigma", "1", "--dp-clip", "1", "--dp-delta", "0"], "DP delta must be in (0.0, 1.0]"),
        (["--metrics-port", "70000"], "port must be 1..65535"),
        (["--metrics-port", "65534"], "passes port 65535"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(capsys, tmp_path, argv, message):
    assert cli.main(["train", "--quick", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "results.json").exists()


def test_busy_metrics_port_is_refused_before_training(capsys, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # a port in use exits 1, as lta softswitch --listen does
        assert cli.main(["train", "--quick", "--workers", "3", "--metrics-port", str(port - 1),
                         "--out", str(tmp_path)]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert f"cannot serve metrics on 127.0.0.1:{port} (worker 1)" in err and len(err.splitlines()) == 1


def test_dp_run_reports_epsilon_and_serves_telemetry(tmp_path):
    dpa = pytest.importorskip("dp_accounting", reason="needs the dp extra: pip install 'lta[dp]'")
    from dp_accounting import rdp

    steps, workers = 12, 3
    port = free_port_block(workers)
    argv = [sys.executable, "-m", "lta.cli", "train", "--quick", "--workers", str(workers), "--drops", "0.3",
            "--methods", "renorm", "--steps", str(steps), "--dp-sigma", "1", "--dp-clip", "1",
            "--dp-delta", "1e-6", "--metrics-port", str(port), "--json", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:  # scrape worker 0 while it trains
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                seen.update({job: float(v) for job, v in STEPS_TOTAL.findall(response.read().decode())})
        except OSError:
            pass  # not listening yet, or already gone
        time.sleep(0.2)
    stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert proc.returncode == 0, stderr[-3000:]
    assert seen and max(seen.values()) >= 1, "no scrape of worker 0 saw a recorded step"
    assert set(seen) <= {"lossless-s0", "renorm-p0.30-s0"}

    results = json.loads((tmp_path / "results.json").read_text())
    acc = rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.0), steps))
    privacy = results["privacy"]
    assert privacy["epsilon"] == pytest.approx(acc.get_epsilon(1e-6), rel=1e-9)
    assert (privacy["sigma"], privacy["clip"], privacy["delta"], privacy["steps"]) == (1.0, 1.0, 1e-6, steps)
    assert f"privacy: epsilon {privacy['epsilon']:.3f}" in stderr
    assert json.loads(stdout)["schema"] == "lta.train/2"
    for run in results["runs"]:
        for worker in run["workers"]:
            assert worker["privacy"]["clips"] == steps
            totals = worker["telemetry"]["totals"]
            assert totals["steps"] == steps and totals["tokens"] == steps * 8 * 32  # batch × context
            assert totals["chunks"] == worker["transport"]["chunks"]  # every reduce is a training step's
    lossy = next(r for r in results["runs"] if r["drop"] > 0)
    assert lossy["workers"][0]["telemetry"]["totals"]["chunks_partial"] > 0
