"""The chaos summary: verdicts per fault kind and per front door, as JSON and as a Markdown table."""

from __future__ import annotations

from collections import Counter
from typing import Any

from lta.chaos.runner import RECOVERY_TARGET_S
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
        "kill_recovery": kill_recovery(rows),
    }


def kill_recovery(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every kill of every run (``recoveries``, runner._recovery): how many, how many had their
    survivors back at pace within ``RECOVERY_TARGET_S``, how many never got back (the run ended first),
    the slowest, and how many were timed from a later fault rather than the kill."""
    kills = [k for r in rows for k in r.get("recoveries", [])]
    times = [k["recovery_s"] for k in kills if k["recovery_s"] is not None]
    return {
        "kills": len(kills),
        "within_target": sum(1 for t in times if t <= RECOVERY_TARGET_S),
        "never_back": len(kills) - len(times),
        "max_s": max(times) if times else None,
        "timed_from_a_later_fault": sum(1 for k in kills if k.get("after")),
        "target_s": RECOVERY_TARGET_S,
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
    k = s["kill_recovery"]
    if k["kills"]:
        lines += [
            "",
            f"Kill recovery (survivors back at their step time; target {k['target_s']:g} s): "
            f"{k['within_target']} of {k['kills']} kills within it, slowest {k['max_s']} s, "
            f"{k['never_back']} never back before the run ended, {k['timed_from_a_later_fault']} timed "
            "from a later fault that came before the survivors were back.",
        ]
    lines += [
        "",
        "| seed | door | faults | verdict | s | kill recovery s | cause |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        faults = ", ".join(_fault_text(f) for f in r["faults"])
        recovery = ", ".join(_recovery_text(k) for k in r.get("recoveries", []))
        lines.append(
            f"| {r['seed']} | {r['door']} | {faults} | {r['verdict']} | {r['wall_s']} | {recovery} "
            f"| {r['cause']} |"
        )
    return "\n".join(lines) + "\n"


def _recovery_text(k: dict[str, Any]) -> str:
    text = "never back" if k["recovery_s"] is None else f"{k['recovery_s']}"
    if k.get("after"):
        text += f" (after {k['after']}; {k['from_kill_s']} from the kill)"
    return f"rank {k['rank']}: {text}"


def _fault_text(f: dict[str, Any]) -> str:
    kind = f["kind"]
    if kind.startswith("loss-"):
        return f"{kind} {f['model'][:2]} {f['rate']:.0%}"
    extra = {k: v for k, v in f.items() if k != "kind"}
    return kind + "(" + ",".join(f"{k}={v}" for k, v in extra.items()) + ")"
