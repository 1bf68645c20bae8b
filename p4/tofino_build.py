"""Compile p4/tofino with p4c's Tofino backend and keep the artifacts that matter in git.

The compiler (``p4c-barefoot``, p4lang/p4c configured with ``-DENABLE_TOFINO=ON``) is built from source
outside the project (p4/tofino/README.md). This script runs it and copies into ``p4/tofino/build/``:
``bf-rt.json`` (the control plane's names and ids), ``context.json`` (the driver's view of the program),
the resource reports, and ``manifest.json`` naming the compiler and a hash of the sources they came
from. ``tests/test_tofino.py`` fails when the sources changed and the artifacts did not::

    .venv/bin/python p4/tofino_build.py            # compile and refresh p4/tofino/build/
    .venv/bin/python p4/tofino_build.py --check    # exit 1 if the artifacts are stale

(``p4/`` is deliberately not a Python package; tests load this file by path.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "p4" / "tofino"
BUILD = SOURCES / "build"
MANIFEST = BUILD / "manifest.json"
COMPILER = "p4c-barefoot"
TARGET = "tofino"
PIPE = "pipe"  # the Pipeline instance in lta.p4; BfRt prefixes table names with it
# What is kept from the compiler's output folder: (path inside it, name under p4/tofino/build/).
ARTIFACTS = (
    ("bf-rt.json", "bf-rt.json"),
    (f"{PIPE}/context.json", "context.json"),
    (f"{PIPE}/logs/resources.json", "resources.json"),
    (f"{PIPE}/logs/mau.resources.log", "mau.resources.log"),
    (f"{PIPE}/logs/phv_allocation_summary_0.log", "phv_allocation_summary.log"),
)


def source_files(directory: Path = SOURCES) -> list[Path]:
    """The P4 sources of the Tofino program, in a fixed order (generated files included)."""
    return sorted(p for p in directory.glob("*.p4") if p.is_file())


def sources_hash(directory: Path = SOURCES) -> str:
    """sha256 over (name, length, bytes) of every source, so renaming or moving text changes it."""
    digest = hashlib.sha256()
    for path in source_files(directory):
        data = path.read_bytes()
        digest.update(f"{path.name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def compiler_version(compiler: str = COMPILER) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    return (result.stdout or result.stderr).strip().splitlines()[-1]


def compile_into(out: Path, compiler: str = COMPILER) -> subprocess.CompletedProcess:
    """Run the compiler on p4/tofino/lta.p4 with its output in ``out`` (run from the repository root)."""
    cmd = [
        compiler, "--target", TARGET, "--arch", "tna", "--std", "p4-16",
        "-o", str(out), "--bf-rt-schema", str(out / "bf-rt.json"),
        str((SOURCES / "lta.p4").relative_to(ROOT)),
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)


def read_manifest(path: Path = MANIFEST) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: compile with .venv/bin/python p4/tofino_build.py")
    return json.loads(path.read_text())


def stale_reason(manifest_path: Path = MANIFEST, directory: Path = SOURCES) -> str | None:
    """Why the committed artifacts do not belong to the sources, or None when they do."""
    manifest = read_manifest(manifest_path)
    current = sources_hash(directory)
    if manifest.get("sources_sha256") != current:
        return (
            f"p4/tofino sources changed (sha256 {current[:12]}, artifacts built from "
            f"{str(manifest.get('sources_sha256'))[:12]}): recompile with .venv/bin/python p4/tofino_build.py"
        )
    missing = [name for name in manifest.get("artifacts", []) if not (manifest_path.parent / name).is_file()]
    if missing:
        return f"artifacts named in the manifest are missing: {', '.join(missing)}"
    return None


def bfrt_names(bfrt: dict, pipe: str = PIPE) -> dict[str, set[str]]:
    """Table, action, counter and register names of a bf-rt.json, without the pipeline prefix."""

    def strip(name: str) -> str:
        return name[len(pipe) + 1 :] if name.startswith(pipe + ".") else name

    names: dict[str, set[str]] = {"tables": set(), "actions": set(), "counters": set(), "registers": set()}
    kinds = {"Counter": "counters", "Register": "registers"}
    for table in bfrt.get("tables", []):
        kind = kinds.get(table.get("table_type", ""), "tables")
        names[kind].add(strip(table["name"]))
        for action in table.get("action_specs", []):
            names["actions"].add(strip(action["name"]))
    return names


def missing_bfrt_names(bfrt: dict, required: dict[str, list[str]], pipe: str = PIPE) -> list[str]:
    """Every required name (``hostlib.p4schema.required_names()``'s shape) that bf-rt.json lacks."""
    present = bfrt_names(bfrt, pipe)
    return [
        f"{kind[:-1]} {name}"
        for kind, wanted in required.items()
        for name in wanted
        if name not in present[kind]
    ]


def build(compiler: str = COMPILER) -> int:
    with tempfile.TemporaryDirectory(prefix="lta-tofino-") as tmp:
        out = Path(tmp)
        result = compile_into(out, compiler)
        if result.returncode != 0:
            print(result.stdout[-4000:] + result.stderr[-4000:], file=sys.stderr)
            print(f"{compiler} failed (exit {result.returncode})", file=sys.stderr)
            return 1
        BUILD.mkdir(exist_ok=True)
        kept = []
        for inside, name in ARTIFACTS:
            if (out / inside).is_file():
                shutil.copyfile(out / inside, BUILD / name)
                kept.append(name)
        manifest = {
            "compiler": compiler_version(compiler),
            "target": TARGET,
            "sources_sha256": sources_hash(),
            "artifacts": kept,
        }
        MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"wrote {', '.join(kept)} and manifest.json to {BUILD.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the artifacts against the sources")
    parser.add_argument("--compiler", default=COMPILER, help="the p4c-barefoot to run (default: from PATH)")
    args = parser.parse_args(argv)
    if args.check:
        try:
            reason = stale_reason()
        except FileNotFoundError as exc:
            print(exc)
            return 1
        print(reason or "p4/tofino/build is current")
        return 1 if reason else 0
    if shutil.which(args.compiler) is None:
        print(f"{args.compiler} is not on PATH: build it first (p4/tofino/README.md)", file=sys.stderr)
        return 1
    return build(args.compiler)


if __name__ == "__main__":
    sys.exit(main())
