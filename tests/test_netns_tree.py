"""The leaf-spine tree in network namespaces (mininet_topos/netns_tree.py, ``lta demo --leaves L --netns``):
each switch a softswitch process in its own namespace, kernel loss on both levels. Every chunk a worker
gets is checked against numpy's mean over the workers in its global bitmap (hostlib.verify, inside
each worker); here the test checks that this ran for every chunk, that both levels really dropped their
fraction of packets, and that nothing is left behind. Needs root, iproute2 and nftables (marked mininet)."""

from __future__ import annotations

import math

import pytest

from hostlib.jobconfig import parse_jobs
from hostlib.protocol import Role
from lta.tree_netns import TreeDemoConfig, leaf_toml, run_tree_demo, spine_toml
from mininet_topos.netns import leftovers, list_namespaces
from mininet_topos.netns_tree import NetnsTree
from softswitch.config import job_config, softswitch_jobs
from tests.conftest import netns_skip_reason

PREFIX = "ot"  # this file's namespaces: removed by name
Z = 4.42  # two-sided 1e-5 binomial bound, as in test_netns.py

_REASON = netns_skip_reason()


def needs_netns(test):
    return pytest.mark.mininet(pytest.mark.skipif(_REASON is not None, reason=_REASON or "")(test))


def _within_binomial(dropped: int, seen: int, p: float) -> bool:
    half = Z * math.sqrt(seen * p * (1 - p))
    return seen * p - half <= dropped <= seen * p + half


def test_tree_jobs_files_give_each_switch_its_role() -> None:
    text = leaf_toml(1, 2, 5, ["10.79.3.1:40005", "10.79.3.2:40006"], "10.79.0.254:48879")
    leaf = job_config(softswitch_jobs(parse_jobs(text))[0])
    assert leaf.role == Role.LEAF and leaf.leaf_id == 2
    assert leaf.uplink == ("10.79.0.254", 48879)
    # worker_base 5: the leaf's two workers are global workers 5 and 6, the others absent
    assert leaf.workers == [None] * 5 + [("10.79.3.1", 40005), ("10.79.3.2", 40006)]
    spine = job_config(softswitch_jobs(parse_jobs(spine_toml(1, ["10.79.0.1:48879", "10.79.0.2:48879"])))[0])
    assert spine.role == Role.SPINE
    assert spine.workers == [("10.79.0.1", 48879), ("10.79.0.2", 48879)]


@needs_netns
def test_tree_teardown_leaves_nothing_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with NetnsTree([2, 1], prefix=PREFIX) as net:
            sleeper = net.run_in(net.leaves[1].netns, ["sleep", "60"])
            # bridges, spine, 2 leaves, 3 workers
            assert len([n for n in list_namespaces() if n.startswith(net.tag)]) == 7
            raise RuntimeError("boom")
    assert sleeper.poll() is not None
    assert leftovers(net.tag) == []


@needs_netns
def test_tree_demo_checks_every_chunk_under_loss_on_both_levels() -> None:
    """3 leaves serving 3, 2 and 2 workers, 10% loss up on every worker link and leaf uplink, 5% down."""
    config = TreeDemoConfig(
        workers=7, leaves=3, loss=0.1, down_loss=0.05, elems=8192, rounds=3, prefix=PREFIX, timeout_s=240
    )
    report = run_tree_demo(config)
    assert leftovers(PREFIX) == []
    assert report.ok, report.as_dict()
    chunks_per_round = math.ceil(config.elems / 64)
    for w in report.workers:
        assert w["returncode"] == 0
        # every chunk was either checked against numpy over its bitmap or fell back (no RESULT at all)
        assert w["chunks_checked"] + w["chunks"]["fallback"] == chunks_per_round * config.rounds
        assert w["chunks_checked"] > 0.8 * chunks_per_round * config.rounds
    # the kernel dropped each level's fraction (independently of LTA's counters)
    for prefix in ("w", "u"):
        for direction, p in (("up", config.loss), ("down", config.down_loss)):
            seen = sum(v[f"seen_{direction}"] for k, v in report.links.items() if k.startswith(prefix))
            dropped = sum(v[f"dropped_{direction}"] for k, v in report.links.items() if k.startswith(prefix))
            assert seen > 500 and _within_binomial(dropped, seen, p), (prefix, direction, dropped, seen)
    # leaves sent partials up and resent some (lost partials and RESULTs recovered); the spine added them
    assert set(report.switches) == {"spine", "leaf0", "leaf1", "leaf2"}
    for j in range(3):
        assert report.switches[f"leaf{j}"]["up_partial"] > 0
        assert report.switches[f"leaf{j}"]["up_resend"] > 0
    assert report.switches["spine"]["grad_add"] > 0
