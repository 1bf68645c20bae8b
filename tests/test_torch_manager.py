"""LtaManager, the one owner of a rank's state in the torch layer (hostlib/torch_ext/manager.py), and the
wrappers over it, with an autospec'd worker (no sockets: milliseconds). What the manager counts is checked
against numpy over hand-built per-chunk results."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from hostlib.ps.client import PsClient
from hostlib.torch_ext import lta_stats, should_commit
from hostlib.torch_ext.ddp_hook import LtaHookState
from hostlib.torch_ext.manager import MAX_TRANSIENT_MIRRORS, LtaManager
from hostlib.torch_ext.rendezvous import LtaSession
from hostlib.torch_ext.sharded import ShardedOptimizer
from hostlib.transport import Fallback, LtaWorker, ReduceResult, TransportConfig, TransportStats

N, K = 4, 8


def _result(values: np.ndarray, count: np.ndarray, critical: np.ndarray | None = None) -> ReduceResult:
    chunks = len(count)
    fallback = np.where(count == 0, int(Fallback.PREV), int(Fallback.NONE))
    return ReduceResult(
        values=values.astype(np.float32),
        count=count,
        bitmap=np.zeros(chunks, dtype=np.uint64),
        fallback=fallback,
        withheld=np.zeros(chunks, dtype=bool),
        saturated=np.zeros(chunks, dtype=bool),
        shift=np.zeros(chunks, dtype=np.int32),
        elapsed_s=0.0,
        critical=np.zeros(chunks, dtype=bool) if critical is None else critical,
    )


def _worker(counts: list[np.ndarray], rank: int = 0) -> mock.MagicMock:
    """A worker whose successive allreduces return the mean it was given and the given counts."""
    worker = mock.create_autospec(LtaWorker, instance=True)
    worker.n_workers, worker.worker_id = N, rank
    worker.config = TransportConfig(elems_per_packet=K)
    worker.stats = TransportStats()
    worker.healthy, worker.last_nothing_fraction = True, 0.0
    worker.unhealthy_since_mark.return_value = False
    # Instance attributes autospec cannot see, which a door's Healer (heal.py) uses: never behind here
    worker.health, worker.engine = mock.Mock(behind=False), mock.Mock()
    worker.heal_requests, worker.heal_inbox = set(), {}  # no peer asks, none sent a state
    replies = iter(counts)

    def allreduce(x, *, step=0, key=None, weight=1, critical=None, out=None, owners=None, scale=1.0):  # noqa: ANN001, ANN202
        values = np.asarray(x, dtype=np.float32).reshape(-1) * np.float32(scale)
        if out is not None:
            out[...] = values
        mask = np.zeros(-(-values.size // K), dtype=bool)
        if critical is not None:
            for lo, hi in critical:
                mask[lo // K : -(-hi // K)] = True
        return _result(values, next(replies), mask)

    worker.allreduce.side_effect = allreduce
    return worker


def test_counts_per_stream_match_numpy_over_the_chunks_used() -> None:
    counts = [np.array([4, 3, 0, 4, 1]), np.array([2, 4, 4, 0, 4])]
    manager = LtaManager(_worker(counts))
    x = np.arange(5 * K, dtype=np.float32)
    manager.allreduce(x, stream="a", key="k")
    manager.allreduce(x, stream="a", key="k", mine=(1, 4))  # chunks 1..3 only
    row = manager.streams["a"]
    used = np.concatenate([counts[0], counts[1][1:4]])
    assert row.reduces == 2 and manager.reduces == 2
    assert row.chunks == used.size
    assert row.contributions == used.sum()
    assert row.chunks_full == np.sum(used == N)
    assert row.chunks_partial == np.sum((used > 0) & (used < N))
    assert row.chunks_fallback == np.sum(used == 0)
    stats = manager.collective_stats()["a"]
    assert stats["loss_seen"] == pytest.approx(1 - used.sum() / (N * used.size))
    # the transport's step defaults to the reduce counter
    steps = [c.kwargs["step"] for c in manager.worker.allreduce.call_args_list]
    assert steps == [0, 1]


def test_mirror_is_reused_for_the_same_tensor_and_rebuilt_for_another() -> None:
    manager = LtaManager(_worker([]))
    a = torch.zeros(16)
    m1 = manager.mirror("x", a)
    assert manager.mirror("x", a) is m1
    assert manager.mirror("x", torch.zeros(16)) is not m1  # other memory under the same key
    assert not m1.staged and np.shares_memory(m1.array, a.numpy())  # CPU float32: no copy
    # transient: unstaged mirrors are not kept, staged ones are bounded
    manager.mirror(("t", 0), a, transient=True)
    assert manager.staging_buffers == 1
    tensors = [torch.zeros(4, dtype=torch.float64) for _ in range(MAX_TRANSIENT_MIRRORS + 3)]
    for i, t in enumerate(tensors):
        manager.mirror(("t", i), t, transient=True)
    assert 1 < manager.staging_buffers <= 1 + MAX_TRANSIENT_MIRRORS


def test_hook_state_is_a_view_of_its_manager() -> None:
    counts = [np.array([4, 2]), np.array([0, 4]), np.array([4, 4])]
    manager = LtaManager(_worker(counts))
    state = LtaHookState(manager)
    assert state.manager is manager and state.worker is manager.worker
    for index, is_last in ((0, False), (1, True), (0, False)):
        buffer = torch.arange(2 * K, dtype=torch.float32)
        state.reduce_bucket(index, buffer, is_last, critical=[(0, K)])
    st = state.stats
    assert (st.steps, st.buckets, state.step, manager.step) == (1, 3, 1, 1)
    assert (st.chunks, st.chunks_full, st.chunks_partial, st.chunks_fallback) == (6, 4, 1, 1)
    assert (st.chunks_critical, st.chunks_critical_full) == (3, 2)  # chunk 0 of each: counts 4, 0, 4
    # the transport's step is the training step: 0, 0 (same step), then 1
    assert [c.kwargs["step"] for c in manager.worker.allreduce.call_args_list] == [0, 0, 1]
    assert lta_stats(state)["collectives"]["ddp"]["chunks"] == 6
    assert should_commit(state) is True


def test_hook_given_a_worker_makes_its_own_manager() -> None:
    worker = _worker([np.array([4])])
    state = LtaHookState(worker)
    assert isinstance(state.manager, LtaManager) and state.worker is worker
    state.reduce_bucket(0, torch.ones(K), True)
    assert state.stats.buckets == 1


def test_sharded_optimizer_counters_and_step_live_in_the_manager() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)  # 28 parameters: 4 chunks of K=8, one per worker
    counts = [np.array([4, 3, 2, 0]), np.array([1, 4, 4, 4])]
    worker = _worker(counts, rank=1)
    worker.param_inbox = mock.MagicMock()
    with mock.patch("hostlib.torch_ext.sharded.ParamExchange") as exchange:
        exchange.return_value.changed = False
        opt = ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), worker)
        manager = opt.manager
        assert opt._own_chunks == (1, 2)  # rank 1 of 4 owns chunk 1
        for _ in range(2):
            model(torch.ones(2, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
    # only chunk 1 (this shard) counts: counts 3 then 4
    assert (opt.grad_chunks, opt.grad_contributions, opt.grad_chunks_partial) == (2, 7, 1)
    assert opt.lta_step == manager.step == 2
    opt.lta_step = 7  # what load_state_dict and adopt do
    assert manager.step == 7
    state = opt.state_dict()
    assert state["lta_step"] == 7 and state["counters"]["grad_contributions"] == 7
    assert manager.staging_buffers == 3  # flat parameters, gradients, reduced values


def test_a_session_manager_closes_session_once_and_ps_manager_has_no_worker() -> None:
    worker = _worker([])
    session = mock.create_autospec(LtaSession, instance=True)
    session.worker = worker
    manager = LtaManager(session)
    assert manager.worker is worker and manager.session is session
    manager.close()
    manager.close()
    session.close.assert_called_once_with()
    client = mock.create_autospec(PsClient, instance=True)
    client.version, client.worker_id = 3, 2
    client.stats = mock.MagicMock()
    client.stats.as_dict.return_value = {"pushes": 5}
    ps = LtaManager(client)
    assert ps.ps_client is client and not ps.has_worker and ps.rank == 2
    with pytest.raises(TypeError, match="parameter server"):
        ps.worker  # noqa: B018
    assert lta_stats(ps) == {"step": 0, "version": 3, "pushes": 5}
    with pytest.raises(TypeError, match="LtaWorker, an LtaSession or a PsClient"):
        LtaManager(object())  # type: ignore[arg-type]
