"""One rank of a chaos run: ``python -m lta.chaos.worker SPEC.json RANK``.

Trains a small regression model for ``steps`` steps through one front door (``DOORS``), appends every
finished step to ``rank{R}.progress`` (the parent's clock for faults at a step) and saves what the
verdict needs to ``rank{R}.npz``: the final parameters, the evaluation loss before and after, the
largest change of any parameter in one step (the unit of the staleness bound), and after every step the
sum of each chunk of the parameters (``history``, float64, steps x chunks): replicas that parted at some
step and were made equal again later (a re-broadcast resets most chunks) show there.

In-process faults (the parent cannot do them from outside):

- ``clock``: at step S this process's wall clock (``time.time``) steps by ``offset_s`` seconds, either
  way, as NTP or an operator would step it; its monotonic clocks (``time.perf_counter``, the transport's
  and the exchange's only clock source for deadlines and RTT samples, and ``time.monotonic``) jump forward
  by ``|offset_s|``, as they do over a VM pause. Emulated by replacing those three functions of the
  ``time`` module, which every caller reaches as ``time.perf_counter()``. (A monotonic clock never steps
  backwards, so none is emulated.)
- ``switch_restart``: at step S rank 0, which hosts the embedded softswitch, resets the job on it: every
  slot's round, bitmap and sum, the drop-policy streams and the counters are lost, the configuration is
  kept (a switch rebooted and given its jobs again by the control plane).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from hostlib.lifetime import die_with_parent

DOORS = ("ddp", "hook", "sharded", "sharded-critical", "ps", "fsdp2")
_IN, _HIDDEN, _OUT = 32, 128, 8
_BATCH = 32


def _model(hidden: int = _HIDDEN) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(_IN, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, _OUT),
    )


def _teacher(x: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(12345)
    w = torch.randn(_IN, _OUT, generator=g) / _IN**0.5
    return x @ w


def _eval_loss(model: Any) -> float:
    import torch

    x = torch.randn(512, _IN, generator=torch.Generator().manual_seed(999))
    with torch.no_grad():
        return float((model(x) - _teacher(x)).pow(2).mean())


def _flat(model: Any) -> np.ndarray:
    import torch

    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in _full_params(model)]).numpy().copy()


def _full_params(model: Any) -> list[Any]:
    out = []
    for p in model.parameters():
        full = getattr(p, "full_tensor", None)  # FSDP2's DTensor: gather the whole parameter
        out.append(full() if callable(full) else p)
    return out


def chunk_sums(flat: np.ndarray, k: int) -> np.ndarray:
    """The sum of every chunk of ``k`` values (the last one zero-padded), in float64: two replicas whose
    chunk c sums differ by d differ by at least d / k in some value of that chunk."""
    padded = np.zeros(-(-len(flat) // k) * k, dtype=np.float64)
    padded[: len(flat)] = flat
    return padded.reshape(-1, k).sum(axis=1)


def _step_clock(offset_s: float) -> None:
    real = (time.perf_counter, time.monotonic, time.time)
    jump = abs(offset_s)
    time.perf_counter = lambda: real[0]() + jump  # type: ignore[assignment]
    time.monotonic = lambda: real[1]() + jump  # type: ignore[assignment]
    time.time = lambda: real[2]() + offset_s  # type: ignore[assignment]


def _options(spec: dict[str, Any]) -> Any:
    from dataclasses import replace

    from hostlib.emulation.dropmodels import DropPolicy
    from hostlib.torch_ext.rendezvous import LtaOptions

    options = LtaOptions.from_env()
    options.drop = {d: DropPolicy.from_dict(p) for d, p in spec["drop"].items()}
    options.transport = replace(
        options.transport,
        pool_size=spec["pool_size"],
        elems_per_packet=spec["elems_per_packet"],
        reduce_timeout_s=spec["reduce_timeout_s"],
    )
    options.seed = spec["seed"]
    return options


JOIN_TIMEOUT_S = 90.0  # torch's own 60 s join timeout, plus the time to build the model and its wrapper


def _join_watchdog(who: str, timeout_s: float = JOIN_TIMEOUT_S) -> threading.Timer:
    """Exit with a one-line cause when joining the group takes longer than ``timeout_s``: a rank started
    again into a running group waits in gloo's rendezvous past the timeout it was given (the peers never
    come back to it), which would be a hang. The torch front doors have no rejoin (the group's
    membership is fixed at init), so that is the cause named."""

    def give_up() -> None:
        print(
            f"{who}: JoinTimeout: did not join the process group within {timeout_s:.0f} s "
            "(the torch front doors cannot take a rank back into a running group)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    return timer


def run(spec: dict[str, Any], rank: int, who: str = "", restarted: bool = False) -> None:
    import torch
    import torch.distributed as dist

    watchdog = _join_watchdog(who or f"rank {rank}")
    torch.set_num_threads(1)
    out = Path(spec["out"])
    door, world, steps = spec["door"], spec["world"], spec["steps"]
    model = _model(spec.get("hidden", _HIDDEN))
    # The untrained loss, before any door syncs the model: a restarted rank's door hands it its peers'
    # trained parameters (the parameter server's at once), and its "first" loss would then be theirs
    # (chaos seed 4, PS door: a rank restarted at step 23 read 0.674 of it, "untrained").
    first_loss = _eval_loss(model)
    session = None
    sharded = door.startswith("sharded")
    if door in ("ddp", "fsdp2"):
        store = dist.FileStore(spec["store"], world)
        dist.init_process_group(
            "lta",
            store=store,
            rank=rank,
            world_size=world,
            pg_options=_options(spec),
            timeout=timedelta(seconds=60),
        )
    elif door != "ps" and restarted:
        # The peers' gloo group cannot take it back (its membership is fixed at init): a group of its
        # own for DDP's set-up, and the LTA job rejoined through the run's store.
        from hostlib.torch_ext.health import rejoin_default_group

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        session = rejoin_default_group(
            dist.FileStore(spec["store"], world), rank, world, _options(spec), timeout=timedelta(seconds=60)
        )
    elif door != "ps":
        store = dist.FileStore(spec["store"], world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        from hostlib.torch_ext.health import join_default_group

        session = join_default_group(_options(spec), timeout=timedelta(seconds=60))
    if door == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        net: Any = DistributedDataParallel(model)
        opt: Any = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    elif door == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        net = model
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    elif door == "hook":
        from torch.nn.parallel import DistributedDataParallel

        from hostlib.torch_ext.ddp_hook import LtaHookState, lta_hook

        net = DistributedDataParallel(model)
        state = LtaHookState(session.worker, rebroadcast_every=spec["rebroadcast_every"])  # type: ignore[union-attr]
        net.register_comm_hook(state, lta_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        state.attach(net.module, opt)  # a rank that falls behind takes a peer's parameters and momentum
        if restarted:
            state.rejoin()
    elif sharded:
        from hostlib.torch_ext.sharded import ShardedOptimizer

        critical = "default" if door == "sharded-critical" else None
        net = model
        opt = ShardedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            session.worker,  # type: ignore[union-attr]
            stale_bound=spec["stale_bound"],
            critical=critical,
            module=model,
        )
        if restarted:
            opt.rejoin()
    elif door == "ps":
        from hostlib.torch_ext.ps import PSOptimizer

        os.environ["RANK"] = str(rank)
        net = model
        opt = PSOptimizer.from_env(model.parameters(), lr=0.05)
    else:
        raise ValueError(f"unknown front door {door!r}: choose among {', '.join(DOORS)}")

    watchdog.cancel()
    transport = _transport_worker(door, session)
    data = torch.Generator().manual_seed(1000 + rank + 97 * spec["seed"])
    previous = _flat(model)
    max_step_change = 0.0
    history: list[np.ndarray] = []
    clock = spec.get("clock")
    restart_at = spec.get("switch_restart_at") if rank == 0 else None
    # The hook's and the sharded doors' own step counter: a rank that fell behind takes its peers' step
    # with their state (hostlib/torch_ext/heal.py) and so makes fewer steps of its own.
    door_step = _door_step(door, state if door == "hook" else None, opt)
    step = 0 if door_step is None else door_step()  # a restarted rank starts at its peers' step
    with open(out / f"rank{rank}.progress", "a", buffering=1) as progress:
        while step < steps:
            if clock is not None and clock["rank"] == rank and step == clock["step"]:
                _step_clock(float(clock["offset_s"]))
            if restart_at is not None and step == restart_at:
                _reset_switch(session, net)
            x = torch.randn(_BATCH, _IN, generator=data)
            loss = (net(x) - _teacher(x)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            now = _flat(model)
            max_step_change = max(max_step_change, float(np.abs(now - previous).max()))
            previous = now
            history.append(chunk_sums(now, spec["elems_per_packet"]))
            progress.write(f"{step + 1} {time.perf_counter():.6f} {_health(transport)}\n")
            step = step + 1 if door_step is None else door_step()
    result = {
        "params": _flat(model),
        "first_loss": first_loss,
        "final_loss": _eval_loss(model),
        "max_step_change": max_step_change,
        "history": np.stack(history) if history else np.zeros((0, 0)),
    }
    np.savez(out / f"rank{rank}.npz", **result)  # type: ignore[arg-type]
    healer = getattr(state if door == "hook" else opt, "healer", None) if door != "ps" else None
    if healer is not None:  # a peer stopped past this rank's last step can still take its state
        healer.linger(max_s=30.0)  # a restarted rank's start (importing torch) took 10-20 s at load 10
    if door != "ps":
        dist.destroy_process_group()
    if session is not None:
        session.close()


def _door_step(door: str, hook_state: Any, opt: Any) -> Any:
    """A function that reads the door's step counter, or None for the doors that keep none of their own."""
    if door == "hook":
        return lambda: hook_state.step
    if door.startswith("sharded"):
        return lambda: opt.lta_step
    return None


