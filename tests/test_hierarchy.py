"""Leaf-spine aggregation (docs/protocol.md, "Hierarchy").

Hand-built packets through a leaf and a spine, checked field by field against what the contract says;
then whole rounds through an in-process leaf-spine fabric with loss on both levels, every RESULT checked
against numpy's sum over exactly the workers in its bitmap; the estimator sum/count checked unbiased
(|z| < 3) over 1000 rounds; and the native engine checked equal to the per-packet reference on the fabric.
"""

from __future__ import annotations

import numpy as np
import pytest

from hostlib.protocol import HEADER_BYTES, Flag, Header, Op, Role, make_packet
from softswitch import batch as batch_module
from softswitch.hierarchy import Fabric, leaf_blocks, leaf_job, spine_job
from softswitch.pipeline import JobConfig, SoftSwitch

K = 4
SPINE, LEAF0, LEAF1 = 900, 800, 801
W = {0: 10, 1: 11, 2: 12, 3: 13}  # worker -> port; workers 0, 1 behind leaf 0, workers 2, 3 behind leaf 1


def leaf(leaf_id: int, quorum: int | None = None) -> SoftSwitch:
    sw = SoftSwitch()
    mine = {w: W[w] for w in (0, 1)} if leaf_id == 0 else {w: W[w] for w in (2, 3)}
    sw.add_job(leaf_job(1, mine, 4, SPINE, leaf_id, pool_size=8, elems_per_packet=K, quorum=quorum))
    return sw


def spine() -> SoftSwitch:
    sw = SoftSwitch()
    sw.add_job(spine_job(1, [LEAF0, LEAF1], pool_size=8, elems_per_packet=K))
    return sw


def grad(w: int, values, slot: int = 0, seq: int = 1, **kw) -> bytes:
    return make_packet(
        Op.GRAD, job_id=1, worker_id=w, slot=slot, seq=seq, payload=values, elems_per_packet=K, **kw
    )


def flush(w: int, slot: int = 0, seq: int = 1, **kw) -> bytes:
    return make_packet(Op.FLUSH, job_id=1, worker_id=w, slot=slot, seq=seq, elems_per_packet=K, **kw)


def partial(leaf_id: int, values, bitmap: int, op: Op = Op.GRAD, seq: int = 1, **kw) -> bytes:
    return make_packet(
        op, job_id=1, worker_id=leaf_id, slot=0, seq=seq, payload=values, elems_per_packet=K,
        count=bin(bitmap).count("1"), bitmap=bitmap, **kw,
    )  # fmt: skip


def parse(packet: bytes) -> tuple[Header, list[int]]:
    return Header.unpack(packet), np.frombuffer(packet, ">i4", offset=HEADER_BYTES).tolist()


def changed(sw: SoftSwitch) -> dict[str, int]:
    return {k: v for k, v in sw.read_counters(1).items() if v and k not in ("rx_packets", "tx_packets")}


# ---- hand-built packets ----------------------------------------------------------------------------
def test_leaf_sends_one_partial_up_with_count_bitmap_and_weight():
    sw = leaf(0)
    assert sw.process(grad(0, [1, 2, 3, 4], weight=5), W[0]) == []
    out = sw.process(grad(1, [10, 20, 30, -4], weight=7), W[1])
    assert len(out) == 1 and out[0][0] == SPINE
    h, payload = parse(out[0][1])
    assert (h.op, h.worker_id, h.count, h.bitmap, h.weight, h.slot, h.seq) == (Op.GRAD, 0, 2, 0b11, 12, 0, 1)
    assert payload == [11, 22, 33, 0]
    assert changed(sw) == {"grad_start": 1, "grad_add": 1, "result_quorum": 1, "up_partial": 1}


def test_spine_adds_partials_by_their_counts_and_multicasts_to_leaves():
    sw = spine()
    assert sw.process(partial(0, [11, 22, 33, 0], 0b0011, weight=12), LEAF0) == []
    out = sw.process(partial(1, [1, 1, 1, 1], 0b0100, weight=3), LEAF1)
    assert sorted(port for port, _ in out) == [LEAF0, LEAF1]
    h, payload = parse(out[0][1])
    assert (h.op, h.count, h.bitmap, h.weight) == (Op.RESULT, 3, 0b0111, 15)
    assert payload == [12, 23, 34, 1]
    assert changed(sw) == {"grad_start": 1, "grad_add": 1, "result_quorum": 1}


