"""argparse ``type=`` callables shared by every ``lta`` subcommand, so that ranges are checked
while parsing (before anything is spawned) and a bad value reads as one line naming the range.

Each raises ``argparse.ArgumentTypeError``; argparse turns that into ``lta X: error: argument
--flag: ...`` and exit status 2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from hostlib.protocol import MAX_WORKERS, parse_address


def int_range(low: int, high: int | None = None, what: str = "value") -> Callable[[str], int]:
    """An integer in ``low..high`` (``high`` None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{what} must be {span}, got {value}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def float_range(
    low: float, high: float | None = None, *, low_open: bool = False, what: str = "value"
) -> Callable[[str], float]:
    """A finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            left = "(" if low_open else "["
            right = f"{high}]" if high is not None else "inf)"
            raise argparse.ArgumentTypeError(f"{what} must be in {left}{low}, {right}, got {text}")
        return value

    parse.__name__ = what
    return parse


def csv_of(item: Callable[[str], object], what: str = "list") -> Callable[[str], list]:
    """A comma-separated, non-empty list whose items each pass ``item``."""

    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list, got {text!r}")
        return [item(p) for p in parts]

    parse.__name__ = what
    return parse


def address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` with a port in 1..65535."""
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def listen_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` to listen on: like ``address``, and port 0 asks the system for a free port."""
    host, sep, port = text.rpartition(":")
    if sep and host and port.isdigit() and int(port) == 0:
        return host, 0
    return address(text)


def listen_address_text(text: str) -> str:
    """Like ``listen_address`` but keeps the text."""
    listen_address(text)
    return text


def address_text(text: str) -> str:
    """Like ``address`` but keeps the text (for options passed on as strings)."""
    address(text)
    return text


def loss_below_one(text: str) -> float:
    """A drop probability in [0, 1): at 1 nothing would ever be aggregated (``--loss`` of demo, bench)."""
    p = probability(text)
    if p >= 1.0:
        raise argparse.ArgumentTypeError(f"loss must be in [0, 1): at {text} nothing is aggregated")
    return p


workers = int_range(1, MAX_WORKERS, "worker count")
port = int_range(1, 65535, "port")
probability = float_range(0.0, 1.0, what="probability")
positive_float = float_range(0.0, low_open=True, what="value")
positive_int = int_range(1, what="value")
nonnegative_int = int_range(0, what="value")
