"""``lta train`` outputs: results.json, a Markdown table in the paper's Table 1 layout, and PNG plots.

Relative changes are paired: each run is compared with the 0% run of the same seed (same initial weights,
same batches), then averaged over seeds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from hostlib.torch_ext.drift import iid_drift, paper_drift, perfectly_correlated_drift
from lta.train.sweep import RunResult

METRICS = (
    ("train_loss", "Train Loss"),
    ("train_ppl", "Train PPL"),
    ("val_loss", "Val Loss"),
    ("val_ppl", "Val PPL"),
)


def _metrics(run: RunResult) -> dict[str, float]:
    return {
        "train_loss": run.train_loss,
        "train_ppl": math.exp(run.train_loss),
        "val_loss": run.val_loss,
        "val_ppl": math.exp(run.val_loss),
    }


def loss_seen(run: RunResult) -> dict[str, float]:
    """The loss the workers actually saw (emulated drops plus anything late): gradient contributions
    missing from the owners' chunks, and foreign parameter chunks not fresh at the end of a step."""
    n = len(run.workers)
    stats = [w["stats"] for w in run.workers]
    chunks = sum(s["grad_chunks"] for s in stats)
    got = sum(s["grad_contributions"] for s in stats)
    fresh = [s["exchange"]["fresh_fraction"] for s in stats]
    return {
        "grad_loss_seen": 1.0 - got / (n * chunks) if chunks else 0.0,
        "param_loss_seen": float(1.0 - np.mean(fresh)),
    }


def sweep_rows(runs: list[RunResult], method: str, baseline: dict[int, RunResult]) -> list[dict[str, Any]]:
    """One row per drop rate: metrics averaged over seeds, and their paired change vs 0% in percent."""
    by_drop: dict[float, list[RunResult]] = {}
    for run in runs:
        if run.spec.method == method or run.spec.drop == 0:
            by_drop.setdefault(run.spec.drop, []).append(run)
    rows = []
    for drop in sorted(by_drop):
        seeds = by_drop[drop]
        values = [_metrics(r) for r in seeds]
        refs = [_metrics(baseline[r.spec.seed]) for r in seeds]
        row: dict[str, Any] = {"drop": drop}
        for name, _ in METRICS:
            row[name] = float(np.mean([v[name] for v in values]))
            changes = [100.0 * (v[name] / ref[name] - 1.0) for v, ref in zip(values, refs, strict=True)]
            row[f"{name}_change_pct"] = float(np.mean(changes))
        for name in ("grad_loss_seen", "param_loss_seen"):
            row[name] = float(np.mean([loss_seen(r)[name] for r in seeds]))
        row["seeds"] = [r.spec.seed for r in seeds]
        row["wall_s"] = float(sum(r.wall_s for r in seeds))
        rows.append(row)
    return rows


def drift_rows(runs: list[RunResult], stale_bound: int) -> list[dict[str, Any]]:
    """Measured receiver-pair drift vs theory, per param drop rate, over the second half of training."""
    by_drop: dict[float, list[RunResult]] = {}
    for run in runs:
        by_drop.setdefault(run.spec.drop, []).append(run)
    rows = []
    for p in sorted(by_drop):
        measured, sigma2, predicted = [], [], []
        for run in by_drop[p]:
            half = max(run.drift_steps, default=0) / 2
            keep = [i for i, s in enumerate(run.drift_steps) if s >= half]
            measured += [run.drift_measured[i] for i in keep]
            sigma2 += [run.drift_sigma2[i] for i in keep]
            predicted += [run.drift_predicted[i] for i in keep]
        if not measured:
            continue
        m, s2, pred = float(np.mean(measured)), float(np.mean(sigma2)), float(np.mean(predicted))
        fresh = [w["stats"]["exchange"]["fresh_fraction"] for r in by_drop[p] for w in r.workers]
        ages = [w["stats"]["stale"]["max_age_seen"] for r in by_drop[p] for w in r.workers]
        resends = [w["stats"]["exchange"]["resend_requests"] for r in by_drop[p] for w in r.workers]
        rows.append(
            {
                "p": p,
                "p_effective": float(1.0 - np.mean(fresh)),
                "measured": m,
                "sigma2": s2,
                "measured_over_sigma2": m / s2 if s2 else 0.0,
                "paper": paper_drift(p, s2),
                "iid": iid_drift(p, s2),
                "perfectly_correlated": perfectly_correlated_drift(p, s2) if p < 1 else None,
                "predicted_from_history": pred,
                "measured_over_paper": m / paper_drift(p, s2) if p and s2 else None,
                "measured_over_iid": m / iid_drift(p, s2) if p and s2 else None,
                "max_stale_age": int(max(ages, default=0)),
                "stale_bound": stale_bound,
                "resend_requests": int(sum(resends)),
                "snapshots": len(measured),
            }
        )
    return rows


def build_results(runs: list[RunResult], config: dict[str, Any], wall_s: float) -> dict[str, Any]:
    baseline = {r.spec.seed: r for r in runs if r.spec.drop == 0}
    methods = sorted({r.spec.method for r in runs} - {"renorm"})
    renorm_runs = [r for r in runs if r.spec.method == "renorm"]
    return {
        "config": config,
        "rows": sweep_rows(runs, "renorm", baseline),
        "drift": drift_rows(renorm_runs, config["train"]["stale_bound"]),
        "baselines": {m: sweep_rows(runs, m, baseline) for m in methods},
        "runs": [
            {
                "name": r.spec.name,
                "method": r.spec.method,
                "drop": r.spec.drop,
                "seed": r.spec.seed,
                "train_loss": r.train_loss,
                "val_loss": r.val_loss,
                "wall_s": r.wall_s,
                "step_ms_median": r.step_ms_median,
                "curve": r.curve,
                "worker_curves": r.worker_curves,  # per worker, per step: compare runs bit for bit
                "resumed_from": r.resumed_from,
                **({"fault": r.fault} if r.fault else {}),
                "drift": {
                    "steps": r.drift_steps,
                    "measured": r.drift_measured,
                    "sigma2": r.drift_sigma2,
                    "predicted": r.drift_predicted,
                },
                "workers": r.workers,
            }
            for r in runs
        ],
        "wall_s": wall_s,
    }


