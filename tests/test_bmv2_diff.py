"""Differential tests: the P4 program on BMv2 and the softswitch, configured by the same control plane,
answer the same hand-built packet sequences with the same packets and the same counters. Each scenario
also checks its hand-computed expectation (which RESULTs go to which ports, their counts, bitmaps and
sums, and every counter), so a bug both switches share fails too; those checks run on the softswitch
everywhere (behind its own P4Runtime server, through the same control plane), and on both switches
where BMv2 is installed.

Every branch of the switch contract is driven: full rounds, retransmission after the result, duplicates,
owner-only RESULTs (Flag.OWNER: to the owner alone, resends too),
slot reuse with a higher seq, stale packets, FLUSH partial / empty (count 0) / resend / stale, quorum < N,
exponent (MAX) rounds and mismatches, SATURATED, spoofed and out-of-range workers, unknown jobs, slots
out of range, malformed headers and payloads, PARAM / PARAM_REQ replication and the up / down / param
drop policies (p = 0 or 1, so both switches decide alike), plus a seeded random sequence.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP

from controlplane.bmv2 import (
    SWITCH_IP,
    SWITCH_MAC,
    Bmv2Switch,
    bmv2_missing,
    host_worker,
    lta_of,
    worker_frame,
)
from controlplane.jobs import JobSpec
from controlplane.switch import LtaSwitch
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.p4.schema import BMV2_JSON_PATH
from hostlib.protocol import (
    COUNTERS,
    HEADER_BYTES,
    HEADER_DTYPE,
    INT32_MIN,
    LTA_PORT,
    SWITCH_COUNTERS,
    Flag,
    Op,
    make_packet,
)
from softswitch.p4runtime_server import serve
from softswitch.pipeline import SoftSwitch

ROOT = Path(__file__).resolve().parent.parent
N_PORTS = 4


def _missing() -> str | None:
    reason = bmv2_missing()
    if reason:
        return reason
    if not BMV2_JSON_PATH.exists() and shutil.which("p4c-bm2-ss") is None:
        return (
            "p4/build/lta.json is not compiled and p4c-bm2-ss is not on PATH (build p4c from p4lang's "
            "sources: README, 'BMv2 and p4c')"
        )
    return None


needs_bmv2 = [pytest.mark.bmv2, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


@dataclass
class Pair:
    """BMv2 (where installed) and a softswitch, each behind P4Runtime, configured through the same
    LtaSwitch calls. Without BMv2 (``bmv2`` None) the scenarios run on the softswitch alone."""

    bmv2: Bmv2Switch | None
    softswitch: SoftSwitch
    controllers: list[LtaSwitch]

    def configure(self, fn) -> None:
        for ctl in self.controllers:
            fn(ctl)

    def counters(self) -> list[tuple[dict[int, dict[str, int]], dict[int, list[int]]]]:
        """Per switch: the per-job counters and every job's per-worker counters (WORKER_COUNTER)."""
        return [
            (ctl.read_counters(), {j: ctl.read_worker_rx(j, job.n_workers) for j, job in ctl.jobs().items()})
            for ctl in self.controllers
        ]


