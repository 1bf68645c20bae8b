"""The raw echo: lta's datagrams (as many, as large, in the same windows) sent through
:class:`hostlib.batchio.BatchSocket` to a server that does no LTA work and returns each one to its
sender. It measures what the kernel and the batched I/O allow on this machine, the baseline
``lta bench allreduce`` sets lta's packet rate against (``raw``, ``raw_gso``).

:func:`run_raw` runs N senders (spawned processes, or threads in-process) against one
:class:`EchoServer` (a thread of the calling process) in lock-step iterations (a barrier before each);
an iteration is over when the slowest sender has every reply or gave up after ``stall_timeout_s``.
Every datagram carries its iteration number in bytes 0..3, so a late echo is never counted twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue as queue_mod
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hostlib.batchio import BatchSocket, RxBatch, addr_key
from hostlib.lifetime import spawn_context
from hostlib.transport import TransportConfig
from hostlib.transport.config import default_window_cap
from lta.bench.summary import slowest_rank, time_stats
from lta.launch import running
from softswitch.server import BackgroundServer

log = logging.getLogger(__name__)

_RX_BUFFER_BYTES = 4 << 20  # a sender's receive rows, as lta's worker keeps them
_ECHO_RX_BYTES = 8 << 20  # the echo server's receive rows
_ECHO_BUFFER_BYTES = 32 << 20  # socket buffers of the echo server, as the softswitch server asks for
_RECV_SLICE_S = 0.05  # a sender's longest single wait for replies (then it checks its stall clock)


# What the kernel charges a receive buffer for a datagram received on its own (no GRO train): the data plus
# sk_buff, shared info and alignment, about 1 KiB on x86-64 (a 292-byte datagram takes ~1.3 KiB).
RAW_DATAGRAM_OVERHEAD = 1024


def echo_window(rcvbuf: int, pkt_bytes: int, senders: int) -> int:
    """Datagrams in flight per sender that ``senders`` senders can keep at once in the echo server's
    receive buffer of ``rcvbuf`` bytes as the kernel reports it (twice the usable size). The echo takes
    datagrams one by one, so each costs RAW_DATAGRAM_OVERHEAD more than its bytes: with lta's window
    (2047 units of K = 64 since the pool is 2048; 63 jumbo datagrams) 4 senders overflowed it, and every
    lost datagram cost the raw sender its stall timeout (p50 over 1 s)."""
    return max(2, rcvbuf // 2 // (pkt_bytes + RAW_DATAGRAM_OVERHEAD) // max(1, senders))


def lta_window(rcvbuf: int, pkt_bytes: int, config: TransportConfig) -> int:
    """The window LtaWorker keeps for a socket whose SO_RCVBUF reads ``rcvbuf`` (Linux doubles it)."""
    fit = max(2, rcvbuf // 2 // (pkt_bytes + 64))
    return min(config.window or min(fit, default_window_cap(pkt_bytes)), config.data_slots)


@dataclass(frozen=True)
class RawSpec:
    """One raw echo measurement. Every datagram carries its iteration number in bytes 0..3 (uint32,
    little-endian); the rest is the sender's payload (zeros unless given)."""

    n_datagrams: int  # per sender per iteration
    packet_bytes: int
    iters: int
    warmup: int = 0
    io: str | None = None  # None: BatchSocket's default (LTA_IO, else the fastest available)
    window: int | None = None  # datagrams in flight per sender; None: lta's, within the echo's buffer
    senders: int = 1  # how many send to the echo at once (run_raw sets it): they share its buffer
    buffer_bytes: int = TransportConfig.socket_buffer_bytes
    stall_timeout_s: float = 1.0  # an iteration with no reply for this long is given up (and counted)
    start_timeout_s: float = 300.0  # bound on every barrier wait (the first one covers process start)
    keep_echoes: bool = False  # return every echoed datagram (tests)

    def __post_init__(self) -> None:
        if self.n_datagrams < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError("need n_datagrams >= 1, iters >= 1, warmup >= 0")
        if not 4 <= self.packet_bytes <= 65507:
            raise ValueError(f"packet_bytes must be in 4..65507, got {self.packet_bytes}")


