"""``lta mininet``: the allreduce demo on a Mininet topology with a programmed LTA switch."""

from __future__ import annotations

import argparse
import json

from lta.mininet_demo import TOPOLOGIES, DemoConfig, format_report, run_demo
from mininet_topos.linkshape import LOSS_BACKENDS
from mininet_topos.mnenv import MininetUnavailable


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "mininet",
        help="run an allreduce demo across Mininet hosts through BMv2 or the softswitch (root)",
        description="Hosts on lossy, rate-limited links reduce seeded tensors through an LTA switch "
        "programmed over P4Runtime; each checks its results against the mean of the contributors the "
        "switch reported. Needs root and Debian's mininet (mininet_topos/setup_deps.sh).",
    )
    p.add_argument("--switch", choices=("softswitch", "bmv2"), default="softswitch")
    p.add_argument("--topo", choices=TOPOLOGIES, default="star")
    p.add_argument("--hosts", type=int, default=2, help="worker hosts (1..64)")
    p.add_argument("--loss", type=float, default=0.0, help="loss probability per link and direction")
    p.add_argument("--rate-mbit", type=float, default=200.0, help="link rate; 0 for unlimited")
    p.add_argument("--rounds", type=int, default=20, help="allreduces per worker")
    p.add_argument("--elems", type=int, default=16384, help="float32 values per allreduce")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="bound on the whole run, seconds")
    p.add_argument("--loss-backend", choices=LOSS_BACKENDS, default="auto")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
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
    try:
        report = run_demo(config, log=(lambda *_: None) if args.json else print)
    except MininetUnavailable as exc:
        print(f"lta mininet cannot run here: {exc}")
        return 2
    print(json.dumps(report.to_json(), indent=1) if args.json else format_report(report))
    return 0 if report.ok else 1