def test_leaf_multicasts_the_spines_result_to_its_own_workers_only():
    sw = leaf(1)
    result = make_packet(
        Op.RESULT, job_id=1, worker_id=1, slot=0, seq=1, payload=[5, 6, 7, 8], elems_per_packet=K,
        count=3, bitmap=0b1011, weight=9,
    )  # fmt: skip
    out = sw.process(result, SPINE)
    assert sorted(port for port, _ in out) == [W[2], W[3]]
    h, payload = parse(out[0][1])
    assert (h.count, h.bitmap, h.weight, payload) == (3, 0b1011, 9, [5, 6, 7, 8])
    # The same RESULT from anywhere but the uplink is malformed, as at every switch.
    assert sw.process(result, W[2]) == []
    assert changed(sw) == {"down_result": 1, "drop_malformed": 1}
    # A late worker now gets the global RESULT back, unicast.
    ((port, packet),) = sw.process(grad(2, [1, 1, 1, 1]), W[2])
    assert port == W[2] and parse(packet)[0].count == 3 and parse(packet)[0].flags & Flag.RETX


def test_late_worker_after_forwarding_resends_the_partial_without_its_values():
    sw = leaf(0, quorum=1)
    ((_, first),) = sw.process(grad(0, [1, 2, 3, 4]), W[0])  # quorum 1: forwarded at once
    ((port, again),) = sw.process(grad(1, [100, 100, 100, 100]), W[1])  # late: not added
    h, payload = parse(again)
    assert port == SPINE and h.op == Op.GRAD and h.flags & Flag.RETX
    assert (h.count, h.bitmap, payload) == (1, 0b01, [1, 2, 3, 4])
    assert changed(sw)["up_resend"] == 1


def test_lost_partial_is_recovered_by_the_workers_flush():
    lf, sp = leaf(0), spine()
    sw_out = lf.process(grad(0, [1, 2, 3, 4]), W[0]) + lf.process(grad(1, [1, 1, 1, 1]), W[1])
    assert len(sw_out) == 1  # the partial: lost on its way up (not delivered)
    sp.process(partial(1, [7, 7, 7, 7], 0b1100), LEAF1)  # leaf 1's partial arrived; spine waits for leaf 0
    # Worker 0 times out and FLUSHes its leaf: the forwarded partial goes up again (a GRAD: the spine may
    # still wait for other leaves, whose workers are flushing too).
    ((port, up),) = lf.process(flush(0), W[0])
    h, _ = parse(up)
    assert port == SPINE and h.op == Op.GRAD and h.flags & Flag.RETX and h.count == 2
    out = sp.process(up, LEAF0)
    h, payload = parse(out[0][1])
    assert (h.count, h.bitmap, payload) == (4, 0b1111, [9, 10, 11, 12])
    assert changed(sp) == {"grad_start": 1, "grad_add": 1, "result_quorum": 1}


def test_only_a_workers_repeated_flush_closes_the_spine():
    lf, sp = leaf(0), spine()
    ((_, up0),) = lf.process(grad(0, [1, 2, 3, 4]), W[0]) + lf.process(grad(1, [1, 1, 1, 1]), W[1])
    assert sp.process(up0, LEAF0) == []  # leaf 1 is dead: the spine waits
    ((_, again),) = lf.process(flush(0), W[0])  # first FLUSH: the partial again, as a GRAD (a duplicate)
    assert parse(again)[0].op == Op.GRAD and sp.process(again, LEAF0) == []
    assert lf.process(flush(1), W[1]) == []  # another worker's first FLUSH: nothing (sent again already)
    ((_, closing),) = lf.process(flush(1, flags=int(Flag.RETX)), W[1])  # worker 1 FLUSHes again: as a FLUSH
    assert parse(closing)[0].op == Op.FLUSH
    out = sp.process(closing, LEAF0)
    assert sorted(p for p, _ in out) == [LEAF0, LEAF1] and parse(out[0][1])[0].bitmap == 0b0011
    assert changed(lf)["up_resend"] == 2 and changed(lf)["up_held"] == 1
    assert changed(sp) == {"grad_start": 1, "grad_dup": 1, "flush_partial": 1}


def test_first_flushes_at_one_leaf_do_not_shut_out_another_leafs_partial():
    """The flush wave of hosts: one designated worker FLUSHes, the others one FLUSH round trip later, all
    within about a round trip. Both leaves lost a worker's GRAD. Leaf 0's second first-FLUSH must not
    close the spine before leaf 1's partial, sent at its own first FLUSH, is in."""
    lf0, lf1, sp = leaf(0), leaf(1), spine()
    assert lf0.process(grad(0, [1, 2, 3, 4]), W[0]) == []  # worker 1's GRAD lost
    assert lf1.process(grad(2, [10, 20, 30, 40]), W[2]) == []  # worker 3's GRAD lost
    ((_, up0),) = lf0.process(flush(0), W[0])  # the designated worker: closes leaf 0, partial up
    assert sp.process(up0, LEAF0) == []
    ((_, again),) = lf0.process(flush(1), W[1])  # the wave reaches leaf 0 first: its partial again ...
    assert parse(again)[0].op == Op.GRAD and sp.process(again, LEAF0) == []  # ... and the spine waits
    assert lf0.process(flush(1), W[1]) == []  # a copy of that FLUSH: held (two tries went up)
    ((_, up1),) = lf1.process(flush(3), W[3])  # leaf 1's first FLUSH: its partial
    out = sp.process(up1, LEAF1)
    assert sorted(p for p, _ in out) == [LEAF0, LEAF1]
    h, payload = parse(out[0][1])
    assert (h.count, h.bitmap, payload) == (2, 0b0101, [11, 22, 33, 44])  # workers 0 and 2, by quorum
    assert changed(sp) == {"grad_start": 1, "grad_add": 1, "grad_dup": 1, "result_quorum": 1}
    assert changed(lf0)["up_held"] == 1


