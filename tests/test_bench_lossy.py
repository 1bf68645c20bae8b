"""``lta bench lossy``: the wire accounting against hand-counted frames, ``--rate`` parsing and the
limits it feeds, and, for real (root, network namespaces, nftables: marked ``mininet``), the links'
MTU and tbf settings, one short lossy point with its output checked for structure, measured loss,
and exact lta results wherever a chunk's RESULT came back, and one loss-free point at 1 Gbit/s whose
times must respect the link. No timing of our own speed is asserted: it depends on the machine."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lta.bench import lossy
from lta.bench.lossy import (
    LossyConfig,
    deadline_floor_ms,
    elems_for_mtu,
    format_rate,
    gloo_wire_bytes,
    link_limit_ms,
    lta_frame_bytes,
    lta_wire_bytes,
    parse_rate_mbit,
    summarize_system,
    tbf_burst_bytes,
    tbf_limit_bytes,
    window_for_rate,
)
from lta.cli import build_parser, main
from mininet_topos.netns import leftovers
from tests.conftest import netns_skip_reason

REPO = Path(__file__).resolve().parents[1]
Z = 4.42  # two-sided 1e-5, as tests/test_mininet.py
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
    # the link limit counts what a worker must send: the exponent unit once (its copy goes under loss)
    assert lta_wire_bytes(16384, 2048) == 9 * 8270
    assert link_limit_ms(10 * 8270, 200.0) == pytest.approx(10 * 8270 * 8 / 200e6 * 1e3)
    # gloo, 2 ranks, 1 MiB: the whole tensor each way in 8948-byte segments (118 of them, 66 bytes of
    # headers each) plus 59 ACK frames of 66 bytes for the stream coming the other way
    assert gloo_wire_bytes(1 << 20, 2, 9000) == (1 << 20) + 118 * 66 + 59 * 66
    # 4 ranks move 2(N-1)/N = 1.5 times the tensor
    assert gloo_wire_bytes(1 << 20, 4, 9000) > 1.5 * (1 << 20)


def _reduce_result(inputs, k, count, bitmap, shift, rng):
    """A ReduceResult whose chunks hold the mean of their contributors (by ``bitmap``) plus noise
    within a quarter of the codec's bound, as a correct transport would return."""
    from hostlib.transport import ReduceResult

    n = inputs.shape[1]
    values = np.zeros(n, dtype=np.float32)
    for c in range(len(count)):
        lo, hi = c * k, min((c + 1) * k, n)
        who = [w for w in range(inputs.shape[0]) if int(bitmap[c]) >> w & 1]
        if count[c]:
            mean = inputs[who, lo:hi].astype(np.float64).mean(axis=0)
            values[lo:hi] = mean + rng.uniform(-0.25, 0.25, hi - lo) * 2.0 ** -float(shift[c])
    chunks = len(count)
    return ReduceResult(values=values, count=count, bitmap=bitmap, fallback=np.zeros(chunks, np.int8),
                        withheld=np.zeros(chunks, bool), saturated=np.zeros(chunks, bool), shift=shift,
                        elapsed_s=0.0)  # fmt: skip


