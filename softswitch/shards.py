"""The softswitch on several cores: N shard processes behind one UDP address, each with a share of the slots.

Every shard is a process with its own :class:`~softswitch.server.SoftSwitchServer` loop and its own copy of
the jobs (the same TOML config), but only ever sees the packets of its slots, so the shards share no
state and need no locks between them. The steering is done by the kernel:

* The parent creates N UDP sockets with ``SO_REUSEPORT`` and binds them, in order, to the same
  HOST:PORT. A reuseport group numbers its sockets in bind order: socket i has index i.
* It attaches a classic BPF program to the group (``SO_ATTACH_REUSEPORT_CBPF``; :mod:`softswitch.reuseport`
  makes groups and programs). For UDP the kernel
  runs it with the packet data starting at the UDP payload, i.e. at the LTA header, and delivers the
  datagram to the socket whose index the program returns::

      ldh [8]          ; A = slot (big-endian u16 at offset 8 of the LTA header)
      rsh #7           ; A = the slot's block of 128 (SLOT_BLOCK_BITS)
      and #N-1         ; (N a power of two), else: mod #N
      ret a            ; socket index = (slot >> 7) % N

  Blocks, not single slots: a worker sends UDP GSO trains (up to 128 datagrams in one message), which
  loopback delivers whole and the kernel steers by their first datagram; a worker's train never spans two
  blocks (``hostlib.transport.io``), so every datagram of a slot reaches the shard that owns it. The shard
  sockets do not set ``UDP_GRO`` (they still send trains): a NIC's GRO could join the end of one train to
  the start of the next. A job's pool should hold 128·N slots or more, or some shards get no work.
  A datagram too short to hold the slot makes the load fail, the program return 0, and shard 0 drop it
  as malformed. The mapping is stable: it depends on the slot only, never on the sender or a hash.
* Each shard process gets its socket (the fd is passed at spawn), serves on it and sends its replies
  from it, so workers see a single switch at one source address and port.

The parent keeps its own reference to every socket until the shards have stopped: a socket leaving the
group would renumber the others (the kernel moves the last one into the hole), so membership never
changes while shards run. A shard that dies stops the whole set (``done`` is set, ``error`` says why)
rather than leave a share of the slots unserved.

Counters: each shard counts its own packets and sends them to the parent over its pipe every
``report_every`` seconds, when asked (:meth:`ShardedSoftSwitch.collect`) and when it stops;
:meth:`ShardedSoftSwitch.totals` sums them, in the shape of ``{job: SoftSwitch.read_counters(job)}``.

Emulated loss: each shard draws its own drop decisions. Shard 0 uses the config's seed (so one shard
replays a single switch), shard i > 0 a seed derived from (seed, i), so the shards' losses are
independent rather than the same sequence replayed on neighbouring slots.

Linux only (``SO_ATTACH_REUSEPORT_CBPF``); IPv4, like :mod:`hostlib.batchio`.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from hostlib.lifetime import spawn_context
from softswitch.config import load_switch
from softswitch.pipeline import SoftSwitch
from softswitch.reuseport import MAX_GROUP, Program, bind_group, slot_program
from softswitch.server import SoftSwitchServer

log = logging.getLogger(__name__)

MAX_SHARDS = MAX_GROUP

_READY_TIMEOUT_S = 60.0  # a shard imports numpy and loads the config before it is ready
_STOP_TIMEOUT_S = 5.0
_POLL_S = 0.2


def steering_program(n_shards: int) -> Program:
    """The classic BPF program ``(slot >> SLOT_BLOCK_BITS) % n_shards`` as (code, jt, jf, k) instructions."""
    return slot_program(n_shards)


def shard_sockets(
    listen: tuple[str, int], n_shards: int, buffer_bytes: int = 32 << 20
) -> list[socket.socket]:
    """N UDP sockets in one reuseport group on ``listen`` (port 0: one free port for all), bound in order
    so that socket i has group index i, with the steering program attached: socket i receives exactly
    the datagrams whose (slot >> SLOT_BLOCK_BITS) % N == i."""
    return bind_group(listen, n_shards, slot_program(n_shards), buffer_bytes)


class _ShardServer(SoftSwitchServer):
    """A SoftSwitchServer on a socket made (and bound) by someone else; remembers how its loop ended."""

    def __init__(self, switch: SoftSwitch, sock: socket.socket, io: str | None = None) -> None:
        # SoftSwitchServer.__init__ creates and binds its own sockets; this one serves ``sock``.
        self._serve_on(switch, [sock], io, gro=False)  # see the module docstring: steering needs no GRO
        self.exited = threading.Event()
        self.failure: str | None = None

    def serve_forever(self) -> None:
        try:
            super().serve_forever()
        except BaseException as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("shard serve loop failed")
        finally:
            self.exited.set()


def _shard_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def _report(kind: str, index: int, switch: SoftSwitch, server: _ShardServer | None) -> dict[str, Any]:
    return {
        "kind": kind,
        "shard": index,
        "counters": {job: switch.read_counters(job) for job in list(switch.jobs)},
        "send_errors": server.send_errors if server is not None else 0,
    }


def _send(conn: Connection, msg: dict[str, Any]) -> bool:
    try:
        conn.send(msg)
        return True
    except (OSError, EOFError):  # the parent went away
        return False


def _shard_main(
    index: int,
    sock: socket.socket,
    conn: Connection,
    config: str | None,
    io: str | None,
    report_every: float,
) -> None:
    """One shard process: serve ``sock`` until the parent says stop (or goes away, or SIGTERM)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = None
    try:
        switch = load_switch(config) if config else SoftSwitch()
        switch.seed = _shard_seed(switch.seed, index)
        for job in switch.jobs.values():
            job.seed = switch.seed
        server = _ShardServer(switch, sock, io)
    except Exception as exc:
        _send(conn, {"kind": "error", "shard": index, "error": f"{type(exc).__name__}: {exc}"})
        return
    send_lock = threading.Lock()  # the serve loop's thread (on_new_run) and this one both send

    def send(msg: dict[str, Any]) -> bool:
        with send_lock:
            return _send(conn, msg)

    # A new run seen here (a probe in this shard's slots): the other shards must forget their slots too
    # before any worker sends a unit; the parent relays, and this shard holds the job's probes meanwhile.
    def new_run(job: int, incarnation: int) -> None:
        send({"kind": "new_run", "shard": index, "job": job, "incarnation": incarnation})

    switch.on_new_run = new_run
    server.start()
    send(_report("ready", index, switch, server))
    next_report = time.monotonic() + report_every
    try:
        while not stop.is_set() and not server.exited.is_set():
            if conn.poll(min(_POLL_S, max(0.0, next_report - time.monotonic()))):
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break  # the parent is gone: stop, leave no orphan
                if msg == "stop":
                    break
                if msg == "report" and not send(_report("report", index, switch, server)):
                    break
                if isinstance(msg, dict) and msg.get("kind") == "start_run":
                    switch.start_run(msg["job"], msg["incarnation"])
                    if not send({**msg, "kind": "run_started", "shard": index}):
                        break
                if isinstance(msg, dict) and msg.get("kind") == "release_run":
                    switch.release_run(msg["job"])
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + report_every
                if not send(_report("report", index, switch, server)):
                    break
    finally:
        server.stop()
        if server.failure is not None:
            send({"kind": "error", "shard": index, "error": server.failure})
        send(_report("final", index, switch, server))
        conn.close()


