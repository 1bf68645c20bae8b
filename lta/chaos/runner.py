"""Run one chaos run (``schedule.RunSpec``) and judge it.

The parent starts ``world`` processes of :mod:`lta.chaos.worker`, watches their progress files, injects
the faults it owns (SIGKILL, SIGSTOP/SIGCONT, a killed rank started again: ``restart``) at their steps,
and allows ``bound_s`` seconds without a step of any rank once every live rank has made its first
(``STARTUP_S`` for the start-up only). A bound on progress, not on the whole run: on a host loaded 10x
past its cores a healthy step took 1.5 s instead of 0.05 s, and a 64-slot sharded run 20 s. Ranks of a
run with ``reorder``/``duplicate`` faults run inside a network namespace (``netns.py``). The verdict
(:func:`judge`) is one of:

- ``ok``: every rank that was not killed (or was started again and finished) exited 0, trained (final
  evaluation loss below ``TRAINED_RATIO`` of the first), and the replicas agree: exactly (``EXACT_TOL``)
  where the design says they are identical, within the staleness bound ``(B + 1) x`` the largest one-step
  change of a parameter where it says they may differ (B: the exchange's stale bound, the hook's
  re-broadcast period, the whole run for a backend whose replicas are never reset);
- ``ok-after-restart``: ``ok``, and a killed rank was started again (by the parent: ``restart``; by
  torchrun, which starts every rank of a ``TORCHRUN_DOORS`` run again from its last checkpoint), made
  steps and finished; ``restarts`` says how long it took and how many steps were done twice. A torchft
  replica still running ``LATE_GRACE_S`` after all its peers finished (started again, or stopped past
  the lighthouse's heartbeat timeout, too late for a quorum) is stopped by the parent and judged as a
  killed rank (``late``): the job is over, as a launcher would end it;
- ``loud``: some rank exited non-zero within the bound with a one-line error (its last stderr line:
  the cause; for a torchrun run, torchrun's own summary of the rank that failed last);
- ``hang``: no rank made a step for the bound and some were still running (the parent then has each
  write its threads' stacks to its ``.err`` file and kills them); a reduce that waits gives up after
  ``REDUCE_TIMEOUT_S`` (loud), so a bound of a few times that separates a hang from a slow run;
- ``silent``: every rank exited 0, but the parameters are untrained, not finite, or apart beyond the
  bound: at the end, or, where every step's parameters follow from the same aggregates on every rank
  (``STEPWISE_DOORS`` in an exact run), after any step (from the ranks' per-chunk sums). The hook's
  re-broadcast resets most chunks of parted replicas: judged at the end only, a run whose replicas
  parted (chaos seed 91) could have ended equal by chance and been called ok.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hostlib.errors import LtaError
from hostlib.lifetime import die_with_parent
from hostlib.liveness import DEFAULT_TIMEOUT_S as DEFAULT_LIVENESS_TIMEOUT_S
from lta.chaos import netns
from lta.chaos.schedule import NETNS_KINDS, RunSpec, drop_policy
from lta.chaos.worker import FINISHED_MARK, TORCHRUN_DOORS

TRAINED_RATIO = 0.5
EXACT_TOL = 1e-5
# Doors whose replicas are equal after every step of an exact run, not only at the end: each step applies
# the same aggregates to the same parameters (the sharded doors' copies may lag a step by design).
STEPWISE_DOORS = ("ddp", "hook", "fsdp2")
ELEMS_PER_PACKET = 64  # K of every run (the model's ~341 chunks)
STALE_BOUND = 4  # the sharded exchange's S
REBROADCAST_EVERY = 5  # the hook's re-broadcast period
REDUCE_TIMEOUT_S = 20.0  # a reduce that waits longer raises (one line): the loud-failure bound's core
POLL_S = 0.05
# A killed rank's peers are back at their step time within 2 s of the liveness timeout (the target).
RECOVERY_TARGET_S = DEFAULT_LIVENESS_TIMEOUT_S + 2.0
# Until every live rank has made its first step: importing torch in four processes took over 120 s at
# load 26 on 2 cores. A run still starting after this long is a hang too.
STARTUP_S = 600.0
# torchft door: the lighthouse declares a replica dead after the liveness timeout without a heartbeat, as
# the switch does a worker; a quorum (and a step) needs all but one replica (a kill leaves enough, a
# second rank down at the same time makes the others wait for a restart); a quorum that cannot form
# raises after FT_QUORUM_TIMEOUT_S (loud, not a hang).
FT_QUORUM_TIMEOUT_S = 60.0
FT_JOIN_TIMEOUT_MS = 5000  # how long a quorum waits for a replica that heartbeats but has not asked
LATE_GRACE_S = 5.0  # torchft: a replica still running this long after all its peers finished is late


@dataclass(frozen=True)
class Signal:
    """A signal the parent sent (its clock): ``SIGKILL`` (a ``kill``, or the kill of a ``restart``),
    ``SIGSTOP`` or ``SIGCONT`` (a ``stop``)."""

    at: float
    name: str
    rank: int


@dataclass
class Outcome:
    spec: RunSpec
    verdict: str = "ok"
    cause: str = ""
    wall_s: float = 0.0
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    divergence: float | None = None
    divergence_bound: float | None = None
    loss_ratio: float | None = None
    recovery_s: float | None = None  # the slowest kill's recoveries[i]["recovery_s"]; None if one is
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # per kill: _recovery
    restarts: list[dict[str, Any]] = field(default_factory=list)  # per kill started again: _restarts
    # A torchrun run that gave up after a kill: seconds from the first kill to the parent seeing every
    # rank gone (within a poll). None otherwise.
    ended_after_kill_s: float | None = None
    late: list[int] = field(default_factory=list)  # torchft: ranks stopped as late (runner._late)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "spec"}
        out.update(self.spec.as_dict())
        out["exit_codes"] = {str(k): v for k, v in self.exit_codes.items()}
        return out


def _worker_spec(spec: RunSpec, out: Path) -> dict[str, Any]:
    drop, pool, clock, restart = {}, 512, None, None
    for f in spec.faults:
        if f["kind"].startswith("loss-"):
            drop[f["direction"]] = drop_policy(f)
        elif f["kind"] == "small-pool":
            pool = f["pool_size"]
        elif f["kind"] == "clock":
            clock = {"rank": f["rank"], "step": f["step"], "offset_s": f["offset_s"]}
        elif f["kind"] == "switch-restart":
            restart = f["step"]
    return {
        "door": spec.door,
        "world": spec.world,
        "steps": spec.steps,
        "seed": spec.seed,
        "out": str(out),
        "store": str(out / "store"),
        "drop": drop,
        "pool_size": pool,
        "elems_per_packet": ELEMS_PER_PACKET,
        "reduce_timeout_s": REDUCE_TIMEOUT_S,
        "stale_bound": STALE_BOUND,
        "rebroadcast_every": REBROADCAST_EVERY,
        "clock": clock,
        "switch_restart_at": restart,
        "hidden": spec.hidden,
        "step_s": spec.step_s,
        "ft_min_replicas": max(1, spec.world - 1),
        "ft_quorum_timeout_s": FT_QUORUM_TIMEOUT_S,
    }


def bound_s(spec: RunSpec, base_s: float) -> float:
    """The run's bound on a stretch without progress: ``base_s`` plus every SIGSTOP's seconds."""
    return base_s + sum(f.get("seconds", 0.0) for f in spec.faults)


def _ps_server(spec: RunSpec) -> Any:
    from hostlib.emulation.dropmodels import DropPolicy
    from softswitch.ps.config import PsDrop, PsJobConfig
    from softswitch.ps.server import PsServer

    drops = tuple(
        PsDrop(f["direction"], DropPolicy.from_dict(drop_policy(f)))
        for f in spec.faults
        if f["kind"] in ("loss-up", "loss-down")
    )
    server = PsServer(seed=spec.seed).start()
    server.add_job(
        PsJobConfig(
            job_id=1,
            n_workers=spec.world,
            mode="sync",
            lr=1.0,
            momentum=0.9,
            elems_per_packet=64,
            drops=drops,
        )
    )
    return server


def lighthouse_binary() -> Path:
    """torchft's ``torchft_lighthouse`` (beside this interpreter, else on PATH); a one-line error naming
    the extra when torchft is not installed."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    if binary.exists():
        return binary
    found = shutil.which("torchft_lighthouse")
    if found is None:
        raise LtaError(
            "the torchft door needs torchft's lighthouse (torchft_lighthouse): "
            "pip install 'lta[ft]', or leave the door out with --doors"
        )
    return Path(found)


