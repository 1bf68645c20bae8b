"""``ReducePlan.reset`` stamps every packet row of a reused plan with this reduce's header: checked field by
field with the per-packet struct decoder (hostlib.protocol.HEADER_STRUCT), over resets that change the step,
the weight, the header and the base, and over ones that change nothing (reset skips rewriting fields that
did not change, so stale values would show here)."""

from __future__ import annotations

import numpy as np

from hostlib.protocol import HEADER_BYTES, HEADER_FIELDS, HEADER_STRUCT, VERSION, Op
from hostlib.transport.plan import ReducePlan

K, POOL = 8, 7
NAMES = [name for name, _ in HEADER_FIELDS]


def _decoded(rows: np.ndarray) -> list[dict[str, int]]:
    return [dict(zip(NAMES, HEADER_STRUCT.unpack(bytes(row[:HEADER_BYTES])), strict=True)) for row in rows]


def test_every_row_carries_the_reduce_s_header_after_each_reset():
    n = 21 * K + 3  # 22 chunks (the last one partial), 3 exponent units
    plan = ReducePlan(n, K)
    proposals = np.arange(plan.chunks_count, dtype=np.int32)
    resets = [
        (0, {"version": VERSION, "job_id": 5, "worker_id": 1, "step": 0}, 1),
        (plan.units, {"version": VERSION, "job_id": 5, "worker_id": 1, "step": 1}, 1),  # step only
        (2 * plan.units, {"version": VERSION, "job_id": 5, "worker_id": 1, "step": 1}, 1),  # nothing
        (3 * plan.units, {"version": VERSION, "job_id": 9, "worker_id": 2, "step": 7}, 4),  # all of it
        (4 * plan.units, {"version": VERSION, "job_id": 5, "worker_id": 1, "step": 8}, 1),  # and back
    ]
    for base, header, weight in resets:
        plan.reset(base, POOL, header, weight, proposals, 3)
        exp, data = _decoded(plan.exp_rows), _decoded(plan.data_rows)
        for u, h in enumerate(exp + data):
            g = base + u
            assert h["version"] == VERSION and h["op"] == int(Op.GRAD)
            assert (h["job_id"], h["worker_id"], h["step"]) == (
                header["job_id"],
                header["worker_id"],
                header["step"],
            )
            assert (h["slot"], h["seq"]) == (g % POOL, 2 * (g // POOL) + 1)
        for i, h in enumerate(exp):
            assert h["chunk"] == i and h["nelem"] == min(K, plan.chunks_count - K * i)
        for c, h in enumerate(data):
            assert h["chunk"] == c and h["nelem"] == min(K, n - K * c) and h["weight"] == weight
        assert data[-1]["nelem"] == 3


def test_owners_come_and_go_with_the_reduce_that_names_them():
    """A reduce with owners stamps each data row's count with its owner (docs/protocol.md, "Owner-only
    RESULT") and marks another worker's chunks; the next reduce without owners clears both (reset skips
    the rewrite only when neither reduce had owners)."""
    n = 5 * K
    plan = ReducePlan(n, K)
    proposals = np.zeros(plan.chunks_count, dtype=np.int32)
    header = {"version": VERSION, "job_id": 5, "worker_id": 1, "step": 0}
    owners = np.array([0, 1, -1, 2, 1])
    for base, given in enumerate([None, owners, None, None, owners, owners[::-1].copy(), None]):
        plan.reset(base * plan.units, POOL, header, 1, proposals, 3, owners=given, worker_id=1)
        counts = [h["count"] for h in _decoded(plan.data_rows)]
        if given is None:
            assert counts == [0] * 5 and not plan.any_owned and not plan.elsewhere.any()
        else:
            assert counts == [max(o, 0) for o in given]
            assert plan.elsewhere.tolist() == [o >= 0 and o != 1 for o in given] and plan.any_owned
        g = base * plan.units + np.arange(plan.units)
        assert plan.slots.tolist() == (g % POOL).tolist()
        assert plan.seqs.tolist() == (2 * (g // POOL) + 1).tolist()
