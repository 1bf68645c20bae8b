"""Traffic probes run inside emulated hosts to measure what a link really does (loss, rate).

``python -m mininet_topos.probes udp-sink|udp-blast|tcp-sink|tcp-send ...``. Sinks print ``ready``
once bound, then one JSON line with what they measured, so a harness can start the sender at the
right time and read the result. Only the standard library: the probes run under any python3.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

# Starts argv inside one emulated host with stdout piped (NetnsNetwork.run_in, Mininet's node.popen).
Launcher = Callable[[Sequence[str]], "subprocess.Popen[Any]"]


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def udp_sink(port: int, timeout_s: float, expect: int, seqs: bool = False) -> dict[str, Any]:
    """Count datagrams until ``expect`` arrived or ``timeout_s`` passed without one. ``seqs``: the datagrams
    carry their number in their first 4 bytes (big-endian, as ``udp-blast --gso`` sends them); report the
    lengths of the runs of consecutive numbers in 0..expect-1 that never arrived."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("0.0.0.0", port))
    sock.settimeout(timeout_s)
    print("ready", flush=True)
    received = nbytes = 0
    seen: set[int] = set()
    buf = bytearray(65536)
    first = last = time.monotonic()
    while received < expect:
        try:
            n = sock.recv_into(buf)
        except TimeoutError:
            break
        last = time.monotonic()
        if received == 0:
            first = last
        received += 1
        nbytes += n
        if seqs and n >= 4:
            seen.add(int.from_bytes(buf[:4], "big"))
    result: dict[str, Any] = {"received": received, "bytes": nbytes, "seconds": last - first}
    if seqs:
        runs: list[int] = []
        run = 0
        for i in range(expect):
            if i in seen:
                if run:
                    runs.append(run)
                run = 0
            else:
                run += 1
        if run:
            runs.append(run)
        result["lost_runs"] = runs
    return result


def udp_blast(dst: tuple[str, int], count: int, size: int, pps: float, gso: int = 0) -> dict[str, float]:
    """Send ``count`` datagrams of ``size`` bytes, paced to ``pps`` (0: as fast as possible). ``gso``: send
    them as UDP GSO trains of that many datagrams (one ``sendmsg`` with ``UDP_SEGMENT`` each), every
    datagram numbered in its first 4 bytes, so a sink can tell which were lost."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect(dst)
    payload = bytes(size)
    start = time.monotonic()
    if gso:
        size = max(size, 4)
        segment = [(getattr(socket, "SOL_UDP", 17), getattr(socket, "UDP_SEGMENT", 103),
                    size.to_bytes(2, sys.byteorder))]  # fmt: skip
        trains = 0
        for first in range(0, count, gso):
            if pps:
                ahead = start + first / pps - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            train = b"".join(
                i.to_bytes(4, "big") + bytes(size - 4) for i in range(first, min(count, first + gso))
            )
            sock.sendmsg([train], segment)
            trains += 1
        return {"sent": count, "trains": trains, "seconds": time.monotonic() - start}
    for i in range(count):
        if pps:
            ahead = start + i / pps - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        sock.send(payload)
    return {"sent": count, "seconds": time.monotonic() - start}


def tcp_sink(port: int, timeout_s: float) -> dict[str, float]:
    """Accept one connection and count its bytes from the first byte to the close."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(1)
    server.settimeout(timeout_s)
    print("ready", flush=True)
    conn, _ = server.accept()
    conn.settimeout(timeout_s)
    nbytes = 0
    buf = bytearray(1 << 20)
    first = None
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        if first is None:
            first = time.monotonic()
        nbytes += n
    seconds = time.monotonic() - (first or time.monotonic())
    return {"bytes": nbytes, "seconds": seconds, "mbit_s": nbytes * 8 / 1e6 / seconds if seconds else 0.0}


def tcp_send(dst: tuple[str, int], seconds: float) -> dict[str, float]:
    """Send zeros over one TCP connection for ``seconds``."""
    sock = socket.create_connection(dst, timeout=10)
    chunk = bytes(64 * 1024)
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sent += sock.send(chunk)
    sock.close()
    return {"bytes": sent}


def probe_argv(probe: str, *args: object, python: str = sys.executable) -> list[str]:
    return [python, "-m", "mininet_topos.probes", probe, *map(str, args)]


def run_pair(
    start_sink: Launcher,
    sink_argv: Sequence[str],
    start_sender: Launcher,
    sender_argv: Sequence[str],
    timeout_s: float = 30.0,
) -> tuple[dict[str, float], dict[str, float]]:
    """Start a sink, wait for its ``ready``, run the sender; return both JSON results."""
    sink = start_sink(sink_argv)
    try:
        assert sink.stdout is not None
        line = sink.stdout.readline()
        if line.strip() not in ("ready", b"ready"):
            raise RuntimeError(f"probe sink did not start: {line!r}; argv {list(sink_argv)}")
        sender = start_sender(sender_argv)
        sent_out, _ = sender.communicate(timeout=timeout_s)
        if sender.returncode != 0:
            raise RuntimeError(f"probe sender failed ({sender.returncode}): argv {list(sender_argv)}")
        sink_out, _ = sink.communicate(timeout=timeout_s)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    return json.loads(sink_out), json.loads(sent_out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mininet_topos.probes", description=__doc__)
    sub = parser.add_subparsers(dest="probe", required=True)
    p = sub.add_parser("udp-sink")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--expect", type=int, required=True)
    p.add_argument("--timeout", type=float, default=2.0, help="seconds without a datagram before stopping")
    p.add_argument("--seqs", action="store_true", help="report the runs of numbered datagrams lost")
    p = sub.add_parser("udp-blast")
    p.add_argument("--dst", type=_addr, required=True, help="IP:PORT")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--pps", type=float, default=0.0)
    p.add_argument("--gso", type=int, default=0, help="send GSO trains of this many datagrams")
    p = sub.add_parser("tcp-sink")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=10.0)
    p = sub.add_parser("tcp-send")
    p.add_argument("--dst", type=_addr, required=True, help="IP:PORT")
    p.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args(argv)
    result: dict[str, Any]
    if args.probe == "udp-sink":
        result = udp_sink(args.port, args.timeout, args.expect, args.seqs)
    elif args.probe == "udp-blast":
        result = udp_blast(args.dst, args.count, args.size, args.pps, args.gso)
    elif args.probe == "tcp-sink":
        result = tcp_sink(args.port, args.timeout)
    else:
        result = tcp_send(args.dst, args.seconds)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
