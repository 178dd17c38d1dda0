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

ID_BITS = 40  # grouping keys: the id in the low bits (table rows stay far below 2**40), the piece above


def _groups(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, int] | None]:
    """pieces of (ids [sum(lengths)], lengths [B]) -> per piece (group [B], -1 where a sample has no id; U), or
    None when a sample has more than one id. One sort for all pieces: a few hundred small ones per step
    otherwise cost more than the bytes they save on a fast link."""
    out: list[tuple[torch.Tensor, int] | None] = [None] * len(pieces)
    if not pieces:
        return out
    longest = torch.stack([n.max() if n.numel() else n.new_zeros(()) for _, n in pieces]).tolist()
    ok = [k for k, m in enumerate(longest) if m <= 1]
    if not ok:
        return out
    ids = [pieces[k][0].to(torch.int64) for k in ok]
    keys = torch.cat([i + (j << ID_BITS) for j, i in enumerate(ids)])
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    counts = torch.bincount(uniq >> ID_BITS, minlength=len(ok)).tolist()
    start = 0
    for j, (k, inv) in enumerate(zip(ok, torch.split(inverse, [i.numel() for i in ids]), strict=True)):
        lengths = pieces[k][1]
        group = torch.full(lengths.shape, -1, dtype=torch.int64, device=lengths.device)
        group[lengths == 1] = inv - start
        out[k] = (group, counts[j])
        start += counts[j]
    return out


def send_groups(pieces: list[tuple[torch.Tensor, torch.Tensor]], weighted: bool) -> list[SendGroups | None]:
    """For the pieces this rank will send back: its own samples' (ids, lengths) in each shard."""
    if weighted:
        return [None] * len(pieces)
    return [SendGroups(*g) if g is not None else None for g in _groups(pieces)]


def receive_groups(pieces: list[tuple[torch.Tensor, torch.Tensor]], weighted: bool) -> list[ReceiveGroups | None]:
    """For the pieces this rank served: the (ids, lengths) it received for the samples of each."""
    if weighted:
        return [None] * len(pieces)
    out: list[ReceiveGroups | None] = []
    for g in _groups(pieces):
        if g is None:
            out.append(None)
            continue
        group, count = g
        present = group >= 0
        samples = torch.arange(group.numel(), device=group.device)
        # first sample of each group: the minimum index (scatter_reduce "amin" is deterministic)
        first = torch.full((count,), group.numel(), dtype=torch.int64, device=group.device)
        first.scatter_reduce_(0, group[present], samples[present], reduce="amin")
        out.append(ReceiveGroups(first, group.numel()))
    return out


