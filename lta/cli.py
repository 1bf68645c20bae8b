"""The one ``lta`` command. Each subcommand lives in the module that owns it and registers itself
through a ``register(subparsers)`` function; this file only lists those modules.

It is also the one error front: :func:`main` turns a user error (:class:`hostlib.errors.LtaError`)
into one line on stderr, ``lta COMMAND: error: MESSAGE`` (the innermost subcommand, ``lta ctl
apply: error: ...``; ``lta: error: ...`` before a command is known), and that error's exit status;
a bad command line into one line from the parser, in the same form (exit 2, see :mod:`lta.cliparse`);
Ctrl-C into a quiet exit 130 and a closed stdout (``lta ... | head``) into a quiet exit 141. Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys

from hostlib.errors import LtaError
from hostlib.lifetime import end_children_on_signals
from lta.cliparse import LtaArgumentParser
from lta.jsonout import version_line
from lta.progress import configure_logging, level_from

# Modules that define subcommands, in the order `lta --help` lists them.
SUBCOMMAND_MODULES = (
    "lta.train.cli",  # lta train
    "lta.demo",  # lta demo
    "lta.bench",  # lta bench allreduce | ddp | scaling | lossy | lossy-train
    "softswitch.cli",  # lta softswitch
    "softswitch.ps.cli",  # lta ps
    "controlplane.cli",  # lta ctl
    "lta.mininet_cli",  # lta mininet
    "lta.chaos.cli",  # lta chaos
    "lta.metrics_cli",  # lta metrics watch
)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
# Commands that start worker processes (their SIGTERM/SIGHUP ends the workers first: _run).
_LAUNCHERS = frozenset({"train", "demo", "chaos", "bench"})


def build_parser() -> argparse.ArgumentParser:
    parser = LtaArgumentParser(prog="lta", description="Loss-tolerant in-network gradient aggregation.")
    parser.add_argument("--version", action="version", version=version_line(), help="print versions and exit")
    parser.add_argument(
        "-v",
        "--verbose",
        dest="log_verbose",
        action="count",
        default=0,
        help="log more on stderr: -v info, -vv debug (default: warnings; or set LTA_LOG=info|debug|...)",
    )
    parser.add_argument(
        "-q", "--quiet", dest="log_quiet", action="count", default=0, help="log errors only, no progress"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only a module that is not there yet is skipped; a missing dependency inside it is a bug.
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``lta`` command line; returns the exit status."""
    prog = ["lta"]  # becomes "lta COMMAND" once the command line is parsed: the errors' prefix
    try:
        return _run(argv, prog)
    except LtaError as exc:
        print(f"{prog[0]}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Whoever read stdout has gone. Point stdout at /dev/null so that the interpreter's own final
        # flush does not fail again and print a complaint.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _run(argv: list[str] | None, prog: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad command line (already reported, one line)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.command:
        prog[0] = getattr(args, "command_prog", f"lta {args.command}")  # the innermost: "lta ctl apply"
    try:
        level = level_from(args.log_verbose, args.log_quiet, os.environ.get("LTA_LOG"))
    except ValueError as exc:
        print(f"lta: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(level)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    if args.command not in _LAUNCHERS:
        return int(args.func(args) or 0)
    # A launcher's workers end with it: SIGTERM/SIGHUP kill them at once (hostlib/lifetime.py; SIGKILL of
    # the launcher reaches them through their parent-death signal).
    replaced = end_children_on_signals()
    try:
        return int(args.func(args) or 0)
    finally:
        for sig, previous in replaced.items():
            signal.signal(sig, previous)


if __name__ == "__main__":
    sys.exit(main())
