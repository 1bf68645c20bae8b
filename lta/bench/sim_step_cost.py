"""CPU time of one simulated training step, stacked gradients against the vmap reference:
``python -m lta.bench.sim_step_cost``.

Two :class:`~lta.train.simulated.SimulatedRun` of the same spec (``lta train``'s default config, N=4,
one torch thread, as each ``--jobs`` process), one computing the workers' gradients with
``gradients="stacked"`` (the default) and one with ``gradients="vmap"`` (the reference, the path before
issue R), step in blocks of ``--block`` steps, interleaved (A, B, A, B, ...) so load on a shared machine
hits both alike. Each block's ``time.process_time`` per step is one sample; the table gives the median
per mechanism and the ratio. Process CPU time, not wall time: on a loaded machine wall time says how
busy the machine was, not what a step costs.

Prints a table to stdout, or one JSON document with ``--json``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from lta.bench.flags import script_parser

PATHS = ("vmap", "stacked")


def measure(
    mechanisms: tuple[str, ...] = ("none", "retrieve", "rotate"),
    drop: float = 0.1,
    blocks: int = 5,
    block: int = 10,
    n_workers: int = 4,
) -> dict[str, Any]:
    import torch

    from lta.train.experiment import RunSpec, TrainConfig
    from lta.train.gpt import CharCorpus
    from lta.train.simulated import SimulatedRun

    torch.set_num_threads(1)
    corpus = CharCorpus()
    rows = []
    for mech in mechanisms:
        spec = RunSpec(mech, "renorm", drop, 0, 1, mech)
        runs = {g: SimulatedRun(spec, TrainConfig(), n_workers, corpus=corpus, gradients=g) for g in PATHS}
        for run in runs.values():  # warm-up: allocator, first stale copies
            for _ in range(3):
                run.step()
        ms: dict[str, list[float]] = {g: [] for g in PATHS}
        for _ in range(blocks):
            for g, run in runs.items():
                t0 = time.process_time()
                for _ in range(block):
                    run.step()
                ms[g].append(1e3 * (time.process_time() - t0) / block)
        med = {g: statistics.median(v) for g, v in ms.items()}
        rows.append(
            {
                "mechanism": mech,
                "vmap_ms": med["vmap"],
                "stacked_ms": med["stacked"],
                "ratio": med["vmap"] / med["stacked"],
                "samples": ms,
            }
        )
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return {
        "n_workers": n_workers,
        "drop": drop,
        "blocks": blocks,
        "block": block,
        "rows": rows,
        "load": load,
    }


def main(argv: list[str] | None = None) -> int:
    p = script_parser("lta.bench.sim_step_cost", __doc__)
    p.add_argument("--mechanisms", default="none,retrieve,rotate", help="comma-separated (default: 3)")
    p.add_argument("--drop", type=float, default=0.1, help="loss rate of every direction (default 0.1)")
    p.add_argument("--blocks", type=int, default=5, help="samples per path (median reported)")
    p.add_argument("--block", type=int, default=10, help="steps per sample (default 10)")
    args = p.parse_args(argv)
    if args.blocks < 1 or args.block < 1:
        p.error("--blocks and --block must be >= 1")
    r = measure(tuple(args.mechanisms.split(",")), args.drop, args.blocks, args.block)
    if args.json:
        from lta.jsonout import emit

        emit("lta.bench.sim_step_cost/1", r)
        return 0
    print(f"CPU per simulated step, N={r['n_workers']}, {r['drop']:.0%} loss, load {' '.join(r['load'])}")
    print("| mechanism | vmap (reference) | stacked | ratio |")
    print("|---|---|---|---|")
    for row in r["rows"]:
        ms = f"{row['vmap_ms']:.1f} ms | {row['stacked_ms']:.1f} ms"
        print(f"| {row['mechanism']} | {ms} | {row['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
