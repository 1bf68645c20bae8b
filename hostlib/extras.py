"""Optional parts of the install: a command that needs one says which, in one line, before it starts.

``pip install .`` gives every command but those that speak P4Runtime (``lta ctl``, ``lta softswitch
--p4runtime``); they need the ``p4rt`` extra. The modules are looked up by name at run time, so this
module, like the rest of the ``hostlib`` core, imports no third-party package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from hostlib.errors import LtaError

# What the p4rt extra brings (grpcio, protobuf, googleapis-common-protos, finsy's P4Runtime bindings), by a
# module of each.
P4RT_MODULES = ("grpc", "google.protobuf", "google.rpc.status_pb2", "finsy.proto")


class MissingExtra(LtaError):
    """A command needs an optional part of the install (an extra) that is not there."""


def require_p4rt(command: str) -> None:
    """Raise :class:`MissingExtra` ("``command`` needs the p4rt extra: pip install 'lta[p4rt]'") unless
    the P4Runtime packages import."""
    for name in P4RT_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            raise MissingExtra(f"{command} needs the p4rt extra: pip install 'lta[p4rt]'") from None


def choose_path(
    var: str, requested: str, paths: tuple[str, ...], native: str, missing: str, what: str
) -> str:
    """The code path an ``var`` setting picks among ``paths`` = (reference, native): unset or ``auto``
    takes ``native`` where its C extension is built (``missing`` empty), else the reference. Raises
    ValueError naming the variable for a value not in ``paths``, or for ``native`` where the extension is
    missing (``missing`` says why)."""
    reference = next(p for p in paths if p != native)
    if requested in ("", "auto"):
        return reference if missing else native
    if requested not in paths:
        raise ValueError(f"{var}={requested!r} is not {what}; expected one of {', '.join(paths)} or auto")
    if requested == native and missing:
        raise ValueError(
            f"{var}={native}: {missing}; reinstall with `pip install -e .` or use {var}={reference}"
        )
    return requested


def optional_extension(name: str, check: Callable[[Any], None] | None = None) -> tuple[Any, str]:
    """The C extension module ``name`` and ``""``, or ``None`` and one line saying why it is not usable
    (not built: no compiler at install time; built for another Python; ``check`` raised ImportError)."""
    try:
        module = importlib.import_module(name)
        if check is not None:
            check(module)
    except ImportError as exc:
        return None, f"the C extension {name} is not usable (" + " ".join(str(exc).split()) + ")"
    return module, ""
