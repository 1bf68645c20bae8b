"""An "lta" process group that the script never destroyed is destroyed at exit, while the interpreter is
whole.

A script may end without ``dist.destroy_process_group()`` (torch only warns). The group then lives on in
torch's C++ registry, and with it the Python objects of the "lta" backend; torch destroys that registry
among the C++ static objects after the interpreter has finalized, and freeing a Python object there makes
pybind11 take a GIL that no longer exists: the thread is ended inside a destructor, which C++ answers with
``std::terminate`` ("terminate called without an active exception", SIGABRT, a non-zero exit for the
rank; issue 42). Destroying the groups from an ``atexit`` hook ends them in order instead: the backend's
``shutdown`` stops and joins its heartbeat, liveness and softswitch threads and closes its sockets, and
the registry holds nothing of Python's any more when C++ tears it down. The hook runs before torch's own
``atexit`` hooks (registered earlier, at ``import torch``; ``atexit`` runs the last registered first).
"""

from __future__ import annotations

import atexit
import logging

log = logging.getLogger(__name__)
_registered = False


def destroy_at_exit() -> None:
    """Register :func:`_destroy_lta_groups` once (when the first "lta" group is made)."""
    global _registered
    if not _registered:
        atexit.register(_destroy_lta_groups)
        _registered = True


def _destroy_lta_groups() -> None:
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "lta":
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - at exit: say why, never raise into the interpreter's shutdown
        log.warning("lta: destroying the process group at exit failed", exc_info=True)
