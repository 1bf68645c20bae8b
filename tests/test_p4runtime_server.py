"""The softswitch's P4Runtime server on its own: what it accepts, what it refuses (with P4Runtime's
per-update error details), and how table entries become SoftSwitch jobs and policies."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest

from controlplane.errors import WriteRejected
from controlplane.jobs import JobSpec, WorkerSpec, job_entry, worker_entries
from controlplane.switch import LtaSwitch
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.jobconfig import DEFAULT_POOL_SIZE, parse_jobs
from hostlib.p4.info import to_proto, update
from hostlib.p4.proto import p4runtime_pb2, p4runtime_pb2_grpc
from hostlib.p4.schema import JOBS_TABLE, SET_JOB, WORKER_PORTS_TABLE, Entry, policy_action, policy_table
from hostlib.protocol import Op, make_packet
from softswitch.p4runtime_server import serve
from softswitch.pipeline import SoftSwitch


@pytest.fixture
def served() -> Iterator[tuple[SoftSwitch, LtaSwitch]]:
    switch = SoftSwitch()
    server, port, _ = serve(switch)
    try:
        with LtaSwitch.connect(f"127.0.0.1:{port}") as ctl:
            ctl.load_pipeline()
            yield switch, ctl
    finally:
        server.stop(None)


def write(ctl: LtaSwitch, kind: str, *entries: Entry) -> None:
    ctl.session.write([update(kind, to_proto(ctl.names, e, with_action=kind != "DELETE")) for e in entries])


def test_job_is_installed_only_once_all_its_workers_are_there(served):
    switch, ctl = served
    job = JobSpec(4, (WorkerSpec(1), WorkerSpec(2), WorkerSpec(3)), slot_base=0)
    ports = [e for e in worker_entries(job) if e.table == WORKER_PORTS_TABLE]
    write(ctl, "INSERT", job_entry(job), *ports[:2])
    assert 4 not in switch.jobs  # worker 2 missing: a P4 switch would drop its packets as bad_worker
    write(ctl, "INSERT", ports[2])
    assert switch.jobs[4].cfg.workers == [1, 2, 3]


def test_shape_change_re_adds_and_generation_change_resets(served):
    switch, ctl = served
    job = ctl.add_job(JobSpec(1, (WorkerSpec(1), WorkerSpec(2))))
    switch.process(make_packet(Op.GRAD, job_id=1, worker_id=0, seq=5, payload=np.ones(64)), 1)
    write(ctl, "MODIFY", job_entry(job))  # same entry: nothing changes
    assert switch.jobs[1].slots.seq[0] == 5
    ctl.reset_job(1)
    assert switch.jobs[1].slots.seq[0] == 0
    entry = job_entry(job)
    write(ctl, "MODIFY", Entry(JOBS_TABLE, entry.match, SET_JOB, {**entry.params, "quorum": 1}))
    assert switch.jobs[1].cfg.quorum == 1


def test_refusals_carry_per_update_errors(served):
    _, ctl = served
    job = JobSpec(1, (WorkerSpec(1),), slot_base=0)
    bad_action = Entry(JOBS_TABLE, {"job_id": 1}, policy_action("up", "bernoulli"), {"loss": 1})
    too_wide = Entry(WORKER_PORTS_TABLE, {"job_id": 1, "worker_id": 0}, "LtaIngress.worker_check.expect_port")
    no_priority = Entry(policy_table("up"), {"job_id": 1}, policy_action("up", "no_loss"))
    with pytest.raises(WriteRejected) as info:
        ctl.session.write(
            [
                update("INSERT", to_proto(ctl.names, job_entry(job))),  # fine
                update("INSERT", to_proto(ctl.names, bad_action)),
                update("DELETE", to_proto(ctl.names, Entry(JOBS_TABLE, {"job_id": 9}), with_action=False)),
                update("INSERT", _with_param(to_proto(ctl.names, too_wide, with_action=False), ctl, 600)),
                update("INSERT", to_proto(ctl.names, no_priority)),
            ]
        )
    message = str(info.value)
    assert "rejected 4 of 5 updates" in message
    assert "#1: INVALID_ARGUMENT" in message and "not allowed" in message
    assert "#2: NOT_FOUND" in message
    assert "#3: OUT_OF_RANGE" in message and "exceeds 9 bits" in message
    assert "#4: INVALID_ARGUMENT" in message and "priority" in message
    assert "#0" not in message  # the good update went through
    assert 1 in ctl.jobs()


def _with_param(proto: p4runtime_pb2.TableEntry, ctl: LtaSwitch, port: int) -> p4runtime_pb2.TableEntry:
    action = ctl.names.action("LtaIngress.worker_check.expect_port")
    proto.action.action.action_id = action.preamble.id
    proto.action.action.params.add(param_id=action.params[0].id, value=port.to_bytes(2, "big"))
    return proto


def test_const_tables_are_refused(served):
    _, ctl = served
    const = [t for t in ctl.names.info.tables if t.is_const_table]
    if not const:
        pytest.skip("this P4Info lists no const tables (the provisional one, written before p4c existed)")
    with pytest.raises(WriteRejected, match="PERMISSION_DENIED.*not writable"):
        ctl.session.write([update("INSERT", p4runtime_pb2.TableEntry(table_id=const[0].preamble.id))])


def test_foreign_devices_and_backup_writers_are_refused(served):
    _, ctl = served
    stub = p4runtime_pb2_grpc.P4RuntimeStub(grpc.insecure_channel(ctl.target))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Read(p4runtime_pb2.ReadRequest(device_id=7)))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    request = p4runtime_pb2.WriteRequest(device_id=0)
    request.election_id.low = 99  # not the primary's election id
    with pytest.raises(grpc.RpcError) as info:
        stub.Write(request)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_counter_writes_set_the_value_read_back(served):
    switch, ctl = served
    ctl.add_job(JobSpec(2, (WorkerSpec(1),)))
    for _ in range(3):
        switch.process(make_packet(Op.GRAD, job_id=2, worker_id=0, seq=1), 5)  # bad worker (wrong port)
    assert ctl.read_counters(2)[2]["drop_bad_worker"] == 3
    ctl.clear_counters(2)
    assert ctl.read_counters(2)[2]["drop_bad_worker"] == 0
    switch.process(make_packet(Op.GRAD, job_id=2, worker_id=0, seq=1), 5)
    assert ctl.read_counters(2)[2]["drop_bad_worker"] == 1
    assert switch.read_counters(2)["drop_bad_worker"] == 4  # the softswitch itself never forgets


def test_address_mode_names_workers_by_ip_and_udp_port():
    switch = SoftSwitch()
    server, port, _ = serve(switch, port_key="address")
    try:
        with LtaSwitch.connect(f"127.0.0.1:{port}") as ctl:
            ctl.load_pipeline()
            ctl.add_job(
                JobSpec(
                    1,
                    (
                        WorkerSpec(1, ip="127.0.0.1", udp_port=5001),
                        WorkerSpec(2, ip="127.0.0.1", udp_port=5002),
                    ),
                )
            )
        assert switch.jobs[1].cfg.workers == [("127.0.0.1", 5001), ("127.0.0.1", 5002)]
        out = switch.process(make_packet(Op.GRAD, job_id=1, worker_id=0, seq=1), ("127.0.0.1", 5001))
        out = switch.process(make_packet(Op.GRAD, job_id=1, worker_id=1, seq=1), ("127.0.0.1", 5002))
        assert sorted(addr for addr, _ in out) == [("127.0.0.1", 5001), ("127.0.0.1", 5002)]
    finally:
        server.stop(None)


def test_pipeline_reload_clears_jobs_and_counters(served):
    switch, ctl = served
    ctl.add_job(JobSpec(1, (WorkerSpec(1),), quorum=1))
    switch.process(make_packet(Op.GRAD, job_id=1, worker_id=0, seq=1), 1)
    ctl.load_pipeline()
    assert switch.jobs == {} and ctl.jobs() == {}
    assert all(v == 0 for c in ctl.read_counters().values() for v in c.values())


JOBS = """
seed = 2
[[jobs]]
job_id = 3
quorum = 1
pool_size = 200
elems_per_packet = 16
workers = [
    { ip = "127.0.0.1", udp_port = 6001, port = 9, mac = "02:00:00:00:00:aa" },
    "127.0.0.1:6002",
]
[[jobs.drop]]
direction = "up"
p = 0.5
[[jobs.drop]]
direction = "param"
worker = 0
model = "gilbert_elliott"
p = 0.1
r = 0.2
loss_good = 0.0
loss_bad = 0.75

