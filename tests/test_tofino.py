"""The Tofino (TNA) program: generated parts current, the wire header and counter names shared with
hostlib, every name the control plane uses present in the sources, and the committed compiler artifacts
(p4/tofino/build/) belonging to these sources. The `tofino` tests recompile with p4c-barefoot when it is
on PATH and skip, saying so, when it is not."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from controlplane.tofino import required_bfrt_names
from hostlib.p4.schema import required_names
from hostlib.protocol import COUNTERS, HEADER_BITS, HEADER_FIELDS, WORKER_COUNTER

ROOT = Path(__file__).resolve().parent.parent
TOFINO = ROOT / "p4" / "tofino"
COMPILER = shutil.which("p4c-barefoot")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "p4" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = load("tofino_build")


def sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in TOFINO.glob("*.p4")}


def without_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


# ---- sources ------------------------------------------------------------------------------------


def test_generated_tofino_p4_is_current():
    gen = load("gen_p4")
    assert gen.stale_files(gen.TOFINO_DIR) == [], (
        "run .venv/bin/python p4/gen_p4.py and commit p4/tofino/*.gen.p4"
    )


def test_lta_header_matches_wire_format():
    body = re.search(r"header\s+lta_t\s*\{(.*?)\}", (TOFINO / "headers.p4").read_text(), re.S)
    fields = [
        (name, int(bits))
        for bits, name in re.findall(r"bit<(\d+)>\s+(\w+)\s*;", without_comments(body.group(1)))
    ]
    assert [name for name, _ in fields] == [name for name, _ in HEADER_FIELDS]
    assert dict(fields) == HEADER_BITS


def test_every_counter_has_its_absolute_name_and_is_counted():
    """Ingress counts rx_packets and result_quorum by job, every other ingress branch in one counter at
    branch * 64 + job; egress one counter per branch (controlplane.tofino.counter_address reads them)."""
    text = "\n".join(sources().values())
    declared = re.findall(r'@name\("\.(\w+)"\)\s*Counter<(bit<32>, bit<(\d+)>)>\((\w+)', text)
    own = {"rx_packets", "result_quorum", "drop_policy_down", "drop_policy_param", "tx_packets"}
    assert sorted(d[0] for d in declared) == sorted((*own, "branches", WORKER_COUNTER))
    for name in own:
        assert re.search(rf"\b{name}_counter\.count\(index\)", text), f"{name} is declared but never counted"
    # branches: 2^11 entries, indexed by the identity hash of branch[4:0] ++ job[5:0]
    assert ("branches", "bit<32>, bit<11>", "11", "2048") in declared
    assert len(COUNTERS) <= 32
    assert re.search(r"branches_counter\.count\(branch_index\.get\(\{branch\[4:0\], index\[5:0\]\}\)\)", text)
    assert re.search(r"Hash<bit<11>>\(HashAlgorithm_t\.IDENTITY\) branch_index;", text)
    # the branch the ingress counts is the one the checks and the slot state machine write
    ingress = without_comments((TOFINO / "ingress.p4").read_text())
    assert re.search(
        r"branch_counters\.apply\(meta\.counter_index, meta\.branch, meta\.result_quorum\)", ingress
    )


def test_every_register_is_touched_once_per_pass_through_one_table():
    """A Tofino register is read and written by one stateful ALU access per pass: each slot register's
    register actions are executed from the actions of exactly one table (its access table)."""
    text = without_comments((TOFINO / "slot_update.p4").read_text())
    for register in ("slot_seq", "slot_round", "slot_bitmap", "slot_count", "slot_result"):
        actions = re.findall(rf"RegisterAction<[\w<>, ]*>\({register}\)\s+(\w+)", text)
        assert 1 <= len(actions) <= 4, f"{register}: {len(actions)} register actions (Tofino 1 allows 4)"
        callers = {
            m
            for a in actions
            for m in re.findall(rf"action\s+(\w+)\([^)]*\)\s*\{{[^}}]*\b{a}\.execute", text)
        }
        tables = {
            t
            for t, body in re.findall(r"table\s+(\w+)\s*\{(.*?)\n    \}", text, re.S)
            if callers & set(re.findall(r"\w+", body))
        }
        assert len(tables) == 1, f"{register} is reached from tables {tables}"


def test_element_pairs_cover_every_payload_value_once_per_pass():
    gen = load("gen_p4")
    text = gen.render_file("slot_elements.gen.p4", gen.TOFINO_DIR)
    written_hi = re.findall(r"payload\.v(\d+) = acc_\d+_add\.execute", text)
    written_lo = re.findall(r"payload\.v(\d+) = acc_\d+_load_lo\.execute", text)
    assert sorted(map(int, written_hi + written_lo)) == list(range(gen.ELEMS))
    assert len(re.findall(r"Register<acc_pair_t", text)) == gen.ELEMS // 2


def test_element_groups_apply_every_pair_once_and_keep_the_register_names():
    """The pairs are split into groups applied at nine points of ingress (after the slot chain's tables);
    each pair is in exactly one group, each group control is instantiated and applied once, and every
    register keeps the name LtaIngress.elements.acc_<i> the control plane clears."""
    gen = load("gen_p4")
    assert [len(g) for g in gen.element_groups(32)] == [12, 4, 1, 3, 3, 3, 2, 2, 2]
    assert [list(g) for g in gen.element_groups(8)] == [list(range(8))] + [[]] * 8
    assert [len(g) for g in gen.element_groups(40)] == [12, 4, 1, 3, 3, 3, 2, 2, 10]
    text = gen.render_file("slot_elements.gen.p4", gen.TOFINO_DIR)
    applied = re.findall(r"pair_(\d+)\.apply\(\);", text)
    assert sorted(map(int, applied)) == list(range(gen.PAIRS))
    names = re.findall(r'@name\("\.LtaIngress\.elements\.acc_(\d+)"\)\s*Register<acc_pair_t', text)
    assert sorted(map(int, names)) == list(range(gen.PAIRS))
    ingress = "\n".join(without_comments(t) for t in sources().values())
    for group in range(len(gen.ELEMENT_GROUPS)):
        instances = re.findall(rf"SlotElements{group}\(\)\s+(\w+);", ingress)
        assert len(instances) == 1, group
        assert len(re.findall(rf"\b{instances[0]}\.apply\(", ingress)) == 1, group


def test_every_accumulator_register_action_reads_at_most_two_phv_fields():
    """Tofino 1: a stateful ALU has at most 4 register actions and 2 PHV inputs (here: the pair's two
    payload values), so STORE and ADD are separate actions and none reads a pass flag."""
    gen = load("gen_p4")
    text = gen.render_file("slot_elements.gen.p4", gen.TOFINO_DIR)
    bodies = re.findall(r"RegisterAction<acc_pair_t[^(]*\((acc_\d+)\) \w+ = \{(.*?)\n    \};", text, re.S)
    assert len(bodies) == 4 * (gen.ELEMS // 2)
    per_register: dict[str, int] = {}
    for register, body in bodies:
        per_register[register] = per_register.get(register, 0) + 1
        inputs = set(re.findall(r"\b(payload\.v\d+|start|pass|element_op|index)\b", body))
        assert len(inputs) <= 2 and inputs <= {f"payload.v{i}" for i in range(gen.ELEMS)}, (register, inputs)
    assert set(per_register.values()) == {4}


def test_control_plane_names_exist_in_the_sources():
    """Each dotted name the control plane uses (Control.instance.object) resolves in the Tofino sources:
    the control declares the instance, and the instance's control declares the table/action/register."""
    text = {name: without_comments(body) for name, body in sources().items()}
    controls = {}
    for body in text.values():
        for match in re.finditer(r"\bcontrol\s+(\w+)\s*\(", body):
            end = body.find("\n}\n", match.end())
            controls[match.group(1)] = body[match.end() : end]
    required = required_names()
    for name in required["tables"] + required["actions"] + required["registers"]:
        top, instance, obj = name.split(".")
        top_body = controls[top]
        decl = re.search(rf"\b(\w+)\(\)\s+{instance}\s*;", top_body)
        assert decl, f"{top} does not instantiate {instance} ({name})"
        inner = controls[decl.group(1)]
        assert re.search(rf"(table|action|\))\s+{obj}\b", inner), (
            f"{decl.group(1)} declares no {obj} ({name})"
        )


# ---- artifacts: manifest and bf-rt.json ---------------------------------------------------------


def test_sources_hash_is_sha256_of_names_lengths_and_bytes(tmp_path):
    (tmp_path / "b.p4").write_text("control B() { apply { } }\n")
    (tmp_path / "a.p4").write_text("// a\n")
    (tmp_path / "notes.txt").write_text("not a source")
    expected = hashlib.sha256(b"a.p4\x005\x00// a\nb.p4\x0026\x00control B() { apply { } }\n").hexdigest()
    assert build.sources_hash(tmp_path) == expected


def test_manifest_goes_stale_when_a_source_changes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "lta.p4").write_text("// v1\n")
    (tmp_path / "bf-rt.json").write_text("{}")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"sources_sha256": build.sources_hash(src), "artifacts": ["bf-rt.json"]}))
    assert build.stale_reason(manifest, src) is None
    (src / "lta.p4").write_text("// v2\n")
    assert "sources changed" in build.stale_reason(manifest, src)
    manifest.write_text(
        json.dumps({"sources_sha256": build.sources_hash(src), "artifacts": ["context.json"]})
    )
    assert "missing: context.json" in build.stale_reason(manifest, src)


