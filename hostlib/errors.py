"""The exceptions a user of LTA is meant to see, in one place for every layer.

``LtaError`` and its subclasses carry a message written for the person at the keyboard: what went
wrong and what to check. Every ``lta`` subcommand turns them into one line on stderr and a non-zero
exit (``lta.cli.main``); library callers can catch the base class. Programming errors stay ordinary
exceptions with tracebacks.
"""

from __future__ import annotations


class LtaError(Exception):
    """Base of every user-facing LTA error; its message is one complete sentence for the user."""

    exit_code = 1


class AddressInUseError(LtaError, OSError):
    """A port this command was told to listen on is taken (``--listen``, ``--metrics-port``, ...): one exit
    status for all of them, 1, as for every condition of the machine rather than of the command line."""

    exit_code = 1


class UsageError(LtaError, ValueError):
    """A command-line value or configuration entry is out of range or malformed."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration file is malformed: unknown key, wrong type, missing field (names file and key)."""


class HealthCheckError(LtaError, RuntimeError):
    """The switch did not answer for this job, or answered in a way that means training would not work."""


class UnhealthyTraining(LtaError, RuntimeError):
    """Reduces kept falling back instead of aggregating: training would go on without the gradients."""


class TrainingDiverged(LtaError, ArithmeticError):
    """A training run's loss or gradient became NaN or infinite: ``run`` and ``step`` say which and when."""

    def __init__(self, message: str, run: str = "", step: int = -1) -> None:
        super().__init__(message, run, step)  # all in args: it survives pickling (lta train --jobs)
        self.run, self.step = run, step

    def __str__(self) -> str:
        return str(self.args[0])
