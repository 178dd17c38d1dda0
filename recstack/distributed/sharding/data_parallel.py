"""Data-parallel: every rank holds the whole table and looks up its own samples; the gradient of the table
(dense, so only for small tables) is all-reduced and every replica applies the same update."""

from __future__ import annotations

from recstack.distributed.sharding.types import Shard


def shards(table: int, rows: int, dim: int, ranks: list[int]) -> list[Shard]:
    return [Shard(table, i, r, 0, rows, 0, dim, "local") for i, r in enumerate(ranks)]
