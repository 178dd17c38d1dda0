"""Gradient aggregation for the backward all-to-all: one row per distinct id instead of one per sample.

The backward exchange sends each owner the gradient of every pooled piece it served, [B_r, d] per (rank,
feature shard). For a one-hot, unweighted feature the owner only ever needs the sum of those rows per id
(its sparse optimizer sums them per table row anyway), and both ends know which samples share an id: the
sender from its own batch, the owner from the ids the input distribution brought it. So the sender sums the
rows of each distinct id (in ascending id order) and sends [U, d]; the owner puts each sum on the first
sample of its id and zeros elsewhere, and the ordinary backward applies exactly the same row gradients (up to
the order of the float additions). With Zipf ids U is a fraction of B: on the Criteo-shaped payloads the
pieces hold 3-4x fewer rows in total.

A piece qualifies when every sample has at most one id in the shard (one-hot; samples of a row shard whose id
lies outside its rows have none and send nothing) and the feature has no per-id weights; both ends decide
from the same lengths, so they always agree. Other pieces travel per sample as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recstack.embedding.sparse_optim import aggregate_rows


@dataclass
class SendGroups:
    """Sender side of one piece: ``group`` [B] the distinct-id index of each sample (-1: no id), ``count`` U."""

    group: torch.Tensor
    count: int


@dataclass
class ReceiveGroups:
    """Owner side of one piece: ``first`` [U] the first sample of each distinct id, ``batch`` B of that rank."""

    first: torch.Tensor
    batch: int


GradGroups = tuple[list[list[SendGroups | None]], list[list[ReceiveGroups | None]]]  # [rank][chunk]


def _groups(ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """ids [sum(lengths)], lengths [B] -> (group [B] with -1 where a sample has no id, U), or None when a
    sample has more than one id."""
    if lengths.numel() and int(lengths.max()) > 1:
        return None
    present = lengths == 1
    group = torch.full(lengths.shape, -1, dtype=torch.int64, device=lengths.device)
    uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    group[present] = inverse
    return group, int(uniq.numel())


def send_groups(ids: torch.Tensor, lengths: torch.Tensor, weighted: bool) -> SendGroups | None:
    """For a piece this rank will send back: its own samples' ids and lengths in the shard."""
    if weighted:
        return None
    g = _groups(ids, lengths)
    return SendGroups(*g) if g is not None else None


def receive_groups(ids: torch.Tensor, lengths: torch.Tensor, weighted: bool) -> ReceiveGroups | None:
    """For a piece this rank served: the ids and lengths it received for that rank's samples."""
    if weighted:
        return None
    g = _groups(ids, lengths)
    if g is None:
        return None
    group, count = g
    samples = torch.arange(group.numel(), device=group.device)
    # first sample of each group: the minimum index per group (scatter_reduce "amin" is deterministic)
    first = torch.full((count,), group.numel(), dtype=torch.int64, device=group.device)
    present = group >= 0
    first.scatter_reduce_(0, group[present], samples[present], reduce="amin")
    return ReceiveGroups(first, group.numel())


def aggregate(grad: torch.Tensor, plan: SendGroups | None) -> torch.Tensor:
    """grad [B, d] -> [U, d] sums per distinct id (summed in sample order, the same on every device)."""
    if plan is None:
        return grad
    present = plan.group >= 0
    rows, sums = aggregate_rows(plan.group[present], grad[present])
    if rows.numel() != plan.count:  # every group has a sample by construction
        raise RuntimeError(f"gradient aggregation: {rows.numel()} groups, expected {plan.count}")
    return sums


def expand(sums: torch.Tensor, plan: ReceiveGroups | None) -> torch.Tensor:
    """[U, d] -> [B, d]: each sum on its id's first sample, zeros elsewhere."""
    if plan is None:
        return sums
    out = sums.new_zeros(plan.batch, sums.shape[1])
    out[plan.first] = sums
    return out
