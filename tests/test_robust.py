"""Byzantine-robust rules against per-coordinate and brute-force references written here, hand-made inputs."""

from __future__ import annotations

import itertools
import statistics

import numpy as np
import pytest

from hostlib.ps import robust
from hostlib.ps.robust import InsufficientContributions, aggregate

# --- independent references: loops over coordinates, explicit pairwise distances ------------------


def ref_mean(x: np.ndarray) -> np.ndarray:
    return np.array([sum(float(v) for v in x[:, j]) / len(x) for j in range(x.shape[1])])


def ref_trimmed_mean(x: np.ndarray, trim: int) -> np.ndarray:
    out = []
    for j in range(x.shape[1]):
        column = sorted(float(v) for v in x[:, j])
        kept = column[trim : len(column) - trim]
        out.append(sum(kept) / len(kept))
    return np.array(out)


def ref_median(x: np.ndarray) -> np.ndarray:
    return np.array([statistics.median(float(v) for v in x[:, j]) for j in range(x.shape[1])])


def ref_scores(x: np.ndarray, rows: list[int], f: int) -> dict[int, float]:
    """Krum scores over the rows ``rows``: sum of squared distances to the nearest len(rows)-f-2 others
    (at least 1 while another row exists, the module's documented convention for Bulyan's last rounds)."""
    r = len(rows)
    neighbours = min(max(r - f - 2, 1), r - 1)
    scores = {}
    for i in rows:
        dists = sorted(
            sum((float(a) - float(b)) ** 2 for a, b in zip(x[i], x[j], strict=True)) for j in rows if j != i
        )
        scores[i] = sum(dists[:neighbours])
    return scores


def ref_krum(x: np.ndarray, f: int) -> np.ndarray:
    scores = ref_scores(x, list(range(len(x))), f)
    best = min(scores, key=lambda i: (scores[i], i))
    return x[best].astype(np.float64)


def ref_multi_krum(x: np.ndarray, f: int, m: int) -> np.ndarray:
    scores = ref_scores(x, list(range(len(x))), f)
    best = sorted(scores, key=lambda i: (scores[i], i))[:m]
    return ref_mean(x[sorted(best)])


def ref_bulyan(x: np.ndarray, f: int) -> np.ndarray:
    n = len(x)
    theta = n - 2 * f
    remaining = list(range(n))
    selected = []
    while len(selected) < theta:
        scores = ref_scores(x, remaining, f)
        best = min(remaining, key=lambda i: (scores[i], i))
        selected.append(best)
        remaining.remove(best)
    keep = theta - 2 * f
    out = []
    for j in range(x.shape[1]):
        values = sorted(float(x[i, j]) for i in selected)
        med = statistics.median(values)
        closest = sorted(range(theta), key=lambda k: (abs(values[k] - med), k))[:keep]  # ties: lower value
        out.append(sum(values[k] for k in closest) / keep)
    return np.array(out)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# --- hand-made inputs with known answers and ties ----------------------------------------------------


def test_hand_made_trimmed_mean_median_with_ties():
    x = np.array(
        [[1.0, 5.0, 2.0], [1.0, -3.0, 2.0], [4.0, 0.0, 2.0], [100.0, 0.0, 2.0], [-7.0, 0.0, 9.0]],
        dtype=np.float32,
    )
    # trim_ratio 0.2 with 5 rows: floor(1.0) = 1 value dropped per side and coordinate.
    assert_close(aggregate("trimmed_mean", x, trim_ratio=0.2), [(1 + 1 + 4) / 3, 0.0, 2.0])
    assert_close(aggregate("median", x), [1.0, 0.0, 2.0])
    assert_close(aggregate("median", x[:4]), [2.5, 0.0, 2.0])  # even n: mean of the two middle values
    assert_close(aggregate("mean", x), ref_mean(x))


def test_hand_made_krum_tie_goes_to_lowest_index():
    # In 1-D, rows 0, 1, 2 each have nearest-neighbour squared distance 1: all scores tie.
    x = np.array([[0.0], [1.0], [2.0]])
    assert_close(aggregate("krum", x, f=0), [0.0])
    # Exactly equal rows: duplicates score 0 and the first of them wins.
    x = np.array([[5.0, 5.0], [1.0, 1.0], [1.0, 1.0], [9.0, -9.0], [1.0, 1.0]])
    assert_close(aggregate("krum", x, f=1), [1.0, 1.0])
    assert_close(aggregate("multi_krum", x, f=1, m=3), [1.0, 1.0])


