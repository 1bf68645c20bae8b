"""The committed BMv2 JSON and P4Info are what p4c-bm2-ss makes of p4/v1model today."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "p4" / "build"
COMPILER = shutil.which("p4c-bm2-ss")

pytestmark = [
    pytest.mark.bmv2,
    pytest.mark.skipif(
        COMPILER is None,
        reason="p4c-bm2-ss is not on PATH (build p4c from p4lang's sources: README, 'BMv2 and p4c')",
    ),
]


def compile_into(out: Path) -> subprocess.CompletedProcess:
    # Run from the repository root with relative paths, as p4/build/README.md says, so that source
    # locations inside the JSON are the same as in the committed file.
    cmd = [
        COMPILER, "--std", "p4-16", "--arch", "v1model",
        "-o", str(out / "lta.json"),
        "--p4runtime-files", str(out / "lta.p4info.txtpb"),
        "p4/v1model/lta.p4",
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def without_source_info(node):
    """The JSON minus source locations, which name where p4c's own include files are installed."""
    if isinstance(node, dict):
        return {k: without_source_info(v) for k, v in node.items() if k != "source_info"}
    if isinstance(node, list):
        return [without_source_info(v) for v in node]
    return node


def test_committed_build_matches_sources(tmp_path):
    result = compile_into(tmp_path)
    assert result.returncode == 0, f"p4c-bm2-ss failed:\n{result.stderr[-4000:]}"
    fresh_info = (tmp_path / "lta.p4info.txtpb").read_text()
    assert (BUILD / "lta.p4info.txtpb").read_text() == fresh_info, (
        "p4/build/lta.p4info.txtpb is stale: recompile (see p4/build/README.md)"
    )
    committed = without_source_info(json.loads((BUILD / "lta.json").read_text()))
    fresh = without_source_info(json.loads((tmp_path / "lta.json").read_text()))
    assert committed == fresh, "p4/build/lta.json is stale: recompile (see p4/build/README.md)"
