"""Throughput of SoftSwitch.process_batch against the per-packet SoftSwitch.process.

``python -m lta.bench.switch_micro``: a steady-state stream of GRADs (N workers, K=64, pool 512: unit g in
slot g mod 512, round g div 512 + 1, each worker's packets shuffled within small windows), preallocated as
one (n, 292) uint8 array with ingress port keys, run through fresh switches; one JSON line per
configuration: GRAD/s, µs per packet and the speedup over the per-packet path. Checks on the way that both
paths sent the same number of packets.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hostlib.protocol import Flag, Op, batch_rows, empty_batch
from softswitch.batch import port_key
from softswitch.pipeline import JobConfig, SoftSwitch

K = 64
POOL = 512


def steady_stream(n_workers: int, packets: int, window: int = 32, seed: int = 0) -> np.ndarray:
    """``packets`` GRADs of a steady state as a structured batch (every worker sends every unit; exponent
    (MAX) rounds for the first 4 units of every 64), shuffled within windows of ``window`` packets."""
    rng = np.random.default_rng(seed)
    units = -(-packets // n_workers)
    g = np.repeat(np.arange(units), n_workers)[:packets]
    w = np.tile(np.arange(n_workers), units)[:packets]
    batch = empty_batch(packets, K)
    is_max = g % 64 < 4
    batch["op"] = int(Op.GRAD)
    batch["flags"] = np.where(is_max, int(Flag.MAX), 0)
    batch["exp"] = np.where(is_max, 0, 17)
    batch["job_id"] = 1
    batch["worker_id"] = w
    batch["slot"] = g % POOL
    batch["seq"] = g // POOL + 1
    batch["nelem"] = K
    batch["step"] = g // 4096
    batch["chunk"] = g
    batch["weight"] = 1
    batch["payload"] = rng.integers(-(2**20), 2**20, size=(packets, K))
    order = np.arange(packets)
    for start in range(0, packets, window):
        rng.shuffle(order[start : start + window])
    return batch[order]


def make_switch(ports: list) -> SoftSwitch:
    sw = SoftSwitch(seed=0)
    sw.add_job(JobConfig(1, ports, pool_size=POOL, elems_per_packet=K))
    return sw


def time_batched(ports: list, rows: np.ndarray, lens: np.ndarray, ingress: np.ndarray, size: int) -> tuple:
    sw = make_switch(ports)
    sent = 0
    t0 = time.perf_counter()
    for start in range(0, len(rows), size):
        out = sw.process_batch(
            rows[start : start + size], lens[start : start + size], ingress[start : start + size]
        )
        sent += out.m
    return time.perf_counter() - t0, sent


def time_per_packet(ports: list, rows: np.ndarray, worker: np.ndarray, count: int) -> tuple:
    sw = make_switch(ports)
    packets = [(rows[i].tobytes(), ports[worker[i]]) for i in range(count)]
    sent = 0
    t0 = time.perf_counter()
    for data, port in packets:
        sent += len(sw.process(data, port))
    return time.perf_counter() - t0, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packets", type=int, default=200_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs per configuration")
    parser.add_argument("--per-packet", type=int, default=50_000, help="packets timed on the per-packet path")
    args = parser.parse_args()

    for n_workers in args.workers:
        ports = [("10.0.0.1", 41000 + w) for w in range(n_workers)]
        batch = steady_stream(n_workers, args.packets)
        rows = np.ascontiguousarray(batch_rows(batch))  # (n, 292) uint8
        lens = np.full(len(rows), rows.shape[1], dtype=np.int64)
        keys = np.array([port_key(p) for p in ports], dtype=np.int64)
        ingress = keys[batch["worker_id"]]
        count = min(args.per_packet, len(rows))
        best = min(time_per_packet(ports, rows, batch["worker_id"], count) for _ in range(args.repeat))
        ref_us = best[0] / count * 1e6
        print(
            json.dumps(
                {
                    "path": "process",
                    "workers": n_workers,
                    "packets": count,
                    "grad_per_s": round(count / best[0]),
                    "us_per_packet": round(ref_us, 3),
                }
            ),
            flush=True,
        )
        _, ref_sent = (
            time_per_packet(ports, rows, batch["worker_id"], len(rows)) if count < len(rows) else best
        )
        for size in args.sizes:
            elapsed, sent = min(time_batched(ports, rows, lens, ingress, size) for _ in range(args.repeat))
            assert sent == ref_sent, (sent, ref_sent)
            us = elapsed / len(rows) * 1e6
            print(
                json.dumps(
                    {
                        "path": "process_batch",
                        "workers": n_workers,
                        "batch": size,
                        "packets": len(rows),
                        "grad_per_s": round(len(rows) / elapsed),
                        "us_per_packet": round(us, 3),
                        "speedup": round(ref_us / us, 1),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
