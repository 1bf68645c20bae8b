"""Which engine path settles a batch: the Python reference or the native one (``hostlib/_engine.c``).

``LTA_ENGINE``: unset or ``auto`` takes ``native`` where the extension is built, ``python`` forces the
reference (``ReduceEngine._handle`` and what it calls), ``native`` insists on the extension. Both give the
same unit states, values, counts, bitmaps, samples and statistics on the same batches
(tests/test_engine_native.py); the native one does a batch in one pass over its rows.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from hostlib.extras import choose_path, optional_extension

native_ext: Any
native_ext, _MISSING = optional_extension("hostlib._engine")

ENGINE_PATHS = ("python", "native")
ENV_VAR = "LTA_ENGINE"
# TransportConfig.renormalize as the native code numbers it
RENORMALIZE_CODES = {"count": 0, "weight": 1, "none": 2}


def engine_path() -> str:
    """The path a new engine takes: ``"native"`` or ``"python"`` (see the module docstring). Raises
    ValueError for an unknown value, or for ``native`` where the extension is missing."""
    return _resolve(os.environ.get(ENV_VAR, "").strip())


@functools.lru_cache(maxsize=8)
def _resolve(requested: str) -> str:
    return choose_path(ENV_VAR, requested, ENGINE_PATHS, "native", _MISSING, "an engine path")
