"""``lta softswitch``: run the reference switch as a UDP daemon."""

from __future__ import annotations

import argparse
import json
import signal
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
