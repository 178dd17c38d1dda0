"""The embedding-collection interface, the table description and the tables' initial values.

Every collection (the fused one in ``fused.py``, the sharded ones in ``recstack.distributed``, the tiered ones)
maps ``SparseFeatures`` (F features, batch B) to pooled embeddings [B, F, D] and updates its own rows during
backward. Nothing here knows about processes or devices other than its own.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from recstack.data.batch import Batch, SparseFeatures
from recstack.embedding.sparse_optim import SparseOptimizer, SparseOptimizerConfig


@dataclass(frozen=True)
class TableConfig:
    """One embedding table. Several features may share it (``features`` lists their indices). Rows
    [0, ``zero_rows``) start at zero instead of random values: the rows a prepared set reserves for no known value
    (missing, out of vocabulary), which training may never touch and which serving looks up for unseen values.
    ``init_bound`` > 0 draws the other rows from uniform(-init_bound, init_bound) instead of the DLRM reference's
    uniform(-1/sqrt(rows), 1/sqrt(rows)), which is large for small tables (+-0.58 for 3 rows)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    features: tuple[int, ...]
    zero_rows: int = 0
    init_bound: float = 0.0


def init_bound(table: TableConfig) -> float:
    """The bound of the table's uniform init: ``init_bound``, else the DLRM reference's 1/sqrt(rows)."""
    return table.init_bound or table.num_embeddings**-0.5


def _generator(table: TableConfig, seed: int, index: int) -> tuple[torch.Generator, float]:
    """The per-table generator and the bound of its uniform init (``init_bound``)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index), init_bound(table)


def init_table(table: TableConfig, seed: int, index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DLRM reference init, uniform(-1/sqrt(rows), 1/sqrt(rows)) (or +-``init_bound``), from a generator seeded
    per table so that every placement (one device, sharded, tiered) builds bit-identical rows. -> [rows, dim]
    (rows may be 0: an empty row shard)."""
    w = torch.empty(table.num_embeddings, table.embedding_dim, dtype=dtype)
    if table.num_embeddings == 0:  # an empty row shard (more row blocks than rows): nothing to draw
        return w
    g, bound = _generator(table, seed, index)
    w.uniform_(-bound, bound, generator=g)
    w[: table.zero_rows] = 0  # drawn and then zeroed: every other row stays what it always was
    return w


def init_row_chunks(table: TableConfig, seed: int, index: int, chunk_rows: int, stop: int | None = None
                ) -> Iterator[torch.Tensor]:
    """The rows of ``init_table`` [0, ``stop``) (default: all), ``chunk_rows`` at a time: [n, dim] float32 each,
    bit-identical to the same rows of the whole table without ever holding it. One float32 uniform_ draw
    takes one 32-bit number from the generator per element, in order, so a draw per chunk consumes the stream
    exactly as one draw over the whole table does (tests/embedding/test_embedding.py checks it)."""
    g, bound = _generator(table, seed, index)
    stop = table.num_embeddings if stop is None else stop
    for r0 in range(0, stop, chunk_rows):
        chunk = torch.empty(min(chunk_rows, stop - r0), table.embedding_dim).uniform_(-bound, bound, generator=g)
        if r0 < table.zero_rows:  # as init_table: the reserved rows are zero
            chunk[: table.zero_rows - r0] = 0
        yield chunk


INIT_CHUNK_BYTES = 8 << 20  # per chunk of a block drawn by ``init_block``