def _lighthouse(spec: RunSpec, prefix: list[str], out: Path) -> tuple[Any, str]:
    """torchft's lighthouse for a torchft run (its ``torchft_lighthouse`` binary, in the ranks' network
    namespace when they have one): the process and the address the ranks' Managers are given."""
    binary = lighthouse_binary()
    with socket.socket() as probe:  # a free port (inside a fresh namespace every port is)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [
        *prefix,
        str(binary),
        f"--bind=127.0.0.1:{port}",
        f"--min_replicas={max(1, spec.world - 1)}",
        f"--heartbeat_timeout_ms={int(DEFAULT_LIVENESS_TIMEOUT_S * 1000)}",
        f"--join_timeout_ms={FT_JOIN_TIMEOUT_MS}",
        "--quorum_tick_ms=50",
    ]
    log = open(out / "lighthouse.err", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(argv, stdout=log, stderr=log, preexec_fn=die_with_parent)  # noqa: PLW1509
    return (proc, log), f"http://127.0.0.1:{port}"


def run_one(spec: RunSpec, base_bound_s: float = 120.0, keep: Path | None = None) -> Outcome:
    """Run ``spec`` to its verdict. ``keep``: a folder for the run's files (default: a temporary one);
    what an earlier run left there is removed first."""
    with tempfile.TemporaryDirectory(prefix="lta-chaos-") as tmp:
        out = keep or Path(tmp)
        if keep is not None and keep.exists():
            # An earlier run's FileStore would hand this run's ranks its worker addresses and "ready" key,
            # and its progress and start files would pass for this run's.
            shutil.rmtree(keep)
        out.mkdir(parents=True, exist_ok=True)
        wspec = _worker_spec(spec, out)
        (out / "spec.json").write_text(json.dumps(wspec))
        # LTA_PARENT_PID: each rank asks to die with this process (hostlib.lifetime)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "LTA_ON_UNHEALTHY": "raise",
            "LTA_PARENT_PID": str(os.getpid()),
        }
        server = _ps_server(spec) if spec.door == "ps" else None
        if server is not None:
            env["LTA_PS"] = "{}:{}".format(*server.address)
        disorder = [f for f in spec.faults if f["kind"] in NETNS_KINDS]
        ns = f"P3chaos{spec.seed}-{os.getpid()}"
        lighthouse = None
        try:
            prefix = netns.create(ns, disorder) if disorder else []
            if spec.door == "torchft":
                lighthouse, env["TORCHFT_LIGHTHOUSE"] = _lighthouse(spec, prefix, out)
            return _watch(spec, out, env, bound_s(spec, base_bound_s), prefix)
        finally:
            if lighthouse is not None:
                lighthouse[0].kill()
                lighthouse[0].wait()
                lighthouse[1].close()
            if disorder:
                netns.delete(ns)
            if server is not None:
                server.stop()


