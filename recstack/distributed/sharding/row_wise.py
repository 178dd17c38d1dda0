"""Row-wise: contiguous row blocks over k ranks. Each id goes only to the rank holding its row; every rank
returns a partial pooled sum for every bag (zero where none of the bag's ids fall in its rows), and the
receiver adds the k partials, which is a reduce-scatter done as an all-to-all (works on gloo too)."""

from __future__ import annotations

from recstack.distributed.sharding.types import Shard, row_blocks


def shards(table: int, rows: int, dim: int, ranks: list[int]) -> list[Shard]:
    if not ranks:
        raise ValueError("row_wise needs at least one rank")
    return [Shard(table, i, r, lo, hi, 0, dim, "sum") for i, (r, (lo, hi)) in
            enumerate(zip(ranks, row_blocks(rows, len(ranks)), strict=True))]
