"""``lta ps``: run the parameter server as a UDP daemon (one job from flags, or the jobs of a TOML file).

Examples::

    lta ps --listen 127.0.0.1:48879 --job-id 1 --workers 4 --mode async --max-staleness 4 --adaptive-staleness
    lta ps --job-id 1 --workers 7 --mode sync --rule krum --f 2 --drop-up 0.1
    lta ps --config ps.toml --stats-every 5

Stats (counters, rejection rate, mean staleness, per-worker staleness bounds) are printed to stdout
as one JSON document per line every ``--stats-every`` seconds and once more when the daemon stops.
"""

from __future__ import annotations

import argparse
import errno
import json
import signal
import sys
import threading

from hostlib import argtypes
from hostlib.emulation.dropmodels import DropPolicy
from hostlib.errors import AddressInUseError, LtaError, UsageError
from hostlib.protocol import LTA_PORT, MAX_ELEMS_PER_PACKET, MAX_JOBS
from hostlib.ps import robust
from hostlib.ps.compress import COMPRESSORS
from softswitch.ps.config import FALLBACKS, JOB_KEYS, MODES, PsDrop, PsJobConfig, load_ps_config
from softswitch.ps.server import PsServer
from softswitch.ps.staleness import StalenessConfig

# Flags that describe the one job made without --config (None: not given, the job's default applies).
_JOB_FLAGS = tuple(key for key in JOB_KEYS if key != "drop") + ("drop_up", "drop_down")
_STALENESS_FLAGS = {
    "max_staleness": "max_staleness",
    "adaptive_staleness": "adaptive",
    "min_staleness": "min_staleness",
    "max_staleness_multiplier": "max_staleness_multiplier",
    "ewma_alpha": "ewma_alpha",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ps",
        help="run the parameter server (sync windows, async staleness, robust rules) as a UDP daemon",
        description="The parameter-server mode of the software path: holds a job's parameters, applies "
        "SGD with momentum to the gradients workers push, and serves parameters (docs/protocol.md, "
        "'Parameter-server mode'). One job from the flags, or the jobs of --config FILE.",
    )
    p.add_argument(
        "--listen",
        type=argtypes.listen_address_text,
        default=f"127.0.0.1:{LTA_PORT}",
        metavar="HOST:PORT",
        help="UDP address workers send to; port 0: a free one, printed on stderr",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="jobs file (TOML; docs/jobs_file.md, 'Parameter-server jobs'); excludes the job flags",
    )
    p.add_argument("--seed", type=argtypes.nonnegative_int, default=0, help="seeds the emulated loss")
    p.add_argument(
        "--stats-every",
        type=argtypes.float_range(0.0, what="seconds"),
        default=0.0,
        help="print the stats JSON every N seconds (0: only when stopping)",
    )
    job = p.add_argument_group("one job (without --config)")
    job.add_argument(
        "--job-id", type=argtypes.int_range(1, MAX_JOBS - 1, "job id"), help="job id (default 1)"
    )
    job.add_argument("--workers", type=argtypes.workers, help="worker count (default 1)")
    job.add_argument(
        "--mode", choices=MODES, help="sync (windows) or async (bounded staleness); default sync"
    )
    job.add_argument(
        "--elems-per-packet",
        type=argtypes.int_range(1, MAX_ELEMS_PER_PACKET, "elements per packet"),
        help="K, lanes per packet (default 64)",
    )
    job.add_argument("--n-params", type=argtypes.positive_int, help="refuse an INIT of another size")
    job.add_argument(
        "--lr", type=argtypes.positive_float, help="learning rate when a push carries none (0.01)"
    )
    job.add_argument(
        "--momentum",
        type=argtypes.float_range(0.0, 0.999999, what="momentum"),
        help="SGD momentum (default 0)",
    )
    job.add_argument("--compression", choices=[*COMPRESSORS, "quantize"], help="push encoding (default none)")
    job.add_argument("--window-size", type=argtypes.workers, help="sync: finished pushes that close a step")
    job.add_argument("--max-wait-s", type=argtypes.positive_float, help="sync: window deadline (default 1.0)")
    job.add_argument(
        "--liveness-timeout-s",
        type=argtypes.float_range(0.0, what="liveness timeout"),
        help="sync: a worker silent this long is not waited for; a restarted worker may rejoin from a new "
        "address after it (default 3.0; 0: never)",
    )
    job.add_argument("--rule", choices=robust.RULES, help="sync: aggregation rule (default mean)")
    job.add_argument(
        "--f", type=argtypes.nonnegative_int, help="sync: Byzantine workers the rule must tolerate"
    )
    job.add_argument(
        "--trim-ratio",
        type=argtypes.float_range(0.0, 0.49999, what="trim ratio"),
        help="sync: trimmed_mean's share cut on each side (default 0.1)",
    )
    job.add_argument("--multi-krum-m", type=argtypes.positive_int, help="sync: rows Multi-Krum averages")
    job.add_argument(
        "--fallback", choices=FALLBACKS, help="sync: too few arrived for the rule (default median)"
    )
    job.add_argument(
        "--max-staleness", type=argtypes.nonnegative_int, help="async: staleness bound (default 5)"
    )
    job.add_argument(
        "--adaptive-staleness", action="store_const", const=True, help="async: per-worker bounds from speed"
    )
    job.add_argument("--min-staleness", type=argtypes.nonnegative_int, help="async: adaptive lower clamp (1)")
    job.add_argument(
        "--max-staleness-multiplier",
        type=argtypes.float_range(1.0, what="multiplier"),
        help="async: adaptive upper clamp is max_staleness x this (default 10)",
    )
    job.add_argument(
        "--ewma-alpha",
        type=argtypes.float_range(0.0, 1.0, low_open=True, what="alpha"),
        help="async: smoothing of submission intervals (default 0.2)",
    )
    job.add_argument("--drop-up", type=argtypes.probability, help="emulated Bernoulli loss of PUSH packets")
    job.add_argument(
        "--drop-down", type=argtypes.probability, help="emulated Bernoulli loss of PARAM packets"
    )
    p.set_defaults(func=run)