def test_vectorized_result_check_agrees_with_the_chunk_by_chunk_check():
    from hostlib.verify import check_chunks, check_result

    rng = np.random.default_rng(3)
    workers, k, chunks = 3, 16, 12
    inputs = rng.standard_normal((workers, k * chunks - 5)).astype(np.float32)  # a short last chunk
    means = inputs.astype(np.float64).mean(axis=0)
    # the shift the codec takes for these inputs: s = 30 - ceil(log2 3) - E, max|x| of a chunk < 2^E
    maxabs = np.zeros(k * chunks)
    maxabs[: inputs.shape[1]] = np.abs(inputs).max(axis=0)
    shift = (28 - np.frexp(maxabs.reshape(chunks, k).max(axis=1))[1]).astype(np.int32)
    for full_share in (1.0, 0.5):
        count = np.where(rng.random(chunks) < full_share, 3, rng.integers(0, 3, chunks)).astype(np.int64)
        bitmap = np.array([(1 << w) - 1 for w in count], dtype=np.uint64)  # the first `count` workers
        result = _reduce_result(inputs, k, count, bitmap, shift, rng)
        every = np.flatnonzero(count > 0)
        checked, worst = check_result(result, inputs, k, mean_all=means)
        assert (checked, worst) == pytest.approx(check_chunks(result, inputs, k, every))
        assert (checked, worst) == pytest.approx(check_result(result, inputs, k))  # mean computed inside
        assert checked == np.count_nonzero(count) and 0 < worst < 1
        # one value of a full chunk off by twice the codec's bound fails both checks
        full = int(np.flatnonzero(count == 3)[-1])
        result.values[full * k] += 2 * 2.0 ** -float(shift[full])
        assert check_result(result, inputs, k, mean_all=means)[1] > 1
        assert check_chunks(result, inputs, k, every)[1] > 1
    # a transport that quantized 4096 times coarser (and reported that shift) fails: the bound is the
    # inputs', not the RESULT's
    coarse = _reduce_result(
        inputs, k, np.full(chunks, 3), np.full(chunks, 7, dtype=np.uint64), shift - 12, rng
    )
    assert check_result(coarse, inputs, k)[1] > 1


def test_an_input_check_reused_over_many_results_agrees_with_the_chunk_by_chunk_check():
    """The benchmark's check (worked out once per input round, then called for every result) gives the
    reference's figures for each of several results in turn, and its scratch never leaks between them."""
    from hostlib.verify import InputCheck, check_chunks

    rng = np.random.default_rng(5)
    workers, k, chunks = 4, 32, 9
    inputs = rng.standard_normal((workers, k * chunks - 7)).astype(np.float32)
    maxabs = np.zeros(k * chunks)
    maxabs[: inputs.shape[1]] = np.abs(inputs).max(axis=0)
    shift = (28 - np.frexp(maxabs.reshape(chunks, k).max(axis=1))[1]).astype(np.int32)
    check = InputCheck(inputs, k)
    worsts = []
    for round_ in range(4):
        count = np.where(rng.random(chunks) < 0.7, 4, rng.integers(0, 4, chunks)).astype(np.int64)
        bitmap = np.array([(1 << w) - 1 for w in count], dtype=np.uint64)
        result = _reduce_result(inputs, k, count, bitmap, shift, rng)
        if round_ == 2:  # one value of a full chunk off by twice the bound
            full = int(np.flatnonzero(count == 4)[0])
            result.values[full * k + 3] += 2 * 2.0 ** -float(shift[full])
        got = check(result)
        assert got == pytest.approx(check_chunks(result, inputs, k, np.flatnonzero(count > 0)))
        worsts.append(got[1])
    assert worsts[2] > 1 and max(worsts[:2] + worsts[3:]) < 1


# ---- --rate ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "mbit"),
    [
        ("1gbit", 1000.0),
        ("2500mbit", 2500.0),
        ("200", 200.0),
        ("1.5gbit", 1500.0),
        ("200mbit", 200.0),
        ("1GBit", 1000.0),
        ("500kbit", 0.5),
        (" 10 Mbit ", 10.0),
        ("0.5", 0.5),
        (".5gbit", 500.0),
    ],
)
def test_rates_parse_to_mbit(text, mbit):
    assert parse_rate_mbit(text) == pytest.approx(mbit)


@pytest.mark.parametrize(
    "text", ["", "fast", "1gbps", "10mbps", "1tbit", "-5", "0", "0gbit", "1e3", "1,5gbit"]
)
def test_bad_rates_are_rejected_with_the_flag_and_an_example(text):
    with pytest.raises(ValueError) as exc:
        parse_rate_mbit(text)
    message = str(exc.value)
    assert "--rate" in message and "1gbit" in message and "\n" not in message


