"""The call forms of torch's collectives, reduced to the one form a backend implements.

torch's ``ProcessGroup`` methods take their options in several shapes, and code calls every one of them:
c10d's Python API passes an options object (``allreduce([t], AllreduceOptions())``); custom DDP comm hooks
and torchft pass a ``ReduceOp`` or nothing (``pg.allreduce([t])``, ``pg.allreduce([t], ReduceOp.SUM)``);
the single-tensor overloads pass a tensor, a root rank and a timeout (``pg.broadcast(t, 0)``,
``pg.allgather(outputs, t)``, ``pg.barrier(timedelta(...))``). The functions here turn each form into
torch 2.13's ``Backend`` form (lists of tensors and one options object), the form gloo's backend takes,
so the lta group decides what goes through the switch on one shape and hands gloo what it accepts.

An options object given is returned as it is (never mutated). Anything that is none of the accepted forms
raises ``TypeError`` with one line naming the collective and the forms it takes.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeGuard, TypeVar

import torch
import torch.distributed as dist

# Missing from torch.distributed's namespace (the other options classes are there).
from torch._C._distributed_c10d import AllgatherOptions

T = TypeVar("T")

_REDUCE_OPS = (dist.ReduceOp, dist.ReduceOp.RedOpType)


def is_reduce_op(value: object) -> bool:
    """Whether ``value`` is a ``ReduceOp`` (``dist.ReduceOp.SUM`` is a ``RedOpType``; ``ReduceOp(...)``
    objects too)."""
    return isinstance(value, _REDUCE_OPS)


def _is_rank(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def options(
    kind: type[T],
    given: object,
    name: str,
    *,
    op: object = None,
    root: int | None = None,
    timeout: timedelta | None = None,
) -> T:
    """``given`` as a ``kind`` options object: itself when it is one; else a new ``kind()`` with the reduce
    op (``given`` or ``op``: a ReduceOp), the root rank and the timeout (``given`` or ``timeout``) set."""
    if isinstance(given, kind):
        return given
    made: Any = kind()
    if is_reduce_op(given) and hasattr(made, "reduceOp"):
        op = given
    elif isinstance(given, timedelta):
        timeout = given
    elif given is not None:
        accepted = f"{kind.__name__}, " + ("a ReduceOp, " if hasattr(made, "reduceOp") else "")
        raise TypeError(f"{name}: opts must be {accepted}a timedelta or absent, got {type(given).__name__}")
    if op is not None:
        if not is_reduce_op(op):
            raise TypeError(f"{name}: op must be a torch.distributed.ReduceOp, got {type(op).__name__}")
        made.reduceOp = op
    if root is not None:
        made.rootRank = root
    if timeout is not None:
        if not isinstance(timeout, timedelta):
            raise TypeError(f"{name}: timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        made.timeout = timeout
    return made


def tensor_list(tensors: object, name: str) -> list[torch.Tensor]:
    """``[tensors]`` for one tensor, ``list(tensors)`` for a sequence of tensors."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in tensors):
        return list(tensors)
    raise TypeError(f"{name}: expected a tensor or a list of tensors, got {type(tensors).__name__}")


# ---- per collective: (tensors as the Backend form, options object) ------------------------------------
def allreduce(tensors: object, opts: object, timeout: timedelta | None) -> tuple[list[torch.Tensor], Any]:
    """``(tensors, opts)``, ``(tensors, op[, timeout])``, ``(tensor, op[, timeout])`` or ``(tensors)``."""
    return tensor_list(tensors, "allreduce"), options(
        dist.AllreduceOptions, opts, "allreduce", timeout=timeout
    )


def allreduce_coalesced(tensors: object, opts: object) -> tuple[list[torch.Tensor], Any]:
    return tensor_list(tensors, "allreduce_coalesced"), options(
        dist.AllreduceCoalescedOptions, opts, "allreduce_coalesced"
    )


def broadcast(tensors: object, opts: object, timeout: timedelta | None) -> tuple[list[torch.Tensor], Any]:
    """``(tensors, opts)``, ``(tensors)`` (root 0) or ``(tensor, root[, timeout])``."""
    if _is_rank(opts):
        return tensor_list(tensors, "broadcast"), options(
            dist.BroadcastOptions, None, "broadcast", root=opts, timeout=timeout
        )
    return tensor_list(tensors, "broadcast"), options(
        dist.BroadcastOptions, opts, "broadcast", timeout=timeout
    )


def reduce(
    tensors: object, opts: object, op: object, timeout: timedelta | None
) -> tuple[list[torch.Tensor], Any]:
    """``(tensors, opts)`` or ``(tensor, root[, op[, timeout]])``."""
    if _is_rank(opts):
        made = options(dist.ReduceOptions, None, "reduce", op=op, root=opts, timeout=timeout)
        return tensor_list(tensors, "reduce"), made
    return tensor_list(tensors, "reduce"), options(dist.ReduceOptions, opts, "reduce", op=op, timeout=timeout)


def allgather(outputs: Any, inputs: object, opts: object) -> tuple[list[list[torch.Tensor]], list, Any]:
    """``(output_lists, inputs, opts)``, ``(output_lists, inputs)`` or ``(outputs, input[, timeout])``."""
    if isinstance(inputs, torch.Tensor):
        return [tensor_list(outputs, "allgather")], [inputs], options(AllgatherOptions, opts, "allgather")
    return (
        [tensor_list(o, "allgather") for o in outputs],
        tensor_list(inputs, "allgather"),
        options(AllgatherOptions, opts, "allgather"),
    )


def gather(
    outputs: Any, inputs: object, opts: object, timeout: timedelta | None, rank: int
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], Any]:
    """``(output_lists, inputs, opts)`` or ``(outputs, input, root[, timeout])`` (outputs on the root)."""
    if _is_rank(opts):
        root = opts
        made = options(dist.GatherOptions, None, "gather", root=root, timeout=timeout)
        lists = [tensor_list(outputs, "gather")] if root == rank else []
        return lists, tensor_list(inputs, "gather"), made
    lists = [tensor_list(o, "gather") for o in outputs]
    return lists, tensor_list(inputs, "gather"), options(dist.GatherOptions, opts, "gather", timeout=timeout)


def scatter(
    outputs: object, inputs: Any, opts: object, timeout: timedelta | None, rank: int
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], Any]:
    """``(outputs, input_lists, opts)`` or ``(output, inputs, root[, timeout])`` (inputs on the root)."""
    if _is_rank(opts):
        root = opts
        made = options(dist.ScatterOptions, None, "scatter", root=root, timeout=timeout)
        lists = [tensor_list(inputs, "scatter")] if root == rank else []
        return tensor_list(outputs, "scatter"), lists, made
    lists = [tensor_list(i, "scatter") for i in inputs]
    return (
        tensor_list(outputs, "scatter"),
        lists,
        options(dist.ScatterOptions, opts, "scatter", timeout=timeout),
    )


def reduce_scatter(
    outputs: object, inputs: Any, opts: object, timeout: timedelta | None
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], Any]:
    """``(outputs, input_lists, opts)`` or ``(output, inputs[, op[, timeout]])``."""
    made = options(dist.ReduceScatterOptions, opts, "reduce_scatter", timeout=timeout)
    if isinstance(outputs, torch.Tensor):
        return [outputs], [tensor_list(inputs, "reduce_scatter")], made
    return tensor_list(outputs, "reduce_scatter"), [tensor_list(i, "reduce_scatter") for i in inputs], made


def barrier(opts: object) -> Any:
    """``(opts)``, ``(timeout)`` or ``()``."""
    return options(dist.BarrierOptions, opts, "barrier")
