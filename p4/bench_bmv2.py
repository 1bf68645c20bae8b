"""How many GRAD packets per second BMv2 aggregates with the LTA program (a benchmark, not a test).

Starts simple_switch_grpc on veth pairs (needs root), loads p4/build/lta.json through the control plane,
adds one job of N workers, then offers complete rounds (N GRADs each, K = 64 int32) from the workers'
ports as fast as one sender thread can, and samples the switch's own counters once a second: the rate of
``rx_packets`` is what BMv2 processed (the excess is lost in the veth queues), ``result_quorum`` the
rounds it completed::

    .venv/bin/python p4/bench_bmv2.py --workers 4 --seconds 5 [--json]

``--owner``: every round is owner-only (flag OWNER, the owner ``g mod N`` in ``count``): its RESULT is
still multicast, and egress drops the N-1 replicas that are not the owner's (p4/README.md), so the
difference in rounds/s against the same run without it is the P4 cost of owner-only RESULTs on BMv2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import threading
import time

import numpy as np

from controlplane.bmv2 import Bmv2Switch, bmv2_missing, host_worker, worker_frame
from controlplane.jobs import JobSpec
from controlplane.switch import LtaSwitch
from hostlib.protocol import HEADER_DTYPE, Flag, Op, make_packet

LTA_OFFSET = 14 + 20 + 8  # Ethernet + IPv4 + UDP
UDP_CHECKSUM_OFFSET = 14 + 20 + 6
SLOT_OFFSET = LTA_OFFSET + HEADER_DTYPE.fields["slot"][1]
SEQ_OFFSET = LTA_OFFSET + HEADER_DTYPE.fields["seq"][1]
COUNT_OFFSET = LTA_OFFSET + HEADER_DTYPE.fields["count"][1]


def template_frames(n_workers: int, owner: bool = False) -> list[bytearray]:
    """One GRAD frame per worker; the sender patches slot and seq (and with ``owner``, the owner in
    ``count``) in place (UDP checksum 0 = none)."""
    frames = []
    flags = int(Flag.OWNER) if owner else 0
    for w in range(n_workers):
        lta = make_packet(Op.GRAD, job_id=1, worker_id=w, payload=np.arange(64), weight=1, flags=flags)
        frame = bytearray(worker_frame(lta, host_worker(w + 1)))
        frame[UDP_CHECKSUM_OFFSET : UDP_CHECKSUM_OFFSET + 2] = b"\0\0"
        frames.append(frame)
    return frames


def offer(
    bmv2: Bmv2Switch,
    frames: list[bytearray],
    pool_size: int,
    stop: threading.Event,
    sent: list[int],
    rate: float,
    owner: bool = False,
) -> None:
    """Send unit g = 0, 1, 2, ... (slot g mod P, seq g div P + 1) from every worker until ``stop``,
    at ``rate`` packets/s (0: as fast as possible); with ``owner``, round g's owner is g mod N."""
    g, start = 0, time.monotonic()
    while not stop.is_set():
        if rate and sent[0] > rate * (time.monotonic() - start):
            time.sleep(0.001)
            continue
        slot, seq = g % pool_size, g // pool_size + 1
        for port, frame in enumerate(frames, start=1):
            struct.pack_into(">H", frame, SLOT_OFFSET, slot)
            struct.pack_into(">I", frame, SEQ_OFFSET, seq)
            if owner:
                frame[COUNT_OFFSET] = g % len(frames)
            try:
                bmv2.send(port, frame)
            except BlockingIOError:
                continue  # the veth queue is full: that packet is lost, as on a real link
            sent[0] += 1
        g += 1


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc), all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=5, help="how many one-second samples")
    parser.add_argument("--pool-size", type=int, default=512)
    parser.add_argument(
        "--rate", type=float, default=0, help="offered GRAD packets/s (0: as fast as possible)"
    )
    parser.add_argument(
        "--owner", action="store_true", help="owner-only rounds (flag OWNER): egress keeps 1 of N replicas"
    )
    parser.add_argument("--prefix", default="ltabench", help="veth name prefix (at most 11 characters)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    missing = bmv2_missing()
    if missing:
        print(f"cannot benchmark BMv2: {missing}", file=sys.stderr)
        return 1
    with (
        Bmv2Switch(args.workers, prefix=args.prefix) as bmv2,
        LtaSwitch.connect(bmv2.target, timeout_s=10) as ctl,
    ):
        ctl.load_pipeline()
        workers = tuple(host_worker(p) for p in range(1, args.workers + 1))
        ctl.add_job(JobSpec(1, workers, pool_size=args.pool_size))
        stop, sent = threading.Event(), [0]
        sender = threading.Thread(
            target=offer,
            args=(
                bmv2,
                template_frames(args.workers, args.owner),
                args.pool_size,
                stop,
                sent,
                args.rate,
                args.owner,
            ),
        )
        sender.start()
        time.sleep(1.0)  # warm up
        samples = []
        assert bmv2.process is not None
        pid = bmv2.process.pid
        before, t0, sent0, cpu0 = ctl.read_counters(1)[1], time.monotonic(), sent[0], cpu_seconds(pid)
        for _ in range(args.seconds):
            time.sleep(1.0)
            now, t1, sent1, cpu1 = ctl.read_counters(1)[1], time.monotonic(), sent[0], cpu_seconds(pid)
            dt, rounds = t1 - t0, now["result_quorum"] - before["result_quorum"]
            samples.append(
                {
                    "offered_pps": (sent1 - sent0) / dt,
                    "grad_pps": (now["rx_packets"] - before["rx_packets"]) / dt,
                    "rounds_per_s": (now["result_quorum"] - before["result_quorum"]) / dt,
                    "tx_pps": (now["tx_packets"] - before["tx_packets"]) / dt,
                    # simple_switch_grpc's CPU per completed round (all its threads), steadier under load
                    # than the rates, which follow the CPU share BMv2 gets
                    "cpu_us_per_round": (cpu1 - cpu0) / rounds * 1e6 if rounds else 0.0,
                }
            )
            before, t0, sent0, cpu0 = now, t1, sent1, cpu1
        stop.set()
        sender.join()
    report = {
        "loadavg": os.getloadavg()[0],
        "workers": args.workers,
        "owner_only": args.owner,
        "elements_per_packet": 64,
        **{key: round(statistics.median(s[key] for s in samples)) for key in samples[0]},
        "samples": len(samples),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"BMv2 + LTA, {args.workers} workers, K=64: {report['grad_pps']:,} GRAD packets/s processed "
            f"(median of {len(samples)} s; {report['offered_pps']:,}/s offered), "
            f"{report['rounds_per_s']:,} rounds/s completed, {report['tx_pps']:,} packets/s sent, "
            f"{report['cpu_us_per_round']:,} µs of BMv2 CPU per round"
            + (" (owner-only RESULTs)" if args.owner else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