def test_bad_rate_stops_the_cli_in_one_line_before_any_namespace(monkeypatch, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("built a network for a bad --rate")

    monkeypatch.setattr(lossy, "bench_lossy", must_not_run)
    monkeypatch.setattr("mininet_topos.netns.require_root", must_not_run)
    assert main(["bench", "lossy", "--rate", "1gbps", "--iters", "20"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("lta bench lossy: error: argument --rate") and "1gbit" in line
    assert captured.out == ""
    # the old spelling still works, and means Mbit/s
    args = build_parser().parse_args(["bench", "lossy", "--rate-mbit", "300"])
    assert lossy.config_from_args(args).rate_mbit == 300.0
    assert lossy.config_from_args(build_parser().parse_args(["bench", "lossy"])).rate_mbit == 200.0


def test_missing_nft_or_tc_is_one_line_before_any_namespace(monkeypatch, capsys):
    """Without nftables or tc the command says what to install, in one line, and builds nothing."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("built a network without its tools")

    monkeypatch.setattr(lossy, "bench_lossy", must_not_run)
    monkeypatch.setattr("mininet_topos.netns.require_root", lambda: None)
    absent = ("nft", "tc")
    monkeypatch.setattr("mininet_topos.netns.shutil.which", lambda tool: None if tool in absent else "/x")
    assert main(["bench", "lossy", "--iters", "20"]) == 1
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert "tc, nft" in line and "apt-get install -y iproute2 nftables" in line
    assert captured.out == ""


def test_rates_read_back_in_their_unit():
    assert [format_rate(r) for r in (1000.0, 2500.0, 200.0, 0.5)] == [
        "1 Gbit/s",
        "2.5 Gbit/s",
        "200 Mbit/s",
        "500 kbit/s",
    ]


def test_link_limits_and_deadline_floor_at_1_gbit():
    # 1 MiB = 262144 float32 = 128 chunks of 2048 and one exponent unit sent twice: 130 frames of
    # 8270 bytes = 1,075,100 bytes; 8,600,800 bits at 1e9 bit/s = 8.6008 ms
    cfg = LossyConfig(workers=2, mib=1.0, rate_mbit=parse_rate_mbit("1gbit"))
    assert lta_wire_bytes(cfg.n_values, cfg.k, exp_copies=2) == 1_075_100
    # gloo, 2 ranks: 1,048,576 bytes in 118 segments (66 bytes of headers each) + 59 ACKs of 66 bytes
    # = 1,060,258 bytes = 8.482064 ms
    # An allreduce runs from its last rank's entry to its last rank's exit. In the first, rank 0 entered
    # 4 ms before rank 1 and waited for it (its own 15 ms): the allreduce took 11 ms, not 15.
    ranks = [
        {"times_s": [0.015, 0.012, 0.011], "starts_s": [100.0, 101.0, 102.0]},
        {"times_s": [0.011, 0.010, 0.013], "starts_s": [100.004, 101.0, 102.003]},
    ]
    gloo = summarize_system("gloo", cfg, ranks)
    assert gloo["wire_bytes_per_worker"] == 1_060_258
    assert gloo["link_limit_ms"] == pytest.approx(8.482064)
    # 11, 12 (both entered at once: the slower rank's 12), 13 (2.016 - 2.003)
    assert gloo["p50_ms"] == pytest.approx(12.0) and gloo["max_ms"] == pytest.approx(13.0)
    assert gloo["mean_ms"] == pytest.approx(12.0)
    # each by its slowest rank, as runs before 29 Nov 2026 reported it: 15, 12, 13
    assert gloo["slowest_rank_p50_ms"] == pytest.approx(13.0)
    assert link_limit_ms(1_075_100, cfg.rate_mbit) == pytest.approx(8.6008)
    # the window: a frame of 8270 bytes takes 66.16 us at 1 Gbit/s; 2 ms hold 30.2 of them -> 31, + 1
    assert cfg.units_in_flight == 32
    # the FLUSH deadline floor: 32 frames at 1 Gbit/s (2.11712 ms) + 1 ms
    assert cfg.deadline_ms == pytest.approx(3.11712)
    assert deadline_floor_ms(2048, 16, 200.0) == pytest.approx(16 * 8270 * 8 / 200e6 * 1e3 + 1)
    # an explicit window wins, and sets the floor
    assert LossyConfig(rate_mbit=1000.0, window=16).deadline_ms == pytest.approx(2.05856)


@pytest.mark.parametrize(
    ("rate_mbit", "frames_in_2_ms"),
    [
        (200.0, 6.05),  # 2 ms / 0.3308 ms per frame
        (1000.0, 30.23),  # 2 ms / 66.16 us
        (2500.0, 75.57),
        (100.0, 3.02),
        (8.0, 0.24),  # a frame takes 8.27 ms: one in flight, plus the next
    ],
)
def test_window_is_the_links_frames_in_a_2_ms_round_trip_plus_one(rate_mbit, frames_in_2_ms):
    frame_ms = 8270 * 8 / (rate_mbit * 1e6) * 1e3
    assert 2.0 / frame_ms == pytest.approx(frames_in_2_ms, abs=0.01)
    expected = int(frames_in_2_ms) + 2  # rounded up, plus the frame being serialized
    assert window_for_rate(rate_mbit, 2048) == expected
    assert LossyConfig(rate_mbit=rate_mbit).units_in_flight == expected
    # smaller frames (MTU 1500: K=256, 1102-byte frames): more of them in the same 2 ms
    assert window_for_rate(rate_mbit, 256) == math.ceil(2.0 / (1102 * 8 / (rate_mbit * 1e6) * 1e3)) + 1


def test_softswitch_runs_at_a_higher_priority_than_the_workers(tmp_path):
    launched: list[list[str]] = []

    class _Net:
        aggregator = "agg"

        def run_in(self, host, argv, **popen_kwargs):  # records the command, starts a stand-in
            launched.append(list(argv))
            script = "import sys, time; print('listening', file=sys.stderr, flush=True); time.sleep(30)"
            return subprocess.Popen([sys.executable, "-c", script], **popen_kwargs)

    with lossy.softswitch_in(_Net(), LossyConfig(), ["10.0.0.1:41000"], "10.0.0.9:4000", tmp_path) as switch:
        assert switch.poll() is None
    (argv,) = launched
    assert argv[:3] == ["nice", "-n", "-10"] and argv[4:7] == ["-m", "lta.cli", "softswitch"]
    # the workers' command lines carry no nice: they compete alike with gloo's
    assert lossy._worker_argv("lta-worker", LossyConfig(), 0)[0] == sys.executable


def test_tbf_bucket_holds_a_millisecond_and_two_jumbo_frames():
    # 1 ms at the rate from 262 Mbit/s up; 32 KiB below; two frames for very large MTUs
    assert tbf_burst_bytes(1000.0, 9000) == 125_000
    assert tbf_burst_bytes(2500.0, 9000) == 312_500
    assert tbf_burst_bytes(200.0, 9000) == 32 * 1024
    assert tbf_burst_bytes(200.0, 60000) == 2 * 60014
    for rate in (0.5, 200.0, 1000.0, 2500.0, 10000.0):
        burst = tbf_burst_bytes(rate, 9000)
        assert burst >= rate * 1e6 / 8 / 1000  # rate/HZ for HZ = 1000
        assert burst >= 2 * 9014
        assert tbf_limit_bytes(rate, burst) >= burst
    # tbf's queue: 50 ms at 1 Gbit/s (6.25 MB) on top of the bucket
    assert tbf_limit_bytes(1000.0, 125_000) == 6_375_000
    link = LossyConfig(rate_mbit=1000.0).link(0.01)
    assert (link.rate_mbit, link.burst, link.loss_up, link.loss_down) == (1000.0, 125_000, 0.01, 0.01)


# ---- worker processes (plain subprocesses standing in for the namespaces) -------------------------
class _LocalNet:
    """``run_in`` without namespaces: what WorkerGroup needs of a NetnsNetwork."""

    def run_in(self, host, argv, **popen_kwargs):
        return subprocess.Popen(argv, **popen_kwargs)


_CHATTY_WORKER = """
import json, sys
print("ready", flush=True)
assert sys.stdin.readline().strip() == "go"
for i in range(1, 5):
    sys.stderr.write("x" * 100_000 + "\\n")  # far more than a pipe holds, while the others run
    sys.stderr.flush()
    print(f"progress {i} 4", flush=True)
print(json.dumps({"rank": int(sys.argv[1]), "times_s": [0.001] * 2000}), flush=True)
"""


def test_worker_group_reads_every_pipe_and_relays_progress():
    argvs = [(None, [sys.executable, "-c", _CHATTY_WORKER, str(rank)]) for rank in range(3)]
    heard: list[str] = []
    results = lossy.WorkerGroup(_LocalNet(), argvs, timeout_s=60, progress=heard.append, label="lta").run()
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(len(r["times_s"]) == 2000 for r in results)
    assert heard[-1] == "  lta 4/4" and len(heard) == 3 * 4  # every rank's lines are relayed


def test_worker_group_names_a_worker_that_did_not_start():
    argvs = [
        (None, [sys.executable, "-c", "print('ready', flush=True); import sys; sys.stdin.readline()"]),
        (None, [sys.executable, "-c", "import sys; sys.exit('no such switch')"]),
    ]
    group = lossy.WorkerGroup(_LocalNet(), argvs, timeout_s=60)
    with pytest.raises(
        RuntimeError, match="(?s)bench worker 1 did not start: printed '[(]nothing[)]'.*no such switch"
    ):
        group.run()
    for proc in group.procs:
        proc.kill()
        proc.wait(timeout=10)


# ---- on real links ------------------------------------------------------------------------------
def _ns_json(ns: str, *argv: str) -> list[dict]:
    return json.loads(subprocess.run(["ip", "netns", "exec", ns, *argv], check=True, capture_output=True,
                                     text=True).stdout)  # fmt: skip


@pytest.mark.mininet
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_links_carry_the_rate_bucket_and_jumbo_mtu():
    cfg = LossyConfig(workers=2, rate_mbit=parse_rate_mbit("1gbit"))
    with cfg.network(0.0, max_runtime_s=60) as net:
        ports = {net.port_of(h) for h in net.workers}
        for host in net.hosts:
            (dev,) = _ns_json(host.netns, "ip", "-j", "link", "show", "dev", host.dev)
            assert dev["mtu"] == 9000, host
        switch_links = {d["ifname"]: d for d in _ns_json(net.switch_ns, "ip", "-j", "link", "show")}
        assert {*ports, "pagg", "br0"} <= set(switch_links)
        assert all(switch_links[name]["mtu"] == 9000 for name in (*ports, "pagg", "br0"))
        # tbf on both ends of every worker link (up: the host's eth0, down: its bridge port)
        shaped = [(h.netns, h.dev) for h in net.workers] + [(net.switch_ns, p) for p in ports]
        for ns, dev in shaped:
            (tbf,) = [q for q in _ns_json(ns, "tc", "-j", "qdisc", "show", "dev", dev) if q["kind"] == "tbf"]
            assert tbf["options"]["rate"] == 125_000_000  # bytes/s
            assert tbf["options"]["burst"] == 125_000
        # the aggregator's own link is not the bottleneck
        agg = _ns_json(net.aggregator.netns, "tc", "-j", "qdisc", "show", "dev", net.aggregator.dev)
        assert not [q for q in agg if q["kind"] == "tbf"]
    assert not [name for name in leftovers() if name.startswith(net.tag)]


# ---- one short lossy point, for real --------------------------------------------------------------
@pytest.mark.mininet
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_short_lossy_point_reports_both_systems_and_lta_is_exact(tmp_path):
    plot = tmp_path / "lossy.png"
    argv = [sys.executable, "-m", "lta.cli", "bench", "lossy", "--workers", "2", "--mib", "0.0625",
            "--loss", "0.03", "--iters", "20", "--warmup", "2", "--json", "--plot", str(plot)]  # fmt: skip
    bench = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    stdout, stderr = bench.communicate(timeout=300)
    assert bench.returncode == 0, stderr[-3000:]
    assert not [name for name in leftovers() if f"lta-{bench.pid}-" in name], "namespaces left behind"
    out = json.loads(stdout)
    assert out["schema"] == "lta.bench.lossy/1"
    assert out["config"]["mtu"] == 9000 and out["config"]["elems_per_packet"] == 2048
    (point,) = out["points"]
    assert point["loss"] == 0.03
    seen, dropped = {"up": 0, "down": 0}, {"up": 0, "down": 0}
    for system in ("gloo", "lta"):
        stats = point[system]
        assert STAT_KEYS <= set(stats)
        assert 0 < stats["p50_ms"] <= stats["p99_ms"] <= stats["p99_9_ms"] <= stats["max_ms"]
        # the nftables counters saw this system's packets both ways; the fraction dropped is reported
        measured = stats["measured_loss"]
        for direction in ("up", "down"):
            packets = measured[f"{direction}_packets"]
            assert packets > 0
            seen[direction] += packets
            dropped[direction] += round(measured[f"{direction}_loss"] * packets)
    # Each direction's rule dropped the configured 3%: within the binomial's two-sided 1e-5 interval
    # (about 1300 packets a direction: a missing rule, 0 drops, falls below it).
    for direction in ("up", "down"):
        n, p = seen[direction], 0.03
        half = Z * math.sqrt(n * p * (1 - p))
        assert n * p - half <= dropped[direction] <= n * p + half, (direction, dropped[direction], n)
    assert point["lta"]["link_limit_ms"] == pytest.approx(9 * 8270 * 8 / 200e6 * 1e3)  # each unit once
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


@pytest.mark.mininet
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_one_gbit_point_is_limited_by_the_link():
    argv = [sys.executable, "-m", "lta.cli", "-v", "bench", "lossy", "--workers", "2", "--mib", "1", "--loss",
            "0", "--rate", "1gbit", "--iters", "20", "--warmup", "2", "--json"]  # fmt: skip
    bench = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    stdout, stderr = bench.communicate(timeout=300)
    assert bench.returncode == 0, stderr[-3000:]
    assert not [name for name in leftovers() if f"lta-{bench.pid}-" in name], "namespaces left behind"
    config = json.loads(stdout)["config"]
    assert config["rate_mbit"] == 1000.0 and config["rate"] == "1 Gbit/s"
    assert config["tbf_burst_bytes"] == 125_000 and config["mtu"] == 9000
    assert config["window"] == 32 and config["min_deadline_ms"] == pytest.approx(3.11712)
    # progress went to stderr (each phase logged with -v), not into the JSON
    assert "gloo 20/20" in stderr and "lta 20/20" in stderr
    (point,) = json.loads(stdout)["points"]
    bucket_ms = link_limit_ms(config["tbf_burst_bytes"], 1000.0)  # 1 ms
    # lta: 128 data frames and the exponent unit once (129 x 8270 bytes; its copy goes only under loss)
    for system, limit_ms in (("gloo", 8.482064), ("lta", 8.53464)):
        stats = point[system]
        assert stats["link_limit_ms"] == pytest.approx(limit_ms)
        # The link really limits: tbf passes at most one bucket ahead of the rate, so no allreduce can
        # beat the link limit by more than the bucket's 1 ms. A one-sided check: a missing tbf, a
        # wrong rate or a wrong limit would show as a p50 below it (a slow machine only raises p50).
        assert stats["p50_ms"] >= limit_ms - bucket_ms, (system, stats)
