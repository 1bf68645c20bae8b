"""Exact experiments under emulated loss (issue K): rounds close by the drop policy alone, never by a
timer; a lost exponent withholds a chunk whatever its values; the switch's param drops do not depend on
how senders interleave."""

from __future__ import annotations

import numpy as np
import pytest

from hostlib.emulation.dropmodels import DropPolicy
from hostlib.protocol import HEADER_BYTES, HEADER_DTYPE, VERSION, Op, batch_rows, empty_batch
from hostlib.transport import Fallback
from softswitch.batch import port_key
from softswitch.pipeline import JobConfig, SoftSwitch
from tests.conftest import check_mean_over_bitmap
from tests.test_softswitch_batch import pack

K = 64


def _inputs(rng: np.random.Generator, n: int, length: int, scale: list[float]) -> list[np.ndarray]:
    return [(rng.standard_normal(length) * scale[w]).astype(np.float32) for w in range(n)]


def test_a_lost_exponent_withholds_the_chunk_whatever_its_values(make_cluster):
    """Worker 1's values are a thousandth of the others': they always fit the agreed exponent, so the
    rule before issue K (withhold only what would exceed it) never withheld them. Now a worker whose own
    proposal was not counted withholds every chunk of that exponent unit, and sends nothing for it. (The
    exponent round's rule: speculated exponents are off here. A speculated chunk goes at its speculated
    exponent whatever the exponent round says, flagged where its values lie outside: test_speculate.py.)"""
    n, length = 3, 20 * K + 5
    cluster = make_cluster(
        n,
        elems_per_packet=K,
        exp_copies=1,
        seed=5,
        sync_deadline_ms=300,
        min_deadline_ms=50,
        speculate_bits=0,
    )
    # Worker 1 probes its exponent GRAD again on its RTO until the round closes, and a reduce's first
    # units wait max(sync deadline, RTO + give-up) before their FLUSH (Deadlines.sync_wait_s, ~1 s
    # here): at 40% loss a probe nearly always got through (0 withheld reduces in 12). At 90% every
    # probe of a reduce is lost now and then.
    cluster.switch.set_drop_policy(cluster.job_id, "up", DropPolicy(p=0.9), worker=1)
    rng = np.random.default_rng(1)
    withheld_reduces, reduces = 0, 0
    prev = None
    for step in range(12):  # until two withheld reduces were checked (each reduce costs ~2 s of timers)
        if withheld_reduces == 2:
            break
        reduces += 1
        inputs = _inputs(rng, n, length, [1.0, 1e-3, 1.0])
        results = cluster.reduce_all(inputs, step=step)
        mine = results[1]
        # worker 1's GRADs are lost 9 times in 10: most chunks short of it, some full
        expect = dict(full=(0, None), partial=(1, None), fallback=(0, None))
        if mine.withheld.any():  # it sent nothing: every chunk of every worker short of it
            expect = dict(full=0, partial=n * len(mine.count), fallback=0)
        assert check_mean_over_bitmap(results, inputs, K, prev=prev, **expect) > 0
        prev = [r.values for r in results]
        assert not results[0].withheld.any() and not results[2].withheld.any()  # no loss on their links
        if mine.withheld.any():
            withheld_reduces += 1
            assert mine.withheld.all()  # one exponent unit covers all 21 chunks: all or none
            for r in results:  # worker 1 sent nothing: it is in no bitmap
                assert not np.any(r.bitmap[r.fallback == Fallback.NONE] >> np.uint64(1) & np.uint64(1))
    # Measured: 9 of 12 reduces withheld (0 of 12 at 40% loss since the longer first wait); the loop
    # stops once two were.
    assert withheld_reduces == 2, (withheld_reduces, reduces)
    assert cluster.workers[1].stats.withheld_chunks == withheld_reduces * 21


