"""Time-ordered windows over a prepared data set, and the batches of one window.

A stream is a prepared data set whose rows are in time order (``timestamp`` non-decreasing). Window t holds
the rows whose timestamp falls in [origin + t * size, origin + (t + 1) * size), or, with fixed row counts,
rows [t * n, (t + 1) * n). Either way a window is a contiguous row range, so the FM (which trains on every
vertical) reads it with the ordinary ``BatchLoader`` and a VM reads its own vertical's rows of it by index.
Windows with no rows (a quiet week) are kept, so window indices always mean the same span of time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from recstack.data.batch import Batch
from recstack.data.format import PreparedFormatError
from recstack.data.loader import RowSet
from recstack.data.loader import cap_ids as loader_cap_ids
from recstack.data.prepared_dataset import PreparedDataset
from recstack.exfm.config import StreamConfig


@dataclass(frozen=True)
class Window:
    """Rows [start, end) of the data set; ``index`` counts windows from the start of the stream."""

    index: int
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


def time_windows(timestamps: np.ndarray, size: float, where: str = "timestamp") -> list[Window]:
    """Windows of ``size`` timestamp units over [N] non-decreasing timestamps, starting at the first one."""
    ts = np.asarray(timestamps)
    if size <= 0:
        raise ValueError(f"window size must be positive, got {size}")
    if len(ts) == 0:
        return []
    back = np.flatnonzero(np.diff(ts) < 0)
    if len(back):
        r = int(back[0]) + 1
        raise PreparedFormatError(
            f"{where}: rows are not in time order (row {r} has timestamp {ts[r]} after {ts[r - 1]}); "
            "a stream needs its rows sorted by time"
        )
    index = np.floor((ts - ts[0]) / size).astype(np.int64)  # [N] window of each row, non-decreasing
    bounds = np.searchsorted(index, np.arange(int(index[-1]) + 2), side="left")
    return [Window(t, int(bounds[t]), int(bounds[t + 1])) for t in range(len(bounds) - 1)]


def row_windows(num_rows: int, rows: int) -> list[Window]:
    """Windows of ``rows`` consecutive rows (the last may be shorter)."""
    if rows <= 0:
        raise ValueError(f"window_rows must be positive, got {rows}")
    return [Window(i, s, min(s + rows, num_rows)) for i, s in enumerate(range(0, num_rows, rows))]


def make_windows(ds: PreparedDataset, cfg: StreamConfig) -> list[Window]:
    """The windows of ``ds`` under ``cfg`` (by row count, else by the ``timestamp`` column)."""
    if cfg.window_rows > 0:
        windows = row_windows(len(ds), cfg.window_rows)
    else:
        if not ds.has("timestamp"):
            raise PreparedFormatError(f"{ds.path}: no 'timestamp' column; set stream.window_rows instead")
        windows = time_windows(np.asarray(ds.column("timestamp")), cfg.window, f"{ds.path}/timestamp.bin")
    return windows[: cfg.max_windows] if cfg.max_windows > 0 else windows


def staleness_version(window: int, staleness: int, publish_every: int) -> int | None:
    """Snapshot version (windows the FM had trained on) that labels ``window`` at ``staleness``.

    A fresh FM (staleness 0) labelling window t has trained on windows [0, t), i.e. version t; at staleness d it
    is the newest published version <= t - d, published versions being multiples of ``publish_every``.
    None when no snapshot has been published by then.
    """
    v = (window - staleness) // publish_every * publish_every
    return v if v >= publish_every else None


class VerticalIndex:
    """Row numbers of each vertical inside each window (a data set without ``vertical`` is vertical 0)."""

    def __init__(self, ds: PreparedDataset) -> None:
        self.ds = ds
        self.vertical = (
            np.asarray(ds.column("vertical"), dtype=np.int64) if ds.has("vertical") else np.zeros(len(ds), np.int64)
        )
        self.verticals = sorted(int(v) for v in np.unique(self.vertical))
        self.example_id = ds.column("example_id") if ds.has("example_id") else None  # memory-mapped

    def example_ids(self, rows: np.ndarray) -> np.ndarray:
        """[n] int64 example ids of ``rows`` (the row numbers themselves when the set has no ``example_id``)."""
        return np.asarray(self.example_id[rows]) if self.example_id is not None else rows

    def rows(self, window: Window, vertical: int | None) -> np.ndarray:
        """[n] int64 sorted row numbers of ``vertical`` (None: all) in ``window``."""
        if vertical is None:
            return np.arange(window.start, window.end, dtype=np.int64)
        return np.flatnonzero(self.vertical[window.start : window.end] == vertical) + window.start


def cap_ids(batch: Batch, caps: torch.Tensor | None) -> Batch:
    """Take ids modulo each feature's capped table size (``model.max_table_size``; a cap of 0 leaves a dynamic
    table's raw ids as they are), with ``BatchLoader``'s own rule."""
    if caps is not None:
        loader_cap_ids(batch, caps)
    return batch


def row_batches(
    ds: RowSet,
    rows: np.ndarray,
    batch_size: int,
    extras: tuple[str, ...] = (),
    caps: torch.Tensor | None = None,
    columns: dict[str, np.ndarray] | None = None,
) -> Iterator[Batch]:
    """Batches of ``rows`` [n] (in their order, the last batch short). ``columns`` adds per-row arrays [n]
    aligned with ``rows`` (e.g. FM logits joined from the DAS store) as extras under their names."""
    extras = tuple(e for e in extras if ds.has(e))
    for i in range(0, len(rows), batch_size):
        batch = ds.gather(rows[i : i + batch_size], extras)
        for name, values in (columns or {}).items():
            batch.extras[name] = torch.from_numpy(np.ascontiguousarray(values[i : i + batch_size]))
        yield cap_ids(batch, caps)
