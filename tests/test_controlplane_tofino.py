"""controlplane.tofino against the committed bf-rt.json of p4/tofino: every write names a table, action and
field the compiled program has, with its id and a value of the field's exact width. Expectations come
from the raw JSON (looked up here by name, not through the module's schema) and hand-encoded bytes."""

from __future__ import annotations

import json
import re

import pytest

from controlplane.errors import ControlPlaneError
from controlplane.jobs import JobSpec, WorkerSpec
from controlplane.tofino import (
    BFRT_PATH,
    PRE_MGID_TABLE,
    PRE_NODE_TABLE,
    SLOT_REGISTERS,
    BfrtSchema,
    counter_address,
    counter_clears,
    counter_keys,
    entry_write,
    job_writes,
    packets_of,
    register_clears,
    worker_rx_keys,
)
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.p4.schema import policy_entry, required_names
from hostlib.protocol import COUNTERS, MAX_WORKERS, WORKER_COUNTER

pytestmark = pytest.mark.skipif(
    not BFRT_PATH.is_file(), reason="p4/tofino/build/bf-rt.json is not committed (p4/tofino_build.py)"
)


@pytest.fixture(scope="module")
def raw() -> dict:
    return {t["name"]: t for t in json.loads(BFRT_PATH.read_text())["tables"]}


@pytest.fixture(scope="module")
def schema() -> BfrtSchema:
    return BfrtSchema.load()


def table_id(raw: dict, name: str) -> int:
    return raw[f"pipe.{name}"]["id"]


def action_of(raw: dict, table: str, action: str) -> dict:
    return next(a for a in raw[f"pipe.{table}"]["action_specs"] if a["name"] == action)


def job(slot_base: int | None = 100) -> JobSpec:
    workers = (
        WorkerSpec(port=5, mac="02:00:00:00:00:0a", ip="10.0.0.1", udp_port=40000),
        WorkerSpec(port=130, mac="02:00:00:00:00:0b", ip="10.0.0.2", udp_port=40001),
        WorkerSpec(port=260, mac="02:00:00:00:00:0c", ip="10.0.1.3", udp_port=40002),
    )
    return JobSpec(7, workers, quorum=2, pool_size=64, slot_base=slot_base, generation=0xDEADBEEF)


def test_every_name_the_control_plane_needs_is_in_bf_rt_json(raw):
    names = required_names()
    for table in names["tables"]:
        assert raw[f"pipe.{table}"]["table_type"] == "MatchAction_Direct", table
    actions = {a["name"] for t in raw.values() for a in t.get("action_specs", [])}
    assert set(names["actions"]) <= actions
    for counter in {counter_address(n, 0)[0] for n in COUNTERS} | {WORKER_COUNTER}:
        assert raw[f"pipe.{counter}"]["table_type"] == "Counter", counter
    for register in SLOT_REGISTERS:
        assert raw[f"pipe.{register}"]["table_type"] == "Register", register


def test_job_writes_carry_ids_and_exact_width_bytes(raw, schema):
    pre, writes = job_writes(schema, job())
    # worker entries (ports, then addresses, per worker) and the job entry last
    assert [w.table for w in writes][-1] == "LtaIngress.job_lookup.jobs"
    jobs = writes[-1]
    assert jobs.table_id == table_id(raw, "LtaIngress.job_lookup.jobs")
    set_job = action_of(raw, "LtaIngress.job_lookup.jobs", "LtaIngress.job_lookup.set_job")
    assert jobs.action_id == set_job["id"]
    assert [k.value for k in jobs.key] == [b"\x00\x07"]  # job_id: 16 bits
    params = {p["id"]: p["name"] for p in set_job["data"]}
    got = {params[d.field_id]: d.value for d in jobs.data}
    assert got == {
        "n_workers": b"\x03",
        "quorum": b"\x02",
        "pool_size": b"\x00\x40",
        "slot_base": b"\x00\x00\x00\x64",
        "mcast_grp": b"\x00\x07",
        "generation": b"\xde\xad\xbe\xef",
    }
    ports = [w for w in writes if w.table == "LtaIngress.worker_check.worker_ports"]
    assert [[k.value for k in w.key] for w in ports] == [[b"\x00\x07", bytes([w])] for w in range(3)]
    assert [w.data[0].value for w in ports] == [b"\x00\x05", b"\x00\x82", b"\x01\x04"]  # 9-bit port
    addresses = [w for w in writes if w.table == "LtaEgress.worker_address.worker_addresses"]
    set_address = action_of(
        raw, "LtaEgress.worker_address.worker_addresses", "LtaEgress.worker_address.set_address"
    )
    names = {p["id"]: p["name"] for p in set_address["data"]}
    third = {names[d.field_id]: d.value for d in addresses[2].data}
    assert third == {
        "mac": bytes.fromhex("02000000000c"),
        "ipv4": bytes([10, 0, 1, 3]),
        "udp_port": b"\x9c\x42",
    }


