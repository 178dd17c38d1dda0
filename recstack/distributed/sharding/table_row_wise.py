"""Table-row-wise: row-wise over the ranks of one node. Row partial sums are produced inside that node,
while across nodes the table behaves like a table-wise one: a fit for tables too large for one device but
not worth spreading over the slow inter-node links."""

from __future__ import annotations

from recstack.distributed.sharding import row_wise
from recstack.distributed.sharding.types import Shard


def shards(table: int, rows: int, dim: int, ranks: list[int], ranks_per_node: int | None = None) -> list[Shard]:
    if ranks_per_node and len({r // ranks_per_node for r in ranks}) != 1:
        raise ValueError(f"table_row_wise ranks {ranks} span more than one node of {ranks_per_node} ranks")
    return row_wise.shards(table, rows, dim, ranks)
