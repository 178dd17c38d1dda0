"""Sharding types, one module each; ``table_shards`` turns a plan entry into shards."""

from __future__ import annotations

from recstack.distributed.sharding import column_wise, data_parallel, row_wise, table_row_wise, table_wise
from recstack.distributed.sharding.types import Shard, row_blocks

SHARDING_TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise")


def table_shards(
    table: int, rows: int, dim: int, sharding: str, ranks: list[int], world_size: int,
    ranks_per_node: int | None = None,
) -> list[Shard]:
    if sharding not in SHARDING_TYPES:
        raise ValueError(f"table {table}: unknown sharding {sharding!r} (one of {', '.join(SHARDING_TYPES)})")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"table {table}: ranks {bad} outside 0..{world_size - 1}")
    if sharding == "data_parallel":
        return data_parallel.shards(table, rows, dim, list(range(world_size)))
    if sharding == "table_row_wise":
        return table_row_wise.shards(table, rows, dim, ranks, ranks_per_node)
    module = {"table_wise": table_wise, "row_wise": row_wise, "column_wise": column_wise}[sharding]
    return module.shards(table, rows, dim, ranks)


__all__ = ["SHARDING_TYPES", "Shard", "row_blocks", "table_shards"]
