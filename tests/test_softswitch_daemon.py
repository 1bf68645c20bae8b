"""`lta softswitch --config FILE` as a separate process: workers reduce through it over UDP."""

from __future__ import annotations

import socket
import subprocess
import sys

import numpy as np
import pytest

from hostlib.transport import LtaWorker, TransportConfig
from softswitch.config import load_switch
from tests.conftest import run_workers


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(switch_port: int, *args: str) -> subprocess.Popen:
    """`lta softswitch` in its own process, listening on 127.0.0.1:switch_port."""
    argv = [sys.executable, "-m", "lta.cli", "softswitch", "--listen", f"127.0.0.1:{switch_port}", *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def test_daemon_from_config_file_aggregates(tmp_path):
    ports = [free_udp_port() for _ in range(3)]
    switch_port = free_udp_port()
    cfg = tmp_path / "switch.toml"
    cfg.write_text(
        f"seed = 3\n[[jobs]]\njob_id = 5\nworkers = {[f'127.0.0.1:{p}' for p in ports]!r}\n".replace("'", '"')
        + '[[jobs.drop]]\ndirection = "down"\nmodel = "bernoulli"\np = 0.0\n'
    )
    proc = start_daemon(switch_port, "--config", str(cfg))
    try:
        assert "listening" in proc.stdout.readline()
        config = TransportConfig(sync_deadline_ms=1000)
        workers = [
            LtaWorker(5, w, 3, ("127.0.0.1", switch_port), config=config, bind=("127.0.0.1", p))
            for w, p in enumerate(ports)
        ]
        x = [np.full(1000, float(w), np.float32) for w in range(3)]
        results = run_workers(workers, lambda w, i: w.allreduce(x[i]))
        for r in results:
            assert np.all(r.count == 3) and np.allclose(r.values, 1.0)
        for w in workers:
            w.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_config_errors_name_the_file_and_entry(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[jobs]]\njob_id = 1\nworkers = ["127.0.0.1"]\n')
    with pytest.raises(ValueError, match=r"bad.toml: jobs\[0\].*HOST:PORT"):
        load_switch(bad)
    missing = tmp_path / "nope.toml"
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_switch(missing)
    bad.write_text("[[jobs]]\nworkers = []\n")
    with pytest.raises(ValueError, match="missing key 'job_id'"):
        load_switch(bad)


def test_daemon_configured_over_p4runtime_by_the_control_plane():
    """`lta softswitch --p4runtime`: `lta ctl`'s code path adds a job with UDP worker addresses, then
    workers reduce through the daemon."""
    from controlplane.jobs import JobSpec, WorkerSpec
    from controlplane.switch import LtaSwitch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        p4rt_port = s.getsockname()[1]
    switch_port = free_udp_port()
    proc = start_daemon(switch_port, "--p4runtime", f"127.0.0.1:{p4rt_port}")
    try:
        assert "listening" in proc.stdout.readline()
        assert "P4Runtime" in proc.stdout.readline()
        config = TransportConfig(sync_deadline_ms=1000)
        workers = [LtaWorker(2, w, 2, ("127.0.0.1", switch_port), config=config) for w in range(2)]
        with LtaSwitch.connect(f"127.0.0.1:{p4rt_port}") as ctl:
            ctl.load_pipeline()
            specs = tuple(
                WorkerSpec(w + 1, ip="127.0.0.1", udp_port=wk.address[1]) for w, wk in enumerate(workers)
            )
            ctl.add_job(JobSpec(2, specs))
            x = [np.full(300, 2.0, np.float32), np.full(300, 4.0, np.float32)]
            results = run_workers(workers, lambda w, i: w.allreduce(x[i]))
            assert all(np.all(r.count == 2) and np.allclose(r.values, 3.0) for r in results)
            assert ctl.read_counters(2)[2]["result_quorum"] > 0
        for w in workers:
            w.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
