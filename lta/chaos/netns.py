"""A network namespace whose loopback reorders and duplicates UDP packets: the ``reorder`` and
``duplicate`` faults of a chaos run.

Every rank of the run is started inside the namespace (``ip netns exec``), so the embedded softswitch
(rank 0), the workers' sockets and gloo's TCP all talk over its private loopback; nothing outside it
changes. This kernel has no netem, so the faults are built from what it has:

- **reordering**: an nftables rule marks a random ``fraction`` of the UDP packets (``numgen random``)
  with priority 1:2; an HTB qdisc on ``lo`` sends class 1:2 through a slow class (``SLOW_RATE``) and
  everything else through a fast one, so a marked packet arrives after packets sent after it;
- **duplication**: an nftables ``dup to 127.0.0.1`` rule sends a second copy of a random ``fraction``.

Both apply to every UDP packet on the loopback (GRAD, FLUSH, RESULT, PARAM, heartbeats; both directions),
not to TCP. It needs root, ``ip``, ``tc`` (HTB) and ``nft``: :func:`available` says whether it can run.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

SLOW_RATE = "20mbit"  # the reordering class: a 300-byte packet waits ~0.1 ms per packet queued before it


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"chaos netns: {' '.join(cmd)} failed: {done.stderr.strip() or done.returncode}")


def available() -> str | None:
    """None when namespaces with the faults can be made here, else why not (one line). Root and the
    tools are not enough (an unprivileged container has both and no right to make a namespace): it
    makes one, sets its loopback up and removes it."""
    import os

    missing = [tool for tool in ("ip", "tc", "nft") if shutil.which(tool) is None]
    if missing:
        return f"no {', '.join(missing)} on PATH"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"ltaprobe-{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up")
    except RuntimeError as exc:
        return f"cannot make a network namespace here ({' '.join(str(exc).split())})"
    finally:
        delete(probe)
    return None


def create(name: str, faults: list[dict[str, Any]]) -> list[str]:
    """Make namespace ``name`` with the ``reorder``/``duplicate`` faults of ``faults`` on its loopback;
    returns the command prefix that starts a process inside it. Remove it with :func:`delete`."""
    _run("ip", "netns", "add", name)
    try:
        inside = ["ip", "netns", "exec", name]
        _run(*inside, "ip", "link", "set", "lo", "up")
        rules = []
        for f in faults:
            percent = max(1, round(100 * float(f["fraction"])))
            if f["kind"] == "reorder":
                tc = [*inside, "tc"]
                _run(*tc, *"qdisc add dev lo root handle 1: htb default 1 r2q 100000".split())
                _run(*tc, *"class add dev lo parent 1: classid 1:1 htb rate 10gbit".split())
                slow = f"class add dev lo parent 1: classid 1:2 htb rate {SLOW_RATE} ceil {SLOW_RATE}"
                _run(*tc, *slow.split())
                rules.append(f"meta l4proto udp numgen random mod 100 < {percent} meta priority set 1:2")
            elif f["kind"] == "duplicate":
                rules.append(f"meta l4proto udp numgen random mod 100 < {percent} dup to 127.0.0.1")
        if rules:
            _run(*inside, "nft", "add", "table", "ip", "chaos")
            _run(*inside, "nft", "add", "chain", "ip", "chaos", "out",
                 "{ type filter hook output priority 0; }")  # fmt: skip
            for rule in rules:
                _run(*inside, "nft", "add", "rule", "ip", "chaos", "out", *rule.split())
        return inside
    except BaseException:
        delete(name)
        raise


def delete(name: str) -> None:
    """Remove namespace ``name`` (its processes must have exited); no error when it is gone."""
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
