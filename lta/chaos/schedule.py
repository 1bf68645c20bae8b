"""The fault schedule of a chaos run, drawn from one seed: the same seed gives the same run.

A run is one front door (``worker.DOORS``) and a few faults drawn from ``FAULT_KINDS``:

- ``loss-up`` / ``loss-down`` / ``loss-param``: emulated loss on one direction, 10-40%, by the
  softswitch's seeded drop policy: Bernoulli, or Gilbert-Elliott bursts of 4 packets at the same mean;
- ``kill``: the parent SIGKILLs one rank (never rank 0, which hosts the switch) when the rank's progress
  file reaches step S, and does not restart it: its peers must go on without it (liveness);
- ``restart``: the same kill, then the parent starts the rank again after ``delay_s`` seconds: it must
  rejoin and finish, or exit non-zero with a one-line cause (the torch front doors cannot take a rank
  back into a running group: that is their named cause);
- ``stop``: the parent SIGSTOPs one rank at step S for T seconds, then SIGCONTs it;
- ``switch-restart``: the switch loses every slot's state at step S, its configuration kept (rank 0
  resets the job on its embedded softswitch);
- ``small-pool``: a pool of 64 slots (63 data slots) for a model of ~330 chunks of 64 values;
- ``clock``: one rank's clocks step at step S (``worker._step_clock``: the wall clock either way, the
  monotonic clocks the transport uses forward);
- ``reorder`` / ``duplicate``: the run's ranks share a network namespace whose loopback reorders or
  duplicates a fraction of the UDP packets (every LTA packet, both directions): ``netns.py``. This kernel
  has no netem, so reordering is a seeded nftables mark that sends those packets through a slow HTB
  class (they arrive after packets sent later), duplication nftables' ``dup``. Not drawn with
  ``netns=False`` (no root, no nft/tc) nor for the PS door (its server runs in the parent's namespace).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lta.chaos.worker import DOORS

FAULT_KINDS = (
    "loss-up",
    "loss-down",
    "loss-param",
    "kill",
    "restart",
    "stop",
    "switch-restart",
    "small-pool",
    "clock",
    "reorder",
    "duplicate",
)
NETNS_KINDS = ("reorder", "duplicate")
_PS_SKIP = ("loss-param", "switch-restart", "small-pool")
_DIRECTION = {"loss-up": "up", "loss-down": "down", "loss-param": "param"}
BURST = 4.0  # Gilbert-Elliott: mean burst length in packets
# A kill, restart, stop, clock or switch-restart fault lands at a step in [FIRST_FAULT_STEP, steps -
# FAULT_TAIL_STEPS): after the run has trained a while, and early enough to see it recover.
FIRST_FAULT_STEP = 10
FAULT_TAIL_STEPS = 8
MIN_STEPS = FIRST_FAULT_STEP + FAULT_TAIL_STEPS + 1  # the fewest steps a run may have
MIN_WORLD = 2  # a faulted rank is never rank 0 (it hosts the switch), so a run has another


@dataclass
class RunSpec:
    seed: int
    door: str
    world: int
    steps: int
    faults: list[dict[str, Any]] = field(default_factory=list)
    hidden: int = 128  # the model's hidden width: 128 gives ~341 chunks of 64 values, 192 gives 703
    step_s: float = 0.0  # each step takes at least this long (emulated compute; ``lta chaos --step-ms``)
    torchrun_restarts: int | None = None  # torchrun's --max-restarts; None: one per kill (runner)

    @property
    def kinds(self) -> list[str]:
        return [f["kind"] for f in self.faults]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def drop_policy(fault: dict[str, Any]) -> dict[str, Any]:
    """The DropPolicy (as a dict) of a loss fault: Bernoulli(rate), or Gilbert-Elliott with bursts of
    ``BURST`` packets (bad->good r = 1/BURST, all lost in bad) whose long-run loss is ``rate``."""
    rate = float(fault["rate"])
    if fault["model"] == "bernoulli":
        return {"model": "bernoulli", "p": rate}
    r = 1.0 / BURST
    return {
        "model": "gilbert_elliott",
        "p": rate * r / (1.0 - rate),
        "r": r,
        "loss_good": 0.0,
        "loss_bad": 1.0,
    }


def draw(
    seed: int,
    doors: tuple[str, ...] = DOORS,
    world: int = 4,
    steps: int = 40,
    netns: bool = True,
    step_s: float = 0.0,
) -> RunSpec:
    """The run of ``seed``: a door (round robin over ``doors``, so a batch of seeds covers them all) and
    one to three faults (``netns=False``: none of ``NETNS_KINDS``). ``step_s`` does not change what is
    drawn. Raises ValueError below ``MIN_STEPS`` steps or ``MIN_WORLD`` ranks."""
    if steps < MIN_STEPS or world < MIN_WORLD:
        raise ValueError(
            f"a chaos run needs >= {MIN_STEPS} steps and >= {MIN_WORLD} ranks, got {steps} and {world}"
        )
    rng = np.random.default_rng(seed)
    door = doors[seed % len(doors)]
    # The parameter server has no PARAM direction, embedded switch or clock-driven rounds; its server
    # runs in the parent's network namespace.
    skip = (*NETNS_KINDS, *(_PS_SKIP if door == "ps" else ()))
    pool = [k for k in FAULT_KINDS if k not in skip or (netns and k in NETNS_KINDS and door != "ps")]
    kinds = rng.choice(pool, size=int(rng.integers(1, 4)), replace=False)
    faults: list[dict[str, Any]] = []
    for kind in sorted(kinds):
        fault: dict[str, Any] = {"kind": str(kind)}
        if kind in _DIRECTION:
            fault.update(
                direction=_DIRECTION[str(kind)],
                model=str(rng.choice(["bernoulli", "gilbert_elliott"])),
                rate=round(float(rng.uniform(0.1, 0.4)), 3),
            )
        elif kind in ("kill", "restart", "stop", "clock"):
            fault.update(
                rank=int(rng.integers(1, world)),
                step=int(rng.integers(FIRST_FAULT_STEP, steps - FAULT_TAIL_STEPS)),
            )
            if kind == "restart":
                fault["delay_s"] = round(float(rng.uniform(0.5, 3.0)), 2)
            if kind == "stop":
                fault["seconds"] = round(float(rng.uniform(1.0, 8.0)), 2)
            if kind == "clock":
                fault["offset_s"] = round(float(rng.choice([-1, 1]) * rng.uniform(1.0, 30.0)), 2)
        elif kind == "switch-restart":
            fault["step"] = int(rng.integers(FIRST_FAULT_STEP, steps - FAULT_TAIL_STEPS))
        elif kind == "small-pool":
            fault["pool_size"] = 64
        elif kind == "reorder":
            fault["fraction"] = round(float(rng.uniform(0.05, 0.3)), 3)
        elif kind == "duplicate":
            fault["fraction"] = round(float(rng.uniform(0.02, 0.2)), 3)
        faults.append(fault)
    return RunSpec(seed, door, world, steps, faults, step_s=step_s)