def max_restarts(spec: RunSpec) -> int:
    """torchrun's ``--max-restarts`` for a ``TORCHRUN_DOORS`` run: one per kill the schedule holds (a
    ``restart`` is a kill there too: torchrun, not the parent, starts the ranks again), unless the spec
    sets ``torchrun_restarts``."""
    if spec.torchrun_restarts is not None:
        return spec.torchrun_restarts
    return sum(1 for f in spec.faults if f["kind"] in ("kill", "restart"))


class _TorchrunRank:
    """Rank ``r`` of a torchrun job, as :func:`_watch` handles one of its own processes: signals go to
    the pid the rank wrote (``rank{R}.pid``, the current one after a restart); its status and exit code
    are the agent's (torchrun ends every rank when one fails, and exits 0 only if all finished)."""

    def __init__(self, agent: Any, out: Path, rank: int) -> None:
        self.agent, self.out, self.rank = agent, out, rank

    @property
    def returncode(self) -> int | None:
        return self.agent.returncode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.agent.poll()  # type: ignore[no-any-return]

    def send_signal(self, sig: int) -> None:
        try:
            pid = int((self.out / f"rank{self.rank}.pid").read_text())
            os.kill(pid, sig)
        except (OSError, ValueError):  # not started yet, or already gone
            pass

    def kill(self) -> None:
        self.agent.kill()

    def wait(self) -> int:
        return self.agent.wait()  # type: ignore[no-any-return]


def _start_torchrun(spec: RunSpec, out: Path, env: dict[str, str], prefix: list[str]) -> dict[int, Any]:
    """Start the run's ranks under torchrun (one agent for all; ``max_restarts``); its own output goes to
    ``torchrun.err``."""
    err = open(out / "torchrun.err", "w")  # noqa: SIM115 (closed with the process)
    argv = [
        *prefix,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={spec.world}",
        f"--max-restarts={max_restarts(spec)}",
        "--monitor-interval=0.1",
        "-m",
        "lta.chaos.worker",
        str(out / "spec.json"),
        "env",
    ]
    agent = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=err,
        env=env,
        preexec_fn=die_with_parent,  # noqa: PLW1509
    )
    return {r: (_TorchrunRank(agent, out, r), err) for r in range(spec.world)}


def _start(out: Path, env: dict[str, str], r: int, prefix: list[str], restarted: bool = False) -> Any:
    """Start rank ``r`` (again, with ``restarted``: its stderr is appended to, after a marker line)."""
    err = open(out / f"rank{r}.err", "a" if restarted else "w")  # noqa: SIM115 (closed with the process)
    argv = [*prefix, sys.executable, "-m", "lta.chaos.worker", str(out / "spec.json"), str(r)]
    if restarted:
        err.write("--- restarted by the chaos parent ---\n")
        err.flush()
        argv.append("restarted")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
    return proc, err


