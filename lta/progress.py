"""The stderr side of the ``lta`` command: logging and progress. stdout carries results only.

**Logging.** :func:`configure_logging` is called once per command by ``lta.cli.main``: one handler on
the root logger, writing to stderr as ``LEVEL logger: message``. The level comes from ``-v``/``-q``
(``lta -v demo``: INFO, ``-vv``: DEBUG, ``-q``: ERROR) or else the ``LTA_LOG`` variable
(``debug``, ``info``, ``warning``, ``error``); WARNING by default. ``warnings.warn`` goes through it too.

**Progress.** :class:`Status` tells the user a long command is alive:

- its start line (what is being run) is written to stderr when it opens, on a terminal or not;
- on a terminal, a live line below it shows the current phase and the seconds since the start,
  redrawn in place and cleared at the end;
- elsewhere (a pipe, a log file) nothing more is written, so logs stay short; each phase is logged at
  INFO instead, which ``lta -v`` shows.

``-q`` (a log level above WARNING) silences the start line and the live line too.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import IO, Any

log = logging.getLogger(__name__)

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
LEVEL_NAMES = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class StderrHandler(logging.StreamHandler):
    """A StreamHandler that writes to whatever ``sys.stderr`` is at the time of each record, so that a
    live progress display (which redirects stderr above itself) and test capture both see the logs."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:  # StreamHandler.__init__ sets it; the property wins
        pass


_installed: StderrHandler | None = None


def level_from(verbose: int, quiet: int, env: str | None) -> int:
    """The log level for ``-v`` × ``verbose``, ``-q`` × ``quiet`` and ``LTA_LOG=env``; the flags win.

    Raises ValueError (one line) for an ``LTA_LOG`` that is not a level name or number."""
    if verbose or quiet:
        return min(max(logging.WARNING - 10 * verbose + 10 * quiet, logging.DEBUG), logging.CRITICAL)
    if not env or not env.strip():
        return logging.WARNING
    text = env.strip().lower()
    if text in LEVEL_NAMES:
        return LEVEL_NAMES[text]
    if text.isdigit():
        return int(text)
    raise ValueError(f"LTA_LOG={env!r} is not a log level: use debug, info, warning or error")


def configure_logging(level: int) -> None:
    """Route every logger to stderr at ``level``; calling it again replaces the previous setting."""
    global _installed
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, StderrHandler)]:
        root.removeHandler(handler)  # ours from an earlier call, whoever kept a reference to it
    _installed = StderrHandler()
    _installed.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(_installed)
    root.setLevel(level)
    logging.captureWarnings(True)


def is_quiet() -> bool:
    """``-q`` was given: progress stays silent too."""
    return logging.getLogger().getEffectiveLevel() > logging.WARNING


class Status:
    """A command's progress on stderr (see the module docstring). Use as a context manager; call
    :meth:`update` with the current phase.

    ``live``: force the live line on or off (default: on when stderr is a terminal)."""

    def __init__(self, title: str, *, live: bool | None = None) -> None:
        self.title = title
        self.quiet = is_quiet()
        self._live_requested = live
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> Status:
        if self.quiet:
            return self
        stream = sys.stderr
        stream.write(self.title + "\n")
        stream.flush()
        live = self._live_requested
        if live is None:
            live = bool(getattr(stream, "isatty", lambda: False)())
        if live:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}", markup=False),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
                redirect_stdout=False,  # stdout is for results: never drawn into the live display
            )
            self._progress.start()
            self._task = self._progress.add_task("starting", total=None)
        return self

    def update(self, phase: str) -> None:
        """Show ``phase`` (one short line) as what runs now."""
        log.info("%s", phase)
        if self._progress is not None:
            self._progress.update(self._task, description=phase)

    def line(self, text: str) -> None:
        """Write ``text`` as a line of its own on stderr (a finished step: it stays), above the live line
        on a terminal; silent under ``-q``."""
        if self.quiet:
            return
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