def test_bfrt_names_strip_the_pipe_and_sort_by_kind():
    bfrt = {
        "tables": [
            {"name": "pipe.LtaIngress.job_lookup.jobs", "table_type": "MatchAction_Direct",
             "action_specs": [{"name": "LtaIngress.job_lookup.set_job"}]},
            {"name": "pipe.rx_packets", "table_type": "Counter"},
            {"name": "pipe.LtaIngress.slot_update.slot_seq", "table_type": "Register"},
        ]
    }  # fmt: skip
    required = {
        "tables": ["LtaIngress.job_lookup.jobs", "LtaIngress.worker_check.worker_ports"],
        "actions": ["LtaIngress.job_lookup.set_job"],
        "counters": ["rx_packets", "tx_packets"],
        "registers": ["LtaIngress.slot_update.slot_seq"],
    }
    assert build.missing_bfrt_names(bfrt, required) == [
        "table LtaIngress.worker_check.worker_ports",
        "counter tx_packets",
    ]


def committed_bfrt() -> dict:
    return json.loads((build.BUILD / "bf-rt.json").read_text())


def test_committed_artifacts_belong_to_the_sources():
    """Fails when p4/tofino changed and p4/tofino/build did not (recompile: p4/tofino_build.py)."""
    assert build.stale_reason() is None, build.stale_reason()