def test_multicast_group_has_one_node_per_worker_with_its_rid_and_port():
    pre, _ = job_writes(BfrtSchema.load(), job())
    nodes, group = pre[:-1], pre[-1]
    assert [n.table for n in nodes] == [PRE_NODE_TABLE] * 3
    assert [(n.data["$MULTICAST_RID"], n.data["$DEV_PORT"]) for n in nodes] == [
        (0, [5]),
        (1, [130]),
        (2, [260]),
    ]
    assert group.table == PRE_MGID_TABLE and group.key == {"$MGID": 7}
    assert group.data["$MULTICAST_NODE_ID"] == [7 * MAX_WORKERS + w for w in range(3)]
    assert len({n.key["$MULTICAST_NODE_ID"] for n in nodes}) == 3


def test_a_per_worker_drop_policy_wins_over_the_job_wide_one(raw, schema):
    table = "LtaIngress.up_loss.policy"
    one = entry_write(schema, policy_entry(7, "up", DropPolicy("bernoulli", p=0.25), worker=3))
    every = entry_write(schema, policy_entry(7, "up", DropPolicy("bernoulli", p=0.5)))
    keys = {k["name"]: k["id"] for k in raw[f"pipe.{table}"]["key"]}
    prio = {w: next(k.value for k in w.key if k.field_id == keys["$MATCH_PRIORITY"]) for w in (one, every)}
    assert int.from_bytes(prio[one], "big") < int.from_bytes(prio[every], "big")  # BfRt: lower wins
    worker_key = {w: next(k for k in w.key if k.field_id == keys["worker_id"]) for w in (one, every)}
    assert (worker_key[one].value, worker_key[one].mask) == (b"\x03", b"\xff")
    assert (worker_key[every].value, worker_key[every].mask) == (b"\x00", b"\x00")
    assert one.data[0].value == round(0.25 * 0xFFFFFFFF).to_bytes(4, "big")
    ge = entry_write(
        schema, policy_entry(7, "down", DropPolicy("gilbert_elliott", p=0.1, r=0.5, loss_bad=1.0))
    )
    spec = action_of(raw, "LtaEgress.down_loss.policy", "LtaEgress.down_loss.gilbert_elliott")
    assert ge.action_id == spec["id"]
    names = {p["id"]: p["name"] for p in spec["data"]}
    assert {names[d.field_id]: d.value for d in ge.data}["loss_bad"] == b"\xff\xff\xff\xff"


def test_values_too_wide_or_names_unknown_are_refused(schema):
    wide = JobSpec(7, tuple(WorkerSpec(port=1) for _ in range(3)), pool_size=64, slot_base=16384 - 32)
    with pytest.raises(ControlPlaneError, match="exceed the switch's 16384 slots"):
        job_writes(schema, wide)
    many = JobSpec(7, tuple(WorkerSpec(port=1, udp_port=1000 + w) for w in range(33)), slot_base=0)
    with pytest.raises(ControlPlaneError, match="at most 32 workers"):
        job_writes(schema, many)
    entry = policy_entry(7, "up", DropPolicy("bernoulli", p=0.5))
    with pytest.raises(ControlPlaneError, match="no action"):
        entry_write(schema, type(entry)(entry.table, entry.match, "LtaIngress.up_loss.nothing", {}, 1))
    with pytest.raises(ControlPlaneError, match="does not fit in 8 bits"):
        entry_write(schema, type(entry)(entry.table, {"job_id": 7, "worker_id": (300, 0xFF)}, entry.action,
                                        entry.params, 2))  # fmt: skip


