"""Differential privacy under loss (hostlib/torch_ext/dp.py).

Expectations are independent of the code under test: the residual of the reduced values against
numpy's mean of the *clipped* gradients of exactly the workers that arrived (clipping recomputed in
float64 here), whose std times the divisor must be σ·C at every count; the Gaussian mechanism's
exact ε (Balle & Wang 2018) and the classic RDP conversion as bounds on the accountant's ε.
"""

from __future__ import annotations

import copy
import math
import sys

import numpy as np
import pytest
import torch

from hostlib import codec
from hostlib.errors import LtaError
from hostlib.torch_ext.dp import DpConfig, GaussianPrivacy, epsilon, privacy_report
from hostlib.torch_ext.sharded import ShardedOptimizer
from hostlib.transport import Fallback, ReduceResult
from tests.conftest import run_workers

N, K = 4, 256
SIGMA, CLIP = 1.0, 1.0


def clipped64(g: np.ndarray, c: float) -> np.ndarray:
    norm = np.linalg.norm(g.astype(np.float64))
    return g.astype(np.float64) * min(1.0, c / norm)


def mechanisms(n: int = N, *, renormalize: str = "count", shared_seed: int = 7) -> list[GaussianPrivacy]:
    cfg = DpConfig(SIGMA, CLIP)
    return [
        GaussianPrivacy(cfg, n, K, shared_seed=shared_seed, renormalize=renormalize, own_seed=100 + w)
        for w in range(n)
    ]


def codec_reduce(sent: list[np.ndarray], arrived: list[int], n: int, divisor: int, rng) -> ReduceResult:
    """What the switch and a host do to one reduce: exponent agreement over the arrived workers,
    stochastic rounding to int32, integer sum, dequantization by ``divisor``."""
    rows = [x.reshape(-1, K) for x in sent]
    agreed = np.max([codec.exponent_proposals(rows[w]) for w in arrived], axis=0)
    shifts = codec.data_shifts(agreed, n)
    total = np.zeros(rows[0].shape, dtype=np.int64)
    for w in arrived:
        ints, saturated = codec.quantize(rows[w], shifts, n, rng)
        assert not saturated.any()
        total += ints
    chunks = rows[0].shape[0]
    values = codec.dequantize(total, shifts, np.full(chunks, divisor)).reshape(-1)
    bits = sum(1 << w for w in arrived)
    return ReduceResult(
        values=values,
        count=np.full(chunks, len(arrived), dtype=np.int64),
        bitmap=np.full(chunks, bits, dtype=np.uint64),
        fallback=np.full(chunks, Fallback.NONE, dtype=np.int8),
        withheld=np.zeros(chunks, bool),
        saturated=np.zeros(chunks, bool),
        shift=shifts,
        elapsed_s=0.0,
    )


@pytest.mark.parametrize("count", [2, 3, 4])
def test_aggregate_noise_std_is_sigma_c_at_every_count(count):
    chunks, trials = 64, 12
    rng = np.random.default_rng(count)
    privacy = mechanisms()
    scaled, untopped = [], []
    for trial in range(trials):
        grads = [rng.normal(0, 0.05, chunks * K).astype(np.float32) for _ in range(N)]  # norm ~6 > C
        sent = [g.copy() for g in grads]
        for w in range(N):
            privacy[w].privatize_(sent[w])
        arrived = sorted(rng.choice(N, size=count, replace=False).tolist())
        result = codec_reduce(sent, arrived, N, count, rng)
        want = np.mean([clipped64(grads[w], CLIP) for w in arrived], axis=0)
        untopped.append(count * (result.values - want))
        assert privacy[arrived[0]].top_up_(result, step=trial) == (chunks if count < N else 0)
        scaled.append(count * (result.values - want))
    std = float(np.std(np.concatenate(scaled)))
    assert std == pytest.approx(SIGMA * CLIP, rel=0.05), f"count {count}: aggregate noise std {std:.4f}"
    assert abs(float(np.mean(np.concatenate(scaled)))) < 0.01  # unbiased
    # Without the top-up the aggregate would carry only the c shares that arrived: √(c/N)·σC.
    before = float(np.std(np.concatenate(untopped)))
    assert before == pytest.approx(math.sqrt(count / N) * SIGMA * CLIP, rel=0.05)


