"""The control plane over real gRPC: against the softswitch's P4Runtime server always, and against
BMv2 (simple_switch_grpc on veth pairs) wherever it is installed — the same tests, one code path.

Each test configures the switch through ``controlplane`` only, then checks the data plane's behaviour
with hand-built packets (sums, counts, who receives what) and the counters read back over P4Runtime.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from controlplane.bmv2 import Bmv2Switch, bmv2_missing, host_worker, lta_of, worker_frame
from controlplane.errors import (
    ControlPlaneError,
    NotPrimary,
    PipelineMismatch,
    SwitchUnreachable,
    WriteRejected,
)
from controlplane.jobs import JobSpec, job_entry
from controlplane.switch import LtaSwitch
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.p4.info import load_p4info, update
from hostlib.p4.proto import p4runtime_pb2
from hostlib.p4.schema import BMV2_JSON_PATH, JOB_ROLES_TABLE, WORKER_ADDRESSES_TABLE
from hostlib.protocol import COUNTERS, Flag, Header, Op, Role, make_packet
from softswitch.p4runtime_server import serve
from softswitch.pipeline import SoftSwitch

N_PORTS = 4


@dataclass
class Rig:
    """A switch reachable over P4Runtime plus a way to push LTA packets through its data plane."""

    kind: str
    target: str
    softswitch: SoftSwitch | None = None
    bmv2: Bmv2Switch | None = None

    def send(self, port: int, lta: bytes, expect: int) -> list[tuple[int, bytes]]:
        """Packets caused by ``lta`` arriving on ``port``, as (egress port, LTA bytes)."""
        if self.softswitch is not None:
            return self.softswitch.process(lta, port)
        frames = self.bmv2.exchange(port, worker_frame(lta, host_worker(port)), expect)
        return [(p, lta_of(f)[0]) for p, f in frames]


def _bmv2_params():
    reason = bmv2_missing() or (None if BMV2_JSON_PATH.exists() else "p4/build/lta.json not compiled yet")
    return pytest.param(
        "bmv2", marks=[pytest.mark.bmv2, pytest.mark.skipif(reason is not None, reason=reason or "")]
    )


@pytest.fixture(params=["softswitch", _bmv2_params()])
def rig(request) -> Iterator[Rig]:
    if request.param == "softswitch":
        softswitch = SoftSwitch(seed=7)
        server, port, _ = serve(softswitch)
        try:
            yield Rig("softswitch", f"127.0.0.1:{port}", softswitch=softswitch)
        finally:
            server.stop(None)
    else:
        with Bmv2Switch(N_PORTS, prefix=f"lc{abs(hash(request.node.name)) % 10000}x") as bmv2:
            yield Rig("bmv2", bmv2.target, bmv2=bmv2)


@pytest.fixture
def ctl(rig) -> Iterator[LtaSwitch]:
    with LtaSwitch.connect(rig.target, timeout_s=5) as switch:
        switch.load_pipeline()
        yield switch


def workers(n: int):
    return tuple(host_worker(port) for port in range(1, n + 1))


def grad(worker: int, values, slot: int = 0, seq: int = 1, job_id: int = 1, **kw) -> bytes:
    return make_packet(Op.GRAD, job_id=job_id, worker_id=worker, slot=slot, seq=seq, payload=values, **kw)


def results(out: list[tuple[int, bytes]]) -> dict[int, tuple[Header, np.ndarray]]:
    """RESULTs by egress port: header and payload."""
    return {port: (Header.unpack(b), np.frombuffer(b[36:], dtype=">i4")) for port, b in out}


def nonzero(counters: dict[str, int]) -> dict[str, int]:
    return {name: value for name, value in counters.items() if value}


# ---- pipeline ------------------------------------------------------------------------------------
def test_check_pipeline_before_and_after_load(rig):
    with LtaSwitch.connect(rig.target, timeout_s=5) as switch:
        with pytest.raises(PipelineMismatch, match="no pipeline loaded"):
            switch.check_pipeline()
        assert switch.ensure_pipeline() is True
        switch.check_pipeline()
        assert switch.ensure_pipeline() is False  # already running: not reloaded


def test_another_program_is_reported(rig, tmp_path: Path):
    foreign = load_p4info()
    foreign.tables[0].size = 7  # a different program with our names
    path = tmp_path / "other.p4info.txtpb"
    path.write_text(text_format.MessageToString(foreign))
    with LtaSwitch.connect(rig.target, timeout_s=5, p4info_path=path) as other:
        other.load_pipeline()
    with LtaSwitch.connect(rig.target, timeout_s=5) as switch:
        with pytest.raises(PipelineMismatch, match="runs another P4 program.*lta ctl load"):
            switch.check_pipeline()


def test_p4info_without_lta_names_is_refused(tmp_path: Path):
    info = load_p4info()
    del info.counters[:]
    path = tmp_path / "bad.p4info.txtpb"
    path.write_text(text_format.MessageToString(info))
    with pytest.raises(PipelineMismatch, match="missing: counter rx_packets"):
        LtaSwitch(session=None, p4info_path=path)


def test_unreachable_switch_says_what_to_do():
    from controlplane.bmv2 import free_tcp_port

    target = f"127.0.0.1:{free_tcp_port()}"
    with pytest.raises(SwitchUnreachable) as info:
        LtaSwitch.connect(target, timeout_s=0.3)
    message = str(info.value)
    assert f"switch at {target} did not answer within 0.3 s" in message
    assert "simple_switch_grpc" in message and "lta ctl --target" in message


def test_lower_election_id_is_not_primary(rig):
    with LtaSwitch.connect(rig.target, election_id=(0, 5), timeout_s=5):
        with pytest.raises(NotPrimary, match="higher election id"):
            LtaSwitch.connect(rig.target, election_id=(0, 2), timeout_s=5)


# ---- jobs ------------------------------------------------------------------------------------------
def test_job_aggregates_and_counts(rig, ctl):
    job = ctl.add_job(JobSpec(1, workers(3)))
    assert job.slot_base == 0
    a, b, c = (np.arange(64) * k for k in (1, -2, 5))
    assert rig.send(1, grad(0, a, weight=3), expect=0) == []
    assert rig.send(2, grad(1, b, weight=4), expect=0) == []
    out = results(rig.send(3, grad(2, c, weight=5), expect=3))
    assert sorted(out) == [1, 2, 3]
    for header, payload in out.values():
        assert header.op == Op.RESULT and header.count == 3 and header.bitmap == 0b111
        assert header.weight == 12 and header.worker_id == 2
        np.testing.assert_array_equal(payload, a + b + c)
    counters = ctl.read_counters(1)[1]
    assert nonzero(counters) == {
        "rx_packets": 3,
        "grad_start": 1,
        "grad_add": 2,
        "result_quorum": 1,
        "tx_packets": 3,
    }
    assert set(counters) == set(COUNTERS)


def test_tables_and_multicast_group_read_back(rig, ctl):
    job = ctl.add_job(JobSpec(2, workers(3), quorum=2, pool_size=100))
    assert ctl.jobs() == {2: replace(job, quorum=2)}
    entity = p4runtime_pb2.Entity()
    entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 2
    groups = list(ctl.session.read([entity]))
    replicas = groups[0].packet_replication_engine_entry.multicast_group_entry.replicas
    assert sorted((r.egress_port, r.instance) for r in replicas) == [(1, 0), (2, 1), (3, 2)]


def test_pools_do_not_overlap_and_capacity_is_enforced(ctl):
    first = ctl.add_job(JobSpec(1, workers(2), pool_size=1000))
    second = ctl.add_job(JobSpec(2, workers(2), pool_size=500))
    assert (first.slot_base, second.slot_base) == (0, 1000)
    ctl.remove_job(1)
    third = ctl.add_job(JobSpec(3, workers(2), pool_size=800))
    assert third.slot_base == 0  # first fit in the freed range
    with pytest.raises(ValueError, match="no room for a pool of 60000 slots"):
        ctl.add_job(JobSpec(4, workers(2), pool_size=60000))


def test_duplicate_and_missing_jobs_are_clear_errors(ctl):
    ctl.add_job(JobSpec(1, workers(2)))
    with pytest.raises(ControlPlaneError, match="job 1 already exists.*lta ctl job rm 1"):
        ctl.add_job(JobSpec(1, workers(2)))
    with pytest.raises(ControlPlaneError, match="no job 9"):
        ctl.remove_job(9)


def test_rejected_write_lists_each_failed_update(ctl):
    job = ctl.add_job(JobSpec(1, workers(2)))
    from hostlib.p4.info import to_proto

    duplicate = update("INSERT", to_proto(ctl.names, job_entry(job)))
    with pytest.raises(
        WriteRejected, match="(?s)rejected 1 of 1 updates.*INSERT table_entry #0: ALREADY_EXISTS"
    ):
        ctl.session.write([duplicate])


def test_spoofed_worker_and_unknown_job_are_dropped_and_counted(rig, ctl):
    ctl.add_job(JobSpec(1, workers(2)))
    assert rig.send(2, grad(0, np.ones(64)), expect=0) == []  # worker 0 claimed from worker 1's port
    assert rig.send(1, grad(0, np.ones(64), job_id=5), expect=0) == []
    counters = ctl.read_counters()
    assert nonzero(counters[1]) == {"rx_packets": 1, "drop_bad_worker": 1}
    assert nonzero(counters[0]) == {"rx_packets": 1, "drop_unknown_job": 1}


def test_reset_forgets_slots_and_zeroes_counters(rig, ctl):
    ctl.add_job(JobSpec(1, workers(2)))
    rig.send(1, grad(0, np.full(64, 2)), expect=0)
    assert len(rig.send(2, grad(1, np.full(64, 3)), expect=2)) == 2
    # Before the reset, seq 1 again is a late packet: the stored result is resent.
    resent = results(rig.send(1, grad(0, np.full(64, 2)), expect=1))
    assert resent[1][0].flags & Flag.RETX and resent[1][0].count == 2
    ctl.reset_job(1)
    assert nonzero(ctl.read_counters(1)[1]) == {}
    # After it, the slot is unused: seq 1 starts a fresh round.
    assert rig.send(1, grad(0, np.full(64, 7)), expect=0) == []
    out = results(rig.send(2, grad(1, np.full(64, 1)), expect=2))
    np.testing.assert_array_equal(out[2][1], np.full(64, 8))
    assert nonzero(ctl.read_counters(1)[1]) == {
        "rx_packets": 2,
        "grad_start": 1,
        "grad_add": 1,
        "result_quorum": 1,
        "tx_packets": 2,
    }


def test_removed_job_stops_aggregating(rig, ctl):
    ctl.add_job(JobSpec(1, workers(2)))
    ctl.set_drop_policy(1, "up", DropPolicy("bernoulli", p=0.5))
    ctl.remove_job(1)
    assert ctl.jobs() == {} and ctl.drop_policies() == []
    assert rig.send(1, grad(0, np.ones(64)), expect=0) == []
    assert nonzero(ctl.read_counters(0)[0]) == {"rx_packets": 1, "drop_unknown_job": 1}


# ---- drop policies ---------------------------------------------------------------------------------
def test_up_policy_for_one_worker_drops_only_its_grads(rig, ctl):
    ctl.add_job(JobSpec(1, workers(3)))
    ctl.set_drop_policy(1, "up", DropPolicy("bernoulli", p=1.0), worker=1)
    assert rig.send(1, grad(0, np.full(64, 1)), expect=0) == []
    assert rig.send(2, grad(1, np.full(64, 10)), expect=0) == []  # dropped by the policy
    assert rig.send(3, grad(2, np.full(64, 100)), expect=0) == []  # count 2 < quorum 3
    flush = make_packet(Op.FLUSH, job_id=1, worker_id=0, slot=0, seq=1)
    out = results(rig.send(1, flush, expect=3))
    header, payload = out[2]
    assert header.count == 2 and header.bitmap == 0b101
    np.testing.assert_array_equal(payload, np.full(64, 101))
    assert nonzero(ctl.read_counters(1)[1]) == {
        "rx_packets": 4,
        "drop_policy_up": 1,
        "grad_start": 1,
        "grad_add": 1,
        "flush_partial": 1,
        "tx_packets": 3,
    }
    # Removing the policy lets worker 1 through again (next round).
    ctl.set_drop_policy(1, "up", None, worker=1)
    assert ctl.drop_policies(1) == []
    assert rig.send(2, grad(1, np.full(64, 10), seq=2), expect=0) == []
    assert ctl.read_counters(1)[1]["grad_start"] == 2


def test_worker_policy_wins_over_job_policy_and_down_drops_replicas(rig, ctl):
    ctl.add_job(JobSpec(1, workers(3), quorum=1))
    ctl.set_drop_policy(1, "down", DropPolicy("bernoulli", p=1.0))  # every receiver ...
    ctl.set_drop_policy(1, "down", DropPolicy("bernoulli", p=0.0), worker=2)  # ... but worker 2
    out = rig.send(1, grad(0, np.full(64, 4)), expect=1)
    assert [port for port, _ in out] == [3]
    counters = ctl.read_counters(1)[1]
    assert (counters["drop_policy_down"], counters["tx_packets"]) == (2, 1)
    policies = {(d, w): p for d, _, w, p in ctl.drop_policies(1)}
    assert policies == {
        ("down", None): DropPolicy("bernoulli", p=1.0),
        ("down", 2): DropPolicy("bernoulli", p=0.0),
    }


def test_param_policy_spares_critical_packets(rig, ctl):
    ctl.add_job(JobSpec(1, workers(3)))
    ctl.set_drop_policy(1, "param", DropPolicy("gilbert_elliott", p=1.0, r=0.0, loss_good=0.0, loss_bad=1.0))
    param = make_packet(Op.PARAM, job_id=1, worker_id=0, payload=np.arange(64))
    assert rig.send(1, param, expect=0) == []
    critical = make_packet(Op.PARAM, job_id=1, worker_id=0, payload=np.arange(64), flags=Flag.CRITICAL)
    out = rig.send(1, critical, expect=2)
    assert sorted(port for port, _ in out) == [2, 3]
    assert all(data == critical for _, data in out)
    assert nonzero(ctl.read_counters(1)[1]) == {
        "rx_packets": 2,
        "param_fwd": 2,
        "drop_policy_param": 2,
        "tx_packets": 2,
    }


# ---- liveness: heartbeats, per-worker counters, quorum changes ----------------------------------
def heartbeat(worker: int, job_id: int = 1) -> bytes:
    return make_packet(Op.HEARTBEAT, job_id=job_id, worker_id=worker, nelem=0)


def test_heartbeats_and_traffic_count_per_worker_and_nothing_leaves(rig, ctl):
    ctl.add_job(JobSpec(1, workers(3)))
    ctl.set_drop_policy(1, "up", DropPolicy(p=1.0), worker=2)  # worker 2's GRADs dropped by policy
    for _ in range(3):
        assert rig.send(1, heartbeat(0), expect=0) == []
    assert rig.send(2, grad(1, np.ones(64)), expect=0) == []
    assert rig.send(3, grad(2, np.ones(64)), expect=0) == []  # still counted: before the policy
    assert rig.send(3, heartbeat(2), expect=0) == []
    assert rig.send(2, heartbeat(0), expect=0) == []  # worker 0 claimed from worker 1's port
    assert rig.send(1, heartbeat(0, job_id=9), expect=0) == []  # no such job
    assert ctl.read_worker_rx(1, 3) == [3, 1, 2]
    counters = ctl.read_counters()
    assert nonzero(counters[1]) == {
        "rx_packets": 7,
        "heartbeat": 4,
        "grad_start": 1,
        "drop_policy_up": 1,
        "drop_bad_worker": 1,
    }
    assert nonzero(counters[0]) == {"rx_packets": 1, "drop_unknown_job": 1}


def test_quorum_lowered_and_restored_keeps_the_slots(rig, ctl):
    ctl.add_job(JobSpec(1, workers(3)))
    a, b, c = (np.arange(64) * k for k in (1, 2, 3))
    assert rig.send(1, grad(0, a), expect=0) == []  # slot 0 round 1 open with worker 0's values
    assert ctl.set_quorum(1, 2).quorum == 2
    assert ctl.jobs()[1].quorum == 2
    out = results(rig.send(2, grad(1, b), expect=3))  # count 2 = the new quorum: closes
    assert sorted(out) == [1, 2, 3]
    for header, payload in out.values():
        assert header.count == 2 and header.bitmap == 0b011
        np.testing.assert_array_equal(payload, a + b)  # the sum kept across the MODIFY
    late = results(rig.send(3, grad(2, c), expect=1))  # the third worker is late: gets the result
    assert late[3][0].flags & Flag.RETX and late[3][0].count == 2
    ctl.set_quorum(1, 3)
    assert rig.send(1, grad(0, a, slot=1), expect=0) == []
    assert rig.send(2, grad(1, b, slot=1), expect=0) == []  # 2 of 3: open again
    assert len(rig.send(3, grad(2, c, slot=1), expect=3)) == 3
    with pytest.raises(ControlPlaneError, match="quorum must be 1..3"):
        ctl.set_quorum(1, 4)


# ---- hierarchy roles (docs/protocol.md, "Hierarchy") -----------------------------------------------
def leaf_job(quorum: int | None = None) -> JobSpec:
    """Leaf 1 of job 1: global workers 2 and 3 on ports 1 and 2; the spine behind port 4."""
    return JobSpec(
        1,
        (None, None, host_worker(1), host_worker(2)),
        quorum=quorum,
        role=Role.LEAF,
        uplink=host_worker(4),
        leaf_id=1,
    )


def test_leaf_and_spine_jobs_are_written_read_back_and_removed(rig, ctl):
    leaf = ctl.add_job(leaf_job(quorum=1))
    spine = ctl.add_job(JobSpec(2, workers(3), role=Role.SPINE, pool_size=16))
    assert ctl.jobs() == {1: leaf, 2: replace(spine, quorum=3)}  # quorum None: all 3 leaves
    assert (leaf.quorum, leaf.local) == (1, [2, 3])
    roles = {e.match["job_id"]: e for e in ctl.read_table(JOB_ROLES_TABLE)}
    assert roles[1].action.endswith(".leaf") and roles[1].params == {"uplink_port": 4, "leaf_id": 1}
    assert roles[2].action.endswith(".spine") and roles[2].params == {}
    uplink = [e for e in ctl.read_table(WORKER_ADDRESSES_TABLE) if e.match == {"job_id": 1, "worker_id": 255}]
    assert uplink[0].params["udp_port"] == host_worker(4).udp_port
    entity = p4runtime_pb2.Entity()
    entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 1
    replicas = list(ctl.session.read([entity]))[
        0
    ].packet_replication_engine_entry.multicast_group_entry.replicas
    assert sorted((r.egress_port, r.instance) for r in replicas) == [(1, 2), (2, 3)]  # its own workers only
    # The data plane: the leaf's round closes at quorum 1 and goes up as contributor 1.
    a = np.arange(64) * 3
    out = rig.send(1, grad(2, a, weight=2), expect=1)
    assert [p for p, _ in out] == [4]
    header = Header.unpack(out[0][1])
    assert (header.op, header.worker_id, header.count, header.bitmap, header.weight) == (
        Op.GRAD,
        1,
        1,
        0b100,
        2,
    )
    np.testing.assert_array_equal(np.frombuffer(out[0][1][36:], dtype=">i4"), a)
    # The spine takes a partial from leaf 0 on port 1 (count 2, workers 0 and 1).
    part = make_packet(Op.GRAD, job_id=2, worker_id=0, seq=1, payload=a, count=2, bitmap=0b11)
    assert rig.send(1, part, expect=0) == []
    assert nonzero(ctl.read_counters(1)[1]) == {
        "rx_packets": 1, "grad_start": 1, "result_quorum": 1, "up_partial": 1, "tx_packets": 1
    }  # fmt: skip
    assert nonzero(ctl.read_counters(2)[2]) == {"rx_packets": 1, "grad_start": 1}
    with pytest.raises(ControlPlaneError, match="quorum must be 1..2"):
        ctl.set_quorum(1, 3)  # a leaf's quorum counts its own workers
    ctl.remove_job(1)
    assert set(ctl.jobs()) == {2}
    assert [e.match["job_id"] for e in ctl.read_table(JOB_ROLES_TABLE)] == [2]
    assert not [e for e in ctl.read_table(WORKER_ADDRESSES_TABLE) if e.match["job_id"] == 1]
    assert rig.send(1, grad(2, a, slot=1), expect=0) == []
    assert nonzero(ctl.read_counters(0)[0]) == {"rx_packets": 1, "drop_unknown_job": 1}


def test_lta_ctl_apply_installs_a_leaf_from_a_jobs_file(rig):
    from controlplane.deployment import apply, parse

    text = """
