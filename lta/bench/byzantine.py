"""``lta bench byzantine``: robust aggregation rules against sign-flipping workers, with and without loss.

Each case trains the small teacher problem of :mod:`lta.bench.ps_train` (by default 16 inputs, 32 hidden
units, 4 classes: 676 parameters) through the parameter server in sync mode (a window of all workers, a
rule over the contributions that arrived) for a fixed number of steps, the learning rate sent with each
push decaying linearly to 0 (``--lr-decay``) so that every run ends converged, with some workers
sending their gradient times ``-attack_scale`` (sign flip x10 by default), at each packet-loss rate
(Bernoulli on PUSH and PARAM). The clean run is ``mean`` without an attacker, at
the same worker count and loss. Per case, over seeds: the final evaluation loss (mean, std, range),
the difference to the clean run, and whether it lies within the clean run's seed spread (2 standard
deviations over seeds); ``mean`` under attack is judged diverged (final loss above the initial one)
or stalled (less than half of the clean run's improvement kept).

By default the rule is asked to tolerate exactly the attackers (``f`` = their count). Where that many
contributions cannot support it (Krum needs ``n >= 2f + 3``, Bulyan ``n >= 4f + 3``) the server falls
back to the coordinate-wise median and counts it: ``fallback_share`` says on what share of the rule's
applications that happened, so a row whose rule never ran says so. ``--f auto`` lets every rule take
the ``f`` its arrived count supports instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hostlib import argtypes
from hostlib.ps import robust
from lta.bench.flags import (
    add_sync_training,
    bench_command,
)
from lta.bench.ps_train import (
    TrainSpec,
    add_common_args,
    make_problem,
    run_trainer_bench,
    run_training,
    seed_summary,
)
from lta.bench.summary import mean_std_cells, report

SCHEMA = "lta.bench.byzantine/1"
SPREAD_SIGMAS = 2.0  # "within the seed spread": |rule mean - clean mean| <= this many clean stds


def _attack(text: str) -> tuple[int, int]:
    """``"1of4"`` -> (1 attacker, 4 workers)."""
    bad, sep, total = text.partition("of")
    if not sep or not bad.isdigit() or not total.isdigit():
        raise argparse.ArgumentTypeError(f"an attack is ByzantineOfWorkers like 1of4, got {text!r}")
    b, n = int(bad), int(total)
    if not 1 <= b < n <= 64:
        raise argparse.ArgumentTypeError(f"attack {text!r}: need 1 <= attackers < workers <= 64")
    return b, n


def _rule(text: str) -> str:
    if text not in robust.RULES:
        raise argparse.ArgumentTypeError(f"unknown rule {text!r}; choose from {', '.join(robust.RULES)}")
    return text


def _trim_ratio(byzantine: int, workers: int) -> float:
    """The smallest trim ratio that cuts ``byzantine`` values on each side of ``workers``."""
    return byzantine / workers


def bench_byzantine(
    args: argparse.Namespace, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    say = progress or (lambda text: None)
    problem = make_problem(d_in=args.d_in, hidden=args.hidden, classes=args.classes)
    seeds = list(range(args.seeds))
    base: dict[str, Any] = dict(
        mode="sync",
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        lr_decay=args.lr_decay,
        momentum=args.momentum,
        elems_per_packet=args.elems_per_packet,
        attack_scale=args.attack_scale,
        trainer=args.trainer,
    )
    clean: dict[tuple[int, float], dict[str, Any]] = {}
    rows = []
    for byzantine, workers in args.attacks:
        for loss in args.losses:
            key = (workers, loss)
            if key not in clean:
                say(f"clean: mean, {workers} workers, loss {loss:g}")
                runs = [
                    run_training(TrainSpec(workers=workers, loss=loss, seed=s, rule="mean", **base), problem)
                    for s in seeds
                ]
                clean[key] = {
                    "workers": workers,
                    "loss": loss,
                    "final_loss": seed_summary([r["final_loss"] for r in runs]),
                    "initial_loss": float(np.mean([r["initial_loss"] for r in runs])),
                    "seconds": float(np.sum([r["wall_s"] for r in runs])),
                }
            ref = clean[key]
            for rule in args.rules:
                say(f"{rule}: {byzantine} of {workers} sign-flipped x{args.attack_scale:g}, loss {loss:g}")
                f = None if args.f == "auto" else (byzantine if rule != "mean" else 0)
                trim = _trim_ratio(byzantine, workers)
                runs = [
                    run_training(
                        TrainSpec(
                            workers=workers,
                            loss=loss,
                            seed=s,
                            rule=rule,
                            f=f,
                            trim_ratio=trim,
                            byzantine=byzantine,
                            **base,
                        ),
                        problem,
                    )
                    for s in seeds
                ]
                rows.append(_row(rule, byzantine, workers, loss, f, trim, runs, ref))
    return {
        "config": {
            "rules": args.rules,
            "attacks": [f"{b}of{n}" for b, n in args.attacks],
            "losses": args.losses,
            "seeds": args.seeds,
            "steps": args.steps,
            "batch": args.batch,
            "lr": args.lr,
            "lr_decay": args.lr_decay,
            "momentum": args.momentum,
            "attack_scale": args.attack_scale,
            "f": args.f,
            "elems_per_packet": args.elems_per_packet,
            "trainer": args.trainer,
            "spread": f"{SPREAD_SIGMAS:g} x clean std over seeds",
        },
        "problem": {
            "d_in": args.d_in,
            "hidden": args.hidden,
            "classes": args.classes,
            "n_params": problem.n_params,
        },
        "clean": list(clean.values()),
        "rows": rows,
    }


def _row(
    rule: str,
    byzantine: int,
    workers: int,
    loss: float,
    f: int | None,
    trim: float,
    runs: list[dict[str, Any]],
    ref: dict[str, Any],
) -> dict[str, Any]:
    final = seed_summary([r["final_loss"] for r in runs])
    clean = ref["final_loss"]
    groups = sum(r["rule_groups"] for r in runs)
    fallbacks = sum(r["rule_fallbacks"] for r in runs)
    refusals = sum(r["rule_refusals"] for r in runs)
    f_asked = byzantine if f is None else f
    try:
        needs = robust.min_count(rule, f_asked, trim)
    except ValueError:  # mean tolerates nobody
        needs = None
    row: dict[str, Any] = {
        "rule": rule,
        "attack": f"{byzantine}of{workers}",
        "workers": workers,
        "byzantine": byzantine,
        "loss": loss,
        "f": f,
        "trim_ratio": trim if rule == "trimmed_mean" else None,
        "min_count_for_attackers": needs,
        "final_loss": final,
        "clean_loss": clean,
        "initial_loss": ref["initial_loss"],
        "fallback_share": fallbacks / groups if groups else 0.0,
        "refusal_share": refusals / groups if groups else 0.0,
        "seconds": float(np.sum([r["wall_s"] for r in runs])),
    }
    if final["mean"] is None or clean["mean"] is None:
        row.update(delta=None, within_spread=False, outcome="diverged")
        return row
    delta = final["mean"] - clean["mean"]
    spread = SPREAD_SIGMAS * clean["std"]
    improvement = ref["initial_loss"] - clean["mean"]
    if final["mean"] >= ref["initial_loss"]:
        outcome = "diverged"
    elif delta > 0.5 * improvement:
        outcome = "stalled"
    elif abs(delta) <= spread:
        outcome = "within_spread"
    else:
        outcome = "worse" if delta > 0 else "better"
    paired = np.array(final["values"]) - np.array(clean["values"])
    row.update(
        delta=delta,
        spread=spread,
        paired_delta_mean=float(paired.mean()),
        paired_delta_std=float(paired.std(ddof=1)) if len(paired) > 1 else 0.0,
        within_spread=abs(delta) <= spread,
        outcome=outcome,
    )
    return row


def register(sub: argparse._SubParsersAction) -> None:
    b = bench_command(
        sub,
        "byzantine",
        _run,
        help="robust rules (trimmed mean, median, Krum, Bulyan) against sign-flipping workers, with loss",
        description="Robust aggregation rules of the parameter server against Byzantine workers that send "
        "sign-flipped, scaled gradients, with and without packet loss: final loss per rule, attack and "
        "loss rate over seeds, against the clean run (mean, no attacker).",
    )
    b.add_argument(
        "--rules", type=argtypes.csv_of(_rule, "rules"), default=list(robust.RULES), help="rules to run"
    )
    b.add_argument(
        "--attacks",
        type=argtypes.csv_of(_attack, "attacks"),
        default=[(1, 4), (2, 7)],
        help="attackers of workers, e.g. 1of4,2of7",
    )
    add_sync_training(b, steps=200, lr=0.1, each="rule", losses=[0.0, 0.1])
    b.add_argument(
        "--attack-scale", type=argtypes.positive_float, default=10.0, help="attackers send -scale x g"
    )
    b.add_argument(
        "--f",
        choices=("attackers", "auto"),
        default="attackers",
        help="f the rules tolerate: the attackers' count, or what each arrived count supports",
    )
    add_common_args(b, d_in=16, hidden=32, classes=4)


def _run(args: argparse.Namespace) -> int:
    cases = len(args.attacks) * len(args.losses) * (len(args.rules) + 1)
    title = f"lta bench byzantine: {cases} cases x {args.seeds} seeds, {args.steps} steps each"
    out = run_trainer_bench(args, title, bench_byzantine)

    def table() -> Iterator[str]:
        yield (
            f"{'rule':13s} {'attack':7s} {'loss':>5s} {'final':>8s} {'std':>7s} {'clean':>8s} {'delta':>8s} "
            f"{'fallback':>8s}  outcome"
        )
        for r in out["rows"]:
            fl, cl = r["final_loss"], r["clean_loss"]
            mean, std = mean_std_cells(fl)
            delta = "" if r["delta"] is None else f"{r['delta']:+.4f}"
            yield (
                f"{r['rule']:13s} {r['attack']:7s} {r['loss']:5.2f} {mean:>8s} {std:>7s} "
                f"{cl['mean'] or 0:8.4f} {delta:>8s} {r['fallback_share']:8.0%}  {r['outcome']}"
            )

    return report(args.json, SCHEMA, out, table)
