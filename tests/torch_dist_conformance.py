"""torch's own distributed test base on a backend chosen by the environment: the harness that
tests/test_torch_conformance.py runs in a child pytest, once with BACKEND=gloo and once with BACKEND=lta.

This is torch's ``test/distributed/test_distributed_spawn.py`` in a few lines (that file is not in the
wheel): ``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase`` (which
is in the wheel) with torch's multi-process spawn fixture. The module reads BACKEND, WORLD_SIZE and
TEMP_DIR from the environment at import, as torch's does; "lta" reaches torch through the package's
``torch.backends`` entry point, with no LTA import here.

torch's decorators skip a test unless the backend is listed in ``DistTestCases.backend_feature`` (DDP,
sub-groups, plugins): "lta" is listed where gloo is, so it is asked to run every CPU test gloo runs.
"""

from __future__ import annotations

import os

if "BACKEND" not in os.environ:  # collected outside the harness: nothing to run
    import pytest

    pytest.skip(
        "run by tests/test_torch_conformance.py (needs BACKEND, WORLD_SIZE, TEMP_DIR)",
        allow_module_level=True,
    )

from torch.testing._internal.common_distributed import DistTestCases

for feature in ("ddp", "subgroup", "plugin"):
    DistTestCases.backend_feature[feature].add("lta")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

# torch skips some tests for any backend but gloo, by name (``require_backend_is_available({"gloo"})``,
# ``skip_but_pass_in_sandcastle_if(BACKEND != "gloo", ...)``: coalesced allreduce, sparse allreduce, batched
# send/recv, barrier timeouts, monitored_barrier). lta's reliable path is gloo, so it is asked to run every
# test gloo ran: LTA_CONFORMANCE_RUN names a file of test names (the ones gloo passed) whose
# decoration-time skip is lifted here.
_run = os.environ.get("LTA_CONFORMANCE_RUN")
if os.environ["BACKEND"] != "gloo" and _run:
    with open(_run) as _f:
        for _name in _f.read().split():
            _test = getattr(DistributedTest._DistTestBase, _name, None)
            if _test is not None and getattr(_test, "__unittest_skip__", False):
                _test.__unittest_skip__ = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        # fork (LTA_CONFORMANCE_START=fork, the default here): the ranks start without importing torch
        # again, a few seconds a test on a loaded machine; spawn is what torch's own runner uses.
        if os.environ.get("LTA_CONFORMANCE_START", "fork") == "fork":
            import torch.multiprocessing

            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()

    def run_test(self, test_name: str, parent_pipe) -> None:  # noqa: ANN001 (torch's signature)
        """torch's, then a note of how many reduces this rank's lta groups (the default one and those the
        test made) sent through the switch, so the caller can tell that the switch path was taken
        (LTA_CONFORMANCE_NOTES: a folder)."""
        super().run_test(test_name, parent_pipe)
        notes = os.environ.get("LTA_CONFORMANCE_NOTES")
        if not notes:
            return
        import torch.distributed as dist

        groups = list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []
        lossy = sum(getattr(group, "lossy_calls", 0) for group in groups)
        with open(os.path.join(notes, f"{test_name}.rank{self.rank}"), "w") as f:
            f.write(str(lossy))