def test_aggregate_noise_through_a_lossy_switch_at_every_count(make_cluster):
    """The real transport under 30% GRAD loss: chunks are grouped by the count their RESULT carried."""
    n, chunks = 4, 400
    cluster = make_cluster(n, up=0.3, elems_per_packet=K, seed=3, exp_copies=6)
    rng = np.random.default_rng(0)
    grads = [rng.normal(0, 0.05, chunks * K).astype(np.float32) for _ in range(n)]
    privacy = mechanisms(n)
    sent = [g.copy() for g in grads]
    for w in range(n):
        privacy[w].privatize_(sent[w])
    results = cluster.reduce_all(sent, step=5)
    for w, result in enumerate(results):
        privacy[w].top_up_(result, step=5)
    clipped = np.stack([clipped64(g, CLIP) for g in grads]).reshape(n, chunks, K)
    result = results[0]
    values = result.values.reshape(chunks, K)
    per_count: dict[int, list[np.ndarray]] = {}
    for c in range(chunks):
        if result.fallback[c] != Fallback.NONE:
            continue
        who = result.contributors(c)
        assert len(who) == result.count[c]
        per_count.setdefault(len(who), []).append(len(who) * (values[c] - clipped[who, c].mean(axis=0)))
    for count in (2, 3, 4):
        assert len(per_count.get(count, [])) >= 30, f"too few chunks with count {count}: {per_count.keys()}"
        std = float(np.std(np.concatenate(per_count[count])))
        assert std == pytest.approx(SIGMA * CLIP, rel=0.05), f"count {count}: {std:.4f}"
    # every worker that got a chunk's RESULT holds the same topped-up values
    for other in results[1:]:
        both = (result.fallback == Fallback.NONE) & (other.fallback == Fallback.NONE)
        rows = np.flatnonzero(both)
        np.testing.assert_array_equal(values[rows], other.values.reshape(chunks, K)[rows])


def test_zero_fill_and_local_fallback_are_topped_up_to_sigma_c():
    chunks = 64
    rng = np.random.default_rng(1)
    # renormalize='none' with the zero fallback keeps sum/N from the c that arrived: N·residual ~ σC
    privacy = mechanisms(renormalize="none")
    grads = [rng.normal(0, 0.05, chunks * K).astype(np.float32) for _ in range(N)]
    sent = [g.copy() for g in grads]
    for w in range(N):
        privacy[w].privatize_(sent[w])
    result = codec_reduce(sent, [0, 2], N, N, rng)
    result.fallback[:] = Fallback.ZERO
    privacy[0].top_up_(result, step=0)
    want = (clipped64(grads[0], CLIP) + clipped64(grads[2], CLIP)) / N
    assert float(np.std(N * (result.values - want))) == pytest.approx(SIGMA * CLIP, rel=0.05)

    # the local fallback is this worker's own x_i, a count of one
    privacy = mechanisms()
    local = grads[1].copy()
    privacy[1].privatize_(local)
    result = codec_reduce([local] * N, [1], N, 1, rng)
    result.values[:] = local
    result.count[:] = 0
    result.fallback[:] = Fallback.LOCAL
    privacy[1].top_up_(result, step=0)
    assert float(np.std(result.values - clipped64(grads[1], CLIP))) == pytest.approx(SIGMA * CLIP, rel=0.05)

    # prev (an earlier, already private result) and plain zeros get nothing
    before = result.values.copy()
    result.fallback[:] = Fallback.PREV
    assert privacy[1].top_up_(result, step=1) == 0
    np.testing.assert_array_equal(result.values, before)


