"""Lost RESULTs (issue 22): a worker that lost the RESULT of a round gets the switch's stored copy back
(its FLUSH or GRAD is answered with a unicast resend), so every worker ends a reduce with the same
aggregate; no peer moves the slot to its next round while that copy may still be asked for."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import check_mean_over_bitmap

K = 16


@pytest.mark.parametrize("n", [2, 3])
def test_lost_results_are_recovered_before_their_slot_moves_on(make_cluster, n):
    """Down loss only, a pool of 15 data slots (every slot carries a new round every 15 units): each
    worker loses a fifth of its RESULT replicas. Every chunk must come back on every worker (none falls
    back), the same RESULT on all of them (count, bitmap and values identical), and equal to numpy's mean
    over its bitmap. Before the fix a peer's next GRAD for the slot often reached the switch before the
    lossy worker's FLUSH, which was then stale: the chunk was lost for good (units_overtaken)."""
    cluster = make_cluster(
        n,
        down=0.2,
        seed=7,
        elems_per_packet=K,
        pool_size=16,
        exact=True,
        # Long waits for late peers (threads on a loaded machine): recovery must not depend on timers.
        sync_deadline_ms=5000,
        lag_deadline_ms=5000,
        min_deadline_ms=300,
        max_deadline_ms=2000,
    )
    rng = np.random.default_rng(n)
    for step in range(3):
        inputs = [rng.standard_normal(100 * K + 3).astype(np.float32) for _ in range(n)]
        results = cluster.reduce_all(inputs, step=step)
        for r in results:
            assert np.all(r.count > 0), f"step {step}: {np.count_nonzero(r.count == 0)} chunks without RESULT"
        for r in results[1:]:
            np.testing.assert_array_equal(r.count, results[0].count)
            np.testing.assert_array_equal(r.bitmap, results[0].bitmap)
            np.testing.assert_array_equal(r.values, results[0].values)
        assert check_mean_over_bitmap(results, inputs, K) == n * 101
    stats = [w.stats for w in cluster.workers]
    assert sum(s.units_overtaken for s in stats) == 0
    assert sum(s.results_retx for s in stats) > 0  # RESULTs were lost and resent
    assert cluster.switch.read_counters(cluster.job_id)["flush_stale"] == 0
