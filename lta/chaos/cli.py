"""``lta chaos``: seeded fault injection through every front door, with a verdict per run.

    lta chaos --seeds 0-99 --out chaos-100        # the long run: 100 seeded runs
    lta chaos --seeds 7                            # replay run 7 exactly as drawn
    lta chaos --seeds 0-99 --out chaos-100 --resume  # go on after an interruption (seeds done are kept)

Each seed draws one run (schedule.py: a front door and one to three faults); the runner starts the ranks,
injects the faults and judges (runner.py: ok / ok-after-restart / loud / hang / silent). ``--out`` gets
``chaos.json`` (every run, its faults, verdict, recoveries and restarts) and ``chaos.md`` (the tables);
stdout gets the door x fault kind table (``--json``: one JSON document, the summary); progress goes to
stderr. The exit status is 1 when any run hung or failed silently.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hostlib import argtypes
from hostlib.errors import LtaError
from hostlib.protocol import MAX_WORKERS
from lta.chaos import netns
from lta.chaos.report import markdown, rich_table, summary
from lta.chaos.runner import lighthouse_binary, run_one
from lta.chaos.schedule import FAULT_TAIL_STEPS, FIRST_FAULT_STEP, MIN_STEPS, MIN_WORLD, draw
from lta.chaos.worker import DOORS
from lta.jsonout import emit
from lta.progress import Status


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not lo.isdigit() or not hi.isdigit() or int(hi) < int(lo):
                raise argparse.ArgumentTypeError(f"expected seeds like 0-99 or 1,5,7, got {text!r}")
            out.extend(range(int(lo), int(hi) + 1))
        elif part.isdigit():
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"expected seeds like 0-99 or 1,5,7, got {text!r}")
    return out


def _doors(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(DOORS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown front door(s) {unknown}: choose among {', '.join(DOORS)}")
    return names


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("chaos", help="seeded fault injection through every front door, with verdicts")
    p.add_argument(
        "--seeds",
        type=_seeds,
        default=_seeds("0-6"),
        help="seeds: 0-99, or 1,5,7 (default 0-6: one run per door)",
    )
    p.add_argument(
        "--doors", type=_doors, default=DOORS, help=f"front doors, comma separated ({','.join(DOORS)})"
    )
    p.add_argument(
        "--workers",
        type=argtypes.int_range(MIN_WORLD, MAX_WORKERS, "--workers"),
        default=4,
        help=f"ranks per run, {MIN_WORLD}..{MAX_WORKERS} (default 4)",
    )
    p.add_argument(
        "--steps",
        type=argtypes.int_range(MIN_STEPS, what="--steps"),
        default=40,
        help=f"training steps per run, >= {MIN_STEPS}: faults land between step {FIRST_FAULT_STEP} and "
        f"{FAULT_TAIL_STEPS} steps before the end (default 40)",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=250.0,
        help="each training step takes at least this long (emulated compute, default 250): a run long "
        "enough for a killed rank started again to find its peers still training",
    )
    p.add_argument(
        "--bound",
        type=float,
        default=120.0,
        help="seconds without a step of any rank before a run is a hang (plus its SIGSTOPs)",
    )
    p.add_argument("--out", type=Path, default=Path("lta-chaos"), help="folder for chaos.json and chaos.md")
    p.add_argument("--keep", action="store_true", help="keep every run's files (logs, progress) under --out")
    p.add_argument(
        "--no-netns",
        action="store_true",
        help="draw no reorder/duplicate faults (they need root, ip, tc and nft; off by itself without them)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document on stdout")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in --out/chaos.json and run only the seeds it lacks",
    )
    p.set_defaults(func=run)


def _span(seeds: list[int]) -> str:
    if not seeds:
        return "none left"
    return f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}..{seeds[-1]}"


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise LtaError(f"cannot write {path}: {exc.strerror or exc} (choose another --out)") from None


def run(args: argparse.Namespace) -> int:
    if args.step_ms < 0:
        raise LtaError(f"--step-ms must be >= 0, got {args.step_ms:g}")
    if "torchft" in args.doors:
        lighthouse_binary()  # no torchft: say so before the first run, not at the torchft door's turn
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LtaError(f"--out {args.out}: cannot make the folder: {exc.strerror or exc}") from None
    why_not = netns.available()
    use_netns = not args.no_netns and why_not is None
    if not args.no_netns and why_not is not None:
        print(f"lta chaos: no reorder/duplicate faults drawn: {why_not}", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    done: set[int] = set()
    if args.resume and (args.out / "chaos.json").exists():
        rows = json.loads((args.out / "chaos.json").read_text())["runs"]
        done = {int(r["seed"]) for r in rows}
    todo = [seed for seed in args.seeds if seed not in done]
    # Written now too: an --out that cannot be written fails before the first run, not after it.
    _write(args.out / "chaos.json", json.dumps({"runs": rows, "summary": summary(rows)}, indent=1))
    title = f"lta chaos: {len(todo)} runs (seeds {_span(todo)}), results in {args.out}"
    with Status(title) as status:
        for i, seed in enumerate(todo):
            spec = draw(seed, args.doors, args.workers, args.steps, use_netns, args.step_ms / 1000)
            status.update(f"run {i + 1}/{len(todo)}: seed {seed}, {spec.door}, {','.join(spec.kinds)}")
            t0 = time.monotonic()
            outcome = run_one(spec, args.bound, args.out / f"run{seed}" if args.keep else None)
            rows.append(outcome.as_dict())
            # one line per run, on stderr as all progress (stdout: the summary)
            status.line(
                f"seed {seed:3d} {spec.door:16s} {','.join(spec.kinds):40s} {outcome.verdict:16s} "
                f"{time.monotonic() - t0:6.1f}s {outcome.cause}"
            )
            _write(args.out / "chaos.json", json.dumps({"runs": rows, "summary": summary(rows)}, indent=1))
            _write(args.out / "chaos.md", markdown(rows))
    counts = summary(rows)["verdicts"]
    if args.json:
        emit("lta.chaos/1", summary(rows))
    else:
        from rich.console import Console

        Console(width=max(Console().width, 150)).print(rich_table(rows))
        print(" ".join(f"{k}={v}" for k, v in counts.items()))
    return 1 if counts.get("hang", 0) or counts.get("silent", 0) else 0
