"""The sharding types and their rules: which rank holds which rectangle of a table, and how a feature's pooled
output is rebuilt from its shards. The sharded collection (``table_shards``) and the planner (``SHARDING_TYPES``,
``row_blocks``, ``shard_blocks``) both use these, so a plan and the shards built from it always agree.

- ``data_parallel``: every rank holds the whole table and looks up its own samples; the table's (dense)
  gradient is all-reduced and every replica applies the same update. Only for small tables.
- ``table_wise``: the whole table on one rank; its features' ids travel there, pooled outputs travel back.
- ``row_wise``: contiguous row blocks of ceil(rows / k) rows over k ranks (the last may be short or empty).
  Each id goes only to the rank holding its row; every rank returns a partial pooled sum for every bag (zero
  where none of the bag's ids fall in its rows) and the receiver adds the k partials: a reduce-scatter done
  as an all-to-all (works on gloo too).
- ``table_row_wise``: row-wise over the ranks of one node. Row partial sums are produced inside that node,
  while across nodes the table behaves like a table-wise one: a fit for tables too large for one device but
  not worth spreading over the slow inter-node links.
- ``column_wise``: the dim split into k equal column blocks, one per rank; every shard sees all ids of the
  table's features and the receiver concatenates the blocks. Row-wise Adagrad keeps one accumulator per row
  per shard, computed from that shard's columns (as TorchRec does), so it differs slightly from unsharded.
"""

from __future__ import annotations

from dataclasses import dataclass

SHARDING_TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise")

# How each type's shards are combined on the rank that needs a feature's output.
COMBINE = {"data_parallel": "local", "table_wise": "identity", "row_wise": "sum", "table_row_wise": "sum",
           "column_wise": "concat"}


@dataclass(frozen=True)
class Shard:
    """Rows [row0, row1) and columns [col0, col1) of table ``table``, held by ``rank``.

    ``combine`` says how a feature's output is rebuilt from its shards on the rank that needs it:
    ``identity`` (the only shard holds the whole table), ``sum`` (row shards give partial pooled sums),
    ``concat`` (column shards give column blocks, in shard order) or ``local`` (replicated: looked up where
    the batch lives, no all-to-all).
    """

    table: int
    index: int
    rank: int
    row0: int
    row1: int
    col0: int
    col1: int
    combine: str

    @property
    def rows(self) -> int:
        return self.row1 - self.row0

    @property
    def dim(self) -> int:
        return self.col1 - self.col0


def row_blocks(rows: int, k: int) -> list[tuple[int, int]]:
    """Contiguous row blocks of ceil(rows / k) rows (the last may be shorter or empty)."""
    block = -(-rows // k)
    return [(min(i * block, rows), min((i + 1) * block, rows)) for i in range(k)]


def shard_blocks(sharding: str, rows: int, dim: int, k: int) -> list[tuple[int, int, int, int]]:
    """The rectangles (row0, row1, col0, col1) of the k shards of a rows x dim table, in shard order (for
    ``table_wise`` k must be 1; ``data_parallel`` gives k whole-table replicas). ValueError when the type
    cannot split the table so."""
    if sharding not in SHARDING_TYPES:
        raise ValueError(f"unknown sharding {sharding!r} (one of {', '.join(SHARDING_TYPES)})")
    if k < 1:
        raise ValueError(f"{sharding} needs at least one rank")
    if sharding == "table_wise" and k != 1:
        raise ValueError(f"table_wise takes exactly one rank, got {k}")
    if sharding == "column_wise":
        if dim % k:
            raise ValueError(f"column_wise: dim {dim} does not split into {k} equal blocks")
        w = dim // k
        return [(0, rows, i * w, (i + 1) * w) for i in range(k)]
    if sharding in ("row_wise", "table_row_wise"):
        return [(lo, hi, 0, dim) for lo, hi in row_blocks(rows, k)]
    return [(0, rows, 0, dim)] * k


def table_shards(
    table: int, rows: int, dim: int, sharding: str, ranks: list[int], world_size: int,
    ranks_per_node: int | None = None,
) -> list[Shard]:
    """A plan entry (table ``table`` of rows x dim under ``sharding`` on ``ranks``) -> its shards, in order.
    ``data_parallel`` puts a replica on every rank whatever ``ranks`` says."""
    if sharding not in SHARDING_TYPES:
        raise ValueError(f"table {table}: unknown sharding {sharding!r} (one of {', '.join(SHARDING_TYPES)})")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"table {table}: ranks {bad} outside 0..{world_size - 1}")
    if sharding == "data_parallel":
        ranks = list(range(world_size))
    if sharding == "table_wise" and len(ranks) != 1:
        raise ValueError(f"table_wise takes exactly one rank, got {ranks}")
    if sharding == "table_row_wise" and ranks_per_node and len({r // ranks_per_node for r in ranks}) != 1:
        raise ValueError(f"table_row_wise ranks {ranks} span more than one node of {ranks_per_node} ranks")
    blocks = shard_blocks(sharding, rows, dim, len(ranks))
    return [Shard(table, i, r, r0, r1, c0, c1, COMBINE[sharding])
            for i, (r, (r0, r1, c0, c1)) in enumerate(zip(ranks, blocks, strict=True))]
