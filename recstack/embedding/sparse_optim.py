"""Sparse embedding optimizers applied inside backward, row by row.

The gradient of a table is never built densely: backward hands us the gradient of each looked-up id, we sum
it per distinct row (sorted, so the result does not depend on id order or thread timing: deterministic
updates as in Neo's fused optimizer) and update only those rows in place. Row-wise Adagrad keeps one
accumulator per row (the mean of the squared gradient over the row), not one per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseOptimizerConfig:
    kind: str = "sgd"  # sgd | rowwise_adagrad
    lr: float = 0.1
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("sgd", "rowwise_adagrad"):
            raise ValueError(f"sparse optimizer {self.kind!r}: expected sgd or rowwise_adagrad")


def aggregate_rows(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum gradients of repeated rows.

    rows [N] int64, grads [N, D] -> (unique rows [U] sorted ascending, summed grads [U, D]).
    The sum runs in sorted-row order on every device, so updates are bitwise reproducible.
    """
    uniq, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    if uniq.numel() == rows.numel():  # no repeats: just reorder
        out = torch.empty((uniq.numel(), grads.shape[1]), dtype=grads.dtype, device=grads.device)
        out[inverse] = grads
        return uniq, out
    if grads.is_cuda:
        # index_add_ uses atomics on CUDA; a sort + segment sum keeps the order fixed.
        order = torch.argsort(inverse, stable=True)
        counts = torch.bincount(inverse, minlength=uniq.numel())
        out = torch.segment_reduce(grads[order], "sum", lengths=counts, axis=0)
        return uniq, out
    out = torch.zeros((uniq.numel(), grads.shape[1]), dtype=grads.dtype, device=grads.device)
    out.index_add_(0, inverse, grads)
    return uniq, out


class SparseOptimizer:
    """Applies one update to the rows of ``weight`` [R, D] (and ``accumulator`` [R] for Adagrad)."""

    def __init__(self, config: SparseOptimizerConfig) -> None:
        self.config = config

    @property
    def needs_accumulator(self) -> bool:
        return self.config.kind == "rowwise_adagrad"

    @torch.no_grad()
    def step(
        self,
        weight: torch.Tensor,
        accumulator: torch.Tensor | None,
        rows: torch.Tensor,
        grads: torch.Tensor,
    ) -> None:
        """rows [N] (may repeat), grads [N, D] -> in-place update of the touched rows."""
        if rows.numel() == 0:
            return
        uniq, g = aggregate_rows(rows, grads.to(weight.dtype))
        lr = self.config.lr
        if self.config.kind == "sgd":
            weight.index_add_(0, uniq, g, alpha=-lr)
            return
        assert accumulator is not None
        acc = accumulator[uniq] + g.pow(2).mean(dim=1)  # [U]
        accumulator[uniq] = acc
        weight.index_add_(0, uniq, g * (-lr / (acc.sqrt() + self.config.eps)).unsqueeze(1))
