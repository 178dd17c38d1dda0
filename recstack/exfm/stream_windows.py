"""ExFM windows from a directory stream: each partition (``recstack.data.stream``: files of a directory in name
order, each once, only under their final name, a bounded idle wait) is one window, read as it arrives.

One process decides what the stream is: the FM (the *leader*) follows the directory through ``DirectoryStream``
and, for every partition it takes, appends an entry to a manifest (``stream_windows.json`` in the FM's
directory): the file name, its first row in the stream's numbering, its rows and the vertical names known after
it. When no partition arrived for the idle wait it marks the manifest ended. The DAS and the VMs (*followers*)
read window t from the file the manifest names for it, waiting for the entry (bounded by ``wait_s``), and stop
where the manifest ends. So every process sees the same windows, even when a producer renames a partition into
place just as the FM's idle wait runs out, and a process that starts at window t numbers rows and verticals as
one that read the stream from its start: vertical names get ids in order of first appearance over the stream,
as ``recstack data prepare --schema`` numbers them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recstack.data.batch import Batch
from recstack.data.format import DataDescription
from recstack.data.loader import RowSet
from recstack.data.prepare.schema import load_schema
from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.stream.partition import PartitionRows, SchemaPartitions
from recstack.data.stream.source import DirectoryStream, Partition, StreamPosition
from recstack.errors import StreamError
from recstack.exfm.config import StreamConfig, StreamSourceSpec
from recstack.exfm.source import FeatureLayout, PreparedWindows, WindowSource
from recstack.exfm.windows import Window, make_windows
from recstack.io import atomic_write_text

MANIFEST = "stream_windows.json"


@dataclass(frozen=True)
class StreamFeatures:
    """A stream's feature layout, from its schema (``hash`` / ``identity`` encodings fix the table sizes)."""

    dense_features: list[str]
    table_names: list[str]
    table_sizes: list[int]


class _CurrentRows:
    """The stream's rows as one ``RowSet`` numbered over the whole stream; only the current window's are here."""

    def __init__(self) -> None:
        self.start, self.rows = 0, PartitionRows(np.zeros(0, np.float32), np.zeros((0, 0), np.float32),
                                                 np.zeros((0, 0), np.int64))

    def __len__(self) -> int:
        return self.start + len(self.rows)

    def has(self, name: str) -> bool:
        return self.rows.has(name)

    def _local(self, rows: np.ndarray) -> np.ndarray:
        local = np.asarray(rows, np.int64) - self.start
        if len(local) and (local.min() < 0 or local.max() >= len(self.rows)):
            raise StreamError(f"rows {int(rows.min())}..{int(rows.max())} are not in the current window "
                              f"[{self.start}, {len(self)}) of the stream (windows are read in order)")
        return local

    def batch(self, start: int, end: int, extras: tuple[str, ...] = ()) -> Batch:
        return self.rows.gather(self._local(np.arange(start, end)), extras)

    def gather(self, rows: np.ndarray, extras: tuple[str, ...] = ()) -> Batch:
        return self.rows.gather(self._local(rows), extras)


