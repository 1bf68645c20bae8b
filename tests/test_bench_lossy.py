"""``lta bench lossy``: the wire accounting against hand-counted frames, and one short lossy point run
for real (root, network namespaces, nftables: marked ``mininet``) with its output checked for
structure, measured loss, and exact lta results wherever a chunk's RESULT came back. No timings are
asserted: they depend on the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lta.bench.lossy import elems_for_mtu, gloo_wire_bytes, link_limit_ms, lta_frame_bytes, lta_wire_bytes
from mininet_topos.netns import leftovers
from tests.conftest import netns_skip_reason

REPO = Path(__file__).resolve().parents[1]
STAT_KEYS = {"mean_ms", "p50_ms", "p99_ms", "p99_9_ms", "max_ms", "link_limit_ms", "p50_over_limit"}


_REASON = netns_skip_reason()


# ---- wire accounting (no root) ------------------------------------------------------------------
def test_elems_per_packet_fills_the_mtu_with_a_power_of_two():
    # 9000 - 20 (IPv4) - 8 (UDP) - 36 (LTA) = 8936 bytes = 2234 int32 -> 2048; 1500 -> 359 -> 256
    assert elems_for_mtu(9000) == 2048
    assert elems_for_mtu(1500) == 256
    assert lta_frame_bytes(2048) == 14 + 20 + 8 + 36 + 8192


def test_link_limits_count_every_header():
    # 64 KiB = 16384 float32 = 8 chunks of 2048, one exponent unit sent twice: 10 frames of 8270 bytes
    assert lta_wire_bytes(16384, 2048, exp_copies=2) == 10 * 8270
    assert link_limit_ms(10 * 8270, 200.0) == pytest.approx(10 * 8270 * 8 / 200e6 * 1e3)
    # gloo, 2 ranks, 1 MiB: the whole tensor each way in 8948-byte segments (118 of them, 66 bytes of
    # headers each) plus 59 ACK frames of 66 bytes for the stream coming the other way
    assert gloo_wire_bytes(1 << 20, 2, 9000) == (1 << 20) + 118 * 66 + 59 * 66
    # 4 ranks move 2(N-1)/N = 1.5 times the tensor
    assert gloo_wire_bytes(1 << 20, 4, 9000) > 1.5 * (1 << 20)


# ---- one short lossy point, for real --------------------------------------------------------------
@pytest.mark.mininet
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_short_lossy_point_reports_both_systems_and_lta_is_exact(tmp_path):
    plot = tmp_path / "lossy.png"
    argv = [sys.executable, "-m", "lta.cli", "bench", "lossy", "--workers", "2", "--mib", "0.0625",
            "--loss", "0.01", "--iters", "20", "--warmup", "2", "--json", "--plot", str(plot)]  # fmt: skip
    bench = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    stdout, stderr = bench.communicate(timeout=300)
    assert bench.returncode == 0, stderr[-3000:]
    assert not [name for name in leftovers() if f"lta-{bench.pid}-" in name], "namespaces left behind"
    out = json.loads(stdout)
    assert out["config"]["mtu"] == 9000 and out["config"]["elems_per_packet"] == 2048
    (point,) = out["points"]
    assert point["loss"] == 0.01
    for system in ("gloo", "lta"):
        stats = point[system]
        assert STAT_KEYS <= set(stats)
        assert 0 < stats["p50_ms"] <= stats["p99_ms"] <= stats["p99_9_ms"] <= stats["max_ms"]
        # the nftables counters saw this system's packets both ways; the fraction dropped is reported
        measured = stats["measured_loss"]
        assert measured["up_packets"] > 0 and measured["down_packets"] > 0
        assert 0.0 <= measured["up_loss"] < 0.1 and 0.0 <= measured["down_loss"] < 0.1
    assert point["lta"]["link_limit_ms"] == pytest.approx(10 * 8270 * 8 / 200e6 * 1e3)
    assert set(point["ratios"]) == {"gloo_over_lta_p50", "gloo_over_lta_p99", "gloo_over_lta_p99_9"}

    lta = point["lta"]
    chunks = lta["chunks"]
    # every chunk of every timed reduce on both ranks is accounted for
    assert chunks["full"] + chunks["partial"] + chunks["fallback"] == 2 * 20 * 8
    assert chunks["full"] > 0
    # every chunk with a RESULT was checked against numpy's mean of the contributors in its bitmap,
    # within the codec's bound: exact where the count was full, and unbiasedly renormalized elsewhere
    assert lta["chunks_checked"] == chunks["full"] + chunks["partial"]
    assert lta["exact"] and lta["worst_error_over_tolerance"] < 1.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
