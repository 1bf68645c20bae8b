"""Simulated workers (lta/train/simulated.py, hostlib/emulation/simulate.py) against independent expectations:
the real transport's reduce for the same contributor set, numpy means over the contributors, brute-force
drift, plain autograd per worker, the owners' history for stale copies."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from hostlib import codec
from hostlib.emulation.dropmodels import DropPolicy, DropStream
from hostlib.emulation.simulate import (
    FabricStreams,
    bursty_policy,
    loss_policy,
    quantize_round,
    simulate_round,
    sum_contributions,
    worker_values,
)
from hostlib.torch_ext.layout import ShardLayout
from hostlib.transport import Fallback
from lta.train.experiment import METHODS, RunSpec, TrainConfig, quick_config
from lta.train.gpt import CharCorpus, CharGpt
from lta.train.simulated import SimulatedRun, pair_drift, run_simulated

K = 64


@pytest.fixture(scope="module")
def corpus() -> CharCorpus:
    return CharCorpus()


def _expected_view(inputs, mask, delivered, method, prev, prev_tol, bound):
    """What one worker should hold per chunk, from numpy alone: (values float64 C×K, tolerance C×K)."""
    n, c, k = inputs.shape
    renorm, fallback = METHODS[method]["renormalize"], METHODS[method]["fallback"]
    count = mask.sum(axis=0)
    values = np.zeros((c, k))
    tol = np.zeros((c, k))
    for ch in range(c):
        who = np.flatnonzero(mask[:, ch])
        if renorm == "count":
            ok = delivered[ch] and count[ch] > 0
            divisor = max(count[ch], 1)
        else:
            ok = delivered[ch] and (count[ch] == n or (fallback == "zero" and count[ch] > 0))
            divisor = n
        if ok:
            values[ch] = inputs[who, ch].astype(np.float64).sum(axis=0) / divisor
            tol[ch] = bound[ch] * (len(who) / divisor) + np.abs(values[ch]) * 2**-23
        elif fallback == "prev":
            values[ch], tol[ch] = prev[ch], prev_tol[ch]
    return values, tol


@pytest.mark.parametrize("method", sorted(METHODS))
def test_simulated_reduce_gives_the_real_reduce_for_its_contributor_set(make_cluster, method):
    """One reduce through the softswitch with loss; its RESULT bitmaps name who was summed per chunk.
    The simulator fed that contributor set and the same delivered RESULTs returns, on every worker and
    under every method, numpy's value for it (within the codec's bound), as the real workers do; and
    both pick the same fallback for the same chunks."""
    n, chunks_n = 4, 24
    cfg = METHODS[method]
    # One FLUSH try and no tail probe per unit: a lost RESULT is recovered less often, so the methods'
    # fallback paths are reached (with the probe and three tries, 12 reduces sometimes saw none).
    cluster = make_cluster(
        n, up=0.3, down=0.1, seed=7, sync_deadline_ms=300, min_deadline_ms=50, elems_per_packet=K,
        max_flushes=1, tail_probe=False, **cfg,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    sim_rng = np.random.default_rng(4)
    zeros = np.zeros((chunks_n, K))
    real_prev = [zeros] * n
    sim_prev = [np.zeros((chunks_n, K), np.float32)] * n
    prev_tol = [zeros] * n
    fallbacks_seen = 0
    step = 0
    # Which packets the seeded policy drops depends on their arrival order (threads): a chunk without a
    # RESULT (a fallback) came in 3 reduces almost always, yet once not at load ~30. Go on until one
    # did, up to 12 reduces.
    while step < 3 or (fallbacks_seen == 0 and step < 12):
        inputs = (rng.standard_normal((n, chunks_n, K)) * 10.0 ** rng.integers(-2, 2)).astype(np.float32)
        results = cluster.reduce_all([x.reshape(-1) for x in inputs], step=step)
        mask = np.zeros((n, chunks_n), dtype=bool)
        for r in results:
            for ch in np.flatnonzero(r.count > 0):
                who = r.contributors(ch)
                assert len(who) == r.count[ch]
                mask[who, ch] = True
        agreed = codec.exponent_proposals(inputs.reshape(-1, K)).reshape(n, chunks_n).max(axis=0)
        ints, shifts, saturated = quantize_round(inputs, agreed, sim_rng)
        assert not saturated.any()  # every proposal counted: nothing can exceed the agreed exponent
        summed = sum_contributions(ints, shifts, mask)
        assert np.array_equal(summed.count, mask.sum(axis=0))
        for w, r in enumerate(results):
            delivered = r.count > 0
            sim, codes = worker_values(summed, delivered, n, prev=sim_prev[w], local=inputs[w], **cfg)
            assert np.array_equal(codes, r.fallback), (w, codes, r.fallback)
            real_bound = codec.error_bound(r.shift)
            expected, tol = _expected_view(
                inputs, mask, delivered, method, real_prev[w], prev_tol[w], real_bound
            )
            real = r.values.reshape(chunks_n, K)
            assert np.all(np.abs(real - expected) <= tol), (method, w)
            sim_expected, sim_tol = _expected_view(
                inputs, mask, delivered, method, real_prev[w], prev_tol[w], summed.error_bound()
            )
            assert np.all(np.abs(sim - sim_expected) <= sim_tol), (method, w)
            fallbacks_seen += int(np.sum(codes != Fallback.NONE))
            real_prev[w], prev_tol[w], sim_prev[w] = expected, np.maximum(tol, sim_tol), sim
        step += 1
    assert fallbacks_seen > 0  # the loss did reach the methods' fallback paths
    assert mask.sum() < n * chunks_n  # ... and partial chunks


@pytest.mark.parametrize("policy", [DropPolicy(p=0.2), bursty_policy(0.2, mean_burst=4.0)])
def test_simulated_rounds_lose_the_configured_share_and_sum_exactly(policy):
    n, c = 16, 40
    fabric = FabricStreams(n, {"up": policy}, seed=5)
    rng = np.random.default_rng(0)
    counts = []
    for _ in range(30):
        chunks = rng.standard_normal((n, c, K)).astype(np.float32)
        # exact: exponents spared, as lta train's runs do. Without it a Gilbert-Elliott burst takes all
        # six back-to-back copies of a worker's exponent packet now and then, and the worker withholds
        # every chunk of that unit (0.237 lost at 0.2 here, measured).
        summed, delivered = simulate_round(chunks, fabric, rng, exp_copies=6, exact=True)
        assert delivered.all() or not (summed.count > 0).all()
        counts.append(summed.count)
        for ch in np.flatnonzero(summed.count):
            who = summed.contributed[:, ch]
            mean = codec.dequantize(
                summed.sums[ch : ch + 1], summed.shifts[ch : ch + 1], summed.count[ch : ch + 1]
            )
            exact = chunks[who, ch].astype(np.float64).mean(axis=0)
            assert np.all(np.abs(mean[0] - exact) <= summed.error_bound()[ch] + np.abs(exact) * 2**-23)
    got = np.concatenate(counts).sum() / (n * c * 30)
    # Bursts make neighbouring decisions dependent: allow the burst length in the variance.
    sigma = math.sqrt(0.2 * 0.8 * 4.0 / (n * c * 30))
    assert abs((1 - got) - 0.2) < 5 * sigma, got


def test_bursty_policy_has_the_mean_rate_and_the_burst_length():
    lost = DropStream(bursty_policy(0.2, mean_burst=4.0), seed=0).drop_many(200_000)
    assert abs(lost.mean() - 0.2) < 0.01
    edges = np.diff(np.concatenate([[0], lost.astype(np.int8), [0]]))
    runs = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)  # lengths of the loss bursts
    assert runs.mean() == pytest.approx(4.0, rel=0.05)
    assert loss_policy("ge", 0.0) == DropPolicy() and loss_policy("bernoulli", 0.1) == DropPolicy(p=0.1)
    with pytest.raises(ValueError, match="loss model"):
        loss_policy("bursty", 0.1)


def test_lossless_round_counts_everyone():
    n, c = 8, 10
    fabric = FabricStreams(n, {"up": DropPolicy(), "down": DropPolicy(), "param": DropPolicy()}, seed=1)
    chunks = np.random.default_rng(1).standard_normal((n, c, K)).astype(np.float32)
    summed, delivered = simulate_round(chunks, fabric, np.random.default_rng(2))
    assert np.all(summed.count == n) and delivered.all()


def test_pair_drift_is_the_brute_force_mean_over_receiver_pairs():
    rng = np.random.default_rng(0)
    n, numel = 5, 300
    layout = ShardLayout.contiguous(numel, 32, n)
    replicas = rng.standard_normal((n, layout.padded)).astype(np.float32)
    owner = np.repeat(layout.owners, 32)[:numel]
    total, pairs = 0.0, 0
    for v in range(numel):
        for i in range(n):
            for j in range(i + 1, n):
                if owner[v] not in (i, j):
                    total += (float(replicas[i, v]) - float(replicas[j, v])) ** 2
                    pairs += 1
    assert pair_drift(replicas, layout) == pytest.approx(total / pairs, rel=1e-9)


def _plain_autograd(model, replicas, corpus, batch: int, context: int, *, seed: int):  # noqa: ANN001, ANN202
    """For each worker w: ``model`` (a CharGpt) set to ``replicas[w]`` and its gradient taken on rank w's
    training batch (the real path's generator seed, seed * 1000 + w); yields (w, loss)."""
    for w in range(len(replicas)):
        x, y = corpus.batch("train", batch, context, torch.Generator().manual_seed(seed * 1000 + w))
        torch.nn.utils.vector_to_parameters(replicas[w].clone(), model.parameters())
        model.zero_grad()
        loss = model(x, y)
        loss.backward()
        yield w, loss


def test_every_worker_gets_the_gradient_of_its_own_replica_on_its_own_batch(corpus):
    cfg = quick_config()
    run = SimulatedRun(RunSpec("g", "renorm", 0.0, 3, 1), cfg, 4, batch_per_worker=2, corpus=corpus)
    gen = torch.Generator().manual_seed(9)
    run.replicas[:, : run.numel] += 0.01 * torch.randn(run.replicas[:, : run.numel].shape, generator=gen)
    replicas = run.replicas.clone()
    grads, losses = run.local_gradients()
    model = CharGpt(cfg.gpt(corpus.vocab))
    for w, loss in _plain_autograd(model, replicas[:, : run.numel], corpus, 2, cfg.context, seed=3):
        expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
        assert losses[w] == pytest.approx(loss.item(), rel=1e-5)
        assert np.allclose(grads[w, : run.numel], expected, rtol=1e-4, atol=1e-6)


def test_stacked_gradients_are_each_replicas_own_autograd_at_the_default_model(corpus):
    """The default path (gpt.stacked_losses, one autograd pass for N replicas) at the sweep's model and
    batch (TrainConfig defaults: width 64, 2 layers, 16 sequences per worker), with four different
    replicas: every worker's loss and gradient are plain autograd of CharGpt at its own replica on its
    own batch. Stated bound: loss within 1e-6 relative, every parameter tensor's gradient within
    1e-5 of that tensor's largest entry (measured: losses equal, gradients ~2e-7)."""
    cfg = TrainConfig()
    run = SimulatedRun(RunSpec("g", "renorm", 0.0, 5, 1), cfg, 4, corpus=corpus)
    assert run.gradients == "stacked" and run.batch == cfg.batch
    gen = torch.Generator().manual_seed(11)
    run.replicas[:, : run.numel] += 0.02 * torch.randn(run.replicas[:, : run.numel].shape, generator=gen)
    replicas = run.replicas.clone()
    grads, losses = run.local_gradients()
    model = CharGpt(cfg.gpt(corpus.vocab))
    for w, loss in _plain_autograd(model, replicas[:, : run.numel], corpus, cfg.batch, cfg.context, seed=5):
        assert losses[w] == pytest.approx(loss.item(), rel=1e-6)
        start = 0
        for name, p in model.named_parameters():
            want = p.grad.reshape(-1).numpy()
            got = grads[w, start : start + len(want)]
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (w, name)
            start += len(want)


def test_stacked_path_trains_as_the_vmap_reference_path(corpus):
    """A lossy run (40% on both directions, stale copies, so the replicas differ) through the stacked
    gradients and through the reference path (torch.func.vmap of CharGpt over the replicas): the same
    losses seen, every worker's loss at every step within 1e-4 and the validation loss within 1e-4
    (float rounding only: measured 5e-7 and 3e-8). Unknown paths are refused."""
    cfg = replace(quick_config(), steps=20)
    spec = RunSpec("paths", "renorm", 0.4, 4, 1)
    fast = run_simulated(spec, cfg, 4, corpus=corpus)
    ref = run_simulated(spec, cfg, 4, corpus=corpus, gradients="vmap")
    assert fast.grad_loss_seen == ref.grad_loss_seen and fast.param_loss_seen == ref.param_loss_seen
    assert np.allclose(fast.worker_curves, ref.worker_curves, rtol=0, atol=1e-4)
    assert fast.val_loss == pytest.approx(ref.val_loss, abs=1e-4)
    with pytest.raises(ValueError, match="gradients must be one of"):
        SimulatedRun(spec, cfg, 4, corpus=corpus, gradients="loop")


def test_stale_copies_are_the_owners_past_values_within_the_bound(corpus):
    """Every receiver's copy of every chunk equals its owner's value from ``age`` steps ago, and no
    copy gets older than S+1 (overdue copies are resent reliably)."""
    cfg = replace(quick_config(), stale_bound=1)
    run = SimulatedRun(RunSpec("s", "renorm", 0.5, 0, 1), cfg, 8, directions=("param",), corpus=corpus)
    history = []
    for _ in range(12):
        run.step()
        history.append(run.owned.detach().numpy().copy())
        rows = run.replicas.numpy()[:, : run.numel]
        ages = np.repeat(run.age, run.k, axis=1)[:, : run.numel]
        assert ages.max() <= cfg.stale_bound + 1
        for a in np.unique(ages):
            if a < len(history):
                sel = ages == a
                owner_then = np.broadcast_to(history[-1 - a], rows.shape)
                assert np.array_equal(rows[sel], owner_then[sel])
    assert run.counters["resend_requests"].sum() > 0
    assert run.counters["max_age_seen"].max() == cfg.stale_bound + 1


def test_lossless_runs_repeat_bit_for_bit_and_lose_nothing(corpus):
    cfg = replace(quick_config(), steps=12)
    spec = RunSpec("lossless", "renorm", 0.0, 1, 1)
    a = run_simulated(spec, cfg, 16, corpus=corpus)
    b = run_simulated(spec, cfg, 16, corpus=corpus)
    assert a.worker_curves == b.worker_curves and a.val_loss == b.val_loss
    assert a.grad_loss_seen == 0.0 and a.param_loss_seen == 0.0 and a.max_stale_age == 0
    assert all(d == 0.0 for d in a.drift_measured)
    from lta.train.report import loss_seen  # the lead's table reads the same numbers from workers[]

    assert loss_seen(a) == {"grad_loss_seen": 0.0, "param_loss_seen": 0.0}


def test_loss_seen_is_the_configured_rate(corpus):
    cfg = replace(quick_config(), steps=10)
    r = run_simulated(RunSpec("lossy", "renorm", 0.3, 2, 1), cfg, 16, corpus=corpus)
    contributions = 16 * sum(w["stats"]["grad_chunks"] for w in r.workers)  # N per chunk per step
    sigma = math.sqrt(0.3 * 0.7 / contributions)
    assert abs(r.grad_loss_seen - 0.3) < 5 * sigma + 0.3**6  # + exponent packets (6 copies) all lost
    copies = sum(w["stats"]["exchange"]["chunks_expected"] for w in r.workers)
    assert abs(r.param_loss_seen - 0.3) < 5 * math.sqrt(0.3 * 0.7 / copies)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_both_optimizers_learn_under_loss(corpus, optimizer):
    cfg = replace(quick_config(), steps=20)
    r = run_simulated(RunSpec("learn", "renorm", 0.1, 0, 1), cfg, 16, optimizer=optimizer, corpus=corpus)
    uniform = math.log(corpus.vocab)  # the loss of a model that has learned nothing
    assert r.curve[0] == pytest.approx(uniform, abs=0.1)
    assert np.mean(r.curve[-5:]) < uniform - 0.8
    assert r.val_loss < uniform - 0.8


def test_withholding_on_a_lost_exponent_is_unbiased_only_when_it_ignores_the_values():
    """One worker's values are 15x the others'. When its exponent proposal is lost it saturates: the
    transport's rule (withhold what would saturate) drops exactly the largest contributor and biases the
    renormalized mean low; withholding every chunk whose own proposal was not counted does not."""
    n, c, rounds = 8, 16, 150
    rng = np.random.default_rng(0)
    errors = {}
    for uncounted in (False, True):
        fabric = FabricStreams(n, {"up": DropPolicy(p=0.3)}, seed=2)
        per_round = []  # one exponent packet covers every chunk of a round: rounds are the samples
        for _ in range(rounds):
            chunks = (0.2 * rng.standard_normal((n, c, K))).astype(np.float32)
            chunks[0] += 3.0
            summed, _ = simulate_round(chunks, fabric, rng, exp_copies=1, withhold_uncounted=uncounted)
            ok = np.flatnonzero(summed.count > 0)
            est = codec.dequantize(summed.sums[ok], summed.shifts[ok], summed.count[ok])
            per_round.append(float((est - chunks[:, ok].mean(axis=0)).mean()))
        d = np.array(per_round)
        errors[uncounted] = (d.mean(), d.std() / np.sqrt(d.size))
    mean, se = errors[True]
    assert abs(mean) < 4 * se, errors
    biased, biased_se = errors[False]
    assert biased < -0.05 and biased < -4 * biased_se, errors


def test_rotated_reduce_gives_each_owner_its_own_view_rotated_back(corpus):
    """Simulated ``rotate`` with GRAD and RESULT loss (30%): each owner's chunks are numpy's view of the
    round for that owner (mean over the chunk's contributors of the rotated gradients where its RESULT
    came, the previous result rotated into this step's basis where not), rotated back."""
    from hostlib.emulation.rotation import Rotation

    cfg = replace(quick_config(), steps=4)
    spec = RunSpec("rot", "renorm", 0.3, 0, 1, mechanism="rotate")
    run = SimulatedRun(spec, cfg, 5, directions=("up", "down"), corpus=corpus)
    for _ in range(2):
        run.step()
    n, c, k = run.n_workers, run.n_chunks, run.k
    prev = run.prev.copy()
    grads, _ = run.local_gradients()
    rotation = Rotation(c * k, seed=0, step=run.step_count)
    rotated = rotation.forward(grads).reshape(n, c, k)
    reduced = run.reduce(grads.copy())
    summed, delivered = run.last_round
    assert not (delivered == delivered[:1]).all()  # owners saw different RESULTs: per-owner views
    prev_rot = rotation.forward(prev.reshape(-1)).reshape(c, k).astype(np.float64)
    bound = summed.error_bound()
    got = np.zeros(c * k, np.float32)
    got[: run.numel] = reduced
    got = got.reshape(c, k)
    for w in range(n):
        view, _ = _expected_view(
            rotated, summed.contributed, delivered[w], "renorm", prev_rot, 0 * prev_rot, bound
        )
        want = rotation.inverse(view.reshape(-1).astype(np.float32)).reshape(c, k)
        mine = run.owners == w
        scale = np.abs(want[mine]).max()
        np.testing.assert_allclose(got[mine], want[mine], atol=1e-4 * scale + float(bound.max()) * 4)


@pytest.mark.slow
def test_four_simulated_workers_train_as_four_real_processes(corpus):
    """N=4 simulated with the real run's batch per worker: the same initial weights, batches and
    shards as ``lta train``'s worker processes through the softswitch, so at 0% loss every worker's
    loss at every step matches theirs up to float and codec rounding (measured: within 1e-6)."""
    from lta.train.sweep import LocalCluster

    cfg = replace(quick_config(), steps=10)
    specs = [RunSpec("real", "renorm", 0.0, 0, 1), RunSpec("real-rotate", "renorm", 0.0, 0, 1, "rotate")]
    with LocalCluster(4, cfg) as cluster:
        reals = [cluster.run(spec, ("up", "param")) for spec in specs]
    for spec, real in zip(specs, reals, strict=True):  # rotate: ShardedOptimizer(rotate_seed=...) alike
        sim = run_simulated(spec, cfg, 4, batch_per_worker=cfg.batch, corpus=corpus)
        assert np.allclose(sim.worker_curves, real.worker_curves, atol=1e-4), spec.name
        assert sim.val_loss == pytest.approx(real.val_loss, abs=1e-4)


def test_feedback_aggregate_is_the_mean_over_survivors_of_gradient_plus_residual(corpus):
    """Simulated feedback: after a few lossy steps every worker carries residuals; the next reduce's
    owner values are numpy's sum, over the workers the round counted, of (gradient + residual), divided
    by N (feedback runs divide by N: experiment.aggregation), within the codec's bound, and afterwards
    each worker carries exactly what its own view of the round did not count."""
    cfg = replace(quick_config(), steps=6)
    spec = RunSpec("fb", "renorm", 0.3, 0, 1, mechanism="feedback")
    run = SimulatedRun(spec, cfg, 8, directions=("up", "down"), corpus=corpus)
    for _ in range(3):
        run.step()
    assert run.feedback is not None and run.feedback.carried.any()
    grads, _ = run.local_gradients()
    n, c, k = run.n_workers, run.n_chunks, run.k
    gradient = grads.reshape(n, c, k).astype(np.float64)
    residual = run.feedback.residual.astype(np.float64)
    reduced = run.reduce(grads.copy())
    summed, delivered = run.last_round
    inputs = gradient + residual
    padded = np.zeros(c * k, np.float32)
    padded[: run.numel] = reduced
    values = padded.reshape(c, k)
    bound = summed.error_bound()
    checked = used_residual = 0
    for ch in range(c):
        who = np.flatnonzero(summed.contributed[:, ch])
        if not (delivered[run.owners[ch], ch] and len(who)):
            continue
        expected = inputs[who, ch].sum(axis=0) / n
        assert np.all(np.abs(values[ch] - expected) <= bound[ch] + np.abs(expected) * 2**-22), ch
        checked += 1
        used_residual += int(np.any(residual[who, ch] != 0))
    assert checked > c // 2 and used_residual > 0
    counted = summed.contributed & delivered & (summed.count > 0)[None, :]  # zero fill: a RESULT is used
    after = np.where(counted[:, :, None], 0.0, inputs.astype(np.float32))
    assert np.allclose(run.feedback.residual, after, rtol=2**-22, atol=0)
    assert (~counted).any()


def test_oracle_split_directions_lose_only_gradients_or_only_parameter_copies(corpus):
    """The oracle split of issue R (docs/results.md, "N=64: where the loss comes from"):
    ``directions=("up",)`` loses gradient contributions only, so after every step every replica is the
    owners' values (no stale copy), and the run is the ``retrieve`` run with both directions loss for
    loss (its lost copies are resent within the step; the ``up`` streams are the same draws);
    ``directions=("param",)`` loses parameter copies only: every chunk of every reduce counts all N."""
    cfg = replace(quick_config(), steps=8)
    n, p = 8, 0.3
    up = SimulatedRun(RunSpec("up", "renorm", p, 3, 1), cfg, n, directions=("up",), corpus=corpus)
    for _ in range(cfg.steps):
        up.step()
        owners = up.owned.detach().numpy()
        assert np.array_equal(up.replicas.numpy()[:, : up.numel], np.broadcast_to(owners, (n, up.numel)))
        assert (up.last_round[0].count < n).any()  # gradients are lost
    spec = RunSpec("r", "renorm", p, 3, 1, mechanism="retrieve")
    a = run_simulated(RunSpec("up", "renorm", p, 3, 1), cfg, n, directions=("up",), corpus=corpus)
    b = run_simulated(spec, cfg, n, directions=("up", "param"), corpus=corpus)
    assert a.worker_curves == b.worker_curves and a.val_loss == b.val_loss
    assert a.grad_loss_seen == b.grad_loss_seen > 0 and a.param_loss_seen == b.param_loss_seen == 0.0
    assert sum(w["stats"]["exchange"]["resend_requests"] for w in b.workers) > 0

    par = SimulatedRun(RunSpec("param", "renorm", p, 3, 1), cfg, n, directions=("param",), corpus=corpus)
    stale = 0
    for _ in range(cfg.steps):
        par.step()
        assert (par.last_round[0].count == n).all()  # every contribution of every chunk counted
        stale += int((par.age > 0).sum())
    assert stale > 0
    r = run_simulated(RunSpec("param", "renorm", p, 3, 1), cfg, n, directions=("param",), corpus=corpus)
    assert r.grad_loss_seen == 0.0
    copies = sum(w["stats"]["exchange"]["chunks_expected"] for w in r.workers)
    assert abs(r.param_loss_seen - p) < 5 * math.sqrt(p * (1 - p) / copies)


@pytest.mark.parametrize("mechanism,bound", [("stale1", 1), ("stale2", 2)])
def test_tight_staleness_bounds_every_copy_and_costs_resends(corpus, mechanism, bound):
    cfg = replace(quick_config(), steps=10)
    assert cfg.stale_bound > bound  # the mechanism, not the config, sets S
    spec = RunSpec("s", "renorm", 0.3, 0, 1, mechanism=mechanism)
    run = SimulatedRun(spec, cfg, 8, directions=("param",), corpus=corpus)
    for _ in range(cfg.steps):
        run.step()
        assert run.age.max() <= bound + 1
    assert run.counters["max_age_seen"].max() == bound + 1
    assert run.counters["resend_requests"].sum() > 0 and run.counters["resends_served"].sum() > 0
    stats = run.worker_stats()[0]["stats"]
    assert stats["stale"]["bound"] == bound and stats["feedback"] is False


def test_unknown_mechanism_is_refused(corpus):
    from lta.train.experiment import MECHANISMS, mechanism_settings

    cfg = quick_config()
    with pytest.raises(ValueError, match="none, feedback, stale1, stale2, retrieve"):
        SimulatedRun(RunSpec("x", "renorm", 0.1, 0, 1, mechanism="magic"), cfg, 4, corpus=corpus)
    settings = [mechanism_settings(m, cfg) for m in MECHANISMS]
    assert [(s.feedback, s.stale_bound, s.retrieve, s.rotate) for s in settings] == [
        (False, cfg.stale_bound, False, False),
        (True, cfg.stale_bound, False, False),
        (False, 1, False, False),
        (False, 2, False, False),
        (False, cfg.stale_bound, True, False),
        (False, cfg.stale_bound, False, True),
    ]


@pytest.mark.parametrize(
    "name,why",
    [
        ("retrieve+stale1", "no copy to bound"),
        ("stale1+stale2", "same bound"),
        ("feedback+rotate", "feedback does not combine with rotate"),
        ("retrieve+retrieve", "named twice"),
        ("none+retrieve", "'none' is combined"),
        ("retrieve+magic", "or a '\\+' combination"),
    ],
)
def test_a_combination_that_cannot_run_is_refused_with_its_reason(corpus, name, why):
    cfg = quick_config()
    with pytest.raises(ValueError, match=why):
        SimulatedRun(RunSpec("x", "renorm", 0.1, 0, 1, mechanism=name), cfg, 4, corpus=corpus)


def test_a_combination_sets_each_of_its_parts(corpus):
    """``retrieve+feedback``: the retrieve part leaves no copy stale and resends each lost copy; the
    feedback part carries residuals and divides by N; ``stale1+rotate`` bounds at 1 and rotates."""
    from lta.train.experiment import aggregation, mechanism_settings

    cfg = replace(quick_config(), steps=6)
    s = mechanism_settings("stale1+rotate", cfg)
    assert (s.feedback, s.stale_bound, s.retrieve, s.rotate) == (False, 1, False, True)
    s = mechanism_settings("feedback+retrieve", cfg)
    assert (s.feedback, s.stale_bound, s.retrieve, s.rotate) == (True, cfg.stale_bound, True, False)
    spec = RunSpec("rf", "renorm", 0.3, 0, 1, mechanism="retrieve+feedback")
    assert aggregation(spec) == "zero"
    run = SimulatedRun(spec, cfg, 8, corpus=corpus)
    for _ in range(cfg.steps):
        run.step()
        owners = run.owned.detach().numpy()  # retrieve: every replica holds the owners' values
        assert np.array_equal(run.replicas.numpy()[:, : run.numel], np.broadcast_to(owners, (8, run.numel)))
    assert run.feedback is not None and run.feedback.carried.any()
    assert run.counters["resend_requests"].sum() > 0 and run.counters["max_age_seen"].max() == 0
