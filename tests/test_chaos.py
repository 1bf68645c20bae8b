"""lta chaos: the schedule is a function of the seed, the verdicts follow their definitions, and two short
seeded runs through front doors end ok or loud, never hung or silent (marker ``chaos``: a few minutes)."""

from __future__ import annotations

import numpy as np
import pytest

from hostlib.dropmodels import DropPolicy
from lta.chaos.report import markdown, summary
from lta.chaos.runner import EXACT_TOL, Outcome, judge, run_one
from lta.chaos.schedule import FAULT_KINDS, RunSpec, draw, drop_policy
from lta.chaos.worker import DOORS, chunk_sums


def test_a_seed_replays_its_run_and_seeds_cover_every_door_and_fault():
    assert draw(7).as_dict() == draw(7).as_dict()
    runs = [draw(s) for s in range(60)]
    assert {r.door for r in runs} == set(DOORS)
    assert {k for r in runs for k in r.kinds} == set(FAULT_KINDS)
    for r in runs:
        assert 1 <= len(r.faults) <= 3
        for f in r.faults:
            if f["kind"].startswith("loss-"):
                assert 0.1 <= f["rate"] <= 0.4
            if f["kind"] in ("kill", "restart", "stop", "clock"):
                assert 1 <= f["rank"] < r.world and 0 < f["step"] < r.steps
            if f["kind"] in ("reorder", "duplicate"):
                assert 0.02 <= f["fraction"] <= 0.3
        if r.door == "ps":
            assert not {"loss-param", "switch-restart", "small-pool", "reorder", "duplicate"} & set(r.kinds)
    # Without network namespaces the same seeds draw no reordering or duplication.
    assert not {k for s in range(60) for k in draw(s, netns=False).kinds} & {"reorder", "duplicate"}


_PROBE = """
import socket, sys
r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
r.bind(("127.0.0.1", 0))
r.settimeout(1.0)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(2000):
    s.sendto(i.to_bytes(4, "big") + bytes(300), r.getsockname())
got = []
try:
    while True:
        got.append(int.from_bytes(r.recv(400)[:4], "big"))
except TimeoutError:
    pass
print(len(got), len(set(got)), sum(b < a for a, b in zip(got, got[1:])))
"""


