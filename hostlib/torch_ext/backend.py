"""``init_process_group("lta")``: a torch.distributed backend whose gradients go through the switch.

    dist.init_process_group("lta")     # switch and job from LTA_* variables (see rendezvous.py)
    model = DistributedDataParallel(model)          # or FSDP2: fully_shard(layer, mesh=init_device_mesh(...))

No LTA import is needed: the installed package declares torch's ``torch.backends`` entry point
(``entry.py``), so ``import torch`` registers "lta"; ``import hostlib.torch_ext`` registers it too.

What goes where (``LtaOptions.lossy_ops``, ``LTA_LOSSY_OPS``; default ``allreduce,reduce_scatter``):

- **allreduce of a dense float32, float16 or bfloat16 tensor with SUM or AVG** (DDP's gradient buckets,
  HSDP's replicate dimension) is *lossy*: reduced through the switch, renormalized by the arrival count
  per chunk. AVG returns that mean; SUM returns ``mean × world_size``, the unbiased estimate of the sum
  (DDP divides each bucket by the world size before a SUM allreduce, so a bucket comes back as the mean
  gradient of the workers that arrived). Tensors with fewer than ``reliable_below`` values (default: one
  packet, K) take the reliable path: they are control values (loss scalars, counters), not gradients.
- **reduce_scatter** (FSDP2's gradients), same conditions: the whole input is reduced through the switch
  (RESULTs are multicast) and each rank keeps its renormalized part.
- **all_gather** (FSDP2's parameters; only when named in ``lossy_ops``): shards go as PARAM broadcasts; a
  lost chunk leaves this rank's previous copy of the same call key, never older than S calls
  (``gather.py``, ``callkeys.py``).
- **everything else** — broadcast, barrier, monitored_barrier, send/recv, all_to_all, allreduce_coalesced,
  MIN/MAX/PRODUCT allreduce, and tensors the switch would degrade (float64, integer, float8, sparse;
  ``switch_carries``) — is *reliable*: a gloo process group built on the same store, registered as this
  group's backend so that DeviceMesh, DTensor and distributed checkpoint find it.

Every call form of torch's ``ProcessGroup`` methods is accepted (``callforms.py``): options absent,
positional or keyword, a ``ReduceOp`` or a timeout in their place, the single-tensor overloads.

``LtaOptions`` can be passed as ``init_process_group("lta", pg_options=LtaOptions(...))``.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# In torch's bindings, missing from its stubs (as are ProcessGroup(rank, size) and Backend.allreduce below).
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

from hostlib.torch_ext import callforms, entry
from hostlib.torch_ext.callkeys import CallKeys
from hostlib.torch_ext.gather import StaleGather
from hostlib.torch_ext.manager import LtaManager, ReduceStats
from hostlib.torch_ext.rendezvous import LtaOptions, LtaSession, join_job
from hostlib.transport import LtaWorker, ReduceResult

BACKEND_NAME = entry.BACKEND_NAME
_LOSSY_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
# The dtypes the switch carries with the precision the dtype has (README.md here, "what is lossy"): float32
# as int32 with a per-chunk exponent; float16 and bfloat16 widen to float32 exactly. float64 would come back
# at float32 precision, and complex, float8 and integer tensors are not summed there: they, and sparse
# tensors, go the reliable way whatever the op.
SWITCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def switch_carries(tensor: torch.Tensor) -> bool:
    """Whether the switch can sum ``tensor`` keeping its dtype's precision: a dense (strided) float32,
    float16 or bfloat16 tensor."""
    return tensor.layout == torch.strided and tensor.dtype in SWITCH_DTYPES


def _completed(result: object) -> dist.Work:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


# Kept under its old name: the process group's per-collective rows are the manager's ReduceStats.
CollectiveStats = ReduceStats
COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather")


def _host_float32(tensor: torch.Tensor) -> np.ndarray:
    """A float32 numpy copy (or view, for a contiguous float32 CPU tensor) of ``tensor``'s values."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu" or flat.dtype != torch.float32:
        flat = flat.to(device="cpu", dtype=torch.float32)
    return flat.numpy()