def test_clipping_bounds_the_norm_and_keeps_the_direction():
    privacy = mechanisms()[0]
    rng = np.random.default_rng(2)
    for scale in (1e-4, 0.01, 1.0, 50.0):
        g = rng.normal(0, scale, 10_000).astype(np.float32)
        norm_before = float(np.linalg.norm(g.astype(np.float64)))
        x = g.copy()
        assert privacy.clip_(x) == pytest.approx(norm_before, rel=1e-12)
        norm = float(np.linalg.norm(x.astype(np.float64)))
        assert norm <= CLIP * (1 + 1e-6)
        if norm_before <= CLIP:
            np.testing.assert_array_equal(x, g)  # short gradients pass untouched
        else:
            assert norm == pytest.approx(CLIP, rel=1e-6)
            cosine = np.dot(x.astype(np.float64), g) / (norm * norm_before)
            assert cosine == pytest.approx(1.0, abs=1e-9)
    assert privacy.stats.clips == 4 and privacy.stats.clipped >= 1


def test_top_up_noise_is_shared_per_step_and_chunk_and_own_shares_are_not():
    a, b = mechanisms(shared_seed=11)[:2]
    other = mechanisms(shared_seed=12)[0]
    chunks = 8
    base = ReduceResult(
        values=np.zeros(chunks * K, np.float32),
        count=np.array([1, 2, 3, 4, 2, 3, 1, 2]),
        bitmap=np.zeros(chunks, np.uint64),
        fallback=np.zeros(chunks, np.int8),
        withheld=np.zeros(chunks, bool),
        saturated=np.zeros(chunks, bool),
        shift=np.zeros(chunks, np.int32),
        elapsed_s=0.0,
    )
    r_a, r_b, r_later, r_other = (copy.deepcopy(base) for _ in range(4))
    assert a.top_up_(r_a, step=3) == 7  # every chunk but the one with count N
    b.top_up_(r_b, step=3)
    a.top_up_(r_later, step=4)
    other.top_up_(r_other, step=3)
    np.testing.assert_array_equal(r_a.values, r_b.values)  # two workers, one draw
    full = slice(3 * K, 4 * K)
    assert not r_a.values[full].any()  # count N: nothing to top up
    for r in (r_later, r_other):
        assert not np.allclose(r.values[: 3 * K], r_a.values[: 3 * K])
    # chunk j's draw does not depend on which other chunks were topped up
    part = copy.deepcopy(base)
    a.top_up_(part, step=3, chunks=(4, 6))
    np.testing.assert_array_equal(part.values[4 * K : 6 * K], r_a.values[4 * K : 6 * K])
    assert not part.values[: 4 * K].any() and not part.values[6 * K :].any()
    # the std per chunk is (σC/c)·√((N−c)/N)
    for j, c in enumerate(base.count):
        got = float(np.std(r_a.values[j * K : (j + 1) * K].astype(np.float64)))
        assert got == pytest.approx(SIGMA * CLIP / c * math.sqrt((N - c) / N), rel=0.15, abs=1e-12)
    # each worker's own share is its own
    x, y = np.zeros(4096, np.float32), np.zeros(4096, np.float32)
    a.add_share_(x)
    b.add_share_(y)
    assert not np.allclose(x, y)
    assert float(np.std(x)) == pytest.approx(SIGMA * CLIP / math.sqrt(N), rel=0.05)


def test_sharded_optimizer_steps_on_the_mean_of_clipped_gradients(make_cluster):
    """σ = 0 isolates the clipping: one SGD step (lr 1) must move the parameters by minus the mean of
    the workers' gradients, each clipped to C as a whole (computed here with torch, in float64)."""
    n, clip = 4, 0.05
    cluster = make_cluster(n, elems_per_packet=64)
    torch.manual_seed(0)
    base = torch.nn.Linear(30, 5)
    models = [copy.deepcopy(base) for _ in range(n)]
    inputs = [torch.randn(8, 30, generator=torch.Generator().manual_seed(i)) for i in range(n)]

    def train(worker, i):
        privacy = GaussianPrivacy.for_worker(DpConfig(0.0, clip), worker, shared_seed=1)
        opt = ShardedOptimizer(torch.optim.SGD(models[i].parameters(), lr=1.0), worker, privacy=privacy)
        models[i](inputs[i]).pow(2).mean().backward()
        opt.step()
        opt.synchronize()
        return privacy

    privacies = run_workers(cluster.workers, train)
    expected = []
    for i in range(n):
        ref = copy.deepcopy(base).double()
        ref(inputs[i].double()).pow(2).mean().backward()
        g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        assert g.norm() > clip  # clipping is active
        expected.append(g * min(1.0, clip / g.norm().item()))
    step = -torch.stack(expected).mean(0)
    before = torch.cat([p.detach().reshape(-1) for p in base.parameters()]).double()
    for model in models:
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
        torch.testing.assert_close(after - before, step, atol=1e-6, rtol=1e-4)
    assert all(p.stats.clipped == 1 for p in privacies)


