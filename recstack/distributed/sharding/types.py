"""A shard: one rectangle of one table, held by one rank."""

from __future__ import annotations

from dataclasses import dataclass


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
