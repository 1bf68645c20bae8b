"""Sending at a rate (LTP's BDP pacing): a token bucket for the batched send path, and the rate learned
from how fast RESULTs come back.

Without pacing a worker puts a whole window on its link at once: the bottleneck (a tbf, a switch port)
queues it, the round trip of the last unit grows by the window's serialization time, and a window
larger than the queue is dropped by the queue itself: loss the sender caused. The :class:`TokenBucket`
answers, per wake-up of the unit engine, *how many* packets may go now (never a sleep per packet): the
tokens that accumulated at the rate since the last send, capped at a small burst. Every packet sent
(data, exponent copies, FLUSHes, resends) spends its frame's bytes; only units wait for tokens, control
packets go at once and leave the bucket in debt.

:class:`RateLearner` estimates the bottleneck rate as BBR does: one delivery-rate sample per reduce,
a max filter over the last ``window`` samples, and a pacing gain cycle that probes for more rate and
then drains the queue the probe built (a sender paced at exactly its estimate could never measure
more). The sample is the rate at which the reduce's RESULTs came back between the 10th and the 90th
percentile of their arrivals: they come back spaced by the slowest link on the way, and the two ends
are not the link's (the first RESULTs wait for the exponent round, the last ones for lost packets'
deadlines). BBR's phases last one round trip, with gains 1.25 and 0.75; here a phase is a whole
reduce, which can be longer than the bottleneck's queue at 25% over the rate (a 4 MiB reduce at
200 Mbit/s: 170 ms, and 25% of that is 42 ms of tbf's 50 ms queue), so the gains are 1.1 and 0.9; and
between probes the worker cruises at 0.97 of its estimate, not 1: a user-space sender's bursts (the
bucket, see TokenBucket) leave a standing queue that a sender at exactly the rate never drains, and the
estimate itself is a maximum (measured in network namespaces at 200 Mbit/s: cruising at 1.0, tbf
dropped 178 frames in 60 reduces of 4 MiB).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

# Bytes a frame carries besides the UDP payload, as tbf counts them: Ethernet 14 + IPv4 20 + UDP 8.
WIRE_OVERHEAD_BYTES = 14 + 20 + 8
PACING_GAINS = (1.1, 0.9, 0.97, 0.97, 0.97, 0.97, 0.97, 0.97)  # BBR's ProbeBW cycle, a reduce per phase
_MIN_SAMPLE_PACKETS = 16  # a reduce with fewer RESULTs gives no rate sample
_SAMPLE_FROM, _SAMPLE_TO = 0.1, 0.9  # the share of a reduce's RESULTs the sample spans
_UNPACED = 1 << 30  # "no limit" as a packet count


def frame_bytes(packet_bytes: int) -> int:
    """Bytes of one LTA packet on the wire (what a tbf or a switch port serializes)."""
    return packet_bytes + WIRE_OVERHEAD_BYTES


class TokenBucket:
    """Tokens (bytes) accrue at ``rate_bps / 8`` per second up to ``burst_bytes``; a packet spends its
    frame's bytes. A rate of 0 means unpaced: every question gets "as many as you like"."""

    def __init__(self, rate_bps: float, burst_s: float, frame: int) -> None:
        self.frame = frame
        self.burst_s = burst_s
        self.rate_Bps = 0.0
        self.burst_bytes = 0.0
        self.tokens = 0.0
        self.last = 0.0
        self.set_rate(rate_bps)

    @property
    def paced(self) -> bool:
        return self.rate_Bps > 0

    @property
    def rate_bps(self) -> float:
        return self.rate_Bps * 8

    def set_rate(self, rate_bps: float) -> None:
        """Change the rate; the bucket keeps its tokens (capped to the new burst)."""
        self.rate_Bps = max(0.0, rate_bps) / 8
        self.burst_bytes = max(2.0 * self.frame, self.rate_Bps * self.burst_s)
        self.tokens = min(self.tokens, self.burst_bytes)

    def _refill(self, now: float) -> None:
        if now > self.last:
            self.tokens = min(self.burst_bytes, self.tokens + (now - self.last) * self.rate_Bps)
            self.last = now

    def allowance(self, now: float) -> int:
        """How many frames may be sent at ``now``."""
        if not self.paced:
            return _UNPACED
        self._refill(now)
        return int(self.tokens // self.frame) if self.tokens > 0 else 0

    def spend(self, packets: int, now: float) -> None:
        """``packets`` frames went out at ``now`` (the bucket may go into debt)."""
        if self.paced:
            self._refill(now)
            self.tokens -= packets * self.frame

    def wait_s(self, now: float) -> float:
        """Seconds until one more frame may go (0 when it may now)."""
        if not self.paced:
            return 0.0
        self._refill(now)
        return max(0.0, (self.frame - self.tokens) / self.rate_Bps)


class RateLearner:
    """The bottleneck rate from RESULT arrivals: a max filter over the last ``window`` reduces' samples,
    and the pacing rate for the next reduce (estimate x the gain of its phase)."""

    def __init__(self, window: int = 10) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self.phase = 0

    @property
    def estimate_bps(self) -> float:
        """The max delivery rate seen over the window (0: no sample yet)."""
        return max(self.samples) if self.samples else 0.0

    def sample(self, arrivals: Sequence[tuple[float, int]], frame: int) -> float | None:
        """One reduce's delivery rate from its RESULT batches, ``(arrival time, frames)`` in order: the
        frames that came between the batch holding the 10th percentile of them and the one holding the
        90th, over the time between those two batches. Returns the sample in bit/s, or None when the
        reduce was too short to tell (too few RESULTs, or all in one batch)."""
        if not arrivals:
            return None
        times = np.array([t for t, _ in arrivals])
        cum = np.cumsum([n for _, n in arrivals])
        total = int(cum[-1])
        if total < _MIN_SAMPLE_PACKETS:
            return None
        i = int(np.searchsorted(cum, _SAMPLE_FROM * total))
        j = int(np.searchsorted(cum, _SAMPLE_TO * total))
        span = times[j] - times[i]
        if span <= 0:
            return None
        rate = float((cum[j] - cum[i]) * frame * 8 / span)
        self.samples.append(rate)
        return rate

    def next_rate_bps(self) -> float:
        """The pacing rate for the next reduce (advances the gain cycle); 0 while nothing is known."""
        gain = PACING_GAINS[self.phase % len(PACING_GAINS)]
        self.phase += 1
        return self.estimate_bps * gain
