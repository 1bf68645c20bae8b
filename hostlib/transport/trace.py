"""``EngineTrace``: what a benchmark may watch in a reduce, without patching the engine.

``ReduceEngine.trace`` (or ``LtaWorker(..., trace=...)``) takes one; the engine calls its methods at
each step of a reduce, with itself and the reduce's plan. Every method does nothing here: a tracer
overrides those it needs. The engine skips all of it when ``trace`` is None (the default), so tracing
costs nothing unless asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hostlib.transport.engine import ReduceEngine
    from hostlib.transport.plan import ReducePlan
    from hostlib.transport.result import ReduceResult


class EngineTrace:
    def on_reduce_start(self, engine: ReduceEngine, plan: ReducePlan) -> None:
        """A reduce's plan is set and nothing is sent yet."""

    def on_sent(self, engine: ReduceEngine, plan: ReducePlan) -> None:
        """A send pass ended (``plan.next_unit`` is the first unit not sent yet)."""

    def on_recv(self, engine: ReduceEngine, timeout_s: float, n: int, t_in: float, t_out: float) -> None:
        """A receive asked to wait ``timeout_s`` took from ``t_in`` to ``t_out`` (perf_counter) and got
        ``n`` datagrams (not handled yet)."""

    def on_settled(self, engine: ReduceEngine, plan: ReducePlan, units: np.ndarray) -> None:
        """RESULTs settled ``units`` (plan-local unit numbers)."""

    def on_deadlines(self, engine: ReduceEngine, plan: ReducePlan, due: np.ndarray) -> None:
        """The deadlines of ``due`` passed; they are about to be resent, probed, FLUSHed or given up."""

    def on_flushes(self, engine: ReduceEngine, plan: ReducePlan, units: np.ndarray) -> None:
        """FLUSHes of ``units`` are about to go (``plan.flushes`` already counts them)."""

    def on_reduce_end(self, engine: ReduceEngine, plan: ReducePlan, result: ReduceResult) -> None:
        """The reduce is over and ``result`` built (statistics updated)."""
