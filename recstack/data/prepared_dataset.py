"""Reading a prepared data set: :class:`PreparedDataset` checks a directory's meta.json against its array
files on opening and then serves rows from the memory maps as :class:`~recstack.data.batch.Batch` es;
:func:`layout_difference` compares what a model needs of two sets (the layout is described in
:mod:`recstack.data.format`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from recstack.data.batch import Batch, SparseFeatures
from recstack.data.format import (
    CORE_DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    JAGGED_DTYPES,
    RAW_ID_DTYPE,
    PreparedFormatError,
    SparseFeatureSpec,
    check_sparse_specs,
)
from recstack.io import read_json

# meta.json keys every prepared set has, and the JSON type of each
_REQUIRED = {"num_rows": int, "dense_features": list, "sparse_features": list, "arrays": dict}


def _count_difference(kind: str, a: list[str], b: list[str]) -> str:
    """"3 vs 2 dense features, the first that differs is #3: 'x' vs none"."""
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    x, y = (repr(n[i]) if i < len(n) else "none" for n in (a, b))
    return f"{len(a)} vs {len(b)} {kind} features, the first that differs is #{i + 1}: {x} vs {y}"


_LAYOUT_FIELDS = (("name", "name"), ("table", "table_name"), ("table size", "num_embeddings"),
                  ("multi_hot", "multi_hot"), ("pooling", "pooling"), ("weighted", "weighted"))


def layout_difference(a: PreparedDataset, b: PreparedDataset) -> str | None:
    """The first difference between what a model needs of two prepared sets (dense features, and each
    sparse feature's name, table, table size and kind), as "... X vs Y" text, or None when they agree."""
    if a.dense_features != b.dense_features:
        return _count_difference("dense", a.dense_features, b.dense_features)
    sa, sb = a.sparse_features, b.sparse_features
    if len(sa) != len(sb):
        return _count_difference("sparse", [s.name for s in sa], [s.name for s in sb])
    for i, (x, y) in enumerate(zip(sa, sb, strict=True)):
        for what, attr in _LAYOUT_FIELDS:
            if getattr(x, attr) != getattr(y, attr):
                return f"sparse feature #{i + 1} ({x.name!r}): {what} {getattr(x, attr)!r} vs {getattr(y, attr)!r}"
    return None


class PreparedDataset:
    """Read-only view of a prepared directory; rows are memory-mapped, never loaded whole."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise PreparedFormatError(f"{self.path}: not a prepared data set (no meta.json)")
        self.meta = read_json(meta_file, PreparedFormatError)
        if not isinstance(self.meta, dict):
            raise PreparedFormatError(f"{meta_file}: holds a JSON {type(self.meta).__name__}, expected an object")
        if self.meta.get("format") != FORMAT_NAME or self.meta.get("version") != FORMAT_VERSION:
            raise PreparedFormatError(
                f"{meta_file}: format {self.meta.get('format')!r} version {self.meta.get('version')!r}, "
                f"expected {FORMAT_NAME!r} version {FORMAT_VERSION}"
            )
        for key, kind in _REQUIRED.items():
            if not isinstance(self.meta.get(key), kind) or isinstance(self.meta.get(key), bool):
                have = "missing" if key not in self.meta else f"a {type(self.meta[key]).__name__}"
                raise PreparedFormatError(f"{meta_file}: key {key!r} is {have}, expected a JSON "
                                          f"{ {int: 'integer', list: 'list', dict: 'object'}[kind]}")
        self.num_rows = int(self.meta["num_rows"])
        if self.num_rows < 0:
            raise PreparedFormatError(f"{meta_file}: num_rows is {self.num_rows}, must be >= 0")
        self.dense_features: list[str] = list(self.meta["dense_features"])
        try:
            self.sparse_features = [SparseFeatureSpec.from_meta(s) for s in self.meta["sparse_features"]]
            check_sparse_specs(self.sparse_features)
        except (KeyError, TypeError, ValueError) as e:
            raise PreparedFormatError(f"{meta_file}: bad sparse_features entry ({e})") from e
        self.info: dict[str, Any] = self.meta.get("info", {})
        self._jagged_dtypes = {f"{s.name}.{part}": np.dtype(dt) for s in self.sparse_features if s.multi_hot
                               for part, dt in JAGGED_DTYPES.items()}
        self.arrays: dict[str, np.ndarray] = {}
        # file -> (inode, bytes) of each mapped array file, as opened (see ``_check_unchanged``)
        self._mapped: dict[Path, tuple[int, int]] = {}
        for name, spec in self.meta["arrays"].items():
            self.arrays[name] = self._open_array(meta_file, name, spec)
        self._check_shapes(meta_file)
        self._check_jagged()
        # Column of each single-valued feature in sparse.bin (None for multi-hot features).
        single = [i for i, s in enumerate(self.sparse_features) if not s.multi_hot]
        self.sparse_column: list[int | None] = [None] * len(self.sparse_features)
        for col, i in enumerate(single):
            self.sparse_column[i] = col
        self.any_multi_hot = len(single) < len(self.sparse_features)
        self._single_rows = np.array([self.sparse_features[i].num_embeddings for i in single], np.uint64)
        self.needs_weights = any(s.weighted or s.pooling == "mean" for s in self.sparse_features)

    def _open_array(self, meta_file: Path, name: str, spec: Any) -> np.ndarray:
        """One ``arrays`` entry of meta.json -> its memory map, after checking the entry, the dtype the format
        fixes for it and the file's size."""
        try:
            shape = spec["shape"]
            if not (isinstance(shape, list) and all(type(n) is int for n in shape)):
                raise TypeError(f"shape must be a list of integers, got {shape!r:.80}")
            f, dt, shape = self.path / spec["file"], np.dtype(spec["dtype"]), tuple(shape)
        except (KeyError, TypeError, ValueError) as e:
            raise PreparedFormatError(f"{meta_file}: arrays entry {name!r} is malformed ({type(e).__name__}: "
                                      f"{e}; expected file, dtype and shape)") from e
        name_ok = Path(spec["file"]).name == spec["file"] and spec["file"] not in ("", "..")
        if not name_ok or f.is_symlink() and f.resolve().parent != self.path.resolve():
            # every array lives in the set's directory: an entry naming another file (an absolute
            # path, ../x, a link out) would read, and a later rewrite of the set could delete, a
            # file the set does not own
            raise PreparedFormatError(f"{meta_file}: arrays.{name}.file {spec['file']!r} is not a "
                                      f"file of this prepared set (a file name inside "
                                      f"{self.path})")
        want_dt = CORE_DTYPES.get(name) or self._jagged_dtypes.get(name)
        raw_ids = name == "sparse" and dt == np.dtype(RAW_ID_DTYPE)  # int64 raw ids (dynamic id tables)
        if want_dt is not None and dt != np.dtype(want_dt) and not raw_ids:
            # int32 ids read as float32 (the same size, so the file size cannot tell) would train on garbage
            raise PreparedFormatError(f"{f}: meta.json gives dtype {dt.name} for {name!r}, the format stores "
                                      f"{np.dtype(want_dt).name}")
        if any(n < 0 for n in shape):
            raise PreparedFormatError(f"{f}: negative shape {list(shape)} in meta.json")
        want = int(np.prod(shape)) * dt.itemsize
        size = f.stat().st_size if f.is_file() else -1
        if size != want:
            raise PreparedFormatError(f"{f}: {size} bytes on disk, meta.json implies {want}")
        if not want:
            return np.zeros(shape, dt)
        self._mapped[f] = (f.stat().st_ino, size)
        return np.memmap(f, dtype=dt, mode="r", shape=shape)

    def _check_unchanged(self) -> None:
        """Before rows are copied out of the maps: a mapped file cut shorter in place (its inode
        the same, fewer bytes) is a PreparedFormatError naming it, where reading a page past its
        new end would kill the process with SIGBUS. A file replaced by another (recstack's writers
        rename new files into place) is harmless: the maps keep the old one. Between this check and
        the copy a truncation can still land: the check narrows that window to one batch's copy."""
        for f, (inode, size) in self._mapped.items():
            try:
                st = os.stat(f)
            except OSError:
                continue  # removed: the map keeps the file's data
            if st.st_ino == inode and st.st_size < size:
                raise PreparedFormatError(f"{f}: {st.st_size} bytes on disk, {size} when it was "
                                          "opened: the file was cut short while in use")

    def _check_shapes(self, meta_file: Path) -> None:
        """Every per-row array has ``num_rows`` rows (a larger num_rows would read rows that are not there, a
        smaller one would drop the file's last rows), dense and sparse one column per feature."""
        n_single = sum(not s.multi_hot for s in self.sparse_features)
        widths = {"labels": None, "dense": len(self.dense_features), "sparse": n_single}
        for name, width in widths.items():
            if name not in self.arrays:
                raise PreparedFormatError(f"{meta_file}: no {name!r} array in arrays")
            want = (self.num_rows,) if width is None else (self.num_rows, width)
            if self.arrays[name].shape != want:
                file = self.path / self.meta["arrays"][name]["file"]
                raise PreparedFormatError(f"{file}: shape {list(self.arrays[name].shape)}, but num_rows "
                                          f"{self.num_rows} and the features in meta.json need {list(want)}")
        for name, arr in self.arrays.items():
            if name in widths or name in self._jagged_dtypes:  # a multi-hot feature's arrays: _check_jagged
                continue
            if arr.ndim != 1 or len(arr) != self.num_rows:
                raise PreparedFormatError(f"{self.path / self.meta['arrays'][name]['file']}: shape "
                                          f"{list(arr.shape)}, expected [{self.num_rows}] (num_rows in meta.json)")

    def _check_jagged(self) -> None:
        for s in self.sparse_features:
            if not s.multi_hot:
                continue
            parts = ("values", "offsets", "weights") if s.weighted else ("values", "offsets")
            missing = [p for p in parts if f"{s.name}.{p}" not in self.arrays]
            if missing:
                raise PreparedFormatError(f"{self.path}: multi-hot feature {s.name!r} has no {missing} array")
            off, nnz = self.arrays[f"{s.name}.offsets"], len(self.arrays[f"{s.name}.values"])
            if s.weighted and self.arrays[f"{s.name}.weights"].shape != (nnz,):
                raise PreparedFormatError(f"{self.path}: {s.name}.weights must have {nnz} entries (one per value)")
            if off.shape != (self.num_rows + 1,) or int(off[0]) != 0 or int(off[-1]) != nnz:
                raise PreparedFormatError(
                    f"{self.path}: {s.name}.offsets must have {self.num_rows + 1} entries from 0 to {nnz}"
                )

    def __len__(self) -> int:
        return self.num_rows

    @property
    def table_sizes(self) -> list[int]:
        """Rows of each feature's table, one entry per sparse feature (shared tables repeat)."""
        return [s.num_embeddings for s in self.sparse_features]

    @property
    def table_names(self) -> list[str]:
        """The table each sparse feature looks up; features with the same name share one table."""
        return [s.table_name for s in self.sparse_features]

    def column(self, name: str) -> np.ndarray:
        if name not in self.arrays:
            raise KeyError(f"{self.path}: no column {name!r} (has {sorted(self.arrays)})")
        return self.arrays[name]

    def has(self, name: str) -> bool:
        return name in self.arrays

    def batch(self, start: int, end: int, extras: tuple[str, ...] = ()) -> Batch:
        """Rows [start, end) as a Batch (copies the slice out of the memory map)."""
        self._check_unchanged()
        a = self.arrays
        return Batch(
            dense=torch.from_numpy(np.array(a["dense"][start:end], dtype=np.float32)),
            sparse=self._sparse(slice(start, end), end - start),
            labels=torch.from_numpy(np.array(a["labels"][start:end], dtype=np.float32)),
            extras={k: torch.from_numpy(np.array(a[k][start:end])) for k in extras},
        )

    def gather(self, rows: np.ndarray, extras: tuple[str, ...] = ()) -> Batch:
        """Arbitrary rows (sorted index arrays read fastest) as a Batch."""
        self._check_unchanged()
        a = self.arrays
        rows = np.asarray(rows, dtype=np.int64)
        return Batch(
            dense=torch.from_numpy(np.asarray(a["dense"][rows], dtype=np.float32)),
            sparse=self._sparse(rows, len(rows)),
            labels=torch.from_numpy(np.asarray(a["labels"][rows], dtype=np.float32)),
            extras={k: torch.from_numpy(np.asarray(a[k][rows])) for k in extras},
        )

    def _sparse(self, rows: slice | np.ndarray, b: int) -> SparseFeatures:
        """Sparse ids of ``rows`` (a slice or an index array of b rows) in feature-major jagged form."""
        single = np.array(self.arrays["sparse"][rows], dtype=np.int64)  # [B, n_single]
        # One pass: as unsigned, a negative id is beyond every table too.
        if single.size and (bad := single.view(np.uint64) >= self._single_rows).any():
            r, col = np.argwhere(bad)[0]
            self._id_error("sparse", rows, int(r), self.sparse_column.index(int(col)), int(single[r, col]))
        if not self.any_multi_hot and not self.needs_weights:
            return SparseFeatures.from_dense_ids(single)
        ids, lengths, weights = [], [], []
        for s, col in zip(self.sparse_features, self.sparse_column, strict=True):
            if col is not None:
                ids.append(single[:, col])
                n = np.ones(b, np.int64)
                w: np.ndarray = np.ones(b, np.float32)
            else:
                n, pos = self._bag_positions(s.name, rows, b)
                bag_ids = np.asarray(self.arrays[f"{s.name}.values"][pos], dtype=np.int64)
                bad = bag_ids.view(np.uint64) >= s.num_embeddings  # as above: one pass, negatives included
                if bad.any():
                    k = int(np.argmax(bad))
                    r = int(np.searchsorted(np.cumsum(n), k, side="right"))  # the bag holding id k
                    self._id_error(f"{s.name}.values", rows, r, len(ids), int(bag_ids[k]))
                ids.append(bag_ids)
                w = (np.asarray(self.arrays[f"{s.name}.weights"][pos], dtype=np.float32) if s.weighted
                     else np.ones(len(pos), np.float32))
                if s.pooling == "mean":  # every id weighs 1 / bag size, so the weighted sum is the mean
                    w = w / np.repeat(n, n).astype(np.float32)
            lengths.append(n)
            weights.append(w)
        offsets = np.zeros(b * len(lengths) + 1, np.int64)
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
        return SparseFeatures(
            torch.from_numpy(np.concatenate(ids)),
            torch.from_numpy(offsets),
            len(self.sparse_features),
            torch.from_numpy(np.concatenate(weights)) if self.needs_weights else None,
        )

    def _id_error(self, array: str, rows: slice | np.ndarray, r: int, feature: int, value: int) -> NoReturn:
        """Raise for id ``value`` of sparse feature #``feature`` in the ``r``-th selected row: outside its table,
        it would look up a row of the next table in a fused collection (or fail on a device with an assert)."""
        row = rows.start + r if isinstance(rows, slice) else int(rows[r])
        s = self.sparse_features[feature]
        file = self.path / self.meta["arrays"][array]["file"]
        raise PreparedFormatError(f"{file}: row {row}, sparse feature {s.name!r}: id {value} is outside "
                                  f"its table of {s.num_embeddings} rows (a damaged or foreign file?)")

    def _bag_positions(self, name: str, rows: slice | np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
        """-> (bag sizes [B], positions [sum] into the feature's values array) for the selected rows."""
        off = self.arrays[f"{name}.offsets"]
        if isinstance(rows, slice):
            o = np.array(off[rows.start : rows.stop + 1], dtype=np.int64)
            return np.diff(o), np.arange(o[0], o[-1], dtype=np.int64)
        starts = np.asarray(off[rows], dtype=np.int64)
        n = np.asarray(off[rows + 1], dtype=np.int64) - starts
        total = int(n.sum())
        # position k of bag r is starts[r] + k: shift a running counter by each bag's start
        shift = np.repeat(starts - (np.cumsum(n) - n), n)
        return n, np.arange(total, dtype=np.int64) + shift
