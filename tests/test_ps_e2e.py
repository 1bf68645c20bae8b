"""The parameter server end to end over UDP on loopback: worker threads with ``hostlib.ps.client`` train a
linear model (checked against numpy's least-squares solution), ``lta ps`` as a separate process, the
torch optimizer wrapper against torch's own SGD, and a client that finds no server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.ps.client import PsClient, PsClientConfig, PsTimeout
from softswitch.ps.config import PsDrop, PsJobConfig
from softswitch.ps.server import PsServer
from softswitch.ps.staleness import StalenessConfig

REPO = Path(__file__).resolve().parents[1]


def linear_problem(d: int = 40, n: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    w_true = rng.standard_normal(d).astype(np.float32)
    y = (x @ w_true + 0.05 * rng.standard_normal(n)).astype(np.float32)
    w_best = np.linalg.lstsq(x.astype(np.float64), y.astype(np.float64), rcond=None)[0]
    return x, y, w_best


def train_workers(address, n_workers, x, y, steps, *, config, lr=None, job_id=1) -> list[PsClient]:
    errors: list[BaseException] = []
    clients: list[PsClient] = []

    def work(w: int) -> None:
        try:
            client = PsClient(address, job_id, w, config=config)
            clients.append(client)
            params = client.initialize(np.zeros(x.shape[1], dtype=np.float32)).copy()
            rng = np.random.default_rng(w)
            for _ in range(steps):
                idx = rng.integers(0, len(y), 32)
                grad = x[idx].T @ (x[idx] @ params - y[idx]) / len(idx)
                params = client.step(grad, lr=lr).copy()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(n_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    if errors:
        raise errors[0]
    return clients


@pytest.mark.parametrize(
    ("mode", "compression", "loss"),
    [("sync", "none", 0.0), ("sync", "fp16", 0.1), ("async", "none", 0.0), ("async", "int8", 0.1)],
)
def test_three_workers_train_a_linear_model_over_udp(mode, compression, loss):
    x, y, w_best = linear_problem()
    drops = (PsDrop("up", DropPolicy(p=loss)), PsDrop("down", DropPolicy(p=loss))) if loss else ()
    cfg = PsJobConfig(
        job_id=1,
        n_workers=3,
        mode=mode,
        lr=0.05,
        momentum=0.5,
        compression=compression,
        elems_per_packet=16,
        staleness=StalenessConfig(max_staleness=6, adaptive=True),
        drops=drops,
    )
    with PsServer(seed=1) as server:
        server.add_job(cfg)
        clients = train_workers(
            server.address, 3, x, y, 150, config=PsClientConfig(elems_per_packet=16, compression=compression)
        )
        step, params = server.snapshot(1)
        stats = server.stats()["jobs"][1]
    assert params is not None
    initial = float(np.mean(y**2))
    final = float(np.mean((x @ params - y) ** 2))
    best = float(np.mean((x @ w_best - y) ** 2))
    assert final < initial / 50
    assert np.linalg.norm(params - w_best) / np.linalg.norm(w_best) < 0.05
    assert final - best < 0.02
    assert sum(c.stats.pushes for c in clients) == 450
    counters = stats["counters"]
    if mode == "sync":
        assert step == 150 and counters["windows_full"] == 150
    else:
        # A push whose every packet was lost is never decided: the server cannot know of it.
        assert step == counters["pushes_accepted"] == counters["pushes"] - counters["pushes_rejected"]
        assert counters["pushes"] == 450 if not loss else 400 < counters["pushes"] <= 450
    if loss:
        assert counters["drop_policy_up"] > 0 and counters["drop_policy_down"] > 0
        assert sum(c.stats.pull_resends for c in clients) > 0
    for c in clients:
        c.close()


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lta_ps_daemon_serves_workers_and_reports_stats():
    port = _free_udp_port()
    argv = [
        sys.executable, "-m", "lta.cli", "ps", "--listen", f"127.0.0.1:{port}", "--job-id", "4",
        "--workers", "2", "--mode", "async", "--max-staleness", "3", "--adaptive-staleness", "--lr", "0.05",
        "--elems-per-packet", "16",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert "listening" in proc.stderr.readline()
        x, y, w_best = linear_problem(d=20)
        clients = train_workers(
            ("127.0.0.1", port), 2, x, y, 60, config=PsClientConfig(elems_per_packet=16), job_id=4
        )
        params = clients[0].params.copy()
        assert np.linalg.norm(params - w_best) / np.linalg.norm(w_best) < 0.2
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    job = stats["jobs"]["4"]
    assert job["mode"] == "async" and job["counters"]["pushes"] == 120
    assert 0.0 <= job["rejection_rate"] <= 1.0 and job["mean_staleness"] >= 0.0
    assert len(job["staleness_bounds"]) == 2


def test_lta_ps_refuses_bad_settings_in_one_line():
    argv = [sys.executable, "-m", "lta.cli", "ps", "--workers", "2", "--rule", "mean", "--f", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "mean tolerates no Byzantine worker" in done.stderr


def test_client_without_a_server_times_out_saying_what_to_check():
    port = _free_udp_port()
    client = PsClient(("127.0.0.1", port), 1, 0, config=PsClientConfig(retry_s=0.01, timeout_s=0.3))
    with pytest.raises(PsTimeout, match=r"is `lta ps` running with job 1"):
        client.initialize(np.zeros(10, dtype=np.float32))
    # It gave up on its resend schedule (waits of 10, 20, 40, 80, 160 ms: past timeout_s after the fifth),
    # not later: at most 4 resends (fewer where a loaded machine stretched a wait).
    assert client.stats.pulls == 1 and client.stats.pull_resends <= 4
    client.close()


def test_ps_optimizer_steps_like_torch_sgd_with_momentum():
    torch = pytest.importorskip("torch")
    from hostlib.torch_ext.ps import PSOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    twin.load_state_dict(model.state_dict())
    lr, momentum = 0.1, 0.9
    cfg = PsJobConfig(job_id=2, n_workers=1, mode="sync", lr=1.0, momentum=momentum, elems_per_packet=8)
    gen = torch.Generator().manual_seed(1)
    with PsServer() as server:
        server.add_job(cfg)
        client = PsClient(server.address, 2, 0, config=PsClientConfig(elems_per_packet=8))
        opt = PSOptimizer(model.parameters(), client, lr=lr)  # the lr travels with each push
        ref = torch.optim.SGD(twin.parameters(), lr=lr, momentum=momentum)
        for _ in range(5):
            x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
            for net, o in ((model, opt), (twin, ref)):
                o.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                o.step()
        client.close()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert opt.ps_stats()["pushes"] == 5 and opt.ps_stats()["version"] == 5


def test_ps_optimizer_from_the_environment(monkeypatch):
    torch = pytest.importorskip("torch")
    from hostlib.errors import UsageError
    from hostlib.torch_ext.ps import PSOptimizer

    model = torch.nn.Linear(4, 2)
    monkeypatch.delenv("LTA_PS", raising=False)
    with pytest.raises(UsageError, match="LTA_PS is not set"):
        PSOptimizer.from_env(model.parameters(), lr=0.1)
    cfg = PsJobConfig(job_id=5, n_workers=2, mode="async", elems_per_packet=8, compression="fp16")
    with PsServer() as server:
        server.add_job(cfg)
        host, port = server.address
        monkeypatch.setenv("LTA_PS", f"{host}:{port}")
        monkeypatch.setenv("LTA_JOB_ID", "5")
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("LTA_ELEMS_PER_PACKET", "8")
        monkeypatch.setenv("LTA_PS_COMPRESSION", "fp16")
        opt = PSOptimizer.from_env(model.parameters(), lr=0.1)
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.client.close()
        assert server.job_stats(5)["counters"]["pushes_accepted"] == 1
    assert opt.client.worker_id == 1 and opt.client.config.compression == "fp16"
