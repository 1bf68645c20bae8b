"""Host staging: the transport reads and writes numpy float32 arrays; tensors may live on a device.

A CPU float32 tensor is used in place (the numpy array *is* its memory, no copy). Anything else — a CUDA
tensor, another dtype, or a CPU tensor with staging forced (how the device path is tested without a GPU)
— goes through one float32 host buffer allocated once, pinned when an accelerator is present so the
copies are DMA transfers. Host→device copies are asynchronous; the next host access waits for them.
"""

from __future__ import annotations

import numpy as np
import torch


def _needs_staging(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "cpu" or tensor.dtype != torch.float32 or not tensor.is_contiguous()


class HostMirror:
    """A float32 host array ``array`` that mirrors the 1-D tensor ``tensor``.

    ``pull`` copies device→host and ``push`` host→device (both no-ops when the array is the tensor's own
    memory). Guarantees: after ``pull(lo, hi)`` returns, ``array[lo:hi]`` equals the tensor's values; after
    ``push(lo, hi)`` the tensor holds ``array[lo:hi]`` for every later op on the current stream."""

    def __init__(self, tensor: torch.Tensor, *, force_staging: bool = False) -> None:
        if tensor.dim() != 1:
            raise ValueError(f"HostMirror takes a flat (1-D) tensor, got shape {tuple(tensor.shape)}")
        self.tensor = tensor
        self.staged = force_staging or _needs_staging(tensor)
        if self.staged:
            pin = tensor.device.type == "cuda" or torch.cuda.is_available()
            self._host = torch.empty(tensor.numel(), dtype=torch.float32, pin_memory=pin)
        else:
            self._host = tensor
        self.array: np.ndarray = self._host.detach().numpy()
        self._pending: torch.cuda.Event | None = None

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.synchronize()  # an async host→device copy may still read the host buffer
            self._pending = None

    def pull(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Make ``array[lo:hi]`` current; returns the whole array."""
        self._wait()
        if self.staged:
            self._host[lo:hi].copy_(self.tensor[lo:hi])  # blocking: the host reads it next
        return self.array

    def writable(self) -> np.ndarray:
        """The host array, safe to overwrite (no copy from it is still in flight)."""
        self._wait()
        return self.array

    def push(self, lo: int = 0, hi: int | None = None) -> None:
        """Copy ``array[lo:hi]`` to the tensor."""
        if not self.staged:
            return
        on_device = self.tensor.device.type == "cuda"
        self.tensor[lo:hi].copy_(self._host[lo:hi], non_blocking=on_device)
        if on_device:
            self._pending = torch.cuda.Event()
            self._pending.record()