[[jobs]]
job_id = 8
slot_base = 100
pool_size = 50
workers = ["127.0.0.1:6003"]
"""


def test_jobs_file_jobs_are_table_entries_ctl_reads_back():
    """serve(load_pipeline=True, jobs=...): what `lta softswitch --config F --p4runtime` runs."""
    switch = SoftSwitch(seed=2)
    jobs = parse_jobs(JOBS).jobs
    server, port, _ = serve(switch, port_key="address", load_pipeline=True, jobs=jobs)
    try:
        with LtaSwitch.connect(f"127.0.0.1:{port}", read_only=True) as ctl:
            ctl.check_pipeline()  # loaded from the start
            found = ctl.jobs()
            policies = sorted(ctl.drop_policies(), key=lambda p: p[0])
            groups = {
                e.packet_replication_engine_entry.multicast_group_entry.multicast_group_id: [
                    (r.egress_port, r.instance)
                    for r in e.packet_replication_engine_entry.multicast_group_entry.replicas
                ]
                for e in ctl.session.read([_all_groups()])
            }
        # By hand from JOBS: job 8 is pinned at 100..149, so job 3's 200 slots go after it, at 150; worker
        # 1 of job 3 and worker 0 of job 8 leave port and mac out (defaults w + 1, 02:00:00:00:00:0(w+1)).
        assert sorted(found) == [3, 8]
        assert (found[3].quorum, found[3].pool_size, found[3].slot_base) == (1, 200, 150)
        assert (found[8].quorum, found[8].pool_size, found[8].slot_base) == (1, 50, 100)
        assert found[3].workers == (
            WorkerSpec(9, mac="02:00:00:00:00:aa", ip="127.0.0.1", udp_port=6001),
            WorkerSpec(2, mac="02:00:00:00:00:02", ip="127.0.0.1", udp_port=6002),
        )
        assert found[8].workers == (WorkerSpec(1, mac="02:00:00:00:00:01", ip="127.0.0.1", udp_port=6003),)
        assert policies == [
            ("param", 3, 0, DropPolicy("gilbert_elliott", p=0.1, r=0.2, loss_good=0.0, loss_bad=0.75)),
            ("up", 3, None, DropPolicy("bernoulli", p=0.5)),
        ]
        assert groups == {3: [(9, 0), (2, 1)], 8: [(1, 0)]}
        # ... and the softswitch runs them, each with its own K.
        assert switch.jobs[3].cfg.workers == [("127.0.0.1", 6001), ("127.0.0.1", 6002)]
        assert (switch.jobs[3].cfg.elems_per_packet, switch.jobs[8].cfg.elems_per_packet) == (16, 64)
        assert switch.jobs[3].policies[("up", None)] == DropPolicy("bernoulli", p=0.5)
    finally:
        server.stop(None)


def _all_groups() -> p4runtime_pb2.Entity:
    entity = p4runtime_pb2.Entity()
    entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0
    return entity


def test_jobs_that_do_not_fit_are_refused():
    too_far = parse_jobs('[[jobs]]\njob_id = 1\nslot_base = 65000\nworkers = ["127.0.0.1:1"]\n').jobs
    end = 65000 + DEFAULT_POOL_SIZE - 1  # the default pool
    with pytest.raises(ValueError, match=rf"job 1: slots 65000..{end} exceed the switch's \d+ slots"):
        serve(SoftSwitch(), port_key="address", load_pipeline=True, jobs=too_far)
    with pytest.raises(ValueError, match="jobs need the pipeline"):
        serve(SoftSwitch(), jobs=too_far)
    overlapping = parse_jobs(
        '[[jobs]]\njob_id = 1\nslot_base = 0\npool_size = 100\nworkers = ["127.0.0.1:1"]\n'
        '[[jobs]]\njob_id = 2\nslot_base = 99\nworkers = ["127.0.0.1:2"]\n'
    ).jobs
    overlap = rf"job 2: slots 99..{98 + DEFAULT_POOL_SIZE} overlap job 1's slots 0..99"
    with pytest.raises(ValueError, match=overlap):
        serve(SoftSwitch(), port_key="address", load_pipeline=True, jobs=overlapping)


def test_ctl_refuses_a_pinned_pool_over_another_job(served):
    _, ctl = served
    ctl.add_job(JobSpec(1, (WorkerSpec(1),), pool_size=100, slot_base=0))
    overlap = rf"job 2: slots 50..{49 + DEFAULT_POOL_SIZE} overlap job 1's slots 0..99"
    with pytest.raises(ValueError, match=overlap):
        ctl.add_job(JobSpec(2, (WorkerSpec(2),), slot_base=50))
    assert ctl.add_job(JobSpec(3, (WorkerSpec(3),), pool_size=10)).slot_base == 100  # first free slots


def test_an_occupied_port_is_refused_not_shared():
    """gRPC's default SO_REUSEPORT would let two servers share a port and split the controller's calls."""
    foreign = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # default options: SO_REUSEPORT on
    port = foreign.add_insecure_port("127.0.0.1:0")
    foreign.start()
    try:
        with pytest.raises(OSError, match=f"cannot serve P4Runtime on 127.0.0.1:{port}"):
            serve(SoftSwitch(), f"127.0.0.1:{port}")
    finally:
        foreign.stop(None)
    first, port, _ = serve(SoftSwitch(), "127.0.0.1:0")
    try:
        with pytest.raises(OSError, match=f"cannot serve P4Runtime on 127.0.0.1:{port}"):
            serve(SoftSwitch(), f"127.0.0.1:{port}")
    finally:
        first.stop(None)
