"""``lta ctl``: configure LTA switches over P4Runtime (BMv2 or the softswitch's P4Runtime server).

lta ctl apply jobs.toml               make the switches hold the jobs of a jobs file (the format
                                      `lta softswitch --config` reads: docs/jobs_file.md)
lta ctl load [--force]                push the compiled pipeline (refused while jobs are installed)
lta ctl job add 1 --port 1 --port 2   add a job (or --worker port=1,ip=10.0.0.1,mac=...,udp_port=...)
lta ctl job rm 1 | job reset 1 | job ls
lta ctl drop set 1 up bernoulli --p 0.05 [--worker 2]
lta ctl stats [--job 1] [--all] [--json]   per-job counters, one per branch of the switch contract
lta ctl watch [--interval 1]          counter rates, refreshed
lta ctl liveness 1 [--timeout 3]      mark silent workers offline and lower the quorum while they
                                      are; restore it when they send again
lta ctl bfrt jobs.toml                the BfRt writes that install a jobs file on a Tofino (JSON lines,
                                      ids and widths from p4/tofino/build/bf-rt.json)

Talking to a switch needs the p4rt extra: pip install 'lta[p4rt]'.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controlplane import DEFAULT_TARGET, DEFAULT_TIMEOUT_S
from controlplane.errors import ControlPlaneError
from controlplane.jobs import DEFAULT_POOL_SIZE
from hostlib import argtypes
from hostlib.emulation.dropmodels import DIRECTIONS, DropPolicy
from hostlib.errors import LtaError, UsageError
from hostlib.extras import require_p4rt
from hostlib.jobconfig import MAX_SWITCH_PORT, WorkerEntry
from hostlib.p4.schema import describe
from hostlib.protocol import COUNTERS, MAX_JOBS, MAX_WORKERS

# Nothing in this module imports gRPC, protobuf or the P4Runtime bindings at import time: `lta --help` and
# `lta ctl --help` work without the p4rt extra, and a command says it needs it (_connect).

_job_id = argtypes.int_range(1, MAX_JOBS - 1, "job id")
_worker_id = argtypes.int_range(0, MAX_WORKERS - 1, "worker id")
_WORKER_DEFAULTS = "for worker w, ip 10.0.0.(w+1),\nmac 02:00:00:00:00:(w+1) and udp_port 40000+w"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and shows each flag's default (unless there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or default is None or default is False or default == []:
            return text
        return super()._get_help_string(action) or ""


def _plain(doc: str | None) -> str:
    """A docstring as --help shows it: no reStructuredText markup."""
    return (doc or "").replace("``", "").replace("::\n", ":\n")


def _parser(sub: Any, name: str, **kw: Any) -> argparse.ArgumentParser:
    return sub.add_parser(name, formatter_class=_HelpFormatter, **kw)


def _help_of(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """A command without its subcommand: its help on stderr, exit status 2."""

    def show(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return show


def register(subparsers: Any) -> None:
    ctl = _parser(
        subparsers, "ctl", help="configure LTA switches over P4Runtime", description=_plain(__doc__)
    )
    ctl.add_argument(
        "--target",
        type=argtypes.address_text,
        default=DEFAULT_TARGET,
        help="the switch's P4Runtime HOST:PORT",
    )
    ctl.add_argument("--device-id", type=argtypes.nonnegative_int, default=0, help="P4Runtime device id")
    ctl.add_argument(
        "--election-id",
        type=argtypes.positive_int,
        default=1,
        help="election id (low word) of writing commands; the highest one is primary",
    )
    ctl.add_argument(
        "--timeout",
        type=argtypes.positive_float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds to wait for the switch",
    )
    ctl.set_defaults(func=_help_of(ctl))
    sub = ctl.add_subparsers(dest="ctl_command", metavar="COMMAND")

    from controlplane import deployment

    apply = _parser(
        sub,
        "apply",
        help="make the switches hold the jobs of a jobs file (TOML)",
        description=_plain(deployment.__doc__),
    )
    apply.add_argument("file", type=Path, help="the jobs file")
    apply.add_argument("--prune", action="store_true", help="also remove jobs the file does not list")
    apply.set_defaults(func=_guarded(_apply))

    load = _parser(
        sub,
        "load",
        help="push the compiled pipeline (P4Info + BMv2 JSON); refused while jobs are installed",
        description="Push the compiled pipeline. Loading clears every job and policy, so it is refused\n"
        "while the switch holds jobs or runs another program, unless --force.",
    )
    load.add_argument(
        "--p4info", type=Path, default=None, help="the P4Info (default: p4/build/lta.p4info.txtpb)"
    )
    load.add_argument("--json", type=Path, default=None, help="the BMv2 program (default: p4/build/lta.json)")
    load.add_argument(
        "--force", action="store_true", help="load even though it removes the jobs the switch holds"
    )
    load.set_defaults(func=_guarded(_load))

    job = _parser(sub, "job", help="add, remove, reset or list jobs")
    job.set_defaults(func=_help_of(job))
    job_sub = job.add_subparsers(dest="job_command", metavar="ACTION")
    add = _parser(
        job_sub,
        "add",
        help="add a job",
        description="Add a job. Give its workers, in worker-id order, either as --port P (repeat) or as\n"
        "--worker port=P,... (repeat). Addresses left out: " + _WORKER_DEFAULTS + ".",
    )
    add.add_argument("job_id", type=_job_id, help="the job's id, 1..63")
    add.add_argument(
        "--port",
        type=argtypes.int_range(0, MAX_SWITCH_PORT, "port"),
        action="append",
        default=[],
        help="worker w's switch port (repeat, one per worker); its addresses are the defaults",
    )
    add.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="port=P[,ip=A,mac=M,udp_port=U]",
        help="a worker with its addresses (repeat; worker ids follow the order given); port is required",
    )
    add.add_argument(
        "--quorum",
        type=argtypes.int_range(1, MAX_WORKERS, "quorum"),
        default=None,
        help="close a round at this count (default: all workers)",
    )
    add.add_argument(
        "--pool-size",
        type=argtypes.int_range(1, 65535, "pool size"),
        default=DEFAULT_POOL_SIZE,
        help="slots of the job",
    )
    add.set_defaults(func=_guarded(_job_add))
    rm = _parser(job_sub, "rm", help="remove a job and its policies")
    rm.add_argument("job_id", type=_job_id, help="the job's id")
    rm.set_defaults(func=_guarded(_job_rm))
    reset = _parser(job_sub, "reset", help="forget every slot of a job and zero its counters")
    reset.add_argument("job_id", type=_job_id, help="the job's id")
    reset.set_defaults(func=_guarded(_job_reset))
    ls = _parser(job_sub, "ls", help="list jobs and drop policies")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=_guarded(_job_ls))

    drop = _parser(sub, "drop", help="emulated-loss policies")
    drop.set_defaults(func=_help_of(drop))
    drop_sub = drop.add_subparsers(dest="drop_command", metavar="ACTION")
    dset = _parser(drop_sub, "set", help="set (or with model 'none' remove) a drop policy")
    dset.add_argument("job_id", type=_job_id, help="the job's id")
    dset.add_argument("direction", choices=DIRECTIONS, help="up = GRAD, down = RESULT, param = PARAM")
    dset.add_argument("model", choices=("bernoulli", "gilbert_elliott", "none"), help="the loss model")
    dset.add_argument(
        "--p", type=argtypes.probability, default=0.0, help="loss (bernoulli) or good->bad probability"
    )
    dset.add_argument(
        "--r", type=argtypes.probability, default=1.0, help="bad->good probability (gilbert_elliott)"
    )
    dset.add_argument("--loss-good", type=argtypes.probability, default=0.0, help="loss in the good state")
    dset.add_argument("--loss-bad", type=argtypes.probability, default=1.0, help="loss in the bad state")
    dset.add_argument("--worker", type=_worker_id, default=None, help="only this worker (default: all)")
    dset.set_defaults(func=_guarded(_drop_set))

    stats = _parser(sub, "stats", help="per-job counters")
    stats.add_argument(
        "--job",
        type=argtypes.int_range(0, MAX_JOBS - 1, "job id"),
        default=None,
        help="only this job (0: packets of no known job; default: every job)",
    )
    stats.add_argument("--all", action="store_true", help="also show counters that are zero")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.set_defaults(func=_guarded(_stats))

    watch = _parser(sub, "watch", help="counter rates (packets/s), refreshed until Ctrl-C")
    watch.add_argument(
        "--job", type=argtypes.int_range(0, MAX_JOBS - 1, "job id"), default=None, help="only this job"
    )
    watch.add_argument(
        "--interval", type=argtypes.positive_float, default=1.0, help="seconds between refreshes"
    )
    watch.add_argument(
        "--count", type=argtypes.nonnegative_int, default=0, help="stop after this many refreshes (0: never)"
    )
    watch.set_defaults(func=_guarded(_watch))

    live = _parser(
        sub,
        "liveness",
        help="mark silent workers offline and lower the job's quorum while they are offline",
        description="Watch one job's per-worker packet counters (workers heartbeat every 0.5 s by\n"
        "default). A worker whose counter has not moved for --timeout seconds is offline: the job's\n"
        "quorum becomes min(--quorum, live workers), so the others stop waiting for it at every\n"
        "step. When it sends again it is online and the quorum goes back up. One line per event\n"
        "(--json: one JSON object per line). On exit the configured quorum is restored.",
    )
    live.add_argument("job_id", type=_job_id, help="the job to watch")
    live.add_argument(
        "--timeout",
        type=argtypes.positive_float,
        default=3.0,
        help="seconds without a packet before a worker is offline (keep it above the heartbeat interval)",
    )
    live.add_argument(
        "--poll", type=argtypes.positive_float, default=0.25, help="seconds between counter reads"
    )
    live.add_argument(
        "--quorum",
        type=argtypes.int_range(1, MAX_WORKERS, "quorum"),
        default=None,
        help="the quorum with every worker live (default: the job's quorum now)",
    )
    live.add_argument(
        "--for",
        dest="duration",
        type=argtypes.positive_float,
        default=None,
        metavar="SECONDS",
        help="stop after this long (default: until Ctrl-C)",
    )
    live.add_argument("--json", action="store_true", help="one JSON object per event")
    live.set_defaults(func=_guarded(_liveness))

    bfrt = _parser(
        sub,
        "bfrt",
        help="print the BfRt writes that install a jobs file on a Tofino (JSON lines)",
        description="Print, one JSON object per line, every BfRt write that installs the jobs and drop\n"
        "policies of a jobs file on an empty Tofino running p4/tofino: multicast nodes and group\n"
        "($pre.node, $pre.mgid), worker and job entries, counter clears, policies. Table, action and\n"
        "field ids and value widths come from the compiled program's bf-rt.json; values are hex.\n"
        "Nothing is sent: a BfRt client (the SDE's bfrt_grpc) sends them one to one.",
    )
    bfrt.add_argument("file", type=Path, help="the jobs file")
    bfrt.add_argument("--bfrt-json", type=Path, default=None, help="default: p4/tofino/build/bf-rt.json")
    bfrt.set_defaults(func=_guarded(_bfrt))


def _bfrt(args: argparse.Namespace) -> int:
    from controlplane import deployment, tofino

    plan = deployment.load(args.file, target=args.target, device_id=args.device_id)
    schema = tofino.BfrtSchema.load(args.bfrt_json or tofino.BFRT_PATH)
    for switch, jobs in plan.jobs.items():
        for write in tofino.deployment_writes(schema, jobs, plan.drops[switch]):
            print(json.dumps({"switch": switch, **write}))
    return 0


def _liveness(args: argparse.Namespace) -> int:
    from hostlib.liveness import LivenessMonitor

    with _connect(args) as switch:
        switch.check_pipeline()
        job = switch.jobs().get(args.job_id)
        if job is None:
            raise ControlPlaneError(f"no job {args.job_id} on {args.target} (lta ctl job ls lists them)")
        quorum = args.quorum or job.quorum or job.n_workers
        if quorum > job.n_workers:
            raise UsageError(f"--quorum {quorum}: job {args.job_id} has {job.n_workers} workers")

        def show(event: Any) -> None:
            if args.json:
                print(json.dumps({"time": time.time(), **vars(event)}), flush=True)
            else:
                print(f"{time.strftime('%H:%M:%S')} {event.describe()}", flush=True)

        monitor = LivenessMonitor(
            switch,
            args.job_id,
            job.n_workers,
            quorum=quorum,
            timeout_s=args.timeout,
            poll_s=args.poll,
            on_event=show,
        )
        if not args.json:
            print(
                f"watching job {args.job_id} on {args.target}: {job.n_workers} workers, quorum {quorum}, "
                f"offline after {args.timeout:g} s without a packet",
                flush=True,
            )
        end = None if args.duration is None else time.monotonic() + args.duration
        try:
            while end is None or time.monotonic() < end:
                time.sleep(args.poll if end is None else max(0.0, min(args.poll, end - time.monotonic())))
                monitor.poll()
        finally:
            monitor.stop(restore_quorum=True)
    return 0


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run a subcommand. A bad value (ValueError) or an unreadable file (OSError) is a user error:
    raised as :class:`LtaError`, which ``lta`` prints as one line with a non-zero exit status (control
    plane errors are LtaErrors already)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except LtaError:
            raise
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except OSError as exc:
            raise LtaError(str(exc)) from None

    return run


def _connect(args: argparse.Namespace, **kw: Any) -> Any:
    require_p4rt("lta ctl")
    from controlplane.switch import LtaSwitch  # late: `lta --help` need not load gRPC

    return LtaSwitch.connect(args.target, args.device_id, (0, args.election_id), args.timeout, **kw)


def _monitor(args: argparse.Namespace) -> Any:
    """A read-only session: needs no arbitration, so it runs beside the controller that writes."""
    return _connect(args, read_only=True)


def _apply(args: argparse.Namespace) -> int:
    from controlplane import deployment

    plan = deployment.load(args.file, target=args.target, device_id=args.device_id)
    require_p4rt("lta ctl")
    deployment.apply(plan, prune=args.prune, timeout_s=args.timeout, log=print)
    return 0


def _load(args: argparse.Namespace) -> int:
    from hostlib.p4.schema import BMV2_JSON_PATH, P4INFO_PATH

    p4info, device_config = args.p4info or P4INFO_PATH, args.json or BMV2_JSON_PATH
    with _connect(args, p4info_path=p4info) as switch:
        state = switch.pipeline_state()
        if state == "other" and not args.force:
            raise ControlPlaneError(
                f"switch at {args.target} runs another P4 program; loading ours replaces it and its "
                f"state: lta ctl load --force"
            )
        if state == "ours" and not args.force:
            jobs = sorted(switch.jobs())
            if jobs:
                raise ControlPlaneError(
                    f"switch at {args.target} holds jobs {', '.join(map(str, jobs))}; loading the pipeline "
                    f"removes them: remove them first (lta ctl job rm ID) or lta ctl load --force"
                )
        switch.load_pipeline(device_config)
    print(f"loaded {p4info.name} + {device_config.name} on {args.target}")
    return 0


_WORKER_KEYS = ("port", "ip", "mac", "udp_port")


def _parse_worker(text: str) -> WorkerEntry:
    """``--worker port=1,ip=10.0.0.1,...`` as a jobs-file worker (ranges are checked by WorkerSpec)."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = (x.strip() for x in part.partition("="))
        if not eq or not key or not value:
            raise UsageError(f"--worker {text!r}: write key=value pairs, e.g. port=1,ip=10.0.0.1")
        if key not in _WORKER_KEYS:
            raise UsageError(f"--worker {text!r}: unknown key {key!r}; allowed: {', '.join(_WORKER_KEYS)}")
        if key in fields:
            raise UsageError(f"--worker {text!r}: {key} given twice")
        fields[key] = value
    numbers: dict[str, int] = {}
    for key in ("port", "udp_port"):
        if key in fields:
            try:
                numbers[key] = int(fields[key])
            except ValueError:
                raise UsageError(
                    f"--worker {text!r}: {key} must be an integer, got {fields[key]!r}"
                ) from None
    return WorkerEntry(
        ip=fields.get("ip"), udp_port=numbers.get("udp_port"), port=numbers.get("port"), mac=fields.get("mac")
    )