def _cell(row: dict[str, Any], name: str) -> str:
    value = f"{row[name]:.3f}"
    return value if row["drop"] == 0 else f"{value} ({row[f'{name}_change_pct']:+.2f}%)"


def markdown_table(results: dict[str, Any]) -> str:
    rows = results["rows"]
    cfg = results["config"]
    lines = [
        f"# lta train: char GPT on pydoc topics, {cfg['workers']} workers, {cfg['train']['steps']} steps, "
        f"seeds {cfg['seeds']}",
        "",
        f"Loss on {', '.join(cfg['directions'])} at each drop rate; renormalized aggregation (ours), "
        f"stale bound S={cfg['train']['stale_bound']}. Entries: value (change vs 0%).",
        "",
        "| Metric | " + " | ".join(f"{100 * r['drop']:.0f}%" for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for name, label in METRICS:
        lines.append(f"| {label} | " + " | ".join(_cell(r, name) for r in rows) + " |")
    lines += ["", "## Renormalized vs the baselines (Val PPL, change vs 0%)", ""]
    methods = {"renorm": rows, **results["baselines"]}
    drops = [r["drop"] for r in rows]
    lines.append("| Method | " + " | ".join(f"{100 * d:.0f}%" for d in drops) + " |")
    lines.append("|---|" + "---|" * len(drops))
    for method, method_rows in methods.items():
        by_drop = {r["drop"]: r for r in method_rows}
        cells = [_cell(by_drop[d], "val_ppl") if d in by_drop else "" for d in drops]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Parameter drift between receivers (second half of training)",
        "",
        "| p | p effective | measured E[D²] | σ² | paper 2p/(1+p)σ² | i.i.d. 2p/(1−p²)σ² | from history | "
        "measured/paper | measured/i.i.d. | max age (S) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in results["drift"]:
        ratio = "–" if d["measured_over_paper"] is None else f"{d['measured_over_paper']:.2f}"
        ratio_iid = "–" if d["measured_over_iid"] is None else f"{d['measured_over_iid']:.2f}"
        lines.append(
            f"| {d['p']:.2f} | {d['p_effective']:.3f} | {d['measured']:.3e} | {d['sigma2']:.3e} | "
            f"{d['paper']:.3e} | {d['iid']:.3e} | {d['predicted_from_history']:.3e} | {ratio} | "
            f"{ratio_iid} | {d['max_stale_age']} ({d['stale_bound']}) |"
        )
    lines += ["", f"Wall time: {results['wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    runs = results["runs"]
    methods = ["renorm", *results["baselines"]]
    drops = sorted({r["drop"] for r in runs})
    colors = {d: plt.cm.viridis(i / max(1, len(drops) - 1)) for i, d in enumerate(drops)}
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 4), sharey=True, squeeze=False)
    for ax, method in zip(axes[0], methods, strict=True):
        for d in drops:
            curves = [r["curve"] for r in runs if r["drop"] == d and (r["method"] == method or d == 0)]
            if not curves:
                continue
            curve = np.mean(curves, axis=0)
            width = max(1, len(curve) // 30)
            smooth = np.convolve(curve, np.ones(width) / width, mode="valid")
            ax.plot(np.arange(len(smooth)) + width - 1, smooth, color=colors[d], label=f"{100 * d:.0f}%")
        ax.set_yscale("log")
        ax.set_title(f"{method}: train loss")
        ax.set_xlabel("step")
        ax.legend(title="drop")
    axes[0][0].set_ylabel("train loss (log)")
    fig.tight_layout()
    curves_png = out / "loss_curves.png"
    fig.savefig(curves_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    drift = [d for d in results["drift"] if d["sigma2"] > 0]
    grid = np.linspace(0, max([d["p"] for d in drift], default=0.4) or 0.4, 50)
    ax.plot(grid, 2 * grid / (1 + grid), label="paper 2p/(1+p)")
    ax.plot(grid, 2 * grid / (1 - grid**2), label="i.i.d. 2p/(1−p²)")
    ax.plot(grid, 2 * grid / (1 - grid) ** 2, ":", color="gray", label="identical updates 2p/(1−p)²")
    ps = [d["p"] for d in drift]
    bound = results["config"]["train"]["stale_bound"]
    ax.plot(ps, [d["measured_over_sigma2"] for d in drift], "o", label=f"measured in training (S={bound})")
    ax.plot(ps, [d["predicted_from_history"] / d["sigma2"] for d in drift], "x", label="from owners' history")
    ax.set_xlabel("param drop rate p")
    ax.set_ylabel("E[D²] / σ²")
    ax.set_title("drift between receivers")
    ax.legend()
    fig.tight_layout()
    drift_png = out / "drift.png"
    fig.savefig(drift_png, dpi=110)
    plt.close(fig)
    return [curves_png, drift_png]


def write(results: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(markdown_table(results))
    return [out / "results.json", out / "table.md", *plot(results, out)]