def _copy_rows_out(output: torch.Tensor, rows: np.ndarray) -> None:
    """Write ``rows`` (N, m), one rank's shard each, into ``output`` (N·m values) end to end: one strided
    copy (with the dtype conversion) for a contiguous output, no staging array in between."""
    if output.is_contiguous():
        output.view(rows.shape[0], -1).copy_(torch.from_numpy(rows))
    else:
        output.copy_(torch.from_numpy(np.ascontiguousarray(rows)).view(output.shape))


class ProcessGroupLta(dist.ProcessGroup):
    """Lossy, renormalized allreduce and reduce-scatter and a lossy all-gather with stale copies through an
    LTA switch (``LtaOptions.lossy_ops``); everything else through gloo.

    The gloo group is also registered as this group's backend for CPU and CUDA tensors, so the group has a
    name and a backend the way torch's own groups do (DeviceMesh, DTensor, FSDP2 and torch.distributed
    .checkpoint look them up), and any collective this class does not override runs reliably there.
    ``lossy=False`` (a sub-group on an external switch, a group of one) keeps every collective reliable.

    The group decides what goes where; its state (the session and worker, staging buffers, reduce
    counter, call keys, the all-gather's copies, per-collective statistics) is its ``manager``'s
    (``manager.py``): ``LtaHookState(group.manager)`` shares it."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        timeout: timedelta,
        options: LtaOptions | None = None,
        *,
        reliable_below: int | None = None,
        lossy: bool = True,
    ) -> None:
        super().__init__(rank, world)  # type: ignore[call-arg]
        self.options = options or LtaOptions.from_env()
        self._rank, self._world = rank, world
        self.reliable = dist.ProcessGroupGloo(dist.PrefixStore("lta-reliable", store), rank, world, timeout)
        for device in entry.DEVICES:
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, self.reliable)
        self.lossy_ops: frozenset[str] = frozenset()
        session = None
        if lossy and world > 1:
            session = join_job(dist.PrefixStore("lta-job", store), rank, world, self.options, timeout)
            self.lossy_ops = self.options.lossy_ops
        self.manager = LtaManager(session, world=world)
        for op in COLLECTIVES:
            self.manager.stream(op)
        if self.manager.has_worker:
            self.manager.gatherer(self.options.stale_bound)
        k = self.worker.config.elems_per_packet if self.worker is not None else 1
        self.reliable_below = k if reliable_below is None else reliable_below
        # all-gather: per call key, the pending vote on whether its next call must be reliable
        self._votes: dict[Any, tuple[Any, torch.Tensor]] = {}

    # ---- the manager's state, by the names this class has always had ---------------------------------
    @property
    def session(self) -> LtaSession | None:
        return self.manager.session

    @property
    def worker(self) -> LtaWorker | None:
        return self.manager.worker if self.manager.has_worker else None

    @property
    def lossy_calls(self) -> int:
        """Lossy reduces through the switch (one per tensor of an allreduce, one per reduce-scatter)."""
        return self.manager.reduces

    @property
    def last_reduce(self) -> ReduceResult | None:
        """The last lossy reduce's per-chunk result."""
        return self.manager.last_reduce

    @property
    def keys(self) -> CallKeys:
        return self.manager.keys

    @property
    def gatherer(self) -> StaleGather | None:
        return self.manager.gatherer() if self.manager.has_worker else None

    @property
    def stats(self) -> dict[str, ReduceStats]:
        return {op: self.manager.stream(op) for op in COLLECTIVES}

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    def set_lossy_ops(self, ops: Any, *, stale_bound: int | None = None) -> None:
        """Choose which collectives go through the switch (every rank must choose the same, at the same
        point); ``stale_bound`` sets the lossy all-gather's S."""
        chosen = LtaOptions(lossy_ops=frozenset(ops), stale_bound=stale_bound or self.options.stale_bound)
        if not self.manager.has_worker and chosen.lossy_ops:
            raise ValueError(
                "this lta group has no switch job (a sub-group on an external switch, or one rank)"
            )
        self.lossy_ops = chosen.lossy_ops
        if self.manager.has_worker:
            self.manager.gatherer(chosen.stale_bound)

    def collective_stats(self) -> dict[str, dict[str, Any]]:
        """Per collective: calls (lossy, reliable), chunks and loss seen, and for the all-gather the stale
        copies handed out, the oldest copy's age (max_age, in calls of its key) and the resyncs."""
        return self.manager.collective_stats(COLLECTIVES)

    # ---- lossy ---------------------------------------------------------------------------------------
    def _is_lossy(self, tensors: list[torch.Tensor], op: dist.ReduceOp, name: str = "allreduce") -> bool:
        return (
            name in self.lossy_ops
            and any(op == lossy for lossy in _LOSSY_OPS)
            and all(switch_carries(t) for t in tensors)
            and all(t.numel() >= self.reliable_below for t in tensors)
        )

    # torch's ProcessGroup call forms (tensors or a tensor; opts, a ReduceOp or nothing; a timeout), reduced
    # to the Backend form by callforms.py.
    def allreduce(self, tensors, opts=None, timeout=None):  # noqa: ANN001, ANN201
        tensors, opts = callforms.allreduce(tensors, opts, timeout)
        stats = self.manager.stream("allreduce")
        stats.calls += 1
        if not self._is_lossy(tensors, opts.reduceOp):
            stats.reliable_calls += 1
            return self.reliable.allreduce(tensors, opts)
        scale = float(self._world) if opts.reduceOp == dist.ReduceOp.SUM else 1.0
        for tensor in tensors:
            self._reduce_in_place(tensor, scale)
        stats.lossy_calls += 1
        return _completed(tensors)

    def _reduce_in_place(self, tensor: torch.Tensor, scale: float) -> None:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        key = (flat.data_ptr(), flat.numel())
        mirror = self.manager.mirror(key, flat, transient=True)
        # The key names the tensor for the `prev` fallback: DDP reuses its bucket buffers every step.
        host = mirror.pull()  # reduced in place: pull() left no copy in flight that reads it
        self.manager.allreduce(host, stream="allreduce", key=("pg", *key), out=host, scale=scale)
        mirror.push()
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))

    def _reduce_scatter_lossy(self, output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp) -> None:  # noqa: A002
        """Every chunk of ``input`` summed in the switch with its arrival count and renormalized; this rank
        keeps its part. The chunks go owner-only (docs/protocol.md, "Owner-only RESULT"): the switch sends
        each chunk's RESULT to the rank that keeps it, and no rank waits for the others' chunks. The shards
        are sent interleaved (chunk j of every rank's shard, then chunk j + 1), each shard padded to whole
        chunks, so every rank gets a RESULT every N units and learns its peers' progress from it (the slot
        reuse rule of hostlib/transport/reuse.py needs that news)."""
        m, world, rank = output.numel(), self._world, self._rank
        worker = self.manager.worker
        k = worker.config.elems_per_packet
        key = self.manager.keys.key("reduce_scatter", input.numel(), input.dtype)
        result, owners, mine_chunks = self._interleaved(key, m, k)
        per = -(-m // k)  # chunks per shard
        full, tail = divmod(m, k)
        # Straight into the transport's own input buffer: no copy there.
        staged = worker.input_buffer(per * world * k)
        src = _host_float32(input).reshape(world, m)
        lanes = staged.reshape(per, world, k)
        if full:
            np.copyto(lanes[:full].transpose(1, 0, 2), src[:, : full * k].reshape(world, full, k))
        if tail:
            lanes[full, :, :tail] = src[:, full * k :]
            lanes[full, :, tail:] = 0.0
        reduced = self.manager.allreduce(
            staged, stream="reduce_scatter", key=key, out=result, owners=owners, mine=mine_chunks
        )  # writes this rank's chunks of ``result`` alone
        # The RESULTs waited for: this rank's chunks and those the transport makes every rank's (the last,
        # every news_every-th; docs/protocol.md, "Owner-only units"), each with a count or a fallback.
        waited = (reduced.count > 0) | (reduced.fallback != 0)
        self.manager.stream("reduce_scatter").chunks_received += int(np.count_nonzero(waited))
        mine = result.reshape(per, world, k)[:, rank, :]
        scale = np.float32(world if op == dist.ReduceOp.SUM else 1)
        cpu32 = output.device.type == "cpu" and output.dtype == torch.float32 and not output.requires_grad
        host = output.numpy() if cpu32 else None
        if host is not None and output.is_contiguous():
            dst = host.reshape(-1)  # the shard, scaled straight into the output tensor
            np.multiply(mine[:full], scale, out=dst[: full * k].reshape(full, k))
            if tail:
                np.multiply(mine[full, :tail], scale, out=dst[full * k :])
        else:
            values = np.ascontiguousarray(mine).reshape(-1)[:m] * scale
            output.copy_(torch.from_numpy(values).view(output.shape))

    def _interleaved(self, key: Any, m: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a reduce-scatter whose shards hold ``m`` values (reused per call key): the buffer its result
        lands in (interleaved, as sent), the chunks' owners and this rank's chunks."""
        found = self.manager.scatter_staging.get(key)
        per, world = -(-m // k), self._world
        if found is None or found[0].size != per * world * k:
            if (
                len(self.manager.scatter_staging) >= 64
            ):  # FSDP2's call keys are few; a script's ad hoc ones are not
                self.manager.scatter_staging.clear()
            owners = np.tile(np.arange(world, dtype=np.int64), per)
            found = self.manager.scatter_staging[key] = (
                np.empty(per * world * k, dtype=np.float32),
                owners,
                np.flatnonzero(owners == self._rank),
            )
        return found

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:  # noqa: A002
        stats = self.manager.stream("reduce_scatter")
        stats.calls += 1
        lossy = (
            self._is_lossy([input], opts.reduceOp, "reduce_scatter")
            and input.numel() == output.numel() * self._world
        )
        if not lossy:
            stats.reliable_calls += 1
            return self.reliable._reduce_scatter_base(output, input, opts)  # type: ignore[attr-defined]
        self._reduce_scatter_lossy(output, input, opts.reduceOp)
        stats.lossy_calls += 1
        return _completed([output])

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:  # noqa: A002
        """Lossy where enabled, for float32/bfloat16/float16 shards of at least ``reliable_below`` values:
        a lost shard copy leaves this rank's previous copy (same call key), never older than S calls;
        a key's first call, and any call after which some rank held a copy S calls old (one more loss would
        make it older: the ranks agree on it by an asynchronous vote, ``_vote_at_risk``), is reliable."""
        stats = self.manager.stream("all_gather")
        stats.calls += 1
        eligible = (
            "all_gather" in self.lossy_ops
            and self.manager.has_worker
            and switch_carries(input)
            and output.dtype == input.dtype
            and input.numel() >= self.reliable_below
            and output.numel() == input.numel() * self._world
        )
        if not eligible:
            stats.reliable_calls += 1
            return self.reliable._allgather_base(output, input, opts)  # type: ignore[attr-defined]
        gatherer = self.manager.gatherer()
        t0 = time.perf_counter()
        key = self.manager.keys.key("all_gather", input.numel(), input.dtype)
        known = gatherer.known(key)
        if known and not self._someone_at_risk(key):
            values, outcome = gatherer.gather(key, _host_float32(input))
            if outcome.resync:  # ages grow by one per call: the vote of the previous call prevents it
                raise RuntimeError(
                    f"lossy all-gather {key}: a copy {outcome.max_age} calls old, above S="
                    f"{gatherer.stale_bound}, although no rank was at risk (a bug: please report it)"
                )
            self._vote_at_risk(key, outcome.max_age >= gatherer.stale_bound)
            _copy_rows_out(output, values)
            stats.lossy_calls += 1
            stats.lossy_s += time.perf_counter() - t0
            return _completed([output])
        if known:
            stats.resyncs += 1
        self.reliable._allgather_base(output, input, opts).wait()  # type: ignore[attr-defined]
        gatherer.refresh(key, _host_float32(output))
        stats.reliable_calls += 1
        return _completed([output])

    def _vote_at_risk(self, key: Any, at_risk: bool) -> None:
        """Start the ranks' agreement on whether the next call of ``key`` must be reliable: some rank holds a
        copy S calls old, which one more loss would make older than S. A reliable 1-value MAX allreduce,
        asynchronous: it completes while the ranks compute, and the next call of ``key`` waits for it
        (every rank makes the same calls, so every rank starts and awaits the same votes in order)."""
        vote = torch.tensor([int(at_risk)], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
        self._votes[key] = (self.reliable.allreduce([vote], opts), vote)  # type: ignore[attr-defined]

    def _someone_at_risk(self, key: Any) -> bool:
        """The outcome of the vote the previous call of ``key`` started (False when none: a reliable call
        left every copy fresh)."""
        pending = self._votes.pop(key, None)
        if pending is None:
            return False
        work, vote = pending
        work.wait()
        return bool(vote.item())

    # FSDP2 and dist.all_gather_into_tensor / reduce_scatter_tensor call these (torch >= 2.13 names, and
    # the older ones); DTensor's functional collectives call the coalesced forms. ``opts`` may be an options
    # object, a ReduceOp (reduce-scatter), a timeout or absent, as for every method below (callforms.py).
    def all_gather_single(self, output, input, opts=None):  # noqa: A002, ANN001, ANN201
        opts = callforms.options(callforms.AllgatherOptions, opts, "all_gather")
        return self._all_gather(output, input, opts)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002, ANN001, ANN201
        return self.all_gather_single(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):  # noqa: ANN001, ANN201
        opts = callforms.options(callforms.AllgatherOptions, opts, "allgather_into_tensor_coalesced")
        for output, input in zip(outputs, inputs, strict=True):  # noqa: A001
            self._all_gather(output, input, opts).wait()
        return _completed(outputs)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002, ANN001, ANN201
        return self._reduce_scatter(
            output, input, callforms.options(dist.ReduceScatterOptions, opts, "reduce_scatter")
        )

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002, ANN001, ANN201
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):  # noqa: ANN001, ANN201
        opts = callforms.options(dist.ReduceScatterOptions, opts, "reduce_scatter_tensor_coalesced")
        for output, input in zip(outputs, inputs, strict=True):  # noqa: A001
            self._reduce_scatter(output, input, opts).wait()
        return _completed(outputs)

    # ---- reliable (gloo) -----------------------------------------------------------------------------
    # Every ProcessGroup call form torch documents (the overloads of torch/_C/_distributed_c10d.pyi),
    # normalized to the Backend form gloo's backend takes.
    def broadcast(self, tensors, opts=None, timeout=None):  # noqa: ANN001, ANN201 (signatures are torch's)
        return self.reliable.broadcast(*callforms.broadcast(tensors, opts, timeout))

    def allgather(self, output_tensors, input_tensors, opts=None):  # noqa: ANN001, ANN201
        return self.reliable.allgather(*callforms.allgather(output_tensors, input_tensors, opts))

    def allgather_coalesced(self, output_lists, input_list, opts=None):  # noqa: ANN001, ANN201
        opts = callforms.options(callforms.AllgatherOptions, opts, "allgather_coalesced")
        return self.reliable.allgather_coalesced(output_lists, input_list, opts)

    def allreduce_coalesced(self, tensors, opts=None):  # noqa: ANN001, ANN201
        return self.reliable.allreduce_coalesced(*callforms.allreduce_coalesced(tensors, opts))

    def reduce(self, tensors, opts=None, op=None, timeout=None):  # noqa: ANN001, ANN201
        return self.reliable.reduce(*callforms.reduce(tensors, opts, op, timeout))

    def gather(self, output_tensors, input_tensors, opts=None, timeout=None):  # noqa: ANN001, ANN201
        return self.reliable.gather(
            *callforms.gather(output_tensors, input_tensors, opts, timeout, self._rank)
        )

    def scatter(self, output_tensors, input_tensors, opts=None, timeout=None):  # noqa: ANN001, ANN201
        return self.reliable.scatter(
            *callforms.scatter(output_tensors, input_tensors, opts, timeout, self._rank)
        )

    def reduce_scatter(self, output_tensors, input_tensors, opts=None, timeout=None):  # noqa: ANN001, ANN201
        return self.reliable.reduce_scatter(
            *callforms.reduce_scatter(output_tensors, input_tensors, opts, timeout)
        )

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002, ANN001, ANN201
        opts = callforms.options(dist.AllToAllOptions, opts, "alltoall_base")
        return self.reliable.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002, ANN001, ANN201
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):  # noqa: ANN001, ANN201
        opts = callforms.options(dist.AllToAllOptions, opts, "alltoall")
        return self.reliable.alltoall(output_tensors, input_tensors, opts)

    def send(self, tensors, dst, tag=0):  # noqa: ANN001, ANN201
        return self.reliable.send(callforms.tensor_list(tensors, "send"), dst, tag)

    def recv(self, tensors, src, tag=0):  # noqa: ANN001, ANN201
        return self.reliable.recv(callforms.tensor_list(tensors, "recv"), src, tag)

    def recv_anysource(self, tensors, tag=0):  # noqa: ANN001, ANN201
        return self.reliable.recv_anysource(callforms.tensor_list(tensors, "recv_anysource"), tag)

    def barrier(self, opts=None):  # noqa: ANN001, ANN201
        return self.reliable.barrier(callforms.barrier(opts))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):  # noqa: ANN001, ANN201
        """gloo's monitored barrier on this group's gloo group: a rank that does not arrive within
        ``timeout`` is named in the error (``dist.monitored_barrier`` itself refuses any backend not named
        "gloo" before it reaches a group: call :func:`monitored_barrier` or this method)."""
        if timeout is None:
            timeout = dist.default_pg_timeout
        return self.reliable.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    def shutdown(self) -> None:
        self.manager.close()

    def abort(self) -> None:
        """Close this group's switch job now (torchft calls it when a quorum is replaced)."""
        self.manager.close()


def _create(
    backend_options: dist.distributed_c10d._DistributedBackendOptions, pg_options: object
) -> ProcessGroupLta:
    if pg_options is not None and not isinstance(pg_options, LtaOptions):
        raise TypeError(
            f"init_process_group('lta', pg_options=...) takes LtaOptions, got {type(pg_options).__name__}"
        )
    options = pg_options or LtaOptions.from_env()
    # A sub-group (dist.new_group, a DeviceMesh dimension) is a job of its own: self-hosted, on a softswitch
    # its rank 0 hosts; on an external switch it would need a job id and addresses configured there, so it
    # stays reliable (the default group keeps the switch).
    sub_group = dist.is_initialized()
    return ProcessGroupLta(
        backend_options.store,
        backend_options.group_rank,
        backend_options.group_size,
        backend_options.timeout,
        options,
        lossy=not (sub_group and options.switch is not None),
    )


def monitored_barrier(
    group: dist.ProcessGroup | None = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """``dist.monitored_barrier`` for any group: an lta group's is served by its gloo group (torch's own
    function refuses every backend but "gloo" by name), any other group's by torch."""
    target = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(target, ProcessGroupLta):
        target.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        return
    dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def register() -> None:
    """Make ``"lta"`` a torch.distributed backend (idempotent; ``entry.py`` registers the name)."""
    entry.register()


register()
