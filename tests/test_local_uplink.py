"""A worker in the softswitch's own process hands its packets to the pipeline by a call
(``SoftSwitchServer.local_port``), not through the kernel: a self-hosted rank 0 does by default.

The packets are the same packets: against a worker that sends the same inputs through its socket, with the
same seeded loss on the way up in exact mode (rounds close by the drop decisions alone), every reduce returns
the same bits (values, counts, bitmaps), and both match numpy's mean over the arrived contributions."""

from __future__ import annotations

import numpy as np

from hostlib.batchio import addr_key
from tests.conftest import check_mean_over_bitmap
from tests.ranks import join_in_threads

K = 256
WAIT_MS = 20_000  # exact mode: no timer closes a round in a test's lifetime


def _run(make_cluster, by_call: bool, steps: int = 4) -> tuple[list, object]:
    cluster = make_cluster(
        3,
        up=0.25,
        seed=5,
        elems_per_packet=K,
        exact=True,
        sync_deadline_ms=WAIT_MS,
        lag_deadline_ms=WAIT_MS,
        min_deadline_ms=WAIT_MS,
        max_deadline_ms=WAIT_MS,
    )
    if by_call:
        first = cluster.workers[0]
        first.send_by_call(cluster.server.local_port(addr_key(first.address)))
        assert first.io.mode.startswith("local+")
    rng = np.random.default_rng(11)
    outs = []
    for step in range(steps):
        inputs = [rng.standard_normal(40 * K + 9).astype(np.float32) * s for s in (1.0, 2.0, 0.5)]
        results = cluster.reduce_all(inputs, step=step)
        prev = [r.values for r in outs[-1][1]] if outs else None
        short = check_mean_over_bitmap(
            results, inputs, K, full=(0, None), partial=(0, None), fallback=(0, None), prev=prev
        )
        assert short > 0
        outs.append((inputs, results))
    return outs, cluster


def test_packets_by_call_reduce_to_the_same_bits_as_packets_through_the_socket(make_cluster) -> None:
    through_socket, _ = _run(make_cluster, by_call=False)  # each on a switch of its own, same seed
    by_call, cluster = _run(make_cluster, by_call=True)
    for (_, a), (_, b) in zip(through_socket, by_call, strict=True):
        for ra, rb in zip(a, b, strict=True):
            assert np.array_equal(ra.count, rb.count)
            assert np.array_equal(ra.bitmap, rb.bitmap)
            assert np.array_equal(ra.values, rb.values, equal_nan=True)
    # every packet worker 0 sent went in by the call; the loss hit them as it hits packets from a socket
    assert cluster.server.local_datagrams == cluster.workers[0].stats.packets_sent > 0
    assert any((r.bitmap & 1 == 0).any() for _, rs in by_call for r in rs)


def test_a_self_hosted_rank_0_sends_by_call_unless_told_not_to() -> None:
    from hostlib.torch_ext.rendezvous import LtaOptions
    from hostlib.transport import TransportConfig
    from tests.conftest import run_workers

    transport = TransportConfig(elems_per_packet=K, health_timeout_s=2.0)
    for job_id, local in ((11, True), (12, False)):
        sessions = join_in_threads(2, LtaOptions(job_id=job_id, transport=transport, local_uplink=local))
        try:
            modes = [s.worker.io.mode for s in sessions]
            assert modes[0].startswith("local+") == local and not modes[1].startswith("local+")
            rng = np.random.default_rng(job_id)
            x = [rng.standard_normal(30 * K + 3).astype(np.float32) for _ in range(2)]
            results = run_workers([s.worker for s in sessions], lambda w, i, x=x: w.allreduce(x[i]))
            check_mean_over_bitmap(results, x, K, full=(30 + 1, None), partial=0, fallback=0)
            server = sessions[0].embedded.server
            sent = sessions[0].worker.stats.packets_sent  # the join's probe and the reduce's packets
            assert server.local_datagrams == (sent if local else 0)
        finally:
            for s in sessions:
                s.close()


def test_a_stopped_switch_takes_nothing_by_call() -> None:
    from softswitch.pipeline import SoftSwitch
    from softswitch.server import SoftSwitchServer

    server = SoftSwitchServer(SoftSwitch()).start()
    deliver = server.local_port(addr_key(("127.0.0.1", 40000)))
    rows = np.zeros((3, 64), dtype=np.uint8)  # malformed for any job: counted, not answered
    assert deliver(rows) == 3
    server.stop()
    assert deliver(rows) == 0
    assert server.local_datagrams == 3
