"""The parameter server without sockets: jobs by id, packets in (a batch at a time), packets out.

:class:`ParameterServer` checks what every packet must satisfy before a job sees it (the order and the
names follow the switch contract): shorter than the header, another version or an op that is not a
``PsOp`` → ``drop_malformed``; a job it does not serve → ``drop_unknown_job``; a length other than the
job's packet → ``drop_malformed``; a worker id out of range or not from that worker's address →
``drop_bad_worker``. Thread-safe: one lock around each batch, tick and read.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from hostlib.protocol import HEADER_BYTES, HEADER_STRUCT, VERSION, PsOp
from softswitch.ps.config import PsJobConfig
from softswitch.ps.job import OutRows, Packet, PsJob

_PS_OPS = frozenset(int(op) for op in PsOp if op != PsOp.PARAM)  # PARAM goes out only
SERVER_COUNTERS = ("rx_packets", "drop_malformed", "drop_unknown_job")


class ParameterServer:
    """Every parameter-server job of one daemon."""

    def __init__(self, seed: int = 0, *, log_pushes: bool = False) -> None:
        self.seed = seed
        self.log_pushes = log_pushes
        self.jobs: dict[int, PsJob] = {}
        self.counters = dict.fromkeys(SERVER_COUNTERS, 0)  # packets no job could take
        self.lock = threading.Lock()

    def add_job(self, cfg: PsJobConfig) -> PsJob:
        with self.lock:
            if cfg.job_id in self.jobs:
                raise ValueError(f"parameter-server job {cfg.job_id} exists already")
            job = self.jobs[cfg.job_id] = PsJob(cfg, self.seed, log_pushes=self.log_pushes)
            return job

    def process(
        self, data: np.ndarray, lens: np.ndarray, keys: np.ndarray, n: int, now: float
    ) -> list[OutRows]:
        """Run rows ``0..n-1`` of a receive batch (bytes, lengths, source address keys) in order."""
        out: list[OutRows] = []
        with self.lock:
            for i in range(n):
                out.extend(self._one(data[i], int(lens[i]), int(keys[i]), now))
        return out

    def process_packet(self, packet: bytes, key: int, now: float) -> list[OutRows]:
        """One packet (tests, tools)."""
        row = np.frombuffer(packet, dtype=np.uint8)
        with self.lock:
            return self._one(row, len(row), key, now)

    def tick(self, now: float) -> list[OutRows]:
        """Close every synchronous window whose deadline passed."""
        out: list[OutRows] = []
        with self.lock:
            for job in self.jobs.values():
                out.extend(job.tick(now))
        return out

    def next_deadline(self) -> float | None:
        with self.lock:
            deadlines = [d for job in self.jobs.values() if (d := job.next_deadline()) is not None]
        return min(deadlines) if deadlines else None

    def _one(self, row: np.ndarray, length: int, key: int, now: float) -> list[OutRows]:
        if length < HEADER_BYTES:
            self.counters["rx_packets"] += 1
            self.counters["drop_malformed"] += 1
            return []
        (version, op, _flags, exp, job_id, w, _count, slot, nelem, seq, step, chunk, _weight, bitmap) = (
            HEADER_STRUCT.unpack_from(row.data)
        )
        job = self.jobs.get(job_id)
        if job is None:
            self.counters["rx_packets"] += 1
            self.counters[
                "drop_unknown_job" if version == VERSION and op in _PS_OPS else "drop_malformed"
            ] += 1
            return []
        job.counters["rx_packets"] += 1
        if version != VERSION or op not in _PS_OPS or length != job.packet_bytes:
            job.counters["drop_malformed"] += 1
            return []
        if not job.check_sender(w, key, now, op):
            job.counters["drop_bad_worker"] += 1
            return []
        pkt = Packet(op, w, exp, slot, nelem, seq, step, chunk, bitmap, row[HEADER_BYTES:length])
        return job.handle(pkt, now)

    def stats(self) -> dict[str, object]:
        with self.lock:
            return {"server": dict(self.counters), "jobs": {j: job.stats() for j, job in self.jobs.items()}}

    def job_stats(self, job_id: int) -> dict[str, Any]:
        """One job's stats (``PsJob.stats``)."""
        with self.lock:
            return self.jobs[job_id].stats()

    def snapshot(self, job_id: int) -> tuple[int, np.ndarray | None]:
        """``(version, a copy of the parameters)`` of a job (None before its INIT completed)."""
        with self.lock:
            job = self.jobs[job_id]
            params = None if job.params is None else job.params[: job.n_params].copy()
            return job.step, params
