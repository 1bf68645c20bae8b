"""``lta train`` outputs: results.json, Markdown tables and PNG plots.

Relative changes are paired: each run is compared with the 0% run of the same seed (same initial weights,
same batches). A row gives the mean of that change over seeds and the half-width of its 95% Student t
interval, t(0.975, n-1) * sd / sqrt(n) with the sample standard deviation (null with one seed), and,
because the change is heavy-tailed (a seed that leaves the loss plateau late), its median with a
distribution-free 95% interval (order statistics: :func:`median_interval`, null below 6 seeds).

results.json (schema ``lta.train/2``, since issue K: ``rows`` holds every method and mechanism,
``baselines`` is gone; from here on keys are added, never renamed or removed) leads with the header of
every ``--json`` document (:mod:`lta.jsonout`): ``schema``, ``lta_version``, ``torch_version``; then

- ``rows``: one per (method, mechanism, drop rate), in the order of ``experiment.METHODS``, then
  ``experiment.MECHANISMS``, then drop. The 0% run (renorm, no mechanism: nothing is lost, so one run
  serves everyone) is every group's reference row, change 0. Keys: ``ROW_KEYS``. Metrics are means over
  seeds; ``grad_loss_seen``/``param_loss_seen`` are the loss the workers saw (:func:`loss_seen`), mean
  over seeds; ``timer_flushes`` sums the transports' ``flushes_on_timer`` (FLUSHes sent before every
  worker had provably passed the unit) over workers and seeds; ``resend_requests`` sums the workers'
  reliable parameter resends (copies older than S) and averages over seeds, ``resend_requests_per_step``
  divides each run's sum by its steps first. A statistic no run of the row recorded is null (simulated
  workers have no transport, so no timer flushes).
- ``drift``: one per (mechanism, param drop rate) of the renorm runs: receiver-pair drift against the
  paper's and the i.i.d. formulas, the oldest stale copy seen and whether the exchange's guarantee
  (no copy older than S+1) held.
- ``runs``: every run's curves, drift snapshots and worker statistics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from hostlib.torch_ext.drift import iid_drift, paper_drift, perfectly_correlated_drift
from lta.train.experiment import MECHANISMS, METHODS
from lta.train.sweep import RunResult

METRICS = (
    ("train_loss", "Train Loss"),
    ("train_ppl", "Train PPL"),
    ("val_loss", "Val Loss"),
    ("val_ppl", "Val PPL"),
)
ROW_KEYS = (
    "drop",
    "method",
    "mechanism",
    *(m for m, _ in METRICS),
    *(f"{m}_change_pct" for m, _ in METRICS),
    *(f"{m}_change_ci95" for m, _ in METRICS),
    *(f"{m}_change_median" for m, _ in METRICS),
    *(f"{m}_change_median_ci95" for m, _ in METRICS),
    "grad_loss_seen",
    "param_loss_seen",
    "seeds",
    "wall_s",
    "timer_flushes",
    "resend_requests",
    "resend_requests_per_step",
)
# Why measured drift lies above the paper's formula, said where the numbers are (table.md, drift.png).
DRIFT_NOTE = (
    "Measured drift can lie well above the paper's 2p/(1+p)σ² "
    "without a bug: the paper's proof lets a stale copy lag one step only, i.i.d. updates give "
    "2p/(1−p²)σ², and AdamW's updates are correlated from step to step, so a copy that missed k "
    "broadcasts lags about k updates: up to 2p/(1−p)²σ² for identical updates. The staleness bound S "
    'caps the lag. "from history" is the drift that the owners\' own update history predicts.'
)
DRIFT_CAPTION = (
    "The paper's line assumes a copy lags one step. AdamW's updates are correlated, so a copy that missed k\n"
    "broadcasts lags ~k updates (up to 2p/(1−p)², dotted): measured may lie above the paper's line.\n"
    "x: the drift that the owners' own update history predicts."
)
LOSS_MODELS = {"bernoulli": "Bernoulli loss", "ge": "Gilbert-Elliott bursty loss"}


def t_quantile_975(df: int) -> float:
    """Student t's 97.5% quantile with ``df`` (>= 1) degrees of freedom (scipy)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    from scipy.stats import t  # imported here: only a report with several seeds needs it

    return float(t.ppf(0.975, df))


