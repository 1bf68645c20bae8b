"""torchft with LTA as its replica-group process group: torchft's fault tolerance (replica groups that
come and go, a quorum per step, live recovery) over LTA's loss tolerance (gradients renormalized by the
arrival count, no retransmission).

    from torchft import DistributedDataParallel, Manager, Optimizer
    from hostlib.torch_ext.ft import lta_replica_group

    manager = Manager(pg=lta_replica_group(), min_replica_size=2, load_state_dict=..., state_dict=...,
                      replica_id=..., lighthouse_addr=..., store_addr=..., store_port=...)
    model = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, torch.optim.AdamW(model.parameters()))

torchft reconfigures its replica-group process group at every quorum change: ``configure(store_addr,
replica_id, rank, world_size, ...)``. :func:`lta_replica_group` builds a torchft ``ProcessGroupWrapper``
whose ``_create_pg`` makes a :class:`~hostlib.torch_ext.backend.ProcessGroupLta` on the quorum's store:
each quorum is an LTA job of its own (self-hosted: the quorum's rank 0 hosts a softswitch; with
``LTA_SWITCH`` the job id and the addresses must be configured there, as for any lta group), and the
previous quorum's job is closed (``ProcessGroupLta.abort``). torchft's ``Manager.allreduce`` sums
(``ReduceOp.SUM``) and divides by the participants: the lta group's SUM is the renormalized mean times
the group size, so the result is the mean over the replicas whose packets arrived.

``lta_replica_group`` imports torchft when called: it is the ``ft`` extra (``pip install 'lta[ft]'``), and
``make setup`` installs it beside the ``p4rt`` extra (both on protobuf 6).
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

from hostlib.extras import MissingExtra
from hostlib.torch_ext.rendezvous import LtaOptions

TORCHFT_HINT = "pip install 'lta[ft]' (torchft)"


def _torchft_process_group() -> Any:
    try:
        return importlib.import_module("torchft.process_group")
    except ImportError as exc:
        raise MissingExtra(f"the torchft replica group needs torchft ({exc}): {TORCHFT_HINT}") from None


def lta_replica_group(
    options: LtaOptions | None = None, *, timeout: timedelta = timedelta(seconds=60)
) -> Any:
    """A torchft process group (``torchft.process_group.ProcessGroupWrapper``) that is an lta group for
    each quorum; ``options`` (default: from the ``LTA_*`` variables, read at each quorum) as for
    ``init_process_group("lta", pg_options=...)``."""
    ft = _torchft_process_group()
    from hostlib.torch_ext.backend import ProcessGroupLta

    class ProcessGroupLtaFT(ft.ProcessGroupWrapper):  # type: ignore[name-defined]
        """torchft's reconfigurable wrapper around a ProcessGroupLta per quorum."""

        def _create_pg(self, store: Any, rank: int, world_size: int) -> ProcessGroupLta:
            return ProcessGroupLta(store, rank, world_size, self._timeout, options or LtaOptions.from_env())

        def getBackendName(self) -> str:  # noqa: N802 (torch's name)
            return "torchft-lta"

        @property
        def lta_group(self) -> ProcessGroupLta | None:
            """The current quorum's lta group (None before the first quorum)."""
            pg = self._pg
            return pg if isinstance(pg, ProcessGroupLta) else None

    return ProcessGroupLtaFT(timeout=timeout)