@pytest.fixture(scope="module")
def soft_only() -> Iterator[Pair]:
    """The softswitch alone behind its P4Runtime server, loaded with the committed BMv2 build."""
    softswitch = SoftSwitch(seed=1)
    server, port, _ = serve(softswitch)
    controller = LtaSwitch.connect(f"127.0.0.1:{port}")
    try:
        controller.load_pipeline(BMV2_JSON_PATH)
        yield Pair(None, softswitch, [controller])
    finally:
        controller.close()
        server.stop(None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[Pair]:
    device_config = BMV2_JSON_PATH
    if not device_config.exists():
        out = tmp_path_factory.mktemp("p4build")
        subprocess.run(
            [
                "p4c-bm2-ss",
                "--std",
                "p4-16",
                "--arch",
                "v1model",
                "-o",
                str(out / "lta.json"),
                "p4/v1model/lta.p4",
            ],
            cwd=ROOT,
            check=True,
        )
        device_config = out / "lta.json"
    softswitch = SoftSwitch(seed=1)
    server, port, _ = serve(softswitch)
    with Bmv2Switch(N_PORTS, prefix="ltadiff") as bmv2:
        controllers = [LtaSwitch.connect(bmv2.target, timeout_s=10), LtaSwitch.connect(f"127.0.0.1:{port}")]
        try:
            for ctl in controllers:
                ctl.load_pipeline(device_config)
            yield Pair(bmv2, softswitch, controllers)
        finally:
            for ctl in controllers:
                ctl.close()
            server.stop(None)


def _clean(pair: Pair) -> Pair:
    """No jobs and every counter at zero, on every switch of the pair."""
    for ctl in pair.controllers:
        for job_id in ctl.jobs():
            ctl.remove_job(job_id)
        # The scenarios touch counter rows 0..9 (unknown jobs count on row 0); the pair compares every
        # row of both switches, the softswitch alone is checked on the rows a scenario names.
        for job_id in range(64 if pair.bmv2 is not None else 10):
            ctl.clear_counters(job_id)
    if pair.bmv2 is not None:
        pair.bmv2.drain()
    return pair


@pytest.fixture(params=["softswitch", pytest.param("bmv2", marks=needs_bmv2)])
def fresh(request) -> Pair:
    """A clean softswitch (everywhere), or a clean BMv2 + softswitch pair (where BMv2 is installed)."""
    return _clean(request.getfixturevalue("soft_only" if request.param == "softswitch" else "pair"))


@pytest.fixture
def fresh_pair(pair: Pair) -> Pair:
    """Both switches, clean: for the scenarios that need BMv2's own frames."""
    return _clean(pair)


def workers(*ports: int):
    return tuple(host_worker(p) for p in ports)


def add_jobs(pair: Pair, *jobs: JobSpec) -> None:
    for job in jobs:
        pair.configure(lambda ctl, job=job: ctl.add_job(job))


def check_frame(port: int, frame: bytes) -> None:
    """A frame BMv2 sent on ``port`` is addressed to the worker there, from the switch, with a valid
    IPv4 checksum."""
    _, packet = lta_of(frame)
    worker = host_worker(port)
    assert (packet.src, packet.dst) == (SWITCH_MAC, worker.mac)
    ip = packet[IP]
    assert (ip.src, ip.dst) == (SWITCH_IP, worker.ip)
    assert (packet[UDP].sport, packet[UDP].dport) == (LTA_PORT, worker.udp_port)
    recomputed = IP(bytes(ip))
    del recomputed.chksum
    assert IP(bytes(recomputed)).chksum == ip.chksum


def run(pair: Pair, packets: list[tuple[int, bytes]]) -> list[list[tuple[int, bytes]]]:
    """Push each (port, LTA bytes) through the softswitch, and through BMv2 where the pair has it: then
    assert the same outputs packet by packet and the same counters at the end. Returns the softswitch's
    outputs for the hand-computed checks."""
    all_outputs = []
    for i, (port, lta) in enumerate(packets):
        expected = sorted(pair.softswitch.process(lta, port))
        if pair.bmv2 is None:
            all_outputs.append(expected)
            continue
        frames = pair.bmv2.exchange(port, worker_frame(lta, host_worker(port)), len(expected))
        for out_port, frame in frames:
            check_frame(out_port, frame)
        got = sorted((out_port, lta_of(frame)[0]) for out_port, frame in frames)
        assert got == expected, f"packet #{i} (port {port}, {lta[:12].hex()}...) differs"
        all_outputs.append(expected)
    if pair.bmv2 is not None:
        bmv2_counters, soft_counters = pair.counters()
        assert bmv2_counters == soft_counters
    return all_outputs


def decode(lta: bytes) -> dict:
    """An LTA packet's header fields (ints) and its payload (int64)."""
    header = np.frombuffer(lta, dtype=HEADER_DTYPE, count=1)[0]
    fields = {name: int(header[name]) for name in HEADER_DTYPE.names}
    fields["payload"] = np.frombuffer(lta, dtype=">i4", offset=HEADER_BYTES).astype(np.int64)
    return fields


def assert_result(out: list[tuple[int, bytes]], ports, payload=None, **fields) -> None:
    """``out`` (one input's outputs) is one RESULT to each of ``ports``, every copy with these header
    fields and, if given, this payload (all K lanes)."""
    assert sorted(p for p, _ in out) == sorted(ports), out
    for _, lta in out:
        got = decode(lta)
        assert got["op"] == Op.RESULT
        for name, value in fields.items():
            assert got[name] == value, (name, got[name], value)
        if payload is not None:
            np.testing.assert_array_equal(got["payload"], np.asarray(payload, dtype=np.int64))


def check_counters(pair: Pair, expected: dict[int, dict[str, int]], worker_rx=None) -> None:
    """The softswitch's counters (equal to BMv2's where the pair has it: run() checked) are exactly
    ``expected`` per job, every counter not named being 0; and the per-worker counters, if given."""
    for job_id, named in expected.items():
        assert set(named) <= set(COUNTERS), set(named) - set(COUNTERS)
        # (the softswitch also counts the hierarchy's branches, HIERARCHY_COUNTERS: 0 for a flat job)
        want = {name: named.get(name, 0) for name in SWITCH_COUNTERS}
        assert pair.softswitch.read_counters(job_id) == want, job_id
    for job_id, counts in (worker_rx or {}).items():
        assert pair.softswitch.read_worker_rx(job_id) == counts, job_id


def grad(job: int, worker: int, values, slot: int = 0, seq: int = 1, **kw) -> bytes:
    return make_packet(Op.GRAD, job_id=job, worker_id=worker, slot=slot, seq=seq, payload=values, **kw)


def flush(job: int, worker: int, slot: int = 0, seq: int = 1, **kw) -> bytes:
    return make_packet(Op.FLUSH, job_id=job, worker_id=worker, slot=slot, seq=seq, **kw)


def vec(seed: int, low: int = -1000, high: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, high, 64)


# ---- scenarios -------------------------------------------------------------------------------------
def test_full_round_then_retransmission_after_result(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3)))
    out = run(
        fresh,
        [
            (1, grad(1, 0, vec(1), weight=2, step=9, chunk=4, nelem=60)),
            (2, grad(1, 1, vec(2), weight=3, step=9, chunk=4, nelem=60)),
            (3, grad(1, 2, vec(3), weight=4, step=9, chunk=4, nelem=60)),
            (2, grad(1, 1, vec(2), weight=3)),  # lost its RESULT: unicast resend
            (3, flush(1, 2)),  # FLUSH after the close: resend too
        ],
    )
    assert [len(o) for o in out] == [0, 0, 3, 1, 1]
    result = out[2][0][1]
    np.testing.assert_array_equal(np.frombuffer(result[36:], ">i4"), vec(1) + vec(2) + vec(3))
    total = vec(1) + vec(2) + vec(3)
    round_fields = dict(count=3, bitmap=0b111, weight=9, seq=1, slot=0, worker_id=2)
    assert_result(out[2], [1, 2, 3], total, flags=0, **round_fields)
    assert_result(out[3], [2], total, flags=int(Flag.RETX), **round_fields)
    assert_result(out[4], [3], total, flags=int(Flag.RETX), **round_fields)
    check_counters(
        fresh,
        {1: dict(rx_packets=5, grad_start=1, grad_add=2, result_quorum=1, grad_late_resend=1, flush_resend=1,
                 tx_packets=5)},
        {1: [1, 2, 2]},
    )  # fmt: skip