def ci95_half_width(values: list[float]) -> float | None:
    """Half-width of the 95% t interval of the mean of ``values``; None for fewer than two."""
    n = len(values)
    if n < 2:
        return None
    return t_quantile_975(n - 1) * float(np.std(values, ddof=1)) / math.sqrt(n)


def median_interval(values: list[float]) -> list[float] | None:
    """Distribution-free 95% interval of the median: the order statistics x_(j) and x_(n+1−j) with the
    largest j such that P(Binomial(n, ½) < j) ≤ 2.5% (coverage ≥ 95% for any continuous distribution,
    heavy tails included); None for fewer than 6 values, where no such j exists."""
    n = len(values)
    if n < 6:
        return None
    from scipy.stats import binom

    j = int(binom.ppf(0.025, n, 0.5))  # smallest j with P(X <= j) >= 2.5%: P(X < j) <= 2.5%
    while j > 0 and binom.cdf(j - 1, n, 0.5) > 0.025:
        j -= 1
    if j < 1:
        return None
    ordered = sorted(values)
    return [float(ordered[j - 1]), float(ordered[n - j])]


def _metrics(run: RunResult) -> dict[str, float]:
    return {
        "train_loss": run.train_loss,
        "train_ppl": math.exp(run.train_loss),
        "val_loss": run.val_loss,
        "val_ppl": math.exp(run.val_loss),
    }


def _stats(run: RunResult) -> list[dict[str, Any]]:
    return [w.get("stats", {}) for w in run.workers]


def loss_seen(run: RunResult) -> dict[str, float | None]:
    """The loss the workers actually saw (emulated drops plus anything late): gradient contributions
    missing from the owners' chunks, and foreign parameter chunks not fresh at the end of a step.
    None where the workers did not record it."""
    stats = _stats(run)
    n = len(stats)
    chunks = sum(s.get("grad_chunks", 0) for s in stats)
    got = sum(s.get("grad_contributions", 0) for s in stats)
    recorded = [s for s in stats if "grad_chunks" in s]
    fresh = [s["exchange"]["fresh_fraction"] for s in stats if "fresh_fraction" in s.get("exchange", {})]
    grad: float | None = None
    if recorded:
        grad = 1.0 - got / (n * chunks) if chunks else 0.0
    return {"grad_loss_seen": grad, "param_loss_seen": float(1.0 - np.mean(fresh)) if fresh else None}


def timer_flushes(run: RunResult) -> int | None:
    """FLUSHes the run's workers sent on a timer (before every worker had passed the unit), summed; None
    when no worker's transport statistics carry the counter (simulated workers have no transport)."""
    transports = [w["transport"] for w in run.workers if "flushes_on_timer" in w.get("transport", {})]
    return sum(int(t["flushes_on_timer"]) for t in transports) if transports else None


