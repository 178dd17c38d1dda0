"""Exact binary-classification metrics accumulated over a whole evaluation set.

``BinaryMetrics`` keeps every logit and label it has seen (float32, on the device they arrived on) so that
AUC is the exact Mann-Whitney statistic over the full set rather than a histogram approximation, and keeps
float64 running sums for the metrics that decompose over examples (logloss, label mean, mean prediction,
accuracy). Accumulators from several ranks combine with ``merge`` or through ``state()`` / ``from_state()``,
whose plain tensors can be all-gathered.

Definitions (N examples, logits x, probabilities q = sigmoid(x) in float64, labels y in [0, 1]):

* ``logloss``      mean of -(y log q + (1 - y) log(1 - q)), evaluated with log-sigmoid so large |x| is exact.
* ``ne``           logloss / H(p) with p = mean(y) and H the binary entropy: the loss relative to always
                   predicting the base rate (NE = 1). NaN when p is 0 or 1 (H(p) = 0).
* ``calibration``  mean(q) / mean(y); NaN when mean(y) = 0.
* ``ece``          expected calibration error over ``ECE_BINS`` = 15 equal-width bins of q on [0, 1] (bin
                   b holds b/15 <= q < (b+1)/15, q = 1 in the last): sum over bins of n_b / N *
                   |mean(q in b) - mean(y in b)|. 0 for a perfectly calibrated model; unlike ``calibration``
                   it sees a model that is too confident in both directions. ``reliability()`` gives the bins.
* ``accuracy``     fraction classified right at q > 0.5. A soft label y scores
                   y * [q > 0.5] + (1 - y) * [q <= 0.5].
* ``auc``          probability that a random positive scores above a random negative, ties counting 1/2.
                   Soft labels weigh each example as y positive and (1 - y) negative. NaN with one class.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# Positions in the float64 running-sum vector.
_LOSS, _LABEL, _PRED, _CORRECT, _COUNT = range(5)
_NUM_SUMS = 5
ECE_BINS = 15  # equal-width probability bins of the expected calibration error and the reliability diagram


def _as_1d(x: torch.Tensor | np.ndarray, field: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() == 2 and t.shape[1] == 1:  # [B, 1] model heads are common; treat them as [B]
        t = t[:, 0]
    if t.dim() != 1:
        raise ValueError(f"{field}: expected a [B] tensor, got shape {tuple(t.shape)}")
    if not (t.is_floating_point() or t.dtype in (torch.bool, torch.int32, torch.int64, torch.uint8)):
        raise ValueError(f"{field}: expected a real-valued tensor, got dtype {t.dtype}")
    return t


def _check_pair(
    scores: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray, score_field: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shapes and values; returns ([B] scores, [B] labels) on the scores' device."""
    s = _as_1d(scores, score_field)
    y = _as_1d(labels, "labels").to(s.device)
    if s.shape != y.shape:
        raise ValueError(f"{score_field} has shape {tuple(s.shape)} but labels has shape {tuple(y.shape)}")
    if s.numel() == 0:
        return s, y
    finite = torch.isfinite(s) if s.is_floating_point() else torch.ones_like(s, dtype=torch.bool)
    if not bool(finite.all()):
        bad = int((~finite).nonzero()[0, 0])
        raise ValueError(f"{score_field}: non-finite value {s[bad].item()} at index {bad}")
    yd = y.double()
    if not bool(((yd >= 0) & (yd <= 1)).all()):  # also rejects NaN
        bad = int((~((yd >= 0) & (yd <= 1))).nonzero()[0, 0])
        raise ValueError(f"labels: value {yd[bad].item()} at index {bad} is outside [0, 1]")
    return s, y


def _weighted_auc(scores: torch.Tensor, pos_w: torch.Tensor) -> float:
    """AUC of [N] scores where example i is pos_w[i] positive and 1 - pos_w[i] negative (float64 [N]).

    Sorting once and grouping equal scores gives the tie-corrected Mann-Whitney statistic: a positive in
    group g beats every negative in lower groups and half of the negatives in its own group.
    """
    neg_w = 1.0 - pos_w
    total_pos, total_neg = float(pos_w.sum()), float(neg_w.sum())
    if total_pos <= 0.0 or total_neg <= 0.0:
        return float("nan")
    order = torch.argsort(scores, stable=True)
    sorted_scores = scores[order]
    _, group = torch.unique_consecutive(sorted_scores, return_inverse=True)
    num_groups = int(group[-1]) + 1
    pos_g = torch.zeros(num_groups, dtype=torch.float64, device=scores.device)
    neg_g = torch.zeros_like(pos_g)
    pos_g.index_add_(0, group, pos_w[order])
    neg_g.index_add_(0, group, neg_w[order])
    neg_below = torch.cumsum(neg_g, 0) - neg_g
    wins = (pos_g * (neg_below + 0.5 * neg_g)).sum()
    return float(wins) / (total_pos * total_neg)


