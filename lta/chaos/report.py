"""The chaos summary: verdicts per fault kind, per front door and per door and fault kind (with the time to
recover and the steps lost there), as JSON, as a Markdown table and as a table for a person (rich)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from lta.chaos.runner import RECOVERY_TARGET_S
from lta.chaos.schedule import FAULT_KINDS

VERDICTS = ("ok", "ok-after-restart", "loud", "hang", "silent")
FIRST_STEP_TARGET_S = 10.0  # a restarted rank's first step after its restart (issue 41's target)


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
        "by_door_fault": by_door_fault(rows),
        "loud_causes": sorted({r["cause"] for r in rows if r["verdict"] == "loud"}),
        "kill_recovery": kill_recovery(rows),
        "restarts": restart_summary(rows),
        "late_ranks": sum(len(r.get("late", [])) for r in rows),
    }


def by_door_fault(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per door, per fault kind drawn there (a run counts under each of its kinds): the verdict counts,
    the slowest kill recovery (survivors back at pace, s; None: none measured), the slowest restarted
    rank's first step after its start (s) and the steps lost to restarts (done twice, summed)."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        kills = [k["recovery_s"] for k in row.get("recoveries", []) if k["recovery_s"] is not None]
        firsts = [k["first_step_s"] for k in row.get("restarts", []) if k["first_step_s"] is not None]
        lost = [k["lost_steps"] for k in row.get("restarts", []) if k["lost_steps"] is not None]
        for kind in dict.fromkeys(f["kind"] for f in row["faults"]):
            cell = table.setdefault(row["door"], {}).setdefault(
                kind,
                {
                    **dict.fromkeys(VERDICTS, 0),
                    "recovery_s_max": None,
                    "first_step_s_max": None,
                    "lost_steps": 0,
                },  # fmt: skip
            )
            cell[row["verdict"]] += 1
            cell["recovery_s_max"] = _max(cell["recovery_s_max"], kills)
            cell["first_step_s_max"] = _max(cell["first_step_s_max"], firsts)
            cell["lost_steps"] += sum(lost)
    return table


def _max(current: float | None, values: list[float]) -> float | None:
    return max([v for v in [current, *values] if v is not None], default=None)


def restart_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every rank started again (``restarts``, runner._restarts): how many, how many made a first
    step within ``FIRST_STEP_TARGET_S`` of their start, how many came after their peers had finished
    (``late``), how many never stepped otherwise, the slowest first step, and the steps lost."""
    starts = [k for r in rows for k in r.get("restarts", [])]
    firsts = [k["first_step_s"] for k in starts if k["first_step_s"] is not None]
    return {
        "restarts": len(starts),
        "first_step_within_target": sum(1 for t in firsts if t <= FIRST_STEP_TARGET_S),
        "late": sum(1 for k in starts if k.get("late")),
        "never_stepped": sum(1 for k in starts if k["first_step_s"] is None and not k.get("late")),
        "first_step_s_max": max(firsts) if firsts else None,
        "lost_steps": sum(k["lost_steps"] for k in starts if k["lost_steps"] is not None),
        "target_s": FIRST_STEP_TARGET_S,
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
    lines += [
        "",
        "| front door | fault kind | " + " | ".join(VERDICTS) + " | " + " | ".join(_MEASURES) + " |",
    ]
    lines.append("| --- | --- |" + " --- |" * (len(VERDICTS) + len(_MEASURES)))
    for door, kind, cells in door_fault_rows(s["by_door_fault"]):
        lines.append(f"| {door} | {kind} | " + " | ".join(cells) + " |")
    k = s["kill_recovery"]
    if k["kills"]:
        lines += [
            "",
            f"Kill recovery (survivors back at their step time; target {k['target_s']:g} s): "
            f"{k['within_target']} of {k['kills']} kills within it, slowest {k['max_s']} s, "
            f"{k['never_back']} never back before the run ended, {k['timed_from_a_later_fault']} timed "
            "from a later fault that came before the survivors were back.",
        ]
    t = s["restarts"]
    if t["restarts"]:
        lines += [
            "",
            f"Restarts (a killed rank started again; first step target {t['target_s']:g} s after its start): "
            f"{t['first_step_within_target']} of {t['restarts']} within it, "
            f"slowest {t['first_step_s_max']} s, "
            f"{t['late']} started after their peers had finished, {t['never_stepped']} never stepped "
            f"otherwise; {t['lost_steps']} steps done twice in all.",
        ]
    lines += [
        "",
        "| seed | door | faults | verdict | s | kill recovery s | restart: 1st step s, lost steps | cause |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        faults = ", ".join(_fault_text(f) for f in r["faults"])
        recovery = ", ".join(_recovery_text(k) for k in r.get("recoveries", []))
        restarts = ", ".join(_restart_text(k) for k in r.get("restarts", []))
        if r.get("late"):
            restarts += f" (late, stopped after their peers had finished: ranks {r['late']})"
        lines.append(
            f"| {r['seed']} | {r['door']} | {faults} | {r['verdict']} | {r['wall_s']} | {recovery} "
            f"| {restarts} | {r['cause']} |"
        )
    return "\n".join(lines) + "\n"


_MEASURES = ("recover s (max)", "restarted 1st step s (max)", "lost steps")


def door_fault_rows(table: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[str, str, list[str]]]:
    """(door, fault kind, cells): the verdict counts then ``_MEASURES``, as text ("-": none measured)."""
    out = []
    for door, kinds in table.items():
        for kind in sorted(
            kinds, key=lambda k: FAULT_KINDS.index(k) if k in FAULT_KINDS else len(FAULT_KINDS)
        ):
            cell = kinds[kind]
            measures = [cell["recovery_s_max"], cell["first_step_s_max"], cell["lost_steps"]]
            out.append(
                (
                    door,
                    kind,
                    [str(cell[v]) for v in VERDICTS] + ["-" if m is None else f"{m:g}" for m in measures],
                )
            )
    return out


def rich_table(rows: list[dict[str, Any]]) -> Any:
    """The door x fault kind table for a terminal (``lta chaos`` prints it on stdout at the end)."""
    from rich.table import Table

    s = summary(rows)
    table = Table(title=f"lta chaos: {s['runs']} runs, per front door and fault kind")
    for name in ("door", "fault", *VERDICTS, *_MEASURES):
        table.add_column(name, justify="left" if name in ("door", "fault") else "right")
    for door, kind, cells in door_fault_rows(s["by_door_fault"]):
        table.add_row(door, kind, *cells)
    return table


def _restart_text(k: dict[str, Any]) -> str:
    if k.get("late"):
        return f"rank {k['rank']}: after its peers had finished"
    if k["first_step_s"] is None:
        return f"rank {k['rank']}: never stepped"
    return f"rank {k['rank']} ({k['by']}): {k['first_step_s']}, {k['lost_steps']} lost"


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