def _job_add(args: argparse.Namespace) -> int:
    from controlplane.jobs import JobSpec, WorkerSpec, check_distinct_addresses

    if args.port and args.worker:
        raise UsageError(
            "give the workers either as --port P (repeat) or as --worker port=P,... (repeat), not both: "
            "worker ids follow the order given"
        )
    if not args.port and not args.worker:
        raise UsageError("a job needs workers: --port P (repeat) or --worker port=P,ip=A,mac=M,udp_port=U")
    given = [(f"--port {p}", WorkerEntry(port=p)) for p in args.port]
    given += [(f"--worker {text!r}", _parse_worker(text)) for text in args.worker]
    workers = []
    for w, (flag, entry) in enumerate(given):
        try:
            workers.append(WorkerSpec.from_entry(entry, w))
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    check_distinct_addresses(tuple(workers))
    if args.quorum is not None and args.quorum > len(workers):
        raise UsageError(f"--quorum {args.quorum}: the job has {len(workers)} workers")
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
        packets = {job_id: switch.read_worker_rx(job_id, job.n_workers) for job_id, job in jobs.items()}
    if args.json:
        out = {
            job_id: {
                "quorum": job.quorum,
                "pool_size": job.pool_size,
                "slot_base": job.slot_base,
                "workers": [{**vars(w), "packets": packets[job_id][i]} for i, w in enumerate(job.workers)],
                "drop": [{"direction": d, "worker": w, **vars(p)} for d, j, w, p in policies if j == job_id],
            }
            for job_id, job in sorted(jobs.items())
        }
        print(json.dumps(out, indent=2))
        return 0
    if not jobs:
        print(f"no jobs on {args.target} (lta ctl job add ... or lta ctl apply FILE)")
    for job_id, job in sorted(jobs.items()):
        print(
            f"job {job_id}: quorum {job.quorum}/{job.n_workers}, slots {job.slot_base}.."
            f"{job.slot_base + job.pool_size - 1}"
        )
        for i, w in enumerate(job.workers):
            print(
                f"    worker {i}: port {w.port}, {w.ip}:{w.udp_port}, mac {w.mac}, "
                f"{packets[job_id][i]} packets received"
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


def _cell(value: float) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def format_counters(
    counters: dict[int, dict[str, Any]], show_zero: bool = False, jobs: list[int] | None = None
) -> str:
    """A table: one row per counter, one column per job, each column as wide as its widest cell.

    Columns: the jobs in ``jobs`` (those installed) and any other index that counted something (index 0,
    "no job", counts packets of no known job). Rows: the counters that are non-zero in some column, or
    every counter with ``show_zero``."""
    shown = set(jobs or ()) | {j for j, c in counters.items() if any(c.values())}
    columns = sorted(j for j in shown if j in counters)
    names = [n for n in COUNTERS if show_zero or any(counters[j][n] for j in columns)]
    if not columns or not names:
        return "no packets counted yet"
    headers = ["counter"] + ["no job" if j == 0 else f"job {j}" for j in columns]
    body = [[n] + [_cell(counters[j][n]) for j in columns] for n in names]
    widths = [max(len(row[i]) for row in [headers, *body]) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(cells)

    return "\n".join(line(row) for row in [headers, *body])


def _stats(args: argparse.Namespace) -> int:
    with _monitor(args) as switch:
        switch.check_pipeline()
        counters = switch.read_counters(args.job)
        installed = sorted(switch.jobs())
    if args.json:
        print(json.dumps({str(j): c for j, c in sorted(counters.items())}, indent=2))
        return 0
    if args.job is not None:
        installed = [args.job]
    print(format_counters(counters, show_zero=args.all or args.job is not None, jobs=installed))
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
