"""Whole tables of a ``TieredEmbeddingCollection``: flushing the cache, reading a table, checkpoint files.

Every table (whatever its tier) is checkpointed as one file of records, ``tables/<index>.f32`` beside the
checkpoint's ``state.pt``: [rows, width] float32, the D weights then the row-wise Adagrad accumulator of each
row (``tiered_store``'s layout). A file is streamed from its tier in chunks (an SSD table is a kernel file copy),
so no table passes through memory whole; the state dict only records which files to expect. ``restore_files``
loads them into whatever tiers the loading collection uses, so a run may resume under other memory budgets.
Budgets under which every table fits in memory build the all-in-memory collection instead, whose checkpoint is
a single file: ``read_table_files`` turns a directory checkpoint's tables into its weight and accumulator, and
``restore_tensors`` fills the tiers from them, so a run may also resume across the two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from recstack.embedding.tiered.store import check_table_file
from recstack.io import open_synced

CHUNK_ROWS = 1 << 16  # rows per chunk when whole tables are initialised, saved or restored


class TableFilesMixin:
    """Flush, whole-table reads and checkpoint files; mixed into ``TieredEmbeddingCollection``."""

    def flush(self) -> None:
        """Write every dirty cached row (and staged row) back to its store; rows a pending backward will still
        update stay marked dirty."""
        self._wait_prefetch()
        if self._inflight == 0:
            self._release()
        elif self._staged_dirty:  # a backward is pending: write the staged rows but keep them staged
            for keys, rows in self._staged:
                self._write_back(keys, rows)
        c = self._cache
        slots, keys = c.resident_dirty()
        if slots.numel():
            self._write_back(keys, slots + self._cache_base)
            c.dirty[slots] = c.pinned[slots] & (self._inflight > 0)

    def _table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise KeyError(f"no table {name!r} (tables: {', '.join(t.name for t in self.tables)})")

    def _records(self, i: int) -> Iterator[torch.Tensor]:
        """All records of table i in row order, in chunks [n, width] (CPU); call ``flush`` first."""
        n = self.tables[i].num_embeddings
        part = self.cached_tables.index(i) if i in self.cached_tables else None
        for r0 in range(0, n, CHUNK_ROWS):
            r = torch.arange(r0, min(r0 + CHUNK_ROWS, n))
            yield self._stores[part].read(r) if part is not None else self._gather(r + self._offsets[i])

    def table_state(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (weight [rows, D], row-wise accumulator [rows] or None): a CPU copy of the whole table."""
        self.flush()
        chunks = list(self._records(self._table_index(name)))
        rec = torch.cat(chunks) if chunks else torch.empty(0, self.width)  # an empty row shard has no chunk
        d = self.embedding_dim
        return rec[:, :d].contiguous(), (rec[:, d].contiguous() if self.width > d else None)

    def table_weight(self, name: str) -> torch.Tensor:
        return self.table_state(name)[0]

    @staticmethod
    def table_file(index: int) -> str:
        return f"tables/{index:03d}.f32"

    def checkpoint_files(self) -> dict[str, Callable[[Path], None]]:
        """{relative path: writer(path)} of every table's records, for ``save_checkpoint(files=...)``."""
        return {self.table_file(i): functools.partial(self._save_table, i) for i in range(len(self.tables))}

    def _save_table(self, i: int, path: Path) -> None:
        self.flush()
        path.parent.mkdir(parents=True, exist_ok=True)
        if i in self.cached_tables:
            self._stores[self.cached_tables.index(i)].save(path)
            return
        with open_synced(path) as f:
            for rec in self._records(i):
                f.write(rec.numpy().data)

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "format": 1,
            "width": self.width,
            "tables": [{"name": t.name, "rows": t.num_embeddings, "dim": t.embedding_dim,
                        "file": self.table_file(i)} for i, t in enumerate(self.tables)],
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        mine = self.get_extra_state()
        if state.get("format") != 1 or state.get("width") != self.width or state.get("tables") != mine["tables"]:
            raise ValueError(f"checkpoint tables {state.get('tables')} (record width {state.get('width')}) do not "
                             f"match this model's {mine['tables']} (record width {self.width})")
        self._needs_restore = True  # the rows themselves come from restore_files

    def restore_files(self, directory: str | Path | None) -> None:
        """Load every table from the files a checkpoint directory holds (see ``checkpoint_files``)."""
        if directory is None:
            if self._needs_restore:
                raise ValueError("this checkpoint has no table files; tiered tables need a directory checkpoint")
            return
        self._wait_prefetch()
        d = Path(directory)
        for i, t in enumerate(self.tables):
            path = d / self.table_file(i)
            check_table_file(path, t.num_embeddings, self.width)
            if i in self.cached_tables:
                self._stores[self.cached_tables.index(i)].load(path)
                continue
            with open(path, "rb") as f:
                for r0 in range(0, t.num_embeddings, CHUNK_ROWS):
                    n = min(CHUNK_ROWS, t.num_embeddings - r0)
                    rec = torch.empty(n, self.width)
                    if f.readinto(rec.numpy().data.cast("B")) != n * self.width * 4:
                        raise ValueError(f"{path}: truncated at row {r0}")
                    self._scatter(torch.arange(r0, r0 + n) + self._offsets[i], rec)
        self._restored()

    def restore_tensors(self, weight: torch.Tensor, accumulator: torch.Tensor | None) -> None:
        """Load every table from an all-in-memory collection's state: ``weight`` [sum of rows, D] and the
        row-wise accumulator [sum of rows] (or None), the tables one after another in this collection's order."""
        d, total = self.embedding_dim, sum(t.num_embeddings for t in self.tables)
        if tuple(weight.shape) != (total, d):
            raise ValueError(f"embedding weight of shape {tuple(weight.shape)}, this model's tables need {(total, d)}")
        if (accumulator is not None) != (self.width > d):
            raise ValueError(f"the checkpoint's tables {'have' if accumulator is not None else 'have no'} row-wise "
                             f"accumulators, this model's sparse optimizer {'needs' if self.width > d else 'uses'} "
                             f"{'them' if self.width > d else 'none'}")
        self._wait_prefetch()

        def chunks(r0: int, rows: int) -> Iterator[torch.Tensor]:
            for a in range(r0, r0 + rows, CHUNK_ROWS):
                b = min(a + CHUNK_ROWS, r0 + rows)
                w = weight[a:b].float().cpu()
                yield w if accumulator is None else torch.cat([w, accumulator[a:b].float().cpu().unsqueeze(1)], 1)

        r0 = 0
        for i, t in enumerate(self.tables):
            if i in self.cached_tables:
                self._stores[self.cached_tables.index(i)].fill(chunks(r0, t.num_embeddings))
            else:
                at = self._offsets[i]
                for rec in chunks(r0, t.num_embeddings):
                    self._scatter(torch.arange(at, at + rec.shape[0]), rec)
                    at += rec.shape[0]
            r0 += t.num_embeddings
        self._restored()

    def _restored(self) -> None:
        self._cache.clear()  # the cached copies belonged to the replaced rows
        self._staged.clear()
        self._staged_dirty = False
        self._inflight = 0
        with self._hint_lock:
            self._hints.clear()
        self._needs_restore = False


def read_table_files(
    directory: str | Path | None, extra_state: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A directory checkpoint's tables (``extra_state``: the collection's, from the state dict) -> the
    all-in-memory collection's weight [sum of rows, D] and row-wise accumulator [sum of rows] (None without
    one), on the CPU."""
    if directory is None:
        raise ValueError("this checkpoint has no table files; tiered tables need a directory checkpoint")
    width, tables = int(extra_state["width"]), extra_state["tables"]
    dims = {int(t["dim"]) for t in tables}
    if len(dims) != 1:
        raise ValueError(f"checkpoint tables of different dimensions {sorted(dims)}")
    d = dims.pop()
    total = sum(int(t["rows"]) for t in tables)
    records = torch.empty(total, width)
    r0 = 0
    for t in tables:
        path, rows = Path(directory) / t["file"], int(t["rows"])
        check_table_file(path, rows, width)
        with open(path, "rb") as f:
            if f.readinto(records[r0 : r0 + rows].numpy().data.cast("B")) != rows * width * 4:
                raise ValueError(f"{path}: truncated")
        r0 += rows
    weight = records[:, :d].contiguous()
    return weight, (records[:, d].contiguous() if width > d else None)
