"""Compile p4/tofino with p4c's Tofino backend and keep the artifacts that matter in git.

The compiler (``p4c-barefoot``, p4c's open Tofino backend; tested: 9.13.4) must be on PATH; the
project does not carry it (p4/tofino/README.md, "The compiler"). This script runs it, then its
assembler ``bfas`` on the ``.bfa`` it wrote (``p4c-barefoot`` alone exits 0 for a program that needs
more stages than the chip has; ``bfas`` is what refuses it), and copies into ``p4/tofino/build/``:
``bf-rt.json`` (the control plane's names, ids and widths; the compiler's front end writes it before
the backend runs, so it is kept even when the backend fails), and, once the program fits,
``context.json`` and the resource reports; then ``manifest.json`` naming the compiler, a hash of the
sources, whether the program fits and, if not, the first error. ``tests/test_tofino.py`` fails when
the sources changed and the artifacts did not::

    .venv/bin/python p4/tofino_build.py            # compile and refresh p4/tofino/build/
    .venv/bin/python p4/tofino_build.py --check    # exit 1 if the artifacts are stale

(``p4/`` is deliberately not a Python package; tests load this file by path.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
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
ASSEMBLER = "bfas"
TARGET = "tofino"
PIPE = "pipe"  # the Pipeline instance in lta.p4; BfRt prefixes table names with it
# What is kept from the compiler's output folder: (path inside it, name under p4/tofino/build/). The
# schema is kept whatever the backend says; the rest exists only for a program that fits.
SCHEMA = ("bf-rt.json", "bf-rt.json")
# ``-g`` makes the compiler write its resource report (``logs/resources.json``: every stage's RAMs,
# ALUs, crossbar bytes) and the PHV allocation (``logs/phv.json``, 2 MB and more; not kept: its
# container counts go into ``resources.md``).
ARTIFACTS = (
    (f"{PIPE}/context.json", "context.json"),
    (f"{PIPE}/logs/resources.json", "resources.json"),
)
PHV_LOG = f"{PIPE}/logs/phv.json"
SUMMARY = "resources.md"  # written by resource_summary() from resources.json and phv.json


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


def compiler_version(compiler: str = COMPILER, out: Path | None = None) -> str:
    """``p4c-barefoot 9.13.4 (6b7ec98e77)``: the version and p4c commit the compiler wrote into its own
    manifest in ``out``, else its ``--version`` line."""
    name = Path(compiler).name
    own = out / "manifest.json" if out is not None else None
    if own is not None and own.is_file():
        version = json.loads(own.read_text()).get("compiler_version")
        if version:
            return f"{name} {version}"
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    return f"{name} {(result.stdout or result.stderr).strip().splitlines()[-1].removeprefix('Version ')}"


def compile_into(out: Path, compiler: str = COMPILER) -> subprocess.CompletedProcess:
    """Run the compiler on p4/tofino/lta.p4 with its output in ``out`` (run from the repository root),
    then the assembler on its ``.bfa``; the result is the first of the two that failed, else the last."""
    cmd = [
        compiler, "--target", TARGET, "--arch", "tna", "--std", "p4-16", "-g",
        "-o", str(out), "--bf-rt-schema", str(out / "bf-rt.json"),
        str((SOURCES / "lta.p4").relative_to(ROOT)),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    bfa = out / PIPE / "lta.bfa"
    if result.returncode != 0 or not bfa.is_file():
        return result
    assembler = str(Path(shutil.which(compiler) or compiler).with_name(ASSEMBLER))
    cmd = [assembler, "-o", str(out / PIPE), str(bfa)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)


def first_error(result: subprocess.CompletedProcess) -> str:
    """The compiler's (or assembler's) first error line, the exit status if it printed none."""
    lines = (result.stdout + result.stderr).splitlines()
    for i, line in enumerate(lines):
        if "error" in line.lower() and "0 errors" not in line:
            # PHV allocation names its count of unallocated slices on the next line
            follow = (
                lines[i + 1].strip() if i + 1 < len(lines) and "remain unallocated" in lines[i + 1] else ""
            )
            # the assembler names its input by path: keep only the file name (the folder is temporary)
            text = re.sub(r"^\S*/(?=[^/\s]+\.bfa:)", "", line.strip())
            return " ".join(p for p in (text, follow) if p)
    return f"exit status {result.returncode}"


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


SNAPSHOT = "pipe.snapshot."  # the compiler's debug-capture tables


def bfrt_signature(bfrt: dict) -> list:
    """What the control plane relies on in a bf-rt.json, in a canonical order: every table's name, id,
    type and size, its key fields, actions with their parameters, and data fields (names, ids, match
    types, widths). Two compiles of the same sources have agreed on it; the file itself has once come
    out in another order (the compiler orders some lists by address). The compiler's own snapshot
    tables (``pipe.snapshot.*``, debug capture, which the control plane never writes) are compared
    without their ids: two compiles of the same sources gave ``pipe.snapshot.cfg`` ids 2435546183 and
    2447393627."""

    def field(raw: dict) -> tuple:
        type_ = raw.get("type") or {}
        return (
            raw.get("name"),
            raw.get("id"),
            raw.get("match_type", ""),
            type_.get("type"),
            type_.get("width"),
        )

    def data(raw: dict) -> tuple:
        return field(raw["singleton"]) if "singleton" in raw else ("", 0, "", None, None)

    return sorted(
        (
            t["name"], 0 if t["name"].startswith(SNAPSHOT) else t["id"], t["table_type"], t.get("size", 0),
            tuple(sorted(field(k) for k in t.get("key", []))),
            tuple(sorted((a["name"], a["id"], tuple(sorted(field(d) for d in a.get("data", []))))
                         for a in t.get("action_specs", []))),
            tuple(sorted(data(d) for d in t.get("data", []))),
        )
        for t in bfrt.get("tables", [])
    )  # fmt: skip


def missing_bfrt_names(bfrt: dict, required: dict[str, list[str]], pipe: str = PIPE) -> list[str]:
    """Every required name (``hostlib.p4.schema.required_names()``'s shape) that bf-rt.json lacks."""
    present = bfrt_names(bfrt, pipe)
    return [
        f"{kind[:-1]} {name}"
        for kind, wanted in required.items()
        for name in wanted
        if name not in present[kind]
    ]


def stage_usage(resources: dict) -> list[dict[str, int]]:
    """Per MAU stage of a ``resources.json`` (``-g``): the units used and the stage's capacity, as
    ``{"stage", "sram", "sram_max", "tcam", "tcam_max", "map_ram", "map_ram_max", "salu", "salu_max",
    "stats", "stats_max", "gateways", "gateways_max", "exact_xbar", "exact_xbar_max", "ternary_xbar",
    "ternary_xbar_max"}`` (ingress and egress share a stage)."""
    rows = []
    for stage in resources["resources"]["mau"]["mau_stages"]:
        rams, tcams, maps = stage["rams"], stage["tcams"], stage["map_rams"]
        gateways, xbar = stage["gateways"], stage["xbar_bytes"]
        kinds = [b.get("byte_type") for b in xbar["bytes"]]
        rows.append({
            "stage": stage["stage_number"],
            "sram": len(rams["srams"]), "sram_max": rams["nRows"] * rams["nColumns"],
            "tcam": len(tcams["tcams"]), "tcam_max": tcams["nRows"] * tcams["nColumns"],
            "map_ram": len(maps["maprams"]), "map_ram_max": maps["nRows"] * maps["nUnits"],
            "salu": len(stage["meter_alus"]["meters"]), "salu_max": stage["meter_alus"]["nAlus"],
            "stats": len(stage["statistic_alus"]["stats"]), "stats_max": stage["statistic_alus"]["nAlus"],
            "gateways": len(gateways["gateways"]), "gateways_max": gateways["nRows"] * gateways["nUnits"],
            "exact_xbar": kinds.count("exact"), "exact_xbar_max": xbar["exact_size"],
            "ternary_xbar": kinds.count("ternary"), "ternary_xbar_max": xbar["ternary_size"],
        })  # fmt: skip
    return rows


def phv_usage(phv: dict, resources: dict) -> list[tuple[str, str, int, int, int]]:
    """(gress, container type, width, containers used, containers the chip has) from ``phv.json`` and
    the capacity in ``resources.json``; the chip's containers are shared by ingress and egress."""
    capacity = {
        (kind, group["width"]): group["units"]
        for kind, groups in resources["resources"]["phv_containers"].items()
        for group in groups
    }
    used: dict[tuple[str, str, int], int] = {}
    for container in phv["containers"]:
        key = (container["gress"], container["container_type"], container["bit_width"])
        used[key] = used.get(key, 0) + 1
    return [(g, k, w, n, capacity.get((k, w), 0)) for (g, k, w), n in sorted(used.items())]


def resource_summary(resources: dict, phv: dict | None, header: str) -> str:
    """Markdown: per stage SRAM, TCAM, map RAM, stateful and stats ALUs, gateways and crossbar bytes,
    the totals, and the PHV containers used by gress, type and width."""
    rows = stage_usage(resources)
    columns = [("sram", "SRAM"), ("tcam", "TCAM"), ("map_ram", "map RAM"), ("salu", "stateful ALUs"),
               ("stats", "stats ALUs"), ("gateways", "gateways"), ("exact_xbar", "exact xbar bytes"),
               ("ternary_xbar", "ternary xbar bytes")]  # fmt: skip
    used = [r for r in rows if any(r[c] for c, _ in columns)]
    lines = [header, "", f"MAU stages used: {len(used)} of {len(rows)}.", ""]
    lines.append("| stage | " + " | ".join(title for _, title in columns) + " |")
    lines.append("| --- " * (len(columns) + 1) + "|")
    for r in rows:
        lines.append(f"| {r['stage']} | " + " | ".join(f"{r[c]}/{r[c + '_max']}" for c, _ in columns) + " |")
    totals = ", ".join(
        f"{title} {sum(r[c] for r in rows)}/{sum(r[c + '_max'] for r in rows)}" for c, title in columns[:5]
    )
    lines += ["", f"Totals: {totals}.", ""]
    if phv is not None:
        lines.append("| PHV containers | type | width | used | the chip has (both gresses) |")
        lines.append("| --- | --- | --- | --- | --- |")
        for gress, kind, width, count, capacity in phv_usage(phv, resources):
            lines.append(f"| {gress} | {kind} | {width} | {count} | {capacity} |")
        lines.append("")
    return "\n".join(lines)


def build(compiler: str = COMPILER) -> int:
    """Compile, refresh p4/tofino/build/ and its manifest; 0 when the program fits the chip, 1 when only
    the schema could be kept (the manifest then names the first error), 2 when not even that."""
    with tempfile.TemporaryDirectory(prefix="lta-tofino-") as tmp:
        out = Path(tmp)
        return keep_artifacts(out, compile_into(out, compiler), compiler)


def keep_artifacts(out: Path, result: subprocess.CompletedProcess, compiler: str = COMPILER) -> int:
    """Refresh p4/tofino/build/ and its manifest from a compile of the current sources into ``out``
    (``result``: the compiler's, or the assembler's when the compiler succeeded); build()'s codes."""
    fits = result.returncode == 0
    if not (out / SCHEMA[0]).is_file():
        print(result.stdout[-4000:] + result.stderr[-4000:], file=sys.stderr)
        print(f"{compiler} wrote no bf-rt.json: {first_error(result)}", file=sys.stderr)
        return 2
    BUILD.mkdir(exist_ok=True)
    for old in BUILD.iterdir():
        old.unlink()
    kept = []
    for inside, name in (SCHEMA, *(ARTIFACTS if fits else ())):
        if (out / inside).is_file():
            shutil.copyfile(out / inside, BUILD / name)
            kept.append(name)
    if fits and (out / ARTIFACTS[1][0]).is_file():
        phv_path = out / PHV_LOG
        summary = resource_summary(
            json.loads((out / ARTIFACTS[1][0]).read_text()),
            json.loads(phv_path.read_text()) if phv_path.is_file() else None,
            f"# LTA on {TARGET}: the compiler's resource report (`p4/tofino_build.py` from "
            f"`resources.json` and `phv.json`)",
        )
        (BUILD / SUMMARY).write_text(summary)
        kept.append(SUMMARY)
    manifest = {
        "compiler": compiler_version(compiler, out),
        "target": TARGET,
        "sources_sha256": sources_hash(),
        "fits": fits,
        "first_error": None if fits else first_error(result),
        "artifacts": kept,
    }
    MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {', '.join(kept)} and manifest.json to {BUILD.relative_to(ROOT)}")
    if not fits:
        print((result.stdout + result.stderr)[-3000:], file=sys.stderr)
        print(f"the program does not fit yet: {manifest['first_error']}", file=sys.stderr)
    return 0 if fits else 1


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
        print(f"{args.compiler} is not on PATH (tested: 9.13.4; p4/tofino/README.md)", file=sys.stderr)
        return 1
    return build(args.compiler)


if __name__ == "__main__":
    sys.exit(main())