class EchoServer(BackgroundServer):
    """Stands in for the switch: receives in batches and sends every datagram back to its source, one
    reply per request. Counts the datagrams of timed iterations (tag >= ``warmup``) as they arrive."""

    thread_name = "raw-echo"

    def __init__(self, spec: RawSpec) -> None:
        self.spec = spec
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, _ECHO_BUFFER_BYTES)
            sock.bind(("127.0.0.1", 0))
            self.batch = BatchSocket(sock, spec.io)
        except BaseException:
            sock.close()
            raise
        self.address: tuple[str, int] = sock.getsockname()
        self.rx = RxBatch.within(_ECHO_RX_BYTES, spec.packet_bytes + 4)
        self.received_timed = 0
        self.wrong_length = 0
        self.error: str | None = None
        super().__init__()

    def close(self) -> None:
        self.batch.close()

    def serve_forever(self) -> None:
        rx, bs, pb, warmup = self.rx, self.batch, self.spec.packet_bytes, self.spec.warmup
        try:
            while not self._stop.is_set():
                n = bs.recv(rx, 0.1)
                if not n:
                    continue
                lens = rx.lens[:n]
                ok = lens == pb
                tags = np.ascontiguousarray(rx.data[:n, :4]).view("<u4")[:, 0]
                self.received_timed += int(np.count_nonzero(ok & (tags >= warmup)))
                self.wrong_length += n - int(np.count_nonzero(ok))
                bs.send(rx.data[:n], lens, rx.keys[:n])
        except OSError as exc:
            if not self._stop.is_set():
                self.error = f"echo server: {exc}"
                log.error("raw echo server failed: %s", exc)


def _raw_iterations(
    bs: BatchSocket, server_key: int, rows: np.ndarray, spec: RawSpec, window: int, barrier: Any
) -> dict:
    """Run every iteration of one sender; returns its times (timed iterations) and counts."""
    m, pb = rows.shape
    rx = RxBatch.within(_RX_BUFFER_BYTES, pb + 4)
    times: list[float] = []
    timeouts = sent_timed = echoed_timed = send_failed = 0
    echoes: list[np.ndarray] = []
    for it in range(spec.warmup + spec.iters):
        rows[:, :4] = np.frombuffer(struct.pack("<I", it), dtype=np.uint8)
        kept: list[np.ndarray] = []
        barrier.wait(timeout=spec.start_timeout_s)
        t0 = last = time.perf_counter()
        sent = got = failed = 0
        while got + failed < m:
            in_flight = sent - got - failed
            if sent < m and in_flight < window:
                k = min(window - in_flight, m - sent)
                ok = bs.send(rows[sent : sent + k], pb, server_key)
                sent += k
                failed += k - ok  # given up by the socket (no room for stall_timeout_s): never echoed
            n = bs.recv(rx, _RECV_SLICE_S)
            now = time.perf_counter()
            if n:
                tags = np.ascontiguousarray(rx.data[:n, :4]).view("<u4")[:, 0]
                mine = (rx.lens[:n] == pb) & (tags == it)  # a late echo of a given-up iteration is not
                k = int(np.count_nonzero(mine))
                if k:
                    got += k
                    last = now
                    if spec.keep_echoes:
                        kept.append(rx.data[:n][mine, :pb].copy())
            if now - last > spec.stall_timeout_s:
                if it >= spec.warmup:
                    timeouts += 1
                log.warning(
                    "raw sender: iteration %d gave up after %.1f s without a reply (%d of %d echoed)",
                    it,
                    spec.stall_timeout_s,
                    got,
                    m,
                )
                break
        elapsed = time.perf_counter() - t0
        send_failed += failed
        if it >= spec.warmup:
            times.append(elapsed)
            sent_timed += sent - failed
            echoed_timed += got
        if spec.keep_echoes:
            echoes.append(np.concatenate(kept) if kept else np.zeros((0, pb), dtype=np.uint8))
    out: dict[str, Any] = {
        "times_s": times,
        "timeouts": timeouts,
        "sent_timed": sent_timed,
        "echoed_timed": echoed_timed,
        "send_failed": send_failed,
        "window": window,
        "io": bs.io,
    }
    if spec.keep_echoes:
        out["echoes"] = echoes
    return out


