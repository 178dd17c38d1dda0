"""Schema-driven readers: Parquet, CSV/TSV and libFM/libSVM/libFFM files as chunks of Arrow tables."""

from __future__ import annotations

from pathlib import Path

from recstack.data.prepare.readers.base import BadRow, BadRowLog, DataError, RawChunk, Source, is_data_file
from recstack.data.prepare.readers.csv import CsvSource
from recstack.data.prepare.readers.libfm import VALUE_SUFFIX, LibfmSource
from recstack.data.prepare.readers.parquet import ParquetSource, parquet_files
from recstack.data.prepare.schema import SourceSpec, detect_format


def expand_inputs(paths: list[str | Path], spec: SourceSpec | None = None) -> list[Path]:
    """Files to read in order: a directory of Parquet parts becomes its files; other directories their data
    files (``is_data_file``: no hidden, temporary or documentation files) in name order."""
    out: list[Path] = []
    for name in paths:
        p = Path(name)
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such file or directory")
        if p.is_dir():
            if detect_format(p, spec) == "parquet":
                out += parquet_files(p)
            else:
                out += sorted(q for q in p.iterdir() if is_data_file(q))
        else:
            out.append(p)
    return out


def open_source(path: str | Path, spec: SourceSpec, chunk_rows: int = 65536, log: BadRowLog | None = None) -> Source:
    """The reader for ``path``'s format (``spec.format``, else the file name)."""
    log = log or BadRowLog()
    fmt = detect_format(path, spec)
    if fmt == "parquet":
        return ParquetSource(path, chunk_rows, log)
    if fmt in ("csv", "tsv"):
        return CsvSource(path, chunk_rows, log, spec, tsv=fmt == "tsv")
    return LibfmSource(path, chunk_rows, log, spec)


__all__ = [
    "VALUE_SUFFIX", "BadRow", "BadRowLog", "CsvSource", "DataError", "LibfmSource", "ParquetSource", "RawChunk",
    "Source", "expand_inputs", "open_source",
]