def test_manifest_says_whether_the_program_fits_and_keeps_what_follows_from_it():
    manifest = build.read_manifest()
    assert manifest["compiler"].startswith("p4c-barefoot") or manifest["compiler"][0].isdigit()
    assert len(manifest["sources_sha256"]) == 64
    if manifest["fits"]:
        assert manifest["first_error"] is None
        assert {"bf-rt.json", "context.json", "resources.json", "resources.md"} <= set(manifest["artifacts"])
    else:
        # Only the front end's schema: resources of a program that does not fit would mislead.
        assert manifest["artifacts"] == ["bf-rt.json"]
        assert "error" in manifest["first_error"].lower()


def test_committed_bfrt_has_every_name_the_control_plane_uses():
    assert build.missing_bfrt_names(committed_bfrt(), required_bfrt_names()) == []


def test_committed_bfrt_registers_have_the_slot_capacity_and_pair_widths():
    """16384 slots per pipe; a slot register or accumulator pair is one 32-bit word or two."""
    tables = {t["name"]: t for t in committed_bfrt()["tables"]}
    registers = {n: t for n, t in tables.items() if t["table_type"] == "Register" and ".slot_update." in n}
    accumulators = {n: t for n, t in tables.items() if t["table_type"] == "Register" and ".elements." in n}
    gen = load("gen_p4")
    assert len(accumulators) == gen.ELEMS // 2
    for name, table in {**registers, **accumulators}.items():
        assert table["size"] == 16384, name
        widths = [d["singleton"]["type"]["width"] for d in table["data"]]
        assert widths in ([32], [32, 32]), (name, widths)


def test_bfrt_signature_ignores_order_and_sees_ids_and_widths():
    table = {
        "name": "pipe.t", "id": 7, "table_type": "MatchAction_Direct", "size": 4,
        "key": [{"id": 1, "name": "a", "match_type": "Exact", "type": {"type": "bytes", "width": 8}},
                {"id": 2, "name": "b", "match_type": "Ternary", "type": {"type": "bytes", "width": 16}}],
        "action_specs": [{"id": 9, "name": "x", "data": []}, {"id": 8, "name": "y", "data": []}],
    }  # fmt: skip
    shuffled = {**table, "key": table["key"][::-1], "action_specs": table["action_specs"][::-1]}
    assert build.bfrt_signature({"tables": [table]}) == build.bfrt_signature({"tables": [shuffled]})
    wider = json.loads(json.dumps(table))
    wider["key"][1]["type"]["width"] = 32
    assert build.bfrt_signature({"tables": [table]}) != build.bfrt_signature({"tables": [wider]})
    renumbered = {**table, "action_specs": [{"id": 10, "name": "x", "data": []}, table["action_specs"][1]]}
    assert build.bfrt_signature({"tables": [table]}) != build.bfrt_signature({"tables": [renumbered]})


