"""Per-feature vocabularies for Criteo categoricals: count raw values in one pass, then map raw -> id.

Ids are assigned in ascending order of the raw value (deterministic whatever the file order or chunking):
the kept values of a feature get ids 1..V and id 0 is shared by missing, rare (count < min_freq) and unseen
values, so a table has V + 1 rows.

Memory grows with the number of distinct values: about 12 bytes per distinct (feature, value) pair while
counting (uint32 value + int64 count), plus transient merge copies of the largest run, and 4 bytes per kept
value afterwards. Criteo Kaggle (~33M distinct in total) needs well under 1 GiB; the Terabyte logs hold
hundreds of millions of distinct values and need many GiB: use hashing (``max_ind_range``) there.
"""

from __future__ import annotations

import numpy as np


class _SortedCounts:
    """Counts of one feature as a few sorted runs of (value, count), merged like a binary counter so the
    total merge work stays O(N log N) however many chunks arrive."""

    def __init__(self) -> None:
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, values: np.ndarray, counts: np.ndarray) -> None:
        self.runs.append((values, counts))
        while len(self.runs) > 1 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0]):
            b = self.runs.pop()
            a = self.runs.pop()
            self.runs.append(_merge(a, b))

    def total(self) -> tuple[np.ndarray, np.ndarray]:
        while len(self.runs) > 1:
            b = self.runs.pop()
            a = self.runs.pop()
            self.runs.append(_merge(a, b))
        if not self.runs:
            return np.zeros(0, np.uint32), np.zeros(0, np.int64)
        return self.runs[0]


def _merge(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    values = np.concatenate([a[0], b[0]])
    counts = np.concatenate([a[1], b[1]])
    order = np.argsort(values, kind="stable")
    values, counts = values[order], counts[order]
    first = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
    return values[first], np.add.reduceat(counts, first) if len(first) else counts


class VocabCounter:
    """Count raw categorical values per feature across chunks; ``vocabularies`` keeps the frequent ones."""

    def __init__(self, num_features: int) -> None:
        self.num_features = num_features
        self._counts = [_SortedCounts() for _ in range(num_features)]

    def add(self, raw: np.ndarray) -> None:
        """raw: int [n, num_features] raw values in [0, 2**32); 0 means missing and is not counted."""
        if raw.ndim != 2 or raw.shape[1] != self.num_features:
            raise ValueError(f"expected raw values [n, {self.num_features}], got shape {raw.shape}")
        for f in range(self.num_features):
            col = raw[:, f].astype(np.uint32)  # values come from at most 8 hex digits
            values, counts = np.unique(col[col != 0], return_counts=True)
            self._counts[f].add(values, counts.astype(np.int64))

    def vocabularies(self, min_freq: int = 1) -> list[np.ndarray]:
        """Per feature, the sorted uint32 values seen at least ``min_freq`` times (id = position + 1)."""
        if min_freq < 1:
            raise ValueError(f"min_freq must be >= 1, got {min_freq}")
        out = []
        for c in self._counts:
            values, counts = c.total()
            out.append(values[counts >= min_freq])
        return out


def apply_vocabularies(raw: np.ndarray, vocabs: list[np.ndarray]) -> np.ndarray:
    """raw: int [n, F] raw values; vocabs: F sorted uint32 arrays. Returns int32 [n, F] ids in [0, V_f]:
    position + 1 for a kept value, 0 for missing / rare / unseen."""
    n, num_features = raw.shape
    if num_features != len(vocabs):
        raise ValueError(f"{num_features} features but {len(vocabs)} vocabularies")
    out = np.zeros((n, num_features), np.int32)
    for f, vocab in enumerate(vocabs):
        if not len(vocab):
            continue
        col = raw[:, f].astype(np.uint32)
        pos = np.searchsorted(vocab, col)
        found = vocab[np.minimum(pos, len(vocab) - 1)] == col
        out[:, f] = np.where(found, pos + 1, 0)
    return out
