"""Parquet input, streamed one record batch at a time (never more than one row group is decoded).

Columns keep their Parquet types: numbers, strings, booleans, timestamps, and list columns (a multi-hot
feature needs no separator when it is stored as a list). A directory is read as its ``*.parquet`` files in
name order (a warehouse export is usually a directory of parts).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recstack.data.prepare.readers.base import BadRowLog, DataError, RawChunk, Source, is_data_file


class ParquetSource(Source):
    size_unit = "rows"

    def __init__(self, path: str | Path, chunk_rows: int, log: BadRowLog) -> None:
        super().__init__(path, chunk_rows, log)
        try:
            self.file = pq.ParquetFile(self.path, pre_buffer=False)  # pre-buffering keeps read data cached
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(str(self.path), None, None, f"not a readable Parquet file ({e})") from e
        self.columns = list(self.file.schema_arrow.names)
        self.size = self.file.metadata.num_rows
        self.max_row_group = max(
            (self.file.metadata.row_group(i).num_rows for i in range(self.file.num_row_groups)), default=0
        )

    def column_type(self, name: str) -> pa.DataType:
        return self.file.schema_arrow.field(name).type

    def chunks(self, columns: list[str], file_index: int = 0) -> Iterator[RawChunk]:
        self.require(columns)
        first = 0
        try:
            for batch in self.file.iter_batches(batch_size=self.chunk_rows, columns=columns, use_threads=False):
                n = batch.num_rows
                self.progress += n
                yield RawChunk(pa.Table.from_batches([batch]), str(self.path),
                               np.arange(first + 1, first + n + 1, dtype=np.int64), "row", file_index)
                first += n
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{self.path} row {first + 1}", None, None, f"cannot decode the file ({e})") from e


def parquet_files(path: Path) -> list[Path]:
    """A file, or a directory's ``*.parquet`` / ``*.pq`` files in name order."""
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".parquet", ".pq") and is_data_file(p))
    if not files:
        raise FileNotFoundError(f"{path}: directory has no .parquet files")
    return files