def test_dead_leaf_a_flush_closes_the_spine_without_it():
    lf, sp = leaf(0), spine()
    lf.process(grad(0, [1, 2, 3, 4]), W[0])
    ((_, up),) = lf.process(flush(1), W[1])  # worker 1's GRAD was lost: its FLUSH closes the leaf
    h, _ = parse(up)
    assert h.op == Op.GRAD and (h.count, h.bitmap) == (1, 0b01)  # the spine still waits for leaf 1
    assert sp.process(up, LEAF0) == []
    ((_, up2),) = lf.process(flush(1, flags=int(Flag.RETX)), W[1])  # no answer: its repeat closes the spine
    out = sp.process(up2, LEAF0)
    assert sorted(p for p, _ in out) == [LEAF0, LEAF1]
    h, payload = parse(out[0][1])
    assert (h.count, h.bitmap, payload) == (1, 0b01, [1, 2, 3, 4])  # leaf 1 (dead) is not in it
    # Leaf 1 comes back late with its partial: it gets the stored RESULT, not added.
    ((port, resend),) = sp.process(partial(1, [9, 9, 9, 9], 0b1100), LEAF1)
    assert port == LEAF1 and parse(resend)[0].count == 1 and parse(resend)[0].flags & Flag.RETX


def test_spine_refuses_inconsistent_partials():
    sp = spine()
    bad = make_packet(Op.GRAD, job_id=1, worker_id=0, slot=0, seq=1, elems_per_packet=K, count=3, bitmap=0b1)
    assert sp.process(bad, LEAF0) == []
    sp.process(partial(0, [1, 1, 1, 1], 0b0011), LEAF0)
    assert sp.process(partial(1, [1, 1, 1, 1], 0b0110), LEAF1) == []  # worker 1 counted twice
    assert changed(sp) == {"drop_malformed": 1, "grad_start": 1, "grad_dup": 1}


def test_max_round_across_levels_after_an_empty_partial():
    sp = spine()
    empty = partial(0, [0, 0, 0, 0], 0, flags=int(Flag.MAX))  # leaf 0 saw none of its workers
    sp.process(empty, LEAF0)
    out = sp.process(partial(1, [-5, -7, 3, -(2**31)], 0b1100, flags=int(Flag.MAX), exp=0), LEAF1)
    h, payload = parse(out[0][1])
    assert (h.count, h.bitmap, payload) == (2, 0b1100, [-5, -7, 3, -(2**31)])  # not max'ed with the zeros


def test_health_probe_through_the_hierarchy():
    lf0, lf1, sp = leaf(0), leaf(1), spine()
    probe = dict(slot=7, seq=2**32 - 1)
    ((_, up0),) = lf0.process(flush(0, **probe), W[0])
    ((_, up1),) = lf1.process(flush(2, **probe), W[2])
    assert sp.process(up0, LEAF0) == []
    out = sp.process(up1, LEAF1)
    ((_, down),) = [o for o in out if o[0] == LEAF0]
    assert sorted(p for p, _ in lf0.process(down, SPINE)) == [W[0], W[1]]
    assert parse(down)[0].count == 0


