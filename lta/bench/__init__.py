"""``lta bench``: lta against its baselines (gloo, a raw-socket echo), measured in the same run."""

from __future__ import annotations

import argparse

from lta.bench import (
    allreduce,
    async_ps,
    byzantine,
    compression,
    ddp,
    fsdp,
    lossy,
    lossy_train,
    ltp,
    scaling,
    stragglers,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmarks: lta against gloo, measured in the same run",
        description="Benchmarks of lta against its baselines (gloo, a raw UDP echo), measured in the same "
        "run on the same machine. Progress goes to stderr, results to stdout (--json: one document).",
    )
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    benches = (allreduce, ddp, fsdp, scaling, lossy, lossy_train, byzantine, async_ps, compression)
    benches += (stragglers,)
    for module in benches:
        module.register(sub)
    ltp.register(sub)
