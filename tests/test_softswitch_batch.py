"""SoftSwitch.process_batch against the per-packet reference SoftSwitch.process.

The same seeded packet sequence goes through two fresh switches: one packet by packet, one in batches of
random sizes (and as one batch). Emitted packets (bytes, egress, order), every counter row, the final slot
registers and the drop streams must be identical.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest

from hostlib.emulation.dropmodels import NO_LOSS, DropPolicy, DropStream
from hostlib.protocol import HEADER_BYTES, INT32_MIN, MAX_JOBS, Flag, Header, Op, Role, make_packet
from softswitch import batch as batch_module
from softswitch.batch import NO_KEY, key_address, port_key
from softswitch.pipeline import JobConfig, SoftSwitch

GE_BURSTY = DropPolicy("gilbert_elliott", p=0.2, r=0.4, loss_good=0.05, loss_bad=0.9)
GE_PLAIN = DropPolicy("gilbert_elliott", p=0.1, r=0.5)


@dataclass
class Spec:
    job_id: int
    workers: list
    pool: int
    k: int
    quorum: int | None = None
    policies: list = field(default_factory=list)  # (direction, policy, worker or None)
    role: Role = Role.FLAT
    uplink: object = None  # a leaf's spine
    leaf_id: int = 0


# Three jobs with different K, pools and quorums; int ports (two workers behind port 7, as behind a leaf
# switch) and (host, port) addresses; no policy, global and per-worker Bernoulli and Gilbert-Elliott
# policies on every direction, and a per-worker NO_LOSS overriding a global policy.
MIXED = [
    Spec(1, [10, 11, 12], pool=8, k=4),
    Spec(
        2,
        [("10.0.0.1", 5000), ("10.0.0.2", 5000), ("10.0.0.1", 5001), ("192.168.7.3", 6000)],
        pool=16,
        k=8,
        quorum=3,
        policies=[
            ("up", DropPolicy(p=0.2), None),
            ("down", DropPolicy(p=0.1), None),
            ("down", GE_BURSTY, 1),
            ("param", DropPolicy(p=0.3), None),
        ],
    ),
    Spec(
        3,
        [7, 7, 8],
        pool=4,
        k=64,
        quorum=2,
        policies=[
            ("up", DropPolicy(p=0.3), None),
            ("up", GE_PLAIN, 0),
            ("up", NO_LOSS, 2),
            ("param", GE_BURSTY, 1),
            ("down", GE_PLAIN, 2),
        ],
    ),
]
# The hierarchy (docs/protocol.md, "Hierarchy"): a leaf serving workers 1 and 3 of five (the others sit
# behind other leaves) with an uplink, and a spine whose three contributors are leaves.
HIERARCHY = [
    Spec(
        4,
        [None, 20, None, 21, None],
        pool=8,
        k=4,
        role=Role.LEAF,
        uplink=30,
        leaf_id=2,
        policies=[("up", DropPolicy(p=0.2), None), ("down", DropPolicy(p=0.1), 3)],
    ),
    Spec(
        5,
        [("10.0.1.1", 7000), ("10.0.1.2", 7000), 31],
        pool=8,
        k=8,
        role=Role.SPINE,
        policies=[("up", GE_PLAIN, None), ("down", DropPolicy(p=0.2), 1)],
    ),
]
MIXED = MIXED + HIERARCHY
STRANGER = ("10.9.9.9", 4000)  # a port no worker uses


def make_switch(specs: list[Spec], seed: int = 1) -> SoftSwitch:
    sw = SoftSwitch(seed=seed)
    for spec in specs:
        cfg = JobConfig(
            spec.job_id,
            list(spec.workers),
            spec.quorum,
            spec.pool,
            spec.k,
            spec.role,
            spec.uplink,
            spec.leaf_id,
        )
        sw.add_job(cfg)
        for direction, policy, worker in spec.policies:
            sw.set_drop_policy(spec.job_id, direction, policy, worker)
    return sw


# ---- packet sequences ------------------------------------------------------------------------------
class MixGenerator:
    """Seeded packets of every kind: rounds that complete, duplicates, stale / future seqs, FLUSH on
    open / closed / unseen rounds, exponent and MAX mismatches, SATURATED / CRITICAL, int32 wrap-around,
    PARAM / PARAM_REQ, HEARTBEAT, and every malformed case of the contract."""

    def __init__(self, specs: list[Spec], seed: int) -> None:
        self.specs = specs
        self.rng = np.random.default_rng(seed)
        self.current: dict[tuple[int, int], int] = {}  # (job, slot) -> the round most packets are for
        self.rounds: dict[tuple[int, int, int], tuple[int, bool]] = {}  # (job, slot, seq) -> (exp, max)

    def payload(self, k: int, is_max: bool) -> np.ndarray:
        rng = self.rng
        if rng.random() < 0.3:  # large values: sums wrap around int32
            values = rng.integers(-(2**31), 2**31, size=k)
        else:
            values = rng.integers(-1000, 1000, size=k)
        if is_max:
            values[rng.random(k) < 0.2] = INT32_MIN
        return values

    def packet(self) -> tuple[bytes, object]:
        rng = self.rng
        spec = self.specs[int(rng.integers(len(self.specs)))]
        n = len(spec.workers)
        local = [w for w, p in enumerate(spec.workers) if p is not None]
        w = local[int(rng.integers(len(local)))] if rng.random() < 0.95 else int(rng.integers(n))
        port: object = spec.workers[w] if spec.workers[w] is not None else STRANGER
        u = rng.random()
        if u < 0.62:
            op = Op.GRAD
        elif u < 0.75:
            op = Op.FLUSH
        elif u < 0.82:
            op = Op.PARAM
        elif u < 0.87:
            op = Op.PARAM_REQ
        elif u < 0.89:
            op = Op.RESULT  # upstream RESULT: malformed
        elif u < 0.91:
            op = Op.HEARTBEAT
        else:
            op = Op.GRAD
        hot = min(spec.pool, 6)
        slot = int(rng.integers(hot)) if rng.random() < 0.9 else int(rng.integers(spec.pool))
        if rng.random() < 0.02:
            slot = spec.pool + int(rng.integers(3))  # out of range
        key = (spec.job_id, slot)
        cur = self.current.setdefault(key, 1)
        v = rng.random()
        if v < 0.08:
            cur = self.current[key] = cur + 1  # the slot moves on
        if v < 0.65:
            seq = cur
        elif v < 0.78:
            seq = max(cur - 1, 0)  # stale
        elif v < 0.9:
            seq = cur + 1  # a future round
        elif v < 0.96:
            seq = cur + int(rng.integers(2, 5))  # a FLUSH / GRAD for an unseen round
        elif v < 0.995:
            seq = 0  # never a round
        else:
            seq = int(rng.integers(2**31, 2**32 - 16))  # far ahead
        if seq > cur and rng.random() < 0.7:
            self.current[key] = seq  # most packets follow the slot to its newest round
        exp, is_max = self.rounds.setdefault(
            (spec.job_id, slot, seq), (int(rng.integers(-128, 128)), bool(rng.random() < 0.25))
        )
        if rng.random() < 0.06:
            exp = int(rng.integers(-128, 128))  # exponent mismatch
        if rng.random() < 0.04:
            is_max = not is_max  # MAX-flag mismatch
        # (0..63: OWNER too, with a random owner in count, often no worker of the job)
        flags = (int(Flag.MAX) if is_max else 0) | int(rng.integers(0, 64)) & ~int(Flag.MAX)
        if rng.random() < 0.5:
            flags &= ~int(Flag.CRITICAL)
        if spec.role == Role.LEAF and op == Op.FLUSH and rng.random() < 0.6:
            flags &= ~int(Flag.RETX)  # a worker's first FLUSH (sends the partial up once, then held)
        if spec.role == Role.LEAF and rng.random() < 0.15:
            op, port = Op.RESULT, spec.uplink  # the spine's answer
        count, bitmap = int(rng.integers(256)), int(rng.integers(0, 2**63))
        if spec.role == Role.SPINE and rng.random() < 0.95:  # a leaf's partial: count = |bitmap|
            bitmap = int(rng.integers(0, 2**12)) << (12 * w) if rng.random() < 0.9 else 0
            count = bitmap.bit_count()
        k = spec.k
        nelem = int(rng.integers(0, k + 1))
        if rng.random() < 0.02:
            nelem = k + 1 + int(rng.integers(3))  # nelem > K: malformed
        fields = dict(
            job_id=spec.job_id,
            worker_id=w,
            slot=slot,
            seq=seq,
            payload=self.payload(k, is_max),
            elems_per_packet=k,
            flags=flags,
            exp=exp,
            count=count,
            step=int(rng.integers(0, 2**32)),
            chunk=int(rng.integers(0, 2**32)),
            weight=int(rng.integers(0, 2**32)) if rng.random() < 0.3 else int(rng.integers(0, 10)),
            bitmap=bitmap,
            nelem=nelem,
        )
        # Malformed and misdirected variants.
        c = rng.random()
        if c < 0.015:
            return bytes(rng.integers(0, 256, size=int(rng.integers(0, HEADER_BYTES))).astype(np.uint8)), port
        if c < 0.03:
            fields["version"] = int(rng.choice([0, 2, 255]))
        elif c < 0.045:
            data = make_packet(op, **fields)
            return bytes([data[0], int(rng.choice([0, 6, 200]))]) + data[2:], port  # unknown op
        elif c < 0.06:
            data = make_packet(op, **fields)
            cut = int(rng.integers(HEADER_BYTES, len(data)))
            return (data[:cut] if rng.random() < 0.5 else data + b"\x00" * 4), port  # wrong payload length
        elif c < 0.075:
            fields["job_id"] = int(rng.choice([0, 4, 63, 64, 999, 65535]))  # unknown job
        elif c < 0.09:
            fields["worker_id"] = int(rng.integers(n, 256))  # beyond N
        elif c < 0.11:
            others = [p for spec2 in self.specs for p in spec2.workers if p not in (port, None)] + [STRANGER]
            port = others[int(rng.integers(len(others)))]  # from another worker's port
        elif c < 0.12:
            other = self.specs[int(rng.integers(len(self.specs)))]
            fields["elems_per_packet"] = other.k  # another job's K: wrong length unless equal
            fields["payload"] = self.payload(other.k, is_max)
            fields["nelem"] = min(nelem, other.k)
        return make_packet(op, **fields), port

    def packets(self, count: int) -> list[tuple[bytes, object]]:
        out: list[tuple[bytes, object]] = []
        while len(out) < count:
            data, port = self.packet()
            out.append((data, port))
            # The first FLUSHes of a unit come from several workers within a round trip: a leaf's first
            # sends its partial up again, the next ones are held (up_held).
            if len(data) > 2 and data[1] == Op.FLUSH and port in (20, 21) and self.rng.random() < 0.5:
                out += [(data, port)] * int(self.rng.integers(1, 3))
        return out[:count]


def steady_stream(
    n_workers: int, k: int, pool: int, units: int, window: int, seed: int, loss: float = 0.0
) -> list[tuple[bytes, int, int]]:
    """GRADs as the hosts send them: unit g in slot g mod P, round g div P + 1, every worker; an exponent
    (MAX) round for the first units of every 64; shuffled within windows; optionally a fraction lost on
    the way and the survivors' FLUSHes. Returns (bytes, worker, unit)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(units):
        is_max = g % 64 < 4
        for w in range(n_workers):
            if loss and rng.random() < loss:
                continue
            values = rng.integers(-(2**20), 2**20, size=k)
            data = make_packet(
                Op.GRAD,
                job_id=1,
                worker_id=w,
                slot=g % pool,
                seq=g // pool + 1,
                payload=values,
                elems_per_packet=k,
                flags=int(Flag.MAX) if is_max else 0,
                exp=0 if is_max else 17,
                step=g // 256,
                chunk=g,
                weight=1,
            )
            out.append((data, w, g))
    if loss:  # every unit flushed once by its owner after the window
        for g in range(units):
            w = g % n_workers
            flush = make_packet(
                Op.FLUSH, job_id=1, worker_id=w, slot=g % pool, seq=g // pool + 1, elems_per_packet=k
            )
            out.append((flush, w, g + window))
        out.sort(key=lambda item: item[2])
    order = np.arange(len(out))
    for start in range(0, len(out), window):
        rng.shuffle(order[start : start + window])
    return [out[i] for i in order]