def test_duplicates_ignored_and_slot_reuse_with_higher_seq(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2)))
    out = run(
        fresh,
        [
            (1, grad(1, 0, vec(1))),
            (1, grad(1, 0, vec(9))),  # duplicate: ignored, not added
            (2, grad(1, 1, vec(2))),
            (1, grad(1, 0, vec(3), seq=2)),  # the slot moves on to round 2
            (2, grad(1, 1, vec(4), seq=1)),  # stale
            (2, flush(1, 1, seq=1)),  # stale FLUSH
            (2, grad(1, 1, vec(4), seq=2)),
        ],
    )
    assert [len(o) for o in out] == [0, 0, 2, 0, 0, 0, 2]
    assert_result(out[2], [1, 2], vec(1) + vec(2), count=2, bitmap=0b11, seq=1)  # not vec(9)
    assert_result(out[6], [1, 2], vec(3) + vec(4), count=2, bitmap=0b11, seq=2)
    check_counters(
        fresh,
        {1: dict(rx_packets=7, grad_start=2, grad_dup=1, grad_add=2, result_quorum=2, grad_stale=1,
                 flush_stale=1, tx_packets=4)},
    )  # fmt: skip


def test_flush_partial_and_count_zero(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3), pool_size=4))
    out = run(
        fresh,
        [
            (1, grad(1, 0, vec(1), slot=1, weight=5)),
            (2, grad(1, 1, vec(2), slot=1, weight=6)),
            (3, flush(1, 2, slot=1)),  # partial: count 2
            (3, grad(1, 2, vec(3), slot=1)),  # too late: the partial result is resent
            (
                1,
                flush(1, 0, slot=2, seq=3, exp=12, step=77, chunk=5, nelem=10, flags=int(Flag.MAX)),
            ),  # count 0
            (2, flush(1, 1, slot=2, seq=3)),  # resend of the empty result
            (2, grad(1, 1, vec(2), slot=2, seq=3)),  # late resend of the count-0 result
        ],
    )
    assert [len(o) for o in out] == [0, 0, 3, 1, 3, 1, 1]
    partial = dict(count=2, bitmap=0b011, weight=11, slot=1, seq=1, worker_id=2)
    assert_result(out[2], [1, 2, 3], vec(1) + vec(2), flags=0, **partial)
    assert_result(out[3], [3], vec(1) + vec(2), flags=int(Flag.RETX), **partial)  # vec(3) not added
    empty = dict(count=0, bitmap=0, weight=0, slot=2, seq=3, exp=12, step=77, chunk=5, nelem=10, worker_id=0)
    assert_result(out[4], [1, 2, 3], np.zeros(64), flags=int(Flag.MAX), **empty)
    assert_result(out[5], [2], np.zeros(64), flags=int(Flag.MAX | Flag.RETX), **empty)
    assert_result(out[6], [2], np.zeros(64), flags=int(Flag.MAX | Flag.RETX), **empty)
    check_counters(
        fresh,
        {1: dict(rx_packets=7, grad_start=1, grad_add=1, flush_partial=1, grad_late_resend=2, flush_empty=1,
                 flush_resend=1, tx_packets=9)},
    )  # fmt: skip


def test_quorum_below_n(fresh):
    add_jobs(fresh, JobSpec(2, workers(2, 3, 4), quorum=2))
    out = run(
        fresh,
        [
            (2, grad(2, 0, vec(5), slot=3)),
            (4, grad(2, 2, vec(6), slot=3)),  # quorum 2 reached: closed, multicast to all three
            (3, grad(2, 1, vec(7), slot=3)),  # the third contribution is late: resend, not added
        ],
    )
    assert [len(o) for o in out] == [0, 3, 1]
    closed = dict(count=2, bitmap=0b101, slot=3, seq=1, worker_id=2, job_id=2)
    assert_result(out[1], [2, 3, 4], vec(5) + vec(6), flags=0, **closed)
    assert_result(out[2], [3], vec(5) + vec(6), flags=int(Flag.RETX), **closed)
    check_counters(
        fresh,
        {2: dict(rx_packets=3, grad_start=1, grad_add=1, result_quorum=1, grad_late_resend=1, tx_packets=4)},
    )


def test_quorum_one_closes_on_every_start(fresh):
    add_jobs(fresh, JobSpec(3, workers(1, 2), quorum=1))
    out = run(
        fresh,
        [(1, grad(3, 0, vec(1), slot=s, seq=2)) for s in range(3)] + [(2, grad(3, 1, vec(2), slot=1, seq=2))],
    )
    for s in range(3):  # every start closes its round at once, with worker 0 alone
        assert_result(out[s], [1, 2], vec(1), count=1, bitmap=0b1, slot=s, seq=2, flags=0, job_id=3)
    assert_result(out[3], [2], vec(1), count=1, bitmap=0b1, slot=1, seq=2, flags=int(Flag.RETX))
    check_counters(
        fresh, {3: dict(rx_packets=4, grad_start=3, result_quorum=3, grad_late_resend=1, tx_packets=7)}
    )


