"""CSV and TSV input (plain or gzip), streamed block by block with pyarrow's CSV reader.

Every column the schema uses is read as text and converted by the encoder, so that a value of the wrong type
is reported with its file, line and column instead of failing the whole block. The first line is the header
unless ``[source] header = false`` (then ``columns`` names the fields, or they are ``c0, c1, ...``). Empty
fields and the usual null markers (``NA``, ``NULL``, ``nan``, ...) are missing values. CSV fields may be
quoted; TSV fields are taken literally. A UTF-8 byte order mark (as Excel writes) is ignored. Line numbers in
messages count the records of the file, the header included: they are the file's line numbers unless blank
lines (not counted) or quoted line breaks (a record spanning lines counts once) come before. A file with a
header and no rows is an error.

A row with the wrong number of fields is a bad row: an error, or skipped and reported with
``skip_bad_rows``; it is reported in line order with the bad values the encoder finds.
"""

from __future__ import annotations

import csv
import io
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from recstack.data.prepare.readers.base import (
    BadRow,
    BadRowLog,
    DataError,
    RawChunk,
    Source,
    first_invalid_utf8_line,
    open_binary,
    report_in_order,
)
from recstack.data.prepare.schema import SourceSpec

BLOCK_BYTES = 1 << 20  # pyarrow parses this many bytes at a time: bounds memory with the chunk size