class RoundGenerator:
    """Seeded GRAD rounds as hosts send them, with faults: unit g (slot g mod P, round g div P + 1) gets
    GRADs from a random subset of the workers (sum or MAX round, one exponent), some duplicated, with an
    exponent or MAX mismatch, SATURATED, CRITICAL or a huge weight; a few FLUSHes and stale or late
    GRADs; shuffled within windows. Most slots see a plain round per batch (the one-pass path), the
    others need the waves."""

    def __init__(self, spec: Spec, seed: int, window: int = 40) -> None:
        self.spec, self.window = spec, window
        self.rng = np.random.default_rng(seed)

    def grad(self, g: int, w: int, exp: int, is_max: bool, owner: int = -1) -> bytes:
        rng, spec = self.rng, self.spec
        flags = (int(Flag.MAX) if is_max else 0) | (int(Flag.OWNER) if owner >= 0 else 0)
        if rng.random() < 0.02:
            exp = int(rng.integers(-128, 128))
        if rng.random() < 0.02:
            flags ^= int(Flag.MAX)
        if rng.random() < 0.05:
            flags |= int(Flag.SATURATED)
        if rng.random() < 0.1:
            flags |= int(Flag.CRITICAL)
        big = rng.random() < 0.2
        values = rng.integers(-(2**31), 2**31, size=spec.k) if big else rng.integers(-50, 50, size=spec.k)
        return make_packet(
            Op.GRAD,
            job_id=spec.job_id,
            worker_id=w,
            slot=g % spec.pool,
            seq=g // spec.pool + 1,
            payload=values,
            elems_per_packet=spec.k,
            flags=flags,
            exp=exp,
            step=g // 7,
            chunk=g,
            weight=int(rng.integers(0, 2**32)) if rng.random() < 0.1 else int(rng.integers(1, 4)),
            nelem=int(rng.integers(0, spec.k + 1)),
            count=max(owner, 0),
        )

    def packets(self, units: int) -> list[tuple[bytes, object]]:
        rng, spec = self.rng, self.spec
        n = len(spec.workers)
        out: list[tuple[bytes, int, float]] = []
        for g in range(units):
            is_max = bool(rng.random() < 0.2)
            exp = 0 if is_max else int(rng.integers(-20, 40))
            senders = rng.permutation(n)[: int(rng.integers(max(1, n - 2), n + 1))]
            # an owner-only round (its RESULT to one worker; now and then an id that is no worker's)
            owner = int(rng.integers(n + 1)) if rng.random() < 0.3 else -1
            for w in senders:
                out.append((self.grad(g, int(w), exp, is_max, owner), int(w), g + rng.random()))
                if rng.random() < 0.03:  # a duplicate, or a late GRAD after the close
                    out.append((self.grad(g, int(w), exp, is_max, owner), int(w), g + rng.random() * 3))
            if rng.random() < 0.03:  # a stale GRAD of the previous round of this slot
                w = int(rng.integers(n))
                out.append((self.grad(max(g - spec.pool, 0), w, exp, is_max), w, g + rng.random()))
            if rng.random() < 0.04:
                w = int(rng.integers(n))
                flush = make_packet(
                    Op.FLUSH, job_id=spec.job_id, worker_id=w, slot=g % spec.pool, seq=g // spec.pool + 1,
                    elems_per_packet=spec.k, exp=exp, chunk=g, count=max(owner, 0),
                    flags=(int(Flag.MAX) if is_max else 0) | (int(Flag.OWNER) if owner >= 0 else 0),
                )  # fmt: skip
                out.append((flush, w, g + 1 + rng.random() * 2))
        out.sort(key=lambda item: item[2])
        order = np.arange(len(out))
        for start in range(0, len(out), self.window):
            rng.shuffle(order[start : start + self.window])
        return [(out[i][0], spec.workers[out[i][1]]) for i in order]


