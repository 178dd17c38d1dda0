"""Batches from a prepared data set, resumable at any batch and split across ranks.

A global batch is ``batch_size * world_size`` consecutive rows (consecutive, so reads from the memory map are
sequential and time order is kept); rank r takes the r-th slice of it. With ``shuffle`` the order of global
batches is permuted per epoch by a generator seeded with (seed, epoch), so a resumed run sees the same order.
A background thread prepares the next batches while the current one trains (``prefetch``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from recstack.data.batch import Batch
from recstack.data.format import PreparedDataset


@dataclass
class LoaderPosition:
    """Where the next batch comes from: ``epoch`` and ``batch`` (index of the next global batch)."""

    epoch: int = 0
    batch: int = 0

    def rebatched(self, old_batch: int, new_batch: int, epoch_rows: int, shuffle: bool) -> LoaderPosition:
        """The same place in the data for global batches of ``new_batch`` rows instead of ``old_batch``
        (another world size or batch size), in an epoch of ``epoch_rows`` rows (whole batches only):
        ``batch * old_batch`` rows of the epoch are done, which must be a whole number of new batches. With
        ``shuffle`` the batches an epoch permutes change with their size, so only a position at the start (or
        end) of an epoch carries over. Raises ValueError when there is no such position."""
        if old_batch == new_batch or self.batch == 0:
            return LoaderPosition(self.epoch, self.batch)
        if self.batch >= epoch_rows // old_batch:  # the epoch is done (saved before the loader moved on)
            return LoaderPosition(self.epoch + 1, 0)
        rows = self.batch * old_batch
        if shuffle:
            raise ValueError(
                f"the global batch changed from {old_batch} to {new_batch} rows in the middle of epoch {self.epoch} "
                f"({self.batch} shuffled batches done): shuffled batches of another size are another permutation, "
                "so the rows still due in this epoch are unknown"
            )
        if rows % new_batch:
            raise ValueError(
                f"the global batch changed from {old_batch} to {new_batch} rows: the {rows} rows done in epoch "
                f"{self.epoch} are not a whole number of batches of {new_batch}"
            )
        if rows // new_batch >= epoch_rows // new_batch:  # what is left is shorter than one new batch (dropped)
            return LoaderPosition(self.epoch + 1, 0)
        return LoaderPosition(self.epoch, rows // new_batch)


class BatchLoader:
    def __init__(
        self,
        dataset: PreparedDataset,
        batch_size: int,
        row_range: tuple[int, int] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = True,
        extras: tuple[str, ...] = (),
        table_caps: list[int] | None = None,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
        transform: Callable[[Batch], Batch] | None = None,
    ) -> None:
        self.ds = dataset
        self.batch_size = batch_size  # per rank
        self.start, self.end = row_range if row_range is not None else (0, len(dataset))
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.extras = tuple(e for e in extras if dataset.has(e))
        self.table_caps = (
            torch.tensor(table_caps, dtype=torch.int64) if table_caps is not None else None
        )  # [F] rows per table after capping; ids are taken modulo
        self.rank, self.world_size = rank, world_size
        self.prefetch = prefetch
        # Runs in the prefetch thread; a model's is composed by recstack.distributed.pipeline.InputPipeline.
        self.transform = transform
        self.position = LoaderPosition()

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        n = self.end - self.start
        gb = self.global_batch_size
        return n // gb if self.drop_last else -(-n // gb)

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _load(self, global_index: int) -> Batch:
        gb = self.global_batch_size
        g0 = self.start + global_index * gb
        g1 = min(g0 + gb, self.end)
        # Split the (possibly short, last) global batch as evenly as possible.
        bounds = np.linspace(g0, g1, self.world_size + 1).astype(np.int64)
        batch = self.ds.batch(int(bounds[self.rank]), int(bounds[self.rank + 1]), self.extras)
        if self.table_caps is not None:
            s = batch.sparse
            caps = self.table_caps.repeat_interleave(s.ids_per_feature)  # B may be 0 (a short last batch)
            s.ids = torch.remainder(s.ids, caps)
        return self.transform(batch) if self.transform is not None else batch

    def iterate_epoch(self, limit: int | None = None) -> Iterator[Batch]:
        """Yields the rest of the current epoch from ``position`` (at most ``limit`` batches); advances
        ``position`` as it goes. A limit keeps the prefetch thread from reading (and, pipelined, distributing)
        batches that will never be trained on, which every rank must agree on."""
        order = self._order(self.position.epoch)
        todo = order[self.position.batch :].tolist()
        if limit is not None:
            todo = todo[: max(limit, 0)]
        if self.prefetch <= 0:
            for gi in todo:
                batch = self._load(gi)
                self.position.batch += 1
                yield batch
        else:
            yield from self._prefetched(todo)
        if self.position.batch >= len(order):
            self.position = LoaderPosition(self.position.epoch + 1, 0)

    def _prefetched(self, todo: list[int]) -> Iterator[Batch]:
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work() -> None:
            try:
                for gi in todo:
                    if stop.is_set():
                        return
                    q.put(self._load(gi))
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
                self.position.batch += 1
                yield item
        finally:
            stop.set()
            while t.is_alive():  # drain so a blocked producer can see ``stop``
                try:
                    q.get_nowait()
                except queue.Empty:
                    t.join(timeout=0.01)
