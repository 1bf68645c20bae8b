"""lta/train/report.py on hand-built RunResults (no training): paired changes vs 0% and their 95% t
intervals against numpy + scipy, one row per (method, mechanism, drop), summed transport counters, the
staleness check, the tables and the plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lta.train.experiment import RunSpec
from lta.train.report import (
    ROW_KEYS,
    build_results,
    ci95_half_width,
    markdown_table,
    median_interval,
    t_quantile_975,
    write,
)
from lta.train.sweep import RunResult

STEPS = 20
STALE_BOUND = 8


def worker(*, resends=0, max_age=0, bound=STALE_BOUND, flushes=None, fresh=1.0, contributions=40):
    """One worker's summary as the real path reports it (``transport`` only when ``flushes`` is given,
    as simulated workers have no transport)."""
    out = {
        "stats": {
            "grad_chunks": 10,
            "grad_contributions": contributions,
            "stale": {"max_age_seen": max_age, "bound": bound},
            "exchange": {"fresh_fraction": fresh, "resend_requests": resends},
        }
    }
    if flushes is not None:
        out["transport"] = {"flushes_sent": 2 * flushes, "flushes_on_timer": flushes}
    return out


def run(method, drop, seed, val, *, mechanism="none", train=None, workers=None, drift=(0.0, 1.0)):
    spec = RunSpec(f"{method}+{mechanism}-{drop}-{seed}", method, drop, seed, 1, mechanism)
    return RunResult(
        spec,
        curve=[3.0] * STEPS,
        train_loss=val + 0.1 if train is None else train,
        val_loss=val,
        wall_s=1.5,
        drift_steps=[10, 19],
        drift_measured=[drift[0], drift[0]],
        drift_sigma2=[drift[1], drift[1]],
        drift_predicted=[drift[0], drift[0]],
        workers=[worker() for _ in range(4)] if workers is None else workers,
    )


def config(seeds, *, simulated=False, loss_model="bernoulli", workers=4):
    return {
        "workers": workers,
        "simulated": simulated,
        "loss_model": loss_model,
        "directions": ["up", "param"],
        "seeds": seeds,
        "train": {"steps": STEPS, "stale_bound": STALE_BOUND},
    }


LOSSLESS = {0: 2.00, 1: 2.10, 2: 1.95}
LOSSY = {0: 2.06, 1: 2.11, 2: 2.03}  # renorm at 20%: a different change per seed


def three_seeds():
    runs = [run("renorm", 0.0, s, v) for s, v in LOSSLESS.items()]
    runs += [run("renorm", 0.2, s, v) for s, v in LOSSY.items()]
    return runs


def test_t_quantile_matches_the_printed_table():
    printed = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 10: 2.228, 30: 2.042}
    for df, value in printed.items():
        assert t_quantile_975(df) == pytest.approx(value, abs=5e-4)
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_mean_change_and_its_t_interval_are_the_hand_computation():
    results = build_results(three_seeds(), config([0, 1, 2]), 9.0)
    row = next(r for r in results["rows"] if r["drop"] == 0.2)
    for metric, value in (("val_loss", lambda v: v), ("val_ppl", math.exp)):
        changes = np.array([100 * (value(LOSSY[s]) / value(LOSSLESS[s]) - 1) for s in (0, 1, 2)])
        assert row[f"{metric}_change_pct"] == pytest.approx(changes.mean(), rel=1e-12)
        half = 4.30265 * changes.std(ddof=1) / math.sqrt(3)  # t(0.975, 2 df), from a printed table
        assert row[f"{metric}_change_ci95"] == pytest.approx(half, rel=1e-5)
    assert row["val_ppl"] == pytest.approx(np.mean([math.exp(v) for v in LOSSY.values()]), rel=1e-12)
    assert row["train_loss"] == pytest.approx(np.mean(list(LOSSY.values())) + 0.1, rel=1e-12)
    assert row["seeds"] == [0, 1, 2] and row["wall_s"] == pytest.approx(4.5)
    lossless = results["rows"][0]
    assert lossless["drop"] == 0.0 and lossless["val_ppl_change_pct"] == 0.0
    assert lossless["val_ppl_change_ci95"] == 0.0  # three seeds, each exactly itself: no spread
    assert ci95_half_width([1.0]) is None and ci95_half_width([]) is None


def test_median_and_its_order_statistic_interval_are_the_hand_computation():
    """The interval of the median is [x_(j), x_(n+1-j)] with the largest j whose binomial tail
    P(Bin(n, 1/2) < j) is at most 2.5%, computed here from math.comb; the table shows it from 6 seeds."""
    for n in (6, 10, 30, 31):
        tail = [sum(math.comb(n, i) for i in range(j)) / 2**n for j in range(n + 1)]
        j = max(j for j in range(n + 1) if tail[j] <= 0.025)
        values = list(np.random.default_rng(n).standard_normal(n))
        ordered = sorted(values)
        assert median_interval(values) == [ordered[j - 1], ordered[n - j]], n
    assert median_interval([1.0] * 5) is None
    lossless = {s: 2.0 for s in range(8)}
    lossy = {s: 2.0 + 0.01 * s + (0.5 if s == 7 else 0.0) for s in range(8)}  # one heavy-tailed seed
    runs = [run("renorm", 0.0, s, v) for s, v in lossless.items()]
    runs += [run("renorm", 0.1, s, v) for s, v in lossy.items()]
    results = build_results(runs, config(list(range(8))), 1.0)
    row = next(r for r in results["rows"] if r["drop"] == 0.1)
    changes = sorted(100 * (lossy[s] / 2.0 - 1) for s in range(8))
    assert row["val_loss_change_median"] == pytest.approx(np.median(changes))
    assert row["val_loss_change_median_ci95"] == pytest.approx([changes[0], changes[7]])  # n=8: j=1
    assert "median" in markdown_table(results)


def test_one_seed_has_no_interval():
    runs = [run("renorm", 0.0, 0, 2.0), run("renorm", 0.1, 0, 2.2)]
    results = build_results(runs, config([0]), 1.0)
    lossy = results["rows"][1]
    assert lossy["val_loss_change_pct"] == pytest.approx(10.0)
    assert all(lossy[f"{m}_change_ci95"] is None for m in ("train_loss", "train_ppl", "val_loss", "val_ppl"))
    table = markdown_table(results)
    assert "±" not in table and "one seed: no interval" in table
    assert json.loads(json.dumps(results))["rows"][1]["val_ppl_change_ci95"] is None  # null in the JSON


def test_a_row_per_method_mechanism_and_drop_each_opened_by_the_lossless_reference():
    runs = []
    for seed in (0, 1):
        runs.append(run("renorm", 0.0, seed, 2.0 + seed / 10))
        for drop in (0.1, 0.3):
            runs.append(run("prev", drop, seed, 2.5))  # listed first: the rows' order is not the runs'
            for mechanism in ("stale1", "none", "feedback"):
                runs.append(run("renorm", drop, seed, 2.1 + drop, mechanism=mechanism))
    rows = build_results(runs, config([0, 1]), 1.0)["rows"]
    got = [(r["method"], r["mechanism"], r["drop"]) for r in rows]
    groups = [("renorm", "none"), ("renorm", "feedback"), ("renorm", "stale1"), ("prev", "none")]
    assert got == [(m, mech, d) for m, mech in groups for d in (0.0, 0.1, 0.3)]
    for r in rows:
        assert set(r) == set(ROW_KEYS)
        assert r["seeds"] == [0, 1]
    for r in rows[::3]:  # every group's 0% row is the same lossless runs: change 0
        assert r["val_ppl"] == pytest.approx((math.exp(2.0) + math.exp(2.1)) / 2)
        assert r["val_ppl_change_pct"] == 0.0
    feedback = next(r for r in rows if r["mechanism"] == "feedback" and r["drop"] == 0.3)
    expected = np.mean([100 * (2.4 / v - 1) for v in (2.0, 2.1)])
    assert feedback["val_loss_change_pct"] == pytest.approx(expected, rel=1e-12)


def test_timer_flushes_and_resends_add_up_over_workers_and_seeds():
    runs = [run("renorm", 0.0, s, 2.0, workers=[worker(flushes=0) for _ in range(4)]) for s in (0, 1)]
    per_seed = {0: ([1, 0, 2, 0], [3, 3, 0, 1]), 1: ([0, 4, 0, 0], [5, 0, 0, 0])}  # flushes, resends
    for seed, (flushes, resends) in per_seed.items():
        workers = [worker(flushes=f, resends=r) for f, r in zip(flushes, resends, strict=True)]
        runs.append(run("renorm", 0.2, seed, 2.1, workers=workers))
    rows = build_results(runs, config([0, 1]), 1.0)["rows"]
    lossless, lossy = rows
    assert lossless["timer_flushes"] == 0  # recorded, and no round closed by a timer
    assert lossy["timer_flushes"] == 1 + 2 + 4
    assert lossy["resend_requests"] == pytest.approx((7 + 5) / 2)
    assert lossy["resend_requests_per_step"] == pytest.approx((7 + 5) / 2 / STEPS)


def test_statistics_the_workers_did_not_record_are_null_not_zero():
    """Simulated workers carry no transport statistics: no timer flushes to report."""
    runs = [run("renorm", 0.0, 0, 2.0), run("renorm", 0.4, 0, 2.3, workers=[worker(resends=2)] * 16)]
    results = build_results(runs, config([0], simulated=True, loss_model="ge", workers=16), 1.0)
    lossy = results["rows"][1]
    assert lossy["timer_flushes"] is None
    assert lossy["resend_requests"] == 32
    bare = run("renorm", 0.4, 0, 2.3, workers=[{} for _ in range(4)])  # no statistics at all
    row = build_results([runs[0], bare], config([0]), 1.0)["rows"][1]
    nulls = (
        "timer_flushes",
        "resend_requests",
        "resend_requests_per_step",
        "grad_loss_seen",
        "param_loss_seen",
    )
    assert all(row[k] is None for k in nulls)
    table = markdown_table(results)
    assert "16 simulated workers" in table.splitlines()[0]
    assert "Gilbert-Elliott" in table.splitlines()[0]
    assert "| renorm | 40% |" in table and "| – |" in table  # the null shown as a dash


def test_loss_seen_is_the_missing_share_of_contributions_and_fresh_copies():
    workers = [worker(contributions=c, fresh=f) for c, f in ((36, 0.9), (30, 0.7), (40, 1.0), (34, 0.8))]
    runs = [run("renorm", 0.0, 0, 2.0), run("renorm", 0.2, 0, 2.1, workers=workers)]
    row = build_results(runs, config([0]), 1.0)["rows"][1]
    assert row["grad_loss_seen"] == pytest.approx(1 - (36 + 30 + 40 + 34) / (4 * 4 * 10))
    assert row["param_loss_seen"] == pytest.approx(1 - (0.9 + 0.7 + 1.0 + 0.8) / 4)


def test_staleness_bound_is_checked_per_mechanism_against_s_plus_one():
    def aged(ages, bound):
        return [worker(max_age=a, bound=bound) for a in ages]

    runs = [
        run("renorm", 0.0, 0, 2.0),
        run("renorm", 0.3, 0, 2.1, workers=aged([4, 9, 7, 2], STALE_BOUND), drift=(0.5, 1.0)),
        run("renorm", 0.3, 0, 2.1, mechanism="stale1", workers=aged([2, 1, 2, 0], 1), drift=(0.2, 1.0)),
        run("renorm", 0.3, 0, 2.1, mechanism="stale2", workers=aged([3, 4, 1, 0], 2), drift=(0.3, 1.0)),
        run("prev", 0.3, 0, 2.4, workers=aged([30, 30, 30, 30], STALE_BOUND)),  # not a renorm run
    ]
    results = build_results(runs, config([0]), 1.0)
    drift = {(d["mechanism"], d["p"]): d for d in results["drift"]}
    assert list(drift) == [("none", 0.0), ("none", 0.3), ("stale1", 0.3), ("stale2", 0.3)]
    assert (drift["none", 0.3]["max_stale_age"], drift["none", 0.3]["stale_bound"]) == (9, 8)
    assert drift["none", 0.3]["stale_bound_holds"] is True  # 9 <= 8 + 1
    assert (drift["stale1", 0.3]["max_stale_age"], drift["stale1", 0.3]["stale_bound"]) == (2, 1)
    assert drift["stale1", 0.3]["stale_bound_holds"] is True
    assert drift["stale2", 0.3]["stale_bound_holds"] is False  # 4 > 2 + 1
    assert drift["none", 0.3]["measured"] == 0.5 and drift["none", 0.3]["paper"] == pytest.approx(
        2 * 0.3 / 1.3
    )
    table = markdown_table(results)
    assert "age ≤ S+1" in table and "| 4 (2) | **no** |" in table and "| 9 (8) | yes |" in table


def test_tables_show_the_interval_and_every_group(tmp_path):
    runs = three_seeds()
    runs += [run("renorm", 0.2, s, 2.2, mechanism="feedback") for s in (0, 1, 2)]
    runs += [run("zero", 0.2, s, 2.3) for s in (0, 1, 2)]
    results = build_results(runs, config([0, 1, 2]), 12.0)
    row = next(
        r for r in results["rows"] if (r["method"], r["mechanism"], r["drop"]) == ("renorm", "none", 0.2)
    )
    table = markdown_table(results)
    assert "4 worker processes, Bernoulli loss, 20 steps, seeds [0, 1, 2]" in table.splitlines()[0]
    cell = f"{row['val_ppl']:.3f} ({row['val_ppl_change_pct']:+.2f} ± {row['val_ppl_change_ci95']:.2f}%)"
    assert f"| Val PPL | {math.exp(2.0) / 3 + math.exp(2.1) / 3 + math.exp(1.95) / 3:.3f} | {cell} |" in table
    for label in ("renorm", "renorm+feedback", "zero"):
        assert f"\n| {label} | " in table
    written = write(results, tmp_path)
    assert [p.name for p in written] == [
        "results.json",
        "table.md",
        "loss_curves.png",
        "drift.png",
        "val_ppl_change.png",
    ]
    for p in written[2:]:
        assert p.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and p.stat().st_size > 10_000
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(results["rows"]))
    assert {r["mechanism"] for r in saved["runs"]} == {"none", "feedback"}