@pytest.mark.parametrize("kind", ["reorder", "duplicate"])
def test_netns_fault_reorders_or_duplicates_udp(kind):
    """2000 UDP datagrams over the namespace's loopback at a 20% fault: with ``duplicate`` about 400
    extra copies (binomial: 3 sigma is 54) and every datagram once at least, in order; with ``reorder``
    every one once, some arriving after a later one."""
    import subprocess
    import sys

    from lta.chaos import netns

    why = netns.available()
    if why is not None:
        pytest.skip(why)
    name = f"P3test-{kind}"
    prefix = netns.create(name, [{"kind": kind, "fraction": 0.2}])
    try:
        out = subprocess.run(
            [*prefix, sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True
        )
    finally:
        netns.delete(name)
    received, unique, descents = map(int, out.stdout.split())
    assert unique == 2000
    if kind == "duplicate":
        assert 400 - 60 <= received - unique <= 400 + 60 and descents == 0
    else:
        assert received == 2000 and descents > 0


@pytest.mark.parametrize("rate", [0.1, 0.25, 0.4])
def test_gilbert_elliott_fault_has_the_drawn_mean_loss_and_bursts_of_four(rate):
    policy = DropPolicy.from_dict(drop_policy({"model": "gilbert_elliott", "rate": rate}))
    # Stationary share of the bad state p / (p + r), every packet lost there: the chain's own algebra.
    assert policy.p / (policy.p + policy.r) == pytest.approx(rate)
    assert 1 / policy.r == pytest.approx(4.0)  # mean sojourn in the bad state: 4 packets


def _finished(tmp_path, params: list[np.ndarray], first=1.0, final=0.1, step=0.01, history=None) -> None:
    for r, p in enumerate(params):
        extra = {} if history is None else {"history": history[r]}
        np.savez(
            tmp_path / f"rank{r}.npz",
            params=p,
            first_loss=first,
            final_loss=final,
            max_step_change=step,
            **extra,
        )


def test_verdicts(tmp_path):
    spec = RunSpec(0, "sharded", 3, 10, [{"kind": "loss-param", "direction": "param", "model": "bernoulli",
                                           "rate": 0.2}])  # fmt: skip
    exact = RunSpec(0, "ddp", 3, 10, [])
    base = np.zeros(50, np.float32)

    _finished(tmp_path, [base, base + 0.02, base])  # apart by 2 steps: within (S + 1) steps
    assert judge(Outcome(spec, exit_codes={0: 0, 1: 0, 2: 0}), tmp_path, {}).verdict == "ok"
    _finished(tmp_path, [base, base + 0.5, base])  # 50 steps apart: beyond the staleness bound
    assert judge(Outcome(spec, exit_codes={0: 0, 1: 0, 2: 0}), tmp_path, {}).verdict == "silent"
    _finished(tmp_path, [base, base + 10 * EXACT_TOL, base])  # the design says identical
    assert judge(Outcome(exact, exit_codes={0: 0, 1: 0, 2: 0}), tmp_path, {}).verdict == "silent"
    _finished(tmp_path, [base, base, base], final=0.9)  # exit 0, untrained
    out = judge(Outcome(exact, exit_codes={0: 0, 1: 0, 2: 0}), tmp_path, {})
    assert out.verdict == "silent" and "untrained" in out.cause
    _finished(tmp_path, [base, base, base])
    out = judge(
        Outcome(exact, exit_codes={0: 0, 1: -9, 2: 0}), tmp_path, {1: 0.0}
    )  # a killed rank is no failure
    assert out.verdict == "ok"
    (tmp_path / "rank2.err").write_text("noise\nrank 2: UnhealthyTraining: the cause\n\n")
    out = judge(Outcome(exact, exit_codes={0: 0, 1: 0, 2: 1}), tmp_path, {})
    assert (out.verdict, out.cause) == ("loud", "rank 2 exit 1: rank 2: UnhealthyTraining: the cause")
    (tmp_path / "rank0.err").write_text("job 1: worker 2 offline\n")  # rank 0 was killed by the parent
    out = judge(Outcome(exact, exit_codes={0: -9, 1: 0, 2: 1}), tmp_path, {})
    assert out.cause == "rank 2 exit 1: rank 2: UnhealthyTraining: the cause"
    rows = [out.as_dict()]
    assert summary(rows)["verdicts"] == {"ok": 0, "loud": 1, "hang": 0, "silent": 0}
    assert "| ddp | 0 | 1 | 0 | 0 |" in markdown(rows)


def test_replicas_that_parted_mid_run_are_silent_though_equal_at_the_end(tmp_path):
    """Chaos seed 91: a hook run's replicas parted at a re-broadcast; the next one resets most chunks, so
    a run could end with equal parameters and be called ok. Exact replicas are judged after every step
    (from the per-chunk sums each rank saves), and a rank killed on the way is left out of it."""
    hook_kill = RunSpec(91, "hook", 3, 4, [{"kind": "kill", "rank": 2, "step": 2}])
    base = np.linspace(-1.0, 1.0, 200).astype(np.float32)  # 4 chunks of K = 64, the last one padded
    steps = [base + 0.01 * t for t in range(1, 5)]
    history = [np.stack([chunk_sums(p, 64) for p in steps]) for _ in range(3)]
    parted = [h.copy() for h in history]
    parted[1][2, 3] += 64 * 1e-3  # after step 3, rank 1's last chunk: some value at least 1e-3 apart
    _finished(tmp_path, [steps[-1]] * 3, history=parted)
    out = judge(Outcome(hook_kill, exit_codes={0: 0, 1: 0, 2: 0}), tmp_path, {})
    assert out.verdict == "silent" and "after step 3" in out.cause, out.cause
    assert float(out.cause.split("at least ")[1].split()[0]) == pytest.approx(1e-3, rel=1e-3)
    _finished(tmp_path, [steps[-1]] * 3, history=history)  # equal after every step
    assert judge(Outcome(hook_kill, exit_codes={0: 0, 1: 0, 2: 0}), tmp_path, {}).verdict == "ok"
    killed_parted = [history[0], history[1], parted[1]]  # rank 2's history ends apart: killed, not judged
    _finished(tmp_path, [steps[-1]] * 3, history=killed_parted)
    out = judge(Outcome(hook_kill, exit_codes={0: 0, 1: 0, 2: -9}), tmp_path, {2: 0.0}, interrupted={2})
    assert out.verdict == "ok"
    restarted = judge(Outcome(hook_kill, exit_codes={0: 0, 1: 0, 2: 0}), tmp_path, {}, interrupted={2})
    assert restarted.verdict == "ok"  # started again: its steps are its own run's, its end is judged
    # Where replicas may differ by design (a lost RESULT falls back), only the end is judged.
    lossy = RunSpec(91, "hook", 3, 4, [{"kind": "loss-down", "direction": "down", "model": "bernoulli",
                                        "rate": 0.2}])  # fmt: skip
    _finished(tmp_path, [steps[-1]] * 3, history=parted)
    assert judge(Outcome(lossy, exit_codes={0: 0, 1: 0, 2: 0}), tmp_path, {}).verdict == "ok"


@pytest.mark.chaos
def test_killed_worker_survivors_finish_exact_and_back_at_pace(tmp_path):
    """DDP hook, 3 ranks, rank 2 SIGKILLed at step 10 (no restart): the survivors finish, trained and
    identical (up-loss only: every worker applies the same RESULTs), their step time back to its pace
    after the liveness timeout lowered the quorum."""
    spec = RunSpec(11, "hook", 3, 30, [{"kind": "kill", "rank": 2, "step": 10}])
    out = run_one(spec, base_bound_s=300.0, keep=tmp_path)
    assert out.verdict == "ok", out.as_dict()
    assert out.exit_codes[2] == -9 and out.recovery_s is not None


@pytest.mark.chaos
def test_switch_losing_its_state_under_bursty_loss_is_never_a_hang_or_a_lie(tmp_path):
    spec = RunSpec(
        12,
        "ddp",
        3,
        30,
        [
            {"kind": "loss-up", "direction": "up", "model": "gilbert_elliott", "rate": 0.2},
            {"kind": "switch-restart", "step": 12},
        ],
    )
    out = run_one(spec, base_bound_s=300.0, keep=tmp_path)
    assert out.verdict in ("ok", "loud"), out.as_dict()
    if out.verdict == "loud":
        assert out.cause.startswith("rank ") and "\n" not in out.cause


def test_self_hosted_switch_lowers_the_quorum_when_a_worker_dies():
    """The embedded softswitch runs a liveness monitor: a worker whose heartbeats stop is marked offline
    and the job's quorum drops to the live workers (what lets a killed rank's peers go back to their pace)."""
    import time

    from hostlib.torch_ext.embedded import EmbeddedSwitch
    from hostlib.torch_ext.rendezvous import LtaOptions
    from hostlib.transport import LtaWorker, TransportConfig

    assert LtaOptions.from_env({"LTA_LIVENESS_TIMEOUT": "1.5"}).liveness_timeout_s == 1.5
    assert LtaOptions.from_env({}).liveness_timeout_s == 3.0
    with pytest.raises(ValueError, match="liveness_timeout_s"):
        LtaOptions(liveness_timeout_s=-1)
    embedded = EmbeddedSwitch(0, ("127.0.0.1", 0))
    cfg = TransportConfig(heartbeat_interval_s=0.1, elems_per_packet=64)
    workers = [LtaWorker(1, w, 3, embedded.address, config=cfg) for w in range(3)]
    try:
        embedded.add_job(1, [w.address for w in workers], pool_size=512, elems_per_packet=64,
                         liveness_timeout_s=0.5)  # fmt: skip
        for w in workers:
            w.check_switch()  # starts each worker's heartbeat with its first packet
        workers[2].close()
        give_up = time.monotonic() + 30
        while embedded.switch.jobs[1].cfg.quorum != 2 and time.monotonic() < give_up:
            time.sleep(0.05)
        assert embedded.switch.jobs[1].cfg.quorum == 2
        assert embedded.monitors[0].offline == [2]
    finally:
        for w in workers[:2]:
            w.close()
        embedded.stop()
