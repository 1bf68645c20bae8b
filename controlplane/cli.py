"""``lta ctl``: configure LTA switches over P4Runtime (BMv2 or the softswitch's P4Runtime server).

lta ctl apply deploy.toml             make the switches match a deployment file
lta ctl load                          push the compiled pipeline (clears every job)
lta ctl job add 1 --port 1 --port 2   add a job (or --worker port=1,ip=10.0.0.1,mac=...,udp_port=...)
lta ctl job rm 1 | job reset 1 | job ls
lta ctl drop set 1 up bernoulli --p 0.05 [--worker 2]
lta ctl stats [--job 1] [--json]      per-job counters, one per branch of the switch contract
lta ctl watch [--interval 1]          counter rates, refreshed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from controlplane.errors import ControlPlaneError
from controlplane.session import DEFAULT_TARGET, DEFAULT_TIMEOUT_S
from hostlib.dropmodels import DIRECTIONS, DropPolicy
from hostlib.p4schema import describe
from hostlib.protocol import COUNTERS, LTA_PORT


def register(subparsers) -> None:
    ctl = subparsers.add_parser(
        "ctl",
        help="configure LTA switches over P4Runtime",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ctl.add_argument(
        "--target", default=DEFAULT_TARGET, help=f"switch P4Runtime address (default {DEFAULT_TARGET})"
    )
    ctl.add_argument("--device-id", type=int, default=0)
    ctl.add_argument("--election-id", type=int, default=1, help="election id (low word); highest is primary")
    ctl.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for the switch"
    )
    ctl.set_defaults(func=lambda args: ctl.print_help() or 2)
    sub = ctl.add_subparsers(dest="ctl_command", metavar="COMMAND")

    from controlplane import deployment

    apply = sub.add_parser(
        "apply",
        help="make the switches match a deployment file (TOML)",
        description=deployment.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    apply.add_argument("file", type=Path)
    apply.add_argument("--prune", action="store_true", help="also remove jobs the file does not list")
    apply.set_defaults(func=_guarded(_apply))

    load = sub.add_parser("load", help="push the compiled pipeline (P4Info + BMv2 JSON); clears every job")
    load.add_argument("--p4info", type=Path, default=None, help="default: p4/build/lta.p4info.txtpb")
    load.add_argument("--json", type=Path, default=None, help="default: p4/build/lta.json")
    load.set_defaults(func=_guarded(_load))

    job = sub.add_parser("job", help="add, remove, reset or list jobs")
    job.set_defaults(func=lambda args: job.print_help() or 2)
    job_sub = job.add_subparsers(dest="job_command", metavar="ACTION")
    add = job_sub.add_parser("add", help="add a job")
    add.add_argument("job_id", type=int)
    add.add_argument("--port", type=int, action="append", default=[], help="a worker's switch port (repeat)")
    add.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="port=P,ip=A,mac=M,udp_port=U",
        help="a worker with its addresses (repeat; worker ids follow the order given)",
    )
    add.add_argument("--quorum", type=int, default=None, help="close a round at this count (default: all)")
    add.add_argument("--pool-size", type=int, default=512, help="slots of the job")
    add.set_defaults(func=_guarded(_job_add))
    rm = job_sub.add_parser("rm", help="remove a job and its policies")
    rm.add_argument("job_id", type=int)
    rm.set_defaults(func=_guarded(_job_rm))
    reset = job_sub.add_parser("reset", help="forget every slot of a job and zero its counters")
    reset.add_argument("job_id", type=int)
    reset.set_defaults(func=_guarded(_job_reset))
    ls = job_sub.add_parser("ls", help="list jobs and drop policies")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_guarded(_job_ls))

    drop = sub.add_parser("drop", help="emulated-loss policies")
    drop.set_defaults(func=lambda args: drop.print_help() or 2)
    drop_sub = drop.add_subparsers(dest="drop_command", metavar="ACTION")
    dset = drop_sub.add_parser("set", help="set (or with model 'none' remove) a drop policy")
    dset.add_argument("job_id", type=int)
    dset.add_argument("direction", choices=DIRECTIONS)
    dset.add_argument("model", choices=("bernoulli", "gilbert_elliott", "none"))
    dset.add_argument("--p", type=float, default=0.0, help="loss (bernoulli) or good->bad probability")
    dset.add_argument("--r", type=float, default=1.0, help="bad->good probability (gilbert_elliott)")
    dset.add_argument("--loss-good", type=float, default=0.0)
    dset.add_argument("--loss-bad", type=float, default=1.0)
    dset.add_argument("--worker", type=int, default=None, help="only this worker (default: all)")
    dset.set_defaults(func=_guarded(_drop_set))

    stats = sub.add_parser("stats", help="per-job counters")
    stats.add_argument("--job", type=int, default=None, help="only this job (0: packets of no known job)")
    stats.add_argument("--all", action="store_true", help="also show counters that are zero")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.set_defaults(func=_guarded(_stats))

    watch = sub.add_parser("watch", help="counter rates (packets/s), refreshed until Ctrl-C")
    watch.add_argument("--job", type=int, default=None)
    watch.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    watch.add_argument("--count", type=int, default=0, help="stop after this many refreshes (0: never)")
    watch.set_defaults(func=_guarded(_watch))


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run a subcommand; a control-plane or input error becomes one line on stderr and exit status 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (ControlPlaneError, ValueError, FileNotFoundError) as exc:
            print(f"lta ctl: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130

    return run


def _connect(args: argparse.Namespace, **kw):
    from controlplane.switch import LtaSwitch  # late: `lta --help` need not load gRPC

    return LtaSwitch.connect(args.target, args.device_id, (0, args.election_id), args.timeout, **kw)


def _monitor(args: argparse.Namespace):
    """A read-only session: needs no arbitration, so it runs beside the controller that writes."""
    return _connect(args, read_only=True)


def _apply(args: argparse.Namespace) -> int:
    from controlplane import deployment

    deployment.apply(deployment.load(args.file), prune=args.prune, timeout_s=args.timeout)
    return 0


def _load(args: argparse.Namespace) -> int:
    from hostlib.p4schema import BMV2_JSON_PATH, P4INFO_PATH

    p4info, device_config = args.p4info or P4INFO_PATH, args.json or BMV2_JSON_PATH
    with _connect(args, p4info_path=p4info) as switch:
        switch.load_pipeline(device_config)
    print(f"loaded {p4info.name} + {device_config.name} on {args.target}")
    return 0


def _parse_worker(text: str):
    from controlplane.jobs import WorkerSpec

    fields = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if not value:
            raise ValueError(f"--worker {text!r}: write key=value pairs, e.g. port=1,ip=10.0.0.1")
        fields[key.strip()] = int(value) if key.strip() in ("port", "udp_port") else value.strip()
    return WorkerSpec.from_dict(fields)


def _job_add(args: argparse.Namespace) -> int:
    from controlplane.jobs import JobSpec, WorkerSpec

    workers = [WorkerSpec(port, ip=f"10.0.0.{port % 250 + 1}", udp_port=LTA_PORT) for port in args.port]
    workers += [_parse_worker(w) for w in args.worker]
    if not workers:
        raise ValueError("a job needs workers: --port P (repeat) or --worker port=P,ip=A,mac=M,udp_port=U")
    job = JobSpec(args.job_id, tuple(workers), quorum=args.quorum, pool_size=args.pool_size)
    with _connect(args) as switch:
        switch.check_pipeline()
        placed = switch.add_job(job)
    print(
        f"job {placed.job_id}: {placed.n_workers} workers, quorum {placed.quorum or placed.n_workers}, "
        f"slots {placed.slot_base}..{placed.slot_base + placed.pool_size - 1} on {args.target}"
    )
    return 0


def _job_rm(args: argparse.Namespace) -> int:
    with _connect(args) as switch:
        switch.check_pipeline()
        switch.remove_job(args.job_id)
    print(f"job {args.job_id} removed from {args.target}")
    return 0


def _job_reset(args: argparse.Namespace) -> int:
    with _connect(args) as switch:
        switch.check_pipeline()
        switch.reset_job(args.job_id)
    print(f"job {args.job_id} reset on {args.target}: slots forgotten, counters zeroed")
    return 0


def _job_ls(args: argparse.Namespace) -> int:
    with _monitor(args) as switch:
        switch.check_pipeline()
        jobs = switch.jobs()
        policies = switch.drop_policies()
    if args.json:
        out = {
            job_id: {
                "quorum": job.quorum,
                "pool_size": job.pool_size,
                "slot_base": job.slot_base,
                "workers": [vars(w) for w in job.workers],
                "drop": [{"direction": d, "worker": w, **vars(p)} for d, j, w, p in policies if j == job_id],
            }
            for job_id, job in sorted(jobs.items())
        }
        print(json.dumps(out, indent=2))
        return 0
    if not jobs:
        print(f"no jobs on {args.target} (lta ctl job add ... or lta ctl apply FILE)")
    for job_id, job in sorted(jobs.items()):
        ports = ", ".join(f"w{i}@{w.port}" for i, w in enumerate(job.workers))
        print(
            f"job {job_id}: quorum {job.quorum}/{job.n_workers}, slots {job.slot_base}.."
            f"{job.slot_base + job.pool_size - 1}, workers {ports}"
        )
        for direction, j, worker, policy in policies:
            if j == job_id:
                who = "all workers" if worker is None else f"worker {worker}"
                print(f"    drop {direction} ({who}): {describe(policy)}")
    return 0


def _drop_set(args: argparse.Namespace) -> int:
    policy = None
    if args.model != "none":
        policy = DropPolicy(args.model, p=args.p, r=args.r, loss_good=args.loss_good, loss_bad=args.loss_bad)
    with _connect(args) as switch:
        switch.check_pipeline()
        if args.job_id not in switch.jobs():
            raise ValueError(f"no job {args.job_id} on {args.target} (lta ctl job ls)")
        switch.set_drop_policy(args.job_id, args.direction, policy, args.worker)
    who = "all workers" if args.worker is None else f"worker {args.worker}"
    print(f"job {args.job_id} {args.direction} ({who}): {describe(policy) if policy else 'removed'}")
    return 0


def _counter_rows(counters: dict[int, dict[str, int]], show_zero: bool) -> tuple[list[int], list[str]]:
    jobs = sorted(j for j, c in counters.items() if show_zero or any(c.values()))
    names = [n for n in COUNTERS if show_zero or any(counters[j][n] for j in jobs)]
    return jobs, names


def format_counters(counters: dict[int, dict[str, int]], show_zero: bool = False) -> str:
    """A table: one row per counter, one column per job (job 0: packets of no known job)."""
    jobs, names = _counter_rows(counters, show_zero)
    if not jobs:
        return "no packets counted yet"
    width = max(len(n) for n in names)
    header = " " * width + "".join(f"{'job ' + str(j):>14}" for j in jobs)
    rows = [f"{n:<{width}}" + "".join(f"{counters[j][n]:>14}" for j in jobs) for n in names]
    return "\n".join([header, *rows])


def _stats(args: argparse.Namespace) -> int:
    with _monitor(args) as switch:
        switch.check_pipeline()
        counters = switch.read_counters(args.job)
    if args.json:
        print(json.dumps({str(j): c for j, c in sorted(counters.items())}, indent=2))
    else:
        print(format_counters(counters, show_zero=args.all or args.job is not None))
    return 0


def _watch(args: argparse.Namespace) -> int:
    with _monitor(args) as switch:
        switch.check_pipeline()
        before, t0 = switch.read_counters(args.job), time.monotonic()
        refreshes = 0
        while not args.count or refreshes < args.count:
            time.sleep(args.interval)
            now, t1 = switch.read_counters(args.job), time.monotonic()
            rates = {
                j: {n: round((now[j][n] - before.get(j, {}).get(n, 0)) / (t1 - t0), 1) for n in COUNTERS}
                for j in now
            }
            print(f"--- {time.strftime('%H:%M:%S')}  packets/s over {t1 - t0:.1f} s on {args.target}")
            print(format_counters(rates))
            before, t0 = now, t1
            refreshes += 1
    return 0
