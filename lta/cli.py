"""The one ``lta`` command. Each subcommand lives in the module that owns it and registers itself
through a ``register(subparsers)`` function; this file only lists those modules."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that define subcommands, in the order `lta --help` lists them.
SUBCOMMAND_MODULES = (
    "lta.train.cli",  # lta train
    "lta.demo",  # lta demo
    "lta.bench",  # lta bench allreduce | scaling | lossy | lossy-train
    "softswitch.cli",  # lta softswitch
    "controlplane.cli",  # lta ctl
    "lta.mininet_cli",  # lta mininet
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lta", description="Loss-tolerant in-network gradient aggregation.")
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