def test_exponent_rounds_take_the_signed_max(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3)))
    low = np.full(64, INT32_MIN)
    a, b, c = low.copy(), low.copy(), low.copy()
    a[:3], b[:3], c[:3] = [-5, 3, -127], [-7, 9, -126], [-6, -2, -127]
    out = run(
        fresh,
        [
            (1, grad(1, 0, a, flags=int(Flag.MAX), nelem=3)),
            (2, grad(1, 1, b, flags=int(Flag.MAX | Flag.SATURATED), nelem=3)),
            (3, grad(1, 2, c, flags=int(Flag.MAX), nelem=3)),
        ],
    )
    assert [len(o) for o in out] == [0, 0, 3]
    expected = low.copy()
    expected[:3] = [-5, 9, -126]  # the signed max per lane, not the sum
    assert_result(out[2], [1, 2, 3], expected, count=3, bitmap=0b111, nelem=3,
                 flags=int(Flag.MAX | Flag.SATURATED))  # fmt: skip
    check_counters(fresh, {1: dict(rx_packets=3, grad_start=1, grad_add=2, result_quorum=1, tx_packets=3)})


def test_exponent_mismatch_and_saturated_flag(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3)))
    out = run(
        fresh,
        [
            (1, grad(1, 0, vec(1), exp=20)),
            (2, grad(1, 1, vec(2), exp=21)),  # other exponent: dropped, counted
            (2, grad(1, 1, vec(2), exp=20, flags=int(Flag.MAX))),  # MAX differs: dropped
            (2, grad(1, 1, vec(2), exp=20, flags=int(Flag.SATURATED))),
            (3, grad(1, 2, vec(3), exp=20)),  # RESULT carries SATURATED
        ],
    )
    assert [len(o) for o in out] == [0, 0, 0, 0, 3]
    assert_result(out[4], [1, 2, 3], vec(1) + vec(2) + vec(3), count=3, bitmap=0b111, exp=20,
                 flags=int(Flag.SATURATED))  # fmt: skip
    check_counters(
        fresh,
        {1: dict(rx_packets=5, grad_start=1, grad_exp_mismatch=2, grad_add=2, result_quorum=1, tx_packets=3)},
    )


def test_int32_sums_wrap_alike(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2)))
    big = np.full(64, 2**31 - 10)
    out = run(fresh, [(1, grad(1, 0, big)), (2, grad(1, 1, big))])
    assert_result(out[1], [1, 2], np.full(64, 2 * (2**31 - 10) - 2**32), count=2)  # wrapped: -20
    check_counters(fresh, {1: dict(rx_packets=2, grad_start=1, grad_add=1, result_quorum=1, tx_packets=2)})


def test_spoofed_and_out_of_range_workers(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2)))
    out = run(
        fresh,
        [
            (1, grad(1, 1, vec(1))),  # claims worker 1 from worker 0's port
            (3, grad(1, 0, vec(1))),  # a port no worker of the job uses
            (1, grad(1, 7, vec(1))),  # worker id >= N
            (2, flush(1, 0)),  # FLUSH spoofed too
        ],
    )
    assert out == [[], [], [], []]
    check_counters(fresh, {1: dict(rx_packets=4, drop_bad_worker=4)}, {1: [0, 0]})


def test_malformed_unknown_job_and_slot_range(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2), pool_size=8))
    ok = grad(1, 0, vec(1))
    out = run(
        fresh,
        [
            (1, ok[:10]),  # shorter than the header
            (1, make_packet(Op.GRAD, job_id=1, version=2)),  # wrong version, known job
            (1, make_packet(Op.GRAD, job_id=9, version=2)),  # wrong version, unknown job
            (1, make_packet(Op.RESULT, job_id=1)),  # RESULT sent to the switch
            (1, make_packet(9, job_id=1)),  # no such op
            (1, ok[:-100]),  # payload too short
            (1, ok + b"\0\0\0\0"),  # payload too long
            (1, grad(1, 0, vec(1), nelem=65)),  # nelem > K
            (1, grad(5, 0, vec(1))),  # unknown job
            (1, grad(1, 0, vec(1), slot=8)),  # slot out of range
            (1, flush(1, 0, slot=300)),  # FLUSH slot out of range
            (1, ok),  # and a good packet still works afterwards
        ],
    )
    assert all(o == [] for o in out)  # the good one starts a round of two
    # What cannot be trusted to name a job counts on index 0: too short, unknown job (any version).
    check_counters(
        fresh,
        {0: dict(rx_packets=3, drop_malformed=2, drop_unknown_job=1),
         1: dict(rx_packets=9, drop_malformed=6, drop_slot_range=2, grad_start=1)},
        {1: [3, 0]},  # the slot-range drops and the good one passed the worker check
    )  # fmt: skip


def test_heartbeats_and_foreign_ops(fresh):
    """HEARTBEAT counts per worker and emits nothing; the parameter-server ops (6..9) and any op past
    HEARTBEAT stay malformed; per-worker counters count before the up policy."""
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3)))
    fresh.configure(lambda ctl: ctl.set_drop_policy(1, "up", DropPolicy("bernoulli", p=1.0), worker=2))
    run(
        fresh,
        [
            (1, make_packet(Op.HEARTBEAT, job_id=1, worker_id=0, nelem=0)),
            (2, make_packet(Op.HEARTBEAT, job_id=1, worker_id=1)),
            (2, make_packet(Op.HEARTBEAT, job_id=1, worker_id=0)),  # spoofed: bad worker
            (1, make_packet(Op.HEARTBEAT, job_id=7, worker_id=0)),  # unknown job
            *[(1, make_packet(op, job_id=1, worker_id=0)) for op in (6, 7, 8, 9, 11, 255)],
            (3, grad(1, 2, vec(3))),  # dropped by the policy, counted for worker 2
            (1, grad(1, 0, vec(1))),
            (2, grad(1, 1, vec(2))),
            (1, make_packet(Op.HEARTBEAT, job_id=1, worker_id=0)),
        ],
    )
    assert fresh.counters()[0][1] == {1: [3, 2, 1]}