def _watch(spec: RunSpec, out: Path, env: dict[str, str], limit_s: float, prefix: list[str]) -> Outcome:
    torchrun = spec.door in TORCHRUN_DOORS
    if torchrun:
        procs = _start_torchrun(spec, out, env, prefix)
    else:
        procs = {r: _start(out, env, r, prefix) for r in range(spec.world)}
    t0 = time.monotonic()
    steps_at: dict[int, list[float]] = {r: [] for r in procs}  # the parent's clock at each rank's steps
    numbers: dict[int, list[int]] = {r: [] for r in procs}  # the step each of those lines completed
    pending = [dict(f) for f in spec.faults if f["kind"] in ("kill", "restart", "stop")]
    resume: list[tuple[float, int]] = []
    restart: list[tuple[float, int]] = []
    killed: dict[int, float] = {}  # ranks killed and not (yet) restarted
    kill_times: dict[int, float] = {}
    late: list[int] = []  # torchft: ranks still running LATE_GRACE_S after all their peers had finished
    peers_done: float | None = None  # torchft: since when only such ranks are left
    signals: list[Signal] = []  # every SIGKILL, SIGSTOP and SIGCONT sent, for the kill recovery
    old: list[tuple[Any, Any]] = []  # the killed processes, closed at the end
    outcome = Outcome(spec)
    try:
        while True:
            now = time.monotonic()
            _read_progress(out, steps_at, now, numbers)
            for f in list(pending):
                if len(steps_at[f["rank"]]) >= f["step"]:
                    pending.remove(f)
                    proc = procs[f["rank"]][0]
                    if proc.poll() is not None:
                        continue
                    if f["kind"] in ("kill", "restart"):
                        proc.send_signal(signal.SIGKILL)
                        kill_times[f["rank"]] = now
                        signals.append(Signal(now, "SIGKILL", f["rank"]))
                        if not torchrun:  # torchrun starts it (and every other rank) again itself
                            killed[f["rank"]] = now
                        if f["kind"] == "restart" and not torchrun:
                            restart.append((now + f["delay_s"], f["rank"]))
                    else:
                        proc.send_signal(signal.SIGSTOP)
                        signals.append(Signal(now, "SIGSTOP", f["rank"]))
                        resume.append((now + f["seconds"], f["rank"]))
            for at, r in list(resume):
                if now >= at:
                    resume.remove((at, r))
                    if procs[r][0].poll() is None:
                        procs[r][0].send_signal(signal.SIGCONT)
                        signals.append(Signal(now, "SIGCONT", r))
            for at, r in list(restart):
                if now >= at:  # the killed rank starts again: from now on its exit status counts
                    restart.remove((at, r))
                    procs[r][0].wait()
                    old.append(procs[r])
                    procs[r] = _start(out, env, r, prefix, restarted=True)
                    del killed[r]
            codes = {r: p.poll() for r, (p, _) in procs.items()}
            _mark_finished(out, codes, killed, restart, pending)
            waiting = _late(codes, killed) if spec.door == "torchft" else []
            peers_done = (peers_done or now) if waiting else None
            if peers_done is not None and now - peers_done >= LATE_GRACE_S:
                # Its peers finished and left: no quorum will form again for it to step (or heal) in.
                # The job is over; a launcher stops what is left of it, as the parent does here.
                for r in waiting:
                    procs[r][0].send_signal(signal.SIGCONT)
                    procs[r][0].kill()
                    procs[r][0].wait()
                    killed[r] = now
                    late.append(r)
                    codes[r] = procs[r][0].returncode
            live = [r for r, c in codes.items() if c is None]
            failed = [r for r, c in codes.items() if c not in (None, 0) and r not in killed]
            if (not live and not restart) or failed:
                if torchrun and kill_times and failed and not live:  # torchrun gave up
                    outcome.ended_after_kill_s = round(now - min(kill_times.values()), 2)
                if failed:  # the others may wait on the failed one: give them a moment, then judge
                    _drain(procs, killed, time.monotonic(), limit_s, out, steps_at, numbers)
                break
            started = all(steps_at[r] for r in live)
            last_step = max([t0] + [times[-1] for times in steps_at.values() if times])
            stalled = started and now - last_step > limit_s
            if stalled or (not started and now - t0 > max(limit_s, STARTUP_S)):
                at = {r: len(steps_at[r]) for r in live}
                outcome.verdict = "hang"
                waited = (
                    f"made no step for {limit_s:.0f} s"
                    if stalled
                    else f"not all started in {STARTUP_S:.0f} s"
                )
                outcome.cause = f"ranks {live} {waited}, at steps {at}"
                for r in live:  # each writes its threads' stacks to its .err file (faulthandler)
                    procs[r][0].send_signal(signal.SIGCONT)
                    procs[r][0].send_signal(signal.SIGUSR1)
                time.sleep(1.0)
                break
            time.sleep(POLL_S)
    finally:
        for p, err in [*procs.values(), *old]:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
            err.close()
    _read_progress(out, steps_at, time.monotonic(), numbers)
    outcome.wall_s = round(time.monotonic() - t0, 2)
    outcome.exit_codes = {r: p.returncode for r, (p, _) in procs.items()}
    outcome.recoveries = _recovery(steps_at, signals)
    outcome.late = late
    outcome.restarts = _restarts(out, steps_at, numbers, signals, late, "torchrun" if torchrun else "parent")
    per_kill = [k["recovery_s"] for k in outcome.recoveries]
    if per_kill and None not in per_kill:
        outcome.recovery_s = max(t for t in per_kill if t is not None)
    if outcome.verdict == "hang":
        return outcome
    # torchrun starts every rank again from the same checkpoint: their step histories stay aligned.
    return judge(outcome, out, killed, interrupted=() if torchrun else set(kill_times))