def test_job_config_checks():
    with pytest.raises(ValueError, match="uplink"):
        JobConfig(1, [1, 2], role=Role.LEAF)
    with pytest.raises(ValueError, match="only a leaf"):
        JobConfig(1, [1, None])
    with pytest.raises(ValueError, match="no worker"):
        JobConfig(1, [None, None], role=Role.LEAF, uplink=5)
    assert leaf_blocks(10, 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(ValueError, match="leaves"):
        leaf_blocks(2, 3)


# ---- whole rounds through a lossy fabric -------------------------------------------------------------
def check_round(values: np.ndarray, results, n_workers: int) -> int:
    """Every RESULT = numpy's int32 sum over the workers in its bitmap, count = |bitmap|, and every worker
    that got one got the same. Returns the count."""
    got = [r for r in results if r is not None]
    assert got, "no worker got a RESULT"
    assert len({(r.header.count, r.header.bitmap) for r in got}) == 1
    r = got[0]
    members = [w for w in range(n_workers) if r.header.bitmap >> w & 1]
    assert r.header.count == len(members)
    expected = values[members].astype(np.int64).sum(axis=0) if members else np.zeros(values.shape[1])
    assert np.array_equal(r.payload, expected.astype(np.int32))
    for d in got:
        assert np.array_equal(d.payload, r.payload)
    return r.header.count


@pytest.mark.parametrize(("leaves", "per_leaf"), [(2, 2), (3, 4), (4, 3)])
def test_every_chunk_is_the_sum_over_its_global_bitmap_under_loss(leaves, per_leaf):
    n = leaves * per_leaf
    fab = Fabric(n, leaves, pool_size=16, elems_per_packet=8, worker_loss=0.1, spine_loss=0.1, seed=leaves)
    rng = np.random.default_rng(n)
    counts = []
    for r in range(120):
        values = rng.integers(-(2**20), 2**20, size=(n, 8)).astype(np.int32)
        counts.append(check_round(values, fab.round(r % 15, r // 15 + 1, values), n))
    assert fab.link_drops > 0 and min(counts) < n  # loss happened, and was renormalized around
    assert sum(c == n for c in counts) > 0


def test_exponent_rounds_take_the_max_over_the_global_bitmap():
    n = 6
    fab = Fabric(n, 3, elems_per_packet=8, worker_loss=0.15, spine_loss=0.15, seed=3)
    rng = np.random.default_rng(5)
    checked = 0
    for r in range(60):
        values = rng.integers(-130, 30, size=(n, 8)).astype(np.int32)
        results = fab.round(r % 63, r // 63 + 1, values, flags=int(Flag.MAX))
        got = [d for d in results if d is not None and d.header.count]
        for d in got:
            members = [w for w in range(n) if d.header.bitmap >> w & 1]
            assert d.header.count == len(members) and d.header.flags & Flag.MAX
            assert np.array_equal(d.payload, values[members].max(axis=0))
        checked += len(got)
    # Every worker FLUSHes until it holds the round's RESULT (8 tries): at 15% loss per hop each of the
    # 6 x 60 takes one, with a count (all six GRADs lost: 0.15^6 a round). A spine that refused MAX
    # partials answered none of them.
    assert checked == n * 60


def test_renormalized_mean_is_unbiased_over_1000_rounds_at_10_percent_loss_on_both_levels():
    """sum/count estimates the mean over all workers: its error, averaged per round, has mean 0 (|z| < 3).
    The drops are the fabric's seeded link losses (every packet on every link, 10% per level); values are
    integers, so the switch's sums are exact and any bias would be the hierarchy's."""
    n, k = 8, 16
    fab = Fabric(n, 4, pool_size=64, elems_per_packet=k, worker_loss=0.1, spine_loss=0.1, seed=11)
    rng = np.random.default_rng(12)
    errors, counts = [], []
    for r in range(1000):
        values = rng.integers(-1000, 1001, size=(n, k)).astype(np.int32)
        results = [d for d in fab.round(r % 63, r // 63 + 1, values) if d is not None]
        if not results or results[0].header.count == 0:
            continue
        d = results[0]
        estimate = d.payload.astype(np.float64) / d.header.count
        errors.append(float((estimate - values.mean(axis=0)).mean()))
        counts.append(d.header.count)
    errors_a = np.array(errors)
    z = errors_a.mean() / (errors_a.std(ddof=1) / np.sqrt(len(errors_a)))
    assert len(errors_a) > 950
    assert abs(z) < 3, z
    assert 0.6 * n < np.mean(counts) < n  # loss cost contributions (and no more than loss explains)


def test_two_levels_count_every_worker_whose_grad_arrived():
    """Efficiency under loss: a worker's GRAD is lost with p = 10% and never resent, so theory puts the
    expected count at (1 - p) N. A leaf's partial, lost on its way up, is sent again at each of its
    workers' first FLUSHes, and only a repeated FLUSH closes the spine, so the second level costs nothing
    on top (before that rule, the second first-FLUSH at one leaf closed the spine ahead of the other
    leaves' resent partials: 4 x 8 counted 0.60 N). Bound: 4.42 sigma of the binomial."""
    n, leaves, p, rounds = 32, 4, 0.1, 300
    fab = Fabric(n, leaves, pool_size=16, elems_per_packet=4, worker_loss=p, spine_loss=p, seed=21)
    counts = []
    for r in range(rounds):
        got = [d.header.count for d in fab.round(r % 16, r // 16 + 1, np.ones((n, 4), np.int32)) if d]
        counts.append(max(got, default=0))
    expected, sigma = (1 - p), np.sqrt(p * (1 - p) / (n * rounds))
    assert abs(np.mean(counts) / n - expected) < 4.42 * sigma, np.mean(counts) / n


def test_native_engine_equals_reference_on_the_fabric():
    if batch_module._swcore is None:
        pytest.skip("softswitch._swcore is not built here")
    runs = []
    for batched in (True, False):
        fab = Fabric(
            6, 3, pool_size=8, elems_per_packet=8, worker_loss=0.2, spine_loss=0.2, seed=4, batched=batched
        )
        rng = np.random.default_rng(9)
        out = []
        for r in range(80):
            values = rng.integers(-500, 500, size=(6, 8)).astype(np.int32)
            for d in fab.round(r % 7, r // 7 + 1, values):
                out.append(None if d is None else (d.header, d.payload.tolist()))
        counters = [sw.read_counters(1) for sw in [*fab.leaves, fab.spine]]
        regs = [sw.jobs[1].slots.regs.tobytes() for sw in [*fab.leaves, fab.spine]]
        runs.append((out, counters, regs))
    assert runs[0] == runs[1]


# ---- the jobs file ------------------------------------------------------------------------------------
LEAF_FILE = """
[[jobs]]
job_id = 1
role = "leaf"
uplink = "127.0.0.1:48900"
leaf_id = 1
worker_base = 2
workers = ["127.0.0.1:41003", "127.0.0.1:41004"]
[[jobs.drop]]
direction = "up"
p = 0.5
worker = 1
"""


def test_jobs_file_roles_reach_the_switch():
    from hostlib.jobconfig import parse_jobs
    from softswitch.config import build_switch

    sw = build_switch(parse_jobs(LEAF_FILE, "leaf.toml"))
    cfg = sw.jobs[1].cfg
    assert (cfg.role, cfg.uplink, cfg.leaf_id, cfg.quorum) == (Role.LEAF, ("127.0.0.1", 48900), 1, 2)
    assert cfg.workers == [None, None, ("127.0.0.1", 41003), ("127.0.0.1", 41004)]
    assert set(sw.jobs[1].policies) == {("up", 3)}  # the file's worker 1 is global worker 3
    spine_file = '[[jobs]]\njob_id = 1\nrole = "spine"\nworkers = ["127.0.0.1:48901", "127.0.0.1:48902"]\n'
    assert build_switch(parse_jobs(spine_file, "spine.toml")).jobs[1].cfg.role == Role.SPINE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ('role = "leaf"', "uplink"),
        ('role = "root"', "must be one of"),
        ('uplink = "127.0.0.1:1"', "only belong"),
        ('role = "leaf"\nuplink = "nowhere"', "HOST:PORT"),
        ('role = "leaf"\nuplink = "127.0.0.1:1"\nleaf_id = 40', "leaf_id"),
        ('role = "leaf"\nuplink = { port = 3 }', "give the spine's ip and udp_port"),
        ('role = "leaf"\nuplink = 3', "uplink is"),
        ('role = "leaf"\nuplink = { ip = "10.0.0.9", udp_port = 1, port = 999 }', "port"),
    ],
)
def test_jobs_file_refuses_bad_roles(change, message):
    from hostlib.errors import ConfigError
    from hostlib.jobconfig import parse_jobs

    text = f'[[jobs]]\njob_id = 1\n{change}\nworkers = ["127.0.0.1:41001"]\n'
    with pytest.raises(ConfigError, match=message):
        parse_jobs(text, "bad.toml")


def test_lta_ctl_apply_needs_the_leafs_uplink_port():
    from controlplane.deployment import parse
    from hostlib.errors import ConfigError

    text = LEAF_FILE.replace('"127.0.0.1:41003", "127.0.0.1:41004"', "1, 2").split("[[jobs.drop]]")[0]
    with pytest.raises(ConfigError, match="switch port toward the spine"):
        parse(text)


# ---- worker processes through leaf and spine softswitches on loopback -----------------------------------
@pytest.mark.parametrize("switch_processes", [False, True], ids=["switch-threads", "switch-processes"])
def test_lta_workers_through_two_leaves_and_a_spine_with_loss_on_both_levels(switch_processes):
    """Real LtaWorker processes (4, two per leaf) reduce seeded tensors through UDP leaf and spine
    softswitches dropping 10% of GRADs at the leaves and of partials at the spine; every chunk that came
    back is checked against numpy's mean over the workers in its global bitmap (lta demo's check). The
    switches run as threads of the test, or each in a process of its own (``lta bench scaling``'s
    default), whose counters come back to the switches run_job hands out."""
    from hostlib.emulation.dropmodels import DropPolicy
    from hostlib.transport import TransportConfig
    from lta.demo import demo_worker
    from lta.launch import JobSpec, run_job

    drop = {"up": DropPolicy(p=0.1)}
    spec = JobSpec(
        n_workers=4,
        transport=TransportConfig(seed=3),
        drop=drop,
        leaves=2,
        spine_drop=drop,
        switch_seed=3,
        switch_processes=switch_processes,
    )
    switches: list = []
    results, spine_sw = run_job(spec, demo_worker, 20000, 3, 3, switches=switches)
    assert all(r["worst_error_over_bound"] < 1.0 for r in results)
    # every chunk that came back from a RESULT was checked (the bound from the inputs: hostlib.verify)
    for r in results:
        assert r["checked_chunks"] == r["stats"]["chunks_full"] + r["stats"]["chunks_partial"] > 0
    partial = sum(r["stats"]["chunks_partial"] for r in results)
    assert partial > 0  # loss happened and was renormalized around
    leaves = [sw.read_counters(1) for sw in switches[:2]]
    assert all(c["up_partial"] > 0 and c["down_result"] > 0 and c["drop_policy_up"] > 0 for c in leaves)
    assert spine_sw is switches[2] and spine_sw.read_counters(1)["drop_policy_up"] > 0


def test_a_worker_alone_in_its_block_joins_the_spine_as_its_own_leaf():
    """5 workers over 4 leaves (blocks 2, 1, 1, 1) with ``own_leaf``: one leaf switch serves workers 0-1
    and workers 2-4 send to the spine themselves as leaves 1-3; 10% of GRADs dropped at the leaf and of
    partials at the spine. Every chunk is checked against numpy's mean over its global bitmap, and the
    spine heard each contributor at its own address."""
    from hostlib.emulation.dropmodels import DropPolicy
    from hostlib.transport import TransportConfig
    from lta.demo import demo_worker
    from lta.launch import JobSpec, run_job

    drop = {"up": DropPolicy(p=0.1)}
    transport = TransportConfig(seed=4, own_leaf=True, heartbeat_interval_s=0.05)
    spec = JobSpec(n_workers=5, transport=transport, drop=drop, leaves=4, spine_drop=drop, switch_seed=4)
    switches: list = []
    results, spine_sw = run_job(spec, demo_worker, 12000, 3, 4, switches=switches)
    assert all(r["checked_chunks"] > 0 and r["worst_error_over_bound"] < 1.0 for r in results)
    assert sum(r["stats"]["chunks_partial"] for r in results) > 0  # loss happened
    assert len(switches) == 2 and spine_sw is switches[1]
    leaf_counters = switches[0].read_counters(1)
    assert leaf_counters["up_partial"] > 0 and leaf_counters["drop_policy_up"] > 0
    assert switches[0].read_worker_rx(1, 2) != [0, 0]  # the leaf served workers 0 and 1 only
    assert all(n > 0 for n in spine_sw.read_worker_rx(1))  # leaf 0's partials, workers 2-4's own
    assert spine_sw.read_counters(1)["drop_bad_worker"] == 0
    # Its heartbeats reach the spine, but no ALIVE relay (under a leaf id) that the spine would replicate
    assert spine_sw.read_counters(1)["heartbeat"] > 0 and spine_sw.read_counters(1)["param_fwd"] == 0
    assert leaf_counters["drop_bad_worker"] == 0


def test_a_worker_as_its_own_leaf_sends_its_grad_again_at_its_first_flush():
    """Two workers, each its own leaf, 10% of the partials dropped at the spine. A leaf's first FLUSH of
    a unit sends its partial up again without closing the spine's round, so a lost GRAD gets a second
    try and a round misses a worker only when both tries were lost: P(full) = (1 - p^2)^2 ~ 0.98, where
    a flat switch, which closes at the FLUSH without the lost GRAD, has (1 - p)^2 = 0.81."""
    from hostlib.emulation.dropmodels import DropPolicy
    from hostlib.transport import TransportConfig
    from lta.demo import demo_worker
    from lta.launch import JobSpec, run_job

    transport = TransportConfig(seed=6, own_leaf=True)
    spine_drop = {"up": DropPolicy(p=0.1)}
    spec = JobSpec(n_workers=2, transport=transport, leaves=2, spine_drop=spine_drop, switch_seed=6)
    switches: list = []
    results, spine_sw = run_job(spec, demo_worker, 64 * 400, 3, 6, switches=switches)
    assert len(switches) == 1  # the spine alone
    assert all(r["checked_chunks"] > 0 and r["worst_error_over_bound"] < 1.0 for r in results)
    stats = results[0]["stats"]
    full = stats["chunks_full"] / (stats["chunks_full"] + stats["chunks_partial"])
    counters = spine_sw.read_counters(1)
    assert counters["drop_policy_up"] > 0.05 * 2 * 3 * 400  # the loss happened
    assert full > 0.95, (full, counters)


def test_own_leaf_needs_the_leaf_blocks():
    from hostlib.transport import LtaWorker, TransportConfig

    with pytest.raises(ValueError, match="own_leaf needs leaf_sizes"):
        LtaWorker(1, 0, 2, ("127.0.0.1", 9), config=TransportConfig(own_leaf=True))


def test_the_documented_leaf_and_spine_files_parse(tmp_path):
    import re
    from pathlib import Path

    from softswitch.config import load_switch

    doc = (Path(__file__).resolve().parent.parent / "docs" / "jobs_file.md").read_text()
    section = doc.split("## Leaf and spine jobs", 1)[1].split("\n## ", 1)[0]
    leaf_text, spine_text = re.findall(r"```toml\n(.*?)```", section, re.S)
    (tmp_path / "leaf1.toml").write_text(leaf_text)
    (tmp_path / "spine.toml").write_text(spine_text)
    leaf_cfg = load_switch(tmp_path / "leaf1.toml").jobs[1].cfg
    spine_cfg = load_switch(tmp_path / "spine.toml").jobs[1].cfg
    assert (leaf_cfg.role, leaf_cfg.leaf_id, leaf_cfg.local) == (Role.LEAF, 1, [2, 3])
    # the leaf's uplink is the spine, and the spine's leaf 1 is where that leaf listens
    assert spine_cfg.role == Role.SPINE and spine_cfg.workers[1] == ("127.0.0.1", 48902)
    assert leaf_cfg.uplink == ("127.0.0.1", 48900)


def _demo_through_each(workers, rank, n_values, rounds, seed):
    """run_jobs body: lta demo's checked reduces through each job's worker in turn."""
    from lta.demo import demo_worker

    return [demo_worker(w, rank, n_values, rounds, seed) for w in workers]


def test_run_jobs_reduces_through_a_flat_switch_and_a_tree_from_the_same_worker_processes():
    """``lta bench scaling``'s harness: the same 4 worker processes hold one LtaWorker per job, a flat
    switch (job 1) and a 2-leaf tree in switch processes (job 2), both with 10% GRAD loss; every chunk
    through either is checked against numpy's mean over its bitmap, and each job's switches counted
    only their own job's packets, and each switch's serving CPU time comes back."""
    from hostlib.emulation.dropmodels import DropPolicy
    from hostlib.transport import TransportConfig
    from lta.launch import JobSpec, run_jobs

    drop = {"up": DropPolicy(p=0.1)}
    common = dict(n_workers=4, transport=TransportConfig(seed=5), drop=drop, switch_seed=5)
    specs = [
        JobSpec(job_id=1, **common),
        JobSpec(job_id=2, leaves=2, spine_drop=drop, switch_processes=True, **common),
    ]
    switches: list = []
    cpu_s: list = []
    results = run_jobs(specs, _demo_through_each, 5000, 2, 5, switches=switches, switch_cpu_s=cpu_s)
    for per_job in results:
        assert len(per_job) == 2
        for r in per_job:
            assert r["checked_chunks"] > 0 and r["worst_error_over_bound"] < 1.0
    assert [len(s) for s in switches] == [1, 3]
    # Every switch served packets, in this process's thread or its own process: its serving thread used
    # some CPU, and the CPU time came back from the switch processes too.
    assert [len(c) for c in cpu_s] == [1, 3] and all(c > 0 for job in cpu_s for c in job)
    flat, tree = switches
    assert flat[0].read_counters(1)["grad_start"] > 0 and flat[0].read_counters(1)["drop_policy_up"] > 0
    assert 2 not in flat[0].jobs and all(1 not in sw.jobs for sw in tree)
    assert all(sw.read_counters(2)["up_partial"] > 0 for sw in tree[:2])
    assert tree[2].read_counters(2)["grad_start"] > 0


def test_run_jobs_refuses_jobs_that_cannot_share_workers():
    from lta.launch import JobSpec, run_jobs

    with pytest.raises(ValueError, match="same worker count and distinct job ids"):
        run_jobs([JobSpec(n_workers=2), JobSpec(n_workers=2)], _demo_through_each)
    with pytest.raises(ValueError, match="same worker count and distinct job ids"):
        run_jobs([JobSpec(n_workers=2), JobSpec(n_workers=3, job_id=2)], _demo_through_each)


def test_bench_scaling_reports_each_switchs_cpu_per_reduce(capsys):
    """``lta bench scaling --leaves``: the one switch's row carries one CPU figure, the tree's one per leaf
    and one for the spine, each a positive share of its serving thread's CPU; the text names them."""
    import json

    from lta import cli

    argv = ["bench", "scaling", "--workers", "2", "--leaves", "2", "--sim-workers", "", "--kib", "1"]
    argv += ["--iters", "2", "--plot", "", "--loss", "0"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "lta.bench.scaling/1"
    rows = {r["mode"]: r for r in out["rows"]}
    assert len(rows["processes"]["switch_cpu_ms"]) == 1 and len(rows["leaves=2"]["switch_cpu_ms"]) == 3
    assert all(c > 0 for mode in ("processes", "leaves=2") for c in rows[mode]["switch_cpu_ms"])
    (h,) = out["hierarchy"]
    assert h["one_level_switch_cpu_ms"] == rows["processes"]["switch_cpu_ms"]
    assert h["two_level_switch_cpu_ms"] == rows["leaves=2"]["switch_cpu_ms"]

    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "switch CPU per reduce" in text and "2 leaves" in text and "spine" in text


def test_bench_scaling_own_leaf_runs_the_one_worker_leaves_without_a_switch(capsys):
    """``lta bench scaling --own-leaf``: 3 workers over 2 leaves (blocks 2 and 1) run through one leaf
    switch and the spine (two CPU figures), the one switch as before; the text says how many leaves had
    a switch."""
    import json

    from lta import cli

    argv = ["bench", "scaling", "--workers", "3", "--leaves", "2", "--own-leaf", "--sim-workers", ""]
    argv += ["--kib", "1", "--iters", "2", "--plot", "", "--loss", "0"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in out["rows"]}
    assert out["config"]["own_leaf"] is True
    assert len(rows["processes"]["switch_cpu_ms"]) == 1 and len(rows["leaves=2"]["switch_cpu_ms"]) == 2
    assert cli.main(argv) == 0
    assert "2 leaves" in (text := capsys.readouterr().out) and "(1 with a switch)" in text


def test_bench_scaling_loss_costs_are_what_held_and_flushed_the_worker(make_cluster):
    """The figures of ``lta bench scaling``'s loss columns, for one worker in a scenario with known
    holds: alone (no peer can hold it), 30% GRAD loss and a pool of 15 data slots (S = 8), so a lost unit
    holds the ninth until a FLUSH recovers it. Per measured reduce: the FLUSHes it sent and the time its
    own span and its peers held it, as its transport's stats count them."""
    from lta.bench.scaling import reduce_in_turn

    cluster = make_cluster(1, up=0.3, seed=3, elems_per_packet=64, pool_size=16)
    (worker,) = cluster.workers
    out = reduce_in_turn([worker], 0, 200 * 64, 2, 0)  # 2 measured reduces, no warm-up
    (costs,) = out["loss_costs"]
    st = worker.stats
    assert st.flushes_sent > 0 and st.held_by_span_s > 0 and st.held_by_peers_s == 0
    assert costs["flushes_per_reduce"] == st.flushes_sent
    assert costs["span_held_ms"] == pytest.approx(1e3 * st.held_by_span_s)
    assert costs["peers_held_ms"] == 0.0
    assert [len(t) for t in out["times_s"]] == [2]


def test_bench_scaling_drops_at_the_spine_by_spine_loss_and_reports_what_loss_cost(capsys):
    """``lta bench scaling --loss 0 --spine-loss 0.2`` (and a pool of 64 slots for every job): only the
    tree's spine drops (its leaves' partials), so the one switch's row counts no drops and the tree's
    some; each row carries the FLUSHes per worker and reduce and the time a reuse rule held a worker,
    and the text prints them side by side."""
    import json

    from lta import cli

    argv = ["bench", "scaling", "--workers", "2", "--leaves", "2", "--sim-workers", "", "--kib", "4"]
    argv += ["--iters", "3", "--plot", "", "--loss", "0", "--spine-loss", "0.2", "--pool-size", "64"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["spine_loss"] == 0.2 and out["config"]["loss"] == 0
    assert out["config"]["pool_size"] == 64
    rows = {r["mode"]: r for r in out["rows"]}
    assert rows["processes"]["drops_per_reduce"] == 0 and rows["leaves=2"]["drops_per_reduce"] > 0
    assert rows["leaves=2"]["flushes_per_reduce"] > 0  # a lost partial is recovered by its workers' FLUSHes
    for mode in ("processes", "leaves=2"):
        assert rows[mode]["span_held_ms"] >= 0 and rows[mode]["peers_held_ms"] >= 0
    (h,) = out["hierarchy"]
    assert h["one_level_drops_per_reduce"] == 0 and h["two_level_drops_per_reduce"] > 0
    assert h["two_level_flushes_per_reduce"] == rows["leaves=2"]["flushes_per_reduce"]

    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "what loss cost a reduce" in text and "held by span" in text
