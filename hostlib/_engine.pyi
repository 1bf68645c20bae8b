# Types of the optional C extension built from _engine.c (see setup.py); hostlib.transport.native loads it.
from typing import Any

import numpy as np

def quantize_ahead(*args: Any) -> int: ...
def fast_flush(*args: Any) -> int: ...
def flush(*args: Any) -> tuple[int, int, int]: ...
def gather_rows(*args: Any) -> None: ...
def reuse_first(
    settled: np.ndarray, excused: np.ndarray, excused_to: np.ndarray, peers: np.ndarray, data_slots: int, /
) -> int: ...
def stall(*args: Any) -> int: ...
def peers_news(*args: Any) -> None: ...
def run(state: np.ndarray, exp_units: int, k: int, u0: int, hi: int, /) -> tuple[int, int]: ...
def scan(state: np.ndarray, low: int, next_unit: int, /) -> tuple[int, int, int]: ...
def due(
    state: np.ndarray,
    deadline_at: np.ndarray,
    low: int,
    next_unit: int,
    now: float,
    out: np.ndarray,
    proven_lost: np.ndarray = ...,
    flushes: np.ndarray = ...,
    strict: float = ...,
    /,
) -> tuple[int, float]: ...
def settle(
    data: np.ndarray, lens: np.ndarray, n: int, params: tuple[int, ...], now: float, /, *arrays: np.ndarray
) -> tuple[Any, ...]: ...

class Wake:
    """A steady wake-up of one reduce in a few calls (see hostlib/_engine.c)."""

    def send(
        self, low: int, next_unit: int, room: int, any_withheld: bool, /
    ) -> tuple[int, int, int, int, int, int]: ...
    def commit(
        self,
        u0: int,
        u1: int,
        low: int,
        now: float,
        arm_at: float,
        stall: tuple[int, int, float, bool],
        held: int,
        /,
    ) -> float: ...
    def after(
        self,
        results: bool,
        dead_bits: int,
        fast_flushed_to: int,
        low: int,
        next_unit: int,
        any_withheld: bool,
        now: float,
        others_wait_s: float,
        probe_at: float,
        resend_max: int,
        slack: float,
        /,
    ) -> tuple[int, int, int, int]: ...

def wake(*args: Any) -> Wake: ...