def test_quorum_change_keeps_open_rounds(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3, 4)))
    out = run(fresh, [(1, grad(1, 0, vec(1))), (2, grad(1, 1, vec(2))), (1, grad(1, 0, vec(5), slot=1))])
    assert out == [[], [], []]
    fresh.configure(lambda ctl: ctl.set_quorum(1, 3))
    # slot 0 closes at its third contribution, slot 1 needs two more; the fourth worker is late
    out = run(
        fresh,
        [
            (3, grad(1, 2, vec(3))),
            (4, grad(1, 3, vec(4))),
            (2, grad(1, 1, vec(6), slot=1)),
            (4, grad(1, 3, vec(7), slot=1)),
        ],
    )
    assert [len(o) for o in out] == [4, 1, 0, 4]
    assert_result(out[0], [1, 2, 3, 4], vec(1) + vec(2) + vec(3), count=3, bitmap=0b0111, slot=0, flags=0)
    assert_result(out[1], [4], vec(1) + vec(2) + vec(3), count=3, bitmap=0b0111, flags=int(Flag.RETX))
    assert_result(out[3], [1, 2, 3, 4], vec(5) + vec(6) + vec(7), count=3, bitmap=0b1011, slot=1)
    fresh.configure(lambda ctl: ctl.set_quorum(1, 4))
    out = run(fresh, [(w, grad(1, w - 1, vec(w), slot=2)) for w in (1, 2, 3, 4)])
    assert [len(o) for o in out] == [0, 0, 0, 4]
    assert_result(out[3], [1, 2, 3, 4], vec(1) + vec(2) + vec(3) + vec(4), count=4, bitmap=0b1111, slot=2)
    check_counters(
        fresh,
        {
            1: dict(
                rx_packets=11, grad_start=3, grad_add=7, result_quorum=3, grad_late_resend=1, tx_packets=13
            )
        },
    )


def test_duplicate_at_a_lowered_quorum_closes_the_round(fresh):
    """Liveness lowers the quorum of rounds that already hold every survivor's GRAD (docs/protocol.md,
    "A duplicate at the quorum"): a survivor's resend closes each, without adding its values again;
    below the new quorum a duplicate is still only a duplicate."""
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3, 4)))
    own = int(Flag.OWNER)
    out = run(
        fresh,
        [
            (1, grad(1, 0, vec(1), weight=1)),  # slot 0: workers 0, 1, 2 in; worker 3 dies
            (2, grad(1, 1, vec(2), weight=1)),
            (3, grad(1, 2, vec(3), weight=1)),
            (2, grad(1, 1, vec(2), weight=1)),  # quorum 4: a plain duplicate
            (1, grad(1, 0, vec(4), slot=1, flags=own, count=2)),  # slot 1, OWNER (worker 2): 0, 1 in
            (2, grad(1, 1, vec(5), slot=1, flags=own, count=2)),
            (3, grad(1, 2, vec(6), slot=2)),  # slot 2: only worker 2 in
        ],
    )
    assert out == [[]] * 7
    fresh.configure(lambda ctl: ctl.set_quorum(1, 3))
    out = run(
        fresh,
        [
            (2, grad(1, 1, vec(9), weight=1)),  # a resend at the quorum: closes slot 0
            (1, grad(1, 0, vec(1), weight=1)),  # closed: the stored RESULT back to worker 0
            (2, grad(1, 1, vec(5), slot=1, flags=own, count=2)),  # one of three: still a duplicate
            (3, grad(1, 2, vec(6), slot=2)),  # one of three: still a duplicate
        ],
    )
    assert [len(o) for o in out] == [4, 1, 0, 0]
    survivors = vec(1) + vec(2) + vec(3)
    assert_result(out[0], [1, 2, 3, 4], survivors, count=3, bitmap=0b0111, weight=3, worker_id=1, flags=0)
    assert_result(out[1], [1], survivors, count=3, bitmap=0b0111, flags=int(Flag.RETX))
    fresh.configure(lambda ctl: ctl.set_quorum(1, 2))
    out = run(
        fresh,
        [
            (1, grad(1, 0, vec(4), slot=1, flags=own, count=2)),  # at the quorum: to the owner alone
            (3, grad(1, 2, vec(6), slot=2)),  # one of two: still a duplicate
        ],
    )
    assert [len(o) for o in out] == [1, 0]
    assert_result(out[0], [3], vec(4) + vec(5), count=2, bitmap=0b0011, worker_id=0, flags=own)
    check_counters(
        fresh,
        {1: dict(rx_packets=13, grad_start=3, grad_add=3, grad_dup=6, result_quorum=2, grad_late_resend=1,
                 tx_packets=6)},
    )  # fmt: skip


def test_param_and_param_req_replication(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3, 4)))
    params = np.random.default_rng(0).standard_normal(64).astype(np.float32).view(np.int32)
    param = make_packet(Op.PARAM, job_id=1, worker_id=1, chunk=3, step=8, payload=params)
    request = make_packet(Op.PARAM_REQ, job_id=1, worker_id=3, chunk=3)
    out = run(fresh, [(2, param), (4, request)])
    # replicated unchanged to every other worker of the job, never summed
    assert out == [[(1, param), (3, param), (4, param)], [(1, request), (2, request), (3, request)]]
    check_counters(
        fresh, {1: dict(rx_packets=2, param_fwd=1, param_req_fwd=1, tx_packets=6)}, {1: [0, 1, 0, 1]}
    )


