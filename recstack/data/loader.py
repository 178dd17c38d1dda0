"""Batches from a prepared data set, resumable at any row and split across ranks.

A global batch is ``batch_size * world_size`` consecutive positions of the epoch's row sequence
(``recstack.data.order``: file order, or shuffled per epoch by a generator seeded with (seed, epoch)); rank r
takes the r-th slice of it. Without ``drop_last`` the last global batch of an epoch is short (``rows mod global
batch`` rows), so every row is visited once per epoch; it is split over the ranks as evenly as possible (a rank
may get none), and each batch carries ``global_rows`` so that the step can weight its loss as the mean over the
rows actually present. The position is (epoch, rows of the epoch's sequence done): a resumed run regenerates the
sequence and continues at the exact next row, whatever the batch size now (except ``blocks``, whose sequence is
made of batch-sized blocks). A background thread prepares the next batches while the current one trains
(``prefetch``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from recstack.data.batch import Batch
from recstack.data.order import EpochOrder, shuffle_mode


@dataclass
class LoaderPosition:
    """Where the next batch comes from: ``epoch`` and ``row``, how many positions of that epoch's row sequence
    are done (the next global batch starts there)."""

    epoch: int = 0
    row: int = 0

    def rebatched(self, old_batch: int, new_batch: int, shuffle: bool | str) -> LoaderPosition:
        """The same place in the data for global batches of ``new_batch`` rows instead of ``old_batch`` (another
        world size or batch size). Rows are rows: the sequence of ``none``, ``rows`` and ``window`` does not
        depend on the batch, so the next batch starts at the same row. The ``blocks`` sequence is made of blocks
        of the batch size, so there only a position at the start of an epoch carries over. Raises ValueError when
        there is no such position."""
        if old_batch == new_batch or self.row == 0 or shuffle_mode(shuffle) != "blocks":
            return LoaderPosition(self.epoch, self.row)
        raise ValueError(
            f"the global batch changed from {old_batch} to {new_batch} rows in the middle of epoch {self.epoch} "
            f"({self.row // old_batch} shuffled blocks done): shuffled blocks of another size are another "
            "permutation, so the rows still due in this epoch are unknown"
        )


class RowSet(Protocol):
    """What a loader reads rows from: a prepared set (``PreparedDataset``), or a stream's partition in memory
    (``recstack.data.stream.PartitionRows``)."""

    def __len__(self) -> int: ...

    def has(self, name: str) -> bool: ...

    def batch(self, start: int, end: int, extras: tuple[str, ...] = ()) -> Batch: ...

    def gather(self, rows: np.ndarray, extras: tuple[str, ...] = ()) -> Batch: ...


def cap_ids(batch: Batch, caps: torch.Tensor) -> None:
    """The one place where ids become rows of ordinary tables, in place: feature f's ids modulo ``caps[f]``
    (``model.max_table_size``, or a stream's table sizes). A cap of 0 leaves that feature's ids as they are (a
    dynamic id table maps raw ids to rows in a loader transform instead)."""
    s = batch.sparse
    per_id = caps.repeat_interleave(s.ids_per_feature)  # B may be 0 (a short last batch)
    if bool((caps > 0).all()):
        s.ids = torch.remainder(s.ids, per_id)
    else:
        s.ids = torch.where(per_id > 0, torch.remainder(s.ids, per_id.clamp(min=1)), s.ids)


class BatchLoader:
    def __init__(
        self,
        dataset: RowSet,
        batch_size: int,
        row_range: tuple[int, int] | None = None,
        shuffle: bool | str = False,
        seed: int = 0,
        drop_last: bool = True,
        extras: tuple[str, ...] = (),
        table_caps: list[int] | None = None,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
        transform: Callable[[Batch], Batch] | None = None,
        shuffle_window: int = 0,
    ) -> None:
        """``shuffle``: a ``recstack.data.order`` mode (true = ``blocks``); ``shuffle_window``: rows per window of
        the ``window`` mode. ``drop_last``: an epoch ends before a short last global batch (its rows are not
        visited that epoch)."""
        self.ds = dataset
        self.batch_size = batch_size  # per rank
        self.start, self.end = row_range if row_range is not None else (0, len(dataset))
        self.shuffle, self.seed, self.drop_last = shuffle_mode(shuffle), seed, drop_last
        self.shuffle_window = shuffle_window
        if self.shuffle == "window" and shuffle_window <= 0:
            raise ValueError(f"train.shuffle_window: must be > 0 for the window shuffle, got {shuffle_window}")
        self.extras = tuple(e for e in extras if dataset.has(e))
        self.table_caps = (
            torch.tensor(table_caps, dtype=torch.int64) if table_caps is not None else None
        )  # [F] rows per table after capping; ids are taken modulo (cap_ids; 0: raw ids of a dynamic table)
        self.rank, self.world_size = rank, world_size
        self.prefetch = prefetch
        # Runs in the prefetch thread; a model's is composed by recstack.distributed.pipeline.InputPipeline.
        self.transform = transform
        self.position = LoaderPosition()

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def _batches_from(self, row: int) -> int:
        """Global batches of an epoch from position ``row`` of its sequence to its end."""
        left, gb = max(self.end - self.start - row, 0), self.global_batch_size
        return left // gb if self.drop_last else -(-left // gb)

    def __len__(self) -> int:
        return self._batches_from(0)

    def normalised(self, position: LoaderPosition) -> LoaderPosition:
        """``position``, or the start of the next epoch when nothing of its epoch is left to visit."""
        if self._batches_from(position.row) == 0:
            return LoaderPosition(position.epoch + 1, 0)
        return LoaderPosition(position.epoch, position.row)

    def batches_until(self, epochs: int) -> int:
        """Global batches from ``position`` to the end of epoch ``epochs - 1`` (0 when that is done)."""
        pos = self.normalised(self.position)
        if pos.epoch >= epochs:
            return 0
        return self._batches_from(pos.row) + (epochs - pos.epoch - 1) * len(self)

    def _order(self, epoch: int) -> EpochOrder:
        return EpochOrder(self.shuffle, self.start, self.end, self.global_batch_size, self.seed, epoch,
                          self.shuffle_window)

    def _load(self, order: EpochOrder, a: int, b: int) -> Batch:
        """This rank's slice of the global batch at positions [a, b) of ``order``."""
        piece = order.piece(a, b)
        # Split the (possibly short, last) global batch as evenly as possible.
        bounds = np.linspace(0, b - a, self.world_size + 1).astype(np.int64)
        lo, hi = int(bounds[self.rank]), int(bounds[self.rank + 1])
        if isinstance(piece, tuple):
            batch = self.ds.batch(piece[0] + lo, piece[0] + hi, self.extras)
        else:  # sorted: the memory map is read in file order (the batch is a set: its loss is a mean)
            batch = self.ds.gather(np.sort(piece[lo:hi]), self.extras)
        batch.global_rows = b - a
        if self.table_caps is not None:
            cap_ids(batch, self.table_caps)
        return self.transform(batch) if self.transform is not None else batch

    def _advance(self, row: int) -> None:
        """Mark positions up to ``row`` done; at the end of the epoch the position moves to the next one at once,
        so a checkpoint written after the last batch already points there."""
        self.position = self.normalised(LoaderPosition(self.position.epoch, row))

    def iterate_epoch(self, limit: int | None = None) -> Iterator[Batch]:
        """Yields the rest of the current epoch from ``position`` (at most ``limit`` batches); advances
        ``position`` as it goes. A limit keeps the prefetch thread from reading (and, pipelined, distributing)
        batches that will never be trained on, which every rank must agree on."""
        self.position = self.normalised(self.position)
        if self.position.row == 0 and self._batches_from(0) == 0:
            return  # no batch at all (fewer rows than one global batch, dropped)
        order = self._order(self.position.epoch)
        gb, row, n = self.global_batch_size, self.position.row, self.end - self.start
        todo = [(a, min(a + gb, n)) for a in range(row, row + self._batches_from(row) * gb, gb)]
        if limit is not None:
            todo = todo[: max(limit, 0)]
        if self.prefetch <= 0:
            for a, b in todo:
                batch = self._load(order, a, b)
                self._advance(b)
                yield batch
        else:
            yield from self._prefetched(order, todo)

    def _prefetched(self, order: EpochOrder, todo: list[tuple[int, int]]) -> Iterator[Batch]:
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work() -> None:
            try:
                for a, b in todo:
                    if stop.is_set():
                        return
                    q.put((b, self._load(order, a, b)))
                q.put(None)
            except BaseException as e:  # surfaced in the consumer, never swallowed
                q.put(e)

        t = threading.Thread(target=work, daemon=True, name="batch-prefetch")
        t.start()
        try:
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._advance(item[0])
                yield item[1]
        finally:
            stop.set()
            while t.is_alive():  # drain so a blocked producer can see ``stop``
                try:
                    q.get_nowait()
                except queue.Empty:
                    t.join(timeout=0.01)
