"""The parameter server's rules, driven packet by packet without sockets (``softswitch.ps``), against
hand-computed expectations and numpy replays: the staleness rule at its boundary, adaptive bounds from
given intervals, the async server applying exactly the accepted gradients, the sync window closing at
``window_size`` and at ``max_wait_s``, and robust rules over the contributions that arrived."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hostlib.errors import ConfigError, UsageError
from hostlib.protocol import HEADER_BYTES, HEADER_DTYPE, VERSION, PsCodec, PsFlag, PsOp, make_packet
from hostlib.ps import robust
from hostlib.ps.compress import make_compressor
from hostlib.ps.wire import (
    build_packets,
    chunk_bitmap,
    decode_dense,
    decode_topk,
    encode_push,
    float_rows,
    lr_bits,
    rows_to_floats,
    values_per_packet,
)
from softswitch.pipeline import SoftSwitch
from softswitch.ps.config import PsJobConfig, parse_ps_config
from softswitch.ps.core import ParameterServer
from softswitch.ps.staleness import StalenessConfig, StalenessPolicy

K = 8
JOB = 3


def key(w: int) -> int:
    """A made-up address key per worker (the core only compares them)."""
    return 1000 + w


class Driver:
    """Hand-built packets into a ParameterServer; replies decoded back."""

    def __init__(self, cfg: PsJobConfig, seed: int = 0) -> None:
        self.server = ParameterServer(seed, log_pushes=True)
        self.job = self.server.add_job(cfg)
        self.cfg = cfg
        self.seq = [0] * cfg.n_workers

    def send(self, rows: np.ndarray, w: int, now: float = 0.0) -> list[np.ndarray]:
        out = []
        for row in rows:
            for data, keys in self.server.process_packet(row.tobytes(), key(w), now):
                assert (keys == key_of(data)).all()
                out.append(data)
        return out

    def init(
        self,
        params: np.ndarray,
        w: int = 0,
        *,
        now: float = 0.0,
        incarnation: int = 0,
        addr: int | None = None,
    ) -> list[np.ndarray]:
        """INIT of every chunk from worker ``w`` (``addr``: from another address key than its own)."""
        payload, nelem = float_rows(params, K)
        rows = build_packets(
            payload,
            K,
            version=VERSION,
            op=int(PsOp.INIT),
            job_id=JOB,
            worker_id=w,
            nelem=nelem,
            seq=params.size,
            step=incarnation,
            chunk=np.arange(len(payload)),
        )
        if addr is None:
            return self.send(rows, w, now)
        return self.send_from(rows, addr, now)

    def send_from(self, rows: np.ndarray, addr: int, now: float) -> list[np.ndarray]:
        """Packets from address key ``addr`` (a worker's claimed id in the rows); replies and their keys."""
        out = []
        for row in rows:
            for data, keys in self.server.process_packet(row.tobytes(), addr, now):
                out.append((data, keys))
        return out

    def push_rows(self, w: int, grad: np.ndarray, step: int, lr: float | None = None) -> np.ndarray:
        self.seq[w] += 1
        comp = make_compressor(self.cfg.compression, **_codec_kw(self.cfg.compression))
        payload, nelem = encode_push(_codec(self.cfg.compression), comp.encode(grad), K)
        return build_packets(
            payload,
            K,
            version=VERSION,
            op=int(PsOp.PUSH),
            exp=int(_codec(self.cfg.compression)),
            job_id=JOB,
            worker_id=w,
            slot=len(payload),
            nelem=nelem,
            seq=self.seq[w],
            step=step,
            chunk=np.arange(len(payload)),
            bitmap=lr_bits(lr),
        )

    def pull(
        self, w: int, step: int, now: float = 0.0, seq: int | None = None, addr: int | None = None
    ) -> list:
        """A PULL of every chunk from worker ``w`` (``addr``: from another address key, as ``init``)."""
        first, payload, nelem = chunk_bitmap(np.arange(self.job.n_chunks), K)
        row = build_packets(
            payload[None, :],
            K,
            version=VERSION,
            op=int(PsOp.PULL),
            job_id=JOB,
            worker_id=w,
            nelem=nelem,
            seq=self.seq[w] if seq is None else seq,
            step=step,
            chunk=first,
        )
        return self.send(row, w, now) if addr is None else self.send_from(row, addr, now)

    def params(self) -> np.ndarray:
        _, params = self.server.snapshot(JOB)
        assert params is not None
        return params


def key_of(data: np.ndarray) -> np.ndarray:
    hdr = np.ascontiguousarray(data[:, :HEADER_BYTES]).view(HEADER_DTYPE).ravel()
    return 1000 + hdr["worker_id"].astype(np.int64)


def headers(replies: list[np.ndarray]) -> np.ndarray:
    rows = np.concatenate(replies)
    return np.ascontiguousarray(rows[:, :HEADER_BYTES]).view(HEADER_DTYPE).ravel()


def _codec(name: str) -> PsCodec:
    return {"none": PsCodec.NONE, "fp16": PsCodec.FP16, "int8": PsCodec.INT8, "topk": PsCodec.TOPK}[name]


def _codec_kw(name: str) -> dict:
    if name == "int8":
        return {"chunk": values_per_packet(PsCodec.INT8, K), "rng": 0}
    if name == "topk":
        return {"ratio": 0.25}
    return {}


def async_cfg(n: int = 3, **kw) -> PsJobConfig:
    stale = kw.pop("staleness", StalenessConfig(max_staleness=2))
    return PsJobConfig(job_id=JOB, n_workers=n, mode="async", elems_per_packet=K, staleness=stale, **kw)


def sync_cfg(n: int = 3, **kw) -> PsJobConfig:
    return PsJobConfig(job_id=JOB, n_workers=n, mode="sync", elems_per_packet=K, **kw)


# ---- the staleness rule ----------------------------------------------------------------------------
def test_fixed_bound_accepts_up_to_and_including_the_bound():
    policy = StalenessPolicy(2, StalenessConfig(max_staleness=3))
    assert [policy.accepts(0, s) for s in (0, 1, 2, 3, 4, 10)] == [True, True, True, True, False, False]
    assert not policy.accepts(1, -1)  # a push from a version the server has not reached


def test_async_server_rejects_one_past_the_bound_and_tells_the_worker():
    d = Driver(async_cfg(staleness=StalenessConfig(max_staleness=2)))
    p0 = np.arange(20, dtype=np.float32)
    d.init(p0)
    g = np.ones(20, dtype=np.float32)
    for _ in range(3):  # worker 0 pushes on the current version each time: step -> 3
        d.send(d.push_rows(0, g, step=d.job.step, lr=0.1), 0)
    assert d.job.step == 3
    # Worker 1 computed on version 1: staleness 2 = the bound: applied.
    d.send(d.push_rows(1, g, step=1, lr=0.1), 1)
    assert d.job.step == 4 and d.job.counters["pushes_accepted"] == 4
    hdr = headers(d.pull(1, step=1))
    assert not (hdr["flags"] & PsFlag.REJECTED).any() and set(hdr["weight"]) == {2}
    before = d.params().copy()
    # Worker 2 computed on version 1: staleness 3, one past the bound: rejected, nothing applied.
    d.send(d.push_rows(2, g, step=1, lr=0.1), 2)
    assert d.job.step == 4 and d.job.counters["pushes_rejected"] == 1
    np.testing.assert_array_equal(d.params(), before)
    hdr = headers(d.pull(2, step=1))
    assert (hdr["flags"] & PsFlag.REJECTED).all() and set(hdr["weight"]) == {3}
    assert set(hdr["step"]) == {4}  # the fresh parameters it should go on from
    np.testing.assert_array_equal(
        rows_to_floats(np.concatenate(d.pull(2, 1))[:, HEADER_BYTES:], K).ravel()[:20], before
    )
    stats = d.job.stats()
    assert stats["rejection_rate"] == pytest.approx(1 / 5)
    assert stats["mean_staleness"] == pytest.approx((0 + 0 + 0 + 2) / 4)


def test_adaptive_bounds_from_given_intervals_match_the_formula():
    cfg = StalenessConfig(
        max_staleness=10, adaptive=True, min_staleness=6, max_staleness_multiplier=2.0, ewma_alpha=0.5
    )
    policy = StalenessPolicy(4, cfg)
    submissions = {0: [0.0, 1.0, 2.0], 1: [0.0, 2.0, 4.0], 2: [0.0, 0.5, 1.5], 3: [0.0, 4.0]}
    for w, times in submissions.items():
        for t in times:
            policy.observe(w, t)
    # By hand: EWMA intervals (alpha 0.5, first interval initializes) 1, 2, 0.5*1 + 0.5*0.5 = 0.75, 4;
    # median of (0.75, 1, 2, 4) = 1.5; speeds 1.5, 0.75, 2, 0.375; 10 / speed = 6.667, 13.333, 5, 26.667;
    # clamped to [6, 10 x 2 = 20]: 6.667, 13.333, 6, 20.
    np.testing.assert_allclose(policy.interval, [1.0, 2.0, 0.75, 4.0])
    np.testing.assert_allclose(policy.speeds(), [1.5, 0.75, 2.0, 0.375])
    np.testing.assert_allclose(policy.bounds(), [20 / 3, 40 / 3, 6.0, 20.0])
    assert policy.accepts(0, 6) and not policy.accepts(0, 7)
    assert policy.accepts(3, 20) and not policy.accepts(3, 21)


def test_adaptive_bound_of_a_worker_without_interval_is_the_base():
    policy = StalenessPolicy(3, StalenessConfig(max_staleness=5, adaptive=True))
    policy.observe(0, 0.0)
    policy.observe(0, 1.0)
    np.testing.assert_allclose(policy.bounds(), [5.0, 5.0, 5.0])


def test_adaptive_server_lets_a_slow_worker_through_where_the_fixed_bound_refuses():
    def run(adaptive: bool) -> int:
        stale = StalenessConfig(max_staleness=2, adaptive=adaptive, ewma_alpha=1.0)
        d = Driver(async_cfg(n=3, staleness=stale))
        d.init(np.zeros(16, dtype=np.float32))
        g = np.ones(16, dtype=np.float32)
        t = 0.0
        # Workers 0 and 1 push every 1 s on fresh parameters; worker 2 every 4 s, 8 versions behind.
        for round_ in range(3):
            for tick in range(4):
                t = round_ * 4 + tick
                for w in (0, 1):
                    d.send(d.push_rows(w, g, step=d.job.step), w, now=t)
            d.send(d.push_rows(2, g, step=d.job.step - 8), 2, now=t)
        return d.job.counters["pushes_rejected"]

    # Intervals 1, 1, 4: median 1, speeds 1, 1, 0.25: bounds 2, 2, 8. The fixed bound 2 refuses all 3.
    assert run(adaptive=False) == 3
    assert run(adaptive=True) == 1  # its first push, before its interval is known


# ---- async: exactly the accepted gradients -----------------------------------------------------------
@pytest.mark.parametrize("loss", [0.0, 0.3])
def test_async_server_applies_exactly_the_accepted_gradients(loss):
    """The up link is emulated here (the test drops packets with its own generator), so what the server
    must accept and apply is computed independently of it: a push whose packets all got lost is never
    seen; otherwise its first packet decides for the whole push (staleness = server step - the push's
    step, accepted within the bound 1, and then the step advances), and an accepted push applies
    exactly the packets that arrived."""
    n, d_params, lr, mu = 3, 37, 0.05, 0.9
    d = Driver(async_cfg(n=n, momentum=mu, lr=lr, staleness=StalenessConfig(max_staleness=1)))
    p0 = np.random.default_rng(1).standard_normal(d_params).astype(np.float32)
    d.init(p0)
    rng, link = np.random.default_rng(2), np.random.default_rng(3)
    versions = [0] * n
    server_step = rejected = lost_packets = 0
    applied = []  # (worker, seq, chunk, lr, gradient) of every packet the server must apply, in order
    for i in range(30):
        w = int(rng.integers(n))
        g = rng.standard_normal(d_params).astype(np.float32)
        lr_sent = 0.02 if i % 2 == 0 else lr
        rows = d.push_rows(w, g, step=versions[w], lr=None if i % 2 else 0.02)
        arrived = [c for c in range(len(rows)) if link.random() >= loss]
        lost_packets += len(rows) - len(arrived)
        d.send(rows[arrived], w, now=float(i))
        if arrived:
            if server_step - versions[w] <= 1:
                server_step += 1
                applied += [(w, d.seq[w], c, lr_sent, g) for c in arrived]
            else:
                rejected += 1
        if rng.random() < 0.5:  # sometimes the worker refreshes, sometimes it computes on old parameters
            versions[w] = server_step
    if loss:
        assert lost_packets > 0
    assert rejected > 0 and d.job.step == server_step
    assert d.job.counters["pushes_rejected"] == rejected
    log = d.job.push_log
    assert [(w, seq, chunk) for w, seq, _step, chunk, _lr in log] == [(w, s, c) for w, s, c, _, _ in applied]
    # Replay with numpy: SGD with momentum on each applied packet's values, in order.
    per = values_per_packet(PsCodec.NONE, K)
    p, v = p0.copy(), np.zeros_like(p0)
    for (_w, _seq, chunk, lr_sent, g), entry in zip(applied, log, strict=True):
        assert entry[4] == pytest.approx(lr_sent)
        sl = slice(chunk * per, min((chunk + 1) * per, d_params))
        v[sl] = np.float32(mu) * v[sl] + g[sl]
        p[sl] -= np.float32(lr_sent) * v[sl]
    np.testing.assert_allclose(d.params(), p, rtol=1e-6, atol=1e-7)


# ---- sync windows ------------------------------------------------------------------------------------
def test_sync_window_closes_at_window_size_and_answers_the_held_pulls():
    lr = 0.5
    d = Driver(sync_cfg(n=3, window_size=2, lr=lr, max_wait_s=10.0))
    p0 = np.zeros(20, dtype=np.float32)
    d.init(p0)
    g = [np.full(20, float(w + 1), dtype=np.float32) for w in range(3)]
    assert d.send(d.push_rows(0, g[0], step=0), 0) == []
    assert d.pull(0, step=0) == []  # held: the window is open
    assert d.job.step == 0
    d.send(d.push_rows(1, g[1], step=0), 1)  # the second finished push closes it
    assert d.job.step == 1 and d.job.counters["windows_full"] == 1
    np.testing.assert_allclose(d.params(), p0 - lr * (g[0] + g[1]) / 2)
    replies = d.pull(1, step=0)  # worker 1's PULL comes after the close: answered at once
    hdr = headers(replies)
    assert set(hdr["step"]) == {1} and set(hdr["count"]) == {2} and set(hdr["bitmap"]) == {0b011}
    # Worker 2 is late for version 0: dropped, counted, and told.
    d.send(d.push_rows(2, g[2], step=0), 2)
    assert d.job.counters["push_late"] == 3 and d.job.counters["pushes_rejected"] == 1
    hdr = headers(d.pull(2, step=0))
    assert (hdr["flags"] & PsFlag.REJECTED).all()
    np.testing.assert_allclose(d.params(), p0 - lr * (g[0] + g[1]) / 2)


def test_held_pull_is_answered_when_the_window_closes():
    d = Driver(sync_cfg(n=2, lr=1.0))
    d.init(np.zeros(10, dtype=np.float32))
    d.send(d.push_rows(0, np.ones(10, dtype=np.float32), step=0), 0)
    assert d.pull(0, step=0) == []
    out = d.send(d.push_rows(1, np.ones(10, dtype=np.float32), step=0), 1)
    hdr = headers(out)
    assert list(hdr["worker_id"]) == [0, 0]  # the held PULL of worker 0, both chunks
    assert set(hdr["op"]) == {int(PsOp.PARAM)} and set(hdr["step"]) == {1}
    floats = rows_to_floats(np.concatenate(out)[:, HEADER_BYTES:], K).ravel()[:10]
    np.testing.assert_array_equal(floats, -np.ones(10, dtype=np.float32))


def test_sync_window_closes_at_max_wait_with_what_arrived():
    lr = 0.1
    d = Driver(sync_cfg(n=3, lr=lr, max_wait_s=0.5))
    d.init(np.zeros(12, dtype=np.float32))
    g = np.linspace(-1, 1, 12).astype(np.float32)
    d.send(d.push_rows(0, g, step=0), 0, now=100.0)
    assert d.job.next_deadline() == pytest.approx(100.5)
    assert d.server.tick(100.49) == [] and d.job.step == 0
    d.server.tick(100.5)
    assert d.job.step == 1 and d.job.counters["windows_timeout"] == 1
    np.testing.assert_allclose(d.params(), -lr * g, rtol=1e-6)  # renormalized by the one that arrived
    assert d.job.next_deadline() is None  # the next window opens with its first packet


def test_sync_renormalizes_each_packet_by_its_own_count():
    """Packets lost from some workers: each value is the mean over the workers whose packet arrived."""
    lr = 1.0
    d = Driver(sync_cfg(n=3, lr=lr))
    d.init(np.zeros(3 * K, dtype=np.float32))
    g = [np.full(3 * K, float(10**w), dtype=np.float32) for w in range(3)]
    lost = {0: [1], 1: [2], 2: []}  # worker 0 lost its packet 1, worker 1 its packet 2
    for w in range(3):
        rows = d.push_rows(w, g[w], step=0)
        d.send(np.delete(rows, lost[w], axis=0), w)
        d.pull(w, step=0)
    expected = np.empty(3 * K)
    expected[:K] = (1 + 10 + 100) / 3
    expected[K : 2 * K] = (10 + 100) / 2
    expected[2 * K :] = (1 + 100) / 2
    np.testing.assert_allclose(d.params(), -lr * expected, rtol=1e-6)


# ---- robust rules over the contributions that arrived -------------------------------------------------
@pytest.mark.parametrize(
    ("rule", "f", "trim_ratio"),
    [
        ("median", None, 0.1),
        ("trimmed_mean", 1, 0.2),
        ("krum", 1, 0.1),
        ("multi_krum", 1, 0.1),
        ("bulyan", 1, 0.1),
    ],
)
def test_rule_over_arrived_rows_equals_hostlib_robust(rule, f, trim_ratio):
    n, per, lr = 7, K, 0.1
    n_packets = 4
    d_params = n_packets * per - 3
    d = Driver(sync_cfg(n=n, rule=rule, f=f, trim_ratio=trim_ratio, lr=lr, fallback="refuse"))
    d.init(np.zeros(d_params, dtype=np.float32))
    rng = np.random.default_rng(5)
    g = rng.standard_normal((n, d_params)).astype(np.float32)
    g[6] *= -10  # a sign-flipped, scaled row
    # Which packets arrive from whom: packets 0 and 3 from everyone, 1 without worker 2, 2 without 4.
    arrived = np.ones((n, n_packets), dtype=bool)
    arrived[2, 1] = False
    arrived[4, 2] = False
    for w in range(n):
        rows = d.push_rows(w, g[w], step=0)
        d.send(rows[arrived[w]], w)
        d.pull(w, step=0)
    assert d.job.step == 1
    expected = np.zeros(d_params)
    refused = 0
    # One set per distinct sender set: packets {0, 3} from all, {1} without 2, {2} without 4.
    for packets in ([0, 3], [1], [2]):
        cols = np.concatenate([np.arange(p * per, min((p + 1) * per, d_params)) for p in packets])
        rows = np.flatnonzero(arrived[:, packets[0]])
        try:
            expected[cols] = robust.aggregate(rule, g[np.ix_(rows, cols)], f=f, trim_ratio=trim_ratio)
        except robust.InsufficientContributions:  # Bulyan f=1 needs 7: those values stay as they were
            refused += 1
    np.testing.assert_allclose(d.params(), -lr * expected, rtol=1e-5, atol=1e-6)
    assert d.job.counters["rule_groups"] == 3
    assert d.job.counters["rule_refusals"] == refused == (2 if rule == "bulyan" else 0)
    assert d.job.stats()["last_window"]["fewest_rows"] == 6


def test_too_few_for_the_rule_falls_back_to_the_median_and_counts():
    # Krum tolerating f=1 needs 5 contributions; 4 arrive: the median of the 4 is applied instead.
    d = Driver(sync_cfg(n=4, rule="krum", f=1, lr=1.0, fallback="median"))
    d.init(np.zeros(K, dtype=np.float32))
    g = np.array([[1.0] * K, [2.0] * K, [4.0] * K, [-40.0] * K], dtype=np.float32)
    for w in range(4):
        d.send(d.push_rows(w, g[w], step=0), w)
    assert d.job.counters["rule_fallbacks"] == 1
    np.testing.assert_allclose(d.params(), -np.median(g, axis=0))


def test_refuse_leaves_the_values_alone_and_counts():
    d = Driver(sync_cfg(n=4, rule="bulyan", f=1, lr=1.0, fallback="refuse"))
    d.init(np.full(K, 3.0, dtype=np.float32))
    for w in range(4):
        d.send(d.push_rows(w, np.ones(K, dtype=np.float32), step=0), w)
    assert d.job.counters["rule_refusals"] == 1 and d.job.step == 1
    np.testing.assert_array_equal(d.params(), np.full(K, 3.0, dtype=np.float32))


# ---- compression on the wire -------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["none", "fp16", "int8", "topk"])
def test_push_payloads_decode_to_what_the_compressor_decodes(method):
    codec = _codec(method)
    x = np.random.default_rng(3).standard_normal(101).astype(np.float32)
    comp = make_compressor(method, **_codec_kw(method))
    enc = comp.encode(x)
    reference = make_compressor(method, **_codec_kw(method)).decode(enc)
    rows, nelem = encode_push(codec, enc, K)
    assert rows.shape[1] == 4 * K and (nelem <= K).all()
    if codec == PsCodec.TOPK:
        idx, values = decode_topk(rows, nelem, K)
        dense = np.zeros(101, dtype=np.float32)
        dense[idx] = values
    else:
        dense = decode_dense(codec, rows, K).ravel()[:101]
        assert len(rows) == math.ceil(101 / values_per_packet(codec, K))
    np.testing.assert_array_equal(dense, reference)


@pytest.mark.parametrize("method", ["fp16", "int8", "topk"])
def test_sync_server_decodes_compressed_pushes(method):
    d = Driver(sync_cfg(n=2, lr=1.0, compression=method))
    d.init(np.zeros(50, dtype=np.float32))
    x = [np.random.default_rng(w).standard_normal(50).astype(np.float32) for w in range(2)]
    decoded = []
    for w in range(2):
        comp = make_compressor(method, **_codec_kw(method))
        decoded.append(comp.decode(comp.encode(x[w])))
        d.send(d.push_rows(w, x[w], step=0), w)
    assert d.job.step == 1
    np.testing.assert_allclose(d.params(), -(decoded[0] + decoded[1]) / 2, rtol=1e-6, atol=1e-7)


def test_a_push_in_another_encoding_is_dropped_and_counted():
    d = Driver(sync_cfg(n=1, compression="fp16"))
    d.init(np.zeros(10, dtype=np.float32))
    d.cfg = sync_cfg(n=1)  # the worker encodes as none
    d.send(d.push_rows(0, np.ones(10, dtype=np.float32), step=0), 0)
    assert d.job.counters["drop_codec"] == 2 and d.job.step == 0  # both packets


# ---- packets the server refuses ------------------------------------------------------------------------
def test_init_is_kept_from_the_first_worker_only():
    d = Driver(sync_cfg(n=2))
    d.init(np.full(10, 1.0, dtype=np.float32), w=1)
    d.init(np.full(10, 2.0, dtype=np.float32), w=0)
    np.testing.assert_array_equal(d.params(), np.full(10, 1.0, dtype=np.float32))
    assert d.job.counters["init_ignored"] == 2


def test_a_pull_before_init_is_held_until_the_parameters_exist():
    d = Driver(sync_cfg(n=2))
    d.seq = [0, 0]
    assert (
        d.send(
            build_packets(
                np.zeros((1, 4 * K), dtype=np.uint8),
                K,
                version=VERSION,
                op=int(PsOp.PULL),
                job_id=JOB,
                worker_id=1,
            ),
            1,
        )
        == []
    )
    out = d.init(np.arange(10, dtype=np.float32))
    assert set(headers(out)["worker_id"]) == {1}


def test_malformed_unknown_job_and_impostors_are_counted():
    d = Driver(sync_cfg(n=2))
    d.init(np.zeros(10, dtype=np.float32))  # worker 0 is now known as key(0)
    server = d.server
    server.process_packet(b"\x01\x07", key(0), 0.0)
    assert server.counters["drop_malformed"] == 1
    other = make_packet(PsOp.PULL, job_id=9, elems_per_packet=K)
    server.process_packet(other, key(0), 0.0)
    assert server.counters["drop_unknown_job"] == 1
    impostor = make_packet(PsOp.PULL, job_id=JOB, worker_id=0, elems_per_packet=K)
    server.process_packet(impostor, key(5), 0.0)
    assert d.job.counters["drop_bad_worker"] == 1
    short = make_packet(PsOp.PULL, job_id=JOB, worker_id=1, elems_per_packet=K - 1)
    server.process_packet(short, key(1), 0.0)
    assert d.job.counters["drop_malformed"] == 1


def test_a_switch_drops_ps_packets_as_malformed():
    switch = SoftSwitch()
    for op in PsOp:
        assert switch.process(make_packet(op, job_id=1), ("127.0.0.1", 1)) == []
    assert switch.read_counters(0)["drop_malformed"] == len(PsOp)


# ---- configuration ----------------------------------------------------------------------------------------
def test_config_file_builds_the_jobs():
    doc = {
        "seed": 4,
        "jobs": [
            {
                "job_id": 2,
                "workers": 7,
                "mode": "sync",
                "rule": "krum",
                "f": 2,
                "drop": [{"direction": "up", "p": 0.1}],
            },
            {
                "job_id": 3,
                "workers": ["127.0.0.1:4000", "127.0.0.1:4001"],
                "mode": "async",
                "adaptive_staleness": True,
            },
        ],
    }
    seed, jobs = parse_ps_config(doc, "ps.toml")
    assert seed == 4
    assert (jobs[0].n_workers, jobs[0].rule, jobs[0].f, jobs[0].drops[0].policy.p) == (7, "krum", 2, 0.1)
    assert jobs[1].workers == (("127.0.0.1", 4000), ("127.0.0.1", 4001)) and jobs[1].staleness.adaptive


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (
            {"job_id": 1, "workers": 2, "mdoe": "sync"},
            r"ps.toml: jobs\[0\]: unknown key 'mdoe' \(did you mean 'mode'\?\)",
        ),
        ({"job_id": 1, "workers": 2, "rule": "mean", "f": 1}, "mean tolerates no Byzantine worker"),
        ({"job_id": 1, "workers": 2, "window_size": 3}, "window_size must be in 1..2"),
        ({"job_id": 1, "workers": 2, "lr": "fast"}, "lr must be a number"),
        ({"workers": 2}, "job_id = N is missing"),
    ],
)
def test_config_errors_name_the_file_and_the_key(job, message):
    with pytest.raises(ConfigError, match=message):
        parse_ps_config({"jobs": [job]}, "ps.toml")


