"""Rows of a ``TieredEmbeddingCollection`` given to new ids (dynamic id tables): ``reset_rows``.

A reused row gets its new values and the optimizer state of a row never updated (row-wise Adagrad's initial
accumulator; SGD keeps none) in every place a copy of it lives, so that no later move of rows can bring the old
one back:

- a ``device`` table: its rows of the compute buffer;
- a cached table: the backing store (host memory, or the SSD file, where the write appends a record as every
  write does), and the cache slot or staging row holding the row, if any. A resident row is overwritten where
  it is, not dropped: its slot stays what a prefetched batch resolved (``_Hint.resolved``), and a dirty slot
  written back later writes the new values.

Ordering with the prefetch: a prefetch runs in a background thread while a step computes and moves rows
between the stores and the buffer, so ``reset_rows`` waits for it first; whatever it brought in is then
overwritten here. The dynamic ids' remap (the only caller in training) runs in the training thread between two
steps, when no backward is pending; the input pipeline then announces no batch ahead (``recstack.distributed.
pipeline``: the loader's thread sees raw ids, whose rows exist only once the remap has run), so each batch's rows
are fetched at its own forward, after its resets.
"""

from __future__ import annotations

import torch


class RowResetMixin:
    """``reset_rows`` for ``TieredEmbeddingCollection``; mixed into it beside ``TableFilesMixin``."""

    # Whether ``reset_rows`` works: it does, in every tier (module doc).
    resets_rows = True

    @torch.no_grad()
    def reset_rows(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Rows [k] of table ``name`` (distinct, numbered in the table) get ``values`` [k, dim] and the
        optimizer state of a new row, in the store and in any buffer copy (module doc)."""
        i = self._table_index(name)
        t = self.tables[i]
        rows = rows.detach().to("cpu", torch.int64)
        if rows.numel() == 0:
            return
        if int(rows.min()) < 0 or int(rows.max()) >= t.num_embeddings:
            raise ValueError(f"reset_rows: table {name!r} has rows [0, {t.num_embeddings}), got "
                             f"{rows[(rows < 0) | (rows >= t.num_embeddings)].tolist()[:5]}")
        if int(rows.unique().numel()) != rows.numel():
            raise ValueError(f"reset_rows: table {name!r}: rows must be distinct, got {rows.tolist()[:20]}")
        d = self.embedding_dim
        if tuple(values.shape) != (rows.numel(), d):
            raise ValueError(f"reset_rows: values of shape {tuple(values.shape)} for {rows.numel()} rows of dim {d}")
        k = rows.numel()
        # a record: the weights, then the state of a row never updated (``state_parts``, in the stores' order)
        parts = [torch.full((k, d if p.per_column else 1), p.initial) for p in self.optimizer.state_parts]
        records = torch.cat([values.detach().to("cpu", torch.float32), *parts], 1)
        self._wait_prefetch()  # the prefetch thread must not move rows (or the cache's flags) meanwhile
        if i not in self.cached_tables:
            self._scatter(rows + self._offsets[i], records)
            return
        part = self.cached_tables.index(i)
        self._stores[part].write(rows, records)
        keys = rows + self._cache.key_base[part]
        slots = self._cache.lookup(keys, torch.full_like(keys, part))
        resident = slots >= 0
        if bool(resident.any()):
            self._scatter(slots[resident] + self._cache_base, records[resident])
        if self._staged:  # staged rows are written back when released (the next forward): their copy too
            found, staged_rows = self._find_staged(keys)
            if bool(found.any()):
                self._scatter(staged_rows[found], records[found])
