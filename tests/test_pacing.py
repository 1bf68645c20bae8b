"""LTP's BDP pacing and Early Close in the worker: the token bucket, the learned rate, the close rule.

Expectations by hand (token arithmetic, LTP's formulas), by definition (a paced sender never exceeds
``burst + rate x time`` over any interval) and by numpy (every chunk is the mean over its bitmap).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hostlib.protocol import packet_bytes
from hostlib.transport import TransportConfig
from hostlib.transport.earlyclose import EarlyClose
from hostlib.transport.pacing import PACING_GAINS, RateLearner, TokenBucket, frame_bytes
from lta.bench import ltp
from lta.cli import main
from mininet_topos.netns import leftovers
from tests.conftest import check_mean_over_bitmap, netns_skip_reason

K = 64


# ---- the token bucket -------------------------------------------------------------------------------
def test_token_bucket_counts_tokens_by_hand():
    tb = TokenBucket(rate_bps=8e6, burst_s=0.002, frame=500)  # 1 MB/s; bucket 2 ms = 2000 B = 4 frames
    tb.last = 0.0
    assert tb.allowance(0.0) == 0
    assert tb.allowance(0.001) == 2  # 1000 B accrued
    tb.spend(2, 0.001)
    tb.spend(3, 0.001)  # control packets may put the bucket in debt: -1500 B
    assert tb.allowance(0.001) == 0
    assert tb.wait_s(0.001) == pytest.approx((500 + 1500) / 1e6)
    assert tb.allowance(0.003) == 1  # -1500 + 2000 = 500 B
    assert tb.allowance(10.0) == 4  # capped at the bucket
    tb.set_rate(8e9)  # 1 GB/s: the bucket holds 2 ms = 2 MB now
    assert tb.burst_bytes == pytest.approx(2e6)
    unpaced = TokenBucket(0.0, 0.002, 500)
    assert not unpaced.paced and unpaced.allowance(0.0) > 10**6 and unpaced.wait_s(0.0) == 0.0


def test_bucket_never_smaller_than_two_frames():
    tb = TokenBucket(rate_bps=1e6, burst_s=0.001, frame=9000)  # 125 B per ms: less than a frame
    assert tb.burst_bytes == 2 * 9000


def steady(start: float, per_ms: int, ms: int, head: float = 0.0, tail: float = 0.0) -> list:
    """RESULT batches: ``per_ms`` frames every millisecond for ``ms`` ms from ``start``, after one batch
    of 5 frames ``head`` s earlier and followed by one of 5 frames ``tail`` s after the last."""
    batches = [(start - head, 5)] if head else []
    batches += [(start + i / 1000, per_ms) for i in range(ms)]
    if tail:
        batches.append((start + (ms - 1) / 1000 + tail, 5))
    return batches


def test_rate_learner_samples_the_middle_of_a_reduce_and_keeps_the_max():
    rl = RateLearner(window=3)
    assert rl.estimate_bps == 0.0 and rl.next_rate_bps() == 0.0
    assert rl.sample([(0.0, 7), (0.01, 7)], 1000) is None  # too few RESULTs to tell
    assert rl.sample([(0.0, 100)], 1000) is None  # one batch: no time span
    # 10 frames of 1000 B per ms = 80 Mbit/s; a slow start (the exponent round) and a long tail (a lost
    # packet's deadline) do not count: the sample spans the 10th to the 90th percentile of the frames
    sample = rl.sample(steady(1.0, 10, 100, head=0.05, tail=0.2), 1000)
    assert sample == pytest.approx(80e6, rel=0.02)
    rl.sample(steady(2.0, 5, 100), 1000)  # 40 Mbit/s
    assert rl.estimate_bps == pytest.approx(80e6, rel=0.02)
    rl.sample(steady(3.0, 5, 100), 1000)
    rl.sample(steady(4.0, 5, 100), 1000)  # the 80 Mbit/s sample has left the window of 3
    assert rl.estimate_bps == pytest.approx(40e6, rel=0.02)
    # the first call above took phase 0 (1.1); the cycle goes on from 0.9, 0.97, 0.97, ... and repeats
    base = rl.estimate_bps
    rates = [rl.next_rate_bps() for _ in range(2 * len(PACING_GAINS))]
    assert rates[:3] == pytest.approx([0.9 * base, 0.97 * base, 0.97 * base])
    assert rates[7] == pytest.approx(1.1 * base) and rates[8:11] == pytest.approx(rates[:3])


# ---- Early Close's thresholds -------------------------------------------------------------------------
def test_lt_threshold_starts_from_ltp_formula_then_follows_the_fastest_complete_reduce():
    ec = EarlyClose(theta=0.1, slack_ms=30.0, history=2)
    assert math.isinf(ec.times("a", 10**6, None, 1e8).lt_s)  # nothing measured yet: never early
    t = ec.times("a", 10**6, 0.002, 1e8)  # 1.5 x 2 ms + 8 Mbit at 100 Mbit/s
    assert t.lt_s == pytest.approx(0.003 + 0.08) and t.deadline_s == pytest.approx(0.083 + 0.03)
    ec.record("a", 0.05, complete=True)
    ec.record("a", 0.01, complete=False)  # a reduce that lost data says nothing of the full transfer
    ec.record("a", 0.04, complete=True)
    assert ec.times("a", 10**6, 0.002, 1e8).lt_s == pytest.approx(0.04)
    ec.record("a", 0.07, complete=True)
    ec.record("a", 0.06, complete=True)  # history 2: the 40 ms reduce has aged out
    assert ec.times("a", 10**6, 0.002, 1e8).lt_s == pytest.approx(0.06)
    assert ec.times("b", 10**6, 0.002, 1e8).lt_s == pytest.approx(0.083)  # per tensor


def test_enough_in_is_one_minus_theta_of_the_units():
    ec = EarlyClose(theta=0.1, slack_ms=0.0)
    assert ec.enough_in(90, 100) and not ec.enough_in(89, 100)
    assert ec.enough_in(9, 10) and not ec.enough_in(8, 10)
    strict = EarlyClose(theta=0.0, slack_ms=0.0)
    assert strict.enough_in(100, 100) and not strict.enough_in(99, 100)


def test_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="pace_gbps"):
        TransportConfig(pace_gbps=-1.0)
    with pytest.raises(ValueError, match="early_close_theta"):
        TransportConfig(early_close_theta=1.0)


# ---- on loopback ----------------------------------------------------------------------------------
def spy_sends(worker) -> list[tuple[float, int]]:
    """(time, packets) of every send call of ``worker``."""
    log: list[tuple[float, int]] = []
    send = worker.io.send_rows

    def spy(rows, slots=None):
        log.append((time.perf_counter(), len(rows)))
        return send(rows, slots)

    worker.io.send_rows = spy
    return log


def test_a_paced_worker_never_outruns_its_bucket(make_cluster):
    """Over every interval of send calls, a paced worker sends at most burst + rate x interval, plus the
    packets that go without waiting (the exponent copies); the reduce takes the serialization time."""
    n, chunks, gbps = 2, 1500, 0.04
    cluster = make_cluster(n, pace_gbps=gbps, sync_deadline_ms=300, min_deadline_ms=50, window=256)
    logs = [spy_sends(w) for w in cluster.workers]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(chunks * K).astype(np.float32) for _ in range(n)]
    results = cluster.reduce_all(inputs)
    # nothing lost: every chunk from a RESULT (a thread descheduled past a deadline may be closed out)
    expect = dict(full=(1, None), partial=(0, None), fallback=0)
    assert check_mean_over_bitmap(results, inputs, K, **expect) == n * chunks
    frame = frame_bytes(packet_bytes(K))
    rate = gbps * 1e9 / 8
    burst = cluster.workers[0].pacer.burst_bytes
    exp_copies = 2 * math.ceil(chunks / K)
    for log, r in zip(logs, results, strict=True):
        t = np.array([x for x, _ in log])
        sent = np.cumsum([m for _, m in log]) * frame
        before = np.concatenate([[0.0], sent[:-1]])
        # max over i <= j of (sent[j] - before[i]) - rate (t[j] - t[i]): a running minimum
        excess = sent - rate * t - np.minimum.accumulate(before - rate * t)
        assert excess.max() <= burst + exp_copies * frame + frame, excess.max()
        floor_s = (sent[-1] - burst - exp_copies * frame) / rate
        assert r.elapsed_s >= floor_s, (r.elapsed_s, floor_s)


def test_a_learning_worker_paces_at_what_comes_back(make_cluster):
    # A window of 64 units: the RESULTs of a reduce come back over several round trips, so every reduce
    # gives a sample (a reduce whose RESULTs all land in one receive gives none, by design).
    cluster = make_cluster(2, pace_learn=True, sync_deadline_ms=300, min_deadline_ms=50, window=64)
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(400 * K).astype(np.float32) for _ in range(2)]
    for step in range(3):
        cluster.reduce_all(inputs, step=step)
    worker = cluster.workers[0]
    assert worker.rate_learner.estimate_bps > 0
    samples = list(worker.rate_learner.samples)
    assert len(samples) == 3 and worker.pacer.paced
    # the third reduce ran at the best of the first two samples x the third gain of the cycle
    assert worker.pacer.rate_bps == pytest.approx(max(samples[:2]) * PACING_GAINS[2])


def test_early_close_ends_reduces_that_have_enough_and_spares_critical_units(make_cluster):
    """Loss on the way up; theta = 0.25: reduces close their tail early; every chunk is still exactly
    the mean over its bitmap, and critical chunks are still full."""
    n, chunks, steps = 3, 120, 8
    # No tail copies nor tail probes: they bring most lost GRADs of the last units in, leaving early close
    # little to close (with the tail probe one FLUSH round trip after the frontier, 3 runs in 10 closed none).
    cluster = make_cluster(
        n, up=0.03, seed=2, early_close_theta=0.25, sync_deadline_ms=300, min_deadline_ms=50, tail_units=0,
        tail_probe=False,
    )  # fmt: skip
    critical = np.zeros(chunks, dtype=bool)
    critical[::10] = True
    rng = np.random.default_rng(2)
    prev = None
    short = 0
    for step in range(steps):
        inputs = [rng.standard_normal(chunks * K).astype(np.float32) for _ in range(n)]
        results = cluster.reduce_all(inputs, step=step, critical=critical)
        # critical chunks full; the others full, short (lost or closed early) or, all lost, the fallback
        expect = dict(full=(n * int(critical.sum()), None), partial=(0, None), fallback=(0, None))
        checked = check_mean_over_bitmap(
            results, inputs, K, prev=prev, slack_bits=cluster.slack_bits, **expect
        )
        short += n * chunks - checked
        short += sum(int(np.sum((r.count > 0) & (r.count < n))) for r in results)
        prev = [r.values for r in results]
        for r in results:
            assert np.all(r.count[critical] == n)
    closes = sum(w.stats.early_closes_theta + w.stats.early_closes_deadline for w in cluster.workers)
    closed_units = sum(w.stats.units_closed_early for w in cluster.workers)
    assert closes > 0 and closed_units > 0
    assert short > 0  # chunks came back short of a contribution or none (closed early)


# ---- the bench's command line and real links (root, network namespaces, tbf) ----------------------------
def test_bad_theta_stops_the_cli_in_one_line_before_any_namespace(monkeypatch, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("built a network for a bad --theta")

    monkeypatch.setattr(ltp, "bench_ltp", must_not_run)
    monkeypatch.setattr("mininet_topos.netns.require_root", must_not_run)
    assert main(["bench", "ltp", "--theta", "1"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("lta bench ltp: error: argument --theta") and "below 1" in line
    assert main(["bench", "ltp", "--experiments", "pacing,warp"]) == 2
    assert "warp" in capsys.readouterr().err


def test_tcp_goodput_is_read_off_the_sink_samples():
    # 1 MB per 10 ms from t = 100: 800 Mbit/s, by interpolation inside the samples
    log = "\n".join(f"{100 + i / 100:.6f} {i * 10**6}" for i in range(11))
    assert ltp.tcp_rate_mbit(log, (100.015, 100.075)) == pytest.approx(800.0)
    assert ltp.tcp_rate_mbit("100.0 0\n", (100.0, 101.0)) == 0.0


_REASON = netns_skip_reason()
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.mininet
@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_pacing_keeps_tbf_from_dropping_what_an_unpaced_window_overflows():
    """A 4 MiB reduce with 256 units in flight is 2.1 MB at once, more than tbf's queue at 200 Mbit/s
    (1.28 MB): unpaced, tbf drops frames and chunks come back short at 0% configured loss; paced at 95%
    of the link, tbf drops nothing and every chunk is full."""
    argv = [sys.executable, "-m", "lta.cli", "bench", "ltp", "--experiments", "pacing", "--workers", "2",
            "--mib", "4", "--iters", "8", "--warmup", "2", "--rate", "200mbit", "--json"]  # fmt: skip
    bench = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    stdout, stderr = bench.communicate(timeout=300)
    assert bench.returncode == 0, stderr[-3000:]
    assert not [name for name in leftovers() if f"lta-{bench.pid}-" in name], "namespaces left behind"
    out = json.loads(stdout)
    assert out["config"]["tbf_limit_bytes"] < 256 * (8192 + 36 + 42)
    pacing = out["pacing"]
    unpaced, paced = pacing["unpaced"], pacing["paced"]
    assert unpaced["tbf_drops"]["up"] > 0
    assert paced["tbf_drops"] == {"up": 0, "down": 0}
    assert paced["pace_rate_mbit"] == [pytest.approx(190.0)] * 2
    assert paced["chunks"]["partial"] == paced["chunks"]["fallback"] == 0
    assert unpaced["chunks"]["partial"] + unpaced["chunks"]["fallback"] > 0