def _raw_sender_main(
    rank: int, server_addr: tuple[str, int], spec: RawSpec, payload: np.ndarray | None, to_parent, barrier
) -> None:
    """One sender (a process, or a thread in-process): bind, then run every iteration in step with the
    others (a barrier before each), and report ("done"|"error", rank, payload)."""
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, spec.buffer_bytes)
            sock.bind(("127.0.0.1", 0))
            bs = BatchSocket(sock, spec.io)
            rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            window = spec.window or min(
                lta_window(rcvbuf, spec.packet_bytes, TransportConfig()),
                echo_window(rcvbuf, spec.packet_bytes, spec.senders),
            )
            if payload is None:
                rows = np.zeros((spec.n_datagrams, spec.packet_bytes), dtype=np.uint8)
            else:
                rows = np.array(payload, dtype=np.uint8, copy=True)
                if rows.shape != (spec.n_datagrams, spec.packet_bytes):
                    raise ValueError(
                        f"payload must be ({spec.n_datagrams}, {spec.packet_bytes}) bytes, got {rows.shape}"
                    )
            result = _raw_iterations(bs, addr_key(server_addr), rows, spec, window, barrier)
        finally:
            sock.close()
        to_parent.put(("done", rank, result))
    except BaseException:
        with contextlib.suppress(Exception):
            barrier.abort()  # the others would wait for this one at the next barrier
        to_parent.put(("error", rank, traceback.format_exc()))


def run_raw(
    n_senders: int,
    spec: RawSpec,
    *,
    in_process: bool = False,
    payloads: list[np.ndarray] | None = None,
    timeout_s: float = 900.0,
) -> dict:
    """Echo ``spec`` through one :class:`EchoServer` from ``n_senders`` senders (spawned processes, or
    threads with ``in_process``). An iteration is over when the slowest sender has every reply (or gave
    up: ``timeouts``). Returns the summary (p50_ms, pps, ...) plus ``times_s`` and each sender's result.

    ``payloads``: per sender, the (n_datagrams, packet_bytes) bytes to send (bytes 0..3 are replaced by
    the iteration number)."""
    if n_senders < 1:
        raise ValueError(f"n_senders must be >= 1, got {n_senders}")
    if payloads is not None and len(payloads) != n_senders:
        raise ValueError(f"need one payload per sender ({n_senders}), got {len(payloads)}")
    results: dict[int, dict] = {}
    spec = dataclasses.replace(spec, senders=n_senders)
    with EchoServer(spec) as server:
        if in_process:
            to_parent: Any = queue_mod.Queue()
            barrier: Any = threading.Barrier(n_senders)
            make: Callable[..., Any] = threading.Thread
        else:
            ctx = spawn_context()
            to_parent, barrier, make = ctx.Queue(), ctx.Barrier(n_senders), ctx.Process
        runners = [
            make(
                target=_raw_sender_main,
                args=(r, server.address, spec, None if payloads is None else payloads[r], to_parent, barrier),
                daemon=True,
            )
            for r in range(n_senders)
        ]
        # Threads (in_process) cannot be killed: they end when the barrier is aborted.
        with running(runners, kill=not in_process):
            give_up_at = time.monotonic() + timeout_s
            try:
                while len(results) < n_senders:
                    try:
                        kind, rank, payload = to_parent.get(timeout=1.0)
                    except queue_mod.Empty:
                        if server.error:
                            raise RuntimeError(server.error) from None
                        dead = [r for r, p in enumerate(runners) if r not in results and not p.is_alive()]
                        if dead:
                            # A process that died reports nothing; the queue may still hold its last words.
                            time.sleep(0.5)
                            if to_parent.empty():
                                raise RuntimeError(f"raw senders {dead} exited without a result") from None
                        if time.monotonic() > give_up_at:
                            message = f"raw senders gave no answer within {timeout_s:.0f} s"
                            raise TimeoutError(message) from None
                        continue
                    if kind == "error":
                        raise RuntimeError(f"raw sender {rank} failed:\n{payload}")
                    results[rank] = payload
            finally:  # senders waiting at the next barrier would wait for ever
                with contextlib.suppress(Exception):
                    barrier.abort()
        received_timed, wrong_length = server.received_timed, server.wrong_length
    senders = [results[r] for r in range(n_senders)]
    times = slowest_rank([s["times_s"] for s in senders])
    total_s = float(times.sum())
    return time_stats(times) | {
        "pps": received_timed / total_s if total_s > 0 else 0.0,
        "datagrams_per_reduce": spec.n_datagrams,
        "window": senders[0]["window"],
        "timeouts": max(s["timeouts"] for s in senders),
        "lost": sum(s["sent_timed"] - s["echoed_timed"] for s in senders),
        "io": senders[0]["io"],
        "received_timed": received_timed,
        "wrong_length": wrong_length,
        "times_s": times.tolist(),
        "senders": senders,
    }