class ShardedSoftSwitch:
    """``n_shards`` softswitch processes behind ``listen``, slot % n_shards steering packets to shard i.

    ``start()`` binds the sockets, spawns the shards and returns once every shard serves (or raises);
    ``stop()`` stops them (idempotent). ``done`` is set when a shard fails (``error`` says how) or
    ``stop()`` was called. ``totals()`` is the sum of the shards' last counter reports; ``collect()``
    asks every shard for a fresh report first."""

    def __init__(
        self,
        config: str | Path | None,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        n_shards: int = 2,
        *,
        io: str | None = None,
        buffer_bytes: int = 32 << 20,
        report_every: float = 1.0,
    ) -> None:
        steering_program(n_shards)
        if report_every <= 0:
            raise ValueError(f"report_every must be > 0, got {report_every}")
        self.config = str(config) if config is not None else None
        # Loaded here too so that a bad config fails before any process starts, and for the job list.
        self.jobs = sorted((load_switch(self.config) if self.config else SoftSwitch()).jobs)
        self.listen = listen
        self.n_shards = n_shards
        self.io = io
        self.buffer_bytes = buffer_bytes
        self.report_every = report_every
        self.address: tuple[str, int] | None = None
        self.done = threading.Event()
        self.error: str | None = None
        self._socks: list[socket.socket] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._reports: list[dict[str, Any] | None] = [None] * n_shards
        self._seen = [0] * n_shards  # reports received per shard
        self._finished = [False] * n_shards  # final report received
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._stopped = False
        # New runs being relayed: (job, incarnation) -> (the shard that saw it, shards not yet reset).
        self._runs: dict[tuple[int, int], tuple[int, set[int]]] = {}
        self._send_lock = threading.Lock()  # the reader relays while collect()/stop() ask

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> ShardedSoftSwitch:
        self._socks = shard_sockets(self.listen, self.n_shards, self.buffer_bytes)
        self.address = self._socks[0].getsockname()
        ctx = spawn_context()  # no fork of a possibly threaded parent
        try:
            for i, sock in enumerate(self._socks):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=_shard_main,
                    args=(i, sock, child_end, self.config, self.io, self.report_every),
                    name=f"softswitch-shard-{i}",
                    daemon=True,  # multiprocessing's exit hook terminates a shard the parent forgot
                )
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
            self._reader = threading.Thread(target=self._read_reports, name="softswitch-shards", daemon=True)
            self._reader.start()
            deadline = time.monotonic() + _READY_TIMEOUT_S
            with self._cond:
                while not self.done.is_set() and not all(self._seen):
                    if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                        self.error = f"shards not ready after {_READY_TIMEOUT_S:.0f} s"
                        break
            if self.error is not None:
                raise RuntimeError(f"softswitch shards failed to start: {self.error}")
        except BaseException:
            self.stop()
            raise
        log.info("softswitch: %d shards on %s:%d", self.n_shards, *self.address)
        return self

    def stop(self) -> None:
        """Stop every shard (final counter reports are kept), then close the sockets."""
        if self._stopped:
            return
        self._stopping = True
        for i in range(len(self._conns)):
            self._send_to(i, "stop")
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                log.warning("shard %s did not stop in %.0f s; terminating it", proc.name, _STOP_TIMEOUT_S)
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        if self._reader is not None:
            self._reader.join(2.0)
        for conn in self._conns:
            conn.close()
        for sock in self._socks:
            sock.close()
        self._stopped = True
        self.done.set()
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> ShardedSoftSwitch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pids(self) -> list[int | None]:
        return [proc.pid for proc in self._procs]

    # ---- counters ----------------------------------------------------------------------------
    def collect(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Ask every running shard for its counters now; return the latest report of each shard."""
        with self._cond:
            before = list(self._seen)
        for i in range(len(self._conns)):
            if not self._finished[i]:
                self._send_to(i, "report")
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(s > b or f for s, b, f in zip(self._seen, before, self._finished, strict=True)):
                if self.done.is_set() and not self._stopping:
                    break
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"shards did not report their counters in {timeout} s")
            return [dict(r) if r is not None else {} for r in self._reports]

    def shard_counters(self) -> list[dict[int, dict[str, int]]]:
        """The last reported counters of each shard: ``[{job: {name: value}}]``, index = shard."""
        with self._cond:
            return [dict(r["counters"]) if r is not None else {} for r in self._reports]

    def totals(self) -> dict[int, dict[str, int]]:
        """The sum over shards of the last reported counters, ``{job: {name: value}}``."""
        total: dict[int, dict[str, int]] = {}
        for counters in self.shard_counters():
            for job, values in counters.items():
                acc = total.setdefault(job, dict.fromkeys(values, 0))
                for name, value in values.items():
                    acc[name] = acc.get(name, 0) + value
        return dict(sorted(total.items()))

    def send_errors(self) -> int:
        with self._cond:
            return sum(r["send_errors"] for r in self._reports if r is not None)

    # ---- parent side of the pipes ------------------------------------------------------------
    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        log.error("softswitch: %s", message)
        self.done.set()

    def _relay_run(self, shard: int, msg: dict[str, Any]) -> None:
        """A new run (docs/protocol.md, "Run after run") seen by ``shard``: every other shard forgets the
        job's slots, then ``shard`` answers the job's probes again. Runs in the reader thread."""
        key = (msg["job"], msg["incarnation"])
        if msg["kind"] == "new_run":
            others = set(range(self.n_shards)) - {shard}
            self._runs[key] = (shard, others)
            for other in others:
                self._send_to(
                    other, {"kind": "start_run", "job": msg["job"], "incarnation": msg["incarnation"]}
                )
        elif key in self._runs:
            self._runs[key][1].discard(shard)
        origin, waiting = self._runs.get(key, (shard, set()))
        if not waiting and key in self._runs:
            del self._runs[key]
            self._send_to(origin, {"kind": "release_run", "job": msg["job"]})
            log.info("softswitch: job %d starts a new run on every shard", msg["job"])

    def _send_to(self, shard: int, msg: Any) -> None:
        with self._send_lock:
            try:
                self._conns[shard].send(msg)
            except (OSError, EOFError):
                pass  # that shard is gone: the reader reports it

    def _read_reports(self) -> None:
        index = {id(conn): i for i, conn in enumerate(self._conns)}
        open_conns = list(self._conns)
        while open_conns:
            try:
                ready = wait(open_conns, _POLL_S)
            except OSError:  # stop() closed the pipes
                return
            for conn in ready:
                i = index[id(conn)]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    open_conns.remove(conn)
                    if not self._finished[i] and not self._stopping:
                        proc = self._procs[i]
                        proc.join(1.0)
                        self._fail(f"shard {i} (pid {proc.pid}) exited unexpectedly, code {proc.exitcode}")
                    with self._cond:
                        self._cond.notify_all()
                    continue
                if msg["kind"] in ("new_run", "run_started"):
                    self._relay_run(i, msg)
                    continue
                with self._cond:
                    if msg["kind"] == "error":
                        self._fail(f"shard {i}: {msg['error']}")
                    else:
                        self._reports[i] = msg
                        self._seen[i] += 1
                        if msg["kind"] == "final":
                            self._finished[i] = True
                            if not self._stopping:
                                self._fail(f"shard {i} stopped on its own")
                    self._cond.notify_all()