def auc(scores: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> float:
    """Exact ROC AUC of [N] scores (any monotone score: logits or probabilities) against [N] labels in [0, 1].

    Ties count one half. Returns NaN when only one class is present.
    """
    s, y = _check_pair(scores, labels, "scores")
    if s.numel() == 0:
        return float("nan")
    return _weighted_auc(s.double(), y.double())


def _binary_entropy(p: float) -> float:
    """Entropy in nats of a Bernoulli(p); NaN at p in {0, 1} where NE is undefined."""
    if not 0.0 < p < 1.0:
        return float("nan")
    return -(p * math.log(p) + (1.0 - p) * math.log1p(-p))


def _bce_sum(logits64: torch.Tensor, labels64: torch.Tensor) -> torch.Tensor:
    """Sum of binary cross-entropy over [B] float64 logits/labels; log-sigmoid keeps large |x| finite."""
    return -(labels64 * F.logsigmoid(logits64) + (1.0 - labels64) * F.logsigmoid(-logits64)).sum()


def normalized_entropy(logits: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> float:
    """Normalized entropy of [N] logits against [N] labels: mean BCE / H(mean label). NaN if H is 0."""
    x, y = _check_pair(logits, labels, "logits")
    if x.numel() == 0:
        return float("nan")
    x64, y64 = x.double(), y.double()
    logloss = float(_bce_sum(x64, y64)) / x.numel()
    return logloss / _binary_entropy(float(y64.mean()))


class BinaryMetrics:
    """Accumulates [B] logits and labels batch by batch; ``compute()`` gives exact whole-set metrics.

    Memory grows with the evaluation set: 8 bytes per example (float32 logit + float32 label). AUC ranks
    the stored float32 logits, which orders examples exactly as their probabilities would but without the
    ties that float64 sigmoid saturation creates beyond |x| ~ 37.

    Args:
        validate: check every batch for non-finite logits and labels outside [0, 1]. This reads a value
            back from the device each batch; turn it off in tight GPU loops once inputs are trusted.
    """

    def __init__(self, validate: bool = True) -> None:
        self.validate = validate
        self.reset()

    def reset(self) -> None:
        """Forget everything accumulated so far."""
        self._logits: list[torch.Tensor] = []  # float32 [B_i] chunks
        self._labels: list[torch.Tensor] = []  # float32 [B_i] chunks
        self._sums: torch.Tensor | None = None  # float64 [_NUM_SUMS] on the data's device
        self._device: torch.device | None = None

    # ------------------------------------------------------------------ accumulation
    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one batch: logits [B] (or [B, 1]) and labels [B] in [0, 1] (soft labels allowed)."""
        if self.validate:
            x, y = _check_pair(logits, labels, "logits")
        else:
            x, y = _as_1d(logits, "logits"), _as_1d(labels, "labels").to(torch.as_tensor(logits).device)
            if x.shape != y.shape:
                raise ValueError(f"logits has shape {tuple(x.shape)} but labels has shape {tuple(y.shape)}")
        if x.numel() == 0:
            return
        x, y = x.detach(), y.detach()
        if self._device is None:
            self._device = x.device
        x, y = x.to(self._device), y.to(self._device)
        # Sums use the caller's full precision (before the float32 copy kept for AUC).
        x64, y64 = x.double(), y.double()
        q = torch.sigmoid(x64)
        pred_pos = (q > 0.5).double()
        batch = torch.stack(
            [
                _bce_sum(x64, y64),
                y64.sum(),
                q.sum(),
                (y64 * pred_pos + (1.0 - y64) * (1.0 - pred_pos)).sum(),
                torch.tensor(float(x.numel()), dtype=torch.float64, device=self._device),
            ]
        )
        self._sums = batch if self._sums is None else self._sums + batch
        self._logits.append(x.float())
        self._labels.append(y.float())

    def merge(self, other: BinaryMetrics) -> None:
        """Fold another accumulator (e.g. another rank's, or another shard's) into this one."""
        if other is self:
            raise ValueError("merge: cannot merge an accumulator into itself (it would count every example twice)")
        if other._sums is None:
            return
        if self._device is None:
            self._device = other._device
        self._logits.extend(t.to(self._device) for t in other._logits)
        self._labels.extend(t.to(self._device) for t in other._labels)
        other_sums = other._sums.to(self._device)
        self._sums = other_sums.clone() if self._sums is None else self._sums + other_sums

    # ------------------------------------------------------------------ state for all-gather
    def _flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored (float32 [N] logits, float32 [N] labels); compacts the chunk lists as a side effect."""
        if not self._logits:
            empty = torch.zeros(0, dtype=torch.float32, device=self._device)
            return empty, empty.clone()
        if len(self._logits) > 1:
            self._logits = [torch.cat(self._logits)]
            self._labels = [torch.cat(self._labels)]
        return self._logits[0], self._labels[0]

    def state(self) -> dict[str, torch.Tensor]:
        """Plain tensors: ``logits`` float32 [N], ``labels`` float32 [N], ``sums`` float64 [5].

        ``sums`` holds (BCE sum, label sum, probability sum, correct count, example count). Ranks can
        all-gather these (padding logits/labels to the largest N) and rebuild with ``from_state``.
        """
        logits, labels = self._flat()
        sums = self._sums if self._sums is not None else torch.zeros(_NUM_SUMS, dtype=torch.float64)
        return {"logits": logits.clone(), "labels": labels.clone(), "sums": sums.clone()}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], validate: bool = True) -> BinaryMetrics:
        """Rebuild an accumulator from ``state()`` output."""
        missing = {"logits", "labels", "sums"} - set(state)
        if missing:
            raise KeyError(f"metrics state: missing field(s) {sorted(missing)}")
        logits, labels, sums = state["logits"], state["labels"], state["sums"]
        if sums.shape != (_NUM_SUMS,):
            raise ValueError(
                f"metrics state: field 'sums' has shape {tuple(sums.shape)}, expected ({_NUM_SUMS},)"
            )
        if logits.dim() != 1 or logits.shape != labels.shape:
            raise ValueError(
                f"metrics state: fields 'logits' {tuple(logits.shape)} and 'labels' {tuple(labels.shape)} "
                "must be equal-length 1-D tensors"
            )
        if int(round(float(sums[_COUNT]))) != logits.numel():
            raise ValueError(
                f"metrics state: field 'sums' counts {float(sums[_COUNT]):.0f} examples but 'logits' holds "
                f"{logits.numel()} (strip all-gather padding before from_state)"
            )
        m = cls(validate=validate)
        if logits.numel() == 0:
            return m
        m._device = logits.device
        m._logits = [logits.detach().float().clone()]
        m._labels = [labels.detach().float().to(logits.device).clone()]
        m._sums = sums.detach().double().to(logits.device).clone()
        return m

    # ------------------------------------------------------------------ results
    @property
    def num_examples(self) -> int:
        return 0 if self._sums is None else int(round(float(self._sums[_COUNT])))

    def reliability(self, bins: int = ECE_BINS) -> dict[str, list[Any]]:
        """The reliability diagram's data: per equal-width probability bin (``lower`` edge, ``upper`` edge) the
        ``count`` of examples, their ``mean_prediction`` and their observed ``rate`` (mean label; NaN in an
        empty bin)."""
        logits, labels = self._flat()
        count, q_sum, y_sum = calibration_bins(logits, labels, bins)
        nan = float("nan")
        return {
            "lower": [b / bins for b in range(bins)],
            "upper": [(b + 1) / bins for b in range(bins)],
            "count": [int(c) for c in count.tolist()],
            "mean_prediction": [q / c if c else nan for q, c in zip(q_sum.tolist(), count.tolist(), strict=True)],
            "rate": [y / c if c else nan for y, c in zip(y_sum.tolist(), count.tolist(), strict=True)],
        }

    def compute(self) -> dict[str, float]:
        """Whole-set metrics; every value is NaN (and num_examples 0) before the first update."""
        nan = float("nan")
        n = self.num_examples
        if n == 0 or self._sums is None:
            keys = ("auc", "logloss", "ne", "calibration", "ece", "accuracy", "ctr", "mean_prediction")
            return {**dict.fromkeys(keys, nan), "num_examples": 0}
        loss_sum, label_sum, pred_sum, correct_sum, _ = self._sums.tolist()
        logloss = loss_sum / n
        ctr = label_sum / n
        mean_pred = pred_sum / n
        logits, labels = self._flat()
        return {
            "auc": _weighted_auc(logits.double(), labels.double()),
            "logloss": logloss,
            "ne": logloss / _binary_entropy(ctr),
            "calibration": mean_pred / ctr if ctr > 0.0 else nan,
            "ece": expected_calibration_error(logits, labels),
            "accuracy": correct_sum / n,
            "num_examples": n,
            "ctr": ctr,
            "mean_prediction": mean_pred,
        }


