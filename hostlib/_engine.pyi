# Types of the optional C extension built from _engine.c (see setup.py); hostlib.transport.native loads it.
from typing import Any

import numpy as np

def settle(
    data: np.ndarray, lens: np.ndarray, n: int, params: tuple[int, ...], now: float, /, *arrays: np.ndarray
) -> tuple[Any, ...]: ...