def resend_requests(run: RunResult) -> int | None:
    """Parameter copies the run's workers asked for reliably (older than S), summed over workers."""
    counts = [
        s["exchange"]["resend_requests"] for s in _stats(run) if "resend_requests" in s.get("exchange", {})
    ]
    return int(sum(counts)) if counts else None


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def _group_row(
    method: str, mechanism: str, drop: float, runs: list[RunResult], reference: dict[int, RunResult]
) -> dict[str, Any]:
    values = [_metrics(r) for r in runs]
    refs = [_metrics(reference[r.spec.seed]) for r in runs]
    row: dict[str, Any] = {"drop": drop, "method": method, "mechanism": mechanism}
    for name, _ in METRICS:
        row[name] = float(np.mean([v[name] for v in values]))
    for name, _ in METRICS:
        changes = [100.0 * (v[name] / ref[name] - 1.0) for v, ref in zip(values, refs, strict=True)]
        row[f"{name}_change_pct"] = float(np.mean(changes))
        row[f"{name}_change_ci95"] = ci95_half_width(changes)
        row[f"{name}_change_median"] = float(np.median(changes))
        row[f"{name}_change_median_ci95"] = median_interval(changes)
    seen = [loss_seen(r) for r in runs]
    for name in ("grad_loss_seen", "param_loss_seen"):
        row[name] = _mean([s[name] for s in seen])
    row["seeds"] = [r.spec.seed for r in runs]
    row["wall_s"] = float(sum(r.wall_s for r in runs))
    flushes = [f for f in (timer_flushes(r) for r in runs) if f is not None]
    row["timer_flushes"] = sum(flushes) if flushes else None
    resends = [resend_requests(r) for r in runs]
    row["resend_requests"] = _mean(list(resends))
    row["resend_requests_per_step"] = _mean(
        [None if n is None else n / max(1, len(r.curve)) for n, r in zip(resends, runs, strict=True)]
    )
    return row


def _order(method: str, mechanism: str) -> tuple[int, int, str, str]:
    methods, mechanisms = list(METHODS), list(MECHANISMS)
    return (
        methods.index(method) if method in methods else len(methods),
        mechanisms.index(mechanism) if mechanism in mechanisms else len(mechanisms),
        method,
        mechanism,
    )


def result_rows(runs: list[RunResult]) -> list[dict[str, Any]]:
    """Every (method, mechanism, drop) row: means over seeds, paired changes vs 0% with their 95% CI.

    The 0% run of a seed is the reference of every run of that seed, and each (method, mechanism) group
    opens with it as its 0% row (change 0)."""
    reference: dict[int, RunResult] = {}
    for run in runs:
        if run.spec.drop == 0:
            reference.setdefault(run.spec.seed, run)
    groups: dict[tuple[str, str], dict[float, list[RunResult]]] = {}
    for run in runs:
        if run.spec.drop > 0:
            groups.setdefault((run.spec.method, run.spec.mechanism), {}).setdefault(run.spec.drop, []).append(
                run
            )
    lossless = list(reference.values())
    if lossless:
        groups.setdefault(("renorm", "none"), {})
    rows = []
    for method, mechanism in sorted(groups, key=lambda g: _order(*g)):
        by_drop = groups[(method, mechanism)]
        if lossless:
            rows.append(_group_row(method, mechanism, 0.0, lossless, reference))
        for drop in sorted(by_drop):
            rows.append(_group_row(method, mechanism, drop, by_drop[drop], reference))
    return rows


def drift_rows(runs: list[RunResult], stale_bound: int) -> list[dict[str, Any]]:
    """Measured receiver-pair drift vs theory per (mechanism, param drop rate), over the second half of
    training; ``stale_bound`` is S where the workers did not report theirs."""
    groups: dict[tuple[str, float], list[RunResult]] = {}
    for run in runs:
        groups.setdefault((run.spec.mechanism, run.spec.drop), []).append(run)
    rows = []
    for mechanism, p in sorted(groups, key=lambda g: (_order("renorm", g[0]), g[1])):
        group = groups[(mechanism, p)]
        measured, sigma2, predicted = [], [], []
        for run in group:
            half = max(run.drift_steps, default=0) / 2
            keep = [i for i, s in enumerate(run.drift_steps) if s >= half]
            measured += [run.drift_measured[i] for i in keep]
            sigma2 += [run.drift_sigma2[i] for i in keep]
            predicted += [run.drift_predicted[i] for i in keep]
        if not measured:
            continue
        m, s2, pred = float(np.mean(measured)), float(np.mean(sigma2)), float(np.mean(predicted))
        stats = [s for r in group for s in _stats(r)]
        fresh = [s["exchange"]["fresh_fraction"] for s in stats if "fresh_fraction" in s.get("exchange", {})]
        ages = [s["stale"]["max_age_seen"] for s in stats if "max_age_seen" in s.get("stale", {})]
        bounds = [s["stale"]["bound"] for s in stats if "bound" in s.get("stale", {})]
        bound = int(max(bounds)) if bounds else stale_bound
        resends = [n for n in (resend_requests(r) for r in group) if n is not None]
        max_age = int(max(ages)) if ages else None
        rows.append(
            {
                "p": p,
                "mechanism": mechanism,
                "p_effective": float(1.0 - np.mean(fresh)) if fresh else None,
                "measured": m,
                "sigma2": s2,
                "measured_over_sigma2": m / s2 if s2 else 0.0,
                "paper": paper_drift(p, s2),
                "iid": iid_drift(p, s2),
                "perfectly_correlated": perfectly_correlated_drift(p, s2) if p < 1 else None,
                "predicted_from_history": pred,
                "measured_over_paper": m / paper_drift(p, s2) if p and s2 else None,
                "measured_over_iid": m / iid_drift(p, s2) if p and s2 else None,
                "max_stale_age": max_age,
                "stale_bound": bound,
                # the exchange's guarantee (hostlib/torch_ext/exchange.py): no copy older than S+1
                "stale_bound_holds": None if max_age is None else max_age <= bound + 1,
                "resend_requests": int(sum(resends)) if resends else None,
                "snapshots": len(measured),
            }
        )
    return rows


