"""``lta mininet``: the allreduce demo on a Mininet topology with a programmed LTA switch."""

from __future__ import annotations

import argparse

from hostlib import argtypes
from hostlib.errors import UsageError
from hostlib.protocol import MAX_WORKERS
from lta.jsonout import emit
from lta.mininet_demo import TOPOLOGIES, DemoConfig, format_report, run_demo
from lta.progress import Status
from mininet_topos.linkshape import LOSS_BACKENDS
from mininet_topos.mnenv import MininetUnavailable

SCHEMA = "lta.mininet/1"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "mininet",
        help="run an allreduce demo across Mininet hosts through BMv2 or the softswitch (root)",
        description="Hosts on lossy, rate-limited links reduce seeded tensors through an LTA switch "
        "programmed over P4Runtime; each checks its results against the mean of the contributors the "
        "switch reported. Needs root and Debian's mininet (mininet_topos/setup_deps.sh).",
    )
    p.add_argument(
        "--switch", choices=("softswitch", "bmv2"), default="softswitch", help="the LTA switch to run"
    )
    p.add_argument("--topo", choices=TOPOLOGIES, default="star", help="topology")
    p.add_argument("--hosts", type=argtypes.workers, default=2, help=f"worker hosts, 1..{MAX_WORKERS}")
    p.add_argument(
        "--loss", type=argtypes.probability, default=0.0, help="loss probability per link and direction, 0..1"
    )
    p.add_argument(
        "--rate-mbit",
        type=argtypes.float_range(0.0, what="rate"),
        default=200.0,
        help="link rate in Mbit/s; 0 for unlimited",
    )
    p.add_argument("--rounds", type=argtypes.positive_int, default=20, help="allreduces per worker")
    p.add_argument("--elems", type=argtypes.positive_int, default=16384, help="float32 values per allreduce")
    p.add_argument("--seed", type=argtypes.nonnegative_int, default=0, help="seed of the inputs")
    p.add_argument(
        "--timeout",
        type=argtypes.float_range(0.0, low_open=True, what="timeout"),
        default=300.0,
        help="bound on the whole run, seconds",
    )
    p.add_argument(
        "--loss-backend",
        choices=LOSS_BACKENDS,
        default="auto",
        help="what drops packets: netem on the links, nftables at the hosts' interfaces, or auto",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON document")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = DemoConfig(
        switch=args.switch,
        topo=args.topo,
        hosts=args.hosts,
        loss=args.loss,
        rate_mbit=args.rate_mbit or None,
        rounds=args.rounds,
        elems=args.elems,
        seed=args.seed,
        timeout_s=args.timeout,
        loss_backend=args.loss_backend,
    )
    title = (
        f"lta mininet: {args.hosts} hosts, {args.topo}, {args.switch}, loss {args.loss:g}, "
        f"{args.rounds} allreduces of {args.elems} values"
    )
    try:
        with Status(title) as status:
            report = run_demo(config, log=status.update)
    except MininetUnavailable as exc:
        raise UsageError(f"cannot run here: {exc}") from None
    if args.json:
        emit(SCHEMA, report.to_json(), indent=1)
    else:
        print(format_report(report))
    return 0 if report.ok else 1
