"""``lta bench allreduce``: the raw echo baseline returns exactly what each sender sent, one short run
of the command reports every key with sane values, and bad arguments fail before anything is spawned.
No timings are asserted beyond being positive: they depend on the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hostlib.batchio import available_modes
from lta import cli
from lta.bench import allreduce
from lta.bench.allreduce import RawSpec, lta_datagrams_per_reduce, run_raw

REPO = Path(__file__).resolve().parents[1]
IO_PATHS = ("gso-c", "mmsg-c", "mmsg-ctypes", "plain")
TOP_KEYS = {
    "config",
    "lta",
    "gloo",
    "raw",
    "raw_gso",
    "io",
    "ratio_gloo_over_lta_p50",
    "ratio_lta_over_raw_pps",
    "ratio_lta_over_raw_gso_pps",
}
LTA_KEYS = {"p50_ms", "p99_ms", "mean_ms", "pps", "busbw_gbps", "mean_count", "flushes_per_reduce"}
GLOO_KEYS = {"p50_ms", "p99_ms", "mean_ms", "busbw_gbps"}
RAW_KEYS = {"p50_ms", "pps"}


def _bench(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lta.cli", "bench", "allreduce", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=180)


# ---- raw echo, in-process ---------------------------------------------------------------------------
@pytest.mark.parametrize("io", available_modes())
def test_raw_echo_returns_exactly_what_each_sender_sent(io):
    m, width, iters, warmup = 300, 292, 2, 1
    rng = np.random.default_rng(7)
    payloads = [rng.integers(0, 256, size=(m, width), dtype=np.uint8) for _ in range(2)]
    spec = RawSpec(m, width, iters, warmup, io=io, window=64, keep_echoes=True)
    raw = run_raw(2, spec, in_process=True, payloads=payloads)

    for payload, sender in zip(payloads, raw["senders"], strict=True):
        assert len(sender["echoes"]) == warmup + iters
        for it, echoed in enumerate(sender["echoes"]):
            # What went out in iteration `it`: the payload, its first 4 bytes the iteration (u32 LE).
            expected = payload.copy()
            expected[:, :4] = list(int(it).to_bytes(4, "little"))
            assert echoed.shape == (m, width)
            assert sorted(map(bytes, echoed)) == sorted(map(bytes, expected))
        assert sender["sent_timed"] == sender["echoed_timed"] == m * iters
    assert raw["received_timed"] == 2 * m * iters  # counted by the echo server, timed iterations only
    assert raw["lost"] == raw["timeouts"] == raw["wrong_length"] == 0
    assert raw["io"] == io and raw["window"] == 64
    assert len(raw["times_s"]) == iters
    assert raw["pps"] > 0 and raw["p50_ms"] > 0


def test_raw_datagram_count_is_what_an_lta_worker_sends():
    # 64 KiB of float32 at K=64: 256 chunks, 4 exponent units sent twice each
    assert lta_datagrams_per_reduce(16384, 64, 2) == 256 + 2 * 4
    assert lta_datagrams_per_reduce(1, 64, 2) == 1 + 2
    assert lta_datagrams_per_reduce(64 * 64 + 1, 64, 1) == 65 + 2


# ---- the command ------------------------------------------------------------------------------------
def test_one_short_run_reports_every_key():
    run = _bench("--workers", "2", "--mib", "0.0625", "--iters", "2", "--warmup", "1", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)  # exactly one JSON document
    assert out["schema"] == "lta.bench.allreduce/1"
    assert TOP_KEYS | {"ratio_busbw"} <= out.keys()
    assert LTA_KEYS <= out["lta"].keys() and GLOO_KEYS <= out["gloo"].keys() and RAW_KEYS <= out["raw"].keys()
    assert out["config"]["workers"] == 2 and out["config"]["mib"] == 0.0625
    for system in ("lta", "gloo", "raw"):
        assert out[system]["p50_ms"] > 0
    assert out["lta"]["pps"] > 0 and out["raw"]["pps"] > 0
    assert out["lta"]["mean_count"] == 2.0  # no loss: every chunk has both contributions
    assert out["io"] in IO_PATHS
    assert out["ratio_gloo_over_lta_p50"] == pytest.approx(out["gloo"]["p50_ms"] / out["lta"]["p50_ms"])
    assert out["ratio_lta_over_raw_pps"] == pytest.approx(out["lta"]["pps"] / out["raw"]["pps"])
    # raw echoes as many datagrams per reduce as an lta worker sends when nothing is lost: 256 data units
    # and 4 exponent units, each once (the copies go only where packets are lost: quiet_units)
    assert out["raw"]["datagrams_per_reduce"] == 260
    assert out["raw"]["io"] == ("mmsg-c" if "mmsg-c" in available_modes() else available_modes()[0])
    if "gso-c" in available_modes():  # the kernel's best: the same datagrams in GSO/GRO trains
        assert RAW_KEYS <= out["raw_gso"].keys() and out["raw_gso"]["io"] == "gso-c"
        assert out["raw_gso"]["datagrams_per_reduce"] == 260 and out["raw_gso"]["lost"] == 0
        assert out["ratio_lta_over_raw_gso_pps"] == pytest.approx(out["lta"]["pps"] / out["raw_gso"]["pps"])
    else:
        assert out["raw_gso"] is None and out["ratio_lta_over_raw_gso_pps"] is None
    assert out["lta"]["packets_per_reduce"] >= 260
    assert "lta" in run.stderr and "raw" in run.stderr  # progress went to stderr


def test_io_flag_forces_the_path_of_lta_and_raw():
    run = _bench(*"--workers 2 --mib 0.0625 --iters 1 --warmup 0 --io plain --json".split())
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["io"] == "plain" and out["raw"]["io"] == "plain"
    assert out["raw_gso"] is None or out["raw_gso"]["io"] == "gso-c"  # the baseline keeps its path
    assert out["config"]["io_requested"] == "plain"


def test_zero_workers_fail_with_one_line():
    run = _bench("--workers", "0")
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "--workers" in lines[0], run.stderr
    assert run.stdout == ""


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--workers", "65"], "--workers"),
        (["--workers", "2,x"], "--workers"),
        (["--mib", "0"], "--mib"),
        (["--mib", "4,-1"], "--mib"),
        (["--iters", "0"], "--iters"),
        (["--elems-per-packet", "0"], "--elems-per-packet"),
        (["--elems-per-packet", "16368"], "--elems-per-packet"),
        (["--io", "bogus"], "--io"),
    ],
)
def test_bad_arguments_fail_before_anything_runs(argv, word, monkeypatch, capsys):
    def spawned(*args, **kwargs):
        raise AssertionError("a benchmark ran despite a bad argument")

    monkeypatch.setattr(allreduce, "bench_pair", spawned)
    assert cli.main(["bench", "allreduce", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and word in lines[0]
    assert captured.out == ""


def _fake_pair(opts, n, mib, phase):
    with phase("lta"):
        pass
    return {
        "config": {"workers": n, "mib": mib, "elems_per_packet": opts.elems_per_packet},
        "lta": {"p50_ms": 2.0, "p99_ms": 3.0, "pps": 1000.0, "busbw_gbps": 1.0, "mean_count": float(n)},
        "gloo": {"p50_ms": 4.0, "p99_ms": 5.0, "busbw_gbps": 0.5},
        "raw": {
            "p50_ms": 1.0,
            "p99_ms": 1.5,
            "pps": 4000.0,
            "datagrams_per_reduce": 3,
            "window": 256,
            "timeouts": 0,
            "io": "plain",
        },
        "io": "plain",
        "ratio_gloo_over_lta_p50": 2.0,
        "ratio_lta_over_raw_pps": 0.25,
        "ratio_busbw": 2.0,
    }


def test_comma_lists_give_one_result_per_pair(monkeypatch, capsys):
    monkeypatch.setattr(allreduce, "bench_pair", _fake_pair)
    assert cli.main(["bench", "allreduce", "--workers", "2,4", "--mib", "4,64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "lta.bench.allreduce/1"
    pairs = [(r["config"]["workers"], r["config"]["mib"]) for r in out["results"]]
    assert pairs == [(2, 4.0), (2, 64.0), (4, 4.0), (4, 64.0)]
    assert all("schema" not in r for r in out["results"])

    assert cli.main(["bench", "allreduce", "--workers", "2,4", "--mib", "4"]) == 0
    text = capsys.readouterr().out.splitlines()
    for system in ("lta", "gloo", "raw"):
        assert sum(line.split()[0] == system for line in text if line.strip()) == 2
    assert sum("gloo/lta p50 2.000" in line and "lta/raw pps 0.250" in line for line in text) == 2
    assert sum("io plain" in line for line in text if not line.startswith(" ")) == 2


def test_raw_senders_keep_their_windows_within_the_echos_buffer():
    """Four senders of 67 jumbo datagrams (what a 4 MiB reduce of K = 16367 sends) echo every datagram
    of every iteration without a stall: with lta's window (63 datagrams each) they overflowed the echo's
    receive buffer, and each lost datagram cost an iteration the stall timeout."""
    from lta.bench.allreduce import RAW_DATAGRAM_OVERHEAD, echo_window

    reported = 8 << 20  # SO_RCVBUF as Linux reports it: twice the usable bytes
    window = echo_window(reported, 65504, 4)
    cost = 65504 + RAW_DATAGRAM_OVERHEAD  # per datagram
    assert 4 * window * cost <= reported // 2 < 4 * (window + 1) * cost
    spec = RawSpec(67, 65504, iters=3, warmup=1, io="mmsg-c", stall_timeout_s=0.5)
    raw = run_raw(4, spec, in_process=True)
    assert raw["timeouts"] == 0
