"""``lta softswitch``: run the reference switch as a UDP daemon."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from hostlib.protocol import LTA_PORT, parse_address
from softswitch.config import load_switch
from softswitch.pipeline import SoftSwitch
from softswitch.server import SoftSwitchServer


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("softswitch", help="run the reference switch as a UDP daemon")
    p.add_argument("--listen", default=f"127.0.0.1:{LTA_PORT}", help="HOST:PORT to listen on")
    p.add_argument("--config", help="TOML file with jobs and drop policies (see softswitch/config.py)")
    p.add_argument(
        "--p4runtime",
        metavar="HOST:PORT",
        help="also serve P4Runtime here (`lta ctl --target HOST:PORT`); workers by address",
    )
    p.add_argument("--stats-every", type=float, default=0.0, help="print counters every N seconds")
    p.add_argument(
        "--shards",
        type=_shard_count,
        default=1,
        metavar="N",
        help="N processes behind the same address, shard i serving the slots with slot %% N == i "
        "(SO_REUSEPORT with a BPF steering program; Linux); counters are summed over the shards",
    )
    p.set_defaults(func=run)


def _shard_count(text: str) -> int:
    from softswitch.shards import MAX_SHARDS

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= n <= MAX_SHARDS:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_SHARDS}, got {n}")
    return n


def run(args: argparse.Namespace) -> int:
    if args.shards > 1:
        return run_sharded(args)
    switch = load_switch(args.config) if args.config else SoftSwitch()
    server = SoftSwitchServer(switch, parse_address(args.listen))
    host, port = server.address
    print(f"softswitch listening on {host}:{port} with jobs {sorted(switch.jobs)}", flush=True)
    p4rt = None
    if args.p4runtime:
        from softswitch.p4runtime_server import serve

        p4rt, p4rt_port, _ = serve(switch, args.p4runtime, port_key="address")
        print(f"P4Runtime on {args.p4runtime.rpartition(':')[0]}:{p4rt_port}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    server.start()
    try:
        while not done.wait(args.stats_every or 3600):
            if args.stats_every:
                stats = {j: switch.read_counters(j) for j in switch.jobs}
                print(json.dumps(stats), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if p4rt is not None:
            p4rt.stop(None)
    return 0


def run_sharded(args: argparse.Namespace) -> int:
    if args.p4runtime:
        msg = "--shards N > 1 cannot be combined with --p4runtime (P4Runtime would configure one shard)"
        print(f"lta softswitch: {msg}", file=sys.stderr)
        return 2
    from softswitch.shards import ShardedSoftSwitch

    report_every = min(1.0, args.stats_every) if args.stats_every > 0 else 1.0
    sharded = ShardedSoftSwitch(
        args.config, parse_address(args.listen), args.shards, report_every=report_every
    )
    try:
        sharded.start()
    except (OSError, RuntimeError) as exc:
        print(f"lta softswitch: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    host, port = sharded.address
    shards = f"{args.shards} shards, pids {sharded.pids}"
    print(f"softswitch listening on {host}:{port} with jobs {sharded.jobs} ({shards})", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sharded.done.set())
    try:
        while not sharded.done.wait(args.stats_every or 3600):
            if args.stats_every:
                print(json.dumps(sharded.totals()), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        sharded.stop()
    if args.stats_every:
        print(json.dumps(sharded.totals()), flush=True)  # the final counters, summed over the shards
    if sharded.error is not None:
        print(f"lta softswitch: {sharded.error}", file=sys.stderr)
        return 1
    return 0