def _mark_finished(
    out: Path, codes: dict[int, int | None], killed: Collection[int], restart: list[Any], pending: list[Any]
) -> None:
    """Write ``FINISHED_MARK`` once no rank will step again: each has saved its result or was killed for
    good (no restart due, no fault pending). The ranks lingering for a silent peer (``Healer.linger``)
    then exit: the peer they waited for is dead, or done."""
    mark = out / FINISHED_MARK
    if restart or pending or mark.exists():
        return
    if all(r in killed or (out / f"rank{r}.npz").exists() for r in codes):
        mark.touch()


def _late(codes: dict[int, int | None], killed: Collection[int]) -> list[int]:
    """torchft: the ranks still running while every other rank still in the run has finished (exit 0):
    a replica steps (and heals) only in a quorum of at least ``world - 1`` replicas, and none will form
    again. A replica stopped past the lighthouse's heartbeat timeout, or started again, when its peers
    had too few steps left to wait for it, is one."""
    waiting = [r for r, c in codes.items() if c is None and r not in killed]
    others = [c for r, c in codes.items() if r not in waiting and r not in killed]
    return waiting if waiting and others and all(c == 0 for c in others) else []


def _read_progress(
    out: Path, steps_at: dict[int, list[float]], now: float, numbers: dict[int, list[int]] | None = None
) -> None:
    """Each rank's steps finished since the last look, stamped ``now`` (the parent's clock); with
    ``numbers``, the training step each completed (the first field of its line)."""
    for r, times in steps_at.items():
        path = out / f"rank{r}.progress"
        if path.exists():
            lines = path.read_text().splitlines(keepends=True)
            lines = [line for line in lines if line.endswith("\n")]  # a line half written: next look
            new = lines[len(times) :]
            times.extend([now] * len(new))
            if numbers is not None:
                numbers[r].extend(int(line.split()[0]) for line in new)


def _drain(
    procs: dict[int, Any],
    killed: dict[int, float],
    t0: float,
    limit_s: float,
    out: Path,
    steps_at: dict[int, list[float]],
    numbers: dict[int, list[int]] | None = None,
) -> None:
    """After one rank failed: wait (up to the bound) for the others to fail or finish too, their steps
    still recorded (a restarted rank that fails while the survivors are still slow from the kill would
    otherwise cut their recovery short: chaos seed 19, whose survivors were back at pace after the
    failure, read as never back)."""
    while time.monotonic() - t0 < limit_s:
        _read_progress(out, steps_at, time.monotonic(), numbers)
        if all(p.poll() is not None for r, (p, _) in procs.items() if r not in killed):
            _read_progress(out, steps_at, time.monotonic(), numbers)
            return
        time.sleep(POLL_S)
    for p, _ in procs.values():  # still running: each writes its stacks to its .err (faulthandler)
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGUSR1)
    time.sleep(1.0)


