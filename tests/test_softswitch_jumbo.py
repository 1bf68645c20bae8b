"""SoftSwitch.process_batch with big rows against the per-packet reference SoftSwitch.process.

Rows of at least ``softswitch.batch._ROW_LOOP_BYTES`` (K >= 1024: MTU 9000, loopback's 64 KiB datagrams)
take their own code: payloads stay big-endian views of the receive buffer, plain rounds are added straight
into the slots one row at a time, replicas are copied row by row. The same seeded sequences as in
tests/test_softswitch_batch.py run through it (with the threshold lowered so that every K takes it, and at
real jumbo sizes); emitted packets, counters, slot registers and drop streams must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from hostlib.dropmodels import DropPolicy
from softswitch import batch
from tests.test_softswitch_batch import (
    GE_PLAIN,
    MIXED,
    ROUND_SPECS,
    MixGenerator,
    RoundGenerator,
    Spec,
    _always_vectorized,  # noqa: F401 (autouse: every batch through the vectorized pass)
    assert_same,
    random_sizes,
    steady_stream,
)


@pytest.fixture
def big_rows(monkeypatch) -> dict[str, int]:
    """Every K takes the big-row code; counts the GRADs it added row by row (so a test can show it ran)."""
    monkeypatch.setattr(batch, "_ROW_LOOP_BYTES", 1)
    return count_row_adds(monkeypatch)


def count_row_adds(monkeypatch) -> dict[str, int]:
    seen = {"grads": 0}
    add_rows = batch._add_rows

    def counting(acc, payload, members, *args):
        seen["grads"] += len(members)
        assert payload.dtype == np.dtype(">i4")  # a view of the receive rows, not a converted copy
        return add_rows(acc, payload, members, *args)

    monkeypatch.setattr(batch, "_add_rows", counting)
    return seen


@pytest.fixture(params=["auto", "waves", "steps"])
def slot_path(request, monkeypatch) -> str:
    """As in test_softswitch_batch: as process_batch chooses, or forced through the vectorized waves
    only, or packet by packet only."""
    if request.param != "auto":
        monkeypatch.setattr(batch.BatchEngine, "_simple_groups", lambda self, job, order, *args: order)
        monkeypatch.setattr(batch, "_SMALL_WAVE", 0 if request.param == "waves" else 1 << 30)
    return request.param


@pytest.mark.parametrize("seed", range(3))
def test_random_mix_matches_per_packet_on_the_big_row_code(big_rows, slot_path, seed):
    packets = MixGenerator(MIXED, 300 + seed).packets(2500)
    rng = np.random.default_rng(400 + seed)
    final = assert_same(packets, MIXED, random_sizes(rng, len(packets)), seed)
    totals = {name: sum(c[name] for c in final["counters"]) for name in final["counters"][0]}
    assert all(totals.values()), {name: v for name, v in totals.items() if not v}
    assert (big_rows["grads"] > 0) == (slot_path == "auto")


@pytest.mark.parametrize("spec", ROUND_SPECS, ids=lambda spec: f"job{spec.job_id}")
def test_rounds_match_on_the_big_row_code(big_rows, spec):
    units, low, high = {1: (900, 8, 240), 2: (60, 16, 160), 3: (1400, 16, 700)}[spec.job_id]
    packets = RoundGenerator(spec, seed=10 + spec.job_id).packets(units)
    rng = np.random.default_rng(spec.job_id)
    final = assert_same(packets, [spec], random_sizes(rng, len(packets), low, high), 7)
    assert big_rows["grads"] > 100
    assert final["counters"][spec.job_id]["result_quorum"] > units // 5


@pytest.mark.parametrize(("n_workers", "k"), [(2, 16367), (4, 1024), (3, 2241)])
def test_jumbo_steady_state_matches(monkeypatch, n_workers, k):
    """Real jumbo packets (64 KiB at K=16367), batch sizes as a receive buffer of a few MiB holds."""
    seen = count_row_adds(monkeypatch)
    pool = 64
    stream = steady_stream(n_workers, k=k, pool=pool, units=3 * pool + 11, window=16, seed=k)
    specs = [Spec(1, [("10.1.0.1", 41000 + w) for w in range(n_workers)], pool=pool, k=k)]
    packets = [(data, specs[0].workers[w]) for data, w, _ in stream]
    final = assert_same(packets, specs, random_sizes(np.random.default_rng(k), len(packets), 1, 64), 0)
    c = final["counters"][1]
    assert c["result_quorum"] == 3 * pool + 11 and c["tx_packets"] == n_workers * c["result_quorum"]
    assert seen["grads"] > len(packets) // 2


def test_lossy_jumbo_stream_with_flushes_and_policies_matches(monkeypatch, slot_path):
    seen = count_row_adds(monkeypatch)
    n_workers, k, pool = 4, 4096, 32
    stream = steady_stream(n_workers, k=k, pool=pool, units=150, window=20, seed=5, loss=0.08)
    specs = [
        Spec(
            1,
            [("10.1.0.1", 41000 + w) for w in range(n_workers)],
            pool=pool,
            k=k,
            quorum=3,
            policies=[("up", DropPolicy(p=0.05), None), ("down", GE_PLAIN, None)],
        )
    ]
    packets = [(data, specs[0].workers[w]) for data, w, _ in stream]
    final = assert_same(packets, specs, random_sizes(np.random.default_rng(6), len(packets), 1, 96), 4)
    c = final["counters"][1]
    assert c["flush_partial"] and c["flush_resend"] and c["drop_policy_up"] and c["drop_policy_down"]
    assert (seen["grads"] > 0) == (slot_path == "auto")
