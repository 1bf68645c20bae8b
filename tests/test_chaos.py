"""lta chaos: the schedule is a function of the seed, the verdicts follow their definitions, and two short
seeded runs through front doors end ok or loud, never hung or silent (marker ``chaos``: a few minutes)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hostlib.emulation.dropmodels import DropPolicy
from lta.chaos.report import markdown, summary
from lta.chaos.runner import (
    EXACT_TOL,
    RECOVERY_TARGET_S,
    Outcome,
    Signal,
    _drain,
    _mark_finished,
    _recovery,
    judge,
    run_one,
)
from lta.chaos.schedule import FAULT_KINDS, RunSpec, draw, drop_policy
from lta.chaos.worker import DOORS, FINISHED_MARK, chunk_sums


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


def test_the_shortest_run_draws_its_timed_faults_in_range_and_a_shorter_one_is_refused(capsys):
    """At 19 steps every kill, restart, stop, clock and switch-restart lands at step 10 (the one step in
    [10, 19 - 8)); with 18 steps or 1 rank there is no such step or rank: a ValueError from draw, a one-line
    error from the command (not numpy's traceback)."""
    from lta import cli

    timed = [f for s in range(200) for f in draw(s, steps=19, world=2).faults if "step" in f]
    assert timed and all(f["step"] == 10 for f in timed)
    assert all(f["rank"] == 1 for f in timed if "rank" in f)
    with pytest.raises(ValueError, match=">= 19 steps"):
        draw(5, steps=18)
    with pytest.raises(ValueError, match=">= 2 ranks"):
        draw(5, world=1)
    for flag, value in (("--steps", "12"), ("--workers", "1")):
        assert cli.main(["chaos", "--seeds", "5", flag, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0], err


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
    extra copies and every datagram once at least, in order; with ``reorder`` every one once, some
    arriving after a later one. The extra copies spread wider than a binomial's (3 sigma would be 54): 40
    runs gave 354-436, and CI once 331 on a busy host (the kernel's dup skips a copy now and then), so the
    band is 300-500: a duplicate rule that did not fire, or fired twice as often, still fails."""
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
        assert 300 <= received - unique <= 500 and descents == 0
    else:
        assert received == 2000 and descents > 0


@pytest.mark.parametrize("allowed", [True, False])
def test_netns_probe_makes_a_namespace_before_it_says_yes(monkeypatch, allowed):
    """Root and ip/tc/nft on PATH are not enough (an unprivileged container has both): the probe makes a
    namespace, and where the kernel refuses it says why in one line (the fault tests then skip), always
    removing what it made. The commands are played by hand, as the kernel would answer them."""
    import os
    import subprocess

    from lta.chaos import netns

    calls: list[list[str]] = []

    def fake_run(cmd, **kwargs):  # noqa: ANN001, ANN202
        calls.append(list(cmd))
        refused = not allowed and list(cmd[:3]) == ["ip", "netns", "add"]
        err = "mount --make-shared /run/netns failed: Operation not permitted\n" if refused else ""
        return subprocess.CompletedProcess(cmd, 1 if refused else 0, "", err)

    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.subprocess, "run", fake_run)
    why = netns.available()
    assert calls[0][:3] == ["ip", "netns", "add"] and calls[-1][:3] == ["ip", "netns", "del"]
    assert calls[-1][3] == calls[0][3]  # the probe namespace is removed again
    if allowed:
        assert why is None
        assert ["ip", "netns", "exec", calls[0][3], "ip", "link", "set", "lo", "up"] in calls
    else:
        assert why is not None and "\n" not in why
        assert why.startswith("cannot make a network namespace here") and "Operation not permitted" in why


@pytest.mark.parametrize("rate", [0.1, 0.25, 0.4])
def test_gilbert_elliott_fault_has_the_drawn_mean_loss_and_bursts_of_four(rate):
    policy = DropPolicy.from_dict(drop_policy({"model": "gilbert_elliott", "rate": rate}))
    # Stationary share of the bad state p / (p + r), every packet lost there: the chain's own algebra.
    assert policy.p / (policy.p + policy.r) == pytest.approx(rate)
    assert 1 / policy.r == pytest.approx(4.0)  # mean sojourn in the bad state: 4 packets


def _finished(
    tmp_path, params: list[np.ndarray], first=1.0, final=0.1, step=0.01, history=None, versions=None
) -> None:
    for r, p in enumerate(params):
        extra = {} if history is None else {"history": history[r]}
        if versions is not None:
            extra["version"] = versions[r]
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
    exact = RunSpec(0, "hook", 3, 10, [])
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
    assert summary(rows)["verdicts"] == {"ok": 0, "ok-after-restart": 0, "loud": 1, "hang": 0, "silent": 0}
    assert "| hook | 0 | 0 | 1 | 0 | 0 |" in markdown(rows)


def test_parameter_server_replicas_may_differ_by_the_versions_they_ended_at_and_no_more(tmp_path):
    """Chaos seed 11 (ps, up loss only: the design says exact): two ranks started late, so their steps
    landed one sync window later and they ended at version 41 against their peers' 40, one step apart.
    A replica is its server version: equal versions must be identical, and ranks d versions apart may
    differ by d steps (the largest one-step change), no more."""
    spec = RunSpec(
        11, "ps", 4, 40, [{"kind": "loss-up", "direction": "up", "model": "bernoulli", "rate": 0.2}]
    )
    base = np.zeros(50, np.float32)
    step = 0.01
    late = base + 0.9 * step  # one server step on
    codes = {r: 0 for r in range(4)}
    _finished(tmp_path, [base, late, base, late], step=step, versions=[40, 41, 40, 41])
    assert judge(Outcome(spec, exit_codes=codes), tmp_path, {}).verdict == "ok"
    # the same parameters reported at one version: apart by design only if their versions say so
    _finished(tmp_path, [base, late, base, late], step=step, versions=[40, 40, 40, 40])
    assert judge(Outcome(spec, exit_codes=codes), tmp_path, {}).verdict == "silent"
    # one version apart but two steps' difference
    _finished(tmp_path, [base, base + 2 * step, base, base], step=step, versions=[40, 41, 40, 40])
    assert judge(Outcome(spec, exit_codes=codes), tmp_path, {}).verdict == "silent"
    # two late ranks at the same version must agree with each other
    other = late.copy()
    other[0] -= 0.9 * step
    _finished(tmp_path, [base, late, base, other], step=step, versions=[40, 41, 40, 41])
    assert judge(Outcome(spec, exit_codes=codes), tmp_path, {}).verdict == "silent"


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


def _steps(*spans: tuple[float, float, float]) -> list[float]:
    """Step times: each span (start, end, step time) steps from ``start`` up to ``end``, inclusive."""
    out: list[float] = []
    for start, end, dt in spans:
        out += list(np.round(np.arange(start, end + dt / 2, dt), 6))
    return out


def test_kill_recovery_is_timed_from_the_fault_that_kept_the_survivors_waiting():
    """Hand-built step times (survivors at 0.05 s a step; a kill's wait: 0.5 s steps until its liveness
    timeout has passed, as the hook door's units give up). The survivors' pace comes back 3.2 s after the
    last fault that made them wait; a stopped rank's own stop is not its peers' recovery; a fault that
    came after the target had passed excuses nothing."""
    pace = (0.0, 10.0, 0.05)
    # Rank 3 killed at 10, rank 2 stopped at 11.8 (inside the kill's window) for 4.9 s: the survivors wait
    # for both until 11.8 + 3.2 = 15.0 (chaos seed 26's shape).
    survivors = _steps(pace, (10.5, 14.5, 0.5), (15.0, 16.0, 0.05))
    steps = {0: survivors, 1: survivors, 2: _steps(pace, (10.5, 11.5, 0.5), (16.7, 17.0, 0.05)),
             3: _steps(pace)}  # fmt: skip
    signals = [Signal(10.0, "SIGKILL", 3), Signal(11.8, "SIGSTOP", 2), Signal(16.7, "SIGCONT", 2)]
    [kill] = _recovery(steps, signals)
    assert kill["survivors"] == [0, 1]  # rank 2, stopped after the kill, is no survivor
    assert kill["recovery_s"] == pytest.approx(3.2) and kill["from_kill_s"] == pytest.approx(5.0)
    assert kill["after"] == "SIGSTOP of rank 2 +1.80 s"
    # The same stop after the survivors were back (13.2 s) changes nothing; rank 2 is no survivor (its
    # own steps stop 14 to 20 s).
    survivors = _steps(pace, (10.5, 12.5, 0.5), (13.2, 20.0, 0.05))
    steps = {
        0: survivors,
        1: survivors,
        2: _steps(pace, (10.5, 12.5, 0.5), (13.2, 14.0, 0.05)),
        3: _steps(pace),
    }
    signals = [Signal(10.0, "SIGKILL", 3), Signal(14.0, "SIGSTOP", 2), Signal(20.0, "SIGCONT", 2)]
    [kill] = _recovery(steps, signals)
    assert (kill["recovery_s"], kill["after"], kill["survivors"]) == (pytest.approx(3.2), None, [0, 1])
    # Survivors still slow when the target had passed: a stop at 16 s (6 s after the kill, past the
    # target) excuses nothing; the kill's recovery is the whole 8 s.
    assert RECOVERY_TARGET_S < 6.0
    survivors = _steps(pace, (10.5, 17.5, 0.5), (18.0, 19.0, 0.05))
    steps = {0: survivors, 1: survivors, 2: _steps(pace, (10.5, 15.5, 0.5)), 3: _steps(pace)}
    signals = [Signal(10.0, "SIGKILL", 3), Signal(16.0, "SIGSTOP", 2)]
    [kill] = _recovery(steps, signals)
    assert (kill["recovery_s"], kill["after"], kill["survivors"]) == (pytest.approx(8.0), None, [0, 1])
    # Two kills 2.5 s apart (chaos seed 19's shape): the first kill's survivors wait for the second's
    # liveness timeout too; each kill is timed from the second, 3.3 s.
    survivors = _steps(pace, (10.5, 15.5, 0.5), (15.8, 17.0, 0.05))
    steps = {0: survivors, 1: survivors, 2: _steps(pace, (10.5, 12.5, 0.5)), 3: _steps(pace)}
    signals = [Signal(10.0, "SIGKILL", 3), Signal(12.5, "SIGKILL", 2)]
    first, second = _recovery(steps, signals)
    assert first["survivors"] == second["survivors"] == [0, 1]
    assert first["recovery_s"] == second["recovery_s"] == pytest.approx(3.3)
    assert first["from_kill_s"] == pytest.approx(5.8) and first["after"] == "SIGKILL of rank 2 +2.50 s"
    # A rank stopped before the kill (at 8 s; no survivor) resumed 2 s after it: the survivors, back
    # 7 s after the kill, missed the target; the SIGCONT excuses nothing.
    survivors = _steps((0.0, 8.0, 0.05), (8.5, 16.5, 0.5), (17.0, 18.0, 0.05))
    steps = {0: survivors, 1: survivors, 2: _steps((0.0, 8.0, 0.05), (12.5, 18.0, 0.05)), 3: _steps(pace)}
    signals = [Signal(8.0, "SIGSTOP", 2), Signal(10.0, "SIGKILL", 3), Signal(12.0, "SIGCONT", 2)]
    [kill] = _recovery(steps, signals)
    assert (kill["recovery_s"], kill["after"], kill["survivors"]) == (pytest.approx(7.0), None, [0, 1])
    # A survivor that never gets back to its pace: no recovery.
    steps = {0: _steps(pace, (10.5, 20.0, 0.5)), 1: _steps(pace, (10.5, 20.0, 0.5)), 3: _steps(pace)}
    [kill] = _recovery(steps, [Signal(10.0, "SIGKILL", 3)])
    assert kill["recovery_s"] is None


def test_summary_counts_every_kill_against_the_recovery_target():
    def row(seed: int, *recoveries: dict) -> dict:
        return {"seed": seed, "door": "hook", "faults": [], "verdict": "ok", "wall_s": 1.0, "cause": "",
                "recoveries": list(recoveries)}  # fmt: skip

    def kill(rank: int, s: float | None, after: str | None = None, from_kill: float | None = None) -> dict:
        return {
            "rank": rank,
            "recovery_s": s,
            "from_kill_s": from_kill or s,
            "after": after,
            "survivors": [0],
        }

    rows = [
        row(1, kill(2, 3.2)),
        row(2, kill(3, 3.1, "SIGSTOP of rank 2 +1.80 s", 4.9), kill(2, 6.5)),
        row(3, kill(1, None)),
        row(4),
    ]
    assert RECOVERY_TARGET_S == 5.0  # the liveness timeout (3 s) + 2 s
    assert summary(rows)["kill_recovery"] == {
        "kills": 4,
        "within_target": 2,
        "never_back": 1,
        "max_s": 6.5,
        "timed_from_a_later_fault": 1,
        "target_s": 5.0,
    }
    text = markdown(rows)
    assert "2 of 4 kills within it, slowest 6.5 s, 1 never back" in text
    assert "| rank 3: 3.1 (after SIGSTOP of rank 2 +1.80 s; 4.9 from the kill), rank 2: 6.5 |" in text


def test_steps_made_after_a_rank_failed_still_count_for_the_recovery(tmp_path):
    """After one rank fails the parent drains the others: the steps they make meanwhile are recorded
    (before, a restarted rank's failure while its peers were still slow from a kill read as 'never
    back at pace', chaos seed 19)."""

    class Exited:
        def poll(self) -> int:
            return 0

    for r, lines in ((0, 5), (1, 7)):
        (tmp_path / f"rank{r}.progress").write_text("".join(f"{i + 1} 0.0\n" for i in range(lines)))
    steps_at: dict[int, list[float]] = {0: [1.0, 2.0], 1: [], 2: [1.0]}
    _drain({r: (Exited(), None) for r in steps_at}, {2: 1.0}, time.monotonic(), 10.0, tmp_path, steps_at)
    assert [len(steps_at[r]) for r in (0, 1, 2)] == [5, 7, 1]  # rank 2 (killed) wrote no file
    assert steps_at[0][:2] == [1.0, 2.0]


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
def test_parameter_server_worker_killed_and_restarted_rejoins_and_every_rank_finishes_trained(tmp_path):
    """PS door, 3 ranks, rank 2 SIGKILLed at step 8 and started again (a new process on a new port): the
    server gives its id to the new process's INIT (before: PsTimeout after 30 s, the new port's packets
    dropped as another worker's), and every rank finishes trained."""
    spec = RunSpec(13, "ps", 3, 30, [{"kind": "restart", "rank": 2, "step": 8, "delay_s": 0.5}])
    out = run_one(spec, base_bound_s=300.0, keep=tmp_path)
    assert out.verdict == "ok-after-restart", out.as_dict()  # ok, with a rank started again that stepped
    assert [r["rank"] for r in out.restarts] == [2] and out.restarts[0]["resumed_at"] == 0  # starts over
    assert out.exit_codes[2] == 0  # the restarted process finished its run
    # (How soon its peers were back at pace is a timing, measured by `lta chaos`, not asserted here: it
    # depends on the host's load. The server's liveness rule is tested packet by packet in test_ps.py.)


@pytest.mark.chaos
@pytest.mark.parametrize("door", ["hook", "sharded"])
def test_a_restarted_rank_rejoins_the_hook_and_sharded_doors_and_a_stopped_one_heals(tmp_path, door):
    """3 ranks: rank 2 SIGKILLed at step 8 and started again 0.5 s later, rank 1 SIGSTOPped 4 s at step
    14. The restarted process rejoins through the run's store and takes a live peer's state (before:
    JoinTimeout in gloo's rendezvous); the stopped one comes back behind and takes a peer's state (before:
    UnhealthyTraining, "reduces in a row were over"). Every rank exits 0 and the verdict is ok-after-restart:
    trained, replicas within the door's bound (hostlib/torch_ext/heal.py), and the restarted rank went on
    from its peers' step (the step it healed to), not from step 0."""
    faults = [
        {"kind": "restart", "rank": 2, "step": 8, "delay_s": 0.5},
        {"kind": "stop", "rank": 1, "step": 14, "seconds": 4.0},
    ]
    out = run_one(RunSpec(17, door, 3, 30, faults), base_bound_s=300.0, keep=tmp_path)
    assert (out.verdict, out.cause) == ("ok-after-restart", ""), out.as_dict()
    assert out.exit_codes == {0: 0, 1: 0, 2: 0}
    [restart] = out.restarts
    assert restart["rank"] == 2 and restart["first_step_s"] is not None, restart
    assert restart["resumed_at"] >= 8, restart  # healed to where its peers were, past the kill's step


@pytest.mark.chaos
def test_switch_losing_its_state_under_bursty_loss_is_never_a_hang_or_a_lie(tmp_path):
    """The switch forgets every slot at step 12 (its jobs kept) under 20% bursty GRAD loss: a forgotten
    round is one more lost packet (its units are flushed, fall back or start the slot's round again), so
    every rank trains to the end and exits 0: "ok" (3 of 3 runs on a loaded 2-core machine; accepting
    "loud" too let a regression that raises after a restart pass)."""
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
    assert (out.verdict, out.cause) == ("ok", ""), out.as_dict()
    assert out.exit_codes == {0: 0, 1: 0, 2: 0}


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
    cfg = TransportConfig(heartbeat_interval_s=0.1, elems_per_packet=64, pool_size=512)
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


def test_a_restart_is_timed_from_its_new_process_and_counts_the_steps_done_twice(tmp_path):
    """Hand-built run: rank 2 killed at t = 10 after step 10 (rank 0 had finished step 11), its new process
    started at 11.5 and finished its first step, step 6 (it resumed from a checkpoint of step 5), at 14.0:
    first step 2.5 s after its start, 4.0 s after the kill, steps 6-11 done twice (6). A torchft replica
    that healed to step 12 lost none; one started after its peers had finished has no first step."""
    from lta.chaos.runner import _restarts

    (tmp_path / "rank2.starts").write_text("0.5 -\n11.5 1\n")
    steps_at = {0: [0.9 * i for i in range(1, 12)], 2: [1.0 * i for i in range(1, 11)] + [14.0, 14.5]}
    numbers = {0: list(range(1, 12)), 2: list(range(1, 11)) + [6, 7]}
    [restart] = _restarts(tmp_path, steps_at, numbers, [Signal(10.0, "SIGKILL", 2)], by="torchrun")
    assert restart == {
        "rank": 2,
        "by": "torchrun",
        "started_s": 1.5,
        "first_step_s": 2.5,
        "from_kill_s": 4.0,
        "resumed_at": 5,
        "lost_steps": 11 - 5,
        "late": False,
    }
    numbers[2][10:] = [13, 14]  # healed to step 12, then stepped: nothing done twice
    [healed] = _restarts(tmp_path, steps_at, numbers, [Signal(10.0, "SIGKILL", 2)])
    assert (healed["resumed_at"], healed["lost_steps"]) == (12, 0)
    steps_at[2], numbers[2] = steps_at[2][:10], numbers[2][:10]  # no step after the new start
    [late] = _restarts(tmp_path, steps_at, numbers, [Signal(10.0, "SIGKILL", 2)], late=[2])
    assert late["late"] and late["first_step_s"] is None and late["lost_steps"] is None
    (tmp_path / "rank2.starts").write_text("0.5 -\n")  # never started again: no restart
    assert _restarts(tmp_path, steps_at, numbers, [Signal(10.0, "SIGKILL", 2)]) == []


def test_a_replica_still_running_after_its_peers_finished_is_late_only_then():
    """torchft: a replica steps (and heals) in a quorum of all but one replica. Ranks still running when
    every other rank still in the run exited 0 are late (the parent stops them after a grace); not while
    none has finished, nor when a peer failed (that failure is the run's verdict)."""
    from lta.chaos.runner import _late

    assert _late({0: 0, 1: 0, 2: None}, {}) == [2]
    assert _late({0: None, 1: 0, 2: None}, {}) == [0, 2]  # both left behind (the grace covers a slow exit)
    assert _late({0: 0, 1: 1, 2: None}, {}) == []
    assert _late({0: 0, 1: -9, 2: None}, {1: 5.0}) == [2]  # rank 1 killed for good
    assert _late({0: 0, 1: 0, 2: 0}, {}) == []
    assert _late({0: None, 1: None, 2: None}, {}) == []


def test_ok_after_restart_needs_a_restarted_rank_that_stepped(tmp_path):
    spec = RunSpec(0, "torchft", 3, 10, [{"kind": "restart", "rank": 2, "step": 4, "delay_s": 0.5}])
    base = np.zeros(50, np.float32)
    _finished(tmp_path, [base, base, base])
    stepped = {"rank": 2, "first_step_s": 3.0, "lost_steps": 0, "late": False}
    outcome = Outcome(spec, exit_codes={0: 0, 1: 0, 2: 0}, restarts=[stepped])
    assert judge(outcome, tmp_path, {}).verdict == "ok-after-restart"
    late = {"rank": 2, "first_step_s": None, "lost_steps": None, "late": True}
    outcome = Outcome(spec, exit_codes={0: 0, 1: 0, 2: -9}, restarts=[late])
    assert judge(outcome, tmp_path, {2: 1.0}).verdict == "ok"
    _finished(tmp_path, [base, base + 1.0, base])  # apart: silent stays silent
    outcome = Outcome(spec, exit_codes={0: 0, 1: 0, 2: 0}, restarts=[stepped])
    assert judge(outcome, tmp_path, {}).verdict == "silent"


_TORCHRUN_SUMMARY = """Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
lta.chaos.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-28_22:06:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 101)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_22:06:00
  host      : localhost
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 103)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 103
============================================================
"""


def test_a_torchrun_run_that_fails_names_torchruns_root_cause(tmp_path):
    """A stock DDP run whose torchrun gave up: loud, naming the rank torchrun's summary gives as the root
    cause (not the first rank it stopped), its exit code, and that rank's own last line."""
    spec = RunSpec(0, "ddp", 3, 10, [{"kind": "kill", "rank": 2, "step": 4}])
    (tmp_path / "torchrun.err").write_text(_TORCHRUN_SUMMARY)
    (tmp_path / "rank2.err").write_text("rank 2 step 4\n")
    out = judge(Outcome(spec, exit_codes={0: 1, 1: 1, 2: 1}), tmp_path, {})
    assert (out.verdict, out.cause) == ("loud", "torchrun exit 1: rank 2 exitcode -9: rank 2 step 4")
    (tmp_path / "torchrun.err").unlink()
    out = judge(Outcome(spec, exit_codes={0: 1, 1: 1, 2: 1}), tmp_path, {})
    assert (out.verdict, out.cause) == ("loud", "torchrun exit 1: (no message)")


def test_the_door_by_fault_table_counts_verdicts_and_keeps_the_slowest_times():
    def row(door: str, kinds: list[str], verdict: str, recovery=None, first=None, lost=None) -> dict:
        return {
            "seed": 0, "door": door, "verdict": verdict,
            "faults": [{"kind": k, "model": "bernoulli", "rate": 0.1} for k in kinds],
            "wall_s": 1.0, "cause": "",
            "recoveries": [] if recovery is None else [{"rank": 1, "recovery_s": recovery, "after": None}],
            "restarts": [] if first is None else [{"rank": 1, "by": "torchrun", "first_step_s": first,
                                                   "lost_steps": lost, "late": False}],
        }  # fmt: skip

    rows = [
        row("ddp", ["kill"], "ok-after-restart", 4.0, 9.0, 3),
        row("ddp", ["kill", "loss-up"], "ok-after-restart", 6.5, 8.0, 2),
        row("ddp", ["loss-up"], "ok"),
        row("torchft", ["restart"], "loud"),
    ]
    table = summary(rows)["by_door_fault"]
    verdicts = {"ok": 0, "ok-after-restart": 2, "loud": 0, "hang": 0, "silent": 0}
    measures = {"recovery_s_max": 6.5, "first_step_s_max": 9.0, "lost_steps": 5}
    assert table["ddp"]["kill"] == {**verdicts, **measures}
    assert table["ddp"]["loss-up"]["ok"] == 1 and table["ddp"]["loss-up"]["ok-after-restart"] == 1
    assert table["torchft"]["restart"]["loud"] == 1 and table["torchft"]["restart"]["recovery_s_max"] is None
    assert summary(rows)["restarts"] == {"restarts": 2, "first_step_within_target": 2, "late": 0,
                                         "never_stepped": 0, "first_step_s_max": 9.0, "lost_steps": 5,
                                         "target_s": 10.0}  # fmt: skip
    text = markdown(rows)
    assert "| ddp | kill | 0 | 2 | 0 | 0 | 0 | 6.5 | 9 | 5 |" in text
    assert "| torchft | restart | 0 | 0 | 1 | 0 | 0 | - | - | 0 |" in text


@pytest.mark.chaos
def test_torchft_replica_killed_and_restarted_heals_from_a_peer_and_finishes_equal(tmp_path):
    """torchft door, 3 replicas, replica 2 SIGKILLed at step 5 and started again: torchft's lighthouse
    drops it from the quorum, the new process joins a later quorum, heals from a live peer (it goes on at
    the step the others are at: nothing done twice) and every replica ends with the same parameters."""
    spec = RunSpec(
        14, "torchft", 3, 40, [{"kind": "restart", "rank": 2, "step": 5, "delay_s": 0.5}], step_s=0.5
    )
    out = run_one(spec, base_bound_s=300.0, keep=tmp_path)
    assert out.verdict == "ok-after-restart", out.as_dict()
    [restart] = out.restarts
    assert restart["rank"] == 2 and not restart["late"]
    assert restart["resumed_at"] >= 5 and restart["lost_steps"] == 0
    assert out.divergence is not None and out.divergence <= EXACT_TOL  # identical replicas


@pytest.mark.chaos
def test_stock_ddp_under_torchrun_resumes_from_its_last_checkpoint_after_a_kill(tmp_path):
    """Stock DDP on "lta" under torchrun, rank 2 SIGKILLed at step 12: torchrun stops the others and starts
    all three again (--max-restarts 1); they load the distributed checkpoint of step 10 (one every 5
    steps) and finish, identical. The steps after 10 that were done before the kill are done twice."""
    from lta.chaos.worker import CHECKPOINT_EVERY

    assert CHECKPOINT_EVERY == 5
    spec = RunSpec(15, "ddp", 3, 24, [{"kind": "kill", "rank": 2, "step": 12}], step_s=0.3)
    out = run_one(spec, base_bound_s=300.0, keep=tmp_path)
    assert out.verdict == "ok-after-restart", out.as_dict()
    [restart] = out.restarts
    assert restart["by"] == "torchrun" and restart["resumed_at"] == 10
    assert 2 <= restart["lost_steps"] <= 4  # killed after step 12 (the parent's poll may see 13 or 14)
    assert out.divergence is not None and out.divergence <= EXACT_TOL


def test_the_command_prints_the_door_by_fault_table_or_one_json_document(tmp_path, capsys):
    """``lta chaos --resume`` over runs already in chaos.json runs nothing more: stdout is the summary
    (``--json``: one document with the door x fault table; else the rich table and the counts line), and
    a negative --step-ms is a one-line error."""
    import json

    from lta import cli

    row = {"seed": 3, "door": "ddp", "verdict": "ok-after-restart", "wall_s": 1.0, "cause": "",
           "faults": [{"kind": "kill", "rank": 1, "step": 12}],
           "recoveries": [{"rank": 1, "recovery_s": 11.0, "after": None}],
           "restarts": [{"rank": 1, "by": "torchrun", "first_step_s": 9.5, "lost_steps": 3,
                         "late": False}]}  # fmt: skip
    (tmp_path / "chaos.json").write_text(json.dumps({"runs": [row]}))
    argv = ["chaos", "--seeds", "3", "--resume", "--no-netns", "--out", str(tmp_path)]
    assert cli.main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "lta.chaos/1" and doc["verdicts"]["ok-after-restart"] == 1
    assert doc["by_door_fault"]["ddp"]["kill"]["lost_steps"] == 3
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "ok-after-restart=1" in text and "ddp" in text and "kill" in text
    assert cli.main([*argv, "--step-ms", "-1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step-ms" in err[0]


@pytest.mark.slow
def test_stock_ddp_under_torchrun_without_restarts_ends_loudly_naming_the_killed_rank(tmp_path):
    """The same kill with --max-restarts 0: torchrun stops the other ranks and exits non-zero; the run is
    loud, its cause the killed rank (exit code -9), and nothing was started again."""
    spec = RunSpec(
        15, "ddp", 3, 24, [{"kind": "kill", "rank": 2, "step": 12}], step_s=0.3, torchrun_restarts=0
    )
    out = run_one(spec, base_bound_s=300.0, keep=tmp_path)
    assert out.verdict == "loud", out.as_dict()
    assert out.cause.startswith("torchrun exit 1: rank 2 exitcode -9"), out.cause
    assert out.restarts == [] and out.ended_after_kill_s is not None  # (how soon: docs/results.md)


def test_without_torchft_the_torchft_door_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    from lta import cli
    from lta.chaos import runner

    monkeypatch.setattr(runner.sys, "executable", str(tmp_path / "python"))  # no lighthouse beside it
    monkeypatch.setenv("PATH", str(tmp_path))  # nor on PATH
    assert cli.main(["chaos", "--seeds", "6", "--doors", "torchft", "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torchft_lighthouse" in err[0] and "--doors" in err[0]
    assert not (tmp_path / "out" / "run6").exists()


@pytest.mark.chaos
def test_a_run_kept_in_the_folder_of_an_earlier_run_starts_from_an_empty_folder(tmp_path):
    """``lta chaos --keep`` run twice writes each seed into the same folder: the second run must not meet
    the first one's FileStore (its worker addresses and "ready" key sent the sharded door's ranks to
    dead ports: JoinTimeout, a loud verdict on seed 2) nor count its start and progress files."""
    spec = RunSpec(19, "hook", 2, 30, [])
    for _ in range(2):
        out = run_one(spec, base_bound_s=300.0, keep=tmp_path)
        assert out.verdict == "ok", out.as_dict()
        for rank in range(2):  # this run's one start of each rank, not the earlier run's too
            assert len((tmp_path / f"rank{rank}.starts").read_text().splitlines()) == 1


def test_the_finished_mark_waits_for_every_rank_that_will_step_again(tmp_path):
    """The parent tells lingering ranks the run is over (``FINISHED_MARK``) only once each rank saved its
    result or was killed for good: not while a restart or a fault is still due, nor while a rank (a stopped
    one) has yet to finish."""
    codes = {0: 0, 1: None, 2: -9}
    (tmp_path / "rank0.npz").touch()
    _mark_finished(tmp_path, codes, killed={2: 1.0}, restart=[], pending=[])
    assert not (tmp_path / FINISHED_MARK).exists()  # rank 1 is still running (stopped, or behind)
    (tmp_path / "rank1.npz").touch()
    _mark_finished(tmp_path, codes, killed={2: 1.0}, restart=[(5.0, 2)], pending=[])
    assert not (tmp_path / FINISHED_MARK).exists()  # rank 2 starts again: it may need a peer's state
    _mark_finished(tmp_path, codes, killed={2: 1.0}, restart=[], pending=[{"kind": "stop", "rank": 0}])
    assert not (tmp_path / FINISHED_MARK).exists()
    _mark_finished(tmp_path, codes, killed={}, restart=[], pending=[])
    assert not (tmp_path / FINISHED_MARK).exists()  # rank 2 not killed and no result: still to come
    _mark_finished(tmp_path, codes, killed={2: 1.0}, restart=[], pending=[])
    assert (tmp_path / FINISHED_MARK).exists()
