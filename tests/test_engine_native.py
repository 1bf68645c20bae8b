"""The native engine path (hostlib/_engine.c) against the Python reference (ReduceEngine._handle and what
it calls), bit for bit.

Worker 0 of a job is played twice, by a reference engine and a native one; its peers by reference engines.
All of them run the engine's own send, deadline and finish code on a fake clock, with their GRADs and
FLUSHes summed by an in-process softswitch; the RESULTs for worker 0 go through seeded loss, duplication,
reordering and delay (late packets), mixed with rows no unit owns (another job, a wrong length, the
probe slot, a later reduce's units, parameters), and are handed to both copies as the same batches.
After every batch the two copies must hold the same unit states, values, counts, bitmaps, shifts,
frontiers, RTT estimates, slot news and statistics; at the end the same ReduceResult.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from hostlib import protocol
from hostlib.batchio import RxBatch
from hostlib.protocol import HEADER_BYTES, HEADER_DTYPE, HEADER_OFFSETS, Flag, Op
from hostlib.transport import TransportConfig
from hostlib.transport import deadlines as deadlines_module
from hostlib.transport import engine as engine_module
from hostlib.transport.deadlines import Deadlines
from hostlib.transport.engine import ReduceEngine
from hostlib.transport.native import engine_path, native_ext
from hostlib.transport.plan import DONE, GAVE_UP, IN_FLIGHT
from hostlib.transport.reuse import _NO_LIMIT, SlotReuse
from softswitch.pipeline import JobConfig, SoftSwitch
from tests.conftest import codec_bound

pytestmark = pytest.mark.skipif(native_ext is None, reason="hostlib._engine is not built (pip install -e .)")

JOB = 3


class FakeIO:
    """A worker's I/O without a socket: sends are recorded, receives are the batches a test hands in."""

    mode = "test"

    def __init__(self, packet_bytes: int, capacity: int = 128) -> None:
        self.rx = RxBatch(capacity, packet_bytes + 4)
        self.sent: list[np.ndarray] = []

    def send_rows(self, rows: np.ndarray, slots: np.ndarray | None = None) -> int:
        self.sent.append(np.array(rows, copy=True))
        return len(rows)

    def take(self) -> list[bytes]:
        out = [bytes(row) for rows in self.sent for row in rows]
        self.sent.clear()
        return out

    def fill(self, packets: list[bytes]) -> int:
        for i, pkt in enumerate(packets):
            self.rx.data[i, : len(pkt)] = np.frombuffer(pkt, dtype=np.uint8)
            self.rx.lens[i] = len(pkt)
        return len(packets)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _engine(cfg: TransportConfig, worker: int, n_workers: int, native: bool) -> ReduceEngine:
    engine = ReduceEngine(
        JOB, worker, n_workers, cfg, FakeIO(protocol.packet_bytes(cfg.elems_per_packet)), 24
    )
    engine.native = native
    return engine


def _result_of(pkt: bytes, **fields: int) -> bytes:
    """``pkt`` (a RESULT) with header fields changed."""
    arr = np.frombuffer(pkt, dtype=np.uint8).copy()
    hdr = arr[:HEADER_BYTES].view(HEADER_DTYPE)
    for name, value in fields.items():
        hdr[name] = value
    return arr.tobytes()


def _rows_read(plan) -> np.ndarray:  # noqa: ANN001
    """The float32 rows a plan's quantize reads: its staged chunks, and the caller's own values below the
    end of ``direct`` (the native engine quantizes whole chunks where they lie; the reference stages all)."""
    rows = plan.chunks.copy()
    if plan.direct is not None:
        rows[: len(plan.direct)] = plan.direct
    return rows


def _same(a: ReduceEngine, b: ReduceEngine, where: str) -> None:
    pa, pb = a._plans, b._plans
    assert pa.keys() == pb.keys()
    for key in pa:
        for name, va in vars(pa[key]).items():
            vb = getattr(pb[key], name)
            if name == "direct":  # where the rows are read from: compared as the rows read, below
                continue
            if name == "chunks":  # (what a chunk's values went out over, once delivered, is not read again)
                kept = ~(pa[key].delivered | pb[key].delivered)
                va, vb = _rows_read(pa[key])[kept], _rows_read(pb[key])[kept]
            if name in ("data_batch", "data_rows"):
                # A data row's slot, seq and step are written when it is quantized (the native engine
                # writes them then, the reference at the reset): rows not quantized yet are no packet.
                va, vb = va[pa[key].quantized], vb[pb[key].quantized]
            if isinstance(va, np.ndarray):
                assert va.dtype == vb.dtype and np.array_equal(va, vb, equal_nan=va.dtype.kind == "f"), (
                    f"{where}: plan.{name} differs"
                )
            else:
                assert va == vb, f"{where}: plan.{name} differs: {va!r} != {vb!r}"
    assert np.array_equal(a._newest_unit, b._newest_unit), where
    assert a.stats.as_dict() == b.stats.as_dict(), where
    for name in ("_held", "_held_since", "_peer_wait_since"):  # what holds sending, and since when
        assert getattr(a, name) == getattr(b, name), f"{where}: engine.{name}"
    for name in (
        "srtt_ms",
        "rttvar_ms",
        "flush_srtt_ms",
        "flush_rttvar_ms",
        "presumed_dead",
        "early_close",
        "_absent",
        "_absent_window",
        "_rto_cached_s",
    ):
        assert getattr(a.deadlines, name) == getattr(b.deadlines, name), f"{where}: deadlines.{name}"
    assert list(a.deadlines._rtt_mins) == list(b.deadlines._rtt_mins), where
    for name, va in vars(a.reuse).items():
        vb = getattr(b.reuse, name)
        assert np.array_equal(va, vb) if isinstance(va, np.ndarray) else va == vb, f"{where}: reuse.{name}"
    assert a.param_requests == b.param_requests, where
    inbox_a, inbox_b = a.param_inbox.peek(), b.param_inbox.peek()
    for name in ("chunk", "step", "sender", "nelem", "values"):
        assert np.array_equal(getattr(inbox_a, name), getattr(inbox_b, name)), f"{where}: param_inbox.{name}"


