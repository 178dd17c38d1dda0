"""What a prepared set's values must be before a model trains or is evaluated on them, and the set's identity.

:func:`check_values` scans the arrays once, in chunks of at most ``chunk_bytes`` (vectorised numpy over the
memory map: bounded memory for a set of any size; about as fast as the pages can be read): labels are 0 or 1
(the prepared format stores labels after the schema's threshold), dense inputs and bag weights are finite, and
every multi-hot feature's offsets are non-decreasing and inside its values array. Each error names the array
file and the first bad row. (What opening checks, cheaply, is in ``PreparedDataset``: meta.json's keys, the
dtypes and sizes of the arrays, ``num_rows`` against their lengths; ids against their tables are checked on
every batch as it is read.)

:func:`fingerprint` is the set's identity for a checkpoint and for the ranks of a job: its row count and a
SHA-256 of ``meta.json`` and of the first and last 64 KiB of every array file. It reads little, and it changes
when the set is prepared again from other rows, re-generated with other options, or appended to; a change that
keeps meta.json and both ends of every array (a byte edited in the middle) is not seen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import numpy as np

from recstack.data.format import PreparedFormatError
from recstack.data.prepared_dataset import PreparedDataset

_EDGE_BYTES = 1 << 16  # of each array file, at each end, in the fingerprint
CHUNK_BYTES = 16 << 20  # of one array read at a time by check_values


def check_values(ds: PreparedDataset, rows: tuple[int, int] | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Scan rows [lo, hi) of ``ds`` (default all) -> None, or PreparedFormatError naming the array file and the
    first bad row (0-based, as ``recstack data inspect`` and the batch checks count them)."""
    lo, hi = rows if rows is not None else (0, len(ds))
    _scan(ds, "labels", lo, hi, chunk_bytes, _bad_label, "label {value!r}, expected 0 or 1")
    if ds.dense_features:
        _scan(ds, "dense", lo, hi, chunk_bytes, _not_finite,
              "dense feature {column}: {value!r} (inputs must be finite)")
    for s in ds.sparse_features:
        if not s.multi_hot:
            continue
        offsets = ds.arrays[f"{s.name}.offsets"]
        _check_offsets(ds, s.name, offsets, lo, hi, chunk_bytes)
        if s.weighted:
            start, end = int(offsets[lo]), int(offsets[hi])
            _scan(ds, f"{s.name}.weights", start, end, chunk_bytes, _not_finite,
                  "weight {value!r} (weights must be finite)", offsets=offsets)


def _bad_label(x: np.ndarray) -> np.ndarray:
    return (x != 0) & (x != 1)  # NaN is neither


def _not_finite(x: np.ndarray) -> np.ndarray:
    return ~np.isfinite(x)


def _scan(ds: PreparedDataset, name: str, lo: int, hi: int, chunk_bytes: int,
          bad_of: Callable[[np.ndarray], np.ndarray], what: str,
          offsets: np.ndarray | None = None) -> None:
    """Entries [lo, hi) of array ``name`` chunk by chunk; the first where ``bad_of`` is true is an error. With
    ``offsets`` the entries are a multi-hot feature's values positions, reported by the row whose bag holds them."""
    arr = ds.arrays[name]
    per_row = max(arr.itemsize * (arr.shape[1] if arr.ndim == 2 else 1), 1)
    step = max(chunk_bytes // per_row, 1)
    for start in range(lo, hi, step):
        chunk = np.asarray(arr[start : min(start + step, hi)])
        bad = bad_of(chunk)
        if bad.any():
            first = np.argwhere(bad)[0]
            pos = start + int(first[0])
            row = pos if offsets is None else int(np.searchsorted(offsets, pos, side="right")) - 1
            column = repr(ds.dense_features[int(first[1])]) if chunk.ndim == 2 else ""
            _fail(ds, name, row, what.format(value=float(chunk[tuple(first)]), column=column))


def _check_offsets(ds: PreparedDataset, feature: str, offsets: np.ndarray, lo: int, hi: int,
                   chunk_bytes: int) -> None:
    """Bag boundaries of rows [lo, hi): non-decreasing and within [0, len(values)] (opening checked the ends)."""
    name, nnz = f"{feature}.offsets", len(ds.arrays[f"{feature}.values"])
    step = max(chunk_bytes // offsets.itemsize, 2)
    for start in range(lo, hi, step - 1):  # chunks overlap by one entry: every row's two bounds in one chunk
        chunk = np.asarray(offsets[start : min(start + step, hi + 1)], dtype=np.int64)
        outside = (chunk < 0) | (chunk > nnz)
        if outside.any():
            r = start + int(np.argmax(outside))
            _fail(ds, name, r, f"offset {int(chunk[r - start])} is outside the {nnz} values of "
                               f"{feature!r} (a damaged file?)")
        down = np.diff(chunk) < 0
        if down.any():
            r = start + int(np.argmax(down))
            _fail(ds, name, r, f"offsets of {feature!r} decrease ({int(chunk[r - start])} then "
                               f"{int(chunk[r - start + 1])}): a bag cannot end before it starts (a damaged file?)")


def _fail(ds: PreparedDataset, array: str, row: int, what: str) -> NoReturn:
    file = ds.path / ds.meta["arrays"][array]["file"]
    raise PreparedFormatError(f"{file}: row {row}: {what}")


def fingerprint(ds: PreparedDataset) -> str:
    """``rows=N, sha256=<16 hex digits>``: see the module docstring for what it covers."""
    path = Path(ds.path)
    h = hashlib.sha256((path / "meta.json").read_bytes())
    for spec in ds.meta["arrays"].values():  # in meta.json's order (opening has checked every entry)
        file = path / spec["file"]
        size = file.stat().st_size
        with open(file, "rb") as f:
            h.update(f.read(_EDGE_BYTES))
            if size > _EDGE_BYTES:
                f.seek(max(size - _EDGE_BYTES, _EDGE_BYTES))
                h.update(f.read(_EDGE_BYTES))
    return f"rows={len(ds)}, sha256={h.hexdigest()[:16]}"
