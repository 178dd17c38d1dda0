"""Where a stream's partitions come from. ``StreamSource`` is the interface a loop consumes: partitions in
order, each with a stable name (its position), its index and its arrival time, resumable after the last one
consumed. ``DirectoryStream`` is the embedded source: a directory that producers drop files into.

A file counts once it appears under its final name: producers write a hidden temporary (``.name.tmp``) or one
with a temporary suffix and rename it, as object-store and HDFS writers do, so a half-written file is never
read. Files are read in name order, each once; a file whose name sorts before one already consumed arrived out of
order and is skipped with a warning (its position would be ambiguous on a resume). When no new file has appeared
for ``idle_s`` seconds the stream ends cleanly.

A message-broker source would implement the same interface; none ships, since no broker can be run or tested on
the machines this is built on.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from recstack.errors import StreamError

# Names producers give files that are still being written (Hadoop's _temporary and _COPYING_, .tmp, .partial)
# or that are not data (_SUCCESS, checksums).
_NOT_FINAL_SUFFIXES = (".tmp", ".partial", "._COPYING_", ".crc")


@dataclass(frozen=True)
class StreamPosition:
    """The last partition consumed: its ``name`` (the position in name order) and ``index`` (0-based)."""

    name: str
    index: int


@dataclass(frozen=True)
class Partition:
    """One unit of a stream. ``name``: stable, orders the stream; ``index``: 0-based position; ``arrived_at``:
    ``time.time()`` when it appeared under its final name (for a file: its status-change time, which the
    producer's rename sets); ``path``: where its rows are."""

    name: str
    index: int
    arrived_at: float
    path: Path

    @property
    def position(self) -> StreamPosition:
        return StreamPosition(self.name, self.index)


class StreamSource(Protocol):
    """Partitions in order. ``after``: resume after that partition (None: from the start). ``location``: where
    they come from (a directory, a broker's topic), recorded in the artifacts of a model trained on them."""

    @property
    def location(self) -> str: ...

    def partitions(self, after: StreamPosition | None = None) -> Iterator[Partition]: ...


def is_final_name(name: str) -> bool:
    """Whether a file name is a finished partition: not hidden (``.x``), not a Hadoop marker (``_x``), no
    temporary suffix."""
    return not name.startswith((".", "_")) and not name.endswith(_NOT_FINAL_SUFFIXES)


class DirectoryStream:
    """The files of ``directory``, in name order, each once; waits up to ``idle_s`` seconds for a new one (polling
    every ``poll_s``), then the stream ends. The idle clock restarts whenever the consumer asks for the next
    partition, so training time is never counted as idle."""

    def __init__(self, directory: str | Path, idle_s: float, poll_s: float = 0.2) -> None:
        if idle_s < 0:
            raise StreamError(f"--stream-idle-s: must be >= 0, got {idle_s:g}")
        self.directory, self.idle_s, self.poll_s = Path(directory), idle_s, poll_s

    @property
    def location(self) -> str:
        return str(self.directory)

    def check(self) -> None:
        """A StreamError unless the directory exists and is a directory."""
        if not self.directory.exists():
            raise StreamError(f"--stream {self.directory}: no such directory")
        if not self.directory.is_dir():
            raise StreamError(f"--stream {self.directory}: not a directory")

    def _ready(self, last: str | None) -> list[str]:
        """Final names after ``last`` in name order (regular files only)."""
        self.check()  # removed while training: say so, do not wait
        try:
            entries = list(os.scandir(self.directory))
        except OSError as e:
            raise StreamError(f"--stream {self.directory}: cannot list it ({e.strerror})") from e
        names = [e.name for e in entries if is_final_name(e.name) and e.is_file()]
        late = [n for n in names if last is not None and n <= last and n not in self._seen]
        for n in late:
            self._seen.add(n)
            print(f"stream: {self.directory / n} arrived after {last} was consumed (name order): skipped",
                  file=sys.stderr)
        return sorted(n for n in names if last is None or n > last)

    def partitions(self, after: StreamPosition | None = None) -> Iterator[Partition]:
        self.check()
        last, index = (after.name, after.index + 1) if after is not None else (None, 0)
        # consumed (here, or before the resume position by the run that checkpointed it), or warned about
        self._seen: set[str] = {n for n in os.listdir(self.directory) if last is not None and n <= last}
        idle_since = time.monotonic()
        while True:
            ready = self._ready(last)
            if not ready:
                if time.monotonic() - idle_since >= self.idle_s:
                    return
                time.sleep(self.poll_s)
                continue
            for name in ready:
                path = self.directory / name
                try:
                    arrived = path.stat().st_ctime
                except FileNotFoundError:  # removed since it was listed: it never counted
                    continue
                self._seen.add(name)
                yield Partition(name, index, arrived, path)
                last, index = name, index + 1
            idle_since = time.monotonic()