def test_dp_config_and_mechanism_refuse_bad_values():
    for sigma, clip, delta in ((-1, 1, 1e-5), (1, 0, 1e-5), (1, 1, 0), (1, math.inf, 1e-5)):
        with pytest.raises(LtaError):
            DpConfig(sigma, clip, delta)
    with pytest.raises(LtaError, match="weight"):
        GaussianPrivacy(DpConfig(1, 1), N, K, shared_seed=0, renormalize="weight")


# ---- the accountant --------------------------------------------------------------------------------------
def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """ε of a Gaussian mechanism whose sensitivity/noise ratio is ``mu`` (Balle & Wang 2018, Thm 8):
    δ(ε) = Φ(μ/2 − ε/μ) − e^ε·Φ(−μ/2 − ε/μ), solved for ε by bisection."""

    def delta_of(eps: float) -> float:
        return _phi(mu / 2 - eps / mu) - math.exp(eps) * _phi(-mu / 2 - eps / mu)

    lo, hi = 0.0, 1.0
    while delta_of(hi) > delta:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


def classic_rdp_epsilon(sigma: float, steps: int, delta: float) -> float:
    """min over α of T·α/(2σ²) + log(1/δ)/(α−1) (Mironov 2017, Prop. 3): an upper bound."""
    return min(
        steps * a / (2 * sigma**2) + math.log(1 / delta) / (a - 1) for a in np.linspace(1.01, 200, 20000)
    )


def test_epsilon_matches_the_library_and_the_gaussian_mechanism():
    dpa = pytest.importorskip("dp_accounting", reason="needs the dp extra: pip install 'lta[dp]'")
    from dp_accounting import rdp

    sigma, steps, delta = 1.0, 40, 1e-5
    acc = rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma), steps))
    eps = epsilon(sigma, steps, delta)
    assert eps == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    # T Gaussian mechanisms with multiplier σ compose to one with multiplier σ/√T
    exact = exact_gaussian_epsilon(math.sqrt(steps) / sigma, delta)
    assert exact <= eps <= classic_rdp_epsilon(sigma, steps, delta) * (1 + 1e-6)
    assert epsilon(sigma, steps, delta, accountant="pld") == pytest.approx(exact, rel=0.02)
    # subsampled: the library's own value for the same events
    acc = rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1)), 1000))
    assert epsilon(1.1, 1000, delta, sampling_rate=0.01) == pytest.approx(acc.get_epsilon(delta), rel=1e-9)


def test_epsilon_decreases_with_sigma_and_grows_with_steps():
    pytest.importorskip("dp_accounting", reason="needs the dp extra: pip install 'lta[dp]'")
    by_sigma = [epsilon(s, 100, 1e-5) for s in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert all(a > b for a, b in zip(by_sigma, by_sigma[1:], strict=False))
    by_steps = [epsilon(1.0, t, 1e-5) for t in (1, 10, 100)]
    assert all(a < b for a, b in zip(by_steps, by_steps[1:], strict=False))
    assert epsilon(1.0, 0, 1e-5) == 0.0 and epsilon(0.0, 5, 1e-5) == math.inf
    report = privacy_report(DpConfig(1.0, 1.0, 1e-5), 40)
    assert report["epsilon"] == pytest.approx(epsilon(1.0, 40, 1e-5))
    assert report["unit"] == "worker" and report["sampling_rate"] == 1.0


def test_missing_accountant_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import now raises ImportError
    with pytest.raises(LtaError, match=r"pip install 'lta\[dp\]'"):
        epsilon(1.0, 10, 1e-5)
