"""What every ``--json`` output of ``lta`` is: exactly one JSON document on stdout, led by

- ``schema``: what the document is and its version, ``"lta.<command>/<n>"`` (``"lta.bench.allreduce/1"``);
  a reader checks it before anything else;
- ``lta_version`` and ``torch_version`` (``null`` where torch is not installed): the versions measured.

The versions come from the installed packages' metadata, so neither ``--json`` nor ``lta --version``
imports torch.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from importlib import metadata
from typing import IO, Any

from hostlib.errors import LtaError

RESERVED = ("schema", "lta_version", "torch_version")


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None if it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def lta_version() -> str:
    """This package's version; "unknown" when run from a tree that was never installed."""
    return package_version("lta") or "unknown"


def version_line() -> str:
    """``lta 0.1.0 (torch 2.5.1, numpy 2.1.3, python 3.11.9)``: what ``lta --version`` prints."""
    torch = package_version("torch")
    numpy = package_version("numpy")
    parts = [
        f"torch {torch}" if torch else "torch not installed",
        f"numpy {numpy}" if numpy else "numpy not installed",
        f"python {sys.version.split()[0]}",
    ]
    return f"lta {lta_version()} ({', '.join(parts)})"


def document(schema: str, content: Mapping[str, Any]) -> dict[str, Any]:
    """``content`` under the common header. ``content`` must not use the header's keys itself."""
    clash = [key for key in RESERVED if key in content]
    if clash:
        raise ValueError(f"content may not set {clash}: the header owns them")
    header = {"schema": schema, "lta_version": lta_version(), "torch_version": package_version("torch")}
    return header | dict(content)


def emit(
    schema: str, content: Mapping[str, Any], *, indent: int | None = None, out: IO[str] | None = None
) -> None:
    """Write ``document(schema, content)`` to stdout (or ``out``) as one JSON document and a newline.

    Values json cannot encode (paths, namespaces' odd members) are written as their ``str``."""
    text = json.dumps(document(schema, content), indent=indent, default=str)
    stream = out or sys.stdout
    try:
        stream.write(text + "\n")
        stream.flush()
    except BrokenPipeError:
        raise  # the reader left: lta's main exits quietly (EXIT_BROKEN_PIPE)
    except OSError as exc:  # e.g. > /dev/full, a full disk
        raise LtaError(f"cannot write the JSON document: {exc.strerror or exc}") from None