def test_first_error_names_the_phv_shortfall():
    result = subprocess.CompletedProcess(
        [],
        1,
        "",
        "warning: x\nerror: PHV allocation was not successful\n20 field slices remain unallocated\n",
    )
    assert build.first_error(result) == (
        "error: PHV allocation was not successful 20 field slices remain unallocated"
    )
    fits_not = subprocess.CompletedProcess(
        [], 1, "lta.bfa:7912: error: tofino supports up to 12 stages, using 40\n", ""
    )
    assert build.first_error(fits_not) == "lta.bfa:7912: error: tofino supports up to 12 stages, using 40"
    in_tmp = subprocess.CompletedProcess([], 1, "/tmp/lta-x1/pipe/lta.bfa:13108: error: using 18\n", "")
    assert build.first_error(in_tmp) == "lta.bfa:13108: error: using 18"
    assert (
        build.first_error(subprocess.CompletedProcess([], 3, "0 errors, 2 warnings", "")) == "exit status 3"
    )


def test_resource_summary_counts_units_per_stage_and_phv_containers():
    """A hand-built two-stage report: stage 0 with 3 SRAMs, 1 TCAM, 2 stateful ALUs, 1 exact and 2
    ternary crossbar bytes; stage 1 empty; three PHV containers (two ingress 32-bit normal, one egress
    8-bit tagalong) against the chip's 64 and 32."""

    def stage(n: int, srams: int, tcams: int, salus: int, exact: int, ternary: int) -> dict:
        return {
            "stage_number": n,
            "rams": {"nRows": 8, "nColumns": 10, "srams": [{}] * srams},
            "tcams": {"nRows": 12, "nColumns": 2, "tcams": [{}] * tcams},
            "map_rams": {"nRows": 8, "nUnits": 6, "maprams": []},
            "meter_alus": {"nAlus": 4, "meters": [{}] * salus},
            "statistic_alus": {"nAlus": 4, "stats": []},
            "gateways": {"nRows": 8, "nUnits": 2, "gateways": [{}]},
            "xbar_bytes": {"exact_size": 128, "ternary_size": 66,
                           "bytes": [{"byte_type": "exact"}] * exact + [{"byte_type": "ternary"}] * ternary},
        }  # fmt: skip

    resources = {"resources": {
        "mau": {"mau_stages": [stage(0, 3, 1, 2, 1, 2), stage(1, 0, 0, 0, 0, 0)]},
        "phv_containers": {"normal": [{"width": 32, "units": 64}], "tagalong": [{"width": 8, "units": 32}]},
    }}  # fmt: skip
    phv = {"containers": [
        {"gress": "ingress", "container_type": "normal", "bit_width": 32},
        {"gress": "ingress", "container_type": "normal", "bit_width": 32},
        {"gress": "egress", "container_type": "tagalong", "bit_width": 8},
    ]}  # fmt: skip
    rows = build.stage_usage(resources)
    assert rows[0]["sram"] == 3 and rows[0]["sram_max"] == 80
    assert (rows[0]["tcam"], rows[0]["tcam_max"], rows[0]["salu"], rows[0]["salu_max"]) == (1, 24, 2, 4)
    assert (rows[0]["exact_xbar"], rows[0]["ternary_xbar"], rows[1]["sram"]) == (1, 2, 0)
    assert build.phv_usage(phv, resources) == [
        ("egress", "tagalong", 8, 1, 32),
        ("ingress", "normal", 32, 2, 64),
    ]
    text = build.resource_summary(resources, phv, "# report")
    assert "| 0 | 3/80 | 1/24 | 0/48 | 2/4 | 0/4 | 1/16 | 1/128 | 2/66 |" in text
    assert "SRAM 3/160, TCAM 1/48" in text
    assert "| ingress | normal | 32 | 2 | 64 |" in text
    # every stage has a gateway here, so both count as used
    assert "MAU stages used: 2 of 2." in text


# ---- recompile (needs p4c-barefoot) -------------------------------------------------------------


