"""The chaos summary: verdicts per fault kind and per front door, as JSON and as a Markdown table."""

from __future__ import annotations

from collections import Counter
from typing import Any

from lta.chaos.schedule import FAULT_KINDS

VERDICTS = ("ok", "loud", "hang", "silent")


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of each verdict: overall, per fault kind (a run counts under each of its kinds) and per door."""
    by_kind: dict[str, Counter[str]] = {k: Counter() for k in FAULT_KINDS}
    by_door: dict[str, Counter[str]] = {}
    for row in rows:
        for f in row["faults"]:
            by_kind[f["kind"]][row["verdict"]] += 1
        by_door.setdefault(row["door"], Counter())[row["verdict"]] += 1
    return {
        "runs": len(rows),
        "verdicts": {v: sum(1 for r in rows if r["verdict"] == v) for v in VERDICTS},
        "by_fault": {k: {v: c[v] for v in VERDICTS} for k, c in by_kind.items()},
        "by_door": {d: {v: c[v] for v in VERDICTS} for d, c in by_door.items()},
        "loud_causes": sorted({r["cause"] for r in rows if r["verdict"] == "loud"}),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    s = summary(rows)
    lines = [f"# lta chaos: {s['runs']} runs", "", "| fault kind | " + " | ".join(VERDICTS) + " |"]
    lines.append("| --- |" + " --- |" * len(VERDICTS))
    for kind, counts in s["by_fault"].items():
        lines.append(f"| {kind} | " + " | ".join(str(counts[v]) for v in VERDICTS) + " |")
    lines += ["", "| front door | " + " | ".join(VERDICTS) + " |", "| --- |" + " --- |" * len(VERDICTS)]
    for door, counts in s["by_door"].items():
        lines.append(f"| {door} | " + " | ".join(str(counts[v]) for v in VERDICTS) + " |")
    lines += ["", "| seed | door | faults | verdict | s | cause |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        faults = ", ".join(_fault_text(f) for f in r["faults"])
        lines.append(
            f"| {r['seed']} | {r['door']} | {faults} | {r['verdict']} | {r['wall_s']} | {r['cause']} |"
        )
    return "\n".join(lines) + "\n"


def _fault_text(f: dict[str, Any]) -> str:
    kind = f["kind"]
    if kind.startswith("loss-"):
        return f"{kind} {f['model'][:2]} {f['rate']:.0%}"
    extra = {k: v for k, v in f.items() if k != "kind"}
    return kind + "(" + ",".join(f"{k}={v}" for k, v in extra.items()) + ")"
