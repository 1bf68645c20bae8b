# Types of the optional C extension built from _codec.c (see setup.py); hostlib.codec is its only user.
import numpy as np

def quantize(
    chunks: np.ndarray,
    rows: np.ndarray | None,
    shifts: np.ndarray,
    limit: int,
    seed: int,
    out: np.ndarray,
    saturated: np.ndarray,
    /,
) -> None: ...
def dequantize(
    sums: np.ndarray,
    rows: np.ndarray | None,
    shifts: np.ndarray,
    divisors: np.ndarray | None,
    out: np.ndarray,
    out_rows: np.ndarray | None,
    /,
) -> None: ...
def maxabs(chunks: np.ndarray, out: np.ndarray, /) -> None: ...
def stage(
    local: np.ndarray | None,
    chunks: np.ndarray,
    n: int,
    scale: float,
    proposals: np.ndarray,
    empty_exp: int,
    nonfinite_exp: int,
    /,
) -> int: ...
