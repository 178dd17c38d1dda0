"""Sparse embedding optimizers applied inside backward, row by row.

The gradient of a table is never built densely: backward hands us the gradient of each looked-up id and we
update only the touched rows in place. Row-wise Adagrad needs the gradient summed per distinct row first
(sorted, summed in a fixed order, so the result does not depend on thread timing: deterministic updates as
in Neo's fused optimizer) and keeps one accumulator per row (the mean of the squared gradient over the row),
not one per element. SGD is linear in the gradient, so on CPU it skips the aggregation and adds each id's
scaled gradient straight into its row: the same update up to float rounding, still in a fixed order.

Weight decay (``weight_decay`` = wd, L2 on the rows a step touches, lazily, as FBGEMM's / TorchRec's fused
optimizers with ``WeightDecayMode.L2`` and FuxiCTR's ``embedding_regularizer``): for every distinct row r
that the step's ids touch, once however often r occurs, the summed gradient becomes g_r + wd * w_r (w_r the
row before the step), and the optimizer then updates with it: SGD w_r -= lr * (g_r + wd * w_r); row-wise
Adagrad accumulates the mean square of that gradient. Rows the step does not touch neither decay nor move.
This is the gradient of (wd / 2) * sum over the touched rows of ||w_r||^2 added to the loss. wd = 0 (the
default) leaves the update exactly as without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class SparseOptimizerConfig:
    kind: str = "sgd"  # sgd | rowwise_adagrad
    lr: float = 0.1
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    weight_decay: float = 0.0  # L2 on the touched rows (module docstring)

    def __post_init__(self) -> None:
        if self.kind not in ("sgd", "rowwise_adagrad"):
            raise ValueError(f"sparse optimizer {self.kind!r}: expected sgd or rowwise_adagrad")


class SparseOptimFields(Protocol):
    """The fields of the training section (``[optim]``, ``OptimConfig``) the sparse optimizer reads: a lower
    layer cannot import that section, it names what it needs. Read-only properties: the section may narrow
    them (``sparse`` is a Literal there), which a mutable protocol field would not accept."""

    @property
    def sparse(self) -> str: ...
    @property
    def sparse_lr(self) -> float: ...
    @property
    def eps(self) -> float: ...
    @property
    def adagrad_init(self) -> float: ...
    @property
    def sparse_weight_decay(self) -> float: ...


def sparse_optimizer_config(optim: SparseOptimFields) -> SparseOptimizerConfig:
    """``[optim]`` -> the embeddings' optimizer (``sparse``, ``sparse_lr``, ``eps``, ``adagrad_init``,
    ``sparse_weight_decay``)."""
    return SparseOptimizerConfig(optim.sparse, optim.sparse_lr, optim.eps, optim.adagrad_init,
                                 optim.sparse_weight_decay)


def aggregate_rows(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum gradients of repeated rows.

    rows [N] int64, grads [N, D] -> (unique rows [U] sorted ascending, summed grads [U, D]).
    Each row's gradients are summed in their order in ``rows`` on every device, so updates are bitwise
    reproducible.
    """
    if rows.numel() == 0:
        return rows, grads.new_zeros((0, grads.shape[1]))
    if grads.is_cuda:
        # index_add_ uses atomics on CUDA; a sort + segment sum keeps the order fixed.
        uniq, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        order = torch.argsort(inverse, stable=True)
        counts = torch.bincount(inverse, minlength=uniq.numel())
        return uniq, torch.segment_reduce(grads[order], "sum", lengths=counts, axis=0)
    # One stable sort gives the distinct rows and, per row, its ids in input order; embedding_bag then sums
    # each run of equal rows in one vectorised pass (index_add_ would dispatch one kernel per id). Sorting
    # 32-bit keys is about twice as fast as 64-bit ones.
    keys = rows.to(torch.int32) if rows.numel() and int(rows.max()) < 2**31 else rows
    ordered, order = torch.sort(keys, stable=True)
    first = torch.ones(ordered.numel(), dtype=torch.bool, device=rows.device)
    torch.ne(ordered[1:], ordered[:-1], out=first[1:])
    starts = first.nonzero().squeeze(1)  # [U] where each run of equal rows begins
    summed = F.embedding_bag(order, grads.contiguous(), starts, mode="sum")  # [U, D]
    return ordered[starts].to(rows.dtype), summed


class SparseOptimizer:
    """Applies one update to the rows of ``weight`` [R, D] (and ``accumulator`` [R] for Adagrad)."""

    def __init__(self, config: SparseOptimizerConfig) -> None:
        self.config = config
        self.lr_scale = 1.0  # set per step by a learning-rate schedule (recstack.training.lr_schedule)

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
        grads = grads.to(weight.dtype)
        lr = self.config.lr * self.lr_scale
        wd = self.config.weight_decay
        if self.config.kind == "sgd" and not wd and not weight.is_cuda:
            # A serial loop over the ids in order on CPU. The step is folded into the gradient because
            # index_add_ with alpha != 1 takes a much slower path.
            weight.index_add_(0, rows, grads * -lr)
            return
        # Sum per distinct row first: on CUDA index_add_'s atomics would make the order of the adds vary, and
        # the weight decay is once per distinct row.
        uniq, g = aggregate_rows(rows, grads)  # [U], [U, D]
        if wd:
            g.add_(weight.index_select(0, uniq), alpha=wd)  # g_r + wd * w_r
        if self.config.kind == "sgd":
            weight.index_add_(0, uniq, g.mul_(-lr))
            return
        assert accumulator is not None
        acc = accumulator[uniq] + g.pow(2).mean(dim=1)  # [U]
        accumulator[uniq] = acc
        weight.index_add_(0, uniq, g * (-lr / (acc.sqrt() + self.config.eps)).unsqueeze(1))
