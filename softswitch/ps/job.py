"""One parameter-server job: parameters, optimizer, and the sync or async rule, packet in, packets out.

No sockets here: :meth:`PsJob.handle` takes one decoded packet and the time, :meth:`PsJob.tick` the time
alone, and both return the PARAM packets to send. The UDP daemon (``server.py``) and the tests drive the
same object.

**Parameters and optimizer.** The first worker whose INIT arrives owns the initialization; once all its
chunks are in, the job holds ``n_params`` float32 values (padded to whole chunks of K) and a momentum
buffer, and applies SGD with momentum to every gradient ``g`` it accepts: ``v = momentum·v + g;
p -= lr·v`` on the coordinates ``g`` covers (the lr carried by the push, else the job's).

**Sync** (``mode = "sync"``). Pushes computed on the current version ``step`` go into the open window,
one row per worker, packet by packet. A worker has finished when all its packets arrived or its PULL
did (what was lost is lost). The window closes when ``window_size`` workers finished, once every worker
not presumed gone (heard from, then silent ``liveness_timeout_s``) finished, or ``max_wait_s`` after its
first packet; then, for every set of packets that arrived from the same workers (one set
per bitmap of contributors), the rule aggregates those workers' rows over those packets' values: the
count that arrived renormalizes the mean, and a robust rule sees exactly the contributions that
arrived. A set too small for the rule falls back (``fallback``) or is left out; both are counted. The
step is applied with the median of the contributors' learning rates, the version advances, and every
held PULL is answered. A push for an older version is late: dropped, counted, and its PULL is answered
at once with the REJECTED flag.

**Async** (``mode = "async"``). The first packet of each push decides for the whole push: staleness =
step − the push's step; accepted when within the worker's bound (``staleness.py``), and then the
version advances and each of its packets is applied as it arrives; rejected pushes are dropped and
counted. A PULL is answered at once with the current parameters, flagged REJECTED if that push was
refused, its staleness in ``weight``.

**Restarts.** An INIT carries its process's incarnation (``step``); a new one for a worker resets that
worker's push state, and with learned addresses takes the worker's id to a new address once the old one
has been silent ``liveness_timeout_s`` (docs/protocol.md, "Liveness and restarts").
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hostlib.batchio import addr_key
from hostlib.emulation.dropmodels import DropStream
from hostlib.protocol import HEADER_BYTES, VERSION, PsCodec, PsFlag, PsOp
from hostlib.ps import robust
from hostlib.ps.wire import (
    bitmap_chunks,
    build_packets,
    codec_of,
    decode_dense,
    decode_topk,
    dense_packets,
    lr_from_bits,
    param_chunks,
    rows_to_floats,
    values_per_packet,
)
from softswitch.ps.config import PS_DIRECTIONS, PsJobConfig
from softswitch.ps.staleness import StalenessPolicy

log = logging.getLogger(__name__)

# Counters of one job, one per branch of the rules above (``lta ps --stats-every`` prints them).
PS_COUNTERS: tuple[str, ...] = (
    "rx_packets",
    "drop_malformed",  # wrong length, nelem > K, chunk out of range, packet count that does not fit
    "drop_bad_worker",  # worker id out of range, or not from that worker's address
    "drop_codec",  # a PUSH encoded otherwise than the job's compression
    "drop_policy_up",  # emulated loss of a PUSH packet
    "drop_policy_down",  # emulated loss of a PARAM packet
    "init_chunks",  # INIT chunks stored
    "init_ignored",  # INIT once initialized, from another worker than the owner, or of another size
    "push_packets",  # PUSH packets applied (async) or stored in the window (sync)
    "push_uninitialized",  # PUSH before the parameters exist
    "push_dup",  # a packet of a push seen already
    "push_late",  # sync: a packet for a version whose window has closed
    "push_future",  # a push claiming a version the server has not reached
    "push_old",  # async: a packet of an earlier push of the same worker
    "push_rejected_packets",  # async: packets of a rejected push
    "pushes",  # async: pushes decided; sync: workers that contributed to a closed window
    "pushes_accepted",
    "pushes_rejected",  # async: too stale; sync: late for their window
    "staleness_sum",  # async: summed staleness of the accepted pushes
    "staleness_sum_submitted",  # async: summed staleness of every decided push
    "windows_full",  # sync: closed by window_size finished pushes
    "windows_timeout",  # sync: closed by max_wait_s
    "windows_live",  # sync: closed once every worker not presumed gone had finished
    "workers_rejoined",  # an INIT of a new incarnation of a worker that had pushed: its push state reset
    "workers_readdressed",  # a restarted worker's INIT from a new address (its old one silent)
    "windows_empty",  # sync: closed with no contribution at all
    "rule_groups",  # sync: sets of packets aggregated by the rule (one per contributor bitmap)
    "rule_fallbacks",  # sync: a set too small for the rule, aggregated by the fallback
    "rule_refusals",  # sync: a set no rule could aggregate: its values were not updated
    "rows_nonfinite",  # sync: a worker's values holding NaN/Inf, left out of their set
    "values_empty",  # sync: values of a closed window that no worker's packet carried
    "steps_applied",  # updates applied to the parameters (sync windows, async pushes)
    "pull_packets",
    "pull_held",  # PULLs waiting for their window (sync) or for the parameters to exist
    "param_packets",  # PARAM packets sent (after the down policy)
    "tx_packets",
)
MAX_PARAMS = 1 << 28  # an INIT naming more parameters (1 GiB of float32) is refused as malformed

_PUSH, _PULL, _INIT = int(PsOp.PUSH), int(PsOp.PULL), int(PsOp.INIT)
_REJECTED = int(PsFlag.REJECTED)


@dataclass(frozen=True)
class Packet:
    """The header fields a job needs, and the payload bytes (4K)."""

    op: int
    worker: int
    exp: int
    slot: int
    nelem: int
    seq: int
    step: int
    chunk: int
    bitmap: int
    payload: np.ndarray  # uint8, 4K


OutRows = tuple[np.ndarray, np.ndarray]  # (m, packet bytes) uint8 rows and (m,) int64 address keys


class _Window:
    """The open synchronous window: one row of packets per worker."""

    def __init__(self, n: int, packets: int, k: int) -> None:
        self.raw = np.zeros((n, packets, 4 * k), dtype=np.uint8)
        self.arrived = np.zeros((n, packets), dtype=bool)
        self.nelem = np.zeros((n, packets), dtype=np.int64)
        self.n_packets = np.zeros(n, dtype=np.int64)
        self.done = np.zeros(n, dtype=bool)
        self.lr = np.full(n, np.nan)
        self.seq = np.zeros(n, dtype=np.int64)
        self.opened: float | None = None

    def reset(self) -> None:
        self.arrived[:] = False
        self.done[:] = False
        self.lr[:] = np.nan
        self.seq[:] = 0
        self.n_packets[:] = 0
        self.opened = None


class PsJob:
    """The state of one parameter-server job (see the module docstring for its rules)."""

    def __init__(self, cfg: PsJobConfig, seed: int = 0, *, log_pushes: bool = False) -> None:
        self.cfg = cfg
        self.k = cfg.elems_per_packet
        self.codec = codec_of(cfg.compression)
        self.packet_bytes = HEADER_BYTES + 4 * self.k
        self.n = cfg.n_workers
        self.counters = dict.fromkeys(PS_COUNTERS, 0)
        self.keys = np.full(self.n, -1, dtype=np.int64)  # address key per worker (-1: not seen yet)
        self.fixed_addresses = cfg.workers is not None
        if cfg.workers is not None:
            self.keys[:] = [addr_key(a) for a in cfg.workers]
        self.params: np.ndarray | None = None
        self.velocity: np.ndarray | None = None
        self.n_params = 0
        self.step = 0
        self._init_owner: int | None = None
        self._init_buf: np.ndarray | None = None
        self._init_got: np.ndarray | None = None
        self._pending: dict[int, tuple[int, np.ndarray]] = {}  # held PULLs: worker -> (seq, chunks)
        self._last_seen = np.full(self.n, -np.inf)  # when each worker's last packet came (-inf: never)
        self._incarnation = np.zeros(self.n, dtype=np.int64)  # each worker's INIT `step` (0: none yet)
        self._streams = self._drop_streams(seed)
        self._last_count = 0
        self._last_bitmap = 0
        self.last_window: dict[str, object] = {}
        # sync
        self._window: _Window | None = None
        self._late_seq = np.zeros(self.n, dtype=np.int64)
        self._included_seq = np.zeros(self.n, dtype=np.int64)
        # async
        self.policy = StalenessPolicy(self.n, cfg.staleness)
        self._cur_seq = np.zeros(self.n, dtype=np.int64)
        self._accepted = np.zeros(self.n, dtype=bool)
        self._staleness = np.zeros(self.n, dtype=np.int64)
        self._seen: list[set[int]] = [set() for _ in range(self.n)]
        # Every applied async packet in order: (worker, seq, step, chunk, lr) — for replays and tests.
        self.push_log: list[tuple[int, int, int, int, float]] | None = [] if log_pushes else None

    # ---- setup ------------------------------------------------------------------------------------------
    def _drop_streams(self, seed: int) -> dict[tuple[str, int], DropStream]:
        streams: dict[tuple[str, int], DropStream] = {}
        for drop in self.cfg.drops:
            workers = range(self.n) if drop.worker is None else [drop.worker]
            for w in workers:
                if drop.worker is None and (drop.direction, w) in streams:
                    continue  # a per-worker policy wins over the job-wide one
                entropy = [seed, self.cfg.job_id, PS_DIRECTIONS.index(drop.direction), w]
                stream_seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
                streams[(drop.direction, w)] = DropStream(drop.policy, stream_seed)
        return streams

    def _count(self, name: str, by: int = 1) -> None:
        self.counters[name] += by

    @property
    def initialized(self) -> bool:
        return self.params is not None

    @property
    def n_chunks(self) -> int:
        return param_chunks(self.n_params, self.k)

    # ---- packets in --------------------------------------------------------------------------------------
    def check_sender(self, worker: int, key: int, now: float = 0.0, op: int = -1) -> bool:
        """Whether ``key`` may speak for ``worker`` (learning the address of a worker seen first). An INIT
        from a new address takes the worker over once its old address has been silent for
        ``liveness_timeout_s`` (a restarted worker: learned addresses only; docs/protocol.md)."""
        if worker >= self.n:
            return False
        known = int(self.keys[worker])
        if known == key:
            pass
        elif known < 0 and not self.fixed_addresses:
            self.keys[worker] = key
        elif op == _INIT and not self.fixed_addresses and self._gone(now)[worker]:
            self.keys[worker] = key
            self._count("workers_readdressed")
            log.info("job %d: worker %d rejoins from a new address", self.cfg.job_id, worker)
        else:
            return False
        self._last_seen[worker] = now
        return True

    def _gone(self, now: float) -> np.ndarray:
        """Per worker, presumed gone: heard from, then silent for ``liveness_timeout_s`` (0: never presumed
        gone). A worker never heard from is waited for as before (``max_wait_s``): it may be starting."""
        seen = self._last_seen
        timeout = self.cfg.liveness_timeout_s
        return np.isfinite(seen) & (now - seen >= timeout) & (timeout > 0)

    def handle(self, pkt: Packet, now: float) -> list[OutRows]:
        """One packet from its (checked) worker; returns the PARAM packets to send."""
        if pkt.nelem > self.k:
            self._count("drop_malformed")
            return []
        if pkt.op == _PUSH:
            return self._on_push(pkt, now)
        if pkt.op == _PULL:
            return self._on_pull(pkt, now)
        return self._on_init(pkt)

    def tick(self, now: float) -> list[OutRows]:
        """Close a synchronous window whose ``max_wait_s`` has passed, or whose unfinished workers have
        all been presumed gone since."""
        win = self._window
        if win is None or win.opened is None:
            return []
        if now - win.opened >= self.cfg.max_wait_s:
            return self._close(now, "windows_timeout")
        return self._maybe_close(now)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` has something to do next (None: nothing pending)."""
        win = self._window
        if win is None or win.opened is None:
            return None
        deadline = win.opened + self.cfg.max_wait_s
        timeout = self.cfg.liveness_timeout_s
        waiting = self._last_seen[~win.done]
        waiting = waiting[np.isfinite(waiting)]
        if timeout > 0 and waiting.size:
            deadline = min(deadline, float(waiting.max()) + timeout)
        return deadline

    # ---- INIT ----------------------------------------------------------------------------------------------
    def _on_init(self, pkt: Packet) -> list[OutRows]:
        w, incarnation = pkt.worker, pkt.step
        if incarnation and incarnation != self._incarnation[w]:
            if self._incarnation[w]:
                self._rejoin(w)
            self._incarnation[w] = incarnation
        n_params = pkt.seq
        if self.params is not None or (self.cfg.n_params is not None and n_params != self.cfg.n_params):
            self._count("init_ignored")
            return []
        if not 1 <= n_params <= MAX_PARAMS:
            self._count("drop_malformed")
            return []
        if self._init_owner is None:
            self._init_owner = pkt.worker
            self.n_params = n_params
            self._init_buf = np.zeros(self.n_chunks * self.k, dtype=np.float32)
            self._init_got = np.zeros(self.n_chunks, dtype=bool)
        elif pkt.worker != self._init_owner or n_params != self.n_params:
            self._count("init_ignored")
            return []
        assert self._init_buf is not None and self._init_got is not None
        if pkt.chunk >= self.n_chunks:
            self._count("drop_malformed")
            return []
        lo = pkt.chunk * self.k
        self._init_buf[lo : lo + self.k] = rows_to_floats(pkt.payload[None, :], self.k)[0]
        self._init_got[pkt.chunk] = True
        self._count("init_chunks")
        if not self._init_got.all():
            return []
        self.params = self._init_buf
        self.velocity = np.zeros_like(self.params)
        self._init_buf = self._init_got = None
        if self.cfg.mode == "sync":
            self._window = _Window(self.n, self._max_push_packets(), self.k)
        log.info(
            "job %d initialized by worker %d: %d parameters", self.cfg.job_id, self._init_owner, self.n_params
        )
        pending, self._pending = self._pending, {}
        return [self._reply(w, seq, chunks, 0, 0) for w, (seq, chunks) in pending.items()]

    def _rejoin(self, w: int) -> None:
        """Worker ``w`` started again (an INIT of a new incarnation): forget its old process's pushes, so
        its new pushes, numbered from 1 again, are not taken for old or late ones."""
        self._count("workers_rejoined")
        log.info("job %d: worker %d started again: its push state is reset", self.cfg.job_id, w)
        self._late_seq[w] = self._included_seq[w] = 0
        self._cur_seq[w], self._staleness[w] = 0, 0
        self._accepted[w] = False
        self._seen[w] = set()
        self._pending.pop(w, None)
        win = self._window
        if win is not None:  # the old process's part of the open window is dropped with it
            win.arrived[w] = False
            win.done[w] = False
            win.lr[w] = np.nan
            win.seq[w] = 0
            win.n_packets[w] = 0

    def _max_push_packets(self) -> int:
        if self.codec == PsCodec.TOPK:
            return math.ceil(self.n_params / values_per_packet(self.codec, self.k))
        return dense_packets(self.codec, self.k, self.n_params)

    # ---- PUSH ----------------------------------------------------------------------------------------------
    def _on_push(self, pkt: Packet, now: float) -> list[OutRows]:
        if pkt.exp != int(self.codec):
            self._count("drop_codec")
            return []
        if self.params is None:
            self._count("push_uninitialized")
            return []
        limit = self._max_push_packets()
        n_packets = pkt.slot
        fits = n_packets == limit if self.codec != PsCodec.TOPK else 1 <= n_packets <= limit
        if not fits or pkt.chunk >= n_packets:
            self._count("drop_malformed")
            return []
        stream = self._streams.get(("up", pkt.worker))
        if stream is not None and stream.drop():
            self._count("drop_policy_up")
            return []
        if self.cfg.mode == "sync":
            return self._push_sync(pkt, now)
        self._push_async(pkt, now)
        return []

    def _push_sync(self, pkt: Packet, now: float) -> list[OutRows]:
        w = pkt.worker
        if pkt.step < self.step:
            self._count("push_late")
            if self._late_seq[w] != pkt.seq and self._included_seq[w] != pkt.seq:
                self._count("pushes_rejected")  # once per push, and only if none of it made its window
            self._late_seq[w] = pkt.seq
            return []
        if pkt.step > self.step:
            self._count("push_future")
            return []
        win = self._window
        assert win is not None
        if win.arrived[w, pkt.chunk] or (win.arrived[w].any() and win.seq[w] != pkt.seq):
            self._count("push_dup")  # a packet seen already, or a second push for the same version
            return []
        win.raw[w, pkt.chunk] = pkt.payload
        win.arrived[w, pkt.chunk] = True
        win.nelem[w, pkt.chunk] = pkt.nelem
        win.n_packets[w] = pkt.slot
        win.seq[w] = pkt.seq
        lr = lr_from_bits(pkt.bitmap)
        win.lr[w] = np.nan if lr is None else lr
        if win.opened is None:
            win.opened = now
        self._count("push_packets")
        if not win.done[w] and win.arrived[w, : pkt.slot].all():
            win.done[w] = True
            return self._maybe_close(now)
        return []

    def _push_async(self, pkt: Packet, now: float) -> None:
        w = pkt.worker
        if pkt.seq < self._cur_seq[w]:
            self._count("push_old")
            return
        if pkt.seq > self._cur_seq[w]:
            self._decide(w, pkt.seq, pkt.step, now)
        if not self._accepted[w]:
            self._count("push_rejected_packets")
            return
        if pkt.chunk in self._seen[w]:
            self._count("push_dup")
            return
        self._seen[w].add(pkt.chunk)
        lr = lr_from_bits(pkt.bitmap)
        lr_used = self.cfg.lr if lr is None else lr
        if self.codec == PsCodec.TOPK:
            idx, values = decode_topk(pkt.payload[None, :], np.array([pkt.nelem]), self.k)
            keep = (idx >= 0) & (idx < self.n_params)
            if not keep.all():
                self._count("drop_malformed")
                return
            if not np.isfinite(values).all():
                self._count("rows_nonfinite")
                return
            self._sgd(idx, values, lr_used)
        else:
            per = values_per_packet(self.codec, self.k)
            lo = pkt.chunk * per
            hi = min(lo + per, self.n_params)
            values = decode_dense(self.codec, pkt.payload[None, :], self.k)[0, : hi - lo]
            if not np.isfinite(values).all():
                self._count("rows_nonfinite")
                return
            self._sgd(slice(lo, hi), values, lr_used)
        self._count("push_packets")
        if self.push_log is not None:
            self.push_log.append((w, pkt.seq, pkt.step, pkt.chunk, lr_used))

    def _decide(self, w: int, seq: int, step: int, now: float) -> None:
        """Accept or reject worker ``w``'s push ``seq`` computed on version ``step`` (its first packet)."""
        self._cur_seq[w] = seq
        self._seen[w] = set()
        staleness = self.step - step
        self.policy.observe(w, now)
        if staleness < 0:
            self._count("push_future")
        accepted = self.policy.accepts(w, staleness)
        self._accepted[w] = accepted
        self._staleness[w] = staleness
        self._count("pushes")
        self._count("staleness_sum_submitted", max(staleness, 0))
        if accepted:
            self._count("pushes_accepted")
            self._count("staleness_sum", staleness)
            self._count("steps_applied")
            self.step += 1
            self._last_count, self._last_bitmap = 1, 1 << w
        else:
            self._count("pushes_rejected")

    # ---- PULL ----------------------------------------------------------------------------------------------
    def _on_pull(self, pkt: Packet, now: float) -> list[OutRows]:
        self._count("pull_packets")
        w = pkt.worker
        if self.params is None:
            chunks = np.arange(0)  # unknown yet: all chunks, once the size is known
            self._pending[w] = (pkt.seq, chunks)
            self._count("pull_held")
            return []
        chunks = bitmap_chunks(pkt.payload, pkt.chunk, pkt.nelem, self.n_chunks)
        if self.cfg.mode == "async":
            rejected = pkt.seq > 0 and self._cur_seq[w] == pkt.seq and not self._accepted[w]
            stale = int(self._staleness[w]) if pkt.seq > 0 and self._cur_seq[w] == pkt.seq else 0
            return [self._reply(w, pkt.seq, chunks, _REJECTED if rejected else 0, max(stale, 0))]
        win = self._window
        assert win is not None
        if pkt.seq > 0 and pkt.step == self.step:
            self._pending[w] = (pkt.seq, chunks)
            self._count("pull_held")
            if not win.done[w]:
                win.done[w] = True  # its push is over: what did not arrive was lost
                if win.opened is None:
                    win.opened = now
                return self._maybe_close(now)
            return []
        if pkt.step > self.step:
            self._count("push_future")
        late = pkt.seq > 0 and self._late_seq[w] == pkt.seq and self._included_seq[w] != pkt.seq
        return [self._reply(w, pkt.seq, chunks, _REJECTED if late else 0, 0)]

    # ---- the synchronous window ----------------------------------------------------------------------------
    def _maybe_close(self, now: float) -> list[OutRows]:
        win = self._window
        assert win is not None
        finished = int(win.done.sum())
        if finished >= self.cfg.window:
            return self._close(now, "windows_full")
        if finished and (win.done | self._gone(now)).all():
            return self._close(now, "windows_live")
        return []

    def _close(self, now: float, reason: str) -> list[OutRows]:
        win = self._window
        assert win is not None and self.params is not None
        self._count(reason)
        contributors = win.arrived.any(axis=1)
        n_contrib = int(contributors.sum())
        self._count("pushes", n_contrib)
        self._count("pushes_accepted", n_contrib)
        rule_info: dict[str, object] = {}
        if n_contrib:
            grad, updated, rule_info = self._aggregate(win)
            lrs = win.lr[contributors]
            lrs = np.where(np.isnan(lrs), self.cfg.lr, lrs)
            lr = float(np.median(lrs))
            idx = np.flatnonzero(updated)
            if idx.size:
                self._sgd(idx, grad[idx], lr)
                self._count("steps_applied")
            self._included_seq[contributors] = win.seq[contributors]
        else:
            self._count("windows_empty")
        self.last_window = {
            "step": self.step,
            "reason": reason.removeprefix("windows_"),
            "contributors": n_contrib,
            "finished": int(win.done.sum()),
            "open_s": now - (win.opened if win.opened is not None else now),
            **rule_info,
        }
        self._last_count = n_contrib
        self._last_bitmap = sum(1 << int(w) for w in np.flatnonzero(contributors))
        self.step += 1
        win.reset()
        pending, self._pending = self._pending, {}
        return [self._reply(w, seq, chunks, 0, 0) for w, (seq, chunks) in pending.items()]

    def _aggregate(self, win: _Window) -> tuple[np.ndarray, np.ndarray, dict[str, object]]:
        """The window's gradient (float32, n_params), which values the rule produced, and how many rows
        the smallest set had (with the ``f`` the rule tolerates for that count)."""
        d = self.n_params
        grad = np.zeros(d, dtype=np.float32)
        updated = np.zeros(d, dtype=bool)
        rows_seen: list[int] = []
        if self.codec == PsCodec.TOPK:
            contributors = np.flatnonzero(win.arrived.any(axis=1))
            dense = np.zeros((len(contributors), d), dtype=np.float32)
            for r, w in enumerate(contributors):
                got = win.arrived[w]
                idx, values = decode_topk(win.raw[w, got], win.nelem[w, got], self.k)
                ok = (idx >= 0) & (idx < d)
                dense[r, idx[ok]] = values[ok]
            groups = [(contributors, np.arange(d))]
        else:
            per = values_per_packet(self.codec, self.k)
            n_packets = win.arrived.shape[1]
            values = decode_dense(self.codec, win.raw.reshape(-1, 4 * self.k), self.k)
            dense = values.reshape(self.n, n_packets * per)[:, :d]
            # Packets that arrived from the same workers form one set: the rule runs once over all of them.
            weights = np.left_shift(np.uint64(1), np.arange(self.n, dtype=np.uint64))
            bitmaps = (win.arrived.T.astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64)
            uniq, inverse = np.unique(bitmaps, return_inverse=True)
            groups = []
            for g, bitmap in enumerate(uniq):
                packets = np.flatnonzero(inverse == g)
                cols = (packets[:, None] * per + np.arange(per)[None, :]).ravel()
                cols = cols[cols < d]
                if bitmap == 0:
                    self._count("values_empty", cols.size)
                    continue
                rows = np.flatnonzero((int(bitmap) >> np.arange(self.n)) & 1)
                groups.append((rows, cols))
        for rows, cols in groups:
            if self.codec == PsCodec.TOPK:
                block = dense[:, cols]
            else:
                block = dense[np.ix_(rows, cols)]
            finite = robust.finite_rows(block)
            if not finite.all():
                self._count("rows_nonfinite", int((~finite).sum()))
                block = block[finite]
            self._count("rule_groups")
            rows_seen.append(len(block))
            agg = self._rule(block)
            if agg is not None:
                grad[cols] = agg
                updated[cols] = True
        info: dict[str, object] = {"groups": len(rows_seen)}
        if rows_seen:
            fewest = min(rows_seen)
            info["fewest_rows"] = fewest
            info["tolerated_f_at_fewest"] = robust.tolerated_f(self.cfg.rule, fewest, self.cfg.trim_ratio)
        return grad, updated, info

    def _rule(self, rows: np.ndarray) -> np.ndarray | None:
        """The configured rule over ``rows``; its fallback when too few arrived; None: refused."""
        cfg = self.cfg
        n = len(rows)
        if n == 0:
            self._count("rule_refusals")
            return None
        f_used = cfg.f if cfg.f is not None else max(robust.tolerated_f(cfg.rule, n, cfg.trim_ratio), 0)
        m = None if cfg.multi_krum_m is None else max(1, min(cfg.multi_krum_m, n - f_used))
        try:
            return robust.aggregate(cfg.rule, rows, f=cfg.f, trim_ratio=cfg.trim_ratio, m=m)
        except robust.InsufficientContributions:
            pass
        if cfg.fallback == "mean":
            self._count("rule_fallbacks")
            return rows.mean(axis=0, dtype=np.float64)
        if cfg.fallback == "median":
            f_median = cfg.f or 0
            if n >= robust.min_count("median", f_median):
                self._count("rule_fallbacks")
                return robust.aggregate("median", rows, f=f_median)
        self._count("rule_refusals")
        return None

    # ---- optimizer -----------------------------------------------------------------------------------------
    def _sgd(self, where: slice | np.ndarray, grad: np.ndarray, lr: float) -> None:
        """SGD with momentum on the coordinates ``where``: ``v = momentum·v + g; p -= lr·v`` (float32)."""
        assert self.params is not None and self.velocity is not None
        v = np.float32(self.cfg.momentum) * self.velocity[where] + np.asarray(grad, dtype=np.float32)
        self.velocity[where] = v
        self.params[where] -= np.float32(lr) * v

    # ---- packets out ---------------------------------------------------------------------------------------
    def _reply(self, w: int, seq: int, chunks: np.ndarray, flags: int, weight: int) -> OutRows:
        """PARAM packets of ``chunks`` (empty: all) to worker ``w``, each passing its down policy."""
        assert self.params is not None
        if chunks.size == 0:
            chunks = np.arange(self.n_chunks)
        k = self.k
        payload = self.params.reshape(-1, k)[chunks].astype(">f4").view(np.uint8).reshape(len(chunks), 4 * k)
        nelem = np.clip(self.n_params - chunks * k, 0, k)
        stream = self._streams.get(("down", w))
        if stream is not None:
            keep = ~stream.drop_many(len(chunks))
            self._count("drop_policy_down", int((~keep).sum()))
            payload, chunks, nelem = payload[keep], chunks[keep], nelem[keep]
        rows = build_packets(
            payload,
            k,
            version=VERSION,
            op=int(PsOp.PARAM),
            flags=flags,
            job_id=self.cfg.job_id,
            worker_id=w,
            count=min(self._last_count, 255),
            nelem=nelem,
            seq=seq,
            step=self.step,
            chunk=chunks,
            weight=weight,
            bitmap=self._last_bitmap,
        )
        self._count("param_packets", len(rows))
        self._count("tx_packets", len(rows))
        return rows, np.full(len(rows), self.keys[w], dtype=np.int64)

    # ---- reading -------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and what they mean together: rejection rate, mean staleness, per-worker bounds."""
        c = self.counters
        decided = c["pushes"] if self.cfg.mode == "async" else c["pushes"] + c["pushes_rejected"]
        out: dict[str, Any] = {
            "job_id": self.cfg.job_id,
            "mode": self.cfg.mode,
            "step": self.step,
            "initialized": self.initialized,
            "n_params": self.n_params,
            "counters": dict(c),
            "rejection_rate": c["pushes_rejected"] / decided if decided else 0.0,
            "mean_staleness": c["staleness_sum"] / c["pushes_accepted"] if c["pushes_accepted"] else 0.0,
            "mean_staleness_submitted": c["staleness_sum_submitted"] / c["pushes"] if c["pushes"] else 0.0,
        }
        if self.cfg.mode == "async":
            out["staleness_bounds"] = [round(float(b), 3) for b in self.policy.bounds()]
            out["interval_ewma_s"] = [None if np.isnan(i) else float(i) for i in self.policy.interval]
        else:
            out["last_window"] = dict(self.last_window)
        return out
