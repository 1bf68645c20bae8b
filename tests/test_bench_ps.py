"""``lta bench byzantine | async | compression`` with tiny sizes: one JSON document each, every key there,
values sane, and the bytes per step equal to the hand-computed sizes of each encoding. No timings are
asserted: they depend on the machine."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lta import cli
from lta.bench.ps_train import Mlp, make_problem

TINY = ["--d-in", "8", "--hidden", "8", "--classes", "3", "--elems-per-packet", "16"]
D_TINY = 8 * 8 + 8 + 3 * 8 + 3  # W1, b1, W2, b2 of the 8 -> 8 -> 3 MLP: 99 parameters


def initial_loss(seed: int = 0) -> float:
    """Evaluation loss of the TINY problem's initial weights (numpy): what a run that learned nothing has."""
    problem = make_problem(d_in=8, hidden=8, classes=3)
    model = Mlp(problem)
    return model.loss(model.init(seed), problem.x_eval, problem.y_eval)


def run_json(capsys, *argv: str) -> dict:
    assert cli.main(["bench", *argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, "one JSON document on stdout"
    return json.loads(out[0])


def test_byzantine_reports_every_case_and_mean_breaks(capsys):
    doc = run_json(
        capsys, "byzantine", "--rules", "mean,median,krum", "--attacks", "1of4", "--losses", "0",
        "--seeds", "2", "--steps", "20", *TINY,
    )  # fmt: skip
    assert doc["schema"] == "lta.bench.byzantine/1" and doc["problem"]["n_params"] == D_TINY
    assert len(doc["clean"]) == 1 and len(doc["rows"]) == 3
    clean = doc["clean"][0]["final_loss"]
    assert len(clean["values"]) == 2 and all(0 < v < 5 for v in clean["values"])
    rows = {r["rule"]: r for r in doc["rows"]}
    assert rows["mean"]["outcome"] in ("diverged", "stalled")  # 3 honest + 1 at -10 g: a step uphill
    median = rows["median"]
    assert median["outcome"] not in ("diverged", "stalled")
    assert median["fallback_share"] == 0.0 and median["min_count_for_attackers"] == 3
    # Krum tolerating 1 needs 5 contributions; with 4 it always falls back to the median, and says so.
    krum = rows["krum"]
    assert krum["fallback_share"] == 1.0 and krum["min_count_for_attackers"] == 5
    assert krum["final_loss"]["values"] == median["final_loss"]["values"]
    for r in doc["rows"]:
        assert {"delta", "within_spread", "outcome", "clean_loss", "refusal_share"} <= set(r)


def test_compression_bytes_per_step_are_the_encodings_sizes(capsys):
    doc = run_json(
        capsys, "compression", "--methods", "none,fp16,int8,topk", "--topk-ratio", "0.1", "--losses", "0,0.2",
        "--seeds", "1", "--steps", "10", "--workers", "2", *TINY,
    )  # fmt: skip
    assert doc["schema"] == "lta.bench.compression/1"
    rows = {(r["method"], r["loss"]): r for r in doc["rows"]}
    assert len(rows) == 8
    k, header = 16, 36
    per_packet = {"none": k, "fp16": 2 * k, "int8": 4 * (k - 1)}
    expected_payload = {
        "none": 4 * D_TINY,
        "fp16": 2 * D_TINY,
        "int8": D_TINY + 4 * math.ceil(D_TINY / per_packet["int8"]),  # codes + one scale per packet
        "topk": 8 * math.ceil(0.1 * D_TINY),  # (int32 index, float32 value) pairs
    }
    packets = {m: math.ceil(D_TINY / v) for m, v in per_packet.items()}
    packets["topk"] = math.ceil(math.ceil(0.1 * D_TINY) / (k // 2))
    for (method, loss), r in rows.items():
        assert r["payload_bytes_per_step"] == expected_payload[method]
        assert r["wire_bytes_per_step"] == packets[method] * (header + 4 * k)
        assert r["bytes_vs_none"] == pytest.approx(expected_payload[method] / expected_payload["none"])
        # it learned: below the loss of the initial weights (seed 0), computed here
        assert r["final_loss"]["mean"] is not None and 0 < r["final_loss"]["mean"] < initial_loss()
        assert r["met"] is None if method == "none" else isinstance(r["met"], bool)
        if method == "none":
            assert r["relative_diff"] == 0.0
        else:
            none = rows[("none", loss)]["final_loss"]["mean"]
            assert r["relative_diff"] == pytest.approx(r["final_loss"]["mean"] / none - 1)
        assert loss in (0.0, 0.2)
    for method in ("fp16", "int8"):  # without loss, a fine quantization trains as the float32 run does
        assert abs(rows[(method, 0.0)]["relative_diff"]) < 0.01, method


def test_async_reports_time_rejections_and_staleness(capsys):
    doc = run_json(
        capsys, "async", "--seeds", "1", "--compute-ms", "1", "--target-loss", "1.0", "--time-limit", "60",
        *TINY,
    )  # fmt: skip
    assert doc["schema"] == "lta.bench.async/1"
    assert [r["variant"] for r in doc["rows"]] == ["sync", "async-fixed", "async-adaptive"]
    start = initial_loss()
    assert 1.0 < start  # the target is below the loss of the initial weights: it must be learned
    for r in doc["rows"]:
        assert r["reached"] == 1 and r["time_to_target_s"]["mean"] > 0
        assert r["final_loss"]["mean"] < start
        assert r["server_steps"] > 0
        assert 0.0 <= r["rejection_rate"] <= 1.0 and r["mean_staleness"] >= 0.0
    assert doc["rows"][0]["rejection_rate"] == 0.0 and doc["rows"][0]["staleness_bounds"] is None
    assert len(doc["rows"][2]["staleness_bounds"]) == 4
    assert doc["config"]["async_lr"] == pytest.approx(0.2 / 4)  # --lr / --workers by default
    assert {"speedup_async-fixed", "speedup_async-adaptive", "rejection_rate_adaptive"} <= set(doc["targets"])


def test_the_torch_trainer_runs_the_same_benchmark(capsys):
    pytest.importorskip("torch")
    doc = run_json(
        capsys, "compression", "--methods", "none", "--losses", "0", "--seeds", "1", "--steps", "5",
        "--workers", "2", "--trainer", "torch", *TINY,
    )  # fmt: skip
    assert doc["config"]["trainer"] == "torch"
    assert doc["rows"][0]["payload_bytes_per_step"] == 4 * D_TINY


def test_numpy_mlp_gradient_matches_finite_differences():
    problem = make_problem(d_in=5, hidden=4, classes=3, n_train=64, n_eval=8)
    model = Mlp(problem)
    params = model.init(0).astype(np.float64)
    x, y = problem.x_train[:16].astype(np.float64), problem.y_train[:16]
    _, grad = model.loss_grad(params, x, y)
    eps = 1e-6
    numeric = np.array(
        [
            (model.loss(params + eps * e, x, y) - model.loss(params - eps * e, x, y)) / (2 * eps)
            for e in np.eye(len(params))
        ]
    )
    np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["byzantine", "--attacks", "4of4"], "need 1 <= attackers < workers"),
        (["compression", "--methods", "gzip"], "unknown method 'gzip'"),
        (["async", "--variants", "eventually"], "unknown variant 'eventually'"),
    ],
)
def test_bad_arguments_fail_in_one_line(capsys, argv, message):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err
