"""Make Debian's Mininet importable from the project's Python.

Debian installs Mininet (pure Python, standard library only, plus the ``mnexec`` binary) for
``/usr/bin/python3`` in ``/usr/lib/python3/dist-packages``. Rather than run the project under the
system interpreter, :func:`import_mininet` loads just the ``mininet`` package from there into the
current interpreter (the venv's), without putting the rest of Debian's site-packages on ``sys.path``,
so numpy, torch and grpc stay the venv's. ``apt-get install -y mininet`` (or
``mininet_topos/setup_deps.sh`` as root) provides it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

DEBIAN_DIST_PACKAGES = Path("/usr/lib/python3/dist-packages")


class MininetUnavailable(RuntimeError):
    """Mininet cannot run here; the message says what to install or change."""


def import_mininet() -> ModuleType:
    """The ``mininet`` package: the importable one, else Debian's. Raises :class:`MininetUnavailable`."""
    if "mininet" not in sys.modules:
        try:
            import mininet  # noqa: F401  (a pip-installed Mininet wins)
        except ModuleNotFoundError:
            spec = importlib.machinery.PathFinder.find_spec("mininet", [str(DEBIAN_DIST_PACKAGES)])
            if spec is None or spec.loader is None:
                raise MininetUnavailable(
                    "Mininet is not installed: as root run `apt-get install -y mininet bridge-utils` "
                    "(or mininet_topos/setup_deps.sh)"
                ) from None
            module = importlib.util.module_from_spec(spec)
            sys.modules["mininet"] = module
            spec.loader.exec_module(module)
    return sys.modules["mininet"]


def mininet_problem() -> str | None:
    """Why Mininet cannot run here (not root, package or tools missing), or None if it can."""
    if os.geteuid() != 0:
        return "Mininet needs root"
    try:
        import_mininet()
    except MininetUnavailable as exc:
        return str(exc)
    missing = [tool for tool in ("mnexec", "brctl", "ifconfig", "tc", "nft", "ip") if not shutil.which(tool)]
    if missing:
        return f"missing {', '.join(missing)}: apt-get install -y mininet bridge-utils nftables iproute2"
    return None


def init_mininet_quietly() -> None:
    """Mark Mininet initialised without its ``fixLimits()``, which raises global sysctls (buffer sizes,
    ARP cache, PTYs) of the whole machine: not ours to change on a shared host, and not needed here."""
    import_mininet()
    from mininet.net import Mininet
    from mininet.util import ensureRoot

    ensureRoot()
    Mininet.inited = True
