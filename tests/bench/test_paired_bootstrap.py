"""bench/paired_bootstrap.py: the AUC against its pairwise definition, weights against duplicated rows, and the
bootstrap interval on differences whose sign is known."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from paired_bootstrap import _SortedScores, auc, auc_difference  # noqa: E402


def _pairwise_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


def test_auc_matches_the_pairwise_definition_with_ties() -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 300)
    scores = np.round(rng.random(300) + 0.3 * labels, 1)  # coarse: many ties, some across the classes
    assert auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels), abs=1e-12)
    assert auc(labels.astype(float), labels) == 1.0
    assert auc(np.zeros(300), labels) == 0.5


def test_weights_count_as_duplicated_rows() -> None:
    rng = np.random.default_rng(1)
    labels, scores = rng.integers(0, 2, 200), rng.random(200)
    weights = rng.integers(0, 4, 200)
    weighted = _SortedScores(scores, labels).auc(weights.astype(float))
    assert weighted == pytest.approx(auc(np.repeat(scores, weights), np.repeat(labels, weights)), abs=1e-12)


def test_difference_interval_by_users() -> None:
    rng = np.random.default_rng(2)
    users = np.repeat(np.arange(60), 50)  # 60 users x 50 rows
    labels = rng.integers(0, 2, len(users))
    noise = [rng.normal(size=len(users)) for _ in range(4)]
    good = [labels + n for n in noise[:2]]  # AUC about 0.76
    bad = [0.2 * labels + n for n in noise[2:]]  # about 0.56
    r = auc_difference(labels, users, good, bad, replicates=300)
    assert r["units"] == 60 and r["replicates"] == 300
    means = np.mean([auc(s, labels) for s in good]) - np.mean([auc(s, labels) for s in bad])
    assert r["diff"] == pytest.approx(means, abs=1e-5)
    assert 0 < r["low"] < r["diff"] < r["high"] and r["p_below_zero"] == 0.0
    flipped = auc_difference(labels, users, bad, good, replicates=300)
    assert flipped["high"] < 0 and flipped["p_below_zero"] == 1.0
    # The same runs on both sides: every replicate's difference is exactly zero.
    same = auc_difference(labels, None, good, good, replicates=50)
    assert same["units"] == len(labels) and same["low"] == same["high"] == same["diff"] == 0.0
    # Deterministic by seed.
    assert auc_difference(labels, users, good, bad, replicates=300) == r


def test_scores_must_cover_every_row() -> None:
    labels = np.array([0, 1, 0, 1])
    with pytest.raises(ValueError, match="one value per test row"):
        auc_difference(labels, None, [np.zeros(4)], [np.zeros(3)])


def test_quality_bench_compares_with_the_best_peer_from_saved_predictions(tmp_path) -> None:
    """bench/quality.py's comparison: the peer with the best mean test AUC, users as the resampled unit, and
    predictions that do not reproduce a run's reported test AUC refused (a row-order mix-up)."""
    from quality import compare_to_best_peer, summarize

    rng = np.random.default_rng(3)
    users = [f"u{k}" for k in rng.integers(0, 40, 800)]
    labels = rng.integers(0, 2, 800)
    (tmp_path / "test.csv").write_text("label,user_id,item_id\n" + "".join(
        f'{y},"{u}","i"\n' for y, u in zip(labels, users, strict=True)))
    runs = []
    for model, signal in (("recstack DLRM", 1.0), ("FuxiCTR DLRM", 0.3), ("FuxiCTR DCNv2", 0.6)):
        for seed in (0, 1):
            scores = signal * labels + rng.normal(size=800)
            path = tmp_path / f"{model.replace(' ', '_')}_{seed}.npy"
            np.save(path, scores.astype(np.float32))
            runs.append({"model": model, "seed": seed, "test_auc": auc(scores.astype(np.float32), labels),
                         "test_logloss": 0.6, "valid_auc": 0.7, "valid_logloss": 0.6, "wall_s": 1.0,
                         "test_predictions": str(path)})
    c = compare_to_best_peer(tmp_path, runs, summarize(runs))
    assert c["peer"] == "FuxiCTR DCNv2" and c["unit"] == "user" and c["units"] == len(set(users))
    assert 0 < c["low"] < c["diff"] < c["high"]
    runs[0]["test_predictions"] = runs[1]["test_predictions"]  # another run's scores: its AUC does not match
    with pytest.raises(RuntimeError, match="not the run's test AUC"):
        compare_to_best_peer(tmp_path, runs, summarize(runs))