def aggregate_flat(flat: torch.Tensor, shapes: list[tuple[int, int]], groups: list[SendGroups | None]
                   ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The backward buffer of all chunks (rank-major, chunk k [n_k, d_k]) -> (the buffer to send, its chunk
    shapes): grouped chunks become [U_k, d_k] sums, the others stay as they are.

    All chunks of one width (the usual case) take one pass over the buffer viewed as [N, d], without copying
    chunks out: each row's destination (its group, offset by the chunk; its own row for an ungrouped chunk;
    a discarded extra row where a sample has no id) is one index vector."""
    widths = {d for _, d in shapes}
    if len(widths) != 1 or not shapes:
        chunks = list(torch.split(flat, [n * d for n, d in shapes]))
        sums = aggregate([c.view(n, d) for c, (n, d) in zip(chunks, shapes, strict=True)], groups)
        sent = torch.cat([x.reshape(-1) for x in sums]) if sums else flat[:0]
        return sent, [(x.shape[0], x.shape[1]) for x in sums]
    d = widths.pop()
    index, out_shapes, total = [], [], 0
    for (n, _), g in zip(shapes, groups, strict=True):
        if g is None:
            index.append(torch.arange(total, total + n, device=flat.device))
            out_shapes.append((n, d))
            total += n
        else:
            index.append(torch.where(g.group >= 0, g.group + total, g.group))  # -1: the sample has no id
            out_shapes.append((g.count, d))
            total += g.count
    where = torch.cat(index)
    where = torch.where(where < 0, total, where)  # samples without an id -> the extra row, dropped
    rows = flat.view(-1, d)
    if rows.is_cuda:  # index_add_ would add in a varying order (atomics): sum each group in a fixed order
        keep = where < total
        uniq, out = aggregate_rows(where[keep], rows[keep])  # groups 0..total-1, each with a row
        if uniq.numel() != total:
            raise RuntimeError(f"gradient aggregation: {uniq.numel()} groups, expected {total}")
    else:  # a serial loop in row order: the same sums on every run
        out = rows.new_zeros(total + 1, d).index_add_(0, where, rows)[:total]
    return out.reshape(-1), out_shapes


def expand_flat(flat: torch.Tensor, shapes: list[tuple[int, int]], groups: list[ReceiveGroups | None]
                ) -> torch.Tensor:
    """The received buffer (chunk k [U_k, d_k] where grouped) -> the per-sample buffer [sum n_k * d_k]."""
    widths = {d for _, d in shapes}
    if len(widths) != 1 or not shapes:
        chunks = [c.view(n, d) for c, (n, d) in zip(torch.split(flat, [n * d for n, d in shapes]), shapes,
                                                     strict=True)]
        full = expand(chunks, groups)
        return torch.cat([x.reshape(-1) for x in full]) if full else flat[:0]
    d = widths.pop()
    positions, total = [], 0
    for (n, _), g in zip(shapes, groups, strict=True):
        if g is None:
            positions.append(torch.arange(total, total + n, device=flat.device))
            total += n
        else:
            positions.append(g.first + total)
            total += g.batch
    out = flat.new_zeros(total, d)
    out[torch.cat(positions)] = flat.view(-1, d)
    return out.reshape(-1)


def _by_shape(tensors: list[torch.Tensor], groups: list) -> dict[tuple, list[int]]:
    """Indices of the grouped pieces, by (width, dtype, device): each class is handled in one pass."""
    classes: dict[tuple, list[int]] = {}
    for k, (t, g) in enumerate(zip(tensors, groups, strict=True)):
        if g is not None:
            classes.setdefault((t.shape[1], t.dtype, t.device), []).append(k)
    return classes


def aggregate(grads: list[torch.Tensor], groups: list[SendGroups | None]) -> list[torch.Tensor]:
    """Per piece grad [B, d] -> [U, d] sums per distinct id (each summed in sample order, the same on every
    device); pieces without groups are returned as they are."""
    out = list(grads)
    for ks in _by_shape(grads, groups).values():
        gs = [g for k in ks if (g := groups[k]) is not None]  # all of them: _by_shape lists grouped pieces
        rows, values, offset = [], [], 0
        for k, g in zip(ks, gs, strict=True):
            present = g.group >= 0
            rows.append(g.group[present] + offset)
            values.append(grads[k][present])
            offset += g.count
        uniq, sums = aggregate_rows(torch.cat(rows), torch.cat(values))
        if uniq.numel() != offset:  # every group has a sample by construction
            raise RuntimeError(f"gradient aggregation: {uniq.numel()} groups, expected {offset}")
        for k, part in zip(ks, torch.split(sums, [g.count for g in gs]), strict=True):
            out[k] = part
    return out


def expand(sums: list[torch.Tensor], groups: list[ReceiveGroups | None]) -> list[torch.Tensor]:
    """Per piece [U, d] -> [B, d]: each sum on its id's first sample, zeros elsewhere."""
    out = list(sums)
    for ks in _by_shape(sums, groups).values():
        gs = [g for k in ks if (g := groups[k]) is not None]  # all of them: _by_shape lists grouped pieces
        sizes = [g.batch for g in gs]
        full = sums[ks[0]].new_zeros(sum(sizes), sums[ks[0]].shape[1])
        starts = [0]
        for n in sizes[:-1]:
            starts.append(starts[-1] + n)
        full[torch.cat([g.first + s for g, s in zip(gs, starts, strict=True)])] = torch.cat(
            [sums[k] for k in ks])
        for k, part in zip(ks, torch.split(full, sizes), strict=True):
            out[k] = part
    return out
