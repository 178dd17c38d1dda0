"""Where ExFM's windows come from: the one interface the FM, the DAS and the VMs read "window t" through.

A ``WindowSource`` numbers the rows of its stream globally: window t is the contiguous row range
``[start, end)`` of ``data`` (a ``recstack.data.loader.RowSet``), so the FM reads it with the ordinary
``BatchLoader`` and a VM gathers its own vertical's rows of it by index. Two implementations:

* ``PreparedWindows`` (here): the windows of a prepared, time-ordered data set (``windows.make_windows``), all
  known from the start;
* ``DirectoryWindows`` (``stream_windows.py``): the partitions of a directory stream, one window each, read as
  they arrive; ``window(t)`` waits for window t (bounded) and says when the stream has ended.

Either way only the rows of the window last asked for need to be readable (a stream keeps one partition in
memory), and every process that reads window t sees the same rows, vertical ids and example ids.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from recstack.data.format import DataDescription
from recstack.data.loader import RowSet
from recstack.data.prepared_dataset import PreparedDataset
from recstack.exfm.windows import VerticalIndex, Window


class FeatureLayout(Protocol):
    """What building a model for the stream needs: dense feature names, the table each sparse feature looks up
    (shared tables repeat) and its rows. A ``PreparedDataset`` is one."""

    @property
    def dense_features(self) -> list[str]: ...

    @property
    def table_names(self) -> list[str]: ...

    @property
    def table_sizes(self) -> list[int]: ...


class WindowRowsIndex(Protocol):
    """Rows of a vertical inside a window, and the example ids of rows (a ``VerticalIndex`` is one)."""

    def rows(self, window: Window, vertical: int | None) -> np.ndarray:
        """[n] int64 sorted row numbers of ``vertical`` (None: every row) in ``window``."""
        ...

    def example_ids(self, rows: np.ndarray) -> np.ndarray:
        """[n] int64 example ids of ``rows`` (the DAS logs FM labels under them, the VMs join on them)."""
        ...


class WindowSource(WindowRowsIndex, Protocol):
    """Window t of a stream for the FM, the DAS and the VMs.

    ``features``: the feature layout models are built for; ``data``: the rows, numbered over the whole stream
    (those of the window last returned by ``window`` are readable, with the extra columns ``vertical`` and
    ``example_id`` where the stream has them)."""

    @property
    def features(self) -> FeatureLayout: ...

    @property
    def data(self) -> RowSet: ...

    def window(self, t: int) -> Window | None:
        """Window t, waiting for it to arrive if need be (bounded); None when the stream ended before it. Windows
        are asked for in increasing order."""
        ...

    def verticals(self) -> list[int]:
        """Sorted vertical ids of the windows returned so far (a prepared set: all of its verticals)."""
        ...

    def describe(self, raw: list[bool]) -> DataDescription:
        """The data as export and serving see it (features, tables, transforms), to publish a model trained on
        it; ``raw``: per feature, whether its ids reach the model raw (a dynamic id table)."""
        ...


class PreparedWindows:
    """The ``windows`` of a prepared data set ``ds`` (all known up front)."""

    def __init__(self, ds: PreparedDataset, windows: list[Window]) -> None:
        self.ds, self.windows, self.index = ds, windows, VerticalIndex(ds)

    @property
    def features(self) -> FeatureLayout:
        return self.ds

    @property
    def data(self) -> RowSet:
        return self.ds

    def window(self, t: int) -> Window | None:
        return self.windows[t] if t < len(self.windows) else None

    def rows(self, window: Window, vertical: int | None) -> np.ndarray:
        return self.index.rows(window, vertical)

    def example_ids(self, rows: np.ndarray) -> np.ndarray:
        return self.index.example_ids(rows)

    def verticals(self) -> list[int]:
        return self.index.verticals

    def describe(self, raw: list[bool]) -> DataDescription:
        return self.ds  # its transforms give the ids a dynamic table's map takes in training too