def test_drop_policies_up_down_param(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3)))
    drop_all = DropPolicy("bernoulli", p=1.0)
    always_bad = DropPolicy("gilbert_elliott", p=1.0, r=0.0, loss_good=0.0, loss_bad=1.0)

    def policies(ctl: LtaSwitch) -> None:
        ctl.set_drop_policy(1, "up", drop_all, worker=1)
        ctl.set_drop_policy(1, "down", always_bad, worker=2)
        ctl.set_drop_policy(1, "param", drop_all)
        ctl.set_drop_policy(1, "param", DropPolicy("bernoulli", p=0.0), worker=0)

    fresh.configure(policies)
    out = run(
        fresh,
        [
            (1, grad(1, 0, vec(1))),
            (2, grad(1, 1, vec(2))),  # dropped by the up policy
            (2, grad(1, 1, vec(2), flags=int(Flag.CRITICAL))),  # CRITICAL passes it
            (3, grad(1, 2, vec(3))),  # closes; worker 2's replica dropped (down)
            (3, grad(1, 2, vec(3))),  # resend to worker 2: dropped again
            (2, make_packet(Op.PARAM, job_id=1, worker_id=1)),  # only worker 0 receives it
            (2, make_packet(Op.PARAM, job_id=1, worker_id=1, flags=int(Flag.CRITICAL))),  # everyone
            (1, make_packet(Op.PARAM_REQ, job_id=1, worker_id=0)),  # dropped for 1 and 2
        ],
    )
    assert [[p for p, _ in o] for o in out] == [[], [], [], [1, 2], [], [1], [1, 3], []]
    assert_result(out[3], [1, 2], vec(1) + vec(2) + vec(3), count=3, bitmap=0b111, flags=0)
    check_counters(
        fresh,
        {1: dict(rx_packets=8, grad_start=1, drop_policy_up=1, grad_add=2, result_quorum=1,
                 grad_late_resend=1, drop_policy_down=2, param_fwd=2, param_req_fwd=1, drop_policy_param=3,
                 tx_packets=5)},
        {1: [2, 4, 2]},  # counted before the policies
    )  # fmt: skip


def test_owner_only_result_goes_to_the_owner_alone(fresh):
    """Flag.OWNER: the RESULT of the round goes to the worker named in the starting packet's count, never
    to the others, whether the round closes by quorum or by FLUSH, and resends go to the owner too."""
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3), pool_size=8))
    own = int(Flag.OWNER)
    to = {0: 1, 1: 2, 2: 3}  # worker id -> port
    out = run(
        fresh,
        [
            # slot 0: a full round owned by worker 1
            (1, grad(1, 0, vec(1), flags=own, count=1, weight=1)),
            (2, grad(1, 1, vec(2), flags=own, count=1, weight=1)),
            (3, grad(1, 2, vec(3), flags=own, count=1, weight=1)),  # closes: to worker 1 only
            (3, grad(1, 2, vec(3), flags=own, count=1)),  # a non-owner's late GRAD: resent to the owner
            (2, flush(1, 1, flags=own, count=1)),  # the owner's FLUSH after the close: resent to it
            # slot 1: owner 0; worker 1's GRAD is lost upstream, the owner's FLUSH closes the partial
            (1, grad(1, 0, vec(4), slot=1, flags=own, count=0, weight=1)),
            (3, grad(1, 2, vec(5), slot=1, flags=own, count=0, weight=1)),
            (1, flush(1, 0, slot=1, flags=own, count=0)),
            # slot 2: a round the slot never saw, FLUSHed empty by worker 2 for owner 2
            (3, flush(1, 2, slot=2, seq=4, flags=own, count=2, exp=7, nelem=9)),
            # slot 3: an owner that is no worker of the job: the RESULT goes to no one
            (1, grad(1, 0, vec(6), slot=3, flags=own, count=9)),
            (2, grad(1, 1, vec(6), slot=3, flags=own, count=9)),
            (3, grad(1, 2, vec(6), slot=3, flags=own, count=9)),
        ],
    )
    assert [[p for p, _ in o] for o in out] == [[], [], [to[1]], [to[1]], [to[1]], [], [], [to[0]], [to[2]],
                                                [], [], []]  # fmt: skip
    full = vec(1) + vec(2) + vec(3)
    assert_result(out[2], [to[1]], full, count=3, bitmap=0b111, weight=3, flags=own, worker_id=2)
    assert_result(out[3], [to[1]], full, count=3, bitmap=0b111, flags=own | int(Flag.RETX))
    assert_result(out[4], [to[1]], full, count=3, bitmap=0b111, flags=own | int(Flag.RETX))
    # The owner renormalizes over the workers counted: numpy's mean over exactly those.
    partial = decode(out[7][0][1])
    assert (partial["count"], partial["bitmap"], partial["flags"]) == (2, 0b101, own)
    counted = [vec(4), vec(5)]
    np.testing.assert_allclose(partial["payload"] / partial["count"], np.mean(counted, axis=0))
    assert_result(out[8], [to[2]], np.zeros(64), count=0, bitmap=0, flags=own, exp=7, nelem=9, seq=4)
    check_counters(
        fresh,
        {1: dict(rx_packets=12, grad_start=3, grad_add=5, result_quorum=2, grad_late_resend=1,
                 flush_resend=1, flush_partial=1, flush_empty=1, tx_packets=5)},
    )  # fmt: skip


def test_owner_only_result_passes_the_owners_drop_policy_alone(fresh):
    """The down policy is drawn for the owner's replica only: a policy on another worker never counts."""
    add_jobs(fresh, JobSpec(1, workers(1, 2)))
    drop_all = DropPolicy("bernoulli", p=1.0)
    fresh.configure(lambda ctl: ctl.set_drop_policy(1, "down", drop_all, worker=1))
    own = int(Flag.OWNER)
    out = run(
        fresh,
        [
            (1, grad(1, 0, vec(1), flags=own, count=0)),
            (2, grad(1, 1, vec(2), flags=own, count=0)),  # to worker 0: worker 1's policy never drawn
            (1, grad(1, 0, vec(1), slot=1, flags=own, count=1)),
            (2, grad(1, 1, vec(2), slot=1, flags=own, count=1)),  # to worker 1: dropped by its policy
        ],
    )
    assert [[p for p, _ in o] for o in out] == [[], [1], [], []]
    check_counters(
        fresh,
        {1: dict(rx_packets=4, grad_start=2, grad_add=2, result_quorum=2, drop_policy_down=1, tx_packets=1)},
    )