def calibration_bins(logits: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N] logits and labels -> float64 [bins] (count, sum of q, sum of y) per equal-width bin of the
    probability q = sigmoid(logit) on [0, 1] (q = 1 falls in the last bin)."""
    q = torch.sigmoid(logits.double())
    index = (q * bins).long().clamp_(0, bins - 1)
    out = torch.zeros(3, bins, dtype=torch.float64, device=q.device)
    out[0].index_add_(0, index, torch.ones_like(q))
    out[1].index_add_(0, index, q)
    out[2].index_add_(0, index, labels.double())
    return out[0], out[1], out[2]


def expected_calibration_error(logits: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> float:
    """sum_b n_b / N * |mean q_b - mean y_b| over ``calibration_bins``; NaN without examples."""
    count, q_sum, y_sum = calibration_bins(logits, labels, bins)
    n = float(count.sum())
    return float((q_sum - y_sum).abs().sum()) / n if n else float("nan")


def streaming_auc(scores: np.ndarray, labels: np.ndarray, block_rows: int = 1 << 20, group_bins: int = 64) -> float:
    """Exact ROC AUC (ties count 1/2) of [N] float32 scores >= 0 against [N] 0/1 labels, in bounded memory.

    Works on memory maps: the uint32 bit pattern of a non-negative float32 orders like its value, so a
    histogram over the top 16 bits settles every pair in different bins, and one pass per ``group_bins``
    mixed bins histograms the low 16 bits to settle the rest exactly. NaN when one class is missing.
    """
    n = len(scores)

    def blocks():
        for s in range(0, n, block_rows):
            bits = np.ascontiguousarray(scores[s : s + block_rows], dtype=np.float32).view(np.uint32)
            if bits.size and bits.max() >= 0x7F800000:
                raise ValueError(f"streaming_auc: scores must be finite and >= 0 (block at row {s})")
            yield bits, np.asarray(labels[s : s + block_rows]) > 0.5

    pos = np.zeros(1 << 16, dtype=np.int64)
    neg = np.zeros(1 << 16, dtype=np.int64)
    for bits, y in blocks():
        hi = bits >> 16
        pos += np.bincount(hi[y], minlength=1 << 16)
        neg += np.bincount(hi[~y], minlength=1 << 16)
    total_pos, total_neg = int(pos.sum()), int(neg.sum())
    if total_pos == 0 or total_neg == 0:
        return float("nan")
    # Twice the Mann-Whitney count, in integers so it stays exact (int64 holds it up to ~4e9 rows).
    wins2 = 2 * int((pos * (np.cumsum(neg) - neg)).sum())
    mixed = np.flatnonzero((pos > 0) & (neg > 0))
    for g in range(0, len(mixed), group_bins):
        group = mixed[g : g + group_bins]
        slot = np.full(1 << 16, -1, dtype=np.int64)
        slot[group] = np.arange(len(group))
        fpos: np.ndarray = np.zeros(len(group) << 16, dtype=np.int64)  # [G << 16], then [G, 1 << 16]
        fneg = np.zeros_like(fpos)
        for bits, y in blocks():
            s = slot[bits >> 16]
            keep = s >= 0
            key = (s[keep] << 16) | (bits[keep] & 0xFFFF).astype(np.int64)
            yk = y[keep]
            fpos += np.bincount(key[yk], minlength=fpos.size)
            fneg += np.bincount(key[~yk], minlength=fneg.size)
        fpos, fneg = fpos.reshape(len(group), -1), fneg.reshape(len(group), -1)
        below = np.cumsum(fneg, axis=1) - fneg
        wins2 += int((2 * fpos * below + fpos * fneg).sum())
    return wins2 / (2 * total_pos * total_neg)
