"""`lta softswitch --config FILE` as a separate process: workers reduce through it over UDP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pytest

from hostlib.errors import ConfigError
from hostlib.jobconfig import DEFAULT_POOL_SIZE
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
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
        assert "listening" in proc.stderr.readline()
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
    with pytest.raises(ConfigError, match=r"bad.toml: jobs\[0\] \(job_id 1\).workers\[0\]: .*HOST:PORT"):
        load_switch(bad)
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml does not exist"):
        load_switch(missing)
    bad.write_text("[[jobs]]\nworkers = []\n")
    with pytest.raises(ConfigError, match=r"bad.toml: jobs\[0\]: job_id = N is missing"):
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
        assert "listening" in proc.stderr.readline()
        assert "P4Runtime" in proc.stderr.readline()
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


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def lta_softswitch(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "lta.cli", "softswitch", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_p4runtime_softswitch_serves_its_config_jobs_to_ctl(tmp_path, capsys):
    """`--config` with `--p4runtime`: the pipeline is loaded and the file's jobs are table entries that
    `lta ctl` lists, counts, resets and removes; `ctl load` will not wipe them without --force."""
    from controlplane.bmv2 import free_tcp_port
    from lta.cli import main as lta

    ports = [free_udp_port() for _ in range(3)]
    switch_port, p4rt_port = free_udp_port(), free_tcp_port()
    cfg = tmp_path / "jobs.toml"
    cfg.write_text(
        f"""seed = 4
[[jobs]]
job_id = 5
quorum = 2
pool_size = 100
elems_per_packet = 32
workers = [
    {{ ip = "127.0.0.1", udp_port = {ports[0]}, port = 1, mac = "02:00:00:00:00:0a" }},
    "127.0.0.1:{ports[1]}",
]
[[jobs.drop]]
direction = "down"
worker = 1
p = 0.0

