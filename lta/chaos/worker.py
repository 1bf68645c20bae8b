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

How each door survives a process that dies:

- ``ddp`` and ``fsdp2`` (stock torch, ``TORCHRUN_DOORS``) run under torchrun (``RANK`` argument ``env``):
  a dead rank ends the whole group (the agent stops the others), and torchrun starts every rank again
  (``--max-restarts``); each rank then resumes from the last distributed checkpoint
  (``torch.distributed.checkpoint``, every ``CHECKPOINT_EVERY`` steps: model and optimizer state and the
  step), so the steps after that checkpoint are done again (the run's lost steps);
- ``torchft``: each rank is a torchft replica group of one, with torchft's ``Manager``,
  ``DistributedDataParallel`` and ``Optimizer`` wrappers over an lta replica group
  (``hostlib.torch_ext.ft``); the parent runs torchft's lighthouse (``TORCHFT_LIGHTHOUSE``). A dead
  replica leaves the next quorum; one started again joins a quorum and heals from a live peer (model,
  optimizer state and step), then trains on at the current step;
- the other doors: the rank started again runs ``run`` from the start, as a new process of its door.

A rank that finished lingers (``Healer.linger``) while a peer is silent, so that one stopped past its
last step can still heal, until the parent's ``finished`` file says no rank will step again.

Every start of a process appends ``monotonic-seconds restart-count`` to ``rank{R}.starts`` and writes
its pid to ``rank{R}.pid`` (the parent's handle on a rank torchrun started); every finished step appends
``step perf-counter health...`` to ``rank{R}.progress``, ``step`` being the training step it completed
(after a resume or a heal: the step the run is at, not a count of this process's steps).
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

DOORS = ("ddp", "hook", "sharded", "sharded-critical", "ps", "fsdp2", "torchft")
TORCHRUN_DOORS = ("ddp", "fsdp2")  # started by torchrun, resumed from a distributed checkpoint
# The parent writes this file in the run's folder once every rank that will step again has finished
# (written its npz; a rank killed for good never will): a finished rank stops lingering for a peer then.
FINISHED_MARK = "finished"
CHECKPOINT_EVERY = 5  # steps between two distributed checkpoints of a TORCHRUN_DOORS run
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


def _batch(spec: dict[str, Any], rank: int, step: int) -> Any:
    """Rank ``rank``'s batch of step ``step``: a function of the step, so a rank that resumes from a
    checkpoint or heals to step S draws what it would have drawn there."""
    import torch

    gen = torch.Generator().manual_seed(1000 + rank + 97 * spec["seed"] + 7919 * step)
    return torch.randn(_BATCH, _IN, generator=gen)


class _Door:
    """One rank's front door, built by :func:`_open_door`: what it trains with and how it ends."""

    def __init__(self, net: Any, opt: Any, start: int = 0) -> None:
        self.net, self.opt, self.start = net, opt, start
        self.session: Any = None  # the LtaSession of the hook and sharded doors
        self.manager: Any = None  # torchft's Manager (torchft door)
        self.ft_group: Any = None  # the torchft replica group (torchft door)
        self.keep: Any = None  # what must live as long as the door (torchft: its store)
        # The hook's and the sharded doors' own step counter: a rank that fell behind takes its peers'
        # step with their state (hostlib/torch_ext/heal.py) and so makes fewer steps of its own.
        self.step_of: Any = None
        self.healer: Any = None  # the door's healer (hook, sharded): it lingers at the end of the run

    def step_done(self, step: int) -> int:
        """The training step the run is at after a step from ``step``: torchft's own count (it does not
        move when a step was not committed, and jumps when the replica healed)."""
        if self.step_of is not None:
            return int(self.step_of())
        return int(self.manager.current_step()) if self.manager is not None else step + 1

    def worker(self, door: str) -> Any:
        """The rank's LtaWorker now (None in PS mode), for the per-step health columns."""
        if self.session is not None:
            return self.session.worker
        if self.ft_group is not None:
            group = self.ft_group.lta_group
            return group.worker if group is not None else None
        if door in TORCHRUN_DOORS:
            return getattr(_lta_group(), "worker", None)
        return None

    def switch(self) -> Any:
        """The softswitch this rank hosts (rank 0), or None."""
        if self.session is not None:
            return self.session.switch
        if self.ft_group is not None:
            group = self.ft_group.lta_group
            session = group.session if group is not None else None
            return session.switch if session is not None else None
        return _lta_group().session.switch


def _open_door(spec: dict[str, Any], rank: int, model: Any, out: Path, restarted: bool = False) -> _Door:
    import torch
    import torch.distributed as dist

    door, world = spec["door"], spec["world"]
    sgd = {"lr": 0.05, "momentum": 0.9}
    if door in TORCHRUN_DOORS:
        from torch.distributed.rendezvous import rendezvous

        # env:// (torchrun's store), under a prefix of its own per attempt: torch's env:// handler adds
        # none (torch/distributed/rendezvous.py expects a new agent store per attempt), and with
        # --standalone the keys of the attempt before were still there: an lta group started again read
        # its dead predecessors' addresses (gloo: connectFullMesh ... Connection refused). Whether a
        # plain gloo group has the same trouble was not checked.
        env_store, rank, world = next(rendezvous("env://", timeout=timedelta(seconds=60)))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            "lta",
            store=dist.PrefixStore(f"lta-chaos-attempt-{attempt}", env_store),
            rank=rank,
            world_size=world,
            pg_options=_options(spec),
            timeout=timedelta(seconds=60),
        )
        if door == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            net: Any = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
            net = model
        opt: Any = torch.optim.SGD(model.parameters(), **sgd)
        return _Door(net, opt, start=_resume(out, model, opt))
    if door == "torchft":
        return _torchft_door(spec, rank, model)
    if door == "ps":
        from hostlib.torch_ext.ps import PSOptimizer

        os.environ["RANK"] = str(rank)
        return _Door(model, PSOptimizer.from_env(model.parameters(), lr=0.05))
    if door not in DOORS:
        raise ValueError(f"unknown front door {door!r}: choose among {', '.join(DOORS)}")
    if restarted:
        # The peers' gloo group cannot take it back (its membership is fixed at init): a group of its
        # own for DDP's set-up, and the LTA job rejoined through the run's store.
        from hostlib.torch_ext.health import rejoin_default_group

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        session = rejoin_default_group(
            dist.FileStore(spec["store"], world), rank, world, _options(spec), timeout=timedelta(seconds=60)
        )
    else:
        store = dist.FileStore(spec["store"], world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        from hostlib.torch_ext.health import join_default_group

        session = join_default_group(_options(spec), timeout=timedelta(seconds=60))
    if door == "hook":
        from torch.nn.parallel import DistributedDataParallel

        from hostlib.torch_ext.ddp_hook import LtaHookState, lta_hook

        net = DistributedDataParallel(model)
        state = LtaHookState(session.worker, rebroadcast_every=spec["rebroadcast_every"])
        net.register_comm_hook(state, lta_hook)
        hook_opt = torch.optim.SGD(net.parameters(), **sgd)
        state.attach(net.module, hook_opt)  # a rank that falls behind takes a peer's parameters and momentum
        if restarted:
            state.rejoin()
        built = _Door(net, hook_opt)
        built.step_of, built.healer = (lambda: state.step), state.healer
    else:
        from hostlib.torch_ext.sharded import ShardedOptimizer

        opt = ShardedOptimizer(
            torch.optim.SGD(model.parameters(), **sgd),
            session.worker,
            stale_bound=spec["stale_bound"],
            critical="default" if door == "sharded-critical" else None,
            module=model,
        )
        if restarted:
            opt.rejoin()
        built = _Door(model, opt)
        built.step_of, built.healer = (lambda: opt.lta_step), opt.healer
    built.start = built.step_of()  # a restarted rank starts at its peers' step
    built.session = session
    return built


def _torchft_door(spec: dict[str, Any], rank: int, model: Any) -> _Door:
    """torchft's Manager, DDP and optimizer wrappers over an lta replica group; this rank is replica group
    ``rank`` (of one rank). A replica started again heals from a live peer at its first quorum."""
    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel as FtDistributedDataParallel
    from torchft import Manager
    from torchft import Optimizer as FtOptimizer

    from hostlib.torch_ext.ft import lta_replica_group

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def load_state_dict(state: dict[str, Any]) -> None:  # a healing replica gets a live peer's state
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["opt"])

    timeout = timedelta(seconds=spec["reduce_timeout_s"] + 10)
    group = lta_replica_group(_options(spec), timeout=timeout)
    manager = Manager(
        pg=group,
        min_replica_size=spec["ft_min_replicas"],
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "opt": inner.state_dict()},
        replica_id=f"rank{rank}",
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        store_addr="127.0.0.1",
        store_port=store.port,
        hostname="127.0.0.1",  # one host: the lighthouse and the peers reach this replica on loopback
        rank=0,
        world_size=1,
        use_async_quorum=False,  # heal before the step's forward pass, not during it
        timeout=timeout,
        quorum_timeout=timedelta(seconds=spec["ft_quorum_timeout_s"]),
        connect_timeout=timedelta(seconds=60),
    )
    built = _Door(FtDistributedDataParallel(manager, model), FtOptimizer(manager, inner))
    built.manager, built.ft_group = manager, group
    built.keep = store  # the replica group's store: its server lives as long as this object
    built.start = int(manager.current_step())
    return built


def _checkpoints(out: Path) -> list[tuple[int, Path]]:
    """The complete distributed checkpoints under ``out/checkpoint`` (step, folder), oldest first: a
    folder counts once its ``.metadata`` is written, which DCP's coordinator does after every rank's
    shards are (a rank killed in the middle of a save leaves a folder without it)."""
    root = out / "checkpoint"
    found = []
    for folder in root.glob("step-*") if root.exists() else []:
        if (folder / ".metadata").exists():
            found.append((int(folder.name.split("-", 1)[1]), folder))
    return sorted(found)


def _resume(out: Path, model: Any, opt: Any) -> int:
    """Load the last complete checkpoint into ``model`` and ``opt`` (every rank the same one); returns
    its step (0 without one)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    done = _checkpoints(out)
    # Every rank must load the same step: rank 0 decides (a save that completed between two ranks'
    # looks would otherwise split them).
    choice = [done[-1][0] if done else 0]
    dist.broadcast_object_list(choice, src=0)
    step = int(choice[0])
    if step == 0:
        return 0
    model_state, opt_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": opt_state}
    dcp.load(state, checkpoint_id=str(out / "checkpoint" / f"step-{step}"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step


def _save(out: Path, model: Any, opt: Any, step: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, opt_state = get_state_dict(model, opt)
    folder = out / "checkpoint" / f"step-{step}"
    dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=str(folder))


def run(spec: dict[str, Any], rank: int, who: str = "", restarted: bool = False) -> None:
    import torch
    import torch.distributed as dist

    watchdog = _join_watchdog(who or f"rank {rank}")
    torch.set_num_threads(1)
    out = Path(spec["out"])
    door, steps = spec["door"], spec["steps"]
    model = _model(spec.get("hidden", _HIDDEN))
    # The untrained loss, before any door syncs the model: a restarted rank's door hands it its peers'
    # trained parameters (the parameter server's at once), and its "first" loss would then be theirs
    # (chaos seed 4, PS door: a rank restarted at step 23 read 0.674 of it, "untrained").
    first_loss = _eval_loss(model)
    built = _open_door(spec, rank, model, out, restarted)
    watchdog.cancel()
    net, opt = built.net, built.opt
    max_step_change = 0.0
    history: list[np.ndarray] = []
    clock = spec.get("clock")
    restart_at = spec.get("switch_restart_at") if rank == 0 else None
    step = built.start
    previous, previous_step = _flat(model), step
    with open(out / f"rank{rank}.progress", "a", buffering=1) as progress:
        while step < steps:
            if clock is not None and clock["rank"] == rank and step == clock["step"]:
                _step_clock(float(clock["offset_s"]))
            if restart_at is not None and step == restart_at:
                _reset_switch(built)
            began = time.perf_counter()
            x = _batch(spec, rank, step)
            opt.zero_grad()  # torchft: the step's quorum (and a heal) happens here
            loss = (net(x) - _teacher(x)).pow(2).mean()
            loss.backward()
            opt.step()
            done = built.step_done(step)
            if done == step:  # torchft did not commit the step (a peer failed in it): try it again
                continue
            now = _flat(model)
            if done == previous_step + 1:  # one step's change (a heal's jump is no step)
                max_step_change = max(max_step_change, float(np.abs(now - previous).max()))
            previous, previous_step, step = now, done, done
            history.append(chunk_sums(now, spec["elems_per_packet"]))
            progress.write(f"{step} {time.perf_counter():.6f} {_health(built.worker(door))}\n")
            if door in TORCHRUN_DOORS and step % CHECKPOINT_EVERY == 0 and step < steps:
                _save(out, model, opt, step)
            # Emulated compute: a step takes at least step_s (a run long enough for a rank started again
            # to find its peers still training).
            time.sleep(max(0.0, spec.get("step_s", 0.0) - (time.perf_counter() - began)))
    result = {
        "params": _flat(model),
        "first_loss": first_loss,
        "final_loss": _eval_loss(model),
        "max_step_change": max_step_change,
        "history": np.stack(history) if history else np.zeros((0, 0)),
        # The parameter server's version of these parameters (other doors: -1). A sync window closes
        # without a rank that has not pushed within its max wait (a slow start), so that rank's steps
        # land one window later and it ends a version past its peers: replicas one step apart by design.
        "version": opt.client.version if door == "ps" else -1,
    }
    np.savez(out / f"rank{rank}.npz", **result)  # type: ignore[arg-type]
    if built.healer is not None:  # a peer stopped past this rank's last step can still take its state
        # a restarted rank's start (importing torch) took 10-20 s at load 10; no longer than the parent
        # says some rank may still need it
        built.healer.linger(max_s=30.0, until=(out / FINISHED_MARK).exists)
    if built.manager is not None:
        built.manager.shutdown(wait=False)
    elif door != "ps":
        dist.destroy_process_group()
    if built.session is not None:
        built.session.close()


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


def _reset_switch(built: _Door) -> None:
    """Rank 0: the softswitch it hosts loses its state (see the module's docstring)."""
    switch = built.switch()
    if switch is None:  # torchft: this quorum's switch is hosted by another replica
        return
    for job_id in list(switch.jobs):
        switch.reset_job(job_id)


def _starts(out: Path, rank: int, began: float) -> None:
    """Record this process's start (``rank{R}.starts``, ``rank{R}.pid``): the parent times a restarted
    rank's first step from it, and kills a rank torchrun started by its pid."""
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    with open(out / f"rank{rank}.starts", "a") as starts:
        starts.write(f"{began:.6f} {restarts or '-'}\n")
    tmp = out / f"rank{rank}.pid.tmp"
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(out / f"rank{rank}.pid")


def main() -> int:
    began = time.monotonic()
    spec = json.loads(Path(sys.argv[1]).read_text())
    under_torchrun = sys.argv[2] == "env"
    rank = int(os.environ["RANK"]) if under_torchrun else int(sys.argv[2])
    out = Path(spec["out"])
    restarted = sys.argv[3:] == ["restarted"] or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if under_torchrun:
        # torchrun's agent is the parent (it dies with the chaos parent); this rank's stderr goes to its
        # .err file, as the parent's own ranks' do.
        die_with_parent()
        err = os.open(out / f"rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(err, 2)
        os.close(err)
        if restarted:
            print("--- restarted by torchrun ---", file=sys.stderr, flush=True)
    else:
        parent = os.environ.get("LTA_PARENT_PID")
        if parent:  # a rank ends with the chaos parent, however that ends (kill, SIGHUP, SIGKILL)
            die_with_parent(parent_pid=int(parent))
    _starts(out, rank, began)
    who = f"rank {rank} (restarted)" if restarted else f"rank {rank}"
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks where a hung rank waits
    level = os.environ.get("LTA_LOG")
    if level:  # the rank's log goes to its .err file
        fmt = f"%(relativeCreated)d rank {rank} %(name)s: %(message)s"
        logging.basicConfig(level=level.upper(), format=fmt)
    try:
        run(spec, rank, who, restarted=restarted)
    except Exception as exc:
        # One line naming the cause; the parent reads the last line of stderr.
        print(f"{who}: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
