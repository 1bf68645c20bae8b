"""The Mininet demo end to end: topologies with the LTA switch programmed over P4Runtime, links that
really lose packets, results checked by every worker, counters that add up, nothing left behind.
Needs root and Debian's mininet (mininet_topos/setup_deps.sh); BMv2 cases also need BMv2."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from lta.mininet_demo import DemoConfig, DemoReport, problem, root_links, run_demo

_SOFT_PROBLEM = problem(DemoConfig(switch="softswitch"))
_BMV2_PROBLEM = _SOFT_PROBLEM or problem(DemoConfig(switch="bmv2"))

pytestmark = pytest.mark.mininet
needs_mininet = pytest.mark.skipif(_SOFT_PROBLEM is not None, reason=_SOFT_PROBLEM or "")
needs_bmv2 = pytest.mark.skipif(_BMV2_PROBLEM is not None, reason=_BMV2_PROBLEM or "")
Z = 4.42  # two-sided 1e-5


def _check_demo(report: DemoReport, loss: float, switch_queues_may_drop: bool = False) -> None:
    assert report.ok, report.to_json()
    for worker in report.workers:
        assert worker["rounds"] == report.config.rounds and worker["chunks_checked"] > 0
        # Every renormalized chunk equals the mean of the contributors the switch named.
        assert worker["worst_error_over_tolerance"] < 1.0
        assert worker["chunks"]["full"] > 0
    links = list(report.links.values())
    assert len(links) == report.config.hosts
    # The switch counted exactly what the links delivered, and the links carried exactly what it sent.
    counters = report.switch_counters
    delivered = sum(link.seen_up - link.dropped_up for link in links)
    if switch_queues_may_drop:
        # BMv2 drops what it cannot process in its own input queues (about 6k packets/s here, see
        # p4/bench_bmv2.py) before the pipeline, so its counters see at most what the links delivered.
        assert 0 < counters["rx_packets"] <= delivered
    else:
        assert counters["rx_packets"] == delivered
    assert counters["tx_packets"] == sum(link.seen_down for link in links)
    assert counters["drop_bad_worker"] == 0 and counters["drop_malformed"] == 0
    # The kernel dropped the configured fraction of what the links carried.
    seen = sum(link.seen_up + link.seen_down for link in links)
    dropped = sum(link.dropped_up + link.dropped_down for link in links)
    half = Z * math.sqrt(seen * loss * (1 - loss))
    assert seen * loss - half <= dropped <= seen * loss + half, f"{dropped}/{seen} dropped, rule {loss}"
    assert report.leftovers == []


@needs_mininet
def test_star_softswitch_reduces_over_lossy_links() -> None:
    report = run_demo(DemoConfig(switch="softswitch", topo="star", hosts=3, loss=0.02, rounds=5, elems=8192),
                      log=lambda *_: None)  # fmt: skip
    _check_demo(report, 0.02)


@needs_mininet
def test_leafspine_softswitch_lets_workers_share_a_spine_port() -> None:
    report = run_demo(DemoConfig(switch="softswitch", topo="leafspine", hosts=4, loss=0.01, rounds=5,
                                 elems=4096), log=lambda *_: None)  # fmt: skip
    _check_demo(report, 0.01)
    # Four workers, two spine ports: each result went to all four.
    assert report.switch_counters["result_quorum"] > 0


@needs_bmv2
@pytest.mark.parametrize("topo,hosts", [("star", 3), ("leafspine", 4)])
def test_bmv2_reduces_over_lossy_links(topo: str, hosts: int) -> None:
    report = run_demo(DemoConfig(switch="bmv2", topo=topo, hosts=hosts, loss=0.01, rounds=5, elems=4096),
                      log=lambda *_: None)  # fmt: skip
    _check_demo(report, 0.01, switch_queues_may_drop=True)


@needs_mininet
def test_failure_after_start_still_tears_everything_down(monkeypatch: pytest.MonkeyPatch) -> None:
    import lta.mininet_demo as demo

    names: list[str] = []

    def fail(*_args) -> None:
        raise RuntimeError("control plane unreachable (injected)")

    monkeypatch.setattr(demo, "_program_job", fail)
    with pytest.raises(RuntimeError, match="injected"):
        run_demo(DemoConfig(hosts=2, rounds=1, elems=64), log=names.append)
    # every link of that run has the prefix; the line naming the switch gives it away
    found = [m for m in (re.search(r"\b(lta[0-9a-f]{4})s1\b", line) for line in names) if m]
    assert found, names
    prefix = found[0].group(1)
    assert root_links(prefix) == []
    assert _processes_mentioning(prefix) == [], "the switch process outlived the run"


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found
