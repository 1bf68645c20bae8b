"""``lta bench fsdp``: stock FSDP2 (``fully_shard`` on every layer of an MLP of about 4.2M parameters, on a
1-D DeviceMesh) on N ranks on loopback, in the same run: with ``init_process_group("gloo")``; with
``init_process_group("lta")`` and ``LTA_LOSSY_OPS=allreduce,reduce_scatter,all_gather`` at 0% emulated
loss; with lta's default setting (gradients lossy, parameters reliable) at 0%; and with all three lossy at
``--loss`` (default 10%) emulated loss of gradients (GRAD packets) and parameters (PARAM replicas).
Reports step-time percentiles, the loss curve's end, and per collective what lta saw: loss, stale
parameter copies, their largest age (never above S) and resyncs.

The reduce-scatter's RESULTs are owner-only (docs/protocol.md): a rank receives the RESULTs of its own
chunks alone, and every rank the last chunk of each call. ``rs_result_packets`` says how many RESULT packets
rank 0 waited for in reduce-scatters and how many chunks it keeps (one more per call: the last chunk).

Step time is wall time, which the other work on a shared machine inflates; ``cpu_ms_per_step`` is the CPU
time every rank's process spent per timed step (summed over the ranks; the embedded softswitch's thread
runs in rank 0's process and counts), steadier under load. ``loadavg`` is the 1-minute load average at the
start and the end of the run.

``--rounds R`` runs the four variants R times, in order in odd rounds and in reverse in even ones, fresh
processes each time: a machine whose speed drifts between runs moves a single pair's ratio a lot (one
2-rank ratio read 0.94 on one day and 1.45 on the next). Each variant's figures pool the steps of every
round (what lta saw, ``collectives`` and ``summary``: the first round's); ``rounds`` gives each round's
p50s and ratios, and the ``_median`` keys the median of the rounds' ratios."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hostlib import argtypes
from hostlib.errors import LtaError, UsageError
from lta.bench.flags import add_seed, add_steps, add_warmup, add_workers, bench_command
from lta.bench.ranks import raise_rank_errors, run_ranks
from lta.bench.summary import median_known, pool_runs, ratio, report, slowest_rank, time_stats
from lta.progress import Status

SCHEMA = "lta.bench.fsdp/2"  # /2: --rounds (pooled steps, per-round ratios, their median)

WIDTH, IN_FEATURES = 1024, 1024  # 1024 -> 4 x 1024 -> 10: 4.2M parameters
ALL_LOSSY = "allreduce,reduce_scatter,all_gather"


def fsdp_worker(
    backend: str,
    env: dict[str, str],
    rank: int,
    world: int,
    port: int,
    steps: int,
    warmup: int,
    queue: Any,
    seed: int = 0,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in [v for v in os.environ if v.startswith("LTA_")]:
        del os.environ[name]
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(seed)  # the model's initial weights
        layers: list[torch.nn.Module] = [torch.nn.Linear(IN_FEATURES, WIDTH), torch.nn.ReLU()]
        for _ in range(3):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))
        params = sum(p.numel() for p in model.parameters())
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        gen = torch.Generator().manual_seed(seed * 1000 + rank)  # each rank's batch
        x, y = torch.randn(32, IN_FEATURES, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        times, losses = [], []
        cpu0 = 0.0
        for i in range(warmup + steps):
            if i == warmup:
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        cpu_s = time.process_time() - cpu0
        out: dict[str, Any] = {"times_s": times, "losses": losses, "params": params, "cpu_s": cpu_s}
        if backend == "lta":
            pg = dist.group.WORLD
            out["collectives"] = pg.collective_stats()
            out["packets_received"] = pg.worker.stats.packets_received
        dist.destroy_process_group()
        queue.put((rank, out))
    except LtaError as exc:
        queue.put((rank, {"error": str(exc), "user_error": True}))
    except BaseException as exc:
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def run_variant(
    backend: str,
    env: dict[str, str],
    world: int,
    steps: int,
    warmup: int,
    timeout_s: float = 900.0,
    seed: int = 0,
) -> dict:
    def args_of(rank: int, port: int, queue: Any) -> tuple[Any, ...]:
        return (backend, env, rank, world, port, steps, warmup, queue, seed)

    results = run_ranks(world, fsdp_worker, args_of, timeout_s)
    raise_rank_errors(backend, results)
    step = slowest_rank([results[r]["times_s"] for r in range(world)])
    losses = np.mean(np.array([results[r]["losses"] for r in range(world)]), axis=0)  # over ranks
    out: dict[str, Any] = {
        **time_stats(step),
        "cpu_ms_per_step": sum(results[r]["cpu_s"] for r in range(world)) / steps * 1e3,
        "first_loss": float(losses[0]),
        "final_loss": float(losses[-1]),
        "params": results[0]["params"],
        "steps_s": step.tolist(),  # (pooled over rounds by combine_rounds, then dropped)
    }
    if backend == "lta":
        out["collectives"] = {r: results[r]["collectives"] for r in range(world)}
        out["summary"] = _summary(results, world)
    return out


RATIOS = {"lta": "ratio_lta_over_gloo_p50", "lta_grads_only": "ratio_lta_grads_only_over_gloo_p50"}


def combine_rounds(rounds: Sequence[dict[str, dict]]) -> dict[str, Any]:
    """The report of R rounds (each ``{variant: run_variant's dict}``): per variant, the step-time stats of
    every round's steps pooled and the CPU per step averaged over the rounds (losses, ``collectives`` and
    ``summary``: the first round's); per round, each variant's p50 and the ratios to gloo's; the median of
    each ratio over the rounds."""
    out: dict[str, Any] = {name: pool_runs([r[name] for r in rounds]) for name in rounds[0]}
    per_round = []
    for r in rounds:
        each: dict[str, Any] = {f"{name}_p50_ms": run["p50_ms"] for name, run in r.items()}
        each |= {key: ratio(r[name]["p50_ms"], r["gloo"]["p50_ms"]) for name, key in RATIOS.items()}
        per_round.append(each)
    out["rounds"] = per_round
    for name, key in RATIOS.items():
        out[key] = ratio(out[name]["p50_ms"], out["gloo"]["p50_ms"])
        out[f"{key}_median"] = median_known(each[key] for each in per_round)
    return out


def _summary(results: dict[int, dict], world: int) -> dict[str, Any]:
    """What the ranks saw, combined: gradient loss seen, parameter copies lost, stale copies, max age."""
    rs = [results[r]["collectives"]["reduce_scatter"] for r in range(world)]
    ag = [results[r]["collectives"]["all_gather"] for r in range(world)]
    chunks = sum(s["chunks"] for s in rs)
    copies = sum(s["chunks"] for s in ag)
    return {
        "grad_loss_seen": 1.0 - sum(s["contributions"] for s in rs) / (world * chunks) if chunks else 0.0,
        "grad_chunks_fallback": sum(s["chunks_fallback"] for s in rs),
        "rs_lossy_calls": rs[0]["lossy_calls"],
        # owner-only RESULTs: a rank waits for its own chunks' RESULTs and each call's last chunk
        "rs_result_packets": {
            "received_per_rank": rs[0]["chunks_received"],
            "owner_only_per_rank": rs[0]["chunks"],
        },
        "param_copies": copies,
        "param_loss_seen": 1.0 - sum(s["chunks_fresh"] for s in ag) / copies if copies else 0.0,
        "stale_copies": sum(s["stale_copies"] for s in ag),
        "max_age": max(s["max_age"] for s in ag),
        "stale_bound": ag[0]["stale_bound"],
        "resyncs": ag[0]["resyncs"],
        "ag_lossy_calls": ag[0]["lossy_calls"],
        "ag_reliable_calls": ag[0]["reliable_calls"],
    }


def register(sub: argparse._SubParsersAction) -> None:
    p = bench_command(
        sub,
        "fsdp",
        _run,
        help="stock FSDP2 on a DeviceMesh: lta (0%% and lossy) vs gloo, same run",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_workers(p, 2, "ranks (processes), 1..64")
    add_steps(p, 30, "timed training steps per run")
    add_warmup(p, 3, "untimed steps first")
    p.add_argument(
        "--loss", type=argtypes.probability, default=0.1, help="emulated loss of GRAD and PARAM packets"
    )
    p.add_argument("--stale-bound", type=argtypes.positive_int, default=8, help="S of the lossy all-gather")
    add_seed(
        p,
        "the model's weights, each rank's batch and the emulated loss (a lossless seed spread is "
        "several seeds)",
    )
    p.add_argument(
        "--rounds",
        type=argtypes.positive_int,
        default=3,
        help="runs of the four variants, in order in odd rounds, reversed in even ones (the machine drifts)",
    )
    p.add_argument(
        "--switch-sockets",
        type=argtypes.nonnegative_int,
        default=0,
        help="receive sockets of the self-hosted softswitch (LTA_SWITCH_SOCKETS; 0: one a rank)",
    )


def _run(args: argparse.Namespace) -> int:
    config = {
        "workers": args.workers,
        "steps": args.steps,
        "warmup": args.warmup,
        "loss": args.loss,
        "stale_bound": args.stale_bound,
        "lossy_ops": ALL_LOSSY,
        "seed": args.seed,
        "rounds": args.rounds,
        "switch_sockets": args.switch_sockets or args.workers,
    }
    if args.switch_sockets > 64:
        raise UsageError(f"--switch-sockets must be 0..64, got {args.switch_sockets}")
    sockets = {"LTA_SWITCH_SOCKETS": str(args.switch_sockets)} if args.switch_sockets else {}
    lossy_env = {
        **sockets,
        "LTA_LOSSY_OPS": ALL_LOSSY,
        "LTA_STALE_BOUND": str(args.stale_bound),
        "LTA_SEED": str(args.seed),
    }
    variants = {
        "gloo": ("gloo", {}),
        "lta": ("lta", lossy_env),
        "lta_grads_only": (
            "lta",
            {**sockets, "LTA_LOSSY_OPS": "allreduce,reduce_scatter"},
        ),  # the default setting
        "lta_lossy": ("lta", {**lossy_env, "LTA_DROP_UP": str(args.loss), "LTA_DROP_PARAM": str(args.loss)}),
    }
    loadavg = {"start": os.getloadavg()[0]}
    title = (
        f"lta bench fsdp: {args.workers} ranks, {args.rounds} rounds of {args.steps} steps: gloo, lta, "
        f"lta {args.loss:.0%} loss"
    )
    rounds = []
    with Status(title) as status:
        for i in range(args.rounds):
            got = {}
            for name in list(variants) if i % 2 == 0 else list(variants)[::-1]:
                backend, env = variants[name]
                status.update(f"round {i + 1}/{args.rounds}, {name}: {args.warmup} + {args.steps} steps")
                got[name] = run_variant(backend, env, args.workers, args.steps, args.warmup, seed=args.seed)
            rounds.append({name: got[name] for name in variants})
    loadavg["end"] = os.getloadavg()[0]
    out: dict[str, Any] = {"config": config, "loadavg": loadavg, **combine_rounds(rounds)}
    out["ratio_lta_over_gloo_cpu"] = out["lta"]["cpu_ms_per_step"] / out["gloo"]["cpu_ms_per_step"]
    out["final_loss_rel_diff_lta_vs_gloo"] = abs(out["lta"]["final_loss"] / out["gloo"]["final_loss"] - 1)

    def table() -> Iterator[str]:
        yield (
            f"stock FSDP2, {args.workers} ranks, {out['gloo']['params']:,} parameters, "
            f"{args.rounds} x {args.steps} steps a variant"
        )
        for name in variants:
            r = out[name]
            yield (
                f"  {name:14s} step p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  "
                f"cpu {r['cpu_ms_per_step']:7.1f} ms/step  "
                f"loss {r['first_loss']:.4f} -> {r['final_loss']:.4f}"
            )
            if "summary" in r:
                s = r["summary"]
                yield (
                    f"                 gradients: loss seen {s['grad_loss_seen']:.3f}; parameters: "
                    f"copies lost {s['param_loss_seen']:.3f}, stale handed out {s['stale_copies']}, max age "
                    f"{s['max_age']} (S={s['stale_bound']}), resyncs {s['resyncs']}"
                )
        yield (
            f"  lta/gloo step p50: {out['ratio_lta_over_gloo_p50']:.2f}, cpu per step: "
            f"{out['ratio_lta_over_gloo_cpu']:.2f} (all three collectives lossy); load average "
            f"{out['loadavg']['start']:.1f} -> {out['loadavg']['end']:.1f}"
        )
        for name, key in RATIOS.items():
            each = ", ".join("n/a" if r[key] is None else f"{r[key]:.2f}" for r in out["rounds"])
            median = out[f"{key}_median"]
            tail = "" if median is None else f" (median {median:.2f})"
            yield f"  {name}/gloo step p50 by round: {each}{tail}"

    return report(args.json, SCHEMA, out, table)
