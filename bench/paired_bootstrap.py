"""How sure is a difference in test AUC? A paired bootstrap over the test split's users.

``bench/quality.py`` compares two libraries by their mean test AUC over the same seeds, on test splits of a few
thousand rows from a few dozen users. Rows of one user are not independent (a user's taste moves all their
labels), so the resampling unit is the user (a cluster bootstrap): each replicate draws the test split's users
with replacement, weights every row by how often its user was drawn, and recomputes every run's AUC on the same
replicate (paired: both libraries see the same resampled split). The interval is the 2.5 and 97.5 percentiles of
``mean over A's seeds - mean over B's seeds`` over the replicates. Data without a user column (the Criteo sample)
resamples rows.

numpy only, so that bench/quality.py stays free of scikit-learn / scipy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class _SortedScores:
    """One run's scores sorted once, with its tie groups, so that each replicate's AUC is sums over groups."""

    def __init__(self, scores: np.ndarray, labels: np.ndarray) -> None:
        order = np.argsort(scores, kind="stable")
        s = scores[order]
        self.order = order  # [N] row indices by ascending score
        self.starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # [G] where each group of equal scores begins
        self.pos = labels[order] > 0.5  # [N]

    def auc(self, weights: np.ndarray) -> float:
        """weights [N] (rows' multiplicities in a replicate) -> the weighted ROC AUC, ties counted half."""
        w = weights[self.order]
        pos_w = np.add.reduceat(np.where(self.pos, w, 0.0), self.starts)  # [G]
        neg_w = np.add.reduceat(np.where(self.pos, 0.0, w), self.starts)  # [G]
        neg_below = np.cumsum(neg_w) - neg_w  # negatives with a strictly lower score than the group
        denom = pos_w.sum() * neg_w.sum()
        return float((pos_w * (neg_below + 0.5 * neg_w)).sum() / denom) if denom > 0 else float("nan")


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The ROC AUC of scores [N] against 0/1 labels [N] (ties counted half)."""
    return _SortedScores(np.asarray(scores, dtype=np.float64), np.asarray(labels)).auc(np.ones(len(labels)))


def auc_difference(labels: np.ndarray, groups: np.ndarray | None, a: Sequence[np.ndarray],
                   b: Sequence[np.ndarray], replicates: int = 2000, seed: int = 0) -> dict:
    """labels [N]; groups [N] (a user id per row, or None: rows are resampled); a, b: each run's scores [N] (one
    per seed). Returns ``{"diff": mean AUC(a) - mean AUC(b) on the split itself, "low"/"high": the 95% percentile
    interval over the replicates, "p_below_zero": the share of replicates where A's mean is below B's, "units":
    how many users (or rows) are resampled, "replicates"}``."""
    labels = np.asarray(labels)
    if any(len(np.asarray(s)) != len(labels) for s in (*a, *b)):
        raise ValueError("every run's scores must have one value per test row")
    runs = [_SortedScores(np.asarray(s, dtype=np.float64), labels) for s in (*a, *b)]
    unit = np.unique(np.asarray(groups), return_inverse=True)[1] if groups is not None else np.arange(len(labels))
    n_units = int(unit.max()) + 1

    def diff(weights: np.ndarray) -> float:
        aucs = [r.auc(weights) for r in runs]
        return float(np.mean(aucs[:len(a)]) - np.mean(aucs[len(a):]))

    rng = np.random.default_rng(seed)
    reps = np.empty(replicates)
    for i in range(replicates):
        drawn = np.bincount(rng.integers(0, n_units, n_units), minlength=n_units)  # [units] multiplicities
        reps[i] = diff(drawn[unit].astype(np.float64))
    low, high = np.percentile(reps, [2.5, 97.5])
    return {"diff": round(diff(np.ones(len(labels))), 5), "low": round(float(low), 5), "high": round(float(high), 5),
            "p_below_zero": round(float((reps < 0).mean()), 4), "units": n_units, "replicates": replicates}
