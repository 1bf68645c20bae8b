"""Train through a parameter server (``lta ps``) by swapping the optimizer, not the loop.

``PSOptimizer(model.parameters(), client, lr=0.05)`` and the loop stays ``loss.backward();
opt.step(); opt.zero_grad()``. Each ``step``:

1. the parameters' gradients are gathered into one flat float32 vector and pushed (encoded by the job's
   compression; a top-k residual stays on this worker), with the learning rate of the optimizer's group,
   so an LR scheduler attached to this optimizer drives the server's step;
2. the server's parameters are pulled and written into the model (sync: once the step is applied;
   async: at once, and a push refused as too stale only means the model is refreshed).

The optimizer itself (SGD with momentum, its ``lr`` and ``momentum``) runs on the server: ``momentum``
here is the job's, set on the server (``lta ps --momentum``). Construction calls
``client.initialize``: the first worker's parameters become the job's and every worker starts from them.

``PSOptimizer.from_env(params, lr=...)`` builds the client from ``LTA_PS=host:port`` (the server),
``LTA_JOB_ID`` (1), ``RANK`` (0), ``LTA_ELEMS_PER_PACKET`` (64), ``LTA_PS_COMPRESSION`` (none) and
``LTA_PS_TOPK_RATIO`` (0.01): choosing the parameter server is configuration.

Like the switch's wrappers, this one is thin: the client, the host staging buffers of the flat
gradients and parameters, and the step counter are an :class:`LtaManager`'s (``manager.py``);
``lta_stats(opt)`` reports the client's counters.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from hostlib.errors import UsageError
from hostlib.protocol import MAX_ELEMS_PER_PACKET, MAX_JOBS
from hostlib.ps.client import PsClient, PsClientConfig
from hostlib.ps.wire import ALIASES, CODEC_BY_NAME
from hostlib.torch_ext.envparse import EnvReader
from hostlib.torch_ext.flat import FlatParams
from hostlib.torch_ext.manager import LtaManager


class PSOptimizer(torch.optim.Optimizer):
    """An optimizer whose step is a push of the gradients and a pull of the parameters."""

    def __init__(
        self, params: Iterable[torch.Tensor], client: PsClient | LtaManager, *, lr: float | None = None
    ) -> None:
        param_list = [p for p in params]
        if not param_list:
            raise ValueError("PSOptimizer got no parameters")
        super().__init__(param_list, {"lr": lr})
        self.manager = LtaManager.of(client)
        self.flat = FlatParams(param_list, self.client.k)
        n = self.flat.numel
        self._grads_host = self.manager.mirror(("ps", "grads"), self.flat.grad[:n])
        self._params_host = self.manager.mirror(("ps", "params"), self.flat.data[:n])
        with torch.no_grad():
            self._write(self.client.initialize(self._params_host.pull().copy()))

    @property
    def client(self) -> PsClient:
        return self.manager.ps_client

    @classmethod
    def from_env(cls, params: Iterable[torch.Tensor], *, lr: float | None = None) -> PSOptimizer:
        """A PSOptimizer whose client the ``LTA_PS*`` variables describe (module docstring)."""
        read = EnvReader(os.environ)
        address = read.address("LTA_PS")
        if address is None:
            raise UsageError(
                "LTA_PS is not set: give the parameter server as LTA_PS=host:port (lta ps --listen)"
            )
        compression = read.choice("LTA_PS_COMPRESSION", "none", (*CODEC_BY_NAME, *ALIASES))
        k = read.integer("LTA_ELEMS_PER_PACKET", 64, 1, MAX_ELEMS_PER_PACKET)
        topk_ratio = read.real("LTA_PS_TOPK_RATIO", 0.01, 0.0, 1.0)
        job_id, rank = read.integer("LTA_JOB_ID", 1, 1, MAX_JOBS - 1), read.integer("RANK", 0, 0)
        try:
            config = PsClientConfig(elems_per_packet=k, compression=compression, topk_ratio=topk_ratio)
            client = PsClient(address, job_id, rank, config=config)
        except ValueError as exc:  # a combination the variables' own ranges allow (e.g. int8 with K = 1)
            raise UsageError(f"LTA_PS* variables: {exc}") from None
        return cls(params, client, lr=lr)

    def _write(self, values: np.ndarray) -> None:
        self._params_host.writable()[:] = np.asarray(values, dtype=np.float32)
        self._params_host.push()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Push this worker's gradients, then load the server's parameters into the model."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.flat.gather_grads()
        grads = self._grads_host.pull()
        lr = self.param_groups[0].get("lr")
        self._write(self.client.step(grads, lr=None if lr is None else float(lr)))
        self.manager.end_step()
        return loss

    def ps_stats(self) -> dict[str, Any]:
        """The client's counters: pushes, rejected pushes, staleness, bytes, resends."""
        return {"version": self.client.version, **self.client.stats.as_dict()}
