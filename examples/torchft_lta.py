"""torchft over LTA: replica groups that may come and go (torchft) whose gradient allreduce is lossy and
renormalized (LTA). Needs torchft (``pip install torchft``, in an environment without lta's ``p4rt``
extra: see ``hostlib/torch_ext/ft.py``).

One lighthouse, then one process per replica group (here each group is one rank):

    python examples/torchft_lta.py lighthouse            # prints its address
    TORCHFT_LIGHTHOUSE=http://HOST:PORT python examples/torchft_lta.py replica 0 &
    TORCHFT_LIGHTHOUSE=http://HOST:PORT python examples/torchft_lta.py replica 1

Emulated loss on the self-hosted softswitch as for any lta group: ``LTA_DROP_UP=0.05``. The training
loop is torchft's own (its DDP and optimizer wrappers); only the process group is LTA's.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist

STEPS = 6
IN, OUT = 64, 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 64), torch.nn.ReLU(), torch.nn.Linear(64, OUT))


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(16, IN, generator=gen), torch.randint(0, OUT, (16,), generator=gen)


def train_replica(replica: int, lighthouse: str, steps: int = STEPS, lr: float = 0.1) -> dict[str, Any]:
    """Train one replica group (one rank) with torchft's Manager over an lta replica group; returns its
    final parameters, losses and what LTA saw."""
    from torchft import DistributedDataParallel, Manager, Optimizer

    from hostlib.torch_ext import lta_stats
    from hostlib.torch_ext.ft import lta_replica_group

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def load_state_dict(state: dict[str, Any]) -> None:  # a recovering replica gets a peer's state
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])

    pg = lta_replica_group()
    manager = Manager(
        pg=pg,
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        replica_id=f"replica{replica}",
        lighthouse_addr=lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        use_async_quorum=False,
    )
    ddp = DistributedDataParallel(manager, model)
    ft_opt = Optimizer(manager, opt)
    losses = []
    try:
        while manager.current_step() < steps:
            x, y = batch(replica, manager.current_step())
            ft_opt.zero_grad()  # starts the step's quorum
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            ft_opt.step()  # commits when every replica's allreduce went through
            losses.append(float(loss))
        group = pg.lta_group
        stats = lta_stats(group) if group is not None else {}
        return {
            "params": torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy(),
            "losses": losses,
            "steps": manager.current_step(),
            "lossy_calls": group.lossy_calls if group is not None else 0,
            "chunks_partial": stats.get("chunks_partial", 0),
            "chunks": stats.get("chunks", 0),
        }
    finally:
        manager.shutdown(wait=False)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="role", required=True)
    sub.add_parser("lighthouse", help="run torchft's lighthouse for 2 replica groups")
    rep = sub.add_parser("replica", help="run one replica group")
    rep.add_argument("replica", type=int)
    rep.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    if args.role == "lighthouse":
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
        print(lighthouse.address(), flush=True)
        while True:
            time.sleep(3600)
    out = train_replica(args.replica, os.environ["TORCHFT_LIGHTHOUSE"], args.steps)
    losses = out["losses"]
    print(
        f"replica {args.replica}: {out['steps']} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
        f"{out['lossy_calls']} reduces through the switch, "
        f"{out['chunks_partial']}/{out['chunks']} chunks partial"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