def test_two_jobs_share_ports_and_slot_numbers(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3), pool_size=16), JobSpec(2, workers(2, 3, 4), pool_size=16))
    out = run(
        fresh,
        [
            (1, grad(1, 0, vec(1), slot=5)),
            (2, grad(2, 0, vec(2), slot=5)),
            (2, grad(1, 1, vec(3), slot=5)),
            (3, grad(2, 1, vec(4), slot=5)),
            (3, grad(1, 2, vec(5), slot=5)),
            (4, grad(2, 2, vec(6), slot=5)),
        ],
    )
    assert [len(o) for o in out] == [0, 0, 0, 0, 3, 3]
    assert_result(out[4], [1, 2, 3], vec(1) + vec(3) + vec(5), job_id=1, count=3, bitmap=0b111, slot=5)
    assert_result(out[5], [2, 3, 4], vec(2) + vec(4) + vec(6), job_id=2, count=3, bitmap=0b111, slot=5)
    each = dict(rx_packets=3, grad_start=1, grad_add=2, result_quorum=1, tx_packets=3)
    check_counters(fresh, {1: each, 2: each})


def test_reset_job_on_both(fresh):
    add_jobs(fresh, JobSpec(1, workers(1, 2)))
    out = run(fresh, [(1, grad(1, 0, vec(1))), (2, grad(1, 1, vec(2)))])
    assert_result(out[1], [1, 2], vec(1) + vec(2), count=2, seq=1)
    fresh.configure(lambda ctl: ctl.reset_job(1))
    out = run(fresh, [(1, grad(1, 0, vec(3))), (2, grad(1, 1, vec(2))), (2, flush(1, 1, slot=1, seq=4))])
    # round 1 of slot 0 starts afresh (not a late resend of the old result), slot 1 is empty
    assert_result(out[1], [1, 2], vec(3) + vec(2), count=2, bitmap=0b11, seq=1, flags=0)
    assert_result(out[2], [1, 2], np.zeros(64), count=0, bitmap=0, slot=1, seq=4, flags=0)
    check_counters(
        fresh, {1: dict(rx_packets=3, grad_start=1, grad_add=1, result_quorum=1, flush_empty=1, tx_packets=4)}
    )


@pytest.mark.bmv2
@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
def test_seeded_random_sequence(fresh_pair):
    """A seeded mix of GRADs, FLUSHes and PARAMs (stale, future, spoofed, every flag): BMv2 and the
    softswitch agree packet by packet and counter by counter. Differential only: its one expectation is
    BMv2's agreement, so it needs BMv2 (the softswitch's own rules are checked by hand elsewhere)."""
    fresh = fresh_pair
    add_jobs(
        fresh, JobSpec(1, workers(1, 2, 3), pool_size=4), JobSpec(2, workers(2, 3, 4), quorum=2, pool_size=3)
    )
    rng = random.Random(2024)
    ports = {1: (1, 2, 3), 2: (2, 3, 4)}
    packets = []
    for _ in range(300):
        job = rng.choice((1, 2))
        worker = rng.randrange(3)
        port = ports[job][worker] if rng.random() > 0.05 else rng.randint(1, 4)
        kind = rng.choices(("grad", "flush", "param"), (0.8, 0.15, 0.05))[0]
        flags = rng.choice((0, 0, 0, int(Flag.MAX), int(Flag.SATURATED), int(Flag.CRITICAL)))
        fields = dict(slot=rng.randrange(5), seq=rng.randint(1, 3), exp=rng.choice((0, 0, 1)), flags=flags)
        if kind == "grad":
            lta = grad(job, worker, vec(rng.randrange(10**6)), weight=rng.randrange(5), **fields)
        elif kind == "flush":
            lta = flush(job, worker, **fields)
        else:
            lta = make_packet(Op.PARAM, job_id=job, worker_id=worker, payload=vec(1))
        packets.append((port, lta))
    out = run(fresh, packets)
    assert sum(len(o) for o in out) > 50  # the sequence really closed rounds
    assert fresh.bmv2 is not None  # the comparison ran


def test_seeded_lossy_rounds(fresh):
    """Rounds as hosts send them (unit g in slot g mod P, seq g div P + 1), with random losses,
    duplicates, late packets, FLUSHes and exponent rounds: mostly adds and quorum closes. Independent
    expectation on every switch: each first RESULT of a round carries the sum (or the max) of the values
    of exactly the workers in its bitmap, its count the bitmap's size; with BMv2, both agree too."""
    add_jobs(fresh, JobSpec(1, workers(1, 2, 3, 4), pool_size=4))
    rng = random.Random(7)
    packets = []
    sent: dict[tuple[int, int], tuple[dict[int, np.ndarray], bool]] = {}  # (slot, seq) -> values, MAX
    for g in range(60):
        slot, seq = g % 4, g // 4 + 1
        exponent_round = rng.random() < 0.3
        flags = int(Flag.MAX) if exponent_round else 0
        senders = [w for w in range(4) if rng.random() > 0.15]
        for w in senders:
            values = vec(rng.randrange(10**6), -(2**20), 2**20)
            sent.setdefault((slot, seq), ({}, exponent_round))[0][w] = values
            lta = grad(
                1, w, values, slot=slot, seq=seq, flags=flags, exp=0 if exponent_round else 12, weight=w + 1
            )
            packets.append((w + 1, lta))
            if rng.random() < 0.1:
                packets.append((w + 1, lta))  # duplicate (or a late resend request once closed)
        if len(senders) < 4:
            w = rng.randrange(4)
            packets.append((w + 1, flush(1, w, slot=slot, seq=seq, flags=flags)))
    out = run(fresh, packets)
    assert sum(len(o) for o in out) > 150
    rounds = set()
    for _port, lta in (p for o in out for p in o):
        got = decode(lta)
        assert got["op"] == Op.RESULT, got["op"]
        values, is_max = sent[(got["slot"], got["seq"])]
        counted = [w for w in range(4) if got["bitmap"] >> w & 1]
        assert counted and set(counted) <= set(values) and got["count"] == len(counted)
        members = np.array([values[w] for w in counted])
        np.testing.assert_array_equal(got["payload"], members.max(axis=0) if is_max else members.sum(axis=0))
        rounds.add((got["slot"], got["seq"]))
    assert len(rounds) > 50  # nearly every round of the 60 was checked
    counters = fresh.counters()[0][0][1]
    assert counters["result_quorum"] > 20 and counters["flush_partial"] > 5 and counters["grad_add"] > 100


