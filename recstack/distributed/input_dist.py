"""Input distribution of a sharded collection, in two halves: what is sent (local work, any thread)
and the exchange itself (collectives, the training thread only).

``prepare_input`` builds, for every rank, the message of this rank's samples: for each (feature,
shard) pair the rank owns, the lengths [B] and ids of the local samples (row-wise shards only their
ids, renumbered from the shard's first row). It communicates with nobody, so the input pipeline
runs it in the loader's thread, a batch ahead. ``exchange_input`` runs the id all-to-all (two:
sizes, then ids; a third for per-id weights) and unpacks what every rank sent into ``RoutedIds``.
Every collective of recstack is issued from the training thread, in one program order on every
rank: ProcessGroupNCCL orders a collective after the caller's current stream, so two threads
issuing collectives on two groups could enqueue them in opposite orders on two ranks and wait on
each other until ``dist.timeout_s`` (gloo cannot show this;
``tests/distributed/test_collective_order.py`` records every rank's sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from recstack.data.batch import SparseFeatures
from recstack.distributed import grad_aggregation as ga
from recstack.distributed.comm import CommStats, all_to_all_variable
from recstack.distributed.grad_aggregation import GradGroups
from recstack.distributed.sharding import Shard

# pairs[r]: the (feature, shard) pairs rank r owns, in the collection's global canonical order
Pairs = list[list[tuple[int, Shard]]]


@dataclass(frozen=True)
class RoutedIds:
    """The input distribution of one batch, what ``forward`` needs besides it: the batch size of
    every rank, (ids, lengths) of each pair this rank owns over all ranks' samples, their per-id
    weights, and with ``aggregate_gradients`` the backward exchange's (send, receive) id groups per
    [rank][chunk]. ``ids`` is the batch's own id tensor, so that forward can check it is given the
    batch these were routed for."""

    ids: torch.Tensor
    batch_sizes: list[int]
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    weights: list[torch.Tensor | None]
    grad_groups: GradGroups | None


@dataclass(frozen=True)
class PreparedInput:
    """What this rank sends in the input distribution of one batch (``prepare_input``):
    ``send_ids[r]`` = [B, lengths of each of rank r's pairs ([B] each), their ids], ``send_w[r]``
    their weights (None: the batch is unweighted), and the (ids, lengths) of every piece sent,
    rank-major (the gradient groups' input). ``ids`` is the batch's id tensor (the identity the
    input pipeline matches batches by)."""

    ids: torch.Tensor
    send_ids: list[torch.Tensor]
    send_w: list[torch.Tensor] | None
    pieces: list[tuple[torch.Tensor, torch.Tensor]]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds (the input pipeline marks them used on the training stream)."""
        out = [*self.send_ids, *(self.send_w or [])]
        return out + [t for piece in self.pieces for t in piece]


def prepare_input(sparse: SparseFeatures, pairs: Pairs) -> PreparedInput:
    """The messages of this rank's samples ``sparse`` (local batch B, maybe 0) to every rank. No
    collective."""
    b = sparse.batch_size
    lengths = sparse.lengths.view(sparse.num_features, b)  # [F, B]
    starts = sparse.feature_bounds.tolist()  # [F + 1]
    send_ids, send_w = [], []
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    for owned in pairs:
        lens, ids, ws = [], [], []
        for f, s in owned:
            fid = sparse.ids[starts[f] : starts[f + 1]]
            fw = sparse.weights[starts[f] : starts[f + 1]] if sparse.weights is not None else None
            if s.combine == "sum":  # row shard: only the ids in its rows, renumbered from 0
                keep = (fid >= s.row0) & (fid < s.row1)
                bag = torch.repeat_interleave(torch.arange(b, device=fid.device), lengths[f])
                lens.append(torch.bincount(bag[keep], minlength=b))
                ids.append(fid[keep] - s.row0)
                ws.append(fw[keep] if fw is not None else None)
            else:
                lens.append(lengths[f])
                ids.append(fid)
                ws.append(fw)
        pieces.extend(zip(ids, lens, strict=True))
        head = torch.tensor([b], dtype=torch.int64, device=sparse.ids.device)
        send_ids.append(torch.cat([head, *lens, *ids]))
        if sparse.weights is not None:
            send_w.append(
                torch.cat([w for w in ws if w is not None]) if ws else sparse.weights[:0]
            )
    return PreparedInput(
        sparse.ids, send_ids, send_w if sparse.weights is not None else None, pieces
    )


def exchange_input(
    prep: PreparedInput,
    pairs: Pairs,
    group: dist.ProcessGroup | None,
    stats: CommStats,
    grad_groups: bool,
) -> RoutedIds:
    """Collective on ``group``: every rank's prepared messages -> what this rank owns over every
    rank's samples. ``grad_groups``: also the backward exchange's id groups
    (``aggregate_gradients``, training batches)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    recv = all_to_all_variable(prep.send_ids, group, stats, "input_dist")
    recv_w = (
        all_to_all_variable(prep.send_w, group, stats, "input_dist")
        if prep.send_w is not None
        else [None] * world
    )
    n = len(pairs[rank])
    batch_sizes = [int(m[0]) for m in recv]
    pair_ids: list[list[torch.Tensor]] = [[] for _ in range(n)]
    pair_lens: list[list[torch.Tensor]] = [[] for _ in range(n)]
    pair_w: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for r, m in enumerate(recv):
        br, wr = batch_sizes[r], recv_w[r]
        got_lens = m[1 : 1 + n * br].view(n, br)
        counts = got_lens.sum(1).tolist()
        got_ids = torch.split(m[1 + n * br :], counts)
        got_w = torch.split(wr, counts) if wr is not None else None
        for p in range(n):
            pair_lens[p].append(got_lens[p])
            pair_ids[p].append(got_ids[p])
            if got_w is not None:
                pair_w[p].append(got_w[p])
    ids_out = [torch.cat(x) if x else torch.zeros(0, dtype=torch.int64) for x in pair_ids]
    lens_out = [torch.cat(x) if x else torch.zeros(0, dtype=torch.int64) for x in pair_lens]
    weighted = prep.send_w is not None
    w_out: list[torch.Tensor | None] = [torch.cat(x) for x in pair_w] if weighted else [None] * n
    groups = None
    if grad_groups:
        sent = ga.send_groups(prep.pieces, weighted)  # this rank's samples, per owner and pair
        # the owner side: ids it got from each rank
        served = ga.receive_groups(
            [(pair_ids[p][r], pair_lens[p][r]) for r in range(world) for p in range(n)], weighted
        )
        per_owner = [len(pairs[r]) for r in range(world)]
        groups = (_nest(sent, per_owner), _nest(served, [n] * world))
    return RoutedIds(
        prep.ids, batch_sizes, list(zip(ids_out, lens_out, strict=True)), w_out, groups
    )


def _nest(flat: list, sizes: list[int]) -> list[list]:
    """A flat list -> consecutive sublists of the given sizes."""
    out, pos = [], 0
    for n in sizes:
        out.append(flat[pos : pos + n])
        pos += n
    return out
