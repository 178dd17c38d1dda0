"""Whole tables of a ``TieredEmbeddingCollection``: flushing the cache, reading a table, checkpoint files.

Every table (whatever its tier) is checkpointed as one file of records, ``tables/<index>.f32`` beside the
checkpoint's ``state.pt``: [rows, width] float32, the D weights then the row-wise Adagrad accumulator of each
row (``tiered_store``'s layout). A file is streamed from its tier in chunks (an SSD table is a kernel file copy),
so no table passes through memory whole; the state dict only records which files to expect. ``restore_files``
loads them into whatever tiers the loading collection uses, so a run may resume under other memory budgets.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from recstack.embedding.tiered_store import check_table_file

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
        rec = torch.cat(list(self._records(self._table_index(name))))
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
        with open(path, "wb") as f:
            for rec in self._records(i):
                f.write(memoryview(rec.numpy()))
            f.flush()
            os.fsync(f.fileno())

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
                    if f.readinto(memoryview(rec.numpy()).cast("B")) != n * self.width * 4:
                        raise ValueError(f"{path}: truncated at row {r0}")
                    self._scatter(torch.arange(r0, r0 + n) + self._offsets[i], rec)
        self._cache.clear()  # the cached copies belonged to the replaced rows
        self._staged.clear()
        self._staged_dirty = False
        self._inflight = 0
        with self._hint_lock:
            self._hints.clear()
        self._needs_restore = False
