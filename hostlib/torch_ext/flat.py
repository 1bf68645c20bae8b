"""One contiguous buffer for all parameters (and one for their gradients), ZeRO style.

``FlatParams`` copies the parameters end to end into a single float32 tensor padded to whole chunks and
rebinds every ``param.data`` to its slice, so the model, the optimizer's shard and the wire all see the
same memory: an owner's update and a received broadcast land in the model without further copies.
"""

from __future__ import annotations

import math

import torch


class FlatParams:
    """``data``: the parameters end to end (``numel`` values, zero padding up to ``padded``); ``grad``:
    a buffer of the same size that :meth:`gather_grads` fills from ``param.grad``."""

    def __init__(self, params: list[torch.Tensor], elems_per_chunk: int) -> None:
        if not params:
            raise ValueError("no parameters to flatten")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice; list each once")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(
                f"parameters live on several devices {sorted(map(str, devices))}; move the model to one"
            )
        bad = [tuple(p.shape) for p in params if p.dtype != torch.float32]
        if bad:
            raise TypeError(
                f"LTA sends float32; {len(bad)} parameters are not (first shape {bad[0]}): "
                "call model.float() before wrapping (mixed precision keeps float32 master weights anyway)"
            )
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / elems_per_chunk) * elems_per_chunk
        device = params[0].device
        self.data = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.grad = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.ranges: list[tuple[int, int]] = []
        offset = 0
        with torch.no_grad():
            for p in params:
                lo, hi = offset, offset + p.numel()
                self.data[lo:hi].copy_(p.detach().reshape(-1))
                p.data = self.data[lo:hi].view_as(p)
                self.ranges.append((lo, hi))
                offset = hi

    def gather_grads(self) -> None:
        """``grad[lo:hi] = param.grad`` for every parameter (zero where a parameter got no gradient)."""
        with torch.no_grad():
            for p, (lo, hi) in zip(self.params, self.ranges, strict=True):
                if p.grad is None:
                    self.grad[lo:hi].zero_()
                else:
                    self.grad[lo:hi].copy_(p.grad.reshape(-1))