def test_job_settings_are_checked():
    with pytest.raises(UsageError, match="momentum"):
        PsJobConfig(job_id=1, n_workers=2, momentum=1.0)
    with pytest.raises(UsageError, match="at least 2 lanes"):
        PsJobConfig(job_id=1, n_workers=2, compression="int8", elems_per_packet=1)


def test_configured_addresses_are_checked_and_never_learned():
    from hostlib.batchio import addr_key

    cfg = sync_cfg(n=2, workers=(("127.0.0.1", 5000), ("127.0.0.1", 5001)))
    server = ParameterServer()
    job = server.add_job(cfg)
    pull = make_packet(PsOp.PULL, job_id=JOB, worker_id=1, elems_per_packet=K)
    server.process_packet(pull, addr_key(("127.0.0.1", 5000)), 0.0)  # worker 0's address claims to be 1
    server.process_packet(pull, addr_key(("127.0.0.1", 6000)), 0.0)  # an address the job does not know
    assert job.counters["drop_bad_worker"] == 2
    server.process_packet(pull, addr_key(("127.0.0.1", 5001)), 0.0)
    assert job.counters["drop_bad_worker"] == 2 and job.counters["pull_held"] == 1


# ---- liveness and restarts -----------------------------------------------------------------------------
def test_sync_window_stops_waiting_for_a_worker_silent_past_the_liveness_timeout():
    """A killed worker costs its peers the liveness timeout once, not max_wait_s every step; it is
    waited for again as soon as it speaks."""
    lr, n = 1.0, 3
    d = Driver(sync_cfg(n=n, lr=lr, max_wait_s=30.0, liveness_timeout_s=3.0))
    p = np.zeros(12, dtype=np.float32)
    d.init(p, 0, now=0.0)
    g = [np.full(12, w + 1.0, dtype=np.float32) for w in range(n)]
    for w in range(n):  # step 0: everyone pushes at t = 1
        d.send(d.push_rows(w, g[w], step=0), w, now=1.0)
    assert d.job.step == 1 and d.job.counters["windows_full"] == 1
    expect = p - lr * (g[0] + g[1] + g[2]) / 3
    # step 1: worker 2 is silent from t = 1 on; its peers finish at t = 2
    for w in (0, 1):
        d.send(d.push_rows(w, g[w], step=1), w, now=2.0)
    assert d.job.step == 1, "worker 2 was heard from 1 s ago: still waited for"
    assert d.job.next_deadline() == pytest.approx(4.0)  # its last packet + the liveness timeout
    assert d.server.tick(3.99) == [] and d.job.step == 1
    d.server.tick(4.0)
    assert d.job.step == 2 and d.job.counters["windows_live"] == 1
    v = (g[0] + g[1]) / 2  # renormalized by the two that arrived; momentum 0
    expect = expect - lr * v
    np.testing.assert_allclose(d.params(), expect, rtol=1e-6)
    # step 2: closes at its peers' second finished push, no wait at all
    d.send(d.push_rows(0, g[0], step=2), 0, now=4.5)
    assert d.job.step == 2
    d.send(d.push_rows(1, g[1], step=2), 1, now=4.51)
    assert d.job.step == 3 and d.job.counters["windows_live"] == 2
    expect = expect - lr * v
    np.testing.assert_allclose(d.params(), expect, rtol=1e-6)
    # worker 2 speaks again (a PULL at t = 6): the next window waits for it
    d.pull(2, step=3, now=6.0, seq=0)
    for w in (0, 1):
        d.send(d.push_rows(w, g[w], step=3), w, now=6.5)
    assert d.job.step == 3 and d.server.tick(8.0) == [] and d.job.step == 3
    d.send(d.push_rows(2, g[2], step=3), 2, now=8.5)
    assert d.job.step == 4 and d.job.counters["windows_full"] == 2


