"""torch's own distributed tests on "lta", compared with gloo (issue 39, item 5).

A child pytest runs a selection of ``DistributedTest._DistTestBase`` (torch's collective tests, the ones gloo
runs on CPU; tests/torch_dist_conformance.py) once with BACKEND=gloo and once with BACKEND=lta, two ranks
each, side by side. On lta every float SUM/AVG allreduce goes through the switch: K = 1
(``LTA_ELEMS_PER_PACKET=1``), so no tensor is below one packet, and the switch runs exact
(``LTA_EXACT_MS``: rounds close by seeded drops only, none here), so a test sees the switch's arithmetic,
not an emulated loss. Expectation: lta passes every selected test gloo passes, gloo passes all of them (a
test gloo skips would prove nothing), and the switch summed something in the float SUM test.

The default run takes six tests (about a minute); ``-m slow`` runs the broader selection (every
collective test of the base whose name has no cuda/nccl/gpu, ~120, about 20 minutes at two ranks).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("expecttest", reason="torch's test base needs expecttest (the dev extra)")

REPO = Path(__file__).resolve().parent.parent
HARNESS = "tests/torch_dist_conformance.py"
CLASS = "TestDistBackendWithSpawn"

# Float SUM through the switch (default group, complex as float pairs, a new group of all ranks), a
# coalesced allreduce and a sparse one (reliable; torch runs both on gloo only; main 6412e48 failed the
# sparse one), a broadcast.
DEFAULT = [
    "test_all_reduce_sum",
    "test_all_reduce_sum_complex",
    "test_all_reduce_full_group_sum",
    "test_all_reduce_coalesced_sum",
    "test_sparse_all_reduce_sum",
    "test_broadcast",
]
# What gloo runs among the collective tests (the base also has DDP, RPC-free model and profiler tests).
BROAD_PREFIXES = (
    "test_all_reduce", "test_all_gather", "test_allgather", "test_broadcast", "test_reduce", "test_scatter",
    "test_gather", "test_barrier", "test_send_recv", "test_isend", "test_irecv", "test_all_to_all",
    "test_batch_isend", "test_new_group", "test_get_rank", "test_get_backend", "test_destroy",
    "test_average", "test_sparse", "test_monitored",
)  # fmt: skip
# Tests gloo passes that lta cannot without patching torch: dist.monitored_barrier refuses every backend
# not named "gloo" before it reaches the group (hostlib/torch_ext/README.md, "monitored_barrier").
NAME_CHECKS = {"test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup"}


def base_tests() -> list[str]:
    """The test names of ``DistributedTest._DistTestBase``, read from its source (importing the module
    needs BACKEND and the rest of its environment)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    base = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "_DistTestBase")
    return sorted(f.name for f in base.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_"))


def broad_selection() -> list[str]:
    return [
        n
        for n in base_tests()
        if n.startswith(BROAD_PREFIXES) and not any(w in n for w in ("cuda", "nccl", "gpu"))
    ]


def _run_child(
    backend: str, tests: list[str], world: int, work: Path, extra: dict[str, str]
) -> dict[str, str]:
    """One child pytest of the harness on ``backend``: per test, "passed", "failed" or "skipped"."""
    (work / "temp").mkdir(parents=True)
    (work / "notes").mkdir()
    env = {
        **os.environ,
        "BACKEND": backend,
        "WORLD_SIZE": str(world),
        "TEMP_DIR": str(work / "temp"),
        "LTA_ELEMS_PER_PACKET": "1",
        "LTA_EXACT_MS": "3000",
        "LTA_CONFORMANCE_NOTES": str(work / "notes"),
        "OMP_NUM_THREADS": "1",
        **extra,
    }
    ids = [f"{HARNESS}::{CLASS}::{t}" for t in tests]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *ids]
    cmd += [f"--junitxml={work / 'junit.xml'}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=60 * 60)
    xml = work / "junit.xml"
    assert xml.exists(), f"{backend}: the child pytest wrote no report:\n{proc.stdout.decode()[-3000:]}"
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        failed = kinds & {"failure", "error"}
        outcomes[case.get("name", "")] = "failed" if failed else "skipped" if "skipped" in kinds else "passed"
    return outcomes


def run_base(tests: list[str], world: int, tmp_path: Path) -> dict[str, dict[str, str]]:
    """Outcome per backend, per test: gloo first, then lta asked to run every test gloo passed (the
    harness lifts torch's gloo-only skips for those)."""
    gloo = _run_child("gloo", tests, world, tmp_path / "gloo", {})
    ran = tmp_path / "gloo-passed.txt"
    ran.write_text("\n".join(t for t, outcome in gloo.items() if outcome == "passed"))
    lta = _run_child("lta", tests, world, tmp_path / "lta", {"LTA_CONFORMANCE_RUN": str(ran)})
    return {"gloo": gloo, "lta": lta}


def lossy_calls(tmp_path: Path, test: str) -> list[int]:
    return [int(p.read_text()) for p in sorted((tmp_path / "lta" / "notes").glob(f"{test}.rank*"))]


def check(outcomes: dict[str, dict[str, str]], tests: list[str]) -> list[str]:
    """The tests gloo passes and lta does not (name checks aside)."""
    gloo, lta = outcomes["gloo"], outcomes["lta"]
    assert set(gloo) == set(lta) == set(tests), (sorted(gloo), sorted(lta))
    return [t for t in tests if gloo[t] == "passed" and lta[t] != "passed" and t not in NAME_CHECKS]


def test_torch_collective_tests_pass_on_lta_as_on_gloo(tmp_path: Path) -> None:
    outcomes = run_base(DEFAULT, 2, tmp_path)
    assert all(outcomes["gloo"][t] == "passed" for t in DEFAULT), outcomes["gloo"]
    assert check(outcomes, DEFAULT) == [], outcomes["lta"]
    for test in ("test_all_reduce_sum", "test_all_reduce_sum_complex", "test_all_reduce_full_group_sum"):
        calls = lossy_calls(tmp_path, test)
        assert len(calls) == 2 and min(calls) > 0, f"{test} sent nothing through the switch: {calls}"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_broad_selection_of_torch_collective_tests_on_lta_as_on_gloo(tmp_path: Path) -> None:
    tests = broad_selection()
    outcomes = run_base(tests, 2, tmp_path)
    counts = {b: sum(v == "passed" for v in o.values()) for b, o in outcomes.items()}
    switched = [t for t in tests if min(lossy_calls(tmp_path, t), default=0) > 0]
    print(f"passed of {len(tests)}: {counts}; through the switch on lta: {len(switched)} tests")
    assert check(outcomes, tests) == []
