"""The flags every benchmark shares, declared once.

- :func:`bench_command`: one ``lta bench NAME`` subcommand, with ``--json`` and what it runs;
- :func:`script_parser`: the parser of a study run as ``python -m lta.bench.NAME``, with ``--json``;
- :func:`add_workers`: ``--workers`` (its range and help are each bench's own: ranks, namespaces,
  simulated workers, a comma list).

A bench's own flags stay in its module, beside the code that reads them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from hostlib import argtypes

JSON_HELP = "one JSON document on stdout"


def add_json(parser: argparse.ArgumentParser) -> None:
    """``--json``: the run's result as one JSON document on stdout (:mod:`lta.jsonout`)."""
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def add_workers(
    parser: argparse.ArgumentParser,
    default: Any,
    help: str,
    type: Callable[[str], Any] = argtypes.workers,
) -> None:
    """``--workers`` with this bench's default, help and parser (default: one count, 1..MAX_WORKERS)."""
    parser.add_argument("--workers", type=type, default=default, help=help)


def bench_command(
    sub: argparse._SubParsersAction,
    name: str,
    run: Callable[[argparse.Namespace], int],
    help: str,
    description: str | None = None,
    formatter_class: type[argparse.HelpFormatter] | None = None,
) -> argparse.ArgumentParser:
    """The parser of ``lta bench NAME``, which runs ``run(args)``, with ``--json`` on it."""
    options: dict[str, Any] = {"help": help}
    if description is not None:
        options["description"] = description
    if formatter_class is not None:
        options["formatter_class"] = formatter_class
    parser = sub.add_parser(name, **options)
    add_json(parser)
    parser.set_defaults(func=run)
    return parser


def script_parser(module: str, description: str | None) -> argparse.ArgumentParser:
    """The parser of a study run as ``python -m MODULE``, with ``--json`` on it."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    add_json(parser)
    return parser