[[jobs]]
job_id = 3
role = "leaf"
leaf_id = 2
worker_base = 4
uplink = { ip = "10.0.0.9", udp_port = 48879, port = 3, mac = "02:00:00:00:00:09" }
workers = [1, 2]
[[jobs.drop]]
direction = "up"
worker = 1
model = "bernoulli"
p = 1.0
"""
    deployment = parse(text, "leaf.toml", target=rig.target)
    logs: list[str] = []
    apply(deployment, log=logs.append)  # loads the pipeline too
    with LtaSwitch.connect(rig.target, timeout_s=5, read_only=True) as ctl:
        job = ctl.jobs()[3]
        policies = [(d, j, w) for d, j, w, _ in ctl.drop_policies(3)]
    assert (job.role, job.leaf_id, job.local, job.uplink.port, job.uplink.ip) == (
        Role.LEAF, 2, [4, 5], 3, "10.0.0.9"
    )  # fmt: skip
    assert policies == [("up", 3, 5)]  # the file's worker 1 is global worker 5
    apply(deployment, log=logs.append)
    assert logs[-2].endswith("job 3 unchanged"), logs


def test_roles_need_a_program_that_has_them(tmp_path: Path):
    """A P4 program without job roles (the Tofino one) holds flat jobs only: lta ctl says so."""
    info = load_p4info()
    role_tables = {t.preamble.id for t in info.tables if t.preamble.name == JOB_ROLES_TABLE}
    kept = [t for t in info.tables if t.preamble.id not in role_tables]
    del info.tables[:]
    info.tables.extend(kept)
    path = tmp_path / "no_roles.p4info.txtpb"
    path.write_text(text_format.MessageToString(info))

    class NoTables:
        target = "tofino:50052"

        def read(self, entities):
            return []

    switch = LtaSwitch(session=NoTables(), p4info_path=path)
    assert not switch.names.has_roles() and LtaSwitch(session=None).names.has_roles()
    with pytest.raises(ControlPlaneError, match="job 1 is a leaf.*no job roles"):
        switch.add_job(leaf_job())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(role=Role.LEAF), "a leaf needs an uplink"),
        (dict(workers=(None, host_worker(1))), "only a leaf may leave workers out"),
        (dict(uplink=host_worker(4)), "only a leaf has an uplink"),
        (dict(role=Role.LEAF, uplink=host_worker(4), leaf_id=32), "leaf_id must be in 0..31"),
        (dict(role=Role.SPINE, workers=tuple(host_worker(1) for _ in range(33))), "at most 32 leaves"),
        (dict(role=Role.LEAF, uplink=host_worker(4), workers=(None, host_worker(1)), quorum=2), "1..1"),
        (dict(role=Role.LEAF, uplink=host_worker(4), workers=(None, None)), "no worker is served here"),
    ],
)
def test_job_spec_refuses_bad_roles(kwargs, message):
    with pytest.raises(ValueError, match=message):
        JobSpec(1, **{"workers": workers(2), **kwargs})


def test_role_entries():
    from hostlib.jobconfig import WorkerEntry
    from hostlib.p4.jobentries import role_entries
    from hostlib.p4.schema import SET_LEAF, SET_SPINE, UPLINK_WORKER_ID

    assert role_entries(5, Role.FLAT) == []
    (spine,) = role_entries(5, Role.SPINE)
    assert (spine.table, spine.match, spine.action) == (JOB_ROLES_TABLE, {"job_id": 5}, SET_SPINE)
    uplink = WorkerEntry(ip="10.0.0.9", udp_port=48879, port=7, mac="02:00:00:00:00:09")
    leaf, address = role_entries(5, Role.LEAF, 3, uplink)
    assert (leaf.action, leaf.params) == (SET_LEAF, {"uplink_port": 7, "leaf_id": 3})
    assert address.match == {"job_id": 5, "worker_id": UPLINK_WORKER_ID}
    assert address.params == {"mac": 0x020000000009, "ipv4": 0x0A000009, "udp_port": 48879}
    with pytest.raises(ValueError, match="needs its uplink"):
        role_entries(5, Role.LEAF, 3, None)
