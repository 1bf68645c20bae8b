"""Workers end with their launcher (hostlib/lifetime.py): SIGTERM, SIGHUP or SIGKILL of the parent of a
spawned worker, of ``lta demo``, ``lta bench allreduce`` and ``lta chaos``, leaves none of its child
processes alive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

LTA = [sys.executable, "-m", "lta"]
SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL]
# Generous: the machine may be loaded. The kernel sends the signal when the parent exits; this bounds
# only how long a loaded scheduler takes to deliver it and reap.
GONE_WITHIN_S = 10.0


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has ended; only its parent's wait is missing


def _wait_for_children(proc: subprocess.Popen, at_least: int, limit_s: float = 120.0) -> set[int]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        kids = _children(proc.pid)
        if len(kids) >= at_least:
            return kids
        if proc.poll() is not None:
            raise AssertionError(
                f"the launcher exited ({proc.returncode}) before starting {at_least} children"
            )
        time.sleep(0.2)
    raise AssertionError(f"the launcher did not start {at_least} children within {limit_s:g} s")


def _kill_and_check(proc: subprocess.Popen, kids: set[int], sig: int) -> None:
    os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + GONE_WITHIN_S
    alive = {pid for pid in kids if _alive(pid)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = {pid for pid in alive if _alive(pid)}
    what = {pid: _cmdline(pid) for pid in alive}
    for pid in alive:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"children {what} outlived their parent's {signal.Signals(sig).name}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return "?"


# The stand-in launcher takes each signal's default action (to end), whatever it inherited: under
# `nohup` (a CI job started so) SIGHUP is ignored, the parent would never end, and the test would time
# out (a clean-clone run under nohup, 29 Nov 2026) without saying anything about its children.
PARENT = textwrap.dedent(
    """
    import signal
    import time
    from hostlib.lifetime import spawn_context

    signal.signal(signal.SIGHUP, signal.SIG_DFL)

    def sleeper():
        time.sleep(600)

    if __name__ == "__main__":
        procs = [spawn_context().Process(target=sleeper) for _ in range(2)]
        for p in procs:
            p.start()
        print(" ".join(str(p.pid) for p in procs), flush=True)
        time.sleep(600)
    """
)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_spawned_child_dies_with_its_parent(tmp_path, sig):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1]
    )
    try:
        kids = {int(pid) for pid in proc.stdout.readline().split()}
        assert len(kids) == 2 and all(_alive(pid) for pid in kids)
        _kill_and_check(proc, kids, sig)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_child_whose_parent_is_already_gone_exits(tmp_path):
    """The race the check after prctl closes: the parent died before the child asked."""
    code = "from hostlib.lifetime import die_with_parent; die_with_parent(parent_pid=1 << 22); print('alive')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "alive" not in out.stdout


def _launch(args: list[str], tmp_path: Path) -> subprocess.Popen:
    # TMPDIR: what the launcher keeps in a temporary folder (lta chaos: its run's files) is left behind by
    # a SIGKILL, which runs no cleanup; under tmp_path pytest removes it (in /tmp, one folder a CI run).
    return subprocess.Popen(
        [*LTA, *args],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "launcher.err", "w"),  # noqa: SIM115 (closed with the process)
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_lta_demo_workers_die_with_it(tmp_path, sig):
    proc = _launch(["demo", "--workers", "2", "--rounds", "100000", "--loss", "0", "--mib", "0.25"], tmp_path)
    try:
        kids = _wait_for_children(proc, 2)
        time.sleep(1.0)  # the workers are past their imports, in their reduces
        _kill_and_check(proc, kids | _children(proc.pid), sig)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_lta_bench_allreduce_workers_die_with_it(tmp_path):
    proc = _launch(["bench", "allreduce", "--workers", "2", "--iters", "100000"], tmp_path)
    try:
        kids = _wait_for_children(proc, 2)
        time.sleep(1.0)
        _kill_and_check(proc, kids | _children(proc.pid), signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_lta_chaos_ranks_die_with_it(tmp_path):
    proc = _launch(["chaos", "--seeds", "0", "--no-netns", "--out", str(tmp_path / "chaos")], tmp_path)
    try:
        kids = _wait_for_children(proc, 2)
        time.sleep(2.0)  # the ranks are importing or training; either way they must end with the parent
        _kill_and_check(proc, kids | _children(proc.pid), signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_lta_train_workers_die_with_it(tmp_path):
    proc = _launch(["train", "--quick", "--out", str(tmp_path / "train")], tmp_path)
    try:
        kids = _wait_for_children(proc, 2)
        time.sleep(2.0)
        _kill_and_check(proc, kids | _children(proc.pid), signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