def _at_offset(x: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``x`` whose first value lies ``offset`` floats past a 64-byte boundary."""
    room = np.empty(x.size + offset + 16, dtype=np.float32)
    start = (-room.ctypes.data % 64) // 4 + offset
    y = room[start : start + x.size]
    y[:] = x
    return y


def _play(
    clock: Clock,
    seed: int,
    *,
    n_workers: int,
    k: int,
    n_values: int,
    loss: float,
    dup: float,
    late: float,
    renormalize: str = "count",
    critical: bool = False,
    up_loss: float | None = None,
    offset: int = 0,
    wake: bool = False,
    speculate: str = "",
    stats_out: list | None = None,
) -> tuple[object, list[np.ndarray], int]:
    """``loss`` drops GRADs and worker 0's RESULTs, ``up_loss`` (when given) GRADs alone. Worker 0's
    input (its ``out`` too) starts ``offset`` floats past a 64-byte boundary. ``wake``: the native copy
    sends as ReduceEngine._run_units does, through its Wake (_wake_send) where the reduce is steady.
    ``speculate`` ("agree" or "disagree"): speculated exponents on (TransportConfig.speculate_bits 3), every
    engine remembering the same last agreed exponents for the reduce, some too low (their chunks' first
    rounds come back SATURATED: redone), some too high (the guard flags them: redone), some missing (sent
    after the exponent round); "disagree": the last peer remembers nothing (it sends every chunk at the
    agreed exponent: the switch keeps one exponent per round and drops the other). Returns the reference's
    result, the inputs and how many units worker 0's fast flush probed."""
    rng = np.random.default_rng(seed)
    bits = 3 if speculate else 0
    cfg = TransportConfig(
        elems_per_packet=k, pool_size=48, seed=seed, renormalize=renormalize, speculate_bits=bits
    )
    ref, nat = _engine(cfg, 0, n_workers, False), _engine(cfg, 0, n_workers, True)
    peers = [_engine(cfg, w, n_workers, False) for w in range(1, n_workers)]
    switch = SoftSwitch(seed)
    switch.add_job(JobConfig(job_id=JOB, workers=list(range(n_workers)), pool_size=48, elems_per_packet=k))
    xs = [rng.standard_normal(n_values).astype(np.float32) * (w + 1) for w in range(n_workers)]
    crit = [(0, k * 3)] if critical else None
    plans, outs = {}, {}
    spec_key = None
    if speculate:
        spec_key = (n_values, 0)
        chunks = -(-n_values // k)
        padded = np.zeros((n_workers, chunks * k), dtype=np.float32)
        padded[:, :n_values] = np.abs(xs)
        true_e = np.frexp(padded.reshape(n_workers, chunks, k).max(axis=(0, 2)))[1]
        last = (true_e + rng.integers(-7, 6, chunks)).astype(np.int32)  # off by -7..5 bits
        last[rng.random(chunks) < 0.2] = protocol.INT32_MIN  # no exponent RESULT there
        for e in [ref, nat, *peers][: n_workers + 1 - (speculate == "disagree")]:
            e._agreed[spec_key] = last.copy()
    for e, x in zip([ref, nat, *peers], [xs[0], xs[0], *xs[1:]], strict=True):
        # Worker 0 reduces in place (out is its input), times 2: each chunk's values go out as it settles,
        # once quantized (ReducePlan.deliver_to), and the native copy reads its whole chunks from there.
        local = outs[id(e)] = _at_offset(x, offset if e in (ref, nat) else 0)
        plans[id(e)] = e._begin(
            local, step=11, weight=1 + e.worker_id, critical=crit, owners=None, t0=clock(),
            out=local if e in (ref, nat) else None, out_scale=2.0, spec_key=spec_key,
        )  # fmt: skip
    # the native copy quantizes worker 0's whole chunks from its input, the reference from staged rows
    assert (plans[id(nat)][0].direct is not None) == nat._codec_c and plans[id(ref)][0].direct is None
    held: list[bytes] = []  # RESULTs for worker 0 delayed to a later delivery
    probed = 0
    sent_tick: dict[int, int] = {}
    nat_wake = nat._wake_for(plans[id(nat)][0]) if wake else None
    assert (nat_wake is not None) == (wake and not critical)
    woke = 0  # ticks whose units the native copy sent through its Wake
    # With ``wake``, worker 0's two copies run each tick as ReduceEngine._run_units runs a wake-up: the send
    # half, the stall rule and the tail, then (after the batches) _after_receive, the native copy's through
    # its Wake where the reduce is steady.
    looped = (ref, nat) if wake else ()
    was_synced: dict[int, bool] = {}
    batches: dict[int, int] = {}
    next_ats: dict[int, float | None] = {}
    for tick in range(400):
        clock.t += 0.002
        now = clock()
        for e in [ref, nat, *peers]:
            plan = plans[id(e)][0]
            dl = e.deadlines
            was_synced[id(e)], batches[id(e)] = plan.synced, len(plan.rx_batches)
            if e is nat and nat_wake is not None and plan.synced and not plan.all_sent and not dl.early_close:
                before, reference = plan.next_unit, nat._send_ready
                asked = []
                nat._send_ready = lambda *a, _n=asked, _r=reference: _n.append(1) or _r(*a)  # type: ignore[method-assign]
                next_at = e._wake_send(plan, nat_wake)
                del nat._send_ready
                woke += plan.next_unit > before and not asked
            else:
                in_flight = e._advance(plan)
                next_at = None if in_flight < 0 else math.nan
                if in_flight >= 0:  # (as _run_units: a reduce with nothing left to settle sends nothing)
                    e._send_ready(plan, in_flight)
            if e in looped:  # the rules after the send, the Wake's or the reference's
                if next_at is not None and next_at != next_at:
                    next_at = e._after_send(plan)
                next_ats[id(e)] = next_at
                continue
            plan.frontier[e.worker_id] = plan.next_unit - 1
            due = e._due(plan, now)  # the engine's own deadline rules: probes, resends, FLUSHes
            assert e._next_deadline(plan) == e.deadlines.next_at(plan)
            if due.size:
                e._on_deadlines(plan, due, now, 0)
        if wake:  # the earliest deadline the wait is taken from
            assert next_ats[id(ref)] == next_ats[id(nat)], f"tick {tick}: next deadline {next_ats}"
        grads = [(pkt, 0) for pkt in ref.io.take()]
        assert [p for p, _ in grads] == nat.io.take(), f"tick {tick}: the two copies sent different packets"
        for e in peers:
            grads += [(pkt, e.worker_id) for pkt in e.io.take()]
        grads = [g for g in grads if rng.random() >= (loss if up_loss is None else up_loss)]
        grads += [g for g in grads if rng.random() < dup]
        order = rng.permutation(len(grads))
        down: dict[int, list[bytes]] = {w: [] for w in range(n_workers)}
        for i in order:
            for port, pkt in switch.process(*grads[i]):
                down[port].append(pkt)
        if tick % 5 == 3:  # a peer's parameters, relayed, and a request
            peers[0].broadcast_params(np.array([tick]), np.full((1, k), tick, dtype=np.float32), step=tick)
            peers[0].request_params(np.array([tick + 1]), step=tick)
            for port, pkt in [o for p in peers[0].io.take() for o in switch.process(p, peers[0].worker_id)]:
                if port == 0:
                    down[0].append(pkt)
        mine = [p for p in down[0] if rng.random() >= loss]
        mine += [p for p in mine if rng.random() < dup]
        if mine:  # rows no unit of this reduce owns
            plan = plans[id(ref)][0]
            # A later reduce's unit, less than a pool past this worker's first unit not settled: peers get
            # no further ahead while it is counted (units a pool below a RESULT's are overtaken:
            # test_a_result_one_pool_ahead_gives_up_every_older_unit_whatever_its_slot)
            top = plan.base + min(plan.low + 47, plan.units + 40)
            if late and top > plan.base + plan.units:
                g = int(rng.integers(plan.base + plan.units, top))
                bits = int(rng.integers(1, 4))
                mine.append(_result_of(mine[0], seq=2 * (g // 47) + 1, slot=g % 47, bitmap=bits))
            mine.append(_result_of(mine[0], slot=47))  # the probe slot
            mine.append(_result_of(mine[0], job_id=JOB + 1))
            mine.append(mine[0][:-4])
        keep = [p for p in mine if rng.random() >= late]
        mine, held = held + keep, [p for p in mine if p not in keep]
        if rng.random() < 0.4:  # a late wake-up: this tick's answers wait for the next one's (RTTs differ)
            mine, held = [], mine + held
        mine = [mine[i] for i in rng.permutation(len(mine))]
        while mine:
            take = int(rng.integers(1, 60))
            batch, mine = mine[:take], mine[take:]
            clock.t += 0.0005
            for e in (ref, nat):
                n = e.io.fill(batch)
                e.stats.packets_received += n
                e._handle(n, plans[id(e)][0])
            _same(ref, nat, f"seed {seed} tick {tick}")
            # out gets a chunk's values as it is delivered, and nothing before: the rest is still the input
            plan = plans[id(nat)][0]
            kept = np.repeat(~plan.delivered, k)[:n_values]
            assert np.array_equal(outs[id(nat)][kept], xs[0][kept]), f"seed {seed} tick {tick}: out too early"
        for e in peers:
            n = e.io.fill(down[e.worker_id])
            e._handle(n, plans[id(e)][0])
        probes = {}
        for e in [ref, nat, *peers]:
            plan = plans[id(e)][0]
            if e in looped:  # (their probes go out, and are compared, next tick)
                results = len(plan.rx_batches) != batches[id(e)]
                e._after_receive(plan, nat_wake if e is nat else None, clock(), 0, results, was_synced[id(e)])
                continue
            e.reuse.news(plan.base, plan.frontier, e.deadlines.presumed_dead, e.native)
            if plan.frontier.min() > plan.fast_flushed_to:
                probes[id(e)] = e.deadlines.fast_flush(plan, clock(), e.native)
                e._probe_data(plan, probes[id(e)])  # (their rows go out, and are compared, next tick)
                e._send_recovery()
            if plan.own_shown >= 0:  # the window-stall rule, from the newest unit showing this worker's bit
                e._stall_flush(plan, max(-1, plan.own_shown - e.reuse.span) + e._slots + 1, clock())
        _same(ref, nat, f"seed {seed} tick {tick} (after the deadline rules)")
        got = [probes.get(id(e), np.zeros(0, np.int64)) for e in (ref, nat)]
        assert np.array_equal(*got), f"seed {seed} tick {tick}: the fast flush probed other units"
        probed += len(got[0])
        if not plans[id(ref)][0].unsettled() and not held:
            break
        sent_tick[tick] = int(np.count_nonzero(plans[id(ref)][0].state == IN_FLIGHT))
    _same(ref, nat, f"seed {seed} at the end")  # (before _finish: the prev fallback takes plan.out over)
    results = []
    for e in (ref, nat):
        plan, n_chunks = plans[id(e)]
        results.append(e._finish(plan, n_values, n_chunks, None, outs[id(e)], 0.0, 2.0)[0])
    a, b = results
    for name in (
        "values",
        "count",
        "bitmap",
        "fallback",
        "withheld",
        "saturated",
        "shift",
        "critical",
        "nonfinite",
    ):
        va, vb = getattr(a, name), getattr(b, name)
        assert np.array_equal(va, vb, equal_nan=True), f"seed {seed}: result.{name} differs"
    # The play reached the steady state and its rare cases: settled units, partial and empty rounds.
    plan = plans[id(ref)][0]
    assert np.count_nonzero(plan.state == DONE) > plan.units // 2
    assert woke > 0 or nat_wake is None, "the Wake never sent: the play did not test it"
    if nat_wake is not None and plans[id(ref)][0].units > 1000:  # a long reduce: the steady state's sends
        assert woke >= 20, f"seed {seed}: the Wake sent in {woke} ticks only"
    if stats_out is not None:
        stats_out.append(ref.stats)
    return a, xs, probed


def _assert_numpy_mean(result, xs: list[np.ndarray]) -> None:  # noqa: ANN001
    """A lossless play against an independent expectation: every chunk counted by every worker, and the
    values numpy's mean of the inputs (times the reduce's out_scale, 2)."""
    assert (result.count == len(xs)).all()
    np.testing.assert_allclose(result.values, 2 * np.mean(xs, axis=0), rtol=0, atol=2e-6)


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    fake = types.SimpleNamespace(perf_counter=clock)
    monkeypatch.setattr(engine_module, "time", fake)
    monkeypatch.setattr(deadlines_module, "time", fake)
    return clock


@pytest.mark.parametrize("wake", [False, True], ids=["steps", "wake"])
@pytest.mark.parametrize(
    ("seed", "n_workers", "k", "loss", "dup", "late", "renormalize", "critical", "offset"),
    [
        (1, 2, 64, 0.0, 0.0, 0.0, "count", False, 0),  # lossless: every round complete
        (2, 2, 64, 0.05, 0.05, 0.05, "count", False, 0),
        (3, 3, 16, 0.15, 0.1, 0.1, "weight", False, 0),
        (4, 4, 8, 0.25, 0.2, 0.2, "none", True, 0),
        (5, 3, 5, 0.1, 0.3, 0.3, "count", True, 0),
        # rows of 1030 values, long enough for the native copy out to stream them around the cache: they
        # start anywhere in a cache line (whole lines go streamed, the rest plainly), and out starts 4 or
        # 16 bytes past one
        (6, 2, 1030, 0.05, 0.05, 0.05, "count", False, 1),
        (7, 3, 1030, 0.1, 0.0, 0.0, "count", False, 4),
    ],
)
def test_native_settles_as_the_reference(
    fake_clock: Clock,
    seed: int,
    n_workers: int,
    k: int,
    loss: float,
    dup: float,
    late: float,
    renormalize: str,
    critical: bool,
    offset: int,
    wake: bool,
) -> None:
    fake_clock.t = 1000.0
    result, xs, _ = _play(
        fake_clock,
        seed,
        n_workers=n_workers,
        k=k,
        n_values=k * 150 + 7,
        loss=loss,
        dup=dup,
        late=late,
        renormalize=renormalize,
        critical=critical,
        offset=offset,
        wake=wake,
    )
    if loss == dup == late == 0.0:
        _assert_numpy_mean(result, xs)


@pytest.mark.parametrize(
    ("seed", "n_workers", "k", "loss", "dup", "late", "up_loss"),
    [
        (11, 2, 8, 0.0, 0.0, 0.0, None),
        (12, 2, 8, 0.03, 0.03, 0.03, None),
        (13, 3, 4, 0.1, 0.05, 0.1, None),
        (14, 4, 8, 0.2, 0.1, 0.0, None),
        # RESULTs lost alone: no exponent proposal is lost, so nothing is withheld and the Wake's own due
        # scan finds the units whose answers were lost
        (15, 3, 8, 0.15, 0.0, 0.05, 0.0),
        (16, 2, 16, 0.3, 0.05, 0.0, 0.0),
    ],
)
def test_the_wake_sends_as_the_reference(
    fake_clock: Clock,
    seed: int,
    n_workers: int,
    k: int,
    loss: float,
    dup: float,
    late: float,
    up_loss: float | None,
) -> None:
    """A reduce of 1200 chunks through a pool of 48: most of its units go out in the steady state, where the
    native copy runs its wake-ups through its Wake (Wake.send, Wake.commit, Wake.after), held by its own
    span and by its peers in turn, and under loss with the reference deciding the wake-ups the Wake leaves
    to it. Every packet, plan array and statistic as the reference's (_play compares them at every step)."""
    fake_clock.t = 1000.0
    result, xs, _ = _play(
        fake_clock,
        seed,
        n_workers=n_workers,
        k=k,
        n_values=k * 1200 + 3,
        loss=loss,
        dup=dup,
        late=late,
        up_loss=up_loss,
        wake=True,
    )
    if loss == dup == late == 0.0:
        _assert_numpy_mean(result, xs)


@pytest.mark.parametrize("wake", [False, True], ids=["steps", "wake"])
@pytest.mark.parametrize(
    ("seed", "n_workers", "k", "loss", "dup", "late", "speculate"),
    [
        (21, 2, 16, 0.0, 0.0, 0.0, "agree"),  # lossless: redone chunks, every round complete
        (22, 3, 8, 0.1, 0.05, 0.05, "agree"),
        (23, 2, 16, 0.05, 0.05, 0.1, "disagree"),
        (24, 4, 8, 0.2, 0.1, 0.1, "agree"),
    ],
)
def test_native_speculates_and_redoes_as_the_reference(
    fake_clock: Clock,
    seed: int,
    n_workers: int,
    k: int,
    loss: float,
    dup: float,
    late: float,
    speculate: str,
    wake: bool,
) -> None:
    """Speculated exponents (docs/protocol.md, "Speculated exponents"): chunks sent before the exponent
    round's RESULT, first rounds that come back SATURATED and are redone in the unit's second round, under
    loss, duplicates and late RESULTs, with every peer remembering the same exponents or one remembering
    none. Both copies send the same packets and hold the same arrays at every step (_play); a lossless play
    gives numpy's mean, every chunk counted by every worker."""
    fake_clock.t = 1000.0
    stats: list = []
    result, xs, _ = _play(
        fake_clock, seed, n_workers=n_workers, k=k, n_values=k * 150 + 7, loss=loss, dup=dup, late=late,
        wake=wake, speculate=speculate, stats_out=stats,
    )  # fmt: skip
    assert stats[0].speculated_chunks > 0 and stats[0].redone_chunks > 0, "the play did not speculate or redo"
    if loss == dup == late == 0.0:
        # every chunk counted by every worker; the mean within 2^speculate_guard_bits of the exponent
        # round's bound (worked out from the inputs), times the reduce's out_scale
        assert (result.count == n_workers).all()
        bound = np.repeat(codec_bound(xs, k) * 2.0**8, k)[: len(xs[0])]
        error = np.abs(result.values - 2 * np.mean(np.array(xs, dtype=np.float64), axis=0))
        assert (error <= 2 * bound + 1e-6).all()


def test_native_fast_flush_probes_as_the_reference_under_result_loss(fake_clock: Clock) -> None:
    """RESULT loss alone (20% of worker 0's RESULTs, no GRAD lost): most units found lost had their round
    closed, so the fast flush probes them (Deadlines.probing_lost); both copies probe the same units and
    move the same deadlines."""
    fake_clock.t = 1000.0
    _, _, probed = _play(fake_clock, 6, n_workers=3, k=16, n_values=16 * 150 + 7, loss=0.2, dup=0.05,
                         late=0.05, up_loss=0.0)  # fmt: skip
    assert probed > 0


def test_native_due_with_recovery_slack_as_the_reference(fake_clock: Clock) -> None:
    """ReduceEngine._due with a recovery slack (Deadlines.recovery_slack_s) on the native path, in one call,
    against the reference's Deadlines.due_or_recovering over Deadlines.due: units due by now, units due
    within the slack that are proven lost or FLUSHed, and not the others; the earliest deadline too."""
    rng = np.random.default_rng(11)
    cfg = TransportConfig(elems_per_packet=8, pool_size=48, seed=11)
    pair = []
    for native in (False, True):
        e = _engine(cfg, 0, 2, native)
        plan, _ = e._begin(np.ones(8 * 90, dtype=np.float32), step=0, weight=1, critical=None, owners=None,
                           t0=fake_clock())  # fmt: skip
        pair.append((e, plan))
    extra = 0
    for trial in range(200):
        for _e, plan in pair:  # the same state in both copies
            g = np.random.default_rng(trial)
            plan.state[:] = g.choice([0, IN_FLIGHT, DONE, GAVE_UP], plan.units)
            plan.deadline_at[:] = 1000.0 + g.uniform(-0.01, 0.02, plan.units)
            plan.proven_lost[:] = g.random(plan.units) < 0.3
            plan.flushes[:] = g.integers(0, 3, plan.units) * (g.random(plan.units) < 0.3)
            plan.low, plan.next_unit = int(g.integers(0, 10)), int(g.integers(40, plan.units + 1))
        slack = float(rng.choice([0.0, 0.004]))
        (ref, ref_plan), (nat, nat_plan) = pair
        want = ref._due(ref_plan, 1000.0, slack)
        got = nat._due(nat_plan, 1000.0, slack)
        assert want.tolist() == got.tolist(), f"trial {trial}"
        assert ref._next_deadline(ref_plan) == nat._next_deadline(nat_plan), f"trial {trial}"
        strict = set(Deadlines.due(ref_plan, 1000.0).tolist())
        assert set(want.tolist()) >= strict, f"trial {trial}"
        extra += len(set(want.tolist()) - strict)
    assert extra > 0  # the slack took units being recovered early in some trials


def test_gather_rows_is_a_gather_and_a_repeat() -> None:
    """hostlib._engine.gather_rows against numpy: rows src[units - offset], each ``copies`` times side by
    side, and the units' slots likewise (the output starts as a fill pattern, so a byte not written shows)."""
    rng = np.random.default_rng(3)
    for copies in (1, 2, 3):
        src = rng.integers(0, 256, (50, 292), dtype=np.uint8)
        slots = rng.integers(0, 2048, 60)
        units = rng.integers(10, 60, 17)
        out = np.full((17 * copies, 292), 0xAB, dtype=np.uint8)
        out_slots = np.full(17 * copies, -7, dtype=np.int64)
        native_ext.gather_rows(src, units, 17, 10, copies, slots, out, out_slots)
        assert np.array_equal(out, np.repeat(src[units - 10], copies, axis=0))
        assert np.array_equal(out_slots, np.repeat(slots[units], copies))
    with pytest.raises(ValueError, match="outside the rows"):
        native_ext.gather_rows(src, np.array([9]), 1, 10, 1, slots, out, out_slots)


def test_wire_constants_match_the_protocol() -> None:
    """The offsets and codes compiled into hostlib/_engine.c are hostlib.protocol's."""
    for name, field in (
        ("VERSION", "version"),
        ("OP", "op"),
        ("FLAGS", "flags"),
        ("EXP", "exp"),
        ("JOB", "job_id"),
        ("WORKER", "worker_id"),
        ("COUNT", "count"),
        ("SLOT", "slot"),
        ("SEQ", "seq"),
        ("WEIGHT", "weight"),
        ("BITMAP", "bitmap"),
    ):
        assert getattr(native_ext, f"OFF_{name}") == HEADER_OFFSETS[field]
    assert native_ext.HEADER_BYTES == HEADER_BYTES
    assert (native_ext.OP_RESULT, native_ext.OP_PARAM, native_ext.OP_PARAM_REQ) == (
        Op.RESULT,
        Op.PARAM,
        Op.PARAM_REQ,
    )
    assert native_ext.FLAG_RETX == Flag.RETX
    assert (native_ext.ST_IN_FLIGHT, native_ext.ST_DONE, native_ext.ST_GAVE_UP) == (IN_FLIGHT, DONE, GAVE_UP)
    from hostlib import codec

    assert (
        native_ext.NONFINITE_EXPONENT == codec.NONFINITE_EXPONENT
        and native_ext.SHIFT_LIMIT == codec.SHIFT_LIMIT
    )


def test_engine_path_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, path in (("python", "python"), ("native", "native"), ("", "native"), ("auto", "native")):
        monkeypatch.setenv("LTA_ENGINE", value)
        assert engine_path() == path
    monkeypatch.setenv("LTA_ENGINE", "fast")
    with pytest.raises(ValueError, match="LTA_ENGINE='fast' is not an engine path"):
        engine_path()


def test_peers_news_as_the_reference() -> None:
    """SlotReuse.news (set_presumed_dead, then saw) native and reference from the same random states:
    excused and presumed-dead peers, unseen ones, peers far ahead (followed), revived ones."""
    rng = np.random.default_rng(7)
    d = 47
    for trial in range(800):
        n = int(rng.integers(1, 6))
        me = int(rng.integers(0, n))
        pair = [SlotReuse(d, me, n) for _ in range(2)]
        settled = rng.integers(-1, 400, n)
        state = {
            "settled": settled,
            "sent": settled + rng.integers(0, 120, n),
            "_excused": rng.random(n) < 0.4,
            "excused_to": np.where(rng.random(n) < 0.3, _NO_LIMIT, settled + rng.integers(0, 200, n)),
            "presumed_dead": rng.random(n) < 0.3,
        }
        for reuse in pair:
            for name, value in state.items():
                getattr(reuse, name)[:] = value
        base = int(rng.integers(0, 400))
        frontier = np.where(rng.random(n) < 0.2, -1, rng.integers(-1, 150, n))
        dead_bits = int(rng.integers(0, 1 << n))
        pair[0].news(base, frontier, dead_bits, native=False)
        pair[1].news(base, frontier, dead_bits, native=True)
        for name, value in vars(pair[0]).items():
            other = getattr(pair[1], name)
            same = np.array_equal(value, other) if isinstance(value, np.ndarray) else value == other
            assert same, f"trial {trial}: reuse.{name} differs: {value} != {other}"
        # the first unit the peers hold this worker at, as SlotReuse.limit gives it
        assert pair[1].first(native=True) == pair[0].limit()[0], f"trial {trial}: SlotReuse.first"


@pytest.mark.skipif(native_ext is None, reason="hostlib._engine is not built")
@pytest.mark.parametrize("down", [0.0, 0.2])
def test_slots_the_native_sends_hand_over_are_the_rows_slot_fields(make_cluster, down: float) -> None:
    """The native path passes each run's slots to WorkerIO.send_rows (GSO trains are cut by slot block
    from them instead of from the rows), and so do a wake-up's probes and FLUSHes: on loopback, every
    such call's slots equal the slot field of the rows it sends, read from the wire bytes. With RESULT
    loss, FLUSHes and probes are among them."""
    cluster = make_cluster(2, elems_per_packet=64, seed=4, down=down)
    handed: list[int] = []
    ops: set[int] = set()
    wrong: list[tuple[list[int], list[int]]] = []
    for w in cluster.workers:
        assert w.engine.native

        def spy(rows: np.ndarray, slots: np.ndarray | None = None, send=w.io.send_rows) -> int:
            if slots is not None:
                hdr = np.ascontiguousarray(rows[:, :HEADER_BYTES]).view(HEADER_DTYPE).reshape(-1)
                handed.append(len(rows))
                ops.update(hdr["op"].tolist())
                if not np.array_equal(slots, hdr["slot"].astype(np.int64)):
                    wrong.append((slots.tolist(), hdr["slot"].tolist()))
            return send(rows, slots)

        w.io.send_rows = spy
    rng = np.random.default_rng(0)
    for _ in range(3):  # 300 chunks: 5 exponent units, runs across reduces and slot blocks
        cluster.reduce_all([rng.standard_normal(300 * 64).astype(np.float32) for _ in range(2)])
    assert sum(handed) >= 2 * 3 * 305 and not wrong
    if down:
        assert int(Op.FLUSH) in ops and sum(w.stats.lost_probes for w in cluster.workers) > 0


@pytest.mark.parametrize("seed", range(6))
def test_native_deadline_actions_as_the_reference(fake_clock: Clock, seed: int) -> None:
    """ReduceEngine._deadline_actions on the native path (its FLUSH rule, _send_flushes and the retries'
    deadlines in one call: _flush_native) against the reference, from the same seeded mid-reduce state:
    units FLUSHed 0..max_flushes times, some past their give-up time, critical ones, exponent units before
    and after the reduce synced, proven-in ones, a frontier in the middle. The same rows go out (FLUSHes
    and the rest), and the plans and statistics end the same."""
    rng = np.random.default_rng(seed)
    k, n_workers = 8, 3
    # (a low max_deadline_ms in some seeds: the backoff's cap binds)
    cfg = TransportConfig(elems_per_packet=k, pool_size=48, seed=seed, flush_copies=1 + seed % 3,
                          max_deadline_ms=30.0 if seed % 2 else 500.0)  # fmt: skip
    x = rng.standard_normal(k * 60 + 3).astype(np.float32)
    crit = [(0, k * 4)] if seed % 2 else None
    engines = []
    for native in (False, True):
        e = _engine(cfg, 1, n_workers, native)
        plan, _ = e._begin(x.copy(), step=7, weight=1, critical=crit, owners=None, t0=fake_clock())
        engines.append((e, plan))
    now = fake_clock.t = 1000.5
    draw = np.random.default_rng(seed + 100)
    for e, plan in engines:  # the same state in both copies
        g = np.random.default_rng(seed + 100)
        u = plan.units
        plan.next_unit = u
        plan.state[:] = IN_FLIGHT
        plan.synced = seed % 3 != 0
        plan.flushes[:] = g.integers(0, cfg.max_flushes + 2, u)
        plan.first_flush_at[:] = now - g.uniform(0, 2 * e.deadlines.give_up_s(), u)
        plan.probes[:] = g.integers(0, 3, u)
        plan.retx[:] = g.integers(0, 2, u)
        plan.retx_spent[:] = g.integers(0, cfg.critical_max_resends + 2, u)
        plan.proven_in[:] = g.random(u) < 0.3
        plan.sent_at[:] = now - g.uniform(0, 0.5, u)
        plan.sent_at[: plan.exp_units] = now - 10.0  # past the sync wait: FLUSHed, not probed, unsynced
        e.deadlines.rtt_sample(float(g.uniform(1, 5)), 0.5)
    due = np.sort(draw.choice(engines[0][1].units, size=engines[0][1].units // 2, replace=False))
    edge = int(due[len(due) // 2])  # the lowest frontier is a due unit, FLUSHed on a timer's word
    for _e, plan in engines:
        plan.frontier[:] = edge + np.arange(n_workers) * 3
        plan.flushes[edge], plan.proven_in[edge] = 0, False
    for e, plan in engines:
        e._deadline_actions(plan, due.copy(), now, 7)
        e._send_recovery()
    (ref, ref_plan), (nat, nat_plan) = engines
    assert ref.io.take() == nat.io.take()
    _same(ref, nat, f"seed {seed}")
    assert ref.stats.flushes_sent > 0
    assert np.count_nonzero(ref_plan.state == GAVE_UP) > 0
    assert ref.stats.flushes_on_timer > 0


@pytest.mark.parametrize("native", [False, True])
def test_a_chunk_settled_before_it_was_quantized_goes_out_only_at_the_end(
    fake_clock: Clock, native: bool
) -> None:
    """A reduce in place (``out`` is the input) delivers each chunk's values to ``out`` as its RESULT is
    settled, but only once the chunk was quantized: a RESULT that comes first (a peer's FLUSH closed the
    round) leaves the input there, for the quantize that may still read it, and the values go out at the
    end, times the scale. Both paths: the reference's settle and the native one."""
    k, n_workers = 8, 2
    cfg = TransportConfig(elems_per_packet=k, pool_size=48, seed=3)
    e = _engine(cfg, 0, n_workers, native)
    x = np.random.default_rng(3).standard_normal(k * 20 + 5).astype(np.float32)
    local = x.copy()
    plan, n_chunks = e._begin(local, step=1, weight=1, critical=None, owners=None, t0=fake_clock(),
                              out=local, out_scale=2.0)  # fmt: skip
    c = n_chunks - 1  # the partial last chunk: nothing of this worker was sent, let alone quantized
    u = plan.exp_units + c
    shift = 20
    ints = np.arange(1, k + 1, dtype=np.int64) * 1000 - 3500
    pkt = np.zeros(protocol.packet_bytes(k), dtype=np.uint8)
    hdr = pkt[:HEADER_BYTES].view(HEADER_DTYPE)
    hdr["version"], hdr["op"], hdr["job_id"], hdr["worker_id"] = protocol.VERSION, int(Op.RESULT), JOB, 1
    hdr["count"], hdr["bitmap"], hdr["exp"], hdr["chunk"], hdr["nelem"] = 2, 3, shift, c, 5
    hdr["slot"], hdr["seq"] = (plan.base + u) % e._slots, 2 * ((plan.base + u) // e._slots) + 1
    pkt[HEADER_BYTES:].view(">i4")[:] = ints
    n = e.io.fill([pkt.tobytes()])
    e._handle(n, plan)
    assert plan.state[u] == DONE and not plan.quantized[c]
    assert not plan.delivered[c]
    np.testing.assert_array_equal(local, x)  # the input is whole: nothing went out over it yet
    result, _ = e._finish(plan, x.size, n_chunks, None, local, 0.0, 2.0)
    assert result.values is local or np.shares_memory(result.values, local)
    # sum * 2^-shift / count, times the scale: the five values of the last chunk
    expected = (ints[:5] * 2.0**-shift / 2 * 2).astype(np.float32)
    np.testing.assert_array_equal(local[c * k :], expected)
    assert result.count[c] == 2


def test_a_result_one_pool_ahead_gives_up_every_older_unit_whatever_its_slot(fake_clock: Clock) -> None:
    """A late worker whose peers ran on learns only from the few RESULTs that reach it (RESULT loss,
    owner-only reduces) that its units' slots moved on. A RESULT for global unit g
    shows that its sender sent every unit before g (first copies go in order), so the slot of each unit
    up to g - D has seen a newer round: all of them are overtaken, not only the one in g's slot. A
    hand-built RESULT for unit 10 + D of the next reduce (D = 47 data slots) gives up units 0..10 of
    this reduce at once and leaves the others as they were; one for unit last + D + 1 (not the last
    unit's slot) gives up the rest, and the reduce counts as passed (its peers had left it). The
    reference and the native settle alike."""
    k, n_workers = 8, 2
    cfg = TransportConfig(elems_per_packet=k, pool_size=48, seed=3)
    engines = [_engine(cfg, 0, n_workers, native) for native in (False, True)]
    d = engines[0]._slots
    x = np.random.default_rng(4).standard_normal(k * 30).astype(np.float32)
    plans = [e._begin(x.copy(), step=1, weight=1, critical=None, owners=None, t0=fake_clock(), out=None,
                      out_scale=1.0)[0] for e in engines]  # fmt: skip
    units = plans[0].units
    assert 11 < units < d
    before = plans[0].state.copy()
    pkt = np.zeros(protocol.packet_bytes(k), dtype=np.uint8)
    hdr = pkt[:HEADER_BYTES].view(HEADER_DTYPE)
    hdr["version"], hdr["op"], hdr["job_id"], hdr["worker_id"] = protocol.VERSION, int(Op.RESULT), JOB, 1
    hdr["count"], hdr["bitmap"], hdr["chunk"], hdr["nelem"] = 1, 2, 0, k
    for g, given_up in ((10 + d, 11), (units - 1 + d + 1, units)):
        g += plans[0].base
        hdr["slot"], hdr["seq"] = g % d, 2 * (g // d) + 1
        for e, plan in zip(engines, plans, strict=True):
            e._handle(e.io.fill([pkt.tobytes()]), plan)
            assert (plan.state[:given_up] == GAVE_UP).all()
            np.testing.assert_array_equal(plan.state[given_up:], before[given_up:])
            assert e.stats.units_overtaken == given_up
        _same(*engines, f"unit {g}")
    for e, plan in zip(engines, plans, strict=True):
        result, outcome = e._finish(plan, x.size, plan.chunks_count, None, None, fake_clock())
        assert outcome.passed and outcome.got_nothing == plan.chunks_count
        assert (result.count == 0).all()


def test_a_peer_settled_mark_lets_a_withholding_worker_flush_at_once(fake_clock: Clock) -> None:
    """Chaos seed 2, reduced: worker 2 reached a reduce after worker 0 had closed its exponent rounds
    alone (worker 1 is dead), so it withholds every chunk of it and sends no GRAD. Its owner-only RESULTs
    are few, so no RESULT bit proves that worker 0 sent those units, and the withheld units' flush
    (Deadlines.flush_withheld) waited: the units were given up only as worker 0's RESULTs came a pool
    past them, at worker 0's pace, and worker 2 never caught up. Worker 0's relayed heartbeat says it
    settled every unit of the reduce: that is the proof. Its frontier is raised to its mark and the units
    are FLUSHed at once (those worker 2 is designated for now, the others one FLUSH round trip later);
    without the mark nothing is due before the lag deadline."""
    k, n_workers = 8, 3
    cfg = TransportConfig(elems_per_packet=k, pool_size=48, seed=3)
    e = _engine(cfg, 2, n_workers, False)
    x = np.random.default_rng(4).standard_normal(k * 30).astype(np.float32)
    plan, n_chunks = e._begin(x.copy(), step=1, weight=1, critical=None, owners=None, t0=fake_clock(),
                              out=None, out_scale=1.0)  # fmt: skip
    units = np.arange(plan.exp_units, plan.units)
    plan.exp_known[:n_chunks] = True
    plan.exp_bitmap[:n_chunks] = 0b001  # only worker 0's proposals were counted
    plan.any_withheld = True
    plan.state[: plan.exp_units] = DONE
    plan.state[units] = IN_FLIGHT
    plan.low, plan.next_unit = plan.exp_units, plan.units
    plan.frontier[2] = plan.units - 1
    later = fake_clock() + 10.0
    plan.deadline_at[units] = later
    now = fake_clock()
    e._frontier_from_marks(plan)  # no mark heard yet: nothing moves
    e.deadlines.flush_withheld(plan, now)
    assert (plan.deadline_at[units] == later).all()
    # worker 0's mark, relayed by its heartbeat: every unit of the reduce settled
    relay = protocol.make_packet(Op.PARAM, job_id=JOB, worker_id=0, chunk=protocol.ALIVE_CHUNK,
                                 elems_per_packet=k, nelem=0, bitmap=plan.base + plan.units)  # fmt: skip
    e._handle(e.io.fill([relay]), plan)
    assert e._peer_news
    e._frontier_from_marks(plan)
    assert plan.frontier.tolist() == [plan.units - 1, -1, plan.units - 1]
    e.deadlines.flush_withheld(plan, now)
    designated = units % n_workers == 2
    assert (plan.deadline_at[units[designated]] == now).all()
    assert (plan.deadline_at[units[~designated]] < later).all()
    assert (plan.deadline_at[units[~designated]] > now).all()
    # A mark below the newest one moves that peer's frontier too: it is news (before, only a higher
    # newest mark was, and a late peer's mark waited for the leader's next one)
    e._peer_news = False
    relay = protocol.make_packet(Op.PARAM, job_id=JOB, worker_id=1, chunk=protocol.ALIVE_CHUNK,
                                 elems_per_packet=k, nelem=0, bitmap=plan.base + 5)  # fmt: skip
    e._handle(e.io.fill([relay]), plan)
    assert e._peer_news
    e._frontier_from_marks(plan)
    assert plan.frontier.tolist() == [plan.units - 1, 4, plan.units - 1]


def _redo_result(engine: ReduceEngine, plan, c: int, *, bitmap: int, weight: int, later: int = 0) -> bytes:  # noqa: ANN001
    """A RESULT of chunk ``c``'s redo round (its unit's second round; ``later`` reduces' worth of units on),
    hand-built: ``bitmap`` the workers whose GRADs it counted, ``weight`` the sum of their weights (2^w for a
    first-round contributor, 0 for a worker that sent zeros); every value 2^20 at shift 20."""
    g = plan.base + plan.units * later + plan.exp_units + c
    k, seq = engine.config.elems_per_packet, protocol.unit_seq(g, engine._slots, redo=True)
    return protocol.make_packet(
        Op.RESULT, job_id=JOB, worker_id=1, slot=g % engine._slots, seq=seq, payload=np.full(k, 1 << 20),
        elems_per_packet=k, exp=20, count=bin(bitmap).count("1"), chunk=c, weight=weight, bitmap=bitmap,
    )  # fmt: skip


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_a_redo_round_counts_its_contributors_and_proves_only_their_progress(fake_clock: Clock, native: bool):
    """A redo's RESULT counted worker 0's values (weight 1 = 2^0) and worker 1's zeros (weight 0): the chunk
    is worker 0's value alone (count 1, bitmap 1), and only worker 0's bit proves it sent every unit before
    (worker 1's zeros went out of order: a peer that had not reached the unit yet sends them at once)."""
    cfg = TransportConfig(elems_per_packet=8, pool_size=48, seed=1, speculate_bits=3)
    e = _engine(cfg, 0, 2, native)
    plan, _ = e._begin(np.ones(8 * 20, dtype=np.float32), step=5, weight=1, critical=None, owners=None,
                       t0=fake_clock())  # fmt: skip
    e._handle(e.io.fill([_redo_result(e, plan, 15, bitmap=0b11, weight=0b01)]), plan)
    c, u = 15, plan.exp_units + 15
    assert plan.state[u] == DONE and plan.count[c] == 1 and plan.bitmap[c] == 1
    np.testing.assert_array_equal(plan.out[c], np.full(8, 1.0))  # 2^20 · 2^-20 / 1
    assert plan.frontier.tolist() == [u, -1]


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_a_worker_late_to_a_redone_unit_joins_its_redo_and_gets_the_stored_result(
    fake_clock: Clock, native: bool
):
    """A redo RESULT of the next reduce's unit reaches a worker still in this reduce: when it starts that
    reduce, the unit is in its second round already (its FLUSHes and probes go there: the switch drops the
    first round's as stale), and once the agreed exponent is known the worker sends its zeros there, which
    the switch answers with the stored RESULT (before, its first round's FLUSHes went unanswered until it
    gave the unit up)."""
    cfg = TransportConfig(elems_per_packet=8, pool_size=48, seed=1, speculate_bits=3)
    e = _engine(cfg, 1, 2, native)
    x = np.ones(8 * 20, dtype=np.float32)
    plan, _ = e._begin(x, step=5, weight=1, critical=None, owners=None, t0=fake_clock())
    e._handle(e.io.fill([_redo_result(e, plan, 7, bitmap=0b01, weight=0b01, later=1)]), plan)
    assert plan.state.tolist().count(DONE) == 0 and not plan.redo.any()  # (this reduce's own: untouched)
    e._plans.clear()  # the next reduce, of the same length, starts one reduce later
    e._next_unit = plan.base + plan.units
    nxt, _ = e._begin(x, step=6, weight=1, critical=None, owners=None, t0=fake_clock())
    u = nxt.exp_units + 7
    second = protocol.unit_seq(nxt.base + u, e._slots, redo=True)
    assert nxt.redo[7] and nxt.state[u] == IN_FLIGHT and nxt.seqs[u] == second
    assert nxt.deadline_at[u] == np.inf and nxt.redo_waiting[7]  # until the agreed exponent is known
    e.io.take()
    # the exponent round's RESULT (exponent unit 0: chunks 0-7), worker 1's proposal counted
    exponents = protocol.make_packet(
        Op.RESULT, job_id=JOB, slot=nxt.base % e._slots, seq=protocol.unit_seq(nxt.base, e._slots),
        payload=np.ones(8), elems_per_packet=8, flags=int(Flag.MAX), count=2, bitmap=0b11,
    )  # fmt: skip
    e._handle(e.io.fill([exponents]), nxt)
    sent = [np.frombuffer(row, dtype=np.uint8)[:HEADER_BYTES].view(HEADER_DTYPE)[0] for row in e.io.take()]
    mine = [h for h in sent if h["seq"] == second and h["slot"] == (nxt.base + u) % e._slots]
    assert len(mine) == 1 and mine[0]["op"] == int(Op.GRAD) and mine[0]["weight"] == 0  # zeros
    assert np.isfinite(nxt.deadline_at[u]) and not nxt.redo_waiting[7]
