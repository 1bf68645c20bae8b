# Types of the optional C extension built from _batchio.c (see setup.py); hostlib.batchio is its only user.
import numpy as np

STAT_COUNT: int
MAX_VLEN: int
GSO_MAX_BYTES: int
GRO_BUF_BYTES: int

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
def send_gso(
    fd: int,
    data: np.ndarray,
    lens: np.ndarray | int,
    keys: np.ndarray | int,
    n: int,
    stall_ms: float,
    stats: np.ndarray,
    index: np.ndarray | None,
    max_segs: int,
    trains: np.ndarray | None = None,
    /,
) -> tuple[int, int]: ...
def recv_gro(
    fd: int,
    data: np.ndarray,
    lens_out: np.ndarray,
    keys_out: np.ndarray,
    max_n: int,
    timeout_ms: int,
    stats: np.ndarray,
    staging: np.ndarray,
    /,
) -> int: ...
def gro_staging_bytes(messages: int, /) -> int: ...
def gro_staging_init(buf: np.ndarray, messages: int, /) -> None: ...
def gro_pending(staging: np.ndarray, /) -> bool: ...
