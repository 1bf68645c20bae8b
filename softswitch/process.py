"""One softswitch serving UDP from a process of its own, configured from the parent over a pipe.

The switches of a leaf-spine tree started as threads of one Python process share its interpreter lock:
while one of them runs a batch through the engine (which holds the lock), the others wait, so every hop
of the tree waits on the other switches' work as well as its own. Each switch in its own process
(:class:`SoftSwitchProcess`) has its own lock and is scheduled by the kernel like any daemon, as
``lta softswitch`` processes are in the netns tree (``lta demo --leaves L --netns``). On the loaded 2-core
host that did not make a tree faster against one switch (docs/results.md, "Leaf-spine trees"): the
relayed packets' system calls, not the lock, are most of a leaf's cost.

The parent keeps a :class:`~softswitch.pipeline.SoftSwitch` of its own (``switch``) that gets every job and
drop policy the child gets, so it holds the same tables; :meth:`SoftSwitchProcess.stop` copies the child's
counters, worker counters and slot registers into it (:meth:`SoftSwitch.job_state`), so after the run it
reads as the switch that served. What it does not copy: the drop streams' positions (a policy's next
decisions), which only a switch that goes on serving would need.
"""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection
from typing import Any, Self

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.lifetime import spawn_context
from softswitch.pipeline import JobConfig, SoftSwitch
from softswitch.server import SoftSwitchServer

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 60.0  # a fresh interpreter imports numpy and the engine before it serves
_CALL_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0


def _serve(conn: Connection, seed: int, listen: tuple[str, int]) -> None:
    """The child: serve a fresh switch on ``listen``, apply the parent's calls, hand back its state at stop
    (or stop when the parent goes away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    switch = SoftSwitch(seed=seed)
    try:
        server = SoftSwitchServer(switch, listen).start()
    except OSError as exc:
        conn.send(("error", f"softswitch cannot listen on {listen[0]}:{listen[1]}: {exc}"))
        return
    conn.send(("address", server.address))
    try:
        while True:
            op, args = conn.recv()
            if op == "stop":
                server.stop()
                states = {job: switch.job_state(job) for job in list(switch.jobs)}
                conn.send(("state", (states, server.cpu_s)))
                return
            try:
                getattr(switch, op)(*args)
            except (ValueError, KeyError) as exc:
                conn.send(("error", exc))
            else:
                conn.send(("ok", None))
    except (EOFError, OSError):  # the parent went away
        server.stop()


class SoftSwitchProcess:
    """A softswitch in a process of its own, serving UDP on ``listen`` (port 0: a free one); ``start()``,
    ``stop()`` and ``address`` as :class:`~softswitch.server.SoftSwitchServer`. Configure it through
    :meth:`add_job` and :meth:`set_drop_policy` (not through ``switch``, which mirrors the child: see the
    module docstring). ``seed`` seeds the child's drop decisions as ``SoftSwitch(seed)`` would."""

    def __init__(self, seed: int = 0, listen: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.switch = SoftSwitch(seed=seed)
        self.address: tuple[str, int] = listen
        self._ctx = spawn_context()
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(
            target=_serve, args=(child, seed, listen), name="softswitch", daemon=True
        )
        self._child_conn = child
        self.cpu_s = 0.0  # CPU seconds of the child's serving thread, known after stop()

    def start(self) -> Self:
        """Start the child and wait until it serves (raises RuntimeError if it cannot)."""
        self._proc.start()
        self._child_conn.close()
        kind, payload = self._answer(_READY_TIMEOUT_S, "start")
        if kind != "address":
            self._proc.join(_STOP_TIMEOUT_S)
            raise RuntimeError(str(payload))
        self.address = payload
        return self

    def add_job(self, cfg: JobConfig) -> None:
        self._call("add_job", cfg)
        self.switch.add_job(cfg)

    def set_drop_policy(
        self, job_id: int, direction: str, policy: DropPolicy | None, worker: int | None = None
    ) -> None:
        self._call("set_drop_policy", job_id, direction, policy, worker)
        self.switch.set_drop_policy(job_id, direction, policy, worker)

    def stop(self) -> None:
        """Stop the child and copy its jobs' state into ``switch`` and its serving thread's CPU time into
        ``cpu_s``; a child that does not answer within 5 s is killed (``switch`` then keeps the tables
        only, ``cpu_s`` stays 0, and the loss is logged)."""
        if not self._proc.is_alive():
            return
        try:
            self._conn.send(("stop", ()))
            kind, payload = self._answer(_STOP_TIMEOUT_S, "stop")
            if kind == "state":
                states, self.cpu_s = payload
                for job, state in states.items():
                    if job in self.switch.jobs:
                        self.switch.load_job_state(job, state)
        except (RuntimeError, OSError) as exc:
            log.warning("softswitch process %s: no state back at stop (%s)", self._proc.pid, exc)
        finally:
            self._proc.join(_STOP_TIMEOUT_S)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            self._conn.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, op: str, *args: Any) -> None:
        self._conn.send((op, args))
        kind, payload = self._answer(_CALL_TIMEOUT_S, op)
        if kind == "error":
            raise payload

    def _answer(self, timeout_s: float, what: str) -> tuple[str, Any]:
        if not self._conn.poll(timeout_s):
            alive = "still running" if self._proc.is_alive() else f"exit code {self._proc.exitcode}"
            raise RuntimeError(
                f"softswitch process gave no answer to {what} within {timeout_s:g} s ({alive})"
            )
        try:
            answer: tuple[str, Any] = self._conn.recv()
        except EOFError:
            raise RuntimeError(
                f"softswitch process ended during {what} (exit code {self._proc.exitcode})"
            ) from None
        return answer
