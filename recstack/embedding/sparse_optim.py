"""Sparse embedding optimizers applied inside backward, row by row.

The gradient of a table is never built densely: backward hands us the gradient of each looked-up id and we
update only the touched rows in place. Row-wise Adagrad needs the gradient summed per distinct row first
(sorted, summed in a fixed order, so the result does not depend on thread timing: deterministic updates as
in Neo's fused optimizer) and keeps one accumulator per row (the mean of the squared gradient over the row),
not one per element. SGD is linear in the gradient, so on CPU it skips the aggregation and adds each id's
scaled gradient straight into its row: the same update up to float rounding, still in a fixed order.

Weight decay (``weight_decay`` = wd; ``weight_decay_mode = "touched"``, the default: L2 on the rows a step
touches, lazily, as FBGEMM's / TorchRec's fused optimizers with ``WeightDecayMode.L2``): for every distinct row r
that the step's ids touch, once however often r occurs, the summed gradient becomes g_r + wd * w_r (w_r the
row before the step), and the optimizer then updates with it: SGD w_r -= lr * (g_r + wd * w_r); row-wise
Adagrad accumulates the mean square of that gradient. Rows the step does not touch neither decay nor move.
This is the gradient of (wd / 2) * sum over the touched rows of ||w_r||^2 added to the loss. wd = 0 (the
default) leaves the update exactly as without it.

``weight_decay_mode = "all_rows"`` is FuxiCTR's ``embedding_regularizer`` instead: (wd / 2) * ||W||^2 over the
whole tables is in the loss every step, so every row's gradient is g_r + wd * w_r (g_r = 0 for the rows the step
does not touch) and every row takes the optimizer step: a dense pass over the tables each step (each process
over the rows it holds). With Adam that is torch's dense Adam on the tables (FuxiCTR's optimizer): untouched
rows decay towards zero and keep moving by their momentum. FuxiCTR's float regulariser lambda is (lambda / 2) *
||W||^2, so ``embedding_regularizer: lambda`` is ``weight_decay = lambda`` here.

Adam (``kind = "adam"``) is lazy, as torch's SparseAdam and TF's LazyAdam: only the rows a step touches update
their moments. Per element, m and v ([R, D] each, split with the weight's columns under column-wise sharding),
and per row the number of steps that touched it, k (float32 [R], exact to 2^24 steps): for a touched row
k += 1, m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, w -= lr * (m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) +
eps): torch.optim.Adam's formula with the row's own step count in the bias correction. A row touched every step
is updated exactly as dense Adam updates it; a rare row gets a fully bias-corrected step when it is touched
(with SparseAdam's global count, a row first touched at step 1000 steps by about 3.2 lr: its moments are
corrected for 1000 steps of averaging they never had). In ``all_rows`` mode every row
is stepped every step, so k is the global step and the update is torch.optim.Adam's with ``weight_decay``.

The state an optimizer keeps with each row is declared by ``state_parts`` (``StatePart``): Adagrad's
``accumulator`` [R]; Adam's ``exp_avg`` and ``exp_avg_sq`` [R, D] and ``row_step`` [R]: S = 0, 1 or 2 D + 1
values per row. Collections hold one buffer per part, checkpoints one entry per part, sharding splits the
per-column parts with the columns and gives each column shard its own per-row ones.

Deferred updates (``defer``, for ``optim.max_grad_norm``): the gradient-norm clip needs the norm of every
gradient before any update, but backward updates the rows as it reaches them. A deferring optimizer's ``step``
computes the gradient it would apply (summed per distinct row, the weight-decay term added) and keeps it;
``pending_sq_norm`` gives the sum of its squares and ``apply_pending(scale)`` then applies the kept updates with
the gradients multiplied by ``scale``. The cost is holding the gradient rows [U, D] (in ``all_rows`` mode the
whole tables' [R, D]) until the training step applies them, and the aggregation per distinct row also for SGD on
CPU (which otherwise adds each id's gradient straight into its row).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

SPARSE_KINDS = ("sgd", "rowwise_adagrad", "adam")
DECAY_MODES = ("touched", "all_rows")


@dataclass
class SparseOptimizerConfig:
    kind: str = "sgd"  # sgd | rowwise_adagrad | adam
    lr: float = 0.1
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    weight_decay: float = 0.0  # L2 (module docstring)
    betas: tuple[float, float] = (0.9, 0.999)  # Adam's
    weight_decay_mode: str = "touched"  # touched | all_rows (module docstring)

    def __post_init__(self) -> None:
        if self.kind not in SPARSE_KINDS:
            raise ValueError(f"sparse optimizer {self.kind!r}: expected one of {', '.join(SPARSE_KINDS)}")
        if self.weight_decay_mode not in DECAY_MODES:
            raise ValueError(f"sparse weight decay mode {self.weight_decay_mode!r}: expected touched or all_rows")


@dataclass(frozen=True)
class StatePart:
    """One optimizer state tensor kept with the rows: ``per_column`` [R, D] (split with the weight's columns),
    else [R] (one value per row, and per column shard); starting at ``initial``."""

    name: str
    per_column: bool
    initial: float = 0.0


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
    @property
    def sparse_weight_decay_mode(self) -> str: ...
    @property
    def sparse_betas(self) -> list[float]: ...


def sparse_optimizer_config(optim: SparseOptimFields) -> SparseOptimizerConfig:
    """``[optim]`` -> the embeddings' optimizer (``sparse``, ``sparse_lr``, ``eps``, ``adagrad_init``,
    ``sparse_weight_decay``, ``sparse_weight_decay_mode``, ``sparse_betas``)."""
    b1, b2 = optim.sparse_betas
    return SparseOptimizerConfig(optim.sparse, optim.sparse_lr, optim.eps, optim.adagrad_init,
                                 optim.sparse_weight_decay, (b1, b2), optim.sparse_weight_decay_mode)


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
    """Applies one update to the rows of ``weight`` [R, D] and of its state (``state_parts``)."""

    def __init__(self, config: SparseOptimizerConfig) -> None:
        self.config = config
        self.lr_scale = 1.0  # set per step by a learning-rate schedule (recstack.training.lr_schedule)
        self.defer = False  # hold each step's update until apply_pending (module docstring)
        # (weight, state, rows [U], gradient [U, D] as it would be applied) of each deferred step, in order
        self._pending: list[tuple[torch.Tensor, Mapping[str, torch.Tensor], torch.Tensor, torch.Tensor]] = []

    @property
    def state_parts(self) -> tuple[StatePart, ...]:
        """The state kept with each row (module docstring), in the order of a row's record in cached tiers."""
        if self.config.kind == "rowwise_adagrad":
            return (StatePart("accumulator", False, self.config.initial_accumulator_value),)
        if self.config.kind == "adam":
            return (StatePart("exp_avg", True), StatePart("exp_avg_sq", True), StatePart("row_step", False))
        return ()

    def state_width(self, dim: int) -> int:
        """S: the state values per row of ``dim`` columns (0 for SGD, 1 for Adagrad, 2 dim + 1 for Adam)."""
        return sum(dim if p.per_column else 1 for p in self.state_parts)

    @property
    def needs_accumulator(self) -> bool:
        return self.config.kind == "rowwise_adagrad"

    def new_state(self, rows: int, dim: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Initial state of ``rows`` rows of ``dim`` columns: {part name: [rows, dim] or [rows]} float32."""
        return {p.name: torch.full((rows, dim) if p.per_column else (rows,), p.initial, dtype=torch.float32,
                                   device=device) for p in self.state_parts}

    @torch.no_grad()
    def step(
        self,
        weight: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        rows: torch.Tensor,
        grads: torch.Tensor,
    ) -> None:
        """rows [N] (may repeat), grads [N, D] -> in-place update of the touched rows (of every row in
        ``all_rows`` mode) and of their ``state`` ({part name: tensor}, as ``new_state``)."""
        every_row = self.config.weight_decay_mode == "all_rows"
        if rows.numel() == 0 and not every_row:
            return
        grads = grads.to(weight.dtype)
        wd = self.config.weight_decay
        if self.config.kind == "sgd" and not wd and not weight.is_cuda and not every_row and not self.defer:
            # A serial loop over the ids in order on CPU. The step is folded into the gradient because
            # index_add_ with alpha != 1 takes a much slower path.
            weight.index_add_(0, rows, grads * -(self.config.lr * self.lr_scale))
            return
        # Sum per distinct row first: on CUDA index_add_'s atomics would make the order of the adds vary, and
        # the weight decay is once per distinct row.
        uniq, g = aggregate_rows(rows, grads)  # [U], [U, D]
        if every_row:  # the L2 term touches every row: the dense gradient of the whole weight
            dense = torch.zeros_like(weight)
            dense[uniq] = g
            uniq, g = torch.arange(weight.shape[0], device=weight.device), dense  # [R], [R, D]
            if wd:
                g.add_(weight, alpha=wd)
        elif wd:
            g.add_(weight.index_select(0, uniq), alpha=wd)  # g_r + wd * w_r
        if self.defer:
            self._pending.append((weight, state, uniq, g))
            return
        self._update(weight, state, uniq, g)

    @torch.no_grad()
    def pending_sq_norm(self) -> float:
        """The sum of squares of every deferred gradient's elements (0 when nothing is pending)."""
        return sum((float(g.pow(2).sum()) for _, _, _, g in self._pending), 0.0)

    @torch.no_grad()
    def apply_pending(self, scale: float) -> None:
        """Apply the deferred updates in the order of their steps, their gradients multiplied by ``scale``."""
        pending, self._pending = self._pending, []
        for weight, state, uniq, g in pending:
            if scale != 1.0:
                g.mul_(scale)
            self._update(weight, state, uniq, g)

    def _update(self, weight: torch.Tensor, state: Mapping[str, torch.Tensor], uniq: torch.Tensor,
                g: torch.Tensor) -> None:
        """The update of distinct rows ``uniq`` [U] with their gradients ``g`` [U, D] (consumed)."""
        lr = self.config.lr * self.lr_scale
        kind = self.config.kind
        if kind == "sgd":
            weight.index_add_(0, uniq, g.mul_(-lr))
        elif kind == "rowwise_adagrad":
            acc = state["accumulator"][uniq] + g.pow(2).mean(dim=1)  # [U]
            state["accumulator"][uniq] = acc
            weight.index_add_(0, uniq, g * (-lr / (acc.sqrt() + self.config.eps)).unsqueeze(1))
        else:
            self._adam(weight, state, uniq, g, lr)

    def _adam(self, weight: torch.Tensor, state: Mapping[str, torch.Tensor], uniq: torch.Tensor,
              g: torch.Tensor, lr: float) -> None:
        """Lazy Adam on rows ``uniq`` [U] with their summed gradients ``g`` [U, D] (module docstring)."""
        b1, b2 = self.config.betas
        k = state["row_step"][uniq] + 1  # [U]
        state["row_step"][uniq] = k
        m = state["exp_avg"][uniq].mul_(b1).add_(g, alpha=1 - b1)  # [U, D]
        v = state["exp_avg_sq"][uniq].mul_(b2).addcmul_(g, g, value=1 - b2)  # [U, D]
        state["exp_avg"][uniq] = m
        state["exp_avg_sq"][uniq] = v
        k64 = k.double()  # the corrections as torch.optim.Adam computes them (in double, from the step)
        step_size = (lr / (1 - b1**k64)).to(weight.dtype).unsqueeze(1)  # [U, 1]
        bc2_sqrt = (1 - b2**k64).sqrt().to(weight.dtype).unsqueeze(1)
        denom = (v.sqrt() / bc2_sqrt).add_(self.config.eps)  # [U, D]
        weight.index_add_(0, uniq, m.div_(denom).mul_(-step_size))
