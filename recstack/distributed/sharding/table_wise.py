"""Table-wise: the whole table on one rank; its features' ids travel there, pooled outputs travel back."""

from __future__ import annotations

from recstack.distributed.sharding.types import Shard


def shards(table: int, rows: int, dim: int, ranks: list[int]) -> list[Shard]:
    if len(ranks) != 1:
        raise ValueError(f"table_wise takes exactly one rank, got {ranks}")
    return [Shard(table, 0, ranks[0], 0, rows, 0, dim, "identity")]