# ---- damaged IPv4/UDP headers (issue F: what the switch sends is well-formed, whatever it received) --------
class _PairedRawPorts:
    """The softswitch's raw-port front end (softswitch/rawport.py) on socket pairs instead of interfaces,
    around the pair's SoftSwitch, so that both switches see the same frames."""

    def __init__(self, switch: SoftSwitch) -> None:
        import socket

        from softswitch.rawport import RawPortSwitch

        far_ends: dict[str, socket.socket] = {}

        class Paired(RawPortSwitch):
            def _open(self, intf: str) -> socket.socket:  # type: ignore[override]
                near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
                far.setblocking(False)
                far_ends[intf] = far
                return near

        self.far_ends = far_ends
        self.raw = Paired(switch, {p: f"p{p}" for p in range(1, N_PORTS + 1)}, SWITCH_IP, mac=SWITCH_MAC)

    def exchange(self, port: int, frame: bytes) -> list[tuple[int, bytes]]:
        self.raw.handle_frame(port, frame)
        out = []
        for p in range(1, N_PORTS + 1):
            while True:
                try:
                    out.append((p, self.far_ends[f"p{p}"].recv(65535)))
                except BlockingIOError:
                    break
        return out

    def close(self) -> None:
        self.raw.close()
        for sock in self.far_ends.values():
            sock.close()


def _damage(frame: bytes, how: str) -> bytes:
    from scapy.layers.l2 import Ether

    packet = Ether(frame)
    ip = packet[IP]
    if how == "checksum":
        ip.chksum ^= 0x0101
        return bytes(packet)
    if how == "fragment":  # the fuzzing finding: flags/fragment word 0x2001
        ip.flags, ip.frag = 1, 1
    elif how == "short_total_length":  # IPv4 total length 512 of a longer datagram
        ip.len = 512
    elif how == "trailing_bytes":
        return bytes(packet) + b"\xaa" * 10
    elif how == "udp_length":
        packet[UDP].len -= 4
        return bytes(packet)
    del ip.chksum  # a valid checksum over the damaged header
    return bytes(packet)


DAMAGES = ["checksum", "fragment", "short_total_length", "trailing_bytes", "udp_length"]


@pytest.mark.bmv2
@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_ipv4_never_reaches_a_result_and_replicas_are_rebuilt(fresh_pair, how):
    fresh = fresh_pair
    add_jobs(fresh, JobSpec(1, workers(1, 2)))
    raw = _PairedRawPorts(fresh.softswitch)
    try:
        first = worker_frame(grad(1, 0, vec(1)), host_worker(1))
        assert fresh.bmv2.exchange(1, first, 0) == [] and raw.exchange(1, first) == []
        # worker 1's GRAD would close the round; damaged, it is dropped by both and counted on index 0
        damaged = _damage(worker_frame(grad(1, 1, vec(2)), host_worker(2)), how)
        assert fresh.bmv2.exchange(2, damaged, 0, timeout_s=0.5) == []
        assert raw.exchange(2, damaged) == []
        (bmv2_counters, bmv2_rx), (soft_counters, soft_rx) = fresh.counters()
        assert (bmv2_counters, bmv2_rx) == (soft_counters, soft_rx)
        assert bmv2_counters[0]["drop_malformed"] == 1 and bmv2_counters[1]["rx_packets"] == 1
        assert bmv2_rx == {1: [1, 0]}  # the damaged frame is nobody's
        # The same GRAD with TTL 1, DSCP and an odd identification closes the round: every replica's
        # IPv4 header is the switch's own (TTL 64, DF, id 0, no options), byte for byte on both switches.
        from scapy.layers.l2 import Ether

        odd = Ether(worker_frame(grad(1, 1, vec(2)), host_worker(2)))
        odd[IP].ttl, odd[IP].tos, odd[IP].id = 1, 0xB8, 4242
        del odd[IP].chksum
        got = sorted(fresh.bmv2.exchange(2, bytes(odd), 2))
        want = sorted(raw.exchange(2, bytes(odd)))
        assert [p for p, _ in got] == [1, 2]
        for (port, frame), (_, soft_frame) in zip(got, want, strict=True):
            check_frame(port, frame)
            ip = Ether(frame)[IP]
            assert (ip.version, ip.ihl, ip.tos, ip.id, int(ip.flags), ip.frag, ip.ttl) == (
                4,
                5,
                0,
                0,
                2,
                0,
                64,
            )
            assert ip.len == len(frame) - 14
            assert frame == soft_frame
    finally:
        raw.close()
