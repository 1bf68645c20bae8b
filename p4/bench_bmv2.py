"""How many GRAD packets per second BMv2 aggregates with the LTA program (a benchmark, not a test).

Starts simple_switch_grpc on veth pairs (needs root), loads p4/build/lta.json through the control plane,
adds one job of N workers, then offers complete rounds (N GRADs each, K = 64 int32) from the workers'
ports as fast as one sender thread can, and samples the switch's own counters once a second: the rate of
``rx_packets`` is what BMv2 processed (the excess is lost in the veth queues), ``result_quorum`` the
rounds it completed::

    .venv/bin/python p4/bench_bmv2.py --workers 4 --seconds 5 [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import threading
import time

import numpy as np

from controlplane.bmv2 import Bmv2Switch, bmv2_missing, host_worker, worker_frame
from controlplane.jobs import JobSpec
from controlplane.switch import LtaSwitch
from hostlib.protocol import HEADER_DTYPE, Op, make_packet

LTA_OFFSET = 14 + 20 + 8  # Ethernet + IPv4 + UDP
UDP_CHECKSUM_OFFSET = 14 + 20 + 6
SLOT_OFFSET = LTA_OFFSET + HEADER_DTYPE.fields["slot"][1]
SEQ_OFFSET = LTA_OFFSET + HEADER_DTYPE.fields["seq"][1]


def template_frames(n_workers: int) -> list[bytearray]:
    """One GRAD frame per worker; the sender patches slot and seq in place (UDP checksum 0 = none)."""
    frames = []
    for w in range(n_workers):
        lta = make_packet(Op.GRAD, job_id=1, worker_id=w, payload=np.arange(64), weight=1)
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
) -> None:
    """Send unit g = 0, 1, 2, ... (slot g mod P, seq g div P + 1) from every worker until ``stop``,
    at ``rate`` packets/s (0: as fast as possible)."""
    g, start = 0, time.monotonic()
    while not stop.is_set():
        if rate and sent[0] > rate * (time.monotonic() - start):
            time.sleep(0.001)
            continue
        slot, seq = g % pool_size, g // pool_size + 1
        for port, frame in enumerate(frames, start=1):
            struct.pack_into(">H", frame, SLOT_OFFSET, slot)
            struct.pack_into(">I", frame, SEQ_OFFSET, seq)
            try:
                bmv2.send(port, frame)
            except BlockingIOError:
                continue  # the veth queue is full: that packet is lost, as on a real link
            sent[0] += 1
        g += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=5, help="how many one-second samples")
    parser.add_argument("--pool-size", type=int, default=512)
    parser.add_argument(
        "--rate", type=float, default=0, help="offered GRAD packets/s (0: as fast as possible)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    missing = bmv2_missing()
    if missing:
        print(f"cannot benchmark BMv2: {missing}", file=sys.stderr)
        return 1
    with (
        Bmv2Switch(args.workers, prefix="ltabench") as bmv2,
        LtaSwitch.connect(bmv2.target, timeout_s=10) as ctl,
    ):
        ctl.load_pipeline()
        workers = tuple(host_worker(p) for p in range(1, args.workers + 1))
        ctl.add_job(JobSpec(1, workers, pool_size=args.pool_size))
        stop, sent = threading.Event(), [0]
        sender = threading.Thread(
            target=offer, args=(bmv2, template_frames(args.workers), args.pool_size, stop, sent, args.rate)
        )
        sender.start()
        time.sleep(1.0)  # warm up
        samples = []
        before, t0, sent0 = ctl.read_counters(1)[1], time.monotonic(), sent[0]
        for _ in range(args.seconds):
            time.sleep(1.0)
            now, t1, sent1 = ctl.read_counters(1)[1], time.monotonic(), sent[0]
            dt = t1 - t0
            samples.append(
                {
                    "offered_pps": (sent1 - sent0) / dt,
                    "grad_pps": (now["rx_packets"] - before["rx_packets"]) / dt,
                    "rounds_per_s": (now["result_quorum"] - before["result_quorum"]) / dt,
                }
            )
            before, t0, sent0 = now, t1, sent1
        stop.set()
        sender.join()
    report = {
        "workers": args.workers,
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
            f"{report['rounds_per_s']:,} rounds/s completed"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
