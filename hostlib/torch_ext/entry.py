"""Makes ``"lta"`` a torch.distributed backend name, cheaply, so that unchanged code can call
``dist.init_process_group("lta")`` with no LTA import.

Two callers:

- torch itself: the package declares :func:`autoload` as an entry point of group ``torch.backends``, which
  torch (>= 2.5) loads and calls with no arguments near the end of ``import torch``
  (``torch._import_device_backends``; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off). By then
  ``torch.distributed`` is fully imported (``torch/__init__.py`` imports it earlier), so
  ``Backend.register_backend`` works although ``import torch`` has not returned yet.
- ``import hostlib.torch_ext``, which calls :func:`autoload` too.

Only the name is registered here: the process group's module (:mod:`hostlib.torch_ext.backend`: the
transport, rendezvous and, on rank 0 without ``LTA_SWITCH``, the embedded softswitch) is imported when
``init_process_group("lta")`` creates a group. torch turns an exception from an entry point into a failed
``import torch``, so :func:`autoload` never raises: it logs why and leaves ``"lta"`` unregistered. Loading
this module runs ``hostlib/__init__.py`` and ``hostlib/torch_ext/__init__.py`` inside ``import torch`` as
well: both must stay light and must not fail.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import _DistributedBackendOptions

BACKEND_NAME = "lta"
DEVICES = ["cpu", "cuda"]  # device tensors are staged through host memory (staging.HostMirror)

_log = logging.getLogger(__name__)


def _create_process_group(backend_options: _DistributedBackendOptions, pg_options: object) -> ProcessGroup:
    from hostlib.torch_ext import backend  # the heavy part, imported when a group is made
    from hostlib.torch_ext.shutdown import destroy_at_exit

    destroy_at_exit()  # a group the script leaves behind is ended before the interpreter finalizes
    return backend._create(backend_options, pg_options)


def register() -> None:
    """Register ``"lta"`` with torch.distributed (idempotent: a name already registered is kept).

    Raises ``RuntimeError`` where this torch has no ``torch.distributed``, and whatever torch raises.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed: the 'lta' backend needs it")
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True, devices=DEVICES)


def autoload() -> None:
    """:func:`register`, but never raises (torch's ``torch.backends`` entry point; package import)."""
    try:
        register()
    except Exception:
        _log.warning(
            "the 'lta' torch.distributed backend is not registered: init_process_group('lta') will not "
            "find it",
            exc_info=True,
        )
