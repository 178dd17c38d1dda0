"""The one batch type every model, trainer and sharding path consumes.

Sparse ids are stored feature-major and jagged, like TorchRec's KeyedJaggedTensor: all ids of feature 0
(sample 0, 1, ..., B-1), then all ids of feature 1, and so on. ``offsets`` marks bag boundaries, so bag
``f * B + b`` (feature f, sample b) holds ``ids[offsets[f*B+b] : offsets[f*B+b+1]]``. Feature-major order
lets a sharded collection cut the id stream by feature (table-wise) with one slice per feature.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def feature_bounds(offsets: torch.Tensor, num_features: int) -> torch.Tensor:
    """Feature-major bag offsets [F * B + 1] -> [F + 1] offsets where each feature's ids start (and the end).
    B may be 0 (a rank's share of a short last batch): every feature is then empty."""
    b = (offsets.numel() - 1) // num_features
    return offsets[::b] if b else offsets[:1].expand(num_features + 1)


@dataclass
class SparseFeatures:
    """Jagged sparse ids for ``num_features`` features of ``batch_size`` samples.

    ids:     [N] int64, feature-major.
    offsets: [F * B + 1] int64, non-decreasing, offsets[0] == 0, offsets[-1] == N.
    weights: optional [N] float32 per-id weights (weighted sum pooling).
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    num_features: int
    weights: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return (self.offsets.numel() - 1) // self.num_features

    @property
    def feature_bounds(self) -> torch.Tensor:
        """[F + 1]: feature f's ids are ``ids[bounds[f] : bounds[f + 1]]``."""
        return feature_bounds(self.offsets, self.num_features)

    @property
    def ids_per_feature(self) -> torch.Tensor:
        """[F] number of ids of each feature."""
        return self.feature_bounds.diff()

    @property
    def lengths(self) -> torch.Tensor:
        """[F * B] bag sizes."""
        return self.offsets[1:] - self.offsets[:-1]

    @staticmethod
    def from_dense_ids(ids: torch.Tensor | np.ndarray) -> SparseFeatures:
        """One id per (sample, feature): ids [B, F] -> feature-major jagged form."""
        ids_t = torch.as_tensor(np.asarray(ids) if isinstance(ids, np.ndarray) else ids)
        b, f = ids_t.shape
        flat = ids_t.t().reshape(-1).to(torch.int64)  # [F * B], feature-major
        return SparseFeatures(flat, torch.arange(b * f + 1, dtype=torch.int64), f)

    def feature_slice(self, start: int, end: int) -> SparseFeatures:
        """Features [start, end) as their own SparseFeatures (shares storage where possible)."""
        b = self.batch_size
        lo, hi = int(self.offsets[start * b]), int(self.offsets[end * b])
        offsets = self.offsets[start * b : end * b + 1] - lo
        w = self.weights[lo:hi] if self.weights is not None else None
        return SparseFeatures(self.ids[lo:hi], offsets, end - start, w)

    def select(self, features: list[int]) -> SparseFeatures:
        """The listed features (in that order) as their own SparseFeatures (a copy)."""
        parts = [self.feature_slice(f, f + 1) for f in features]
        ids = torch.cat([p.ids for p in parts])
        lens = torch.cat([p.lengths for p in parts])
        offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        w = torch.cat([p.weights for p in parts if p.weights is not None]) if self.weights is not None else None
        return SparseFeatures(ids, offsets, len(features), w)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseFeatures:
        w = self.weights.to(device, non_blocking=non_blocking) if self.weights is not None else None
        return SparseFeatures(
            self.ids.to(device, non_blocking=non_blocking),
            self.offsets.to(device, non_blocking=non_blocking),
            self.num_features,
            w,
        )


@dataclass
class Batch:
    """dense [B, n_dense] float32, sparse (F features), labels [B] float32 in {0, 1} (or soft).

    ``extras`` carries optional per-sample columns ([B] tensors) such as ``example_id``, ``vertical``,
    ``timestamp`` or a teacher's ``fm_logit``; models ignore what they do not use.

    ``global_rows``: rows of the global batch this batch is one rank's slice of (set by the training loader;
    None: the batch stands alone). A short last global batch is split unevenly over the ranks, and a training
    step weights its loss by it so that the step's gradient is the mean over the rows actually present.
    """

    dense: torch.Tensor
    sparse: SparseFeatures
    labels: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    global_rows: int | None = None

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.extras.items()},
            self.global_rows,
        )

    def pin_memory(self) -> Batch:
        s = self.sparse
        w = s.weights.pin_memory() if s.weights is not None else None
        return Batch(
            self.dense.pin_memory(),
            SparseFeatures(s.ids.pin_memory(), s.offsets.pin_memory(), s.num_features, w),
            self.labels.pin_memory(),
            {k: v.pin_memory() for k, v in self.extras.items()},
            self.global_rows,
        )


__all__ = ["Batch", "SparseFeatures"]
