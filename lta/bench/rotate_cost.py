"""What the ``rotate`` mechanism costs per reduce: ``python -m lta.bench.rotate_cost``.

Measured in one process, interleaved (A, B, A, B, ...), on the ``lta train`` model's gradient (its
default config: ~110k values, K=1024) at 10% loss:

- ``reduce``: one simulated reduce of N workers' gradients (``SimulatedRun.reduce``: exponent and data
  rounds, renormalization), with and without rotation, and the ratio;
- ``worker``: what one real worker adds to each step (``ShardedOptimizer(rotate_seed=...)``): the
  signs of the step's rotation, the forward transform of its gradient, the inverse of the result and
  the forward transform of the last result (the ``prev`` fallback), against one training step of the
  model (forward + backward of its batch) measured beside it.

Prints a table (median of ``--repeats`` timings each) to stdout, or one JSON document with ``--json``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from lta.bench.flags import add_workers, script_parser


def _median_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def measure(n_workers: int = 4, repeats: int = 20, drop: float = 0.1) -> dict[str, Any]:
    import torch

    from hostlib.emulation.rotation import Rotation
    from lta.train.experiment import RunSpec, TrainConfig
    from lta.train.gpt import CharCorpus
    from lta.train.simulated import SimulatedRun

    torch.set_num_threads(1)
    corpus = CharCorpus()
    cfg = TrainConfig()
    runs = {
        mech: SimulatedRun(RunSpec(mech, "renorm", drop, 0, 1, mech), cfg, n_workers, corpus=corpus)
        for mech in ("none", "rotate")
    }
    grads, _ = runs["none"].local_gradients()
    grads = grads.copy()
    times: dict[str, list[float]] = {"none": [], "rotate": []}
    for _ in range(repeats):  # interleaved: load on the machine hits both alike
        for mech, run in runs.items():
            times[mech] += _median_ms(lambda r=run: r.reduce(grads.copy()), 1)
            run.step_count += 1  # a new rotation every reduce, as in training
    padded = runs["none"].layout.padded
    one = grads[0].copy()
    prev = grads[1].copy()

    def worker_side() -> None:
        rotation = Rotation(padded, seed=0, step=int(time.perf_counter_ns() % 1000))
        rotation.forward(one)
        rotation.forward(prev)
        rotation.inverse(one)

    model_run = runs["none"]
    x, y = corpus.batch("train", cfg.batch, cfg.context, torch.Generator().manual_seed(0))

    def train_step() -> None:
        model_run.model.zero_grad()
        model_run.model(x, y).backward()

    worker_ms, step_ms = [], []
    for _ in range(repeats):
        worker_ms += _median_ms(worker_side, 1)
        step_ms += _median_ms(train_step, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "n_workers": n_workers,
        "values": int(model_run.numel),
        "padded": int(padded),
        "drop": drop,
        "repeats": repeats,
        "reduce_ms": med["none"],
        "reduce_rotate_ms": med["rotate"],
        "reduce_ratio": med["rotate"] / med["none"],
        "worker_rotation_ms": statistics.median(worker_ms),
        "train_step_ms": statistics.median(step_ms),
        "worker_ratio": statistics.median(worker_ms) / statistics.median(step_ms),
        "blocks": Rotation(padded, seed=0, step=0).sizes,
        "spread": float(np.std(times["rotate"]) / max(1e-9, med["rotate"])),
    }


def main(argv: list[str] | None = None) -> int:
    p = script_parser("lta.bench.rotate_cost", __doc__)
    add_workers(p, 4, "simulated workers in the reduce (default 4)", type=int)
    p.add_argument("--repeats", type=int, default=20, help="timings per figure (median reported)")
    p.add_argument("--drop", type=float, default=0.1, help="GRAD and PARAM loss rate (default 0.1)")
    args = p.parse_args(argv)
    r = measure(args.workers, args.repeats, args.drop)
    if args.json:
        from lta.jsonout import emit

        emit("lta.bench.rotate_cost/1", r)
        return 0
    print(
        f"rotate cost: {r['values']} values (padded {r['padded']}, blocks {r['blocks']}), N={r['n_workers']}"
    )
    print("| what | without rotate | with rotate | ratio |")
    print("|---|---|---|---|")
    print(
        f"| simulated reduce, N={r['n_workers']} | {r['reduce_ms']:.1f} ms | {r['reduce_rotate_ms']:.1f} ms "
        f"| {r['reduce_ratio']:.2f} |"
    )
    print(
        f"| one worker: rotation per step vs a training step | {r['train_step_ms']:.1f} ms (fwd+bwd) "
        f"| +{r['worker_rotation_ms']:.1f} ms | +{100 * r['worker_ratio']:.0f}% |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
