"""Backing stores of cached embedding tables: every row of a table, outside the compute buffer.

A table is stored as records of ``width`` float32 values, one per row: the D weights followed, with row-wise
Adagrad, by the row's accumulator, so an optimizer state always travels with its row (fetched, evicted and
checkpointed together). The same layout, in row order, is the checkpoint file format: saving streams a table's
records in chunks, restoring an SSD table is a file copy.

- ``HostStore``: records in a host-memory tensor [N, width] (pinned when the compute device is a GPU).
- ``SSDStore``: records in a log-structured file on disk. The file starts as the table in row order; a write
  appends its records at the end in one sequential ``pwrite`` and points the rows' entries of an in-memory
  location index (4 bytes per row; 8 past 700M rows) at them; a read follows the index, one ``pread`` per run
  of consecutive records. Rewriting rows in place would dirty a whole page (or a large folio) per 256-byte row
  and have the kernel write all of it back; appending writes each row once. When the appended records reach the
  table's size the file is rewritten in row order (sequential reads and writes), so it never exceeds twice the
  table.
  Nothing is memory-mapped, so the process's resident memory does not grow with the table (the kernel's page
  cache may keep the file's pages: that memory is the kernel's, reclaimable, not the process's).
  The file is created unlinked (a temporary file that has no name), so it vanishes when the process ends,
  however it ends: what it held at a crash can never be read by a later run, which restores the table from its
  last checkpoint instead.
"""

from __future__ import annotations

import abc
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch

from recstack.embedding.collection import TableConfig, init_row_chunks
from recstack.io import open_synced, writing

CHUNK_BYTES = 64 << 20  # streaming granularity for init, save and load
PARALLEL_READ_MIN_RUNS = 256  # reads of fewer runs of records per thread stay on the calling thread


def record_width(dim: int, with_accumulator: bool) -> int:
    return dim + (1 if with_accumulator else 0)


def init_chunks(
    table: TableConfig, seed: int, index: int, width: int, acc_init: float, chunk_rows: int
) -> Iterator[torch.Tensor]:
    """Initial records of a table, ``chunk_rows`` at a time: [n, width] float32 per chunk.

    The weights are bit-identical to ``init_table`` (``init_row_chunks``), without ever holding the whole table.
    """
    for w in init_row_chunks(table, seed, index, chunk_rows):
        yield w if width == table.embedding_dim else torch.cat([w, torch.full((w.shape[0], 1), acc_init)], 1)


def init_chunks_of(weights: torch.Tensor, width: int, acc_init: float, chunk_rows: int) -> Iterator[torch.Tensor]:
    """Records of given initial weights [N, D], ``chunk_rows`` at a time ([n, width] per chunk)."""
    d = weights.shape[1]
    for r0 in range(0, weights.shape[0], chunk_rows):
        w = weights[r0 : r0 + chunk_rows]
        yield w if width == d else torch.cat([w, torch.full((w.shape[0], 1), acc_init)], 1)


