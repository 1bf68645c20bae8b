# Types of the optional C extension built from _batchio.c (see setup.py); hostlib.batchio is its only user.
import numpy as np

STAT_COUNT: int
MAX_VLEN: int

def recv_batch(
    fd: int,
    data: np.ndarray,
    lens_out: np.ndarray,
    keys_out: np.ndarray,
    max_n: int,
    timeout_ms: int,
    stats: np.ndarray,
    scratch: np.ndarray,
    /,
) -> int: ...
def send_batch(
    fd: int,
    data: np.ndarray,
    lens: np.ndarray | int,
    keys: np.ndarray | int,
    n: int,
    stall_ms: float,
    stats: np.ndarray,
    /,
) -> int: ...
def scratch_bytes(n: int, /) -> int: ...
