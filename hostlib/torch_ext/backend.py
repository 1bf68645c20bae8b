"""``init_process_group("lta")``: a torch.distributed backend whose allreduce goes through the switch.

    dist.init_process_group("lta")     # switch and job from LTA_* variables (see rendezvous.py)
    model = DistributedDataParallel(model)

No LTA import is needed: the installed package declares torch's ``torch.backends`` entry point
(``entry.py``), so ``import torch`` registers "lta"; ``import hostlib.torch_ext`` registers it too.

What goes where:

- **allreduce of a floating-point tensor with SUM or AVG** (DDP's gradient buckets) is *lossy*: reduced
  through the switch, renormalized by the arrival count per chunk. AVG returns that mean; SUM returns
  ``mean × world_size``, the unbiased estimate of the sum (DDP divides each bucket by the world size
  before a SUM allreduce, so a bucket comes back as the mean gradient of the workers that arrived).
  Tensors with fewer than ``reliable_below`` values (default: one packet, K) take the reliable path:
  they are control values (loss scalars, counters), not gradients.
- **everything else** — broadcast, allgather, barrier, reduce_scatter, integer or MIN/MAX/PRODUCT
  allreduce, send/recv — is *reliable*: a gloo process group built on the same store. Those carry
  parameters and control values where a loss would be a silent error.

``LtaOptions`` can be passed as ``init_process_group("lta", pg_options=LtaOptions(...))``.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# In torch's bindings, missing from its stubs (as are ProcessGroup(rank, size) and Backend.allreduce below).
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

from hostlib.torch_ext import entry
from hostlib.torch_ext.rendezvous import LtaOptions, LtaSession, join_job
from hostlib.torch_ext.staging import HostMirror

BACKEND_NAME = entry.BACKEND_NAME
_LOSSY_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
_MAX_STAGING_BUFFERS = 64  # pinned host buffers kept for device tensors (DDP reuses a few buckets)


def _completed(result: object) -> dist.Work:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class ProcessGroupLta(dist.ProcessGroup):
    """Lossy, renormalized allreduce through an LTA switch; reliable collectives through gloo."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        timeout: timedelta,
        options: LtaOptions | None = None,
        *,
        reliable_below: int | None = None,
    ) -> None:
        super().__init__(rank, world)  # type: ignore[call-arg]
        self.options = options or LtaOptions.from_env()
        self._rank, self._world = rank, world
        self.reliable = dist.ProcessGroupGloo(dist.PrefixStore("lta-reliable", store), rank, world, timeout)
        self.session: LtaSession = join_job(
            dist.PrefixStore("lta-job", store), rank, world, self.options, timeout
        )
        self.worker = self.session.worker
        k = self.worker.config.elems_per_packet
        self.reliable_below = k if reliable_below is None else reliable_below
        self.lossy_calls = 0
        self._staging: dict[tuple[int, int], HostMirror] = {}

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    # ---- lossy ---------------------------------------------------------------------------------------
    def _is_lossy(self, tensors: list[torch.Tensor], op: dist.ReduceOp) -> bool:
        return (
            any(op == lossy for lossy in _LOSSY_OPS)
            and all(t.is_floating_point() for t in tensors)
            and all(t.numel() >= self.reliable_below for t in tensors)
        )

    # torch calls a backend's allreduce as (tensors, opts) only; the stub's other overloads are the API's.
    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work:  # type: ignore[override]
        if not self._is_lossy(tensors, opts.reduceOp):
            return self.reliable.allreduce(tensors, opts)  # type: ignore[attr-defined]
        scale = float(self._world) if opts.reduceOp == dist.ReduceOp.SUM else 1.0
        for tensor in tensors:
            self._reduce_in_place(tensor, scale)
        return _completed(tensors)

    def _reduce_in_place(self, tensor: torch.Tensor, scale: float) -> None:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        key = (flat.data_ptr(), flat.numel())
        mirror = self._staging.get(key)
        if mirror is None or mirror.tensor.data_ptr() != flat.data_ptr():
            mirror = HostMirror(flat)
            if mirror.staged:  # keep pinned buffers; an unstaged mirror is free to rebuild
                if len(self._staging) >= _MAX_STAGING_BUFFERS:
                    self._staging.clear()
                self._staging[key] = mirror
        # The key names the tensor for the `prev` fallback: DDP reuses its bucket buffers every step.
        host = mirror.pull()  # reduced in place: pull() left no copy in flight that reads it
        self.worker.allreduce(host, step=self.lossy_calls, key=("pg", *key), out=host)
        self.lossy_calls += 1
        if scale != 1.0:
            host *= scale
        mirror.push()
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))

    # ---- reliable (gloo) -----------------------------------------------------------------------------
    def broadcast(self, tensors, opts):  # noqa: ANN001, ANN201 (signatures are torch's)
        return self.reliable.broadcast(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts):  # noqa: ANN001, ANN201
        return self.reliable.allgather(output_tensors, input_tensors, opts)

    def _allgather_base(self, output, input, opts):  # noqa: A002, ANN001, ANN201
        return self.reliable._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):  # noqa: ANN001, ANN201
        return self.reliable.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allreduce_coalesced(self, tensors, opts):  # noqa: ANN001, ANN201
        return self.reliable.allreduce_coalesced(tensors, opts)

    def reduce(self, tensors, opts):  # noqa: ANN001, ANN201
        return self.reliable.reduce(tensors, opts)

    def gather(self, output_tensors, input_tensors, opts):  # noqa: ANN001, ANN201
        return self.reliable.gather(output_tensors, input_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts):  # noqa: ANN001, ANN201
        return self.reliable.scatter(output_tensors, input_tensors, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts):  # noqa: ANN001, ANN201
        return self.reliable.reduce_scatter(output_tensors, input_tensors, opts)

    def _reduce_scatter_base(self, output, input, opts):  # noqa: A002, ANN001, ANN201
        return self.reliable._reduce_scatter_base(output, input, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):  # noqa: A002, ANN001, ANN201
        return self.reliable.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def send(self, tensors, dst, tag):  # noqa: ANN001, ANN201
        return self.reliable.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):  # noqa: ANN001, ANN201
        return self.reliable.recv(tensors, src, tag)

    def barrier(self, opts):  # noqa: ANN001, ANN201
        return self.reliable.barrier(opts)

    def shutdown(self) -> None:
        self.session.close()


def _create(
    backend_options: dist.distributed_c10d._DistributedBackendOptions, pg_options: object
) -> ProcessGroupLta:
    if pg_options is not None and not isinstance(pg_options, LtaOptions):
        raise TypeError(
            f"init_process_group('lta', pg_options=...) takes LtaOptions, got {type(pg_options).__name__}"
        )
    return ProcessGroupLta(
        backend_options.store,
        backend_options.group_rank,
        backend_options.group_size,
        backend_options.timeout,
        pg_options,
    )


def register() -> None:
    """Make ``"lta"`` a torch.distributed backend (idempotent; ``entry.py`` registers the name)."""
    entry.register()


register()