def test_hand_made_bulyan():
    # n = 7, f = 1: theta = 5 rows by iterated Krum, then the mean of the 3 values closest to the median.
    x = np.array([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [1000.0]])
    got = aggregate("bulyan", x, f=1)
    assert_close(got, ref_bulyan(x, 1))
    assert 1.0 <= got[0] <= 4.0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_bulyan_median_tie_keeps_the_lower_values(sign):
    # Iterated Krum (f = 1) drops the two outliers and selects {-1, -1, 0, 1, 1}; around the median 0
    # four values tie at distance 1 for the 2 places left: the lower ones win, whatever the row order.
    x = sign * np.array([[-1000.0], [-1.0], [-1.0], [0.0], [1.0], [1.0], [1000.0]])
    assert_close(aggregate("bulyan", x, f=1), [-2.0 / 3.0])
    assert_close(ref_bulyan(x, 1), [-2.0 / 3.0])


# --- every rule against its reference, random inputs, n at exactly the minimum and above ---------


CASES = [
    # (rule, f, n)
    ("krum", 0, 3),
    ("krum", 1, 5),
    ("krum", 2, 7),
    ("krum", 2, 10),
    ("multi_krum", 1, 5),
    ("multi_krum", 2, 9),
    ("bulyan", 0, 3),
    ("bulyan", 1, 7),
    ("bulyan", 2, 11),
    ("bulyan", 1, 9),
    ("median", 1, 3),
    ("median", 2, 6),
]


@pytest.mark.parametrize(("rule", "f", "n"), CASES)
def test_rule_matches_reference(rule, f, n):
    rng = np.random.default_rng(n * 10 + f)
    for dtype, d in itertools.product((np.float32, np.float64), (1, 6)):
        # Integer-valued entries make ties likely and every distance exact in float64.
        x = rng.integers(-3, 4, size=(n, d)).astype(dtype)
        y = rng.standard_normal((n, d)).astype(dtype)
        for z in (x, y):
            got = aggregate(rule, z, f=f)
            if rule == "krum":
                want = ref_krum(z, f)
            elif rule == "multi_krum":
                want = ref_multi_krum(z, f, n - f)
                assert_close(aggregate(rule, z, f=f, m=2), ref_multi_krum(z, f, 2))
            elif rule == "bulyan":
                want = ref_bulyan(z, f)
            else:
                want = ref_median(z)
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("trim_ratio", "n", "trim"), [(0.1, 9, 0), (0.1, 10, 1), (0.25, 4, 1), (0.3, 7, 2)])
def test_trimmed_mean_matches_reference(trim_ratio, n, trim):
    rng = np.random.default_rng(n)
    x = rng.integers(-2, 3, size=(n, 8)).astype(np.float32)  # many equal values per coordinate
    assert_close(aggregate("trimmed_mean", x, trim_ratio=trim_ratio), ref_trimmed_mean(x, trim))
    y = rng.standard_normal((n, 8))
    np.testing.assert_allclose(aggregate("trimmed_mean", y, trim_ratio=trim_ratio), ref_trimmed_mean(y, trim))


def test_squared_distances_match_pairwise():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    got = robust.squared_distances(x)
    for i, j in itertools.product(range(6), repeat=2):
        want = float(np.sum((x[i].astype(np.float64) - x[j].astype(np.float64)) ** 2))
        assert got[i, j] == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert np.all(np.diag(got) == 0.0)


# --- too few contributions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "f", "minimum", "kw"),
    [
        ("krum", 1, 5, {}),
        ("multi_krum", 2, 7, {}),
        ("bulyan", 1, 7, {}),
        ("bulyan", 2, 11, {}),
        ("median", 2, 5, {}),
        ("trimmed_mean", 1, 10, {"trim_ratio": 0.1}),
        ("trimmed_mean", 2, 7, {"trim_ratio": 0.3}),
    ],
)
def test_one_below_minimum_raises(rule, f, minimum, kw):
    rng = np.random.default_rng(minimum)
    x = rng.standard_normal((minimum, 4))
    assert aggregate(rule, x, f=f, **kw).shape == (4,)  # exactly the minimum works
    with pytest.raises(InsufficientContributions) as err:
        aggregate(rule, x[:-1], f=f, **kw)
    assert isinstance(err.value, ValueError)
    assert (err.value.rule, err.value.f, err.value.n, err.value.minimum) == (rule, f, minimum - 1, minimum)
    assert rule in str(err.value) and f"f={f}" in str(err.value) and str(minimum) in str(err.value)


def test_default_f_is_what_the_count_tolerates():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((7, 5))
    np.testing.assert_allclose(aggregate("krum", x), ref_krum(x, 2))  # 7 rows tolerate f = 2
    np.testing.assert_allclose(aggregate("bulyan", x), ref_bulyan(x, 1))  # and f = 1 for Bulyan
    with pytest.raises(InsufficientContributions):
        aggregate("krum", x[:2])  # Krum cannot run on 2 rows at all
    with pytest.raises(InsufficientContributions):
        aggregate("mean", x[:0])


