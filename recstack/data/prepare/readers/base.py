"""What every schema-driven reader shares: errors that name file, row and column, bad-row bookkeeping, and
the chunk type readers yield.

A reader streams a file as :class:`RawChunk` s: a ``pyarrow.Table`` of at most ``chunk_rows`` rows holding
the columns the schema asked for (strings for text formats, native types for Parquet; multi-hot libFM
fields as list columns), plus where each row came from, so that any later check can point at the line.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from recstack.errors import RecstackError

GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)  # what reading a damaged gzip stream raises


class DataError(RecstackError, ValueError):
    """A row of an input file breaks the schema. ``where`` is ``file:line`` for text files, ``file row N``
    for Parquet (1-based), or just the file when the problem is not one row's."""

    def __init__(self, where: str, column: str | None, value: object, reason: str) -> None:
        self.where, self.column, self.value, self.reason = where, column, value, reason
        super().__init__(_describe(where, column, value, reason))

    def __reduce__(self) -> tuple[type[DataError], tuple[str, str | None, object, str]]:
        # raised in a worker process (an ExFM task reading a stream), it is pickled back to the runner
        return (DataError, (self.where, self.column, self.value, self.reason))


@dataclass(frozen=True)
class BadRow:
    where: str
    column: str | None
    value: object
    reason: str

    def __str__(self) -> str:
        return _describe(self.where, self.column, self.value, self.reason)

    def error(self) -> DataError:
        return DataError(self.where, self.column, self.value, self.reason)


def _describe(where: str, column: str | None, value: object, reason: str) -> str:
    reason = " ".join(reason.split())  # one line, also quoting a library's multi-line message
    parts = [where]
    if column is not None:
        parts.append(f"column {column!r}")
    if value is not None:
        text = str(value)
        reason += f" (got {text[:80] + '...' if len(text) > 80 else text!r})"
    parts.append(reason)
    return ": ".join(parts)


@dataclass
class BadRowLog:
    """Without ``skip`` the first bad row raises; with it rows are dropped, counted and the first
    ``keep`` remembered for the report."""

    skip: bool = False
    keep: int = 100
    count: int = 0
    rows: list[BadRow] = field(default_factory=list)

    def add(self, bad: BadRow) -> None:
        if not self.skip:
            raise bad.error()
        self.count += 1
        if len(self.rows) < self.keep:
            self.rows.append(bad)


@dataclass
class RawChunk:
    """``table``: the requested columns of n rows. ``positions`` int64 [n]: 1-based line numbers (text
    files) or row numbers (Parquet) inside ``file``; ``unit`` says which. ``file_index``: the input's
    position in the list of inputs; ``first``: the position of the file's first record (2 after a CSV
    header), so ``positions - first`` numbers records from 0 the same way in every format (the fraction
    split hashes it). ``rejected``: (position, bad row) of the records the reader itself could not take
    (a wrong field count, a malformed pair) among those of this chunk, in position order; they are reported
    together with the bad values of the chunk's rows (:func:`report_in_order`), so that bad rows are always
    reported in file order."""

    table: pa.Table
    file: str
    positions: np.ndarray
    unit: str
    file_index: int = 0
    first: int = 1
    rejected: list[tuple[int, BadRow]] = field(default_factory=list)

    @property
    def ordinals(self) -> np.ndarray:
        """0-based record number in the file, int64 [n]."""
        return self.positions - self.first

    def __len__(self) -> int:
        return self.table.num_rows

    def where(self, i: int) -> str:
        """Location of row i of this chunk, for messages."""
        p = int(self.positions[i])
        return f"{self.file}:{p}" if self.unit == "line" else f"{self.file} row {p}"


def report_in_order(log: BadRowLog, rejected: list[tuple[int, BadRow]], found: list[tuple[int, BadRow]]) -> None:
    """Log two position-ordered lists of bad rows merged in position order (raises on the first unless
    skipping)."""
    for _, bad in sorted([*rejected, *found], key=lambda pb: pb[0]):  # stable: a tie keeps the reader's first
        log.add(bad)


class Source:
    """A readable input file. Subclasses set ``columns`` (the names a schema can refer to) and implement
    :meth:`chunks`. ``size`` and ``size_unit`` drive the progress bar ("B" bytes or "rows")."""

    columns: list[str]
    size: int
    size_unit: str

    def __init__(self, path: str | Path, chunk_rows: int, log: BadRowLog) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no such file")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self.chunk_rows = chunk_rows
        self.log = log
        self.progress = 0  # in ``size_unit``, advanced while reading

    def require(self, names: list[str]) -> None:
        """Raise a DataError naming the file if a column the schema needs is not in it."""
        missing = [n for n in names if n not in self.columns]
        if missing:
            have = ", ".join(self.columns[:40]) + (" ..." if len(self.columns) > 40 else "")
            raise DataError(str(self.path), missing[0], None,
                            f"no such column in the file (it has: {have})")

    def chunks(self, columns: list[str], file_index: int = 0) -> Iterator[RawChunk]:
        raise NotImplementedError


@contextmanager
def open_binary(path: Path) -> Iterator[BinaryIO]:
    """Open for reading bytes; gzip is recognised by its magic bytes, not the name. A corrupt or
    truncated gzip stream met while reading in the ``with`` block is a DataError naming the file
    (not ``zlib.error``)."""
    with open(path, "rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        try:
            if not gz:
                yield raw
                return
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                yield f  # type: ignore[misc]
        except GZIP_ERRORS as e:
            if not gz:
                raise
            raise DataError(str(path), None, None, f"corrupt or truncated gzip data ({e})") from e


def first_invalid_utf8_line(path: Path) -> int | None:
    """The 1-based number of the first line of a (plain or gzipped) text file that is not valid UTF-8, None if
    every line is (read again on the error path only: pyarrow's message gives no line of the file)."""
    with open_binary(path) as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return None


# What a directory of day files holds besides them: hidden files (.DS_Store, editors' swap files), Spark's and
# Hadoop's markers (_SUCCESS, *.crc), files still being written or copied (*.tmp, *.part, *.partial, *~),
# and documentation (README*, LICENSE*, *.md, *.rst). Data files have any other name (day_0, day_0.gz, x.csv).
_NOT_DATA_SUFFIXES = (".tmp", ".part", ".partial", ".crc", ".md", ".rst", "~")
_NOT_DATA_PREFIXES = (".", "_", "readme", "license")


def is_data_file(path: Path) -> bool:
    """Whether a file found in an input directory is taken as data (the rule above)."""
    name = path.name.lower()
    return path.is_file() and not name.startswith(_NOT_DATA_PREFIXES) and not name.endswith(_NOT_DATA_SUFFIXES)
