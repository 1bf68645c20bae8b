"""``lta softswitch``: run the reference switch as a UDP daemon."""

from __future__ import annotations

import argparse
import errno
import json
import signal
import sys
import threading

from hostlib import argtypes
from hostlib.errors import AddressInUseError, LtaError, UsageError
from hostlib.jobconfig import JobFile, load_jobs
from hostlib.protocol import LTA_PORT
from softswitch.config import build_switch, softswitch_jobs
from softswitch.pipeline import SoftSwitch
from softswitch.server import SoftSwitchServer

# Nothing here imports gRPC at import time: `lta --help` works without the p4rt extra.


def status(line: str) -> None:
    """A line about the daemon (where it listens), on stderr: stdout carries the stats JSON only, so
    ``lta softswitch --stats-every 5 | jq`` reads nothing else."""
    print(line, file=sys.stderr, flush=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "softswitch",
        help="run the reference switch as a UDP daemon",
        description="Run the reference switch as a UDP daemon. Its jobs come from a jobs file (--config; "
        "the format lta ctl apply reads, docs/jobs_file.md) and/or from lta ctl (--p4runtime).",
    )
    p.add_argument(
        "--listen",
        type=argtypes.listen_address,
        default=("127.0.0.1", LTA_PORT),
        metavar="HOST:PORT",
        help=f"UDP address workers send to; port 0: a free one, printed on stderr "
        f"(default: 127.0.0.1:{LTA_PORT})",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="jobs file (TOML): jobs, workers and drop policies (docs/jobs_file.md)",
    )
    p.add_argument(
        "--p4runtime",
        type=argtypes.address_text,
        metavar="HOST:PORT",
        help="also serve P4Runtime here, with LTA's pipeline loaded and the --config jobs installed, so "
        "`lta ctl --target HOST:PORT` lists and changes them (needs the p4rt extra)",
    )
    p.add_argument(
        "--stats-every",
        type=argtypes.float_range(0.0, low_open=True, what="interval"),
        default=None,
        metavar="SECONDS",
        help="print the counters as JSON every SECONDS (> 0; default: never)",
    )
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
    """``lta softswitch``: serve until SIGTERM (exit 0) or Ctrl-C (KeyboardInterrupt, exit 130 in ``lta``).
    A bad jobs file, an occupied port or a missing extra raise :class:`LtaError` before anything serves."""
    if args.p4runtime:
        from hostlib.extras import require_p4rt

        require_p4rt("lta softswitch --p4runtime")
    if args.shards > 1 and args.p4runtime:
        raise UsageError(
            "--shards N > 1 cannot be combined with --p4runtime (P4Runtime would configure one shard)"
        )
    if args.shards > 1 and args.listen[1] == 0:
        raise UsageError("--shards N > 1 share one UDP port: name it (--listen HOST:PORT, PORT > 0)")
    job_file = load_jobs(args.config) if args.config else JobFile("<none>")
    jobs = softswitch_jobs(job_file)
    if args.shards > 1:
        return run_sharded(args)
    # With P4Runtime the jobs go in as table entries (install_jobs), so that lta ctl sees them.
    switch = SoftSwitch(seed=job_file.seed) if args.p4runtime else build_switch(job_file)
    try:
        server = SoftSwitchServer(switch, args.listen)
    except OSError as exc:
        error = AddressInUseError if exc.errno == errno.EADDRINUSE else LtaError
        raise error(f"{exc} (is another softswitch there? pick another --listen HOST:PORT)") from None
    p4rt = None
    try:
        if args.p4runtime:
            from softswitch.p4runtime_server import serve

            try:
                p4rt, _, _ = serve(switch, args.p4runtime, port_key="address", load_pipeline=True, jobs=jobs)
            except OSError as exc:
                raise LtaError(str(exc)) from None
            except ValueError as exc:
                raise job_file.error("[[jobs]]", str(exc)) from None
        host, port = server.address
        status(f"softswitch listening on {host}:{port} with jobs {sorted(switch.jobs)}")
        if p4rt is not None:
            status(f"P4Runtime on {args.p4runtime} with LTA's pipeline loaded")
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        server.start()
        while not done.wait(args.stats_every or 3600):
            if args.stats_every:
                stats = {j: switch.read_counters(j) for j in switch.jobs}
                print(json.dumps(stats), flush=True)
    finally:
        server.stop()
        if p4rt is not None:
            p4rt.stop(None)
    if args.stats_every:
        print(json.dumps({j: switch.read_counters(j) for j in switch.jobs}), flush=True)  # the final counters
    return 0


def run_sharded(args: argparse.Namespace) -> int:
    from softswitch.shards import ShardedSoftSwitch

    report_every = min(1.0, args.stats_every) if args.stats_every else 1.0
    sharded = ShardedSoftSwitch(args.config, args.listen, args.shards, report_every=report_every)
    try:
        try:
            sharded.start()
        except (OSError, RuntimeError) as exc:
            raise LtaError(str(exc)) from None
        host, port = sharded.address or args.listen
        shards = f"{args.shards} shards, pids {sharded.pids}"
        status(f"softswitch listening on {host}:{port} with jobs {sharded.jobs} ({shards})")
        signal.signal(signal.SIGTERM, lambda *_: sharded.done.set())
        while not sharded.done.wait(args.stats_every or 3600):
            if args.stats_every:
                print(json.dumps(sharded.totals()), flush=True)
    finally:
        sharded.stop()
    if args.stats_every:
        print(json.dumps(sharded.totals()), flush=True)  # the final counters, summed over the shards
    if sharded.error is not None:
        raise LtaError(f"a shard failed: {sharded.error}")
    return 0
