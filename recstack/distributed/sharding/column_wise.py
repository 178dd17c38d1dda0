"""Column-wise: the dim split into k equal column blocks, one per rank; every shard sees all ids of the
table's features and the receiver concatenates the blocks. Row-wise Adagrad keeps one accumulator per row
per shard, computed from that shard's columns (as TorchRec does), so it differs slightly from unsharded."""

from __future__ import annotations

from recstack.distributed.sharding.types import Shard


def shards(table: int, rows: int, dim: int, ranks: list[int]) -> list[Shard]:
    k = len(ranks)
    if k == 0 or dim % k:
        raise ValueError(f"column_wise: dim {dim} does not split into {k} equal blocks")
    w = dim // k
    return [Shard(table, i, r, 0, rows, i * w, (i + 1) * w, "concat") for i, r in enumerate(ranks)]