def init_block(table: TableConfig, seed: int, index: int, rows: tuple[int, int], cols: tuple[int, int],
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [row0, row1) x columns [col0, col1) of ``init_table`` (a shard's initial values), written into
    ``out`` [rows, cols] (any device; default a new float32 CPU tensor) chunk by chunk -> ``out``. The rows
    before ``row0`` are drawn and dropped (the generator cannot skip), so besides ``out`` only one chunk of
    ``INIT_CHUNK_BYTES`` is held."""
    (r0, r1), (c0, c1) = rows, cols
    out = torch.empty(r1 - r0, c1 - c0) if out is None else out
    chunk_rows = max(1, INIT_CHUNK_BYTES // (4 * max(1, table.embedding_dim)))
    pos = 0
    for chunk in init_row_chunks(table, seed, index, chunk_rows, stop=r1):
        lo, hi = max(pos, r0), pos + chunk.shape[0]
        if hi > lo:
            out[lo - r0 : hi - r0] = chunk[lo - pos : hi - pos, c0:c1]
        pos = hi
    return out


class EmbeddingCollection(nn.Module, abc.ABC):
    """Pooled (sum) lookups of F features into tables of one common dim D, or, in a collection that
    ``holds_mixed_dims``, tables of their own dims (``feature_dims``, ``mixed_dims``)."""

    # Whether tables of different dims may share the collection; its pooled output is then flat (``forward``).
    holds_mixed_dims: bool = False

    def __init__(self, tables: list[TableConfig], optimizer: SparseOptimizerConfig) -> None:
        super().__init__()
        self.tables = list(tables)
        dims = {t.embedding_dim for t in tables}
        if len(dims) != 1 and not (self.holds_mixed_dims and dims):
            raise ValueError(f"all tables need one embedding_dim, got {sorted(dims)}")
        # True: the tables have more than one dim. embedding_dim is then the widest (a bound, not every table's).
        self.mixed_dims = len(dims) > 1
        self.embedding_dim = max(dims)
        feature_table: dict[int, int] = {}
        for ti, t in enumerate(tables):
            for f in t.features:
                if f in feature_table:
                    raise ValueError(f"feature {f} is mapped to tables {feature_table[f]} and {ti}")
                feature_table[f] = ti
        self.num_features = len(feature_table)
        if sorted(feature_table) != list(range(self.num_features)):
            raise ValueError(f"features must be numbered 0..F-1, got {sorted(feature_table)}")
        self.feature_table = [feature_table[f] for f in range(self.num_features)]
        self.feature_dims = [tables[t].embedding_dim for t in self.feature_table]  # [F]
        self.optimizer = SparseOptimizer(optimizer)

    @abc.abstractmethod
    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        """-> pooled embeddings [B, F, D]; with ``mixed_dims`` [B, sum of feature_dims] instead, each sample's
        features one after another (feature f at its own dim). In training with grad enabled, backward updates
        the rows."""

    @abc.abstractmethod
    def table_weight(self, name: str) -> torch.Tensor:
        """The full weight [rows, dim] of one table (a copy where the table is not held whole)."""

    def weight_groups(self) -> list[tuple[str, list[TableConfig]]]:
        """(state-dict prefix, tables) of each ``<prefix>weight`` [sum of rows, dim] (and ``<prefix>accumulator``
        [sum of rows]) the collection's state holds, the tables' rows one after another: how a whole-table
        state is laid out for it (a sharded checkpoint read into one process). One group of every table by
        default; a collection of several such groups (one per dim) lists each."""
        return [("", self.tables)]

    # -- optional capabilities: every collection has them, most as the no-ops below ---------------------------
    # Whether the rows live in table files (cached tiers) rather than in the module's state dict: such a
    # collection's checkpoint is a directory with ``checkpoint_files`` beside the state, read by ``restore_files``.
    stores_rows_in_files: bool = False

    def next_batch_hook(self) -> Callable[[Batch], Batch] | None:
        """A function the loader calls on each batch ahead of its step (in its prefetch thread), so that the
        collection can fetch the batch's rows early; None when it has no use for that."""
        return None

    def ids_hook(self) -> Callable[[SparseFeatures], None] | None:
        """A function to call, from any thread, with the sparse input of each coming training forward, in
        order and ahead of it (a sharded collection's local shards get their ids from its input distribution,
        not from the loader's batches), so that the collection can fetch their rows early; None when it has no
        use for that."""
        return None

    def pop_counters(self) -> dict[str, float]:
        """Counters since the last call, for the training log: bytes and seconds per collective of a sharded
        collection, cache requests / hits / fetch seconds of cached tiers; empty for one that keeps none."""
        return {}

    def wire_layout(self) -> list[list[tuple[int, int, int, int, int, int]]] | None:
        """For a collection that sends pooled embeddings between ranks: per owner rank, what each chunk of its
        messages carries, ``(feature, table, row0, row1, col0, col1)`` in message order; None otherwise."""
        return None

    def checkpoint_files(self) -> dict[str, Callable[[Path], None]] | None:
        """{relative path: writer} of the files a checkpoint holds beside the state (``stores_rows_in_files``)."""
        return None

    def restore_files(self, directory: str | Path | None) -> None:
        """Load the rows from a checkpoint directory's ``checkpoint_files``; a no-op for in-memory rows."""

    def restore_tensors(self, weight: torch.Tensor, accumulator: torch.Tensor | None) -> None:
        """Load the rows from an all-in-memory collection's state (weight [sum of rows, D], row-wise
        accumulator [sum of rows] or None), for a collection whose rows are not in its state dict."""
        raise NotImplementedError(f"{type(self).__name__} holds its rows in its state dict")

    # Whether ``reset_rows`` works (a collection holding its rows in memory on one process).
    resets_rows: bool = False

    def reset_rows(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Give rows [k] (of table ``name``, numbered in the whole table) to new ids (dynamic ids): their initial
        ``values`` [k, dim] and the optimizer state of a new row."""
        raise NotImplementedError(f"{type(self).__name__} cannot reset rows")

    # Deferred updates, for the gradient-norm clip (``optim.max_grad_norm``; sparse_optim's docstring). The
    # defaults serve a collection whose rows are all updated by its own ``optimizer``; one that holds other
    # collections overrides the three, one that cannot keep an update for later refuses in ``defer_updates``.
    def defer_updates(self) -> None:
        """From now on backward keeps each step's row updates instead of applying them, until
        ``apply_deferred``."""
        self.optimizer.defer = True

    def deferred_sq_norm(self) -> float:
        """The sum of squares of the kept updates' gradients over all of the tables' rows (each element once;
        a collection whose rows are spread over processes sums over them: then a collective)."""
        return self.optimizer.pending_sq_norm()

    def apply_deferred(self, scale: float) -> None:
        """Apply the kept updates, their gradients multiplied by ``scale``."""
        self.optimizer.apply_pending(scale)

    def close(self) -> None:
        """Release what the collection holds besides memory (threads, open files); lookups fail afterwards."""
