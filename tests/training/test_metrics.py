"""BinaryMetrics and the standalone metric functions against scikit-learn and brute-force definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import accuracy_score, log_loss, roc_auc_score

from recstack.metrics import BinaryMetrics, auc, normalized_entropy

# Uneven batch sizes, including a single example and an empty batch, summing to 5000.
BATCH_SIZES = [1, 7, 0, 613, 2048, 1, 1329, 1000, 1]


def _data(n: int = 5000, seed: int = 0, tie_decimals: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [n] logits and float32 [n] 0/1 labels correlated with them; rounding creates ties."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(-1.0, 1.5, size=n)
    if tie_decimals is not None:
        logits = np.round(logits, tie_decimals)
    p_true = 1.0 / (1.0 + np.exp(-(logits + rng.normal(0.0, 1.0, size=n))))
    labels = (rng.random(n) < p_true).astype(np.float32)
    return torch.from_numpy(logits.astype(np.float32)), torch.from_numpy(labels)


def _sigmoid_np(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def _accumulate(logits: torch.Tensor, labels: torch.Tensor, sizes: list[int]) -> BinaryMetrics:
    assert sum(sizes) == logits.numel()
    m = BinaryMetrics()
    start = 0
    for size in sizes:
        m.update(logits[start : start + size], labels[start : start + size])
        start += size
    return m


def _brute_force_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mean over all (positive, negative) pairs of [pos > neg] + 0.5 [pos == neg]."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


@pytest.mark.parametrize("tie_decimals", [None, 1, 0])
def test_matches_sklearn_in_uneven_batches(tie_decimals: int | None) -> None:
    logits, labels = _data(tie_decimals=tie_decimals)
    if tie_decimals is not None:
        # The rounding really produced ties (otherwise this case tests nothing new).
        assert torch.unique(logits).numel() < logits.numel() // 10
    got = _accumulate(logits, labels, BATCH_SIZES).compute()

    x, y = logits.numpy().astype(np.float64), labels.numpy().astype(np.float64)
    q = _sigmoid_np(x)
    assert got["num_examples"] == logits.numel()
    assert got["auc"] == pytest.approx(roc_auc_score(y, x), rel=1e-12)
    assert got["auc"] == pytest.approx(roc_auc_score(y, q), rel=1e-12)
    assert got["logloss"] == pytest.approx(log_loss(y, q), rel=1e-10)
    assert got["accuracy"] == pytest.approx(accuracy_score(y, q > 0.5), rel=1e-12)
    ctr = float(y.mean())
    entropy = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    assert got["ctr"] == pytest.approx(ctr, rel=1e-12)
    assert got["mean_prediction"] == pytest.approx(float(q.mean()), rel=1e-10)
    assert got["calibration"] == pytest.approx(float(q.mean()) / ctr, rel=1e-10)
    assert got["ne"] == pytest.approx(log_loss(y, q) / entropy, rel=1e-10)


def test_batched_equals_single_accumulation() -> None:
    logits, labels = _data(seed=3, tie_decimals=1)
    batched = _accumulate(logits, labels, BATCH_SIZES).compute()
    single = _accumulate(logits, labels, [logits.numel()]).compute()
    assert batched.keys() == single.keys()
    for key in single:
        assert batched[key] == pytest.approx(single[key], rel=1e-12), key


def test_auc_with_ties_matches_pair_count() -> None:
    logits, labels = _data(n=800, seed=5, tie_decimals=0)
    expected = _brute_force_auc(logits.numpy().astype(np.float64), labels.numpy())
    assert auc(logits, labels) == pytest.approx(expected, rel=1e-12)
    assert auc(-logits, labels) == pytest.approx(1.0 - expected, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(min_value=-3, max_value=3), st.booleans()),
        min_size=2,
        max_size=40,
    )
)
def test_auc_property_small_integer_scores(pairs: list[tuple[int, bool]]) -> None:
    scores = np.array([s for s, _ in pairs], dtype=np.float64)
    labels = np.array([float(b) for _, b in pairs])
    got = auc(torch.from_numpy(scores), torch.from_numpy(labels))
    if labels.min() == labels.max():
        assert math.isnan(got)
    else:
        assert got == pytest.approx(_brute_force_auc(scores, labels), rel=1e-12)


def test_saturated_logits_still_ranked() -> None:
    # sigmoid(40) and sigmoid(50) are both 1.0 in float64; ranking by logits keeps them apart.
    logits = torch.tensor([40.0, 50.0, 45.0, 60.0])
    labels = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert auc(logits, labels) == 1.0


def test_logloss_is_stable_for_large_logits() -> None:
    m = BinaryMetrics()
    # sigmoid(-1000) underflows to 0 even in float64, so log(sigmoid(x)) would give inf.
    m.update(torch.tensor([1000.0, -1000.0, 30.0]), torch.tensor([0.0, 1.0, 0.0]))
    # BCE(x, y) = softplus(x) - y * x: 1000 for each of the first two, 30 + log1p(e^-30) for the third.
    expected = (2000.0 + 30.0 + math.log1p(math.exp(-30.0))) / 3
    assert m.compute()["logloss"] == pytest.approx(expected, rel=1e-12)


def test_base_rate_predictor_has_unit_ne() -> None:
    rng = np.random.default_rng(11)
    labels = torch.from_numpy((rng.random(20_000) < 0.137).astype(np.float64))
    p = float(labels.mean())
    logits = torch.full((labels.numel(),), math.log(p / (1.0 - p)), dtype=torch.float64)
    m = BinaryMetrics()
    for lo in range(0, labels.numel(), 3001):
        m.update(logits[lo : lo + 3001], labels[lo : lo + 3001])
    got = m.compute()
    assert abs(got["ne"] - 1.0) < 1e-9
    assert abs(normalized_entropy(logits, labels) - 1.0) < 1e-9
    assert abs(got["calibration"] - 1.0) < 1e-9
    assert got["auc"] == 0.5  # every score tied


def test_better_predictor_has_lower_ne() -> None:
    logits, labels = _data(seed=2)
    assert normalized_entropy(logits, labels) < 1.0
    assert normalized_entropy(-logits, labels) > 1.0


@pytest.mark.parametrize("label_value", [0.0, 1.0])
def test_single_class_gives_nan_not_crash(label_value: float) -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    labels = torch.full((50,), label_value)
    m = BinaryMetrics()
    m.update(logits, labels)
    got = m.compute()
    assert math.isnan(got["auc"])
    assert math.isnan(got["ne"])
    assert math.isnan(auc(logits, labels))
    assert math.isnan(normalized_entropy(logits, labels))
    assert math.isfinite(got["logloss"])
    assert got["ctr"] == label_value
    assert math.isnan(got["calibration"]) == (label_value == 0.0)


def test_empty_accumulator() -> None:
    got = BinaryMetrics().compute()
    assert got["num_examples"] == 0
    assert all(math.isnan(v) for k, v in got.items() if k != "num_examples")


def test_soft_labels() -> None:
    rng = np.random.default_rng(7)
    x = np.round(rng.normal(size=600), 1).astype(np.float32)
    y = rng.random(600).astype(np.float32)
    m = BinaryMetrics()
    m.update(torch.from_numpy(x[:250]), torch.from_numpy(y[:250]))
    m.update(torch.from_numpy(x[250:]), torch.from_numpy(y[250:]))
    got = m.compute()

    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    q = _sigmoid_np(x64)
    expected_loss = float(np.mean(-(y64 * np.log(q) + (1 - y64) * np.log1p(-q))))
    assert got["logloss"] == pytest.approx(expected_loss, rel=1e-10)
    expected_acc = float(np.mean(np.where(q > 0.5, y64, 1 - y64)))
    assert got["accuracy"] == pytest.approx(expected_acc, rel=1e-10)
    # A soft label y is the example counted y times positive and (1 - y) times negative.
    dup_scores = np.concatenate([x64, x64])
    dup_labels = np.concatenate([np.ones(600), np.zeros(600)])
    dup_weights = np.concatenate([y64, 1 - y64])
    expected_auc = roc_auc_score(dup_labels, dup_scores, sample_weight=dup_weights)
    assert got["auc"] == pytest.approx(expected_auc, rel=1e-6)  # labels kept as float32 for AUC


def test_merge_equals_single_accumulation() -> None:
    logits, labels = _data(seed=4, tie_decimals=1)
    whole = _accumulate(logits, labels, [logits.numel()]).compute()
    a = _accumulate(logits[:1234], labels[:1234], [1000, 234])
    b = _accumulate(logits[1234:], labels[1234:], [3766])
    a.merge(b)
    a.merge(BinaryMetrics())  # merging an empty accumulator changes nothing
    empty = BinaryMetrics()
    empty.merge(a)
    for got in (a.compute(), empty.compute()):
        for key in whole:
            assert got[key] == pytest.approx(whole[key], rel=1e-12), key
    with pytest.raises(ValueError, match="itself"):
        a.merge(a)


def test_state_round_trip() -> None:
    logits, labels = _data(n=900, seed=8)
    m = _accumulate(logits, labels, [400, 500])
    state = m.state()
    assert set(state) == {"logits", "labels", "sums"}
    assert state["logits"].shape == (900,) and state["logits"].dtype == torch.float32
    assert state["sums"].dtype == torch.float64
    rebuilt = BinaryMetrics.from_state(state).compute()
    original = m.compute()
    for key in original:
        assert rebuilt[key] == original[key], key

    padded = dict(state, logits=torch.cat([state["logits"], torch.zeros(3)]))
    padded["labels"] = torch.cat([state["labels"], torch.zeros(3)])
    with pytest.raises(ValueError, match="padding"):
        BinaryMetrics.from_state(padded)
    with pytest.raises(KeyError, match="sums"):
        BinaryMetrics.from_state({"logits": state["logits"], "labels": state["labels"]})


def test_reset() -> None:
    logits, labels = _data(n=100)
    m = _accumulate(logits, labels, [100])
    m.reset()
    assert m.compute()["num_examples"] == 0


def test_bad_inputs_name_the_field() -> None:
    m = BinaryMetrics()
    with pytest.raises(ValueError, match="shape"):
        m.update(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="logits: non-finite value nan at index 2"):
        m.update(torch.tensor([0.0, 1.0, float("nan")]), torch.zeros(3))
    with pytest.raises(ValueError, match="labels: value 2.0 at index 1"):
        m.update(torch.zeros(3), torch.tensor([0.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match=r"logits: expected a \[B\] tensor"):
        m.update(torch.zeros(3, 2), torch.zeros(3))
    assert m.num_examples == 0  # rejected batches leave no trace
