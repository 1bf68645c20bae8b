"""One-step oracle of issue R: what a stale parameter copy and a lost gradient contribution each do to
one step's aggregate gradient: ``python -m lta.bench.stale_bias``.

A lossless simulated run (``lta train``'s default config, N=64, one sequence per worker) trains; at each
of ``--steps`` it stops and computes the aggregate gradient (the mean of the N workers' gradients on one
batch) three ways, on the same batch: (a) every copy fresh, (b) each receiver's foreign chunks one step
old with probability p (Algorithm 1's stale copies: a copy k steps old has probability p^k, so most are
one step old), (c) every copy fresh but each (worker, chunk) contribution lost with probability p and
the rest renormalized by the count. Reported, relative to |g| (case a): the sampling noise (the
aggregate of the next batch minus this one's), each error's size averaged over ``--draws`` loss draws,
and the size of its mean over the draws: a random error's mean shrinks like 1/√draws, a systematic
one's does not. The run itself is not perturbed (its batches and replicas are restored).

Prints a table to stdout, or one JSON document with ``--json``.
"""

from __future__ import annotations

from typing import Any

from lta.bench.flags import add_workers, script_parser


def measure(
    steps: tuple[int, ...] = (10, 30, 60, 150, 250),
    drop: float = 0.1,
    draws: int = 4,
    n_workers: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    import numpy as np
    import torch

    from lta.train.experiment import RunSpec, TrainConfig
    from lta.train.simulated import SimulatedRun

    torch.set_num_threads(1)
    run = SimulatedRun(RunSpec("oracle", "renorm", 0.0, seed, 1), TrainConfig(), n_workers)
    numel, k, n = run.numel, run.k, n_workers
    rng = np.random.default_rng([seed, 0x0AC1E])
    foreign = run.owners[None, :] != np.arange(n)[:, None]

    def gradients(replicas: np.ndarray, states: list[torch.Tensor]) -> np.ndarray:
        for g, state in zip(run.batches, states, strict=True):
            g.set_state(state)
        run.replicas[:, :numel] = torch.from_numpy(replicas)
        grads, _ = run.local_gradients()
        return np.asarray(grads[:, :numel], dtype=np.float64).copy()

    rows = []
    previous = run.owned.detach().numpy().copy()
    done = 0
    for at in sorted(steps):
        while done < at:
            previous = run.owned.detach().numpy().copy()
            run.step()
            done += 1
        current = run.owned.detach().numpy().copy()
        fresh = np.broadcast_to(current, (n, numel)).copy()
        states = [g.get_state() for g in run.batches]
        grads = gradients(fresh, states)
        g = grads.mean(axis=0)
        gn = float(np.linalg.norm(g))
        following = [g.get_state() for g in run.batches]
        noise = gradients(fresh, following).mean(axis=0) - g
        errors: dict[str, list[np.ndarray]] = {"stale": [], "lost": []}
        for _ in range(draws):
            stale = np.repeat((rng.random(foreign.shape) < drop) & foreign, k, axis=1)[:, :numel]
            replicas = np.where(stale, previous[None, :], fresh)
            errors["stale"].append(gradients(replicas, states).mean(axis=0) - g)
            kept = np.repeat(rng.random(foreign.shape) >= drop, k, axis=1)[:, :numel]
            errors["lost"].append((grads * kept).sum(axis=0) / np.maximum(kept.sum(axis=0), 1) - g)
        row: dict[str, Any] = {"step": at, "noise": float(np.linalg.norm(noise)) / gn}
        for name, errs in errors.items():
            e = np.array(errs)
            row[f"{name}_error"] = float(np.linalg.norm(e, axis=1).mean()) / gn
            row[f"{name}_mean_error"] = float(np.linalg.norm(e.mean(axis=0))) / gn
        rows.append(row)
        for g_, state in zip(run.batches, states, strict=True):  # the run goes on as if not measured
            g_.set_state(state)
        run.replicas[:, :numel] = torch.from_numpy(fresh)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return {"n_workers": n, "drop": drop, "draws": draws, "seed": seed, "rows": rows, "load": load}


def main(argv: list[str] | None = None) -> int:
    p = script_parser("lta.bench.stale_bias", __doc__)
    p.add_argument("--steps", default="10,30,60,150,250", help="steps to measure at, comma-separated")
    p.add_argument("--drop", type=float, default=0.1, help="loss rate (default 0.1)")
    p.add_argument("--draws", type=int, default=4, help="loss draws per step (default 4)")
    add_workers(p, 64, "simulated workers (default 64)", type=int)
    args = p.parse_args(argv)
    try:
        steps = tuple(int(s) for s in args.steps.split(","))
    except ValueError:
        p.error(f"--steps must be comma-separated integers, got {args.steps!r}")
    if args.draws < 2 or min(steps) < 1 or not 0 < args.drop < 1 or args.workers < 3:
        p.error("need --draws >= 2, steps >= 1, 0 < --drop < 1 and --workers >= 3")
    r = measure(steps, args.drop, args.draws, args.workers)
    if args.json:
        from lta.jsonout import emit

        emit("lta.bench.stale_bias/1", r)
        return 0
    load = " ".join(r["load"])
    print(f"N={r['n_workers']}, {r['drop']:.0%}, {r['draws']} draws; sizes relative to |g|; load {load}")
    print(
        "| step | sampling noise | stale: error | stale: mean of draws | lost: error | lost: mean of draws |"
    )
    print("|---|---|---|---|---|---|")
    for row in r["rows"]:
        print(
            f"| {row['step']} | {row['noise']:.3f} | {row['stale_error']:.3f} | "
            f"{row['stale_mean_error']:.3f} | {row['lost_error']:.3f} | {row['lost_mean_error']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