def build_results(runs: list[RunResult], config: dict[str, Any], wall_s: float) -> dict[str, Any]:
    renorm_runs = [r for r in runs if r.spec.method == "renorm"]
    return {
        "config": config,
        "rows": result_rows(runs),
        "drift": drift_rows(renorm_runs, config["train"]["stale_bound"]),
        "runs": [
            {
                "name": r.spec.name,
                "method": r.spec.method,
                "mechanism": r.spec.mechanism,
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


def group_label(method: str, mechanism: str) -> str:
    """``renorm``, ``renorm+feedback``, ``prev``: the name of a (method, mechanism) group."""
    return method if mechanism == "none" else f"{method}+{mechanism}"


def _change(row: dict[str, Any], name: str) -> str:
    ci = row[f"{name}_change_ci95"]
    pm = "" if ci is None else f" ± {ci:.2f}"
    return f"{row[f'{name}_change_pct']:+.2f}{pm}%"


def _cell(row: dict[str, Any], name: str) -> str:
    value = f"{row[name]:.3f}"
    return value if row["drop"] == 0 else f"{value} ({_change(row, name)})"


def _num(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def title(config: dict[str, Any]) -> str:
    workers = config["workers"]
    who = f"{workers} simulated workers" if config.get("simulated") else f"{workers} worker processes"
    loss = config.get("loss_model", "bernoulli")
    return (
        f"lta train: char GPT on pydoc topics, {who}, {LOSS_MODELS.get(loss, loss)}, "
        f"{config['train']['steps']} steps, seeds {config['seeds']}"
    )


def markdown_table(results: dict[str, Any]) -> str:
    cfg = results["config"]
    all_rows = results["rows"]
    rows = [r for r in all_rows if r["method"] == "renorm" and r["mechanism"] == "none"]
    n_seeds = len(cfg["seeds"])
    spread = "mean over seeds ± half-width of the 95% t interval" if n_seeds > 1 else "one seed: no interval"
    lines = [
        f"# {title(cfg)}",
        "",
        f"Loss on {', '.join(cfg['directions'])} at each drop rate; renormalized aggregation (ours), "
        f"stale bound S={cfg['train']['stale_bound']}. Entries: value (paired change vs 0%: {spread}).",
        "",
        "| Metric | " + " | ".join(f"{100 * r['drop']:.0f}%" for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for name, label in METRICS:
        lines.append(f"| {label} | " + " | ".join(_cell(r, name) for r in rows) + " |")
    groups: dict[tuple[str, str], dict[float, dict[str, Any]]] = {}
    for r in all_rows:
        groups.setdefault((r["method"], r["mechanism"]), {})[r["drop"]] = r
    drops = sorted({r["drop"] for r in all_rows if r["drop"] > 0})
    lines += [
        "",
        "## Every method and mechanism: Val PPL change vs 0% (mean"
        + (" ± 95% CI" if n_seeds > 1 else "")
        + ")",
        "",
        "| Method | " + " | ".join(f"{100 * d:.0f}%" for d in drops) + " |",
        "|---|" + "---|" * len(drops),
    ]
    for (method, mechanism), by_drop in groups.items():
        cells = [_change(by_drop[d], "val_ppl") if d in by_drop else "" for d in drops]
        lines.append(f"| {group_label(method, mechanism)} | " + " | ".join(cells) + " |")
    if n_seeds >= 6:  # the tail can be heavy: the median and its distribution-free interval beside
        lines += [
            "",
            "## Val PPL change vs 0%: mean [95% t interval] and median [95% order-statistic interval]",
            "",
            "| Method | drop | seeds | mean | 95% t interval | median | 95% median interval |",
            "|---|---|---|---|---|---|---|",
        ]
        for (method, mechanism), by_drop in groups.items():
            for d in drops:
                if d not in by_drop:
                    continue
                r = by_drop[d]
                mean, ci = r["val_ppl_change_pct"], r["val_ppl_change_ci95"]
                t_int = "–" if ci is None else f"[{mean - ci:+.2f}, {mean + ci:+.2f}]"
                robust = r["val_ppl_change_median_ci95"]
                m_int = "–" if robust is None else f"[{robust[0]:+.2f}, {robust[1]:+.2f}]"
                lines.append(
                    f"| {group_label(method, mechanism)} | {100 * d:.0f}% | {len(r['seeds'])} | {mean:+.2f} "
                    f"| {t_int} | {r['val_ppl_change_median']:+.2f} | {m_int} |"
                )
    lines += [
        "",
        "Loss the workers saw, timer flushes (FLUSHes sent before every worker had passed the unit, summed "
        "over workers and seeds) and reliable parameter resends per step (mean over seeds):",
        "",
        "| Method | drop | Val PPL | grad loss seen | param loss seen | timer flushes | resends / step |",
        "|---|---|---|---|---|---|---|",
    ]
    lossless_shown = False
    for (method, mechanism), by_drop in groups.items():
        for d in sorted(by_drop):
            if d == 0 and lossless_shown:
                continue  # the same 0% runs open every group: once is enough
            lossless_shown |= d == 0
            r = by_drop[d]
            flushes = "–" if r["timer_flushes"] is None else str(r["timer_flushes"])
            lines.append(
                f"| {group_label(method, mechanism)} | {100 * d:.0f}% | {_cell(r, 'val_ppl')} | "
                f"{_num(r['grad_loss_seen'], '.3f')} | {_num(r['param_loss_seen'], '.3f')} | {flushes} | "
                f"{_num(r['resend_requests_per_step'], '.2f')} |"
            )
    lines += [
        "",
        "## Parameter drift between receivers (renorm, second half of training)",
        "",
        "| mechanism | p | p effective | measured E[D²] | σ² | paper 2p/(1+p)σ² | i.i.d. 2p/(1−p²)σ² | "
        "from history | measured/paper | measured/i.i.d. | max age (S) | age ≤ S+1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in results["drift"]:
        holds = {True: "yes", False: "**no**", None: "–"}[d["stale_bound_holds"]]
        age = "–" if d["max_stale_age"] is None else str(d["max_stale_age"])
        lines.append(
            f"| {d['mechanism']} | {d['p']:.2f} | {_num(d['p_effective'], '.3f')} | {d['measured']:.3e} | "
            f"{d['sigma2']:.3e} | {d['paper']:.3e} | {d['iid']:.3e} | {d['predicted_from_history']:.3e} | "
            f"{_num(d['measured_over_paper'], '.2f')} | {_num(d['measured_over_iid'], '.2f')} | "
            f"{age} ({d['stale_bound']}) | {holds} |"
        )
    lines += ["", DRIFT_NOTE, "", f"Wall time: {results['wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    runs = results["runs"]
    groups = list(dict.fromkeys((r["method"], r["mechanism"]) for r in results["rows"]))
    drops = sorted({r["drop"] for r in runs})
    colors = {d: plt.cm.viridis(i / max(1, len(drops) - 1)) for i, d in enumerate(drops)}
    cols = min(3, len(groups))
    lines_n = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(lines_n, cols, figsize=(5 * cols, 4 * lines_n), sharey=True, squeeze=False)
    for ax, (method, mechanism) in zip(axes.flat, groups, strict=False):
        for d in drops:
            curves = [
                r["curve"]
                for r in runs
                if r["drop"] == d
                and (d == 0 or (r["method"], r.get("mechanism", "none")) == (method, mechanism))
            ]
            if not curves:
                continue
            curve = np.mean(curves, axis=0)
            width = max(1, len(curve) // 30)
            smooth = np.convolve(curve, np.ones(width) / width, mode="valid")
            ax.plot(np.arange(len(smooth)) + width - 1, smooth, color=colors[d], label=f"{100 * d:.0f}%")
        ax.set_yscale("log")
        ax.set_title(f"{group_label(method, mechanism)}: train loss")
        ax.set_xlabel("step")
        ax.legend(title="drop")
    for ax in list(axes.flat)[len(groups) :]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("train loss (log)")
    fig.tight_layout()
    curves_png = out / "loss_curves.png"
    fig.savefig(curves_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.6))
    drift = [d for d in results["drift"] if d["sigma2"] > 0]
    grid = np.linspace(0, max([d["p"] for d in drift], default=0.4) or 0.4, 50)
    ax.plot(grid, 2 * grid / (1 + grid), label="paper 2p/(1+p)")
    ax.plot(grid, 2 * grid / (1 - grid**2), label="i.i.d. 2p/(1−p²)")
    ax.plot(grid, 2 * grid / (1 - grid) ** 2, ":", color="gray", label="identical updates 2p/(1−p)²")
    for i, mechanism in enumerate(dict.fromkeys(d["mechanism"] for d in drift)):
        mine = [d for d in drift if d["mechanism"] == mechanism]
        ps, color = [d["p"] for d in mine], plt.cm.tab10(3 + i)  # 0-2: the formulas' colors
        label = f"{group_label('renorm', mechanism)} (S={mine[0]['stale_bound']})"
        ax.plot(ps, [d["measured_over_sigma2"] for d in mine], "o", color=color, label=f"measured, {label}")
        history = [d["predicted_from_history"] / d["sigma2"] for d in mine]
        ax.plot(ps, history, "x", color=color, label=f"from owners' history, {label}")
    ax.set_xlabel("param drop rate p")
    ax.set_ylabel("E[D²] / σ²")
    ax.set_title("drift between receivers")
    ax.legend(fontsize="small")
    fig.text(0.01, 0.01, DRIFT_CAPTION, fontsize="x-small", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    drift_png = out / "drift.png"
    fig.savefig(drift_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, mechanism in groups:
        mine = [r for r in results["rows"] if (r["method"], r["mechanism"]) == (method, mechanism)]
        x = [100 * r["drop"] for r in mine]
        y = [r["val_ppl_change_pct"] for r in mine]
        ci = [r["val_ppl_change_ci95"] for r in mine]
        err = None if any(c is None for c in ci) else ci
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=group_label(method, mechanism))
    ax.axhline(0.0, color="gray", lw=0.8)
    seeds = len(results["config"]["seeds"])
    ax.set_xlabel("drop rate (%)")
    ax.set_ylabel("Δ val PPL vs 0% (%)")
    ax.set_title("val PPL change" + (f", 95% CI over {seeds} seeds" if seeds > 1 else ", one seed"))
    ax.legend(fontsize="small")
    fig.tight_layout()
    change_png = out / "val_ppl_change.png"
    fig.savefig(change_png, dpi=110)
    plt.close(fig)
    return [curves_png, drift_png, change_png]


def write(results: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(markdown_table(results))
    return [out / "results.json", out / "table.md", *plot(results, out)]