class DirectoryWindows:
    """Windows = the partitions of ``spec.dir`` in the format of ``spec.schema``. ``leader``: follow the directory
    and write ``manifest``; else follow ``manifest``, waiting up to ``wait_s`` for an entry. ``max_windows`` > 0
    ends the stream after that many windows."""

    def __init__(self, spec: StreamSourceSpec, manifest: str | Path, leader: bool, wait_s: float,
                 max_windows: int = 0, poll_s: float = 0.2) -> None:
        self.stream = DirectoryStream(spec.dir, spec.idle_s, poll_s)
        self.stream.check()
        self.reader = SchemaPartitions(load_schema(spec.schema))  # refuses what a stream cannot encode
        self.schema, layout = self.reader.schema, self.reader.layout
        self._features = StreamFeatures(layout.dense_names, layout.table_names, layout.table_sizes)
        self.manifest, self.leader, self.wait_s = Path(manifest), leader, wait_s
        self.max_windows, self.poll_s = max_windows, poll_s
        self.entries: list[dict[str, Any]] = []
        self.ended = False
        if leader:
            self._load_manifest()  # a resumed FM keeps the windows it had taken
        self._rows = _CurrentRows()
        self._window: Window | None = None
        self._verticals: list[int] = []
        self._missing = False
        self._parts: Iterator[Partition] | None = None

    @property
    def features(self) -> FeatureLayout:
        return self._features

    @property
    def data(self) -> RowSet:
        return self._rows

    # -- the manifest ----------------------------------------------------------------------------------
    def _load_manifest(self) -> None:
        if not self.manifest.is_file():
            return
        try:
            state = json.loads(self.manifest.read_text(encoding="utf-8"))
            self.entries, self.ended = list(state["entries"]), bool(state["ended"])
        except (ValueError, KeyError, TypeError) as e:
            raise StreamError(f"{self.manifest}: damaged stream manifest ({type(e).__name__}: {e})") from None

    def _save_manifest(self) -> None:
        atomic_write_text(self.manifest, json.dumps({"directory": self.stream.location, "entries": self.entries,
                                                     "ended": self.ended}, indent=1))

    def _entry(self, t: int) -> dict[str, Any] | None:
        """The manifest entry of window t (the leader takes new partitions from the directory); None: ended."""
        if self.leader:
            while t >= len(self.entries) and not self.ended:
                self._take()
            return self.entries[t] if t < len(self.entries) else None
        deadline = time.monotonic() + self.wait_s
        while True:
            self._load_manifest()
            if t < len(self.entries) or self.ended:
                return self.entries[t] if t < len(self.entries) else None
            if time.monotonic() >= deadline:
                raise StreamError(f"{self.manifest}: window {t} of stream {self.stream.location} not taken by the "
                                  f"foundation model after {self.wait_s:.0f} s")
            time.sleep(self.poll_s)

    def _take(self) -> None:
        """The leader: the next partition of the directory -> a manifest entry (or the end of the stream)."""
        if self._parts is None:
            last = self.entries[-1] if self.entries else None
            after = StreamPosition(last["name"], len(self.entries) - 1) if last else None
            self._parts = self.stream.partitions(after)
        part = next(self._parts, None)
        if part is None:  # no new partition for the idle wait
            self.ended = True
        else:
            t = len(self.entries)
            before = self.entries[-1] if self.entries else None
            start = before["start"] + before["rows"] if before else 0
            rows, names = self._read(part.name, before["verticals"] if before else [])
            self.entries.append({"name": part.name, "start": start, "rows": len(rows), "verticals": names,
                                 "arrived_at": part.arrived_at})
            self._set(Window(t, start, start + len(rows)), rows, names)
        self._save_manifest()

    # -- windows ---------------------------------------------------------------------------------------
    def _read(self, name: str, verticals: list[str]) -> tuple[PartitionRows, list[str]]:
        """Partition ``name`` with the vertical names known before it -> (rows, names known after it)."""
        reader = SchemaPartitions(self.schema, verticals)
        path = self.stream.directory / name
        if not path.is_file():
            raise StreamError(f"{path}: partition of the stream is gone (it was taken as a window)")
        return reader.read(path), reader.verticals  # a bad line: an error naming the file and line

    def _set(self, window: Window, rows: PartitionRows, names: list[str]) -> None:
        """``window`` is current: its ``rows``, and ``names`` the vertical names known after it."""
        self._window, self._rows.start, self._rows.rows = window, window.start, rows
        vertical = rows.extras.get("vertical")
        # every vertical numbered up to this window, whichever windows this process read (a resumed FM, the DAS
        # and the VM arms start later); -1 (no vertical) as far as seen
        self._verticals = list(range(len(names))) if vertical is not None else [0]
        self._missing = self._missing or bool(vertical is not None and (vertical < 0).any())

    def window(self, t: int) -> Window | None:
        if self._window is not None and self._window.index == t:
            return self._window
        if self.max_windows and t >= self.max_windows:
            return None
        entry = self._entry(t)
        if entry is None:
            return None
        if self._window is None or self._window.index != t:  # the leader has just read a new partition
            rows, names = self._read(entry["name"], self.entries[t - 1]["verticals"] if t else [])
            if len(rows) != entry["rows"] or names != entry["verticals"]:
                raise StreamError(f"{self.stream.directory / entry['name']}: changed since the foundation model "
                                  f"read it as window {t} ({len(rows)} rows now, {entry['rows']} then)")
            self._set(Window(t, entry["start"], entry["start"] + entry["rows"]), rows, names)
        assert self._window is not None
        return self._window

    def _vertical(self) -> np.ndarray | None:
        return self._rows.rows.extras.get("vertical")

    def rows(self, window: Window, vertical: int | None) -> np.ndarray:
        if self._window != window:
            raise StreamError(f"window {window.index} is not the current window of the stream")
        if vertical is None:
            return np.arange(window.start, window.end, dtype=np.int64)
        v = self._vertical()
        if v is None:
            return np.arange(window.start, window.end, dtype=np.int64) if vertical == 0 else np.zeros(0, np.int64)
        return np.flatnonzero(v == vertical) + window.start

    def example_ids(self, rows: np.ndarray) -> np.ndarray:
        eid = self._rows.rows.extras.get("example_id")
        return np.asarray(rows, np.int64) if eid is None else eid[self._rows._local(rows)]

    def verticals(self) -> list[int]:
        return [-1, *self._verticals] if self._missing else list(self._verticals)

    def describe(self, raw: list[bool]) -> DataDescription:
        return self.reader.describe(Path(self.stream.location), raw)


def open_windows(data: str, windows: StreamConfig, source: StreamSourceSpec, manifest: str, wait_s: float,
                 leader: bool = False) -> WindowSource:
    """The windows a task reads: a directory stream when ``source.dir`` is set (the FM as ``leader``), else the
    windows of the prepared set ``data`` under ``windows``."""
    if source.dir:
        return DirectoryWindows(source, manifest, leader, wait_s, windows.max_windows)
    ds = PreparedDataset(data)
    return PreparedWindows(ds, make_windows(ds, windows))