def test_bad_arguments():
    x = np.ones((5, 3))
    with pytest.raises(ValueError, match="unknown aggregation rule"):
        aggregate("avg", x)
    with pytest.raises(ValueError, match="mean tolerates no"):
        aggregate("mean", x, f=1)
    with pytest.raises(ValueError, match="multi_krum needs"):
        aggregate("multi_krum", x, f=1, m=5)
    with pytest.raises(ValueError, match="trim_ratio"):
        aggregate("trimmed_mean", x, trim_ratio=0.5)
    bad = x.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match=r"rows \[3\]"):
        aggregate("median", bad)
    assert robust.finite_rows(bad).tolist() == [True, True, True, False, True]


# --- the tolerance table -----------------------------------------------------------------------------


def test_tolerated_f_and_min_count_table():
    table = {
        # rule: {n: tolerated f}
        "mean": {0: -1, 1: 0, 5: 0},
        "median": {0: -1, 1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 10: 4},
        "krum": {2: -1, 3: 0, 4: 0, 5: 1, 6: 1, 7: 2},
        "multi_krum": {2: -1, 3: 0, 5: 1, 9: 3},
        "bulyan": {2: -1, 3: 0, 6: 0, 7: 1, 10: 1, 11: 2, 15: 3},
    }
    for rule, row in table.items():
        for n, f in row.items():
            assert robust.tolerated_f(rule, n) == f, (rule, n)
    trimmed = {
        (0.1, 0): -1,
        (0.1, 9): 0,
        (0.1, 10): 1,
        (0.1, 19): 1,
        (0.1, 20): 2,
        (0.25, 4): 1,
        (0.29, 100): 29,  # 0.29 * 100 is 28.999999999999996 in binary
    }
    for (ratio, n), f in trimmed.items():
        assert robust.tolerated_f("trimmed_mean", n, ratio) == f, (ratio, n)

    minimum = {
        ("mean", 0): 1,
        ("median", 0): 1,
        ("median", 2): 5,
        ("krum", 0): 3,
        ("krum", 2): 7,
        ("multi_krum", 3): 9,
        ("bulyan", 0): 3,
        ("bulyan", 1): 7,
        ("bulyan", 2): 11,
    }
    for (rule, f), n in minimum.items():
        assert robust.min_count(rule, f) == n, (rule, f)
    assert robust.min_count("trimmed_mean", 1, 0.1) == 10
    assert robust.min_count("trimmed_mean", 2, 0.1) == 20
    assert robust.min_count("trimmed_mean", 2, 0.3) == 7
    assert robust.min_count("trimmed_mean", 29, 0.29) == 100
    with pytest.raises(ValueError):
        robust.min_count("mean", 1)
    with pytest.raises(ValueError):
        robust.min_count("trimmed_mean", 1, 0.0)
    # The two functions agree: the tolerated f is the largest whose minimum count has arrived.
    for rule in robust.RULES:
        for n in range(0, 40):
            f = robust.tolerated_f(rule, n, 0.15)
            if f >= 0:
                assert robust.min_count(rule, f, 0.15) <= n
            if rule != "mean":
                assert robust.min_count(rule, f + 1, 0.15) > n
    assert robust.RULES == ("mean", "trimmed_mean", "median", "krum", "multi_krum", "bulyan")


# --- Byzantine sanity: sign-flipped x10 rows among honest rows near v ------------------------------


@pytest.mark.parametrize(
    ("n", "f", "rules"),
    [
        (4, 1, {"trimmed_mean": {"trim_ratio": 0.25}, "median": {}}),
        (5, 1, {"krum": {}, "multi_krum": {}}),
        (7, 2, {"trimmed_mean": {"trim_ratio": 0.3}, "median": {}, "krum": {}, "multi_krum": {}}),
        (7, 1, {"bulyan": {}}),
        (11, 2, {"bulyan": {}, "krum": {}, "median": {}}),
    ],
)
def test_robust_rules_resist_sign_flipped_rows(n, f, rules):
    rng = np.random.default_rng(100 + n)
    d = 50
    v = rng.standard_normal(d)
    honest = v + 0.01 * rng.standard_normal((n - f, d))
    byzantine = -10.0 * (v + 0.01 * rng.standard_normal((f, d)))
    x = np.vstack([byzantine, honest]).astype(np.float32)  # attackers first: index ties cannot help
    spread = 0.01 * np.sqrt(d)  # the norm of one honest row's noise
    for rule, kw in rules.items():
        got = aggregate(rule, x, f=f, **kw)
        assert np.linalg.norm(got - v) < 3 * spread, rule
        # Coordinate-wise rules stay inside the honest range in every coordinate.
        if rule in ("trimmed_mean", "median"):
            assert np.all(got >= honest.min(axis=0) - 1e-6) and np.all(got <= honest.max(axis=0) + 1e-6)
    mean = aggregate("mean", x)
    assert np.linalg.norm(mean - v) > np.linalg.norm(v)  # the mean is dragged past the origin