def _exact_run(make_cluster, seed: int, loss: float, steps: int = 6) -> tuple[list[list], list]:
    """Four workers on a fresh switch, exact mode, up loss: every reduce's results, the transports' stats."""
    wait = 20_000
    cluster = make_cluster(
        4,
        up=loss,
        seed=seed,
        elems_per_packet=K,
        exact=True,
        sync_deadline_ms=wait,
        lag_deadline_ms=wait,
        min_deadline_ms=wait,
        max_deadline_ms=wait,
    )
    rng = np.random.default_rng(seed)
    outs: list[list] = []
    every = 4 * -(-(40 * K + 9) // K)
    for step in range(steps):
        inputs = _inputs(rng, 4, 40 * K + 9, [1.0, 3.0, 0.5, 2.0])
        results = cluster.reduce_all(inputs, step=step)
        # each GRAD lost with probability `loss` and no timer: short chunks every reduce at 25%
        expect = dict(full=every, partial=0, fallback=0) if loss == 0 else dict(partial=(1, None))
        prev = [r.values for r in outs[-1]] if outs else None
        expect = {"full": (0, None), "fallback": (0, None), **expect}
        assert check_mean_over_bitmap(results, inputs, K, prev=prev, **expect) > 0
        outs.append(results)
    return outs, [w.stats for w in cluster.workers]


def test_exact_rounds_close_by_the_drop_policy_alone(make_cluster):
    """With 20 s deadlines a timer could only fire after 20 s: the reduces finish (the fence shows every
    lost packet at once), no FLUSH is sent on a timer's word, the counts follow the loss law, and a
    second run with the same seed returns the same bits."""
    loss = 0.25
    first, stats = _exact_run(make_cluster, seed=3, loss=loss)
    again, _ = _exact_run(make_cluster, seed=3, loss=loss)
    for a_step, b_step in zip(first, again, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            assert np.array_equal(a.values, b.values)
            assert np.array_equal(a.bitmap, b.bitmap)
    assert all(s.flushes_on_timer == 0 for s in stats)
    assert sum(s.flushes_sent for s in stats) > 0  # lossy rounds were closed, by evidence
    counts = np.concatenate([step[0].count for step in first])
    # Each data GRAD is lost with probability `loss`, independently; exponents are spared (critical).
    frac = counts.mean() / 4
    sigma = np.sqrt(loss * (1 - loss) / (4 * counts.size))
    assert abs(frac - (1 - loss)) < 4 * sigma, frac
    assert all(s.withheld_chunks == 0 for s in stats)


def _param_packets(sender: int, chunks: range) -> list[bytes]:
    batch = empty_batch(len(chunks), K)
    batch["version"], batch["op"], batch["job_id"], batch["worker_id"] = VERSION, int(Op.PARAM), 1, sender
    batch["chunk"] = list(chunks)
    batch["nelem"] = K
    return [bytes(row) for row in batch_rows(batch)]


@pytest.mark.parametrize("batched", [False, True])
def test_param_drops_do_not_depend_on_how_senders_interleave(batched):
    """Each (receiver, sender) pair has its own drop stream: receivers lose the same copies whether the
    switch sees sender 0's broadcasts first, sender 1's first, or them alternating."""
    ports = [10, 11, 12]
    every = {(r, c) for s in (0, 1) for c in range(100 * s, 100 * s + 40) for r in range(3) if r != s}

    def lost(order: list[int]) -> set[tuple[int, int]]:
        sw = SoftSwitch(seed=9)
        sw.add_job(JobConfig(1, ports, elems_per_packet=K))
        sw.set_drop_policy(1, "param", DropPolicy(p=0.3))
        packets = {s: _param_packets(s, range(100 * s, 100 * s + 40)) for s in (0, 1)}
        taken = {0: 0, 1: 0}
        sequence = []
        for s in order:
            sequence.append((packets[s][taken[s]], ports[s]))
            taken[s] += 1
        if batched:
            out = sw.process_batch(*pack(sequence)).packets()
        else:
            out = [(port_key(e), bytes(p)) for data, port in sequence for e, p in sw.process(data, port)]
        got = set()
        for egress, data in out:
            hdr = np.frombuffer(data[:HEADER_BYTES], dtype=HEADER_DTYPE)[0]
            got.add((ports.index(egress), int(hdr["chunk"])))
        assert got <= every and 0 < len(every - got) < len(every)
        return every - got

    first = lost([0] * 40 + [1] * 40)
    assert first == lost([1] * 40 + [0] * 40)
    assert first == lost([0, 1] * 40)


@pytest.fixture(scope="module")
def quick_cluster():
    """``lta train --quick``'s 4 worker processes and softswitch at 20 steps, shared by the two tests below:
    a LocalCluster trains run after run (as a sweep does), and starting its workers costs more here than
    the runs."""
    from dataclasses import replace

    from lta.train.experiment import quick_config
    from lta.train.sweep import LocalCluster

    with LocalCluster(4, replace(quick_config(), steps=20)) as cluster:
        yield cluster


def test_lta_train_quick_is_exact_at_any_drop_rate(quick_cluster):
    """``lta train --quick``'s worker processes through the softswitch: at 0% nothing is lost; at 20% on
    gradients and parameters, two runs with the same seed and job id give every worker the same
    loss at every step, bit for bit, a run of another method loses exactly the same gradient packets, the loss
    the workers saw is the configured rate within sampling error, and no round closed by a timer."""
    from lta.train.experiment import RunSpec

    cluster = quick_cluster
    lossy = RunSpec("lossy", "renorm", 0.2, 4, 1)
    clean = cluster.run(RunSpec("clean", "renorm", 0.0, 4, 2), ("up", "param"))
    first = cluster.run(lossy, ("up", "param"))
    second = cluster.run(lossy, ("up", "param"))
    prev = cluster.run(RunSpec("prev", "prev", 0.2, 4, 1), ("up", "param"))  # one job id per seed
    assert first.worker_curves == second.worker_curves
    assert first.val_loss == second.val_loss
    # Another method of the same seed and job id (as lta train gives) meets the same gradient drops.
    for a, b in zip(first.workers, prev.workers, strict=True):
        for key in ("grad_chunks", "grad_contributions"):
            assert a["stats"][key] == b["stats"][key]
    for run, p in ((clean, 0.0), (first, 0.2)):
        stats = [w["stats"] for w in run.workers]
        assert all(w["transport"]["flushes_on_timer"] == 0 for w in run.workers)
        chunks = sum(s["grad_chunks"] for s in stats)
        seen = 1 - sum(s["grad_contributions"] for s in stats) / (4 * chunks)
        expected = sum(s["exchange"]["chunks_expected"] for s in stats)
        param_seen = 1 - sum(s["exchange"]["chunks_fresh"] for s in stats) / expected
        if p == 0:
            assert seen == 0 and param_seen == 0
            continue
        # Each contribution (4 per chunk) and each foreign copy is lost independently with p.
        assert abs(seen - p) < 4 * np.sqrt(p * (1 - p) / (4 * chunks)), seen
        assert abs(param_seen - p) < 4 * np.sqrt(p * (1 - p) / expected), param_seen


def test_retrieval_keeps_every_parameter_copy_fresh_at_one_resend_per_lost_copy(quick_cluster):
    """``--mechanism retrieve`` on worker processes at 30% param loss: no copy is ever stale (every
    foreign chunk is this step's at every step); the simulated receivers ask for each lost copy (30%),
    the real ones for at most that: an owner's resend reaches every receiver, so one that lost the same
    copy and had not asked yet gets it too."""
    from lta.train.experiment import RunSpec
    from lta.train.simulated import run_simulated

    p = 0.3
    cfg = quick_cluster.cfg  # 20 steps
    spec = RunSpec("retrieve", "renorm", p, 1, 1, mechanism="retrieve")
    real = quick_cluster.run(spec, ("param",))
    sim = run_simulated(spec, cfg, 8, directions=("param",))
    for run in (real, sim):
        stats = [w["stats"] for w in run.workers]
        expected = sum(s["exchange"]["chunks_expected"] for s in stats)
        asked = sum(s["exchange"]["resend_requests"] for s in stats)
        assert sum(s["exchange"]["chunks_fresh"] for s in stats) == expected
        assert all(s["stale"]["max_age_seen"] == 0 for s in stats)
        # Each copy is lost (and asked for) independently with p.
        sigma = 4 * np.sqrt(p * (1 - p) / expected)
        if run is sim:
            assert abs(asked / expected - p) < sigma, asked / expected
        else:
            assert 0 < asked / expected < p + sigma, asked / expected
    assert all(w["transport"]["flushes_on_timer"] == 0 for w in real.workers)
