"""How a worker talks to its switch: packet size, window, deadlines, fallbacks (one dataclass)."""

from __future__ import annotations

import enum
import ipaddress
import socket
from dataclasses import dataclass

from hostlib.job import MIN_WORKER_POOL_SIZE, pool_size
from hostlib.protocol import (
    DEFAULT_ELEMS_PER_PACKET,
    HEADER_BYTES,
    MAX_ELEMS_PER_PACKET,
    MAX_LEAVES,
    check_elems_per_packet,
)

_IP_UDP_BYTES = 20 + 8
_IP_MTU = getattr(socket, "IP_MTU", 14)  # Linux: the path MTU of a connected socket


class Fallback(enum.IntEnum):
    NONE = 0  # the chunk was renormalized from a RESULT with count > 0
    PREV = 1  # the value this worker returned for the chunk last time (paper's Algorithm 1)
    ZERO = 2  # zero ("bubble filling", LTP)
    LOCAL = 3  # this worker's own contribution


FALLBACK_POLICIES = {"prev": Fallback.PREV, "zero": Fallback.ZERO, "local": Fallback.LOCAL}


@dataclass
class TransportConfig:
    elems_per_packet: int = DEFAULT_ELEMS_PER_PACKET  # K
    # P, must equal the job's pool size on the switch; slot P-1 is the probe's. 0: the protocol's
    # default for K (hostlib.protocol.default_pool_size: 2048, 512 above 1024 values a packet).
    pool_size: int = 0
    window: int | None = None  # units in flight; None: what the socket buffers hold, default_window_cap, P-1
    # Until the first RESULT of a reduce shows that every worker has started it, units wait this long:
    # workers reach a reduce at different times (skew), and flushing then would throw their data away.
    # At least one RTO and a give-up, though, while no peer looks dead (Deadlines.sync_wait_s): a live
    # peer may still be finishing the reduce before, its last RESULT lost.
    sync_deadline_ms: float = 200.0
    # A unit some peer has not reached yet (by the bitmaps, see Deadlines.fast_flush) waits this long
    # for it: a late peer is not a lost packet. Units every peer has passed are flushed at once.
    lag_deadline_ms: float = 200.0
    # In the tail of a reduce, a unit that waits lag_deadline_ms for a peer (it may be late) is probed
    # one RTO after its send: this worker's GRAD goes again. The switch adds it if the first copy was
    # lost, drops it as a duplicate while the round is open, and answers a closed round with its stored
    # RESULT: a lost RESULT or GRAD of the tail costs about an RTO instead of the lag deadline, and no
    # late peer is cut off (a FLUSH still waits the lag deadline). One probe per unit, sent
    # flush_copies times (a lost copy or answer costs the lag deadline, a duplicate one packet).
    # Off in exact mode (each GRAD's fate is the drop policy's one decision there).
    tail_probe: bool = True
    # Exponent packets are 1/K of the traffic and gate every data packet: send each this many times
    # (the switch ignores duplicates), so one is lost with probability p**copies instead of p.
    exp_copies: int = 2
    # FLUSHes too: a lost FLUSH (or its answer) costs a doubled RTO; a duplicate costs one packet.
    flush_copies: int = 2
    # The last tail_units data units of a reduce go tail_copies times too. A lost GRAD mid-reduce is
    # found by a later unit's RESULT (every worker past it) and flushed at once; the last units have no
    # later one, so their losses waited for a timer (tail probe, FLUSH): a reduce of 66 jumbo chunks
    # (4 workers, 10% loss) had p90 114-148 ms against p50 43-52. With the last two sent twice, the last
    # RESULTs come (the switch drops the copy of a counted GRAD as a duplicate) and prove the units
    # before them passed: p90 48-53 ms (docs/protocol.md, "Host side"). Off in exact mode, as the tail
    # probe is (a copy would draw the drop policy again).
    tail_units: int = 2
    tail_copies: int = 2
    # Those extra copies (exp_copies, tail_copies) only pay where packets are lost; on a quiet network each
    # is a frame of the bottleneck's time (3 frames of the 129 of a 1 MiB reduce at 1 Gbit/s, MTU 9000). After
    # this many units in a row settled without a sign of loss (a unit found lost, a FLUSH, a probe, a
    # resend, a unit given up or a RESULT short of a worker), a reduce sends each packet once; the first
    # sign brings the copies back from the next reduce on. 0: always send the copies. (FLUSHes keep
    # flush_copies: they are sent only on a loss.) Off in exact mode, which keeps its packets as configured.
    quiet_units: int = 1024
    # Speculated exponents (docs/protocol.md, "Speculated exponents"): a chunk whose exponent round's RESULT
    # this worker got in the last reduce of the same key goes at that exponent plus speculate_bits, at once,
    # without waiting for this reduce's exponent round (which still runs). A chunk whose values exceed it,
    # or lie more than speculate_guard_bits below it (zeros excepted), goes flagged SATURATED and is redone
    # at the agreed exponent: the sum never wraps, and a result is never coarser than 2^speculate_guard_bits
    # times the exponent round's bound. 0: off (every chunk waits for its exponent round, as before). Off in
    # exact mode, behind leaf switches, with renormalize other than "count", above 32 workers, and for
    # owner-only and critical chunks.
    speculate_bits: int = 3
    speculate_guard_bits: int = 8
    initial_deadline_ms: float = 50.0  # the RTO before any round trip was measured
    min_deadline_ms: float = 20.0  # lower it on quiet, low-RTT networks (lta bench lossy does)
    max_deadline_ms: float = 500.0
    max_flushes: int = 3
    # A FLUSH is answered by the switch at once (the stored RESULT resent, or the round it closed), so a
    # FLUSH whose answer was lost is retried on the FLUSH round trip, floored here, not at min_deadline_ms:
    # at 20% RESULT loss the 20 ms floor, doubled per retry, made each twice-lost answer a 40-60 ms stall
    # of the worker's span (p50 525 ms a 1 MiB reduce against 44 ms lossless). Retries go on, doubling,
    # past max_flushes until the time a unit took to be given up with the min_deadline_ms floor
    # (Deadlines.give_up_s), so a switch slowed down for a while is not given up on sooner than before.
    min_flush_deadline_ms: float = 2.0
    fallback: str = "prev"  # prev | zero | local
    # count: divide each chunk's sum by its arrival count (unbiased). weight: by the summed sample
    # weights. none: divide by N, as systems without counts do; a chunk missing contributions then
    # takes the fallback, except `zero`, which keeps sum/N (the lost ones count as zeros, LTP's
    # bubble filling). `none` exists for baselines.
    renormalize: str = "count"
    reduce_timeout_s: float = 60.0
    socket_buffer_bytes: int = 8 << 20
    # Packet I/O: None picks the fastest available (batched recvmmsg/sendmmsg, else plain socket calls);
    # "plain" forces one system call per packet. The environment variable LTA_IO does the same.
    io: str | None = None
    seed: int = 0
    # The run this worker belongs to (docs/protocol.md, "Run after run"): one nonzero 32-bit value shared
    # by every worker of a run and new for each run; the health probe carries it (`step`), and a switch
    # forgets the job's slots at the first probe of a new one, so a run starts clean on a switch that
    # served earlier runs. 0: none (the probe announces nothing; the switch keeps its slots).
    incarnation: int = 0
    # Health. Before the first reduce, check_switch() waits this long for the switch to answer a probe
    # (0 skips the check). During training, a reduce where at least `unhealthy_fraction` of the chunks
    # got nothing from the network (no RESULT, or a RESULT with count 0) is unhealthy; after
    # `unhealthy_reduces` of them in a row covering at least `unhealthy_min_chunks` chunks, the worker
    # raises UnhealthyTraining ("raise"), logs a warning ("warn"), or does nothing ("ignore").
    # A worker locked out is unhealthy too: its own bit missing from every RESULT of a whole window (its
    # peers close every round without it, docs/protocol.md "Lost or late?") at the
    # end of `unhealthy_reduces` reduces in a row, each with at least `lockout_fraction` of its chunks
    # without an aggregate. Its replica then trains on stale fallbacks (chaos seed 84: exit 0, untrained).
    health_timeout_s: float = 5.0
    unhealthy_fraction: float = 0.9
    lockout_fraction: float = 0.25
    # A reduce the peers had left before this worker started it (every unit overtaken: a unit one pool past
    # its last was answered) is a late worker catching up, not unhealthy: up to this many in a row.
    # Small on purpose: each skipped reduce hands the caller fallbacks for every chunk, and a worker that
    # skips to the end of a run (its peers finished while it was stopped) must not exit as if it trained.
    catch_up_reduces: int = 5
    unhealthy_reduces: int = 3
    unhealthy_min_chunks: int = 32
    on_unhealthy: str = "raise"
    # Pacing (LTP's BDP pacing, hostlib/transport/pacing.py): a token bucket in the send path keeps the
    # worker at a rate instead of sending a whole window at once into the bottleneck's queue.
    # pace_gbps: the rate in Gbit/s of frames on the wire (Ethernet + IPv4 + UDP + LTA, what tbf counts);
    # 0 with pace_learn off: unpaced. pace_learn: learn the rate from the RESULT inter-arrival times of
    # past reduces (a max filter, probed upward as BBR does); pace_gbps is then the rate until the first
    # estimate (0: unpaced until then). pace_burst_ms: the bucket holds this long at the rate (at least
    # two frames). Tokens that overflow it are lost, so it must cover the longest gap between two wake-ups
    # of the send loop: 1 ms when idle, but 5-10 ms on a loaded host (measured in network namespaces on 2
    # shared cores, 2 workers + softswitch at 200 Mbit/s: with 2 ms the paced reduce took 1.6x the link
    # limit, with 10 ms 1.05x). A burst adds at most this much to the bottleneck's queue.
    pace_gbps: float = 0.0
    pace_learn: bool = False
    pace_burst_ms: float = 10.0
    # Adaptive early close (LTP's Early Close, hostlib/transport/earlyclose.py). None: off. theta: the
    # loss-tolerant threshold: once the reduce has run past its expected completion time (learned) and at
    # least 1 - theta of its units came back with every worker counted, the rest are FLUSHed at once;
    # past that time + early_close_slack_ms (LTP's constant C: 30 ms in a data centre) every unit still
    # open is. Units then wait per-unit deadlines from the measured RTT and serialization time.
    early_close_theta: float | None = None
    early_close_slack_ms: float = 30.0
    # Critical units (allreduce(critical=...)) are resent, never FLUSHed, up to this many times; then they
    # are flushed like the rest. A switch slot remembers one round: once the other workers have moved it
    # on (their next use of the slot, D units later), a worker that lost the RESULT can never get it back,
    # and without a bound it would hold its own next use of the slot, and so every worker, forever.
    critical_max_resends: int = 8
    # A late peer is not a lost packet: while some live peer has not shown (by the bitmaps) that it sent a
    # critical unit, the unit's resends do not count toward critical_max_resends, for up to this long after
    # its first send. Without it a peer descheduled for 15 RTOs (300 ms at the 20 ms floor) had the
    # critical units it had not sent yet closed short without it. Nor do those in the first two
    # max_deadline_ms, the longest a live peer whose GRAD was lost takes to resend it
    # (Deadlines.waiting_for_peers). Longer than the liveness timeout (3 s):
    # a dead peer's rounds close by the quorum the liveness monitor lowers, at a survivor's next resend
    # (a duplicate at the lowered quorum closes the round: docs/protocol.md, "Switch contract"; every
    # target applies it). 0: every resend counts.
    critical_wait_ms: float = 5000.0
    # Liveness: a HEARTBEAT to the switch every this many seconds (0: none), so the control plane's
    # liveness monitor tells a computing worker from a dead one (hostlib/liveness.py).
    heartbeat_interval_s: float = 0.5
    # A peer whose relayed heartbeat (hostlib.protocol.ALIVE_CHUNK) came within this many seconds is alive:
    # it is not presumed dead, however many RESULTs lack its bit (deadlines.py). A peer never heard this
    # way (heartbeats off, another leaf) is judged by the RESULTs alone, as before.
    peer_alive_s: float = 2.0
    # Exact experiments under *emulated* loss (a lossless path whose switch drops packets by seeded
    # policies that spare CRITICAL packets, as the softswitch does): no round is closed by a timer. Each
    # reduce ends with a fence, one zero chunk marked critical (so spared), whose RESULT carries every
    # worker's bit: every worker has then provably sent every unit, and the rounds still open lost a
    # packet to the policy; they are FLUSHed at once (Deadlines.fast_flush) and close with exactly the
    # contributions the policy let through. Exponent units are critical too (a lost one blocks the data
    # behind it; with exp_copies the real loss of all copies is p**copies). Pair with long deadlines
    # (they are then only a safety net: stats.flushes_on_timer counts what they closed) and a parameter
    # exchange that serves resend requests only when it publishes (exchange.py does, in this mode).
    exact: bool = False
    # The job's workers sit behind leaf switches (docs/protocol.md, "Hierarchy") in contiguous blocks of
    # these sizes, in worker-id order (softswitch.hierarchy.leaf_blocks makes such blocks); empty: one
    # switch, or not known. A FLUSH closes a round only at its sender's leaf, so the deadlines then pick
    # one first FLUSH per leaf and unit, and stagger ranks within a leaf, where a flat job picks one per
    # unit (Deadlines.fast_flush): otherwise a unit stuck at one leaf waited, in (L-1)/L of the cases,
    # for a first FLUSH that went to another leaf (which only resends its partial) and then for the
    # others' one FLUSH round trip later, or, in the tail, for a later rank's stagger (up to +50% RTO).
    leaf_sizes: tuple[int, ...] = ()
    # Behind leaves, a worker alone in its block (leaf_sizes) has no leaf switch: it is its own leaf, the
    # spine's contributor leaf_index(leaf_sizes, worker_id), at its own address in the spine's job
    # (docs/protocol.md, "A worker as its own leaf"). Its packets are then partials of one (worker_id =
    # its leaf's id, count 1, its own bit) and its FLUSHes follow a leaf's upward rules: the first of a
    # unit sends the unit's GRAD again, a repeated one (RETX) sends it as a FLUSH, which closes the
    # spine's round. Workers in blocks of two or more ignore it, so one setting serves the whole job.
    own_leaf: bool = False

    def __post_init__(self) -> None:
        check_elems_per_packet(self.elems_per_packet)
        self.pool_size = pool_size(self.pool_size, self.elems_per_packet, minimum=MIN_WORKER_POOL_SIZE)
        self.leaf_sizes = tuple(self.leaf_sizes)
        if len(self.leaf_sizes) > MAX_LEAVES or any(size < 1 for size in self.leaf_sizes):
            raise ValueError(
                f"leaf_sizes must be at most {MAX_LEAVES} block sizes, each >= 1, got {self.leaf_sizes}"
            )
        if self.fallback not in FALLBACK_POLICIES:
            raise ValueError(f"fallback must be one of {sorted(FALLBACK_POLICIES)}, got {self.fallback!r}")
        if self.renormalize not in ("count", "weight", "none"):
            raise ValueError(f"renormalize must be 'count', 'weight' or 'none', got {self.renormalize!r}")
        if self.exp_copies < 1 or self.flush_copies < 1 or self.tail_copies < 1:
            raise ValueError(
                f"exp_copies, flush_copies and tail_copies must be >= 1, got {self.exp_copies}, "
                f"{self.flush_copies}, {self.tail_copies}"
            )
        if not 0 <= self.incarnation <= 0xFFFFFFFF:
            raise ValueError(f"incarnation must be in 0..2**32-1 (0: none), got {self.incarnation}")
        if not 0 <= self.speculate_bits <= self.speculate_guard_bits <= 24:
            raise ValueError(
                f"need 0 <= speculate_bits <= speculate_guard_bits <= 24, got {self.speculate_bits} and "
                f"{self.speculate_guard_bits}"
            )
        if self.quiet_units < 0:
            raise ValueError(f"quiet_units must be >= 0, got {self.quiet_units}")
        if self.tail_units < 0:
            raise ValueError(f"tail_units must be >= 0, got {self.tail_units}")
        if self.window is not None and not 1 <= self.window <= self.data_slots:
            raise ValueError(f"window must be in 1..pool_size-1={self.data_slots}, got {self.window}")
        if not 0 < self.min_deadline_ms <= self.max_deadline_ms:
            raise ValueError("need 0 < min_deadline_ms <= max_deadline_ms")
        if not 0 < self.min_flush_deadline_ms <= self.max_deadline_ms:
            raise ValueError("need 0 < min_flush_deadline_ms <= max_deadline_ms")
        if self.health_timeout_s < 0 or not 0 < self.unhealthy_fraction <= 1:
            raise ValueError("need health_timeout_s >= 0 and 0 < unhealthy_fraction <= 1")
        if self.catch_up_reduces < 0:
            raise ValueError(f"catch_up_reduces must be >= 0, got {self.catch_up_reduces}")
        if not 0 < self.lockout_fraction <= 1:
            raise ValueError(f"need 0 < lockout_fraction <= 1, got {self.lockout_fraction}")
        if self.unhealthy_reduces < 1 or self.unhealthy_min_chunks < 1:
            raise ValueError("unhealthy_reduces and unhealthy_min_chunks must be >= 1")
        if self.peer_alive_s <= 0:
            raise ValueError(f"peer_alive_s must be > 0, got {self.peer_alive_s}")
        if self.heartbeat_interval_s < 0:
            raise ValueError(f"heartbeat_interval_s must be >= 0, got {self.heartbeat_interval_s}")
        if self.on_unhealthy not in ("raise", "warn", "ignore"):
            raise ValueError(f"on_unhealthy must be 'raise', 'warn' or 'ignore', got {self.on_unhealthy!r}")
        if self.pace_gbps < 0 or self.pace_burst_ms <= 0:
            raise ValueError(
                f"need pace_gbps >= 0 (0: unpaced) and pace_burst_ms > 0, got {self.pace_gbps}, "
                f"{self.pace_burst_ms}"
            )
        if self.early_close_theta is not None and not 0.0 <= self.early_close_theta < 1.0:
            raise ValueError(
                f"early_close_theta is the share of units a reduce may close without every worker, in "
                f"[0, 1) (None: off), got {self.early_close_theta}"
            )
        if self.critical_max_resends < 0:
            raise ValueError(f"critical_max_resends must be >= 0, got {self.critical_max_resends}")
        if self.critical_wait_ms < 0:
            raise ValueError(f"critical_wait_ms must be >= 0, got {self.critical_wait_ms}")
        if self.early_close_slack_ms < 0:
            raise ValueError(f"early_close_slack_ms must be >= 0, got {self.early_close_slack_ms}")

    @property
    def data_slots(self) -> int:
        """Slots that carry units: all but the last, which the health probe uses."""
        return self.pool_size - 1