def job_from_flags(args: argparse.Namespace) -> PsJobConfig:
    """The one job the flags describe (defaults: PsJobConfig's)."""
    given = {name: getattr(args, name) for name in _JOB_FLAGS if getattr(args, name) is not None}
    stale = {_STALENESS_FLAGS[k]: given.pop(k) for k in list(given) if k in _STALENESS_FLAGS}
    drops = tuple(
        PsDrop(direction, DropPolicy(p=given.pop(f"drop_{direction}")))
        for direction in ("up", "down")
        if f"drop_{direction}" in given
    )
    try:
        staleness = StalenessConfig(**stale)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return PsJobConfig(
        job_id=given.pop("job_id", 1),
        n_workers=given.pop("workers", 1),
        staleness=staleness,
        drops=drops,
        **given,
    )


def run(args: argparse.Namespace) -> int:
    if args.config:
        flags = [f"--{n.replace('_', '-')}" for n in _JOB_FLAGS if getattr(args, n) is not None]
        if flags:
            raise UsageError(f"--config FILE describes the jobs; drop {', '.join(flags)}")
        seed, jobs = load_ps_config(args.config)
    else:
        seed, jobs = args.seed, [job_from_flags(args)]
    host, _, port = args.listen.rpartition(":")
    try:
        server = PsServer((host, int(port)), seed=seed)
    except OSError as exc:
        error = AddressInUseError if exc.errno == errno.EADDRINUSE else LtaError
        raise error(
            f"{exc} (is another lta ps or softswitch on that port? pick another with --listen)"
        ) from None
    for cfg in jobs:
        server.add_job(cfg)
    listen_host, listen_port = server.address
    described = ", ".join(f"{c.job_id} ({c.mode}, {c.n_workers} workers)" for c in jobs)
    # stderr: stdout carries the stats JSON only (lta ps ... | jq)
    print(
        f"parameter server listening on {listen_host}:{listen_port} with jobs {described}",
        file=sys.stderr,
        flush=True,
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    server.start()
    try:
        while not done.wait(args.stats_every or 3600):
            if args.stats_every:
                print(json.dumps(server.stats()), flush=True)
    finally:  # SIGTERM (exit 0) or Ctrl-C (KeyboardInterrupt: lta exits 130): the final stats either way
        server.stop()
        print(json.dumps(server.stats()), flush=True)
    return 0