[[jobs]]
job_id = 7
slot_base = 1000
workers = ["127.0.0.1:{ports[2]}"]
"""
    )
    proc = start_daemon(switch_port, "--config", str(cfg), "--p4runtime", f"127.0.0.1:{p4rt_port}")
    ctl = ["ctl", "--target", f"127.0.0.1:{p4rt_port}"]
    try:
        assert "with jobs [5, 7]" in proc.stderr.readline()
        assert "P4Runtime" in proc.stderr.readline()
        assert lta([*ctl, "job", "ls", "--json"]) == 0
        listing = json.loads(capsys.readouterr().out)
        # As the file says; fields left out are worker w's defaults (port w + 1, mac 02:00:00:00:00:(w+1)).
        assert listing["5"] == {
            "quorum": 2,
            "pool_size": 100,
            "slot_base": 0,
            "workers": [
                {"port": 1, "mac": "02:00:00:00:00:0a", "ip": "127.0.0.1", "udp_port": ports[0]}
                | {"packets": 0},
                {"port": 2, "mac": "02:00:00:00:00:02", "ip": "127.0.0.1", "udp_port": ports[1]}
                | {"packets": 0},
            ],
            "drop": [
                {"direction": "down", "worker": 1, "model": "bernoulli", "p": 0.0, "r": 1.0}
                | {"loss_good": 0.0, "loss_bad": 1.0}
            ],
        }
        assert (listing["7"]["slot_base"], listing["7"]["pool_size"], listing["7"]["quorum"]) == (
            1000,
            DEFAULT_POOL_SIZE,
            1,
        )
        # The job works with its own K = 32, which P4Runtime cannot carry.
        config = TransportConfig(sync_deadline_ms=1000, elems_per_packet=32)
        workers = [
            LtaWorker(5, w, 2, ("127.0.0.1", switch_port), config=config, bind=("127.0.0.1", p))
            for w, p in enumerate(ports[:2])
        ]
        x = [np.full(200, 1.0, np.float32), np.full(200, 3.0, np.float32)]
        results = run_workers(workers, lambda w, i: w.allreduce(x[i]))
        assert all(np.all(r.count == 2) and np.allclose(r.values, 2.0) for r in results)
        for w in workers:
            w.close()
        assert lta([*ctl, "stats", "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["5"]["result_quorum"] == stats["5"]["grad_start"] > 0
        assert stats["5"]["drop_bad_worker"] == 0 and stats["7"]["rx_packets"] == 0
        assert lta([*ctl, "load"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "holds jobs 5, 7" in err and "--force" in err
        assert lta([*ctl, "job", "reset", "5"]) == 0
        assert lta([*ctl, "job", "rm", "7"]) == 0
        capsys.readouterr()
        assert lta([*ctl, "job", "ls", "--json"]) == 0
        assert sorted(json.loads(capsys.readouterr().out)) == ["5"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_occupied_udp_and_p4runtime_ports_are_refused():
    from controlplane.bmv2 import free_tcp_port
    from controlplane.switch import LtaSwitch

    switch_port, p4rt_port, other_port = free_udp_port(), free_tcp_port(), free_udp_port()
    first = start_daemon(switch_port, "--p4runtime", f"127.0.0.1:{p4rt_port}")
    try:
        assert "listening" in first.stderr.readline()
        assert "P4Runtime" in first.stderr.readline()
        proc = lta_softswitch("--listen", f"127.0.0.1:{switch_port}")
        assert proc.returncode == 1 and f"cannot listen on 127.0.0.1:{switch_port}" in one_line(proc)
        proc = lta_softswitch("--listen", f"127.0.0.1:{switch_port}", "--shards", "2")
        assert proc.returncode == 1 and f"cannot listen on 127.0.0.1:{switch_port}" in one_line(proc)
        proc = lta_softswitch("--listen", f"127.0.0.1:{other_port}", "--p4runtime", f"127.0.0.1:{p4rt_port}")
        assert proc.returncode == 1 and f"cannot serve P4Runtime on 127.0.0.1:{p4rt_port}" in one_line(proc)
        # The first one still answers, alone, with LTA's pipeline loaded from the start.
        with LtaSwitch.connect(f"127.0.0.1:{p4rt_port}", read_only=True) as ctl:
            ctl.check_pipeline()
            assert ctl.jobs() == {}
    finally:
        first.terminate()
        first.wait(timeout=10)
    assert first.returncode == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stats-every", "-1"], "argument --stats-every: interval must be in (0.0, inf), got -1"),
        (["--stats-every", "0"], "argument --stats-every: interval must be in (0.0, inf), got 0"),
        (["--listen", "127.0.0.1:99999"], "argument --listen: address '127.0.0.1:99999' is not HOST:PORT"),
        (["--p4runtime", "nowhere"], "argument --p4runtime: address 'nowhere' is not HOST:PORT"),
    ],
)
def test_bad_flags_are_one_line_before_anything_starts(args, message, capsys):
    from lta.cli import main as lta

    assert lta(["softswitch", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_bad_config_is_one_line_naming_file_and_key(tmp_path, capsys):
    from lta.cli import main as lta

    cfg = tmp_path / "switch.toml"
    cfg.write_text('[[jobs]]\njob_id = 1\nworkers = ["127.0.0.1:41001"]\nquroum = 1\n')
    assert lta(["softswitch", "--listen", f"127.0.0.1:{free_udp_port()}", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{cfg}: jobs[0] (job_id 1): unknown key 'quroum' (did you mean 'quorum'?)" in err
    assert lta(["softswitch", "--config", str(tmp_path / "nope.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.toml does not exist" in err


def test_a_second_shard_group_cannot_join_an_occupied_port():
    """Sockets with SO_REUSEPORT would join the group already on the port and take half its packets."""
    from softswitch.shards import shard_sockets

    first = shard_sockets(("127.0.0.1", 0), 2)
    port = first[0].getsockname()[1]
    try:
        joiner = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        joiner.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        joiner.bind(("127.0.0.1", port))  # what the kernel allows: the reason for the check
        joiner.close()
        with pytest.raises(OSError, match=f"softswitch cannot listen on 127.0.0.1:{port}"):
            shard_sockets(("127.0.0.1", port), 2)
    finally:
        for sock in first:
            sock.close()