def default_window_cap(packet_bytes: int) -> int:
    """The default window's cap: 256 units for packets above 4 KiB, whose kernel buffers (skb truesize, up
    to twice the datagram) fill a socket buffer long before the count does (at 8972 bytes, 464 in flight
    overflowed an 8 MiB buffer); none for smaller ones (the pool's data slots bound it), where the window,
    not the buffer, sets how many packets a worker handles per wake-up (K=64: 511 instead of 256 cut a
    worker's CPU per reduce by about a fifth)."""
    return 256 if packet_bytes > 4096 else 65535


def elems_for_mtu(mtu: int) -> int:
    """The largest K whose packet (IPv4 + UDP + LTA header + K int32) fits one frame of ``mtu`` bytes."""
    return max(1, min(MAX_ELEMS_PER_PACKET, (mtu - _IP_UDP_BYTES - HEADER_BYTES) // 4))


def path_mtu(addr: tuple[str, int]) -> int:
    """The MTU of the route to ``addr`` as the kernel knows it (a connected UDP socket's IP_MTU).
    Loopback counts as one 64 KiB datagram: the loopback device's MTU is 64 KiB and nothing fragments."""
    host = socket.gethostbyname(addr[0])
    if ipaddress.ip_address(host).is_loopback:
        return 65535
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, addr[1]))
            return int(probe.getsockopt(socket.IPPROTO_IP, _IP_MTU))
        except OSError:
            return 1500


def elems_for_path(addr: tuple[str, int]) -> int:
    """Default K for a software switch at ``addr``: one packet per frame of the path's MTU (1500 → 359,
    9000 → 2234, loopback → 16367). P4 switches keep the K their program was compiled for (64)."""
    return elems_for_mtu(path_mtu(addr))