class CsvSource(Source):
    size_unit = "B"

    def __init__(self, path: str | Path, chunk_rows: int, log: BadRowLog, spec: SourceSpec, tsv: bool) -> None:
        super().__init__(path, chunk_rows, log)
        self.delimiter = spec.delimiter or ("\t" if tsv else ",")
        if len(self.delimiter) != 1:
            raise DataError(str(self.path), None, None, f"delimiter must be one character, got {self.delimiter!r}")
        self.quoted = not tsv
        self.header = spec.header
        with open_binary(self.path) as f:
            first = f.readline()
            rows = not self.header or any(line.strip() for line in f)  # stops at the first row
        if not first.removeprefix(b"\xef\xbb\xbf").strip():
            raise DataError(str(self.path), None, None, "empty file (no header or rows)")
        if not rows:
            raise DataError(str(self.path), None, None, "empty file (a header but no rows)")
        # utf-8-sig drops a byte order mark (Excel writes one); pyarrow drops it from the data as well.
        line = first.decode("utf-8-sig", "replace").rstrip("\r\n")
        try:
            fields = next(csv.reader(io.StringIO(line), delimiter=self.delimiter,
                                     quoting=csv.QUOTE_MINIMAL if self.quoted else csv.QUOTE_NONE))
        except csv.Error as e:  # a NUL byte, a lone carriage return inside the line
            raise DataError(f"{self.path}:1", None, None,
                            f"cannot parse the first line ({e})") from e
        if self.header:
            if not self.quoted:  # a TSV header written by a CSV library may still quote its names
                fields = [f[1:-1] if len(f) > 1 and f[0] == f[-1] == '"' else f for f in fields]
            self.columns = fields
            if len(set(fields)) != len(fields):
                dup = next(c for c in fields if fields.count(c) > 1)
                raise DataError(f"{self.path}:1", dup, None, "column name appears twice in the header")
        elif spec.columns:
            if len(spec.columns) != len(fields):
                raise DataError(f"{self.path}:1", None, None, f"{len(fields)} fields, but [source] columns "
                                                              f"names {len(spec.columns)}")
            self.columns = list(spec.columns)
        else:
            self.columns = [f"c{i}" for i in range(len(fields))]
        self.size = self.path.stat().st_size

    def _stream(self) -> tuple[pa.NativeFile, pa.NativeFile]:
        raw = pa.OSFile(str(self.path), "rb")
        magic = raw.read(2)
        raw.seek(0)
        stream = pa.CompressedInputStream(raw, "gzip") if magic == b"\x1f\x8b" else raw
        return raw, stream

    def chunks(self, columns: list[str], file_index: int = 0) -> Iterator[RawChunk]:
        self.require(columns)
        invalid: list[int] = []  # line numbers of rows pyarrow rejected (wrong field count), ascending
        pending: list[tuple[int, BadRow]] = []  # those rows, until the chunk they fall in is yielded

        def on_invalid(row: pcsv.InvalidRow) -> str:
            line = int(row.number) if row.number is not None else -1
            invalid.append(line)
            pending.append((line, BadRow(f"{self.path}:{line}", None, row.text,
                                         f"{row.actual_columns} fields, expected {row.expected_columns}")))
            return "skip"

        raw, stream = self._stream()
        first_line = 2 if self.header else 1
        done = 0  # data rows yielded so far
        buffered: list[pa.RecordBatch] = []
        have = 0
        # pyarrow decodes a rejected row's text before it calls on_invalid; text that is not UTF-8
        # fails there, and pyarrow prints that error as an "Exception ignored" traceback and stops
        # with a parse error. The hook keeps it off the console, so that the parse error below can
        # say what it is.
        undecodable: list[BaseException | None] = []
        hook = sys.unraisablehook
        sys.unraisablehook = lambda u: (undecodable.append(u.exc_value)
                                        if isinstance(u.exc_value, UnicodeError) else hook(u))
        try:
            reader = self._open(stream, columns, on_invalid)  # reads the first block already
            for batch in reader:
                buffered.append(batch)
                have += batch.num_rows
                self.progress = raw.tell()
                while have >= self.chunk_rows:
                    chunk, buffered, have = _take(buffered, self.chunk_rows)
                    yield self._chunk(chunk, done, first_line, invalid, pending, file_index)
                    done += chunk.num_rows
            if have:
                chunk, buffered, have = _take(buffered, have)
                yield self._chunk(chunk, done, first_line, invalid, pending, file_index)
            report_in_order(self.log, pending, [])  # rejected rows after the last good one
            pending.clear()
        except pa.ArrowInvalid as e:
            if "invalid UTF8" in str(e) or undecodable:
                line = first_invalid_utf8_line(self.path)
                raise DataError(f"{self.path}:{line}" if line else str(self.path), None, None,
                                "not UTF-8 text (save the file as UTF-8)") from e
            raise DataError(str(self.path), None, None, f"cannot parse ({e})") from e
        except OSError as e:  # pyarrow's "Truncated compressed stream" and other read errors
            raise DataError(str(self.path), None, None, f"cannot read it after {first_line + done - 1} lines: "
                                                        f"corrupt or truncated ({e})") from e
        finally:
            sys.unraisablehook = hook
            raw.close()
        self.progress = self.size

    def _open(self, stream: pa.NativeFile, columns: list[str], on_invalid: Callable[[pcsv.InvalidRow], str]
              ) -> pcsv.CSVStreamingReader:
        return pcsv.open_csv(
            stream,
            read_options=pcsv.ReadOptions(
                use_threads=False, block_size=BLOCK_BYTES, column_names=self.columns,
                skip_rows=1 if self.header else 0,
            ),
            parse_options=pcsv.ParseOptions(
                delimiter=self.delimiter, quote_char='"' if self.quoted else False, invalid_row_handler=on_invalid,
            ),
            convert_options=pcsv.ConvertOptions(
                include_columns=columns, column_types={c: pa.string() for c in columns},
                strings_can_be_null=True, quoted_strings_can_be_null=False,
            ),
        )

    def _chunk(self, table: pa.Table, done: int, first_line: int, invalid: list[int],
               pending: list[tuple[int, BadRow]], file_index: int) -> RawChunk:
        # Row k (0-based, counting only accepted rows) sits on line first_line + k, pushed down by every
        # rejected line at or above it: shift by the number of j with invalid[j] - j <= that base line.
        base = first_line + done + np.arange(table.num_rows, dtype=np.int64)
        inv = np.asarray(invalid, dtype=np.int64)
        lines = base + np.searchsorted(inv - np.arange(len(inv)), base, side="right")
        # The rejected rows up to this chunk's last line go with it, to be reported in line order with its
        # bad values (pyarrow may have parsed further ahead: later ones wait for their chunk).
        last = int(lines[-1])
        k = next((j for j, (line, _) in enumerate(pending) if line > last), len(pending))
        rejected = pending[:k]
        del pending[:k]
        return RawChunk(table, str(self.path), lines, "line", file_index, first_line, rejected)


def _take(batches: list[pa.RecordBatch], n: int) -> tuple[pa.Table, list[pa.RecordBatch], int]:
    """First n rows of the buffered batches as a table, and the rest."""
    table = pa.Table.from_batches(batches)
    rest = table.slice(n)
    return table.slice(0, n), rest.to_batches(), rest.num_rows
