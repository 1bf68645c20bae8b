"""Errors the control plane raises; each message says what to do next. They are
:class:`hostlib.errors.LtaError` s: ``lta`` prints one line and exits non-zero."""

from __future__ import annotations

from hostlib.errors import LtaError


class ControlPlaneError(LtaError):
    """Base class: a switch could not be configured as asked."""


class SwitchUnreachable(ControlPlaneError):
    def __init__(self, target: str, timeout_s: float, detail: str = "") -> None:
        hint = "is simple_switch_grpc (or the softswitch's P4Runtime server) running? (lta ctl --target ...)"
        extra = f" [{detail}]" if detail else ""
        super().__init__(f"switch at {target} did not answer within {timeout_s:g} s — {hint}{extra}")


class PipelineMismatch(ControlPlaneError):
    """The switch runs a P4 program whose P4Info is not ours, or none at all."""


class NotPrimary(ControlPlaneError):
    pass


class WriteRejected(ControlPlaneError):
    """The switch refused some updates of a Write; the message lists each one."""
