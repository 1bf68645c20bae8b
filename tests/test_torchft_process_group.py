"""torchft's own process-group tests (``torchft/process_group_test.py``, shipped in the torchft wheel) run on
an lta replica group (hostlib/torch_ext/ft.py): the collectives torchft's ``NormalGlooMultiPgTest`` runs on
gloo, three ranks (threads) sharing one store, each checked by torchft's own expectation.
``test_collective`` is in the default run; ``test_collective_with_resiliency`` (reconfigure, a rank shuts
down, the others must see an error, then recover) is marked slow: about 65 s more.

Both need torchft and parameterized (the dev extra); they skip where either is absent."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("parameterized", reason="torchft's tests need parameterized (the dev extra)")
pgt = pytest.importorskip(
    "torchft.process_group_test", reason="torchft is not installed (the dev extra; hostlib/torch_ext/ft.py)"
)

from parameterized import parameterized  # noqa: E402

from hostlib.torch_ext.ft import lta_replica_group  # noqa: E402

# What torchft runs on gloo (it skips the same three there: gloo has no reduce_scatter).
COLLECTIVES = sorted(set(pgt._ALL_COLLECTIVES) - set(pgt.NormalGlooMultiPgTest.SKIP))


class LtaMultiPg(pgt.MultiPgBaseTest):
    """torchft's multi-rank fixture with an lta replica group per rank (no tests of its own)."""

    BACKEND = "lta"
    WORLD_SIZE = 3

    @classmethod
    def _create_pg(cls, backend: str) -> Any:
        assert backend == "lta"
        return lta_replica_group(timeout=timedelta(seconds=10))


class TestLtaMultiPg(LtaMultiPg):
    @parameterized.expand(COLLECTIVES)
    def test_collective(self, collective: str) -> None:
        self._run_parallel(collective, device="cpu")


# allreduce and allreduce_coalesced wait out torchft's 30 s timeout after the fault (on gloo too).
@pytest.mark.slow
class TestLtaMultiPgResiliency(LtaMultiPg):
    @parameterized.expand(COLLECTIVES)
    def test_collective_with_resiliency(self, collective: str) -> None:
        self._run_with_resiliency(collective, device="cpu")


def test_the_selection_is_torchfts_gloo_selection() -> None:
    assert len(COLLECTIVES) == 8 and "allreduce" in COLLECTIVES and "allreduce_coalesced" in COLLECTIVES
