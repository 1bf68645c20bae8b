"""The P4 program agrees with hostlib.protocol: generated files are current, the LTA header has the
wire format's fields and widths, and the P4Info counters and tables have the names the control plane
and the softswitch use."""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path

from hostlib.p4.info import load_p4info, missing_names
from hostlib.protocol import (
    COUNTERS,
    HEADER_BITS,
    HEADER_FIELDS,
    LTA_PORT,
    MAX_JOBS,
    MAX_WORKERS,
    WORKER_COUNTER,
)

ROOT = Path(__file__).resolve().parent.parent
V1MODEL = ROOT / "p4" / "v1model"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_p4", ROOT / "p4" / "gen_p4.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def p4_header_fields(source: str, header: str) -> list[tuple[str, int]]:
    body = re.search(r"header\s+" + header + r"\s*\{(.*?)\}", source, re.S)
    assert body, f"no `header {header}` in the P4 source"
    text = re.sub(r"//[^\n]*", "", body.group(1))
    return [(name, int(bits)) for bits, name in re.findall(r"bit<(\d+)>\s+(\w+)\s*;", text)]


def test_generated_p4_is_current():
    gen = load_generator()
    assert gen.stale_files() == [], "run .venv/bin/python p4/gen_p4.py and commit p4/v1model/*.gen.p4"


def test_committed_build_was_compiled_from_these_sources():
    """Everywhere, p4c or not: p4/build/lta.sources.sha256 (written by ``gen_p4.py --record-build`` after
    compiling) holds the SHA-256 of every P4 source, and they are still those of the sources here. A
    change under p4/v1model without a rebuild fails (tests/test_p4_build.py recompiles where p4c is)."""
    recorded = {}
    for line in (ROOT / "p4" / "build" / "lta.sources.sha256").read_text().splitlines():
        digest, path = line.split("  ", 1)
        recorded[path] = digest
    current = {
        path.relative_to(ROOT).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in V1MODEL.glob("*.p4")
    }
    assert "p4/v1model/lta.p4" in current and len(current) > 5
    changed = sorted(p for p in current.keys() | recorded.keys() if current.get(p) != recorded.get(p))
    assert not changed, (
        f"p4/build is older than {', '.join(changed)}: recompile it and run "
        ".venv/bin/python p4/gen_p4.py --record-build (p4/build/README.md)"
    )


def test_generator_output_is_not_empty_and_covers_every_element():
    gen = load_generator()
    elements = gen.render_file("slot_elements.gen.p4")
    for i in (0, 31, 63):
        assert f"register<bit<32>>(LTA_SLOT_CAPACITY) acc_{i};" in elements
        assert f"acc_{i}.read(stored, index);" in elements
    assert "acc_64" not in elements
    assert len(p4_header_fields(gen.render_file("payload.gen.p4"), "lta_payload_t")) == 64


def test_lta_header_matches_wire_format():
    fields = p4_header_fields((V1MODEL / "headers.p4").read_text(), "lta_t")
    assert [name for name, _ in fields] == [name for name, _ in HEADER_FIELDS]
    assert dict(fields) == HEADER_BITS
    assert sum(bits for _, bits in fields) == 36 * 8


def test_protocol_constants_match_hostlib():
    constants = (V1MODEL / "protocol_constants.gen.p4").read_text()
    assert f"const bit<16> LTA_PORT = {LTA_PORT};" in constants
    assert "const bit<16> LTA_UDP_BYTES = 300;" in constants  # 8 + 36 + 4 * 64
    for i, name in enumerate(COUNTERS):
        assert f"const bit<8> BRANCH_{name.upper()} = {i};" in constants


def test_every_counter_is_declared_once_with_its_absolute_name():
    source = (V1MODEL / "counters.gen.p4").read_text()
    declared = re.findall(r'@name\("\.(\w+)"\) counter\(LTA_MAX_JOBS, CounterType\.packets\)', source)
    assert sorted(declared) == sorted(COUNTERS)


def test_every_branch_counter_is_set_somewhere():
    """Each branch constant the counter tables count is assigned by some control (no dead counter)."""
    sources = "\n".join(p.read_text() for p in V1MODEL.glob("*.p4") if not p.name.endswith(".gen.p4"))
    for name in COUNTERS:
        if name == "rx_packets":
            continue
        assert f"BRANCH_{name.upper()}" in sources or name == "result_quorum", name
    assert "meta.result_quorum = true" in sources


def test_p4info_counters_equal_protocol_counters():
    info = load_p4info()
    sizes = {c.preamble.name: c.size for c in info.counters}
    assert sorted(sizes) == sorted((*COUNTERS, WORKER_COUNTER))
    assert all(sizes[name] == MAX_JOBS for name in COUNTERS)
    assert sizes[WORKER_COUNTER] == MAX_JOBS * MAX_WORKERS  # indexed job_id * MAX_WORKERS + worker_id


def test_p4info_has_every_name_the_control_plane_uses():
    assert missing_names(load_p4info()) == []
