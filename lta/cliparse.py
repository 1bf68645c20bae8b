"""The argument parser every ``lta`` subcommand shares: help with defaults, and one-line usage errors.

``lta.cli`` builds the top-level parser from :class:`LtaArgumentParser`; argparse gives every
subparser (``add_subparsers`` then ``add_parser``) the class of its parent, so each subcommand gets the
same help format and error behaviour without naming it.

A bad command line is reported as exactly one line on stderr, exit status 2::

    lta demo: error: argument --workers: worker count must be 1..64, got 0 (see lta demo --help)

argparse's usage block is left out: for commands with a dozen flags it is several wrapped lines that
bury the one that matters, and ``--help`` is named instead.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn


class LtaHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help, except where the help already speaks of its default,
    or there is nothing to show (None, "", False of an on/off flag, 0 of a counted flag like -v)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        nothing = action.default is None or action.default is False or action.default == ""
        if "default" in text.lower() or nothing or isinstance(action, argparse._CountAction):
            return text
        if isinstance(action.default, list | tuple):
            # Lists come from csv-typed flags; show them as they are typed.
            shown = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in action.default)
            return f"{text} (default: {shown.replace('%', '%%')})"
        return super()._get_help_string(action) or ""


class LtaRawHelpFormatter(LtaHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`LtaHelpFormatter` that keeps the description's own line breaks (module docstrings)."""


_PROG = "command_prog"  # namespace attribute: the innermost (sub)command parsed, "lta ctl job add"


class LtaArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with :class:`LtaHelpFormatter` by default and one-line errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", LtaHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        # The innermost (sub)command parses first and its namespace is copied outwards: it names itself.
        if not hasattr(namespace, _PROG):
            setattr(namespace, _PROG, self.prog)
        return namespace, extras

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """argparse's, except that arguments left over are blamed on the subcommand that was parsing
        them (``lta ctl stats: error: unrecognized arguments: 1``), not on ``lta``. The namespace's
        ``command_prog`` names that subcommand, for errors raised later."""
        namespace, extras = self.parse_known_args(args, namespace)
        prog = getattr(namespace, _PROG, self.prog)
        if extras:
            line = " ".join(f"unrecognized arguments: {' '.join(extras)}".split())
            self.exit(2, f"{prog}: error: {line} (see {prog} --help)\n")
        return namespace

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())  # argparse's messages are one line; keep it so
        self.exit(2, f"{self.prog}: error: {line} (see {self.prog} --help)\n")


def plain_text(doc: str | None) -> str:
    """A module docstring as ``--help`` shows it: reStructuredText's double backticks dropped."""
    return (doc or "").replace("``", "")