def _chunk_rows(width: int) -> int:
    return max(1, CHUNK_BYTES // (4 * width))


def check_table_file(path: Path, rows: int, width: int) -> None:
    """A checkpoint table file must hold exactly ``rows`` records of ``width`` float32."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: table file missing from the checkpoint")
    size, want = path.stat().st_size, rows * width * 4
    if size != want:
        raise ValueError(f"{path}: {size} bytes, expected {want} ({rows} rows x {width} float32)")


def copy_file_range_all(src_fd: int, dst_fd: int, nbytes: int) -> None:
    """Copy ``nbytes`` from the start of ``src_fd`` to the start of ``dst_fd`` inside the kernel (a reflink on
    file systems that support one), falling back to a buffered copy; never through a table-sized buffer."""
    done = 0
    try:
        while done < nbytes:
            n = os.copy_file_range(src_fd, dst_fd, nbytes - done, done, done)
            if n == 0:
                raise OSError(f"copy_file_range stopped at byte {done} of {nbytes}")
            done += n
        return
    except (AttributeError, OSError):  # old kernel, cross-device, unsupported file system: copy by hand
        pass
    while done < nbytes:
        buf = os.pread(src_fd, min(CHUNK_BYTES, nbytes - done), done)
        if not buf:
            raise OSError(f"short read at byte {done} of {nbytes}")
        done += os.pwrite(dst_fd, buf, done)


class RowStore(abc.ABC):
    """All ``num_rows`` records [N, width] of one table."""

    def __init__(self, num_rows: int, width: int) -> None:
        self.num_rows, self.width = num_rows, width

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.width * 4

    @abc.abstractmethod
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [U] int64 -> records [U, width] float32 (a CPU copy)."""

    @abc.abstractmethod
    def write(self, ids: torch.Tensor, records: torch.Tensor) -> None:
        """ids [U] int64 (distinct), records [U, width] float32 -> stored."""

    @abc.abstractmethod
    def fill(self, chunks: Iterator[torch.Tensor]) -> None:
        """Write all records in row order from chunks [n, width]."""

    @abc.abstractmethod
    def save(self, path: Path) -> None:
        """Write all records to a new file ``path`` (raw float32, row order) and fsync it."""

    @abc.abstractmethod
    def load(self, path: Path) -> None:
        """Replace all records with those of a file written by ``save``."""

    def close(self) -> None:  # noqa: B027 - stores without OS resources need nothing
        """Release the store's file, if it has one."""


class HostStore(RowStore):
    """Records in host memory: a [N, width] float32 tensor."""

    def __init__(self, num_rows: int, width: int, pin_memory: bool = False) -> None:
        super().__init__(num_rows, width)
        self.data = torch.empty(num_rows, width, pin_memory=pin_memory)  # pinned: faster copies to a GPU

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        return self.data.index_select(0, ids)

    def write(self, ids: torch.Tensor, records: torch.Tensor) -> None:
        self.data[ids] = records  # ids are distinct; much cheaper than index_copy_ on a large tensor

    def fill(self, chunks: Iterator[torch.Tensor]) -> None:
        r = 0
        for c in chunks:
            self.data[r : r + c.shape[0]] = c
            r += c.shape[0]

    def save(self, path: Path) -> None:
        step = _chunk_rows(self.width)
        with open_synced(path) as f:
            for r in range(0, self.num_rows, step):
                f.write(self.data[r : r + step].numpy().data)

    def load(self, path: Path) -> None:
        check_table_file(path, self.num_rows, self.width)
        step = _chunk_rows(self.width)
        with open(path, "rb") as f:
            for r in range(0, self.num_rows, step):
                view = self.data[r : r + step].numpy().data.cast("B")
                if f.readinto(view) != len(view):
                    raise ValueError(f"{path}: truncated at row {r}")


class SSDStore(RowStore):
    """Records in an unlinked, log-structured file under ``directory`` (see the module doc).

    ``location`` [N] is the record index of each row's newest copy in the file; records ``[N, end)``
    are the appended ones. ``compact_ratio``: rewrite the file once ``end - N`` exceeds this many
    tables. Large reads are split over ``io_threads`` threads (0 = one per CPU, at most 8).
    ``name``: the table's, for error messages.

    Each new file has the table's bytes allocated at once (``posix_fallocate``), so a disk without
    room for the table stops the store where it is made; a write that the disk cannot take later
    (the appended records grow the file) is a DiskError naming the directory and the table, like any
    other disk fault.
    """

    def __init__(
        self, num_rows: int, width: int, directory: str | Path, compact_ratio: float = 1.0,
        io_threads: int = 0, name: str = "",
    ) -> None:
        super().__init__(num_rows, width)
        self.io_threads = io_threads or min(8, os.cpu_count() or 1)
        self.directory = Path(directory)
        table = f" (the file of ssd-cached table {name!r})" if name else ""
        self.where = f"{self.directory}{table}"  # what a disk fault names
        self.directory.mkdir(parents=True, exist_ok=True)
        self.compact_ratio = compact_ratio
        self.compactions = 0
        # int32 while every record index fits (a file of at most 2 + compact_ratio tables), else int64
        max_records = int(num_rows * (2 + compact_ratio)) + 1
        self._loc_dtype = torch.int32 if max_records < 2**31 else torch.int64
        self._file: BinaryIO | None = None
        self._reset(self._new_file())

    @property
    def rb(self) -> int:
        return 4 * self.width  # bytes per record

    @property
    def _fd(self) -> int:
        assert self._file is not None, "the store is closed"
        return self._file.fileno()

    def _new_file(self) -> BinaryIO:
        """An unlinked file with the table's bytes allocated."""
        with writing(self.where):
            f = tempfile.TemporaryFile(dir=self.directory, prefix="recstack-table-")
            try:
                if self.nbytes:
                    os.posix_fallocate(f.fileno(), 0, self.nbytes)
            except BaseException:
                f.close()
                raise
        return f

    def _reset(self, new_file: BinaryIO) -> None:
        """Make ``new_file`` (holding the table in row order) the store's file."""
        self.close()
        self._file = new_file
        self.location = torch.arange(self.num_rows, dtype=self._loc_dtype)
        self.end = self.num_rows

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.numel()
        out = torch.empty(n, self.width)
        if n == 0:
            return out
        loc = self.location[ids].to(torch.int64)
        loc, order = torch.sort(loc)
        buf = torch.empty(n, self.width)
        view = buf.numpy().data.cast("B")
        rb, fd = self.rb, self._fd
        runs = _runs(loc)

        def read_runs(part: list[tuple[int, int, int]]) -> None:
            for a, b, first in part:
                _pread_all(fd, view[a * rb : b * rb], first * rb)

        k = min(self.io_threads, len(runs) // PARALLEL_READ_MIN_RUNS)
        if k > 1:  # several reads in flight: an SSD serves them in parallel, the page cache on several cores
            list(_io_pool(self.io_threads).map(read_runs, [runs[i::k] for i in range(k)]))
        else:
            read_runs(runs)
        out[order] = buf
        return out

    def write(self, ids: torch.Tensor, records: torch.Tensor) -> None:
        n = ids.numel()
        if n == 0:
            return
        with writing(self.where):
            _pwrite_all(self._fd, records.contiguous().numpy().data.cast("B"), self.end * self.rb)
        self.location[ids] = torch.arange(self.end, self.end + n, dtype=self._loc_dtype)
        self.end += n
        if self.end - self.num_rows > self.compact_ratio * self.num_rows:
            self.compact()

    def _chunks(self) -> Iterator[torch.Tensor]:
        """All records in row order, CHUNK_BYTES at a time: [n, width] per chunk."""
        step = _chunk_rows(self.width)
        for r0 in range(0, self.num_rows, step):
            yield self.read(torch.arange(r0, min(r0 + step, self.num_rows)))

    def compact(self) -> None:
        """Rewrite the file in row order, dropping the superseded records (sequential I/O)."""
        new = self._new_file()
        off = 0
        with writing(self.where):
            for c in self._chunks():
                _pwrite_all(new.fileno(), c.numpy().data.cast("B"), off)
                off += c.numel() * 4
        self._reset(new)
        self.compactions += 1

    def fill(self, chunks: Iterator[torch.Tensor]) -> None:
        off = 0
        with writing(self.where):
            for c in chunks:
                buf = c.contiguous().numpy().data.cast("B")
                _pwrite_all(self._fd, buf, off)
                off += len(buf)
        self.location = torch.arange(self.num_rows, dtype=self._loc_dtype)
        self.end = self.num_rows

    def save(self, path: Path) -> None:
        with open_synced(path) as f:
            if self.end == self.num_rows and bool((self.location == torch.arange(self.num_rows)).all()):
                copy_file_range_all(self._fd, f.fileno(), self.nbytes)  # still in row order
            else:
                for c in self._chunks():
                    f.write(c.numpy().data.cast("B"))

    def load(self, path: Path) -> None:
        check_table_file(path, self.num_rows, self.width)
        new = self._new_file()
        with open(path, "rb") as f:
            copy_file_range_all(f.fileno(), new.fileno(), self.nbytes)
        self._reset(new)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _io_pool(threads: int) -> ThreadPoolExecutor:
    """A shared pool per size; its threads spend their time in pread, which releases the GIL."""
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="table-io")
    return _POOLS[threads]


def _runs(sorted_records: torch.Tensor) -> list[tuple[int, int, int]]:
    """Sorted record indices [n] -> (start, end, first record) of each run of consecutive records."""
    n = sorted_records.numel()
    breaks = (sorted_records[1:] != sorted_records[:-1] + 1).nonzero().squeeze(1) + 1
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], n]
    return list(zip(starts, ends, sorted_records[starts].tolist(), strict=True))


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise OSError(f"unexpected end of the table file at byte {offset}")
        buf, offset = buf[n:], offset + n


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n
