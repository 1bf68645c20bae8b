"""What ``lta bench byzantine | async | compression`` share: a small classification problem that trains
in seconds on two cores, and a run of N worker threads through an in-process parameter server
(``softswitch.ps``) over UDP loopback.

**The problem.** Inputs ``x ~ N(0, I)`` of ``d_in`` values; labels drawn from the softmax of a fixed
random teacher network (tanh MLP), so the best reachable loss is the labels' entropy (> 0) and training
noise shows as a spread over seeds. The dataset is the same for every seed (seed 0); the seed varies
the student's initialization, the minibatches, the emulated loss and int8 rounding. The student is a
tanh MLP ``d_in -> hidden -> classes`` trained with softmax cross-entropy; the reported loss is the
cross-entropy of the server's final parameters on a fixed evaluation set.

**The run.** Every worker thread offers the same initial parameters (the server keeps the first), then
loops: minibatch gradient (numpy, or torch through ``hostlib.torch_ext.ps.PSOptimizer`` with
``trainer="torch"``), an optional emulated compute time (a seeded sleep, ``straggler_factor`` times
longer for the last worker), push, pull. A Byzantine worker sends its honest gradient times
``-attack_scale`` (sign flip). Loss is Bernoulli on PUSH and PARAM packets, decided by the server.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hostlib import argtypes
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.ps.client import PsClient, PsClientConfig
from lta.progress import Status
from softswitch.ps.config import PsDrop, PsJobConfig
from softswitch.ps.server import PsServer
from softswitch.ps.staleness import StalenessConfig

TRAINERS = ("numpy", "torch")


def add_common_args(parser: argparse.ArgumentParser, *, d_in: int, hidden: int, classes: int) -> None:
    """The flags every parameter-server bench has: the problem's size (defaults per bench), K of the
    job and the worker loop (``--json`` comes with :func:`lta.bench.flags.bench_command`)."""
    parser.add_argument("--d-in", type=argtypes.positive_int, default=d_in, help="problem: input size")
    parser.add_argument("--hidden", type=argtypes.positive_int, default=hidden, help="problem: hidden units")
    parser.add_argument(
        "--classes", type=argtypes.int_range(2, 1000, "classes"), default=classes, help="problem: classes"
    )
    parser.add_argument(
        "--elems-per-packet",
        type=argtypes.int_range(2, 16367, "elements per packet"),
        default=256,
        help="K of the parameter-server job",
    )
    parser.add_argument(
        "--trainer", choices=TRAINERS, default="numpy", help="worker loop: numpy, or torch + PSOptimizer"
    )


def prepare_trainer(args: argparse.Namespace) -> None:
    """The torch worker loop runs in threads of this process: one intra-op thread each."""
    if args.trainer == "torch":
        import torch

        torch.set_num_threads(1)


def run_trainer_bench(
    args: argparse.Namespace, title: str, bench: Callable[[argparse.Namespace, Callable[[str], None]], Any]
) -> Any:
    """A parameter-server bench's run (async, byzantine, compression): the trainer prepared, then
    ``bench(args, update)`` under a status line titled ``title`` (stderr)."""
    prepare_trainer(args)
    with Status(title) as status:
        return bench(args, status.update)


_JOB_ID = 1


@dataclass(frozen=True)
class Problem:
    x_train: np.ndarray
    y_train: np.ndarray
    x_eval: np.ndarray
    y_eval: np.ndarray
    d_in: int
    hidden: int
    classes: int

    @property
    def n_params(self) -> int:
        return self.hidden * self.d_in + self.hidden + self.classes * self.hidden + self.classes


def make_problem(
    d_in: int = 32,
    hidden: int = 64,
    classes: int = 10,
    n_train: int = 8192,
    n_eval: int = 2048,
    seed: int = 0,
) -> Problem:
    """The teacher-labelled dataset (the same for every training seed)."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((hidden, d_in)) / np.sqrt(d_in)
    w2 = rng.standard_normal((classes, hidden)) * 3.0 / np.sqrt(hidden)

    def sample(n: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.standard_normal((n, d_in))
        logits = np.tanh(x @ w1.T) @ w2.T
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        y = (p.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
        return x.astype(np.float32), y.astype(np.int64)

    x_train, y_train = sample(n_train)
    x_eval, y_eval = sample(n_eval)
    return Problem(x_train, y_train, x_eval, y_eval, d_in, hidden, classes)


class Mlp:
    """tanh MLP in numpy, parameters flat in torch's order (W1 (h, d), b1, W2 (c, h), b2)."""

    def __init__(self, problem: Problem) -> None:
        d, h, c = problem.d_in, problem.hidden, problem.classes
        self.shapes = [(h, d), (h,), (c, h), (c,)]
        self.fan_in = [d, d, h, h]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = np.cumsum([0, *self.sizes])

    def unpack(self, flat: np.ndarray) -> list[np.ndarray]:
        return [
            flat[a:b].reshape(s)
            for a, b, s in zip(self.offsets[:-1], self.offsets[1:], self.shapes, strict=True)
        ]

    def init(self, seed: int) -> np.ndarray:
        """torch.nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases."""
        rng = np.random.default_rng([seed, 1])
        parts = [rng.uniform(-1, 1, n) / np.sqrt(f) for n, f in zip(self.sizes, self.fan_in, strict=True)]
        return np.concatenate(parts).astype(np.float32)

    def loss(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        w1, b1, w2, b2 = self.unpack(flat.astype(np.float64))
        logits = np.tanh(x @ w1.T + b1) @ w2.T + b2
        return float(np.mean(_logsumexp(logits) - logits[np.arange(len(y)), y]))

    def loss_grad(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        w1, b1, w2, b2 = self.unpack(flat)
        a = np.tanh(x @ w1.T + b1)
        logits = a @ w2.T + b2
        lse = _logsumexp(logits)
        loss = float(np.mean(lse - logits[np.arange(len(y)), y]))
        dlogits = np.exp(logits - lse[:, None])
        dlogits[np.arange(len(y)), y] -= 1.0
        dlogits /= len(y)
        da = (dlogits @ w2) * (1.0 - a * a)
        grads = [da.T @ x, da.sum(axis=0), dlogits.T @ a, dlogits.sum(axis=0)]
        return loss, np.concatenate([g.ravel() for g in grads]).astype(np.float32)


def _logsumexp(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=1)
    return top + np.log(np.exp(logits - top[:, None]).sum(axis=1))


@dataclass(frozen=True)
class TrainSpec:
    workers: int = 4
    mode: str = "sync"
    steps: int = 200  # pushes per worker (at most, with a target or a time limit)
    batch: int = 32
    lr: float = 0.2
    lr_decay: str = "none"  # "linear": the lr sent with push t is lr x (1 - t / steps)
    momentum: float = 0.9
    compression: str = "none"
    topk_ratio: float = 0.01
    rule: str = "mean"
    f: int | None = None
    trim_ratio: float = 0.1
    fallback: str = "median"
    window_size: int | None = None
    max_wait_s: float = 2.0
    loss: float = 0.0  # Bernoulli loss of PUSH and PARAM packets
    byzantine: int = 0  # the last `byzantine` workers send -attack_scale x their gradient
    attack_scale: float = 10.0
    max_staleness: int = 4
    adaptive: bool = False
    min_staleness: int = 1
    max_staleness_multiplier: float = 10.0
    compute_s: float = 0.0  # emulated compute time per step
    straggler_factor: float = 1.0  # the last worker's compute time is this many times longer
    jitter: float = 0.1  # sigma of the log-normal factor on the compute time
    target_loss: float | None = None  # stop once the server's parameters reach it (evaluated live)
    time_limit_s: float | None = None
    monitor_every_s: float = 0.02
    elems_per_packet: int = 64
    seed: int = 0
    trainer: str = "numpy"
    extra: dict[str, Any] = field(default_factory=dict)


def job_config(spec: TrainSpec) -> PsJobConfig:
    drops: tuple[PsDrop, ...] = ()
    if spec.loss > 0:
        drops = (PsDrop("up", DropPolicy(p=spec.loss)), PsDrop("down", DropPolicy(p=spec.loss)))
    return PsJobConfig(
        job_id=_JOB_ID,
        n_workers=spec.workers,
        mode=spec.mode,
        elems_per_packet=spec.elems_per_packet,
        lr=spec.lr,
        momentum=spec.momentum,
        compression=spec.compression,
        window_size=spec.window_size,
        max_wait_s=spec.max_wait_s,
        rule=spec.rule,
        f=spec.f,
        trim_ratio=spec.trim_ratio,
        fallback=spec.fallback,
        staleness=StalenessConfig(
            max_staleness=spec.max_staleness,
            adaptive=spec.adaptive,
            min_staleness=spec.min_staleness,
            max_staleness_multiplier=spec.max_staleness_multiplier,
        ),
        drops=drops,
    )


def run_training(spec: TrainSpec, problem: Problem) -> dict[str, Any]:
    """Train ``spec`` on ``problem`` through a fresh parameter server; returns what the benches report."""
    model = Mlp(problem)
    init = model.init(spec.seed)
    server = PsServer(seed=spec.seed)
    server.add_job(job_config(spec))
    server.start()
    stop = threading.Event()
    ready = threading.Barrier(spec.workers + 1)
    errors: list[BaseException] = []
    clients: list[PsClient | None] = [None] * spec.workers
    body = _torch_worker if spec.trainer == "torch" else _numpy_worker

    def worker(w: int) -> None:
        client = None
        try:
            config = PsClientConfig(
                elems_per_packet=spec.elems_per_packet,
                compression=spec.compression,
                topk_ratio=spec.topk_ratio,
                seed=spec.seed * 1000 + w,
            )
            client = clients[w] = PsClient(server.address, _JOB_ID, w, config=config)
            body(spec, problem, model, client, w, init, ready, stop)
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # surfaced in the caller's thread
            errors.append(exc)
            stop.set()
            ready.abort()

    threads = [threading.Thread(target=worker, args=(w,), name=f"ps-worker-{w}") for w in range(spec.workers)]
    for t in threads:
        t.start()
    curve: list[tuple[float, float]] = []
    time_to_target = None
    try:
        ready.wait(timeout=60)
        t0 = time.perf_counter()
        eval_x, eval_y = problem.x_eval[:1024], problem.y_eval[:1024]
        while any(t.is_alive() for t in threads):
            time.sleep(spec.monitor_every_s)
            elapsed = time.perf_counter() - t0
            if spec.target_loss is not None and time_to_target is None:
                _, params = server.snapshot(_JOB_ID)
                if params is not None:
                    live = model.loss(params, eval_x, eval_y)
                    curve.append((round(elapsed, 4), round(live, 5)))
                    if live <= spec.target_loss:
                        time_to_target = elapsed
                        stop.set()
            if spec.time_limit_s is not None and elapsed > spec.time_limit_s:
                stop.set()
        wall = time.perf_counter() - t0
    except threading.BrokenBarrierError:
        wall = 0.0
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        step, params = server.snapshot(_JOB_ID)
        stats = server.job_stats(_JOB_ID)
        server.stop()
        for c in clients:
            if c is not None:
                c.close()
    if errors:
        raise errors[0]
    counters = stats["counters"]
    pushes = sum(c.stats.pushes for c in clients if c is not None)
    final = model.loss(params, problem.x_eval, problem.y_eval) if params is not None else float("nan")
    return {
        "final_loss": final if np.isfinite(final) else None,
        "initial_loss": model.loss(init, problem.x_eval, problem.y_eval),
        "wall_s": wall,
        "time_to_target_s": time_to_target,
        "server_steps": step,
        "pushes": pushes,
        "rejection_rate": stats["rejection_rate"],
        "mean_staleness": stats["mean_staleness"],
        "mean_staleness_submitted": stats["mean_staleness_submitted"],
        "staleness_bounds": stats.get("staleness_bounds"),
        "rule_groups": counters["rule_groups"],
        "rule_fallbacks": counters["rule_fallbacks"],
        "rule_refusals": counters["rule_refusals"],
        "payload_bytes_per_push": _per_push(clients, "payload_bytes_sent"),
        "wire_bytes_per_push": _per_push(clients, "wire_bytes_sent"),
        "pull_resends": sum(c.stats.pull_resends for c in clients if c is not None),
        "curve": curve,
    }


def _per_push(clients: list[PsClient | None], name: str) -> float:
    sent = sum(getattr(c.stats, name) for c in clients if c is not None)
    pushes = sum(c.stats.pushes for c in clients if c is not None)
    return sent / pushes if pushes else 0.0


def lr_at(spec: TrainSpec, t: int) -> float:
    """The learning rate a worker sends with its push ``t`` (0-based)."""
    if spec.lr_decay == "linear":
        return spec.lr * (1.0 - t / spec.steps)
    return spec.lr


def _compute_sleep(spec: TrainSpec, w: int, rng: np.random.Generator) -> None:
    if spec.compute_s <= 0:
        return
    factor = spec.straggler_factor if w == spec.workers - 1 else 1.0
    time.sleep(spec.compute_s * factor * float(np.exp(spec.jitter * rng.standard_normal())))


def _numpy_worker(
    spec: TrainSpec,
    problem: Problem,
    model: Mlp,
    client: PsClient,
    w: int,
    init: np.ndarray,
    ready: threading.Barrier,
    stop: threading.Event,
) -> None:
    params = client.initialize(init).copy()
    rng = np.random.default_rng([spec.seed, w, 2])
    byzantine = w >= spec.workers - spec.byzantine
    ready.wait(timeout=60)
    n = len(problem.y_train)
    for t in range(spec.steps):
        if stop.is_set():
            break
        idx = rng.integers(0, n, spec.batch)
        _, grad = model.loss_grad(params, problem.x_train[idx], problem.y_train[idx])
        if byzantine:
            grad *= -spec.attack_scale
        _compute_sleep(spec, w, rng)
        params = client.step(grad, lr=lr_at(spec, t)).copy()


def _torch_worker(
    spec: TrainSpec,
    problem: Problem,
    model: Mlp,
    client: PsClient,
    w: int,
    init: np.ndarray,
    ready: threading.Barrier,
    stop: threading.Event,
) -> None:
    import torch

    from hostlib.torch_ext.ps import PSOptimizer

    net = torch.nn.Sequential(
        torch.nn.Linear(problem.d_in, problem.hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(problem.hidden, problem.classes),
    )
    with torch.no_grad():
        for p, value in zip(net.parameters(), model.unpack(init), strict=True):
            p.copy_(torch.from_numpy(value.copy()))
    opt = PSOptimizer(net.parameters(), client, lr=spec.lr)
    rng = np.random.default_rng([spec.seed, w, 2])
    byzantine = w >= spec.workers - spec.byzantine
    x_all, y_all = torch.from_numpy(problem.x_train), torch.from_numpy(problem.y_train)
    ready.wait(timeout=60)
    for t in range(spec.steps):
        if stop.is_set():
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(spec, t)  # what an LR scheduler would do; the lr travels with the push
        idx = torch.from_numpy(rng.integers(0, len(y_all), spec.batch))
        loss = torch.nn.functional.cross_entropy(net(x_all[idx]), y_all[idx])
        opt.zero_grad()
        loss.backward()
        if byzantine:
            for p in net.parameters():
                assert p.grad is not None
                p.grad.mul_(-spec.attack_scale)
        _compute_sleep(spec, w, rng)
        opt.step()


def seed_summary(values: list[float | None]) -> dict[str, Any]:
    """Mean, standard deviation (ddof 1) and range over seeds; a diverged run (None) makes them None."""
    if not values or any(v is None or not np.isfinite(v) for v in values):
        return {"mean": None, "std": None, "min": None, "max": None, "values": values}
    arr = np.array(values, dtype=np.float64)
    return {
        "mean": float(arr.mean()),
        "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
        "min": float(arr.min()),
        "max": float(arr.max()),
        "values": [float(v) for v in arr],
    }
