"""Worker side of LTA over UDP: reduce a float32 tensor through a switch, renormalize, fall back.

``LtaWorker.allreduce(x)`` returns the mean over the workers whose contribution reached the switch,
chunk by chunk (sum · 2^-exp / count), together with each chunk's count, bitmap and the fallback used
where nothing arrived. It never waits without a deadline: a unit (one packet's worth) that gets no
RESULT is FLUSHed at its deadline, up to ``max_flushes`` times, then given up.

One module per concern: ``config`` (TransportConfig, fallbacks, path-MTU packet size), ``plan`` (the
buffers of one reduce, critical chunk masks), ``deadlines`` (RTO, deadline rules, early flushes, critical
resends), ``io`` (batched socket I/O), ``pacing`` (token bucket, learned bottleneck rate), ``earlyclose``
(LTP's loss-tolerant threshold and deadline), ``result`` (ReduceResult, statistics, the
renormalize/fallback rule), ``engine`` (ReduceEngine: the one owner of a reduce), ``health`` (switch
probe, training health), ``trace`` (EngineTrace, the engine's hook for benchmarks), ``native`` (which
engine path runs: the Python reference or the native steady state of ``hostlib/_engine.c``,
``LTA_ENGINE``), ``worker`` (LtaWorker, the front users hold).

LTP's mechanisms (seed 002), all off by default: ``allreduce(x, critical=...)`` marks chunks that must
come back with every worker counted (resent, never FLUSHed); ``TransportConfig(pace_gbps=...)`` or
``pace_learn=True`` paces the sends; ``TransportConfig(early_close_theta=...)`` ends a reduce once
1 - theta of its units are in and its expected completion time has passed.
The protocol pieces (header, slots, exponent rounds) are described in docs/protocol.md.
"""

from hostlib.transport.config import FALLBACK_POLICIES, Fallback, TransportConfig, elems_for_path
from hostlib.transport.result import ReduceResult, TransportStats
from hostlib.transport.worker import LtaWorker

__all__ = [
    "FALLBACK_POLICIES",
    "Fallback",
    "LtaWorker",
    "ReduceResult",
    "TransportConfig",
    "TransportStats",
    "elems_for_path",
]