def _recovery(steps_at: dict[int, list[float]], signals: list[Signal]) -> list[dict[str, Any]]:
    """For each SIGKILL: seconds until the survivors' steps are back to their pace (the slowest survivor's
    first step within 1.5x its median step time before the run's first signal; ``recovery_s`` None when
    one never got back to it). The target is ``RECOVERY_TARGET_S``: the liveness timeout plus 2 s.

    Measured from the kill, unless another SIGKILL or SIGSTOP came before the survivors were back and
    within the target of the kill (``after``): then from that signal (the last such), and
    ``from_kill_s`` keeps the time from the kill. A rank stopped or killed in the kill's liveness window
    makes the survivors wait for it too, until its own liveness timeout: timed from the kill, that wait
    is charged to the kill (chaos seed 26: rank 2 stopped 1.8 s after rank 3's kill; its peers were at
    pace 3.2 s after the stop, 5.0 s after the kill; seed 19: a second kill 2.5 s after the first). The
    target still applies from that signal, and a signal that comes when the survivors are already slow
    past the target excuses nothing: the kill has missed it. A SIGCONT moves nothing: a rank coming back
    starts no such wait (nothing measured shows it slowing its peers), and a resume just after a kill
    would otherwise excuse that kill's slow survivors.

    Survivors are the ranks never killed (a restarted rank's steps are its new run's) and not stopped at
    the kill or after it: a stopped rank's own steps stop for its T seconds, so as a survivor its stop
    read as the kill's recovery (chaos seed 68: 9.33 s measured; its peers were at pace 3.4 s after the
    kill, the stopped rank came back 9.3 s after it). A restarted rank's new process start moves no
    anchor: it is the restart's own second half, and its cost (importing torch on a shared host, a
    rejoin that fails on the torch doors) stays charged to the kill."""
    kills = [s for s in signals if s.name == "SIGKILL"]
    if not kills:
        return []
    first = min(s.at for s in signals)
    ever_killed = {s.rank for s in kills}
    out = []
    for kill in kills:
        stopped = {s.rank for s in signals if s.name == "SIGSTOP" and s.at >= kill.at}
        stopped |= _stopped_at(signals, kill.at)
        paces = {r: _pace(steps_at[r], first) for r in steps_at if r not in ever_killed | stopped}
        anchor, after, recovered = kill.at, None, None
        while True:
            back = [_back_at(steps_at[r], anchor, pace) for r, pace in paces.items() if pace is not None]
            if not back or None in back:
                recovered = None
                break
            recovered = max(b for b in back if b is not None)
            between = [
                s
                for s in signals
                if s is not kill
                and s.name in ("SIGKILL", "SIGSTOP")
                and anchor < s.at < min(recovered, anchor + RECOVERY_TARGET_S)
            ]
            if not between:
                break
            last = max(between, key=lambda s: s.at)
            anchor, after = last.at, f"{last.name} of rank {last.rank} {last.at - kill.at:+.2f} s"
        out.append(
            {
                "rank": kill.rank,
                "recovery_s": None if recovered is None else round(recovered - anchor, 2),
                "from_kill_s": None if recovered is None else round(recovered - kill.at, 2),
                "after": after,
                "survivors": sorted(r for r, p in paces.items() if p is not None),
            }
        )
    return out


def _restarts(
    out: Path,
    steps_at: dict[int, list[float]],
    numbers: dict[int, list[int]],
    signals: list[Signal],
    late: Collection[int] = (),
    by: str = "parent",
) -> list[dict[str, Any]]:
    """For each SIGKILL whose rank was started again (by the parent, or by torchrun: a later line in the
    rank's ``.starts`` file): ``started_s`` (from the kill to the new process's start), ``first_step_s``
    (from that start to its first finished step; the target is 10 s), ``from_kill_s`` (the kill to that
    step), ``resumed_at`` (the step it went on from: 0 for a rank that starts its run over, a torchrun
    run's checkpoint step, the step a torchft replica healed to) and ``lost_steps`` (steps done twice:
    the furthest step any rank had finished at the kill, less ``resumed_at``; 0 when it went on from
    there). ``late``: ranks started again after the run had ended for their peers (torchft: no quorum
    left to heal in), stopped by the parent; no first step. None where a time never came."""
    found = []
    for kill in (s for s in signals if s.name == "SIGKILL"):
        later = [t for t in _start_times(out, kill.rank) if t > kill.at]
        if not later:
            continue
        began = later[0]
        times, nums = steps_at[kill.rank], numbers[kill.rank]
        first = next((i for i, t in enumerate(times) if t > began), None)
        furthest = max(
            (n for r in steps_at for t, n in zip(steps_at[r], numbers[r], strict=False) if t <= kill.at),
            default=0,
        )
        entry: dict[str, Any] = {
            "rank": kill.rank,
            "by": by,
            "started_s": round(began - kill.at, 2),
            "first_step_s": None,
            "from_kill_s": None,
            "resumed_at": None,
            "lost_steps": None,
            "late": kill.rank in late,
        }
        if first is not None and first < len(nums):
            resumed = nums[first] - 1
            entry.update(
                first_step_s=round(times[first] - began, 2),
                from_kill_s=round(times[first] - kill.at, 2),
                resumed_at=resumed,
                lost_steps=max(0, furthest - resumed),
            )
        found.append(entry)
    return found


