"""Writing a prepared data set: :class:`PreparedWriter` appends rows chunk by chunk into ``<dir>.tmp`` and
moves it into place with its meta.json at the end (the layout is described in :mod:`recstack.data.format`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from recstack.data.format import (
    CORE_DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    RAW_ID_DTYPE,
    SparseFeatureSpec,
    check_sparse_specs,
)
from recstack.io import check_writable, writing


class PreparedWriter:
    """Append rows chunk by chunk; ``close()`` writes meta.json and moves the directory into place.

    Use as a context manager; on an exception the temporary directory is removed.
    """

    def __init__(
        self,
        out_dir: str | Path,
        dense_features: list[str],
        sparse_features: list[SparseFeatureSpec],
        extra_columns: dict[str, str] | None = None,
        overwrite: bool = False,
        raw_ids: bool = False,
    ) -> None:
        """``raw_ids``: single-valued ids are stored as int64 (raw ids for dynamic id tables, ``format``)."""
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not overwrite:
            raise FileExistsError(f"{self.out_dir} already exists (pass overwrite to replace it)")
        check_writable(self.out_dir, directory=True)  # a file in its place, a read-only parent: now, not at close
        self.tmp_dir = self.out_dir.with_name(self.out_dir.name + ".tmp")
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)
        self.tmp_dir.mkdir(parents=True)
        self.dense_features = list(dense_features)
        self.sparse_features = list(sparse_features)
        try:
            check_sparse_specs(self.sparse_features)
        except ValueError:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            raise
        self.n_single = sum(not s.multi_hot for s in self.sparse_features)
        self.dtypes: dict[str, np.dtype] = {k: np.dtype(v) for k, v in CORE_DTYPES.items()}
        if raw_ids:
            self.dtypes["sparse"] = np.dtype(RAW_ID_DTYPE)
        for name, dt in (extra_columns or {}).items():
            self.dtypes[name] = np.dtype(dt)
        # Jagged arrays of the multi-hot features: name -> dtype; their lengths are not N.
        self.jagged: dict[str, np.dtype] = {}
        for s in self.sparse_features:
            if s.multi_hot:
                self.jagged[f"{s.name}.values"] = np.dtype(np.int32)
                self.jagged[f"{s.name}.offsets"] = np.dtype(np.int64)
                if s.weighted:
                    self.jagged[f"{s.name}.weights"] = np.dtype(np.float32)
        clash = set(self.jagged) & set(self.dtypes)
        if clash:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            raise ValueError(f"column names {sorted(clash)} clash with multi-hot feature arrays")
        self.files = {k: open(self.tmp_dir / f"{k}.bin", "wb") for k in [*self.dtypes, *self.jagged]}
        self.nnz = {s.name: 0 for s in self.sparse_features if s.multi_hot}
        for name in self.nnz:  # offsets start with the 0 of row 0
            self.files[f"{name}.offsets"].write(np.zeros(1, np.int64).tobytes())
        self.num_rows = 0
        self.info: dict[str, Any] = {}

    def write(
        self,
        labels: np.ndarray,
        dense: np.ndarray,
        sparse: np.ndarray,
        jagged: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] | None = None,
        **extras: np.ndarray,
    ) -> None:
        """labels [n], dense [n, n_dense], sparse [n, n_single] (the single-valued features, in order);
        extras [n] for each declared column; ``jagged`` maps each multi-hot feature to (lengths [n],
        ids [sum(lengths)], weights [sum(lengths)] or None)."""
        n = len(labels)
        cols = {"labels": labels, "dense": dense, "sparse": sparse, **extras}
        if set(cols) != set(self.dtypes):
            raise ValueError(f"columns {sorted(cols)} do not match declared {sorted(self.dtypes)}")
        jagged = jagged or {}
        if set(jagged) != set(self.nnz):
            raise ValueError(f"multi-hot features {sorted(jagged)} do not match declared {sorted(self.nnz)}")
        widths = {"dense": len(self.dense_features), "sparse": self.n_single}
        for name, arr in cols.items():
            arr = np.asarray(arr)
            want = (n, widths[name]) if name in widths else (n,)
            if arr.shape != want:
                raise ValueError(f"column {name!r}: shape {arr.shape}, expected {want}")
        checked = {name: self._check_jagged(name, n, *parts) for name, parts in jagged.items()}
        for name, arr in cols.items():
            self.files[name].write(np.ascontiguousarray(arr, dtype=self.dtypes[name]).tobytes())
        for name, (lengths, ids, weights) in checked.items():
            offsets = self.nnz[name] + np.cumsum(lengths, dtype=np.int64)
            self.files[f"{name}.offsets"].write(offsets.tobytes())
            self.files[f"{name}.values"].write(np.ascontiguousarray(ids, dtype=np.int32).tobytes())
            if weights is not None:
                self.files[f"{name}.weights"].write(np.ascontiguousarray(weights, dtype=np.float32).tobytes())
            self.nnz[name] += len(ids)
        self.num_rows += n

    def _check_jagged(
        self, name: str, n: int, lengths: np.ndarray, ids: np.ndarray, weights: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        lengths, ids = np.asarray(lengths), np.asarray(ids)
        if lengths.shape != (n,) or (n and lengths.min() < 0):
            raise ValueError(f"multi-hot {name!r}: lengths must be [{n}] non-negative, got shape {lengths.shape}")
        if ids.shape != (int(lengths.sum()),):
            raise ValueError(f"multi-hot {name!r}: {ids.shape} ids for {int(lengths.sum())} bag entries")
        weighted = f"{name}.weights" in self.jagged
        if weighted != (weights is not None):
            raise ValueError(f"multi-hot {name!r}: weights {'missing' if weighted else 'not declared'}")
        if weights is not None and np.shape(weights) != ids.shape:
            raise ValueError(f"multi-hot {name!r}: weights shape {np.shape(weights)}, ids {ids.shape}")
        return lengths, ids, weights

    def close(self) -> Path:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        widths = {"dense": len(self.dense_features), "sparse": self.n_single}
        arrays = {
            k: {
                "file": f"{k}.bin",
                "dtype": dt.name,
                "shape": [self.num_rows, widths[k]] if k in widths else [self.num_rows],
            }
            for k, dt in self.dtypes.items()
        }
        for name, nnz in self.nnz.items():
            for part in ("values", "offsets", "weights"):
                key = f"{name}.{part}"
                if key in self.jagged:
                    shape = [self.num_rows + 1] if part == "offsets" else [nnz]
                    arrays[key] = {"file": f"{key}.bin", "dtype": self.jagged[key].name, "shape": shape}
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "num_rows": self.num_rows,
            "dense_features": self.dense_features,
            "sparse_features": [s.to_meta() for s in self.sparse_features],
            "arrays": arrays,
            "info": self.info,
        }
        (self.tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2))
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp_dir, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        for f in self.files.values():
            f.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> PreparedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A disk fault (full, read-only) is a DiskError naming the directory; the .tmp directory is removed.
        with writing(self.tmp_dir, remove=[self.tmp_dir]):
            if exc_type is None:
                self.close()
                return
            self.abort()
            raise exc

