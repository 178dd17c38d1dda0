"""libFM / libSVM (``label idx:val idx:val ...``) and field-aware libFFM (``label field:idx:val ...``) input.

Tokens are separated by any whitespace; blank lines are skipped (line numbers in messages are the file's
lines, blank ones counted). An index or field number beyond int64 is a bad row. How indices become features
(``[source]`` of the schema):

* ``fields = ["user", "item", ...]`` (libFM): the i-th pair of every row belongs to the i-th field, so every
  row must have exactly that many pairs (the layout of Frappe and MovieLens as packaged for FM/NFM). Each
  field is a single-valued integer column, its values the column ``<field>#value``.
* ``field_ranges = { user = [0, 957], ... }`` (libFM): a pair belongs to the field whose [start, end)
  holds its index, and the field's id is ``idx - start``; an index in no range is a bad row.
* libFFM files name the field in each token; ``fields`` then names field numbers 0, 1, ... (default
  ``f0, f1, ...`` up to the largest field number in the first MiB).
* neither: all pairs form one multi-hot column ``features``.

In the last three cases a field is a list column (zero or more indices per row) with a parallel list of
values ``<field>#value``. The label column is ``label``. Parsing is vectorised per block; a block with a
malformed line is re-parsed line by line, which names the line and the problem.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recstack.data.prepare.readers.base import (
    GZIP_ERRORS,
    BadRow,
    BadRowLog,
    DataError,
    RawChunk,
    Source,
    open_binary,
    report_in_order,
)
from recstack.data.prepare.schema import SourceSpec

BLOCK_BYTES = 4 << 20
VALUE_SUFFIX = "#value"
INDEX_MAX = 2**63 - 1  # indices (and field numbers) are stored as int64


class _LineError(Exception):
    pass


def _numbers(buf: bytes, starts: np.ndarray, ends: np.ndarray, tp: pa.DataType) -> np.ndarray:
    """The numbers written in buf[starts[i]:ends[i]] -> numpy [m]; _LineError if any is not one.

    Offsets [s0, e0, s1, e1, ...] make an Arrow string array whose even entries are the wanted slices
    (the odd ones are the bytes between them), so no Python object is made per value."""
    m = len(starts)
    if m == 0:
        return np.zeros(0, tp.to_pandas_dtype())
    off = np.empty(2 * m, np.int64)
    off[0::2], off[1::2] = starts, ends
    arr = pa.LargeStringArray.from_buffers(2 * m - 1, pa.py_buffer(off), pa.py_buffer(buf))
    try:
        out = pc.cast(arr.take(pa.array(np.arange(0, 2 * m, 2))), tp)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise _LineError from None
    return out.to_numpy(zero_copy_only=False)


def _read(f: BinaryIO, path: Path, lines: int | None, size: int) -> bytes:
    """``f.read(size)``; a gzip stream that is corrupt or ends early is a DataError naming the file and the
    number of whole lines read before it (``lines``; None: in the first read, where none are counted yet)."""
    try:
        return f.read(size)
    except GZIP_ERRORS as e:
        where = f" after line {lines}" if lines is not None else f" in its first {size >> 20} MiB"
        raise DataError(str(path), None, None, f"corrupt or truncated gzip data{where} ({e})") from e


class LibfmSource(Source):
    size_unit = "B"

    def __init__(self, path: str | Path, chunk_rows: int, log: BadRowLog, spec: SourceSpec) -> None:
        super().__init__(path, chunk_rows, log)
        self.size = self.path.stat().st_size
        with open_binary(self.path) as f:
            head = _read(f, self.path, None, 1 << 20)
        data_lines = [ln.split() for ln in head.split(b"\n")[:-1] or [head]]
        sample = [t for t in data_lines if t]
        if not sample:
            raise DataError(str(self.path), None, None, "empty file (no rows)")
        first_token = next((t[1] for t in sample if len(t) > 1), b"0:1")
        self.parts = first_token.count(b":") + 1  # 2: idx:val, 3: field:idx:val
        if self.parts not in (2, 3):
            raise DataError(f"{self.path}:1", None, first_token.decode("utf-8", "replace"),
                            "expected idx:val or field:idx:val pairs")
        self.ranges: np.ndarray | None = None  # [F, 2] start, end
        if self.parts == 3:
            self.mode = "ffm"
            if spec.fields:
                self.fields = list(spec.fields)
            else:
                top = max((int(tok.split(b":")[0]) for t in sample for tok in t[1:] if tok.split(b":")[0].isdigit()),
                          default=0)
                self.fields = [f"f{i}" for i in range(top + 1)]
        elif spec.fields:
            self.mode, self.fields = "position", list(spec.fields)
        elif spec.field_ranges:
            self.mode = "ranges"
            order = sorted(spec.field_ranges.items(), key=lambda kv: kv[1][0])
            self.fields = [k for k, _ in order]
            self.ranges = np.array([v for _, v in order], dtype=np.int64)
            if (self.ranges[1:, 0] < self.ranges[:-1, 1]).any():
                raise DataError(str(self.path), None, None, "field_ranges overlap")
        else:
            self.mode, self.fields = "single", ["features"]
        self.columns = ["label", *self.fields, *(f + VALUE_SUFFIX for f in self.fields)]

    # ------------------------------------------------------------------------------------------ reading
    def _blocks(self) -> Iterator[bytes]:
        """Blocks of whole lines, each ending in a newline (one is added to an unterminated last line)."""
        tail = b""
        lines = 0  # whole lines read so far: where a truncated gzip file ends
        with open_binary(self.path) as f:
            raw = getattr(f, "fileobj", f)  # the compressed file under a GzipFile: progress in file bytes
            while data := _read(f, self.path, lines, BLOCK_BYTES):
                self.progress = raw.tell()
                data = tail + data
                cut = data.rfind(b"\n") + 1
                tail = data[cut:]
                if cut:
                    lines += data.count(b"\n", 0, cut)
                    yield data[:cut]
        if tail:
            yield tail + b"\n"

    def chunks(self, columns: list[str], file_index: int = 0) -> Iterator[RawChunk]:
        self.require(columns)
        line_no = 0  # lines before the current block
        for block in self._blocks():
            ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
            for lo in range(0, len(ends), self.chunk_rows):
                start = int(ends[lo - 1]) + 1 if lo else 0
                stop = int(ends[min(lo + self.chunk_rows, len(ends)) - 1]) + 1
                chunk = self._chunk(block[start:stop], line_no + lo + 1, file_index)
                if chunk is not None:
                    yield chunk
            line_no += len(ends)
        self.progress = self.size

    def _chunk(self, buf: bytes, first_line: int, file_index: int) -> RawChunk | None:
        """buf: whole lines, each ending in a newline; first_line: the 1-based number of its first line."""
        rejected: list[tuple[int, BadRow]] = []  # the lines this reader drops, reported with the chunk
        try:
            labels, counts, fld, idx, val, line_nos = self._fast(buf, first_line)
        except _LineError:
            lines = buf.split(b"\n")[:-1]
            toks = [ln.split() for ln in lines]
            where = np.flatnonzero(np.fromiter((len(t) > 0 for t in toks), bool, len(toks)))
            labels, counts, fld, idx, val, line_nos = self._slow(
                [toks[i] for i in where], first_line + where.astype(np.int64), rejected)
        labels, counts, fld, idx, val, line_nos = self._assign_fields(
            labels, counts, fld, idx, val, line_nos, rejected)
        rejected.sort(key=lambda lb: lb[0])
        if not len(labels):
            report_in_order(self.log, rejected, [])
            return None
        cols: dict[str, pa.Array] = {"label": pa.array(labels, pa.float64())}
        n = len(labels)
        if self.mode == "position":
            k = len(self.fields)
            for j, name in enumerate(self.fields):
                cols[name] = pa.array(idx.reshape(n, k)[:, j])
                cols[name + VALUE_SUFFIX] = pa.array(val.reshape(n, k)[:, j])
        else:
            row = np.repeat(np.arange(n), counts)
            for j, name in enumerate(self.fields):
                m = fld == j
                offsets = np.zeros(n + 1, np.int64)
                np.cumsum(np.bincount(row[m], minlength=n), out=offsets[1:])
                off = pa.array(offsets)
                cols[name] = pa.LargeListArray.from_arrays(off, pa.array(idx[m]))
                cols[name + VALUE_SUFFIX] = pa.LargeListArray.from_arrays(off, pa.array(val[m]))
        return RawChunk(pa.table(cols), str(self.path), line_nos, "line", file_index, rejected=rejected)

    def _fast(self, buf: bytes, first_line: int) -> tuple[np.ndarray, ...]:
        """Every line of buf at once, on the raw bytes; raises _LineError on anything unexpected (the
        line-by-line path then names the line). -> labels, pairs per row, field, index, value, line numbers.

        Tokens are runs of non-whitespace; the first of a line is the label, the others must hold exactly
        ``parts - 1`` colons. Each part is cut out as an Arrow string (offsets into buf, no Python objects
        per token) and converted by Arrow's casts, which reject anything that is not a number."""
        a = np.frombuffer(buf, np.uint8)
        ws = (a == 32) | (a == 9) | (a == 10) | (a == 13)
        edge = np.diff(np.concatenate([[0], (~ws).view(np.int8), [0]]))
        tstart, tend = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)
        line = np.cumsum(a == 10, dtype=np.int32)[tstart]  # newlines before each token: its 0-based line
        first = np.ones(len(tstart), bool)
        first[1:] = line[1:] != line[:-1]
        is_colon = a == 58
        colon = np.flatnonzero(is_colon)
        before = np.concatenate([[0], np.cumsum(is_colon, dtype=np.int32)])
        ncolon = before[tend] - before[tstart]
        k = self.parts
        if (ncolon[first] != 0).any() or (ncolon[~first] != k - 1).any():
            raise _LineError
        cuts = colon.reshape(-1, k - 1)  # the colons of each pair, in order (labels have none)
        fs, fe = tstart[~first], tend[~first]
        labels = _numbers(buf, tstart[first], tend[first], pa.float64())
        val = _numbers(buf, cuts[:, -1] + 1, fe, pa.float32())
        idx = _numbers(buf, cuts[:, -2] + 1 if k == 3 else fs, cuts[:, -1], pa.int64())
        fld = _numbers(buf, fs, cuts[:, 0], pa.int64()) if k == 3 else np.zeros(len(idx), np.int64)
        if not (np.isfinite(labels).all() and np.isfinite(val).all() and (idx >= 0).all() and (fld >= 0).all()):
            raise _LineError
        lines = line[first]
        counts = np.diff(np.append(np.flatnonzero(first), len(first))) - 1
        return labels, counts, fld, idx, val, first_line + lines.astype(np.int64)

    def _slow(self, toks: list[list[bytes]], line_nos: np.ndarray, rejected: list[tuple[int, BadRow]]
              ) -> tuple[np.ndarray, ...]:
        """Line by line: bad lines are dropped and added to ``rejected``."""
        labels, counts, fld, idx, val, kept = [], [], [], [], [], []
        for t, line in zip(toks, line_nos.tolist(), strict=True):
            try:
                lab, f, i, v = self._parse_line(t)
            except _LineError as e:
                column, value, reason = e.args
                rejected.append((line, BadRow(f"{self.path}:{line}", column, value, reason)))
                continue
            labels.append(lab)
            counts.append(len(i))
            fld += f
            idx += i
            val += v
            kept.append(line)
        return (np.array(labels, np.float64), np.array(counts, np.int64), np.array(fld, np.int64),
                np.array(idx, np.int64), np.array(val, np.float32), np.array(kept, np.int64))

    def _parse_line(self, t: list[bytes]) -> tuple[float, list[int], list[int], list[float]]:
        try:
            lab = float(t[0])
        except ValueError:
            raise _LineError("label", t[0].decode("utf-8", "replace"), "label is not a number") from None
        if not np.isfinite(lab):
            raise _LineError("label", t[0].decode(), "label is not a finite number")
        f, i, v = [], [], []
        for pos, tok in enumerate(t[1:], 1):
            parts = tok.split(b":")
            text = tok.decode("utf-8", "replace")
            if len(parts) != self.parts:
                want = "field:idx:val" if self.parts == 3 else "idx:val"
                raise _LineError(None, text, f"token {pos} is not {want}")
            try:
                nums = [int(x) for x in parts[:-1]]
                value = float(parts[-1])
            except ValueError:
                raise _LineError(None, text, f"token {pos}: index not a non-negative integer or value not a "
                                             "number") from None
            if min(nums) < 0 or not np.isfinite(value):
                raise _LineError(None, text, f"token {pos}: negative index or non-finite value")
            if max(nums) > INDEX_MAX:
                raise _LineError(None, text, f"token {pos}: index larger than {INDEX_MAX} (2**63 - 1)")
            f.append(nums[0] if self.parts == 3 else 0)
            i.append(nums[-1])
            v.append(value)
        return lab, f, i, v

    def _assign_fields(
        self, labels: np.ndarray, counts: np.ndarray, fld: np.ndarray, idx: np.ndarray, val: np.ndarray,
        line_nos: np.ndarray, rejected: list[tuple[int, BadRow]],
    ) -> tuple[np.ndarray, ...]:
        """Map every pair to its field (by position, range or ffm field number); bad rows are dropped and
        added to ``rejected``."""
        n = len(labels)
        row = np.repeat(np.arange(n), counts)
        bad_rows = np.zeros(n, bool)
        bad_tok = np.zeros(len(idx), bool)
        shown, reason = idx, ""
        if self.mode == "position":
            bad_rows = counts != len(self.fields)
            for r in np.flatnonzero(bad_rows).tolist():
                rejected.append((int(line_nos[r]), BadRow(
                    f"{self.path}:{int(line_nos[r])}", None, None,
                    f"{int(counts[r])} idx:val pairs, expected {len(self.fields)} (one per field: "
                    f"{', '.join(self.fields)})",
                )))
        elif self.mode == "ranges":
            assert self.ranges is not None
            fld = np.searchsorted(self.ranges[:, 0], idx, side="right") - 1
            start_end = self.ranges[np.maximum(fld, 0)]
            bad_tok = (fld < 0) | (idx >= start_end[:, 1])
            idx = idx - start_end[:, 0]
            reason = "index is in no field of [source] field_ranges"
        elif self.mode == "ffm":
            bad_tok = fld >= len(self.fields)
            shown = fld
            reason = f"field number is not in [source] fields ({len(self.fields)} fields, numbered from 0)"
        for t in np.flatnonzero(bad_tok).tolist():
            r = int(row[t])
            if not bad_rows[r]:
                bad_rows[r] = True
                rejected.append((int(line_nos[r]), BadRow(f"{self.path}:{int(line_nos[r])}", None, int(shown[t]),
                                                          reason)))
        if bad_rows.any():
            keep_tok, keep = ~bad_rows[row], ~bad_rows
            return labels[keep], counts[keep], fld[keep_tok], idx[keep_tok], val[keep_tok], line_nos[keep]
        return labels, counts, fld, idx, val, line_nos
