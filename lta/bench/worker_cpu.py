"""Worker CPU per reduce, and where it goes: ``python -m lta.bench.worker_cpu``.

N worker processes (:func:`lta.launch.run_job`, a softswitch thread in this process) run ``--warmup``
reduces, then ``--reduces`` timed ones of ``--mib`` MiB at K = ``--elems-per-packet``. Each worker reports
its process's CPU time (``time.process_time``: every thread of the worker, the heartbeat's too) inside its
timed ``allreduce`` calls (``cpu_ms_per_reduce``), and the wall time of each. Before each reduce it refills
its input, as a caller does (DDP its bucket): that copy is the benchmark's, reported apart (``refresh_ms``;
``user_ms`` and ``sys_ms``, ``os.times()`` around the whole loop at its 10 ms resolution, include it). The
switch's CPU is left out too (it is the switch's, not the worker's). With ``--profile`` every worker
times the engine's phases (the methods that make a wake-up, inclusive of what they call) in thread CPU time
(``time.thread_time``, one clock read per call and end: ~1 us each, a few hundred per reduce), so the
table shows where the CPU of the steady state goes; the wrappers are installed in the worker processes
only, for that run.

With ``--exp-rtt`` every worker's engine carries an :class:`ExponentClock` (the engine's trace hook,
hostlib/transport/trace.py): per timed reduce, the wall time from its start to the RESULT of its first
exponent unit (no data unit may go before it: the stall the exponent round trip puts in front of the data,
docs/protocol.md, "Numbers") and of its last one (the last data units wait for it). Measured in a run of
its own: the hook costs a little CPU.

Engine path: ``LTA_ENGINE`` (python or native) as for any reduce; ``--engine`` sets it for the workers.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time
from typing import Any

import numpy as np

from hostlib import codec as codec_module
from hostlib.transport import LtaWorker, TransportConfig

try:
    from hostlib.transport import native as native_module

    _native_ext: Any = native_module.native_ext
except ImportError:  # a tree from before the native engine (a base run of a before/after comparison)
    _native_ext = None
from hostlib.transport.deadlines import Deadlines
from hostlib.transport.engine import ReduceEngine
from hostlib.transport.io import WorkerIO
from hostlib.transport.plan import ReducePlan
from hostlib.transport.reuse import SlotReuse
from hostlib.transport.trace import EngineTrace
from lta.launch import JobSpec, run_job

# The engine's phases: (class, method) timed inclusive of what they call, in thread CPU time.
PHASES = (
    (ReduceEngine, "_begin"),  # stage the input, exponent proposals, plan reset
    (ReduceEngine, "_send_ready"),  # window and reuse rules, quantize ahead, send, arm deadlines
    (ReduceEngine, "_peer_limit"),  # the slot-reuse rules (reuse.py)
    (ReduceEngine, "_send_run"),  # the native path's run of units (quantize, send, arm)
    (ReduceEngine, "_quantize_ahead"),
    (codec_module, "_c_quantize"),  # the C quantize loop and its seed draw
    (ReduceEngine, "send"),  # the sendmsg calls (GSO trains) and pacing
    (Deadlines, "arm"),
    (ReduceEngine, "_receive"),  # recv system call and _handle
    (WorkerIO, "recv"),
    (ReduceEngine, "_handle"),  # route and settle a batch of RESULTs (and parameters)
    (_native_ext, "settle"),  # ... its C call (native path)
    (ReduceEngine, "_drop_overtaken"),
    (ReduceEngine, "_on_deadlines"),
    (Deadlines, "fast_flush"),
    (Deadlines, "flush_withheld"),
    (Deadlines, "stall_flush"),
    (Deadlines, "due"),
    (Deadlines, "next_at"),
    (SlotReuse, "saw"),
    (ReducePlan, "advance_low"),
    (ReduceEngine, "_finish"),  # fallbacks, copy out, statistics
    (ReduceEngine, "reduce"),
)


def _timed_phases() -> dict[str, list[float]]:
    """Wrap every phase method with a thread-CPU timer (a profiler's patch, in the worker process only);
    returns name -> [calls, CPU seconds]."""
    totals: dict[str, list[float]] = {}
    for cls, name in PHASES:
        if cls is None or not hasattr(cls, name):  # (no native extension, or a tree without that phase)
            continue
        key = f"{getattr(cls, '__name__', cls)}.{name}"
        totals[key] = [0, 0.0]
        inner = getattr(cls, name)

        def timed(*args: Any, _inner: Any = inner, _acc: list[float] = totals[key], **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                _acc[0] += 1
                _acc[1] += time.thread_time() - t0

        static = isinstance(cls, type) and isinstance(inspect.getattr_static(cls, name), staticmethod)
        if isinstance(cls, type) and not static:
            setattr(cls, name, timed)
        else:  # a static method, or a module's function
            setattr(cls, name, staticmethod(timed) if static else timed)
    return totals


class ExponentClock(EngineTrace):
    """Per reduce, the perf_counter seconds from its start to the settling of its first exponent unit (no
    data unit goes before it: the stall the round trip puts in front of the data) and of its last one
    (NaN where none settled: given up or lost). With one exponent unit (K >= the chunk count) they agree."""

    def __init__(self) -> None:
        self.first_s: list[float] = []
        self.exp_rtt_s: list[float] = []
        self._t0 = 0.0
        self._left = 0

    def on_reduce_start(self, engine: ReduceEngine, plan: ReducePlan) -> None:
        self._t0, self._left = time.perf_counter(), plan.exp_units
        self.first_s.append(float("nan"))
        self.exp_rtt_s.append(float("nan"))

    def on_settled(self, engine: ReduceEngine, plan: ReducePlan, units: np.ndarray) -> None:
        if self._left > 0:
            exp = int(np.count_nonzero(units < plan.exp_units))
            if exp and self._left == plan.exp_units:
                self.first_s[-1] = time.perf_counter() - self._t0
            self._left -= exp
            if self._left <= 0:
                self.exp_rtt_s[-1] = time.perf_counter() - self._t0


def _cpu_worker(
    worker: LtaWorker,
    rank: int,
    n_values: int,
    reduces: int,
    warmup: int,
    profile: bool,
    exp_rtt: bool = False,
) -> dict:
    x = np.random.default_rng(rank).standard_normal(n_values).astype(np.float32)
    y = np.empty_like(x)
    for i in range(warmup):
        y[:] = x
        worker.allreduce(y, step=i, out=y)
    totals = _timed_phases() if profile else None
    clock = None
    if exp_rtt:
        clock = worker.engine.trace = ExponentClock()
    walls = []
    cpu_s = refresh_s = 0.0
    t_start = os.times()
    for i in range(reduces):
        r0 = time.process_time()
        y[:] = x  # the caller refills its buffer (DDP its bucket): the benchmark's CPU, not the worker's
        c0, t0 = time.process_time(), time.perf_counter()
        worker.allreduce(y, step=warmup + i, out=y)
        walls.append(time.perf_counter() - t0)
        c1 = time.process_time()
        cpu_s += c1 - c0
        refresh_s += c0 - r0
    t_end = os.times()
    out: dict = {
        "cpu_ms": cpu_s * 1000 / reduces,
        "refresh_ms": refresh_s * 1000 / reduces,
        "user_ms": (t_end.user - t_start.user) * 1000 / reduces,
        "sys_ms": (t_end.system - t_start.system) * 1000 / reduces,
        "walls_ms": [w * 1000 for w in walls],
    }
    if clock is not None:
        out["exp_rtt_ms"] = [t * 1000 for t in clock.exp_rtt_s]
        out["exp_first_ms"] = [t * 1000 for t in clock.first_s]
    if totals is not None:
        out["phases"] = {key: (calls / reduces, cpu * 1000 / reduces) for key, (calls, cpu) in totals.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lta.bench.worker_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mib", type=float, default=4.0)
    p.add_argument("--elems-per-packet", type=int, default=64)
    p.add_argument("--reduces", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="time the engine's phases in thread CPU time")
    p.add_argument("--exp-rtt", action="store_true", help="time the exponent round trip (trace hook)")
    p.add_argument("--engine", choices=("python", "native"), help="LTA_ENGINE for the workers")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.engine:
        os.environ["LTA_ENGINE"] = args.engine
    n_values = int(args.mib * (1 << 20) / 4)
    spec = JobSpec(
        n_workers=args.workers, transport=TransportConfig(elems_per_packet=args.elems_per_packet, seed=0)
    )
    results, _ = run_job(spec, _cpu_worker, n_values, args.reduces, args.warmup, args.profile, args.exp_rtt)
    walls = np.max(np.array([r["walls_ms"] for r in results]), axis=0)
    summary = {
        "engine": os.environ.get("LTA_ENGINE", "default"),
        "load1": os.getloadavg()[0],
        "k": args.elems_per_packet,
        "workers": args.workers,
        "mib": args.mib,
        "reduces": args.reduces,
        "cpu_ms_per_reduce": [round(r["cpu_ms"], 2) for r in results],
        "user_ms": [round(r["user_ms"], 2) for r in results],
        "sys_ms": [round(r["sys_ms"], 2) for r in results],
        "refresh_ms": [round(r["refresh_ms"], 2) for r in results],
        "wall_p50_ms": round(float(np.median(walls)), 2),
    }
    if args.exp_rtt:
        # Per reduce, the slower worker's (max over ranks, as the walls) and the last to start's (min over
        # ranks: its peers' proposals were there already, so it sees the round trip without their lateness).
        for name in ("exp_first_ms", "exp_rtt_ms"):
            per = np.array([r[name] for r in results])
            key = name.removesuffix("_ms")
            summary[f"{key}_p50_ms"] = round(float(np.median(per.max(axis=0))), 2)
            summary[f"{key}_last_starter_p50_ms"] = round(float(np.median(per.min(axis=0))), 2)
            summary[f"{key}_share_p50"] = round(float(np.median(per.max(axis=0) / walls)), 3)
    if args.json:
        print(json.dumps(summary))
    else:
        print(" ".join(f"{k}={v}" for k, v in summary.items()))
    if args.profile:
        print(f"{'phase (rank 0, thread CPU, inclusive)':40s} {'calls/reduce':>12s} {'ms/reduce':>9s}")
        for key, (calls, cpu_ms) in results[0]["phases"].items():
            print(f"{key:40s} {calls:12.1f} {cpu_ms:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