def _start_times(out: Path, rank: int) -> list[float]:
    """When each process of ``rank`` started (``rank{R}.starts``, the monotonic clock the parent uses)."""
    path = out / f"rank{rank}.starts"
    if not path.exists():
        return []
    return [float(line.split()[0]) for line in path.read_text().splitlines() if line.strip()]


def _stopped_at(signals: list[Signal], t: float) -> set[int]:
    """The ranks stopped (SIGSTOP sent, no SIGCONT yet) at time ``t``."""
    state: dict[int, bool] = {}
    for s in sorted(signals, key=lambda s: s.at):
        if s.at > t:
            break
        if s.name in ("SIGSTOP", "SIGCONT"):
            state[s.rank] = s.name == "SIGSTOP"
    return {r for r, on in state.items() if on}


def _pace(times: list[float], before: float) -> float | None:
    """1.5x the median step time before ``before`` (at least two polls); None with under 3 steps."""
    t = np.asarray(times)
    gaps = np.diff(t[t <= before])
    if len(gaps) < 3:
        return None
    positive = gaps[gaps > 0]
    pace = 1.5 * float(np.median(positive)) if positive.size else 0.0
    return max(pace, 2 * POLL_S)


def _back_at(times: list[float], anchor: float, pace: float) -> float | None:
    """When the first step at ``pace`` after ``anchor`` began: a step after ``anchor`` whose next one came
    within ``pace`` (the first step after a fault ends the wait the fault caused); None if none did."""
    t = np.asarray(times)
    after = t[t > anchor]
    ok = np.flatnonzero(np.diff(after) <= pace)
    return float(after[ok[0]]) if ok.size else None


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "(no message)"


def judge(
    outcome: Outcome, out: Path, killed: dict[int, float], interrupted: Collection[int] = ()
) -> Outcome:
    """The verdict (module docstring). ``killed``: ranks killed and not started again (no result);
    ``interrupted``: every rank killed at some point (a restarted one's steps are its own run's).
    ``ok`` becomes ``ok-after-restart`` when ``outcome.restarts`` holds a rank started again that made
    steps (its result is among those judged)."""
    _judge(outcome, out, killed, interrupted)
    if outcome.verdict == "ok" and any(r["first_step_s"] is not None for r in outcome.restarts):
        outcome.verdict = "ok-after-restart"
    return outcome


def _judge(outcome: Outcome, out: Path, killed: dict[int, float], interrupted: Collection[int]) -> Outcome:
    spec = outcome.spec
    failed = {r: c for r, c in outcome.exit_codes.items() if r not in killed and c != 0}
    if failed and spec.door in TORCHRUN_DOORS:
        outcome.verdict, outcome.cause = "loud", _torchrun_cause(out, failed)
        return outcome
    if failed:
        # The cause is a rank that exited by itself (a positive status); the parent's SIGKILL of ranks
        # still running after the bound is no cause (their last line says what they were doing).
        r = min(failed, key=lambda r: (failed[r] is None or failed[r] < 0, r))
        outcome.verdict, outcome.cause = (
            "loud",
            f"rank {r} exit {failed[r]}: {_last_line(out / f'rank{r}.err')}",
        )
        return outcome
    ranks = [r for r in outcome.exit_codes if r not in killed]
    results = [np.load(out / f"rank{r}.npz") for r in ranks]
    params = np.stack([res["params"] for res in results])
    ratio = max(float(res["final_loss"]) / float(res["first_loss"]) for res in results)
    step = max(float(res["max_step_change"]) for res in results)
    divergence = float(np.abs(params - params[0]).max()) if np.isfinite(params).all() else float("inf")
    bound = _divergence_bound(spec, step)
    if spec.door == "ps" and _exact(spec):
        divergence, bound = _ps_divergence(results, params, step, bound)
    outcome.loss_ratio, outcome.divergence, outcome.divergence_bound = round(ratio, 4), divergence, bound
    if not np.isfinite(params).all():
        outcome.verdict, outcome.cause = "silent", "exit 0 with non-finite parameters"
    elif ratio > TRAINED_RATIO:
        outcome.verdict, outcome.cause = "silent", f"exit 0 untrained: final/first loss {ratio:.3f}"
    elif divergence > bound:
        outcome.verdict, outcome.cause = (
            "silent",
            f"exit 0 with replicas apart by {divergence:.3g} > {bound:.3g}",
        )
    if outcome.verdict == "silent" or not (_exact(spec) and spec.door in STEPWISE_DOORS):
        return outcome
    steady = [res for r, res in zip(ranks, results, strict=True) if r not in interrupted]
    parted = _first_parting(steady, bound)
    if parted is not None:
        apart, at = parted
        outcome.verdict, outcome.cause = (
            "silent",
            f"exit 0 with replicas apart by at least {apart:.3g} > {bound:.3g} after step {at} "
            f"({divergence:.3g} at the end)",
        )
    return outcome


