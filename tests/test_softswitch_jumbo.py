"""SoftSwitch.process_batch with big rows (K >= 1024: MTU 9000, loopback's 64 KiB datagrams) against the
per-packet reference SoftSwitch.process.

The same seeded sequences as in tests/test_softswitch_batch.py run at jumbo sizes, through the native engine
and through the fallback; emitted packets, counters, slot registers and drop streams must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from hostlib.emulation.dropmodels import DropPolicy
from tests.test_softswitch_batch import (
    GE_PLAIN,
    MIXED,
    MixGenerator,
    Spec,
    assert_same,
    random_sizes,
    slot_path,  # noqa: F401 (fixture: the native engine, then the fallback)
    steady_stream,
)


@pytest.mark.parametrize("seed", range(2))
def test_random_mix_with_jumbo_k(slot_path, seed):  # noqa: F811
    """The mix of every branch, with one job's K at 4096 beside the small ones."""
    last = MIXED[-1]
    specs = [*MIXED[:-1], Spec(last.job_id, last.workers, last.pool, 4096, last.quorum, last.policies)]
    packets = MixGenerator(specs, 300 + seed).packets(1500)
    rng = np.random.default_rng(400 + seed)
    assert_same(packets, specs, random_sizes(rng, len(packets)), seed)


@pytest.mark.parametrize(("n_workers", "k"), [(2, 16367), (4, 1024), (3, 2241)])
def test_jumbo_steady_state_matches(slot_path, n_workers, k):  # noqa: F811
    """Real jumbo packets (64 KiB at K=16367), batch sizes as a receive buffer of a few MiB holds."""
    pool = 64
    stream = steady_stream(n_workers, k=k, pool=pool, units=3 * pool + 11, window=16, seed=k)
    specs = [Spec(1, [("10.1.0.1", 41000 + w) for w in range(n_workers)], pool=pool, k=k)]
    packets = [(data, specs[0].workers[w]) for data, w, _ in stream]
    final = assert_same(packets, specs, random_sizes(np.random.default_rng(k), len(packets), 1, 64), 0)
    c = final["counters"][1]
    assert c["result_quorum"] == 3 * pool + 11 and c["tx_packets"] == n_workers * c["result_quorum"]


def test_lossy_jumbo_stream_with_flushes_and_policies_matches(slot_path):  # noqa: F811
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
