"""Child processes that end with their parent.

A launcher (``lta train``, ``demo``, ``chaos``, ``bench``) starts worker processes. When the launcher is
killed (``kill PID``, a scheduler's SIGTERM, SIGHUP of a closed terminal, SIGKILL), no ``finally`` of
its runs, so its workers would live on, holding their ports and the switch's job. On Linux a child asks
the kernel for a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``); :func:`die_with_parent`
does that, and :func:`spawn_context` is a ``multiprocessing`` spawn context whose processes do it before
their target runs. Elsewhere both do nothing (the launcher's own handlers still end its children on a
clean exit).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import multiprocessing as mp
import multiprocessing.context
import multiprocessing.resource_tracker
import os
import signal
import sys
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux). ``parent_pid``: the
    parent this process was started by; if it has already gone (it died before this call, and this
    process was re-parented), exit at once. Returns whether the request is in place. Safe in a
    ``preexec_fn`` (no allocation past the first call, no locks)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except OSError:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the request was in place: its signal will never come
    return True


class _Process(mp.context.SpawnProcess):
    """A spawned process that dies with the process that started it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lta_parent = os.getpid()

    def run(self) -> None:
        die_with_parent(parent_pid=self._lta_parent)
        super().run()


class _Context(mp.context.SpawnContext):
    Process = _Process


_CONTEXT = _Context()


def spawn_context() -> Any:
    """``multiprocessing.get_context("spawn")``, except that its processes die with their parent."""
    return _CONTEXT


def child_pids(pid: int | None = None) -> list[int]:
    """The live direct children of ``pid`` (default: this process), from /proc (Linux; [] elsewhere)."""
    me = os.getpid() if pid is None else pid
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] not in (b"Z", b"X"):
            found.append(int(name))
    return found


def end_children_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> dict[int, Any]:
    """On each of ``signals``: SIGKILL every child of this process at once (a worker still importing has
    not asked for its parent-death signal yet; multiprocessing's resource tracker is spared; it ends by
    itself once the others are gone, and cleans up after them), then raise ``SystemExit(128 + signal)``
    so that the launcher's own clean-up (``finally``, context managers) still runs. For a launcher's main
    thread; returns the handlers it replaced (for :func:`signal.signal` to put back)."""

    def handler(signum: int, _frame: object) -> None:
        tracker = getattr(getattr(mp, "resource_tracker", None), "_resource_tracker", None)
        spare = getattr(tracker, "_pid", None)
        for pid in child_pids():
            if pid != spare:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        raise SystemExit(128 + signum)

    return {sig: signal.signal(sig, handler) for sig in signals}