# ---- running both paths -----------------------------------------------------------------------------
def pack(packets: list[tuple[bytes, object]], extra: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    stride = max(len(p) for p, _ in packets) + extra
    data = np.zeros((len(packets), max(stride, 1)), dtype=np.uint8)
    lens = np.zeros(len(packets), dtype=np.int64)
    ingress = np.zeros(len(packets), dtype=np.int64)
    for i, (p, port) in enumerate(packets):
        data[i, : len(p)] = np.frombuffer(p, dtype=np.uint8)
        lens[i] = len(p)
        ingress[i] = port_key(port)
    return data, lens, ingress


def run_reference(sw: SoftSwitch, packets: list[tuple[bytes, object]]) -> list[tuple[int, bytes]]:
    out = []
    for data, port in packets:
        out.extend((port_key(egress), bytes(pkt)) for egress, pkt in sw.process(data, port))
    return out


def run_batched(
    sw: SoftSwitch, packets: list[tuple[bytes, object]], sizes: list[int], rng: np.random.Generator
) -> list[tuple[int, bytes]]:
    data, lens, ingress = pack(packets, extra=int(rng.integers(0, 9)))
    out: list[tuple[int, bytes]] = []
    cap = max(sizes)
    buf_data = np.zeros((cap, data.shape[1]), dtype=np.uint8)
    buf_lens = np.zeros(cap, dtype=np.int64)
    buf_ingress = np.zeros(cap, dtype=np.int64)
    start = 0
    for size in sizes:
        stop = min(start + size, len(packets))
        if rng.random() < 0.5:  # slices of the whole array
            res = sw.process_batch(data[start:stop], lens[start:stop], ingress[start:stop])
        else:  # a preallocated receive buffer, n rows valid
            n = stop - start
            buf_data[:n], buf_lens[:n], buf_ingress[:n] = (
                data[start:stop],
                lens[start:stop],
                ingress[start:stop],
            )
            buf_data[n:] = 0xEE  # stale rows must not matter
            res = sw.process_batch(buf_data, buf_lens, buf_ingress, n=n) if n else None
        if res is not None:
            assert res.m == len(res.lens) == len(res.egress)
            if res.index is None:
                assert len(res.data) == res.m
            else:  # replicas share rows: every packet's row exists
                assert len(res.index) == res.m and res.index.max() < len(res.data)
            out.extend(res.packets())
        start = stop
    assert start == len(packets)
    return out


def random_sizes(rng: np.random.Generator, total: int, low: int = 1, high: int = 1024) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        sizes.append(int(rng.integers(low, high + 1)) if rng.random() < 0.7 else int(rng.integers(1, 9)))
    return sizes


def state(sw: SoftSwitch) -> dict:
    """Everything the two paths must agree on besides the packets."""
    counters = [sw.read_counters(j) for j in range(MAX_JOBS)]
    jobs = {}
    for job_id, job in sw.jobs.items():
        streams = {key: (s.used, s.bad) for key, s in job.streams.items()}  # with the seed: its future
        slots = job.slots
        jobs[job_id] = (
            slots.regs.tobytes(),
            slots.bitmap.tobytes(),
            slots.acc.tobytes(),
            streams,
            sw.read_worker_rx(job_id),
        )
    return {"counters": counters, "jobs": jobs}


def assert_same(packets: list[tuple[bytes, object]], specs: list[Spec], sizes: list[int], seed: int) -> dict:
    ref, bat = make_switch(specs, seed), make_switch(specs, seed)
    expected = run_reference(ref, packets)
    got = run_batched(bat, packets, sizes, np.random.default_rng(seed))
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a == b, f"emitted packet {i} differs"
    ref_state, bat_state = state(ref), state(bat)
    for j in range(MAX_JOBS):
        assert bat_state["counters"][j] == ref_state["counters"][j], f"counters of row {j}"
    assert bat_state["jobs"] == ref_state["jobs"]
    return ref_state


# ---- the differential tests ---------------------------------------------------------------------------
@pytest.fixture
def slot_path() -> str:
    """The comparisons below are of the compiled engine (softswitch/_swcore.c) against the per-packet
    reference. Without the compiled engine process_batch runs the reference packet by packet, and the
    comparison would be of the reference with itself: that path is checked against sums worked out by
    hand instead (test_results_are_the_sum_or_max_over_their_bitmap)."""
    if batch_module._swcore is None:
        pytest.skip("softswitch._swcore is not built here: nothing to compare the reference with")
    return "native"


@pytest.mark.parametrize("engine", ["per-packet", "batch-reference", "batch-native"])
def test_results_are_the_sum_or_max_over_their_bitmap(engine, monkeypatch):
    """An independent expectation for every engine: 80 hand-built rounds through a pool of 8 slots, each
    from a random subset of five workers (int32 values, a third of the rounds large enough to wrap around;
    a quarter MAX rounds), a short round closed by one of its senders' FLUSH. Every RESULT must carry
    numpy's int32 wrap-around sum (or max) over the senders, their count and their bitmap, to all five."""
    if engine == "batch-native" and batch_module._swcore is None:
        pytest.skip("softswitch._swcore is not built here")
    if engine == "batch-reference":
        monkeypatch.setattr(batch_module, "_swcore", None)
    n, k, pool = 5, 16, 8
    ports = list(range(40, 40 + n))
    sw = SoftSwitch(seed=0)
    sw.add_job(JobConfig(9, ports, None, pool, k))
    rng = np.random.default_rng(17)
    packets: list[tuple[bytes, object]] = []
    expected = {}  # (slot, seq) -> (payload, count, bitmap, MAX flag)
    for g in range(80):
        slot, seq = g % pool, g // pool + 1
        is_max = bool(rng.random() < 0.25)
        senders = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
        high = 2**31 if rng.random() < 0.35 else 1000
        values = rng.integers(-high, high, size=(len(senders), k))
        flags = int(Flag.MAX) if is_max else 0
        for w, v in zip(senders, values, strict=True):
            grad = make_packet(
                Op.GRAD, job_id=9, worker_id=w, slot=slot, seq=seq, payload=v, elems_per_packet=k,
                flags=flags, exp=0 if is_max else 7, weight=1,
            )  # fmt: skip
            packets.append((grad, ports[w]))
        if len(senders) < n:
            flush = make_packet(
                Op.FLUSH, job_id=9, worker_id=senders[0], slot=slot, seq=seq, elems_per_packet=k, flags=flags
            )
            packets.append((flush, ports[senders[0]]))
        total = values.max(axis=0) if is_max else (values.sum(axis=0) + 2**31) % 2**32 - 2**31
        expected[(slot, seq)] = (total, len(senders), sum(1 << w for w in senders), is_max)
    if engine == "per-packet":
        out = run_reference(sw, packets)
    else:
        out = run_batched(sw, packets, random_sizes(rng, len(packets), 1, 40), rng)
    results: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    for port, data in out:
        hdr = Header.unpack(data)
        assert hdr.op == Op.RESULT and hdr.job_id == 9
        results.setdefault((hdr.slot, hdr.seq), []).append((port, data))
    assert results.keys() == expected.keys()
    for key, (total, count, bitmap, is_max) in expected.items():
        copies = results[key]
        assert sorted(port for port, _ in copies) == sorted(port_key(p) for p in ports), key
        for _, data in copies:
            hdr = Header.unpack(data)
            assert (hdr.count, hdr.bitmap, bool(hdr.flags & Flag.MAX)) == (count, bitmap, is_max), key
            payload = np.frombuffer(data, dtype=">i4", count=k, offset=HEADER_BYTES)
            assert np.array_equal(payload, total), key


def test_the_native_engine_is_built_and_used(monkeypatch):
    """pip install builds softswitch._swcore where a compiler exists (as here, and in CI): process_batch
    must run it, not fall back to the reference."""
    assert batch_module.ENGINE == "native" and batch_module._swcore is not None
    calls = []
    run = batch_module._swcore.run

    def counting(*args):
        calls.append(args[3])
        return run(*args)

    monkeypatch.setattr(batch_module._swcore, "run", counting)
    packets = MixGenerator(MIXED, 79).packets(300)
    assert_same(packets, MIXED, [100, 200], 4)
    assert calls == [100, 200]


@pytest.mark.parametrize("seed", range(6))
def test_random_mix_matches_per_packet_in_random_batches(seed, slot_path):
    packets = MixGenerator(MIXED, seed).packets(2500)
    rng = np.random.default_rng(100 + seed)
    final = assert_same(packets, MIXED, random_sizes(rng, len(packets)), seed)
    # The mix reaches every branch of the contract (so the comparison means something).
    totals = {name: sum(c[name] for c in final["counters"]) for name in final["counters"][0]}
    assert all(totals.values()), {name: v for name, v in totals.items() if not v}


@pytest.mark.parametrize("seed", range(3))
def test_random_mix_with_quorum_changes_matches(seed, slot_path):
    """The liveness monitor lowers and raises quorums between batches (SoftSwitch.set_quorum on both
    switches at the same point): open rounds then meet a lowered quorum, and a duplicate into one closes
    it (docs/protocol.md, "A duplicate at the quorum"). The mix must draw that case, and the engines
    agree on it."""
    rng = np.random.default_rng(200 + seed)
    gen = MixGenerator(MIXED, 300 + seed)
    ref, bat = make_switch(MIXED, seed), make_switch(MIXED, seed)
    closed_by_dup = 0
    for _ in range(12):
        for spec in MIXED:
            local = sum(port is not None for port in spec.workers)
            quorum = int(rng.integers(1, local + 1)) if rng.random() < 0.6 else local
            ref.set_quorum(spec.job_id, quorum)
            bat.set_quorum(spec.job_id, quorum)
        packets = gen.packets(250)
        expected = []
        for data, port in packets:  # the reference, packet by packet, noting the new branch
            before = [ref.read_counters(spec.job_id) for spec in MIXED]
            expected.extend((port_key(egress), bytes(pkt)) for egress, pkt in ref.process(data, port))
            for spec, old in zip(MIXED, before, strict=True):
                now = ref.read_counters(spec.job_id)
                if now["grad_dup"] > old["grad_dup"] and now["result_quorum"] > old["result_quorum"]:
                    closed_by_dup += 1
        got = run_batched(bat, packets, random_sizes(rng, len(packets), 1, 200), rng)
        assert got == expected
        ref_state, bat_state = state(ref), state(bat)
        assert bat_state == ref_state
    assert closed_by_dup > 0


@pytest.mark.parametrize("seed", range(3))
def test_random_mix_as_one_batch(seed, slot_path):
    packets = MixGenerator(MIXED, 50 + seed).packets(3000)
    assert_same(packets, MIXED, [len(packets)], seed)


def test_random_mix_one_packet_per_batch():
    packets = MixGenerator(MIXED, 77).packets(600)
    assert_same(packets, MIXED, [1] * len(packets), 3)


def test_single_hot_slot_many_occurrences_per_batch(slot_path):
    """Every packet on 2 slots: many waves per batch, rounds opening and closing inside one batch."""
    specs = [Spec(1, [10, 11, 12, 13], pool=2, k=4, quorum=3, policies=[("down", GE_BURSTY, None)])]
    packets = MixGenerator(specs, 5).packets(1500)
    assert_same(packets, specs, [1500], 5)
    assert_same(packets, specs, random_sizes(np.random.default_rng(5), 1500, 200, 700), 5)


@pytest.mark.parametrize("n_workers", [2, 4])
def test_steady_state_stream_matches(n_workers):
    stream = steady_stream(n_workers, k=64, pool=512, units=3 * 512 + 100, window=24, seed=n_workers)
    specs = [Spec(1, [("10.1.0.1", 41000 + w) for w in range(n_workers)], pool=512, k=64)]
    packets = [(data, specs[0].workers[w]) for data, w, _ in stream]
    final = assert_same(packets, specs, random_sizes(np.random.default_rng(1), len(packets), 256, 1024), 0)
    c = final["counters"][1]
    assert c["result_quorum"] == 3 * 512 + 100 and c["tx_packets"] == n_workers * c["result_quorum"]


def test_lossy_steady_state_with_flushes_and_policies_matches(slot_path):
    n_workers = 4
    stream = steady_stream(n_workers, k=64, pool=512, units=1200, window=32, seed=9, loss=0.05)
    specs = [
        Spec(
            1,
            [("10.1.0.1", 41000 + w) for w in range(n_workers)],
            pool=512,
            k=64,
            quorum=3,
            policies=[("up", DropPolicy(p=0.05), None), ("down", GE_PLAIN, None)],
        )
    ]
    packets = [(data, specs[0].workers[w]) for data, w, _ in stream]
    final = assert_same(packets, specs, random_sizes(np.random.default_rng(2), len(packets), 64, 1024), 4)
    c = final["counters"][1]
    assert c["flush_partial"] and c["flush_resend"] and c["drop_policy_up"] and c["drop_policy_down"]


ROUND_SPECS = [
    Spec(1, [10, 11, 12], pool=64, k=8, quorum=2),
    Spec(2, list(range(100, 164)), pool=16, k=4, quorum=50),  # 64 workers: bitmap bit 63
    Spec(
        3,
        [("10.2.0.1", 7000 + w) for w in range(4)],
        pool=512,
        k=64,
        policies=[("up", DropPolicy(p=0.03), None), ("down", GE_PLAIN, 3)],
    ),
]


@pytest.mark.parametrize("spec", ROUND_SPECS, ids=lambda spec: f"job{spec.job_id}")
def test_rounds_match_in_random_batches(spec, slot_path):
    units, low, high = {1: (900, 8, 240), 2: (60, 16, 160), 3: (1400, 16, 700)}[spec.job_id]
    packets = RoundGenerator(spec, seed=spec.job_id).packets(units)
    rng = np.random.default_rng(spec.job_id)
    final = assert_same(packets, [spec], random_sizes(rng, len(packets), low, high), 7)
    # Rounds closed (job 1's batches span several rounds of a slot, job 2's rounds close before all 64
    # workers sent, job 3 is mostly plain rounds under its drop policies).
    assert final["counters"][spec.job_id]["result_quorum"] > units // 5


# ---- hand-made cases with known answers ----------------------------------------------------------------
K = 4
PORTS = [10, 11, 12]


def grad(w, slot=0, seq=1, values=(1, 2, 3, 4), **kw) -> bytes:
    return make_packet(
        Op.GRAD, job_id=1, worker_id=w, slot=slot, seq=seq, payload=np.array(values), elems_per_packet=K, **kw
    )


def flush(w, slot=0, seq=1, **kw) -> bytes:
    return make_packet(Op.FLUSH, job_id=1, worker_id=w, slot=slot, seq=seq, elems_per_packet=K, nelem=0, **kw)


def test_one_batch_runs_rounds_of_one_slot_in_order():
    sw = SoftSwitch()
    sw.add_job(JobConfig(1, PORTS, pool_size=4, elems_per_packet=K))
    big = 2**31 - 1
    packets = [
        (grad(0, values=(big, 1, 1, 1)), 10),
        (grad(1, values=(1, 1, 1, 1)), 11),  # wraps to INT32_MIN
        (grad(1), 11),  # duplicate
        (grad(2, values=(0, 0, 0, 5)), 12),  # closes round 1: 3 replicas
        (grad(2), 12),  # late: unicast RETX
        (grad(0, seq=2, values=(9, 9, 9, 9)), 10),  # round 2 starts in the same batch
        (flush(1, seq=2), 11),  # partial close of round 2: 3 replicas
        (flush(2, seq=1), 12),  # stale
        (flush(0, seq=2), 10),  # resend of round 2
    ]
    out = sw.process_batch(*pack(packets))
    assert list(out.egress) == [10, 11, 12, 12, 10, 11, 12, 10]
    acc1 = np.frombuffer(out.row(0)[HEADER_BYTES : HEADER_BYTES + 4 * K].tobytes(), dtype=">i4")
    assert list(acc1) == [INT32_MIN, 2, 2, 7]
    assert out.row(3)[2] & Flag.RETX and out.row(7)[2] & Flag.RETX and not out.row(4)[2] & Flag.RETX
    acc2 = np.frombuffer(out.row(4)[HEADER_BYTES : HEADER_BYTES + 4 * K].tobytes(), dtype=">i4")
    assert list(acc2) == [9, 9, 9, 9] and out.row(4)[7] == 1  # count 1
    c = sw.read_counters(1)
    expected = dict(rx_packets=9, grad_start=2, grad_add=2, grad_dup=1, grad_late_resend=1, result_quorum=1)
    expected.update(flush_partial=1, flush_stale=1, flush_resend=1, tx_packets=8)
    assert {k: v for k, v in c.items() if v} == expected


def test_max_round_and_several_jobs_with_different_k_in_one_batch():
    sw = SoftSwitch()
    sw.add_job(JobConfig(1, [10, 11], pool_size=4, elems_per_packet=K))
    sw.add_job(JobConfig(2, [("127.0.0.1", 9000)], pool_size=2, elems_per_packet=64))
    mx = int(Flag.MAX)
    other = make_packet(Op.GRAD, job_id=2, worker_id=0, payload=np.arange(64), elems_per_packet=64)
    packets = [
        (grad(0, values=(1, -5, 3, INT32_MIN), flags=mx), 10),
        (other, ("127.0.0.1", 9000)),
        (grad(1, values=(4, -7, 2, INT32_MIN), flags=mx), 11),
    ]
    out = sw.process_batch(*pack(packets))
    assert out.m == 3 and list(out.lens) == [HEADER_BYTES + 256, HEADER_BYTES + 16, HEADER_BYTES + 16]
    assert key_address(out.egress[0]) == ("127.0.0.1", 9000) and list(out.egress[1:]) == [10, 11]
    assert list(np.frombuffer(out.row(0)[HEADER_BYTES : HEADER_BYTES + 256].tobytes(), ">i4")) == list(
        range(64)
    )
    acc = np.frombuffer(out.row(1)[HEADER_BYTES : HEADER_BYTES + 16].tobytes(), ">i4")
    assert list(acc) == [4, -5, 3, INT32_MIN] and out.row(1)[2] & Flag.MAX


def test_edge_shapes_empty_short_only_and_buffer_growth():
    sw = SoftSwitch()
    sw.add_job(JobConfig(1, PORTS, quorum=1, pool_size=4096, elems_per_packet=K))
    empty = sw.process_batch(np.zeros((0, 52), np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert empty.m == 0 and empty.data.shape[0] == 0
    short = sw.process_batch(np.ones((3, 5), np.uint8), np.array([5, 0, 3]), np.array([10, 10, 10]))
    row0 = sw.read_counters(0)
    assert short.m == 0 and (row0["rx_packets"], row0["drop_malformed"]) == (3, 3)
    # A non-contiguous data view (every other row) is fine too.
    rows, lens, ingress = pack([(grad(0, slot=5000 + i), 10) for i in range(4)])
    spaced = np.repeat(rows, 2, axis=0)[::2]
    assert sw.process_batch(spaced, lens, ingress).m == 0 and sw.read_counters(1)["drop_slot_range"] == 4
    # 3000 quorum-1 rounds: 9000 replicas, more than the buffers first held.
    packets = [(grad(i % 3, slot=i), PORTS[i % 3]) for i in range(3000)]
    first = sw.process_batch(*pack(packets))
    assert first.m == 9000 and first.data.shape[1] >= HEADER_BYTES + 4 * K
    assert set(np.unique(first.lens)) == {HEADER_BYTES + 4 * K}


def test_port_keys():
    assert port_key(7) == 7 and port_key(np.int64(7)) == 7
    assert port_key(("10.0.0.1", 5000)) == (0x0A000001 << 16) | 5000
    assert key_address(port_key(("192.168.1.20", 65535))) == ("192.168.1.20", 65535)
    with pytest.raises(ValueError, match="IPv4"):
        port_key(("some-host", 5000))
    with pytest.raises(ValueError):
        port_key("10.0.0.1:5000")
    with pytest.raises(ValueError, match="dotted quad"):
        port_key(("127.1", 5000))  # never the address a datagram reports
    # A worker configured by host name has no key: process_batch never matches it (nor does process,
    # whose datagrams come from numeric addresses).
    sw = SoftSwitch()
    sw.add_job(JobConfig(1, [("localhost", 5000), ("127.0.0.1", 5001)], pool_size=4, elems_per_packet=K))
    assert list(sw.jobs[1].worker_keys) == [NO_KEY, port_key(("127.0.0.1", 5000 + 1))]
    out = sw.process_batch(*pack([(grad(0), ("127.0.0.1", 5000))]))
    assert out.m == 0 and sw.read_counters(1)["drop_bad_worker"] == 1


# ---- drop streams -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "policy",
    [
        DropPolicy(p=0.3),
        DropPolicy(p=1.0),
        GE_BURSTY,
        GE_PLAIN,
        DropPolicy("gilbert_elliott", p=1.0, r=1.0, loss_good=0.2, loss_bad=0.7),
        DropPolicy("gilbert_elliott", p=0.0, r=0.5),
    ],
)
def test_drop_stream_sequential_and_batched_decisions_are_identical(policy):
    n = 12_000
    one = DropStream(policy, seed=11)
    expected = np.array([one.drop() for _ in range(n)])
    rng = np.random.default_rng(0)
    mixed, parts, taken = DropStream(policy, seed=11), [], 0
    while taken < n:
        size = min(int(rng.integers(0, 5000)), n - taken)
        if rng.random() < 0.3:
            parts.append(np.array([mixed.drop() for _ in range(size)], dtype=bool))
        else:
            parts.append(mixed.drop_many(size))
        taken += size
    assert np.array_equal(np.concatenate(parts), expected)
    assert mixed.bad == one.bad
    assert abs(expected.mean() - policy.mean_loss) < 0.03


def test_no_policy_draws_nothing(monkeypatch):
    def no_draws(*args, **kwargs):
        raise AssertionError("a drop stream was drawn from")

    monkeypatch.setattr(DropStream, "drop", no_draws)
    monkeypatch.setattr(DropStream, "drop_many", no_draws)
    specs = [
        Spec(1, [10, 11, 12], pool=8, k=4),
        Spec(2, [20, 21], pool=8, k=4, policies=[(d, NO_LOSS, None) for d in ("up", "down", "param")]),
    ]
    packets = MixGenerator(specs, 3).packets(800)
    ref, bat = make_switch(specs), make_switch(specs)
    expected = run_reference(ref, packets)
    got = run_batched(bat, packets, [400, 400], np.random.default_rng(0))
    assert got == expected and len(expected) > 100
    assert all(not job.streams for sw in (ref, bat) for job in sw.jobs.values())


def test_policy_streams_replay_across_batch_cuts():
    """The same packets cut differently take the same decisions (drop streams are per receiver)."""
    packets = MixGenerator(MIXED, 21).packets(1500)
    outs = []
    for sizes in ([1500], [1] * 100 + [1400], list(itertools.repeat(37, 41))):
        sw = make_switch(MIXED, 8)
        outs.append(run_batched(sw, packets, sizes, np.random.default_rng(0)))
    assert outs[0] == outs[1] == outs[2]


def test_policy_changes_between_batches_take_the_same_decisions_as_per_packet():
    """The engine keeps the drop streams it looked up between batches: a policy changed, removed or
    added, and a job reset (fresh streams), between two batches must take effect in the next batch
    exactly as in the per-packet reference given the same changes at the same points."""
    packets = MixGenerator(MIXED, 33).packets(2000)
    changes = [
        lambda sw: sw.set_drop_policy(1, "up", DropPolicy(p=0.6)),
        lambda sw: sw.reset_job(1),  # counters and streams start again, the policy stays
        lambda sw: sw.set_drop_policy(2, "down", GE_PLAIN),
        lambda sw: sw.set_drop_policy(1, "up", None),
    ]
    ref, bat = make_switch(MIXED, 4), make_switch(MIXED, 4)
    expected: list[tuple[int, bytes]] = []
    got: list[tuple[int, bytes]] = []
    rng = np.random.default_rng(2)
    for i, part in enumerate(np.array_split(np.arange(len(packets)), len(changes) + 1)):
        chunk = [packets[j] for j in part]
        expected += run_reference(ref, chunk)
        got += run_batched(bat, chunk, [len(chunk) // 2, len(chunk)], rng)
        if i < len(changes):
            changes[i](ref)
            changes[i](bat)
    assert got == expected and len(expected) > 300
    for job in (1, 2):
        assert ref.read_counters(job) == bat.read_counters(job)
    assert bat.read_counters(1)["drop_policy_up"] > 0


def test_output_buffers_stay_the_size_of_a_batch_when_jobs_come_and_go():
    """A switch whose jobs change K changes its row width each time: the output rows are rebuilt at what a
    batch needs, not doubled (a sweep of lta train once asked for 33 GiB after a few dozen jobs)."""
    sw = SoftSwitch()
    for i in range(40):
        k = 64 if i % 2 else 256
        sw.add_job(JobConfig(1, [10, 11], pool_size=8, elems_per_packet=k))
        packets = [
            (
                make_packet(
                    Op.GRAD, job_id=1, worker_id=w, slot=0, seq=1, payload=np.arange(k), elems_per_packet=k
                ),
                10 + w,
            )
            for w in range(2)
        ]
        out = sw.process_batch(*pack(packets))
        assert out.m == 2
        sw.remove_job(1)
    engine = sw._batch
    assert len(engine._out_data) <= 1024 and len(engine._out_index) <= 1024