def _transport_worker(door: str, session: Any) -> Any:
    """The rank's LtaWorker (None in PS mode), for the per-step health columns of the progress file."""
    if session is not None:
        return session.worker
    if door in ("ddp", "fsdp2"):
        return getattr(_lta_group(), "worker", None)
    return None


def _lta_group() -> Any:
    """The default process group of ``init_process_group("lta")``: the ProcessGroupLta itself (its
    ``_get_backend`` is the gloo group it registers for the collectives it does not override)."""
    import torch.distributed as dist

    return dist.group.WORLD


def _health(worker: Any) -> str:
    """Running totals after this step: chunks without RESULT, with count 0, units overtaken, flushes."""
    if worker is None:
        return ""
    st = worker.stats
    return f"{st.chunks} {st.chunks_no_result} {st.chunks_empty} {st.units_overtaken} {st.flushes_sent}"


def _reset_switch(session: Any, net: Any) -> None:
    """Rank 0: the embedded softswitch loses its state (see the module's docstring)."""
    switch = session.switch if session is not None else None
    if switch is None:  # the lta process group's own session
        switch = _lta_group().session.switch
    for job_id in list(switch.jobs):
        switch.reset_job(job_id)


def main() -> int:
    parent = os.environ.get("LTA_PARENT_PID")
    if parent:  # a rank ends with the chaos parent, however that ends (kill, SIGHUP, SIGKILL)
        die_with_parent(parent_pid=int(parent))
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    who = f"rank {rank} (restarted)" if sys.argv[3:] == ["restarted"] else f"rank {rank}"
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks where a hung rank waits
    level = os.environ.get("LTA_LOG")
    if level:  # the rank's log goes to its .err file
        fmt = f"%(relativeCreated)d rank {rank} %(name)s: %(message)s"
        logging.basicConfig(level=level.upper(), format=fmt)
    try:
        run(spec, rank, who, restarted=sys.argv[3:] == ["restarted"])
    except Exception as exc:
        # One line naming the cause; the parent reads the last line of stderr.
        print(f"{who}: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
