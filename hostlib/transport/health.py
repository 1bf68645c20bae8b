"""Health: whether the switch answers before training (:func:`probe_switch`), and whether training runs
on the other workers' gradients rather than on fallbacks (:class:`HealthMonitor`, docs/protocol.md,
"Health during training")."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from hostlib.errors import HealthCheckError, UnhealthyTraining
from hostlib.protocol import HEADER_DTYPE, PROBE_SEQ, VERSION, Flag, Op, batch_rows
from hostlib.transport.config import TransportConfig
from hostlib.transport.deadlines import Deadlines

if TYPE_CHECKING:
    from hostlib.transport.engine import ReduceEngine

_RESULT, _RETX = int(Op.RESULT), int(Flag.RETX)

log = logging.getLogger(__name__)


def probe_switch(
    engine: ReduceEngine, switch_addr: tuple[str, int], address: tuple[str, int], timeout_s: float
) -> float:
    """Ask the switch whether it knows this job and this worker's address: FLUSH round ``PROBE_SEQ`` of
    the reserved slot P-1, resent with backoff (from 50 ms) until a RESULT for it comes back or
    ``timeout_s`` passes. Returns the seconds the answer took; raises :class:`HealthCheckError` saying
    what to check when none came (``address``: the worker's own, for the message)."""
    timeout, cfg = timeout_s, engine.config
    # `step` carries the run's incarnation: a switch forgets the job's slots at its first probe of a
    # new one (docs/protocol.md, "Run after run").
    probe = engine.control_batch(1, Op.FLUSH, engine.config.incarnation)
    probe["slot"], probe["seq"] = engine.probe_slot, PROBE_SEQ
    if engine.own_leaf:  # a leaf's first probe goes up as an empty partial (GRAD), its repeats as FLUSHes
        probe["op"] = int(Op.GRAD)
    rows = batch_rows(probe)
    t0 = time.perf_counter()
    give_up, resend_at, gap = t0 + timeout, t0, 0.05
    while True:
        now = time.perf_counter()
        if now >= resend_at:
            engine.send(rows)
            resend_at, gap = now + gap, min(2 * gap, 0.5)
            probe["flags"] |= (
                _RETX  # the next ones are repeats (see ReduceEngine._send_flushes); rows is a view
            )
            probe["op"] = int(Op.FLUSH)
        if now >= give_up:
            break
        n = engine.io.recv(max(0.0, min(resend_at, give_up) - now))
        if n:
            engine.stats.packets_received += n
            answered = bool(_probe_answers(engine, n).any())
            engine.receive_batch(n)  # parameter broadcasts of peers that started first are kept
            if answered:
                elapsed = time.perf_counter() - t0
                log.debug(
                    "switch %s answered job %d's probe in %.1f ms",
                    switch_addr,
                    engine.job_id,
                    elapsed * 1e3,
                )
                return elapsed
    host, port = switch_addr
    me = f"{address[0]}:{address[1]}"
    raise HealthCheckError(
        f"the LTA switch at {host}:{port} did not answer worker {engine.worker_id} of job {engine.job_id} "
        f"(from {me}) within {timeout:g} s: check that the switch runs there (LTA_SWITCH), that job "
        f"{engine.job_id} is configured with worker {engine.worker_id} at {me} (a mismatch counts as "
        f"drop_bad_worker), and that its elems_per_packet is {cfg.elems_per_packet} and its "
        f"pool_size {cfg.pool_size}, as here"
    )


def _probe_answers(engine: ReduceEngine, n: int) -> np.ndarray:
    """Rows among the first ``n`` received that answer the health probe."""
    data = engine.io.rx.data
    hdr = np.ndarray((n,), dtype=HEADER_DTYPE, buffer=data, strides=(data.strides[0],))
    return (
        (engine.io.rx.lens[:n] == engine.packet_bytes)
        & (hdr["version"] == VERSION)
        & (hdr["job_id"] == engine.job_id)
        & (hdr["op"] == _RESULT)
        & (hdr["slot"] == engine.probe_slot)
        & (hdr["seq"] == PROBE_SEQ)
    )


class HealthMonitor:
    """The health verdicts of one worker during training (see TransportConfig.on_unhealthy)."""

    def __init__(
        self,
        config: TransportConfig,
        job_id: int,
        worker_id: int,
        n_workers: int,
        switch_addr: tuple[str, int],
        deadlines: Deadlines,
    ) -> None:
        self.config, self.job_id, self.worker_id, self.n_workers = config, job_id, worker_id, n_workers
        self._switch_addr, self._deadlines = switch_addr, deadlines
        self.last_nothing_fraction = 0.0  # share of the last reduce's chunks that got no aggregate
        self._unhealthy_run = 0  # unhealthy reduces in a row
        self._unhealthy_run_chunks = 0
        self._lockout_run = 0  # reduces in a row that ended with this worker locked out (_check_lockout)
        self._skipped_run = 0  # reduces in a row its peers had left before it started them
        self._unhealthy_since_mark = False
        # Set by the torch layer when it can heal this worker from a peer (hostlib/torch_ext/heal.py):
        # past catch_up_reduces skipped reduces it is then ``behind`` (healed at its next step boundary)
        # instead of unhealthy.
        self.can_heal = False
        self.behind = False
        self.last_passed = False  # the last reduce was over before this worker started it (skipped)

    @property
    def healthy(self) -> bool:
        """False while the latest reduces got (almost) nothing from the network, or ended with this worker
        locked out of its peers' rounds (config.on_unhealthy)."""
        return self._unhealthy_run == 0 and self._lockout_run == 0

    def unhealthy_since_mark(self, reset: bool = True) -> bool:
        """Whether any reduce since the last call (with ``reset``) was unhealthy; the torch layer's
        per-step ``should_commit`` signal."""
        seen = self._unhealthy_since_mark
        if reset:
            self._unhealthy_since_mark = False
        return seen

    def check(self, got_nothing: int, chunks: int, passed: bool = False) -> None:
        """One reduce's verdict: ``got_nothing`` of its ``chunks`` got no aggregate; ``passed``: the peers
        had left it before this worker started it. Raises or warns as ``config.on_unhealthy`` says."""
        cfg = self.config
        self.last_nothing_fraction = got_nothing / chunks
        self.last_passed = passed and got_nothing == chunks and self.n_workers > 1
        if self.last_passed:
            # A reduce the peers had left before this worker started it (stopped, descheduled): every unit
            # was overtaken. Skipping it is how a late worker catches up (docs/protocol.md, "Health during
            # training"), so it counts toward neither run below, up to catch_up_reduces in a row.
            self._unhealthy_since_mark = True
            self._skipped_run += 1
            if self._skipped_run > cfg.catch_up_reduces and self.can_heal:
                if not self.behind:
                    log.info(
                        "worker %d of job %d: %d reduces in a row were over before it started them: "
                        "it takes a peer's state at its next step boundary",
                        self.worker_id,
                        self.job_id,
                        self._skipped_run,
                    )
                self.behind = True
                return
            if self._skipped_run > cfg.catch_up_reduces:
                message = (
                    f"worker {self.worker_id} of job {self.job_id}: {self._skipped_run} reduces in a row "
                    f"were over before it started them (its peers had moved past each while it was stopped "
                    f"or descheduled, or they finished and left the job); it cannot catch up within "
                    f"catch_up_reduces={cfg.catch_up_reduces}"
                )
                self._report_unhealthy(message, first=self._skipped_run == cfg.catch_up_reduces + 1)
            return
        self._skipped_run = 0
        self._check_lockout(chunks)
        if self.last_nothing_fraction < cfg.unhealthy_fraction:
            self._unhealthy_run = self._unhealthy_run_chunks = 0
            return
        self._unhealthy_since_mark = True
        self._unhealthy_run += 1
        self._unhealthy_run_chunks += chunks
        if (
            self._unhealthy_run < cfg.unhealthy_reduces
            or self._unhealthy_run_chunks < cfg.unhealthy_min_chunks
        ):
            return
        message = (
            f"worker {self.worker_id} of job {self.job_id}: {self._unhealthy_run} reduces in a row "
            f"({self._unhealthy_run_chunks} chunks) got no aggregate for at least "
            f"{cfg.unhealthy_fraction:.0%} of their chunks (last {self.last_nothing_fraction:.0%}); training "
            f"is running on fallbacks, not on the other workers' gradients. Check the switch at "
            f"{self._switch_addr[0]}:{self._switch_addr[1]} and the loss on the path"
        )
        self._report_unhealthy(message, first=self._unhealthy_run == cfg.unhealthy_reduces)

    def healed(self) -> None:
        """The worker took a peer's state and stands where its peers are: no reduce skipped any more."""
        self.behind = False
        self._skipped_run = 0

    def _check_lockout(self, chunks: int) -> None:
        """A worker whose own bit was missing from every RESULT of a whole window (``Deadlines
        .track_absent``: its peers close its rounds without it, so it stays behind them) and that got
        no aggregate for at least ``lockout_fraction`` of its chunks
        trains on stale fallbacks that feed themselves: after ``unhealthy_reduces`` such reduces in a row,
        it is unhealthy with that cause named (the 90% check alone let a replica at 60-70% fallbacks run
        to the end untrained: chaos seed 84)."""
        cfg = self.config
        own = (int(self._deadlines.presumed_dead) >> self.worker_id) & 1
        if not own or self.last_nothing_fraction < cfg.lockout_fraction or self.n_workers < 2:
            self._lockout_run = 0
            return
        self._lockout_run += 1
        self._unhealthy_since_mark = True
        if self._lockout_run < cfg.unhealthy_reduces:
            return
        message = (
            f"worker {self.worker_id} of job {self.job_id}: locked out: its peers close every round without "
            f"it (its GRADs counted in no RESULT of a whole window, {self._lockout_run} "
            f"reduces in a row); {self.last_nothing_fraction:.0%} of the last reduce's {chunks} chunks got "
            f"no aggregate, so its replica trains on stale fallbacks. It fell behind them (stopped, "
            f"descheduled, or a burst of lost RESULTs) and cannot rejoin their rounds"
        )
        self._report_unhealthy(message, first=self._lockout_run == cfg.unhealthy_reduces)

    def _report_unhealthy(self, message: str, *, first: bool) -> None:
        """What ``config.on_unhealthy`` says to do with an unhealthy run: raise, or warn once (``first``:
        the reduce that reached the run's bound), or nothing."""
        if self.config.on_unhealthy == "raise":
            raise UnhealthyTraining(message)
        if self.config.on_unhealthy == "warn" and first:
            log.warning(message)
