"""P4Runtime control plane for LTA switches: BMv2 (simple_switch_grpc), Tofino later, and the softswitch's
own P4Runtime server, through one code path (:class:`controlplane.switch.LtaSwitch`).

Importing the package, ``controlplane.cli``, ``controlplane.deployment`` or ``controlplane.jobs`` needs
no gRPC: ``lta --help`` works without the ``p4rt`` extra, and a command that talks to a switch says
it needs the extra (``hostlib.extras.require_p4rt``)."""

from hostlib.jobconfig import DEFAULT_P4RUNTIME_TARGET

DEFAULT_TARGET = DEFAULT_P4RUNTIME_TARGET
DEFAULT_TIMEOUT_S = 2.0