# A compile takes 9 to 10 minutes on a quiet 2-core host (29 under load): more than the rest of the default
# run, so it is `slow` (run it with `pytest -m tofino` after a change to p4/tofino). The default run still
# fails on stale artifacts: test_committed_artifacts_belong_to_the_sources compares the manifest's sources
# hash with the sources.
@pytest.mark.tofino
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.skipif(
    COMPILER is None, reason="p4c-barefoot is not on PATH (tested: 9.13.4; p4/tofino/README.md)"
)
def test_recompile_matches_committed_artifacts(tmp_path):
    """The compiler, run now, agrees with the manifest on whether the program fits (and on the first
    error if not), and writes the committed bf-rt.json's tables, actions and fields with their ids and
    widths (bfrt_signature: one compile of unchanged sources listed them in another order)."""
    result = build.compile_into(tmp_path)
    manifest = build.read_manifest()
    fits = result.returncode == 0
    assert fits == manifest["fits"], (
        f"the manifest says fits={manifest['fits']}, the compiler now says fits={fits} "
        f"({build.first_error(result)}): .venv/bin/python p4/tofino_build.py"
    )
    if not fits:
        assert build.first_error(result) == manifest["first_error"]
    fresh = json.loads((tmp_path / "bf-rt.json").read_text())
    assert build.missing_bfrt_names(fresh, required_bfrt_names()) == []
    assert build.bfrt_signature(fresh) == build.bfrt_signature(committed_bfrt()), (
        "p4/tofino/build/bf-rt.json is stale: .venv/bin/python p4/tofino_build.py"
    )


def _const_entries(table: str) -> list[tuple[list[str], str]]:
    """(key values as written, action) of a const-entries table of drop_policy.p4, in priority order."""
    text = without_comments((TOFINO / "drop_policy.p4").read_text())
    body = re.search(
        rf"table\s+{table}\s*\{{.*?const entries = \{{(.*?)\}}\s*const default_action", text, re.S
    )
    rows = re.findall(r"\(([^)]*)\)\s*:\s*(\w+)\(\)", body.group(1))
    return [([v.strip() for v in keys.split(",")], action) for keys, action in rows]


def _first_match(entries, values: dict[str, int], order: list[str], consts: dict[str, int]) -> str | None:
    for keys, action in entries:
        matched = (
            k == "_" or consts.get(k) == values[f] or k == str(values[f])
            for k, f in zip(keys, order, strict=True)
        )
        if all(matched):
            return action
    return None


def test_drop_policy_tables_decide_as_the_contract_says():
    """Every combination of the Gilbert-Elliott and decision tables' inputs (a threshold that always
    fires, a draw below it or not, the state) against the rule itself: a transition is taken when its
    threshold always fires or its draw fell below it; the new state's loss drops likewise."""
    consts = {"MODEL_BERNOULLI": 1, "MODEL_GILBERT_ELLIOTT": 2}
    state = _const_entries("gilbert_elliott_state")
    decide = _const_entries("decide")
    move = {"state_keep": lambda bad: bad, "state_bad": lambda bad: 1, "state_good": lambda bad: 0,
            "state_toggle": lambda bad: 1 - bad}  # fmt: skip
    # room: 0 (draw not below the threshold) or 5 (below); always: the threshold is 2^32 - 1
    for p_always, p_room, r_always, r_room, old_bad in itertools.product(
        (0, 1), (0, 5), (0, 1), (0, 5), (0, 1)
    ):
        values = {"p_always": p_always, "p_room": p_room, "r_always": r_always, "r_room": r_room}
        action = _first_match(state, values, ["p_always", "p_room", "r_always", "r_room"], consts)
        p_taken, r_taken = bool(p_always or p_room), bool(r_always or r_room)
        expected = (1 if p_taken else 0) if old_bad == 0 else (0 if r_taken else 1)
        assert move[action](old_bad) == expected, values
    order = ["model", "bad", "good_always", "good_room", "bad_always", "bad_room"]
    for model, bad, g_always, g_room, b_always, b_room in itertools.product(
        (0, 1, 2), (0, 1), (0, 1), (0, 5), (0, 1), (0, 5)
    ):
        values = dict(zip(order, (model, bad, g_always, g_room, b_always, b_room), strict=True))
        dropped = _first_match(decide, values, order, consts) == "drop_it"
        if model == 0:
            expected = False
        elif model == 1 or bad == 0:
            expected = bool(g_always or g_room)
        else:
            expected = bool(b_always or b_room)
        assert dropped == expected, values