def test_a_reset_zeroes_every_slot_register_and_accumulator_over_the_job_range(raw, schema):
    writes = register_clears(schema, 100, 4)
    accumulators = [n for n, t in raw.items() if ".elements.acc_" in n and t["table_type"] == "Register"]
    names = {w.table for w in writes}
    assert names == set(SLOT_REGISTERS) | {n.removeprefix("pipe.") for n in accumulators}
    assert len(writes) == 4 * (len(SLOT_REGISTERS) + len(accumulators))
    for w in writes:
        spec = raw[f"pipe.{w.table}"]
        assert w.table_id == spec["id"]
        assert int.from_bytes(w.key[0].value, "big") in range(100, 104)
        widths = {d["singleton"]["id"]: d["singleton"]["type"]["width"] for d in spec["data"]}
        assert {d.field_id: d.value for d in w.data} == {i: bytes(b // 8) for i, b in widths.items()}
    with pytest.raises(ControlPlaneError, match="outside"):
        register_clears(schema, 16380, 8)


def branch_codes() -> dict[str, int]:
    """BRANCH_* constants of the Tofino program, by counter name (read from its generated source)."""
    text = (BFRT_PATH.parent.parent / "protocol_constants.gen.p4").read_text()
    return {m[0].lower(): int(m[1]) for m in re.findall(r"const bit<8> BRANCH_(\w+) = (\d+);", text)}


# Counted beside the branch (rx_packets, result_quorum) or in egress: a Counter each, by job id.
OWN = {"rx_packets", "result_quorum", "drop_policy_down", "drop_policy_param", "tx_packets"}


def test_counter_keys_and_clears_address_the_job_and_its_workers(raw, schema):
    keys = counter_keys(schema, 7)
    codes = branch_codes()
    expected = [(n, 7) if n in OWN else ("branches", codes[n] * 64 + 7) for n in COUNTERS]
    assert [(k.table, k.table_id) for k in keys] == [(t, raw[f"pipe.{t}"]["id"]) for t, _ in expected]
    assert {raw[f"pipe.{t}"]["key"][0]["type"]["type"] for t, _ in expected} == {"uint32"}
    assert [k.key[0].value for k in keys] == [i.to_bytes(4, "big") for _, i in expected]
    # every ingress branch has its own index below the branch counter's size
    branch_indices = [i for t, i in expected if t == "branches"]
    assert len(set(branch_indices)) == len(COUNTERS) - len(OWN)
    assert max(branch_indices) < raw["pipe.branches"]["size"]
    assert counter_address("grad_add", 0) == ("branches", codes["grad_add"] * 64)
    with pytest.raises(ControlPlaneError, match="no counter"):
        counter_address("grad_added", 1)
    with pytest.raises(ControlPlaneError, match="outside"):
        counter_address("grad_add", 64)
    packets = raw["pipe.branches"]["data"][0]["singleton"]["id"]
    assert packets_of(schema, "grad_add", {packets: (12).to_bytes(8, "big")}) == 12
    rx = worker_rx_keys(schema, 7, [0, 31])
    assert [int.from_bytes(k.key[0].value, "big") for k in rx] == [7 * MAX_WORKERS, 7 * MAX_WORKERS + 31]
    clears = counter_clears(schema, 7)
    assert len(clears) == len(COUNTERS) + MAX_WORKERS
    packets = raw["pipe.rx_packets"]["data"][0]["singleton"]
    assert packets["name"] == "$COUNTER_SPEC_PKTS"
    assert clears[0].data[0].field_id == packets["id"] and clears[0].data[0].value == bytes(8)


def test_lta_ctl_bfrt_prints_every_write_of_a_jobs_file(raw, tmp_path, capsys):
    from lta.cli import main as lta

    jobs = tmp_path / "jobs.toml"
    jobs.write_text(
        "[[jobs]]\njob_id = 3\npool_size = 128\nworkers = [{ port = 1 }, { port = 2 }]\n"
        '[[jobs.drop]]\ndirection = "down"\nworker = 1\nmodel = "bernoulli"\np = 0.5\n'
    )
    assert lta(["ctl", "bfrt", str(jobs)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tables = [line["table"] for line in lines]
    assert tables[:3] == [PRE_NODE_TABLE, PRE_NODE_TABLE, PRE_MGID_TABLE]
    assert tables.count("LtaIngress.worker_check.worker_ports") == 2
    assert tables.index("LtaIngress.job_lookup.jobs") > tables.index(
        "LtaEgress.worker_address.worker_addresses"
    )
    assert tables.count("rx_packets") == 1 and tables.count(WORKER_COUNTER) == MAX_WORKERS
    policy = lines[-1]
    assert policy["table"] == "LtaEgress.down_loss.policy"
    assert policy["table_id"] == table_id(raw, "LtaEgress.down_loss.policy")
    assert policy["data"][0]["value"] == f"{round(0.5 * 0xFFFFFFFF):08x}"
    job_line = lines[tables.index("LtaIngress.job_lookup.jobs")]
    set_job = action_of(raw, "LtaIngress.job_lookup.jobs", "LtaIngress.job_lookup.set_job")
    names = {p["id"]: p["name"] for p in set_job["data"]}
    params = {names[d["field_id"]]: d["value"] for d in job_line["data"]}
    assert (params["n_workers"], params["quorum"], params["pool_size"]) == ("02", "02", "0080")
    assert int(params["slot_base"], 16) + 128 <= 16384