def _torchrun_cause(out: Path, failed: dict[int, int | None]) -> str:
    """One line for a torchrun run that failed: torchrun's exit status, and the rank its summary names
    first ("Root Cause") with its exit code, and that rank's own last line."""
    code = next(iter(failed.values()))
    summary = (out / "torchrun.err").read_text(errors="replace") if (out / "torchrun.err").exists() else ""
    rank = exitcode = None
    for line in summary[summary.find("Root Cause") :].splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "rank" and rank is None:
            rank = value.split()[0] if value.split() else None
        elif key.strip() == "exitcode" and exitcode is None:
            exitcode = value.split()[0] if value.split() else None
    if rank is None or not rank.isdigit():
        return f"torchrun exit {code}: {_last_line(out / 'torchrun.err') if summary else '(no message)'}"
    own = out / f"rank{rank}.err"
    last = _last_line(own) if own.exists() else "(no message)"
    return f"torchrun exit {code}: rank {rank} exitcode {exitcode}: {last}"


def _first_parting(results: list[Any], bound: float) -> tuple[float, int] | None:
    """The first step after which two replicas were apart by more than ``bound``, from the per-chunk sums
    each rank saved (``history``): a chunk sum that differs by d over k values means some value differs
    by at least d / k. None if they never were (or no rank saved its history)."""
    histories = [res["history"] for res in results if "history" in res and res["history"].size]
    if len(histories) < 2:
        return None
    steps = min(len(h) for h in histories)
    sums = np.stack([h[:steps] for h in histories])
    apart = np.abs(sums - sums[0]).max(axis=(0, 2)) / ELEMS_PER_PACKET
    over = np.flatnonzero(~(apart <= bound))  # NaN (a non-finite sum) counts as apart
    if not over.size:
        return None
    return float(apart[over[0]]), int(over[0]) + 1


def _exact(spec: RunSpec) -> bool:
    """Where the design says every replica holds the same parameters: no fault that lets one worker see
    what another does not (a lost RESULT or PARAM, a switch that forgot a round, a late PARAM)."""
    kinds = set(spec.kinds)
    if spec.door == "ps":
        return not kinds & {"loss-down", "kill", "stop", "clock", "restart"}
    if spec.door.startswith("sharded"):
        return not kinds & {"loss-param", "switch-restart", "stop", "clock", "kill", "restart", "reorder"}
    # reorder: a packet held in the slow class can come after its unit gave up, or be tail-dropped there.
    # stop, clock: the late rank finds units its peers' rounds have overtaken and falls back for them,
    # as for a lost RESULT (docs/protocol.md); stock DDP and FSDP2 never re-sync, the hook every period.
    return not kinds & {"loss-down", "switch-restart", "reorder", "stop", "clock"}


def _ps_divergence(results: list[Any], params: np.ndarray, step: float, bound: float) -> tuple[float, float]:
    """A sync parameter server's replicas are its versions: ranks that ended at the same version hold the
    same parameters (``bound``, exact), and a rank ``d`` versions past the first one may differ from it by
    ``d`` steps. A window closes without a rank that has not pushed within its max wait, so a rank that
    started late (importing torch on a loaded host) makes its steps one window later and ends one version
    past its peers (chaos seed 11, silent in 4 runs of 9 at load 8 before this rule). Returns the largest
    difference of two ranks beyond the steps their versions allow, and ``bound``."""
    versions = [int(res["version"]) if "version" in res else -1 for res in results]
    if min(versions) < 0:
        return float(np.abs(params - params[0]).max()), bound
    v = np.asarray(versions)
    pairs = np.abs(params[:, None, :] - params[None, :, :]).max(axis=2)  # every two ranks
    return max(0.0, float((pairs - step * np.abs(v[:, None] - v[None, :])).max())), bound


def _divergence_bound(spec: RunSpec, step: float) -> float:
    """Where replicas may differ: ``(B + 1)`` x the largest one-step change (module docstring). A parameter
    server worker started again runs its whole run in its new process, after its peers have finished
    too, alone: the server applies its pushes alone, so it ends up to a run's steps ahead of them."""
    if _exact(spec):
        return EXACT_TOL * max(1.0, step)
    if spec.door == "ps" and "restart" in spec.kinds:
        return (spec.steps + 1) * step
    periods = {"sharded": STALE_BOUND, "sharded-critical": STALE_BOUND, "hook": REBROADCAST_EVERY, "ps": 1}
    return (periods.get(spec.door, spec.steps) + 1) * step
