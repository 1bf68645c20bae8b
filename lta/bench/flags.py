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
from hostlib.protocol import MAX_ELEMS_PER_PACKET

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


# ---- flags several benches share, each with the one parser it has everywhere ----------------------
def add_steps(parser: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """``--steps``: training steps (> 0)."""
    parser.add_argument("--steps", type=argtypes.positive_int, default=default, help=help)


def add_warmup(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    """``--warmup``: untimed iterations first (>= 0)."""
    parser.add_argument("--warmup", type=argtypes.nonnegative_int, default=default, help=help)


def add_iters(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    """``--iters``: timed iterations (> 0)."""
    parser.add_argument("--iters", type=argtypes.positive_int, default=default, help=help)


def add_seeds(parser: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """``--seeds``: how many seeds (1..50), each a run of its own."""
    parser.add_argument("--seeds", type=argtypes.int_range(1, 50, "seed count"), default=default, help=help)


def add_batch(parser: argparse.ArgumentParser, default: int, help: str = "minibatch per worker") -> None:
    """``--batch``: samples per worker and step (> 0)."""
    parser.add_argument("--batch", type=argtypes.positive_int, default=default, help=help)


def add_lr(parser: argparse.ArgumentParser, default: float, help: str = "learning rate") -> None:
    """``--lr``: the learning rate (> 0)."""
    parser.add_argument("--lr", type=argtypes.positive_float, default=default, help=help)


def add_momentum(parser: argparse.ArgumentParser, default: float) -> None:
    """``--momentum``: SGD momentum in [0, 0.999]."""
    parser.add_argument(
        "--momentum",
        type=argtypes.float_range(0.0, 0.999, what="momentum"),
        default=default,
        help="SGD momentum",
    )


def add_lr_decay(parser: argparse.ArgumentParser, what: str) -> None:
    """``--lr-decay``: linear (every ``what`` ends converged) or none."""
    parser.add_argument(
        "--lr-decay",
        choices=("linear", "none"),
        default="linear",
        help=f"linear: the lr sent with push t is lr x (1 - t/steps), so every {what} ends converged",
    )


def add_loss_rates(parser: argparse.ArgumentParser, default: list[float]) -> None:
    """``--loss``: comma-separated loss rates per link and direction, each in [0, 1]."""
    parser.add_argument(
        "--loss",
        type=argtypes.csv_of(argtypes.probability, "loss rates"),
        default=default,
        help="comma-separated loss rates per link and direction, each in [0, 1]",
    )


def add_mtu(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    """``--mtu``: the links' MTU in bytes, 68..65535."""
    parser.add_argument("--mtu", type=argtypes.int_range(68, 65535, "MTU"), default=default, help=help)


def add_seed(parser: argparse.ArgumentParser, help: str = "seed of the inputs") -> None:
    """``--seed``: one seed (>= 0, default 0)."""
    parser.add_argument("--seed", type=argtypes.nonnegative_int, default=0, help=help)


def add_elems_per_packet(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    """``--elems-per-packet``: K, values per packet, 1..MAX_ELEMS_PER_PACKET."""
    parser.add_argument(
        "--elems-per-packet",
        type=argtypes.int_range(1, MAX_ELEMS_PER_PACKET, "elements per packet"),
        default=default,
        help=help,
    )


def add_sync_training(
    parser: argparse.ArgumentParser, *, steps: int, lr: float, each: str, losses: list[float]
) -> None:
    """What a parameter-server bench that trains in sync rounds, over seeds and loss rates, is asked
    (``byzantine``, ``compression``): ``--losses``, ``--seeds``, ``--steps``, ``--batch``, ``--lr``,
    ``--lr-decay`` (so that every ``each`` ends converged), ``--momentum``."""
    parser.add_argument(
        "--losses",
        type=argtypes.csv_of(argtypes.float_range(0.0, 0.9, what="loss rate"), "loss rates"),
        default=losses,
        help="Bernoulli loss of PUSH and PARAM packets",
    )
    add_seeds(parser, 3, "seeds per case")
    add_steps(parser, steps, "training steps per run")
    add_batch(parser, 32)
    add_lr(parser, lr)
    add_lr_decay(parser, each)
    add_momentum(parser, 0.9)