def test_liveness_timeout_zero_waits_for_max_wait_as_before():
    d = Driver(sync_cfg(n=2, lr=1.0, max_wait_s=30.0, liveness_timeout_s=0.0))
    d.init(np.zeros(4, dtype=np.float32), 0, now=0.0)
    d.pull(1, step=0, now=0.0, seq=0)
    d.send(d.push_rows(0, np.ones(4, dtype=np.float32), step=0), 0, now=1.0)
    assert d.job.next_deadline() == pytest.approx(31.0)
    assert d.server.tick(30.9) == [] and d.job.step == 0
    d.server.tick(31.0)
    assert d.job.step == 1 and d.job.counters["windows_timeout"] == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_restarted_worker_rejoins_from_a_new_address_once_its_old_one_is_silent(mode):
    """A worker started again (new process, new port, pushes numbered from 1 again) takes its id back with
    its INIT once its old address has been silent for the liveness timeout; before that, and from a
    second live process claiming the same id, its packets are dropped."""
    lr, n = 1.0, 2
    cfg = sync_cfg(n=n, lr=lr) if mode == "sync" else async_cfg(n=n, lr=lr)
    d = Driver(cfg)
    p = np.arange(8, dtype=np.float32)
    d.init(p, 0, now=0.0, incarnation=11)
    d.init(p, 1, now=0.0, incarnation=21)
    g = np.full(8, 0.5, dtype=np.float32)
    per_step = 1 if mode == "sync" else n  # versions one round of pushes makes
    for rnd in range(3):  # three rounds: worker 1's pushes are numbered 1, 2, 3
        for w in range(n):
            d.send(d.push_rows(w, g, step=d.job.step if mode == "async" else rnd), w, now=1.0 + rnd)
    assert d.job.step == 3 * per_step
    expect = p - lr * 3 * per_step * g  # sync: the mean of two equal pushes; async: each push
    np.testing.assert_allclose(d.params(), expect, rtol=1e-6)
    new_addr = 5555
    assert d.init(p, 1, now=4.0, incarnation=22, addr=new_addr) == []  # old address heard 1 s ago
    assert d.job.counters["drop_bad_worker"] == 8 // K
    assert d.job.counters["workers_rejoined"] == 0
    d.init(p, 1, now=6.0, incarnation=22, addr=new_addr)  # 4 s of silence: taken over
    assert d.job.counters["workers_readdressed"] == 1 and d.job.counters["workers_rejoined"] == 1
    replies = d.pull(1, step=0, now=6.1, seq=0, addr=new_addr)
    assert replies and all((keys == new_addr).all() for _, keys in replies)
    got = rows_to_floats(np.concatenate([r for r, _ in replies])[:, HEADER_BYTES:], K).ravel()[:8]
    np.testing.assert_array_equal(got, expect)  # the current parameters, to the new address
    # the old process's address is now the stranger
    assert d.send_from(d.push_rows(1, g, step=d.job.step), key(1), now=6.2) == []
    assert d.job.counters["drop_bad_worker"] == 2 * (8 // K)
    # the new process pushes from 1 again: taken as a new push, not an old or duplicate one
    d.seq[1] = 0
    d.send(d.push_rows(0, g, step=d.job.step), 0, now=6.3)
    d.send_from(d.push_rows(1, g, step=d.job.step if mode == "async" else 3), new_addr, now=6.4)
    assert d.job.step == 4 * per_step
    expect = expect - lr * per_step * g
    np.testing.assert_allclose(d.params(), expect, rtol=1e-6)
    assert d.job.counters["push_old"] == 0 and d.job.counters["push_dup"] == 0


def test_a_second_process_claiming_a_live_workers_id_is_dropped():
    d = Driver(sync_cfg(n=2, lr=1.0, liveness_timeout_s=3.0))
    d.init(np.zeros(8, dtype=np.float32), 0, now=0.0, incarnation=1)
    d.init(np.zeros(8, dtype=np.float32), 1, now=0.0, incarnation=2)
    for t in (1.0, 2.0, 3.0, 4.0):  # worker 1 keeps talking; an impostor keeps trying
        d.pull(1, step=0, now=t, seq=0)
        assert d.init(np.zeros(8, dtype=np.float32), 1, now=t + 0.5, incarnation=9, addr=7777) == []
    assert d.job.counters["workers_readdressed"] == 0 and d.job.counters["workers_rejoined"] == 0
    assert int(d.job.keys[1]) == key(1)


def test_a_restart_at_a_fixed_address_resets_the_workers_pushes_without_readdressing():
    """Fixed addresses: the restarted process binds its address again; its new incarnation's INIT resets
    its push numbering (async: its push 1 would otherwise be an old push, never applied)."""
    lr = 1.0
    cfg = async_cfg(n=2, lr=lr, workers=(("10.0.0.1", 4000), ("10.0.0.2", 4000)))
    d = Driver(cfg)
    d.server.jobs[JOB].keys[:] = [key(0), key(1)]  # the made-up keys stand for the fixed addresses
    p = np.zeros(8, dtype=np.float32)
    d.init(p, 0, now=0.0, incarnation=5)
    d.init(p, 1, now=0.0, incarnation=6)
    g = np.ones(8, dtype=np.float32)
    for _ in range(3):
        d.send(d.push_rows(1, g, step=d.job.step), 1, now=1.0)
    assert d.job.step == 3
    d.init(p, 1, now=1.5, incarnation=7)
    assert d.job.counters["workers_rejoined"] == 1 and d.job.counters["workers_readdressed"] == 0
    d.seq[1] = 0
    d.send(d.push_rows(1, g, step=d.job.step), 1, now=2.0)
    assert d.job.step == 4 and d.job.counters["push_old"] == 0
    np.testing.assert_allclose(d.params(), p - lr * 4 * g)
