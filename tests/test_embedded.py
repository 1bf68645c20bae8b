"""The embedded softswitch (rank 0 without LTA_SWITCH) shares its process's GIL with training: while it
runs, the interpreter hands the GIL over every 0.5 ms instead of 5 ms, and gets its setting back on stop."""

from __future__ import annotations

import sys

import pytest

from hostlib.torch_ext.embedded import SWITCH_INTERVAL_S, EmbeddedSwitch


@pytest.mark.parametrize("before", [0.005, 0.0001])
def test_switch_interval_lowered_while_running_and_restored(before: float) -> None:
    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(before)
        switch = EmbeddedSwitch(0, ("127.0.0.1", 0))
        try:
            assert sys.getswitchinterval() == pytest.approx(
                min(before, SWITCH_INTERVAL_S), abs=2e-6
            )  # kept in µs
        finally:
            switch.stop()
        assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)
    finally:
        sys.setswitchinterval(saved)
