"""Measure hostlib.batchio's I/O modes on loopback: ``python -m lta.bench.batchio_micro``.

For each mode that works here it measures, at 292-byte (36-byte header + 64 int32) and 65507-byte
datagrams:

send
    ``BatchSocket.send`` alone: bursts of packets (in batches) are timed, then drained untimed by a sink
    socket, so the sender never outruns the receive buffer and nothing is lost.
recv
    ``BatchSocket.recv`` alone: a filler queues a burst untimed, then draining it in batches is timed.
echo
    a round trip: the main thread sends a window of ``batch`` packets to an echo thread that receives them
    and sends each back to its source; the main thread waits for the window to return, then sends the
    next. Both ends use the mode measured.

and the cost of one call at batch sizes 1, 16, 64 and 256 (292-byte datagrams), plus one ``recv`` that
finds nothing queued. Each figure is the best of ``--repeats`` runs. One JSON line per mode goes to
stdout, a readable table to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from hostlib.batchio import IO_MODES, BatchSocket, RxBatch, addr_key, available_modes

SMALL, JUMBO = 292, 65507
CALL_BATCHES = (1, 16, 64, 256)
_BUFFER_BYTES = 32 << 20


_LINUX_FORCE = {socket.SO_RCVBUF: 33, socket.SO_SNDBUF: 32}  # SO_RCVBUFFORCE, SO_SNDBUFFORCE


def _udp_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt, force in _LINUX_FORCE.items():
        try:
            if not sys.platform.startswith("linux"):
                raise OSError
            s.setsockopt(socket.SOL_SOCKET, force, _BUFFER_BYTES)  # as root: past net.core.[rw]mem_max
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, opt, _BUFFER_BYTES)
    s.bind(("127.0.0.1", 0))
    return s


def _key(bs: BatchSocket) -> int:
    return addr_key(bs.sock.getsockname())


def _burst(sink: BatchSocket, size: int, batch: int, total: int) -> int:
    """Packets that fit in sink's receive buffer at once (a multiple of batch)."""
    rcvbuf = sink.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    fits = rcvbuf // (2 * size + 1024) // 2  # truesize is well under twice the payload plus 1 KiB; halve it
    return max(batch, min(total, 8192, fits) // batch * batch)


def _drain(bs: BatchSocket, rx: RxBatch, want: int, idle_s: float = 0.2) -> int:
    got = 0
    while got < want:
        n = bs.recv(rx, idle_s)
        if n == 0:
            break
        got += n
    return got


def _payload(rows: int, size: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (rows, size), dtype=np.uint8)


def bench_send(mode: str, size: int, batch: int, packets: int, helper: str) -> dict[str, Any]:
    tx, sink = BatchSocket(_udp_socket(), mode), BatchSocket(_udp_socket(), helper)
    try:
        data, key = _payload(batch, size), _key(sink)
        rx = RxBatch(1024, size)
        burst = _burst(sink, size, batch, packets)
        elapsed = 0.0
        done = lost = 0
        while done < packets:
            calls = min(burst, packets - done) // batch or 1
            t0 = time.perf_counter()
            for _ in range(calls):
                tx.send(data, size, key)
            elapsed += time.perf_counter() - t0
            lost += calls * batch - _drain(sink, rx, calls * batch)
            done += calls * batch
        return _result(done, elapsed, batch, tx.stats.syscalls_send, lost)
    finally:
        tx.close()
        sink.close()


def bench_recv(mode: str, size: int, batch: int, packets: int, helper: str) -> dict[str, Any]:
    filler, dst = BatchSocket(_udp_socket(), helper), BatchSocket(_udp_socket(), mode)
    try:
        data, key = _payload(256, size), _key(dst)
        rx = RxBatch(batch, size)
        burst = _burst(dst, size, batch, packets)
        elapsed = 0.0
        done = lost = calls = 0
        while done < packets:
            want = min(burst, packets - done)
            for start in range(0, want, 256):
                filler.send(data[: min(256, want - start)], size, key)
            got = 0
            t0 = time.perf_counter()
            while got < want:
                n = dst.recv(rx)
                calls += 1
                if n == 0:  # something is late or lost: wait for it untimed
                    elapsed += time.perf_counter() - t0
                    n = dst.recv(rx, 0.2)
                    if n == 0:
                        break
                    t0 = time.perf_counter()
                got += n
            elapsed += time.perf_counter() - t0
            lost += want - got
            done += want
        return _result(done - lost, elapsed, batch, dst.stats.syscalls_recv, lost, calls=calls)
    finally:
        filler.close()
        dst.close()


def bench_recv_empty(mode: str, calls: int = 20000) -> float:
    """Microseconds per recv() call that finds nothing."""
    bs = BatchSocket(_udp_socket(), mode)
    try:
        rx = RxBatch(64, SMALL)
        t0 = time.perf_counter()
        for _ in range(calls):
            bs.recv(rx)
        return (time.perf_counter() - t0) / calls * 1e6
    finally:
        bs.close()


def bench_echo(mode: str, size: int, batch: int, packets: int) -> dict[str, Any]:
    client, server = BatchSocket(_udp_socket(), mode), BatchSocket(_udp_socket(), mode)
    stop = threading.Event()

    def echo() -> None:
        rx = RxBatch(max(batch, 64), size)
        while not stop.is_set():
            n = server.recv(rx, 0.05)
            if n:
                server.send(rx.data[:n], rx.lens[:n], rx.keys[:n])

    thread = threading.Thread(target=echo, name="echo", daemon=True)
    thread.start()
    try:
        data, key = _payload(batch, size), _key(server)
        rx = RxBatch(batch, size)
        lost = 0
        windows = max(1, packets // batch)
        t0 = time.perf_counter()
        for _ in range(windows):
            client.send(data, size, key)
            lost += batch - _drain(client, rx, batch, idle_s=0.5)
        elapsed = time.perf_counter() - t0
        return _result(windows * batch - lost, elapsed, batch, None, lost)
    finally:
        stop.set()
        thread.join()
        client.close()
        server.close()


def _result(
    packets: int, elapsed: float, batch: int, syscalls: int | None, lost: int, calls: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "packets": packets,
        "batch": batch,
        "pps": round(packets / elapsed) if elapsed > 0 else None,
        "us_per_pkt": round(elapsed / packets * 1e6, 3) if packets else None,
        "us_per_call": round(elapsed / (calls or max(1, packets / batch)) * 1e6, 3),
        "lost": lost,
    }
    if syscalls is not None:
        out["syscalls"] = syscalls
    return out


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return max(runs, key=lambda r: r["pps"] or 0)


def bench_mode(mode: str, args: argparse.Namespace, helper: str) -> dict[str, Any]:
    rep = range(args.repeats)
    out: dict[str, Any] = {"mode": mode}
    for size, packets, batch in (
        (SMALL, args.packets, args.batch),
        (JUMBO, args.jumbo_packets, args.jumbo_batch),
    ):
        out[f"send_{size}"] = _best([bench_send(mode, size, batch, packets, helper) for _ in rep])
        out[f"recv_{size}"] = _best([bench_recv(mode, size, batch, packets, helper) for _ in rep])
        out[f"echo_{size}"] = _best([bench_echo(mode, size, batch, packets // 2) for _ in rep])
    per_call: dict[str, Any] = {}
    for batch in CALL_BATCHES:
        n = max(batch * 200, min(args.packets // 2, batch * 2000))
        send = _best([bench_send(mode, SMALL, batch, n, helper) for _ in rep])
        recv = _best([bench_recv(mode, SMALL, batch, n, helper) for _ in rep])
        per_call[str(batch)] = {
            "send_us_per_call": send["us_per_call"],
            "send_us_per_pkt": send["us_per_pkt"],
            "recv_us_per_call": recv["us_per_call"],
            "recv_us_per_pkt": recv["us_per_pkt"],
        }
    out["per_call_292"] = per_call
    out["recv_empty_us_per_call"] = round(min(bench_recv_empty(mode) for _ in rep), 3)
    return out


def _table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'mode':<12} {'test':<11} {'kpps':>9} {'us/pkt':>8} {'us/call':>9} {'lost':>5}"]
    for r in results:
        for size in (SMALL, JUMBO):
            for test in ("send", "recv", "echo"):
                x = r[f"{test}_{size}"]
                lines.append(
                    f"{r['mode']:<12} {test}_{size:<6} {x['pps'] / 1e3:>9.1f} {x['us_per_pkt']:>8.2f} "
                    f"{x['us_per_call']:>9.2f} {x['lost']:>5}"
                )
        for batch, x in r["per_call_292"].items():
            lines.append(
                f"{r['mode']:<12} batch {batch:<5} send {x['send_us_per_call']:>8.2f} us/call "
                f"{x['send_us_per_pkt']:>7.2f} us/pkt   recv {x['recv_us_per_call']:>8.2f} us/call "
                f"{x['recv_us_per_pkt']:>7.2f} us/pkt"
            )
        lines.append(f"{r['mode']:<12} empty recv {r['recv_empty_us_per_call']:.2f} us/call")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=IO_MODES, default=None, help="default: all available")
    parser.add_argument("--packets", type=int, default=100_000, help="292-byte packets per test")
    parser.add_argument("--jumbo-packets", type=int, default=5_000, help="65507-byte packets per test")
    parser.add_argument("--batch", type=int, default=64, help="packets per call, 292-byte tests")
    parser.add_argument("--jumbo-batch", type=int, default=16, help="packets per call, 65507-byte tests")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the best is reported")
    args = parser.parse_args(argv)
    modes = args.modes or list(available_modes())
    helper = available_modes()[0]  # the sink / filler on the side not being measured
    results = []
    for mode in modes:
        res = bench_mode(mode, args, helper)
        res["host"] = {"python": platform.python_version(), "machine": platform.machine(), "cpus": _cpus()}
        print(json.dumps(res), flush=True)
        results.append(res)
    print(_table(results), file=sys.stderr)
    return 0


def _cpus() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


if __name__ == "__main__":
    sys.exit(main())
