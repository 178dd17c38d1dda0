"""The prepared (memory-mapped, columnar) data format that every reader writes and the trainer reads.

A prepared data set is a directory:

    meta.json          {"format": "recstack-prepared", "version": 1, "num_rows": N,
                        "dense_features": [names], "sparse_features": [{"name", "num_embeddings"}],
                        "arrays": {name: {"file", "dtype", "shape"}}, "info": {...}}
    labels.bin         float32 [N]
    dense.bin          float32 [N, n_dense]
    sparse.bin         int32   [N, n_sparse]   ids already in [0, num_embeddings)
    <extra>.bin        optional per-row columns, e.g. probability (synthetic ground truth), vertical,
                       timestamp, example_id

Arrays are raw little-endian files so they can be appended chunk by chunk while preparing (bounded memory,
no need to know N up front) and opened with ``np.memmap`` without reading them. The writer fills
``<dir>.tmp`` and renames it at the end, so a crash never leaves a half-written directory that looks valid.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recstack.data.batch import Batch, SparseFeatures

FORMAT_NAME = "recstack-prepared"
FORMAT_VERSION = 1
_CORE = {"labels": np.float32, "dense": np.float32, "sparse": np.int32}


class PreparedFormatError(ValueError):
    """A prepared directory is missing, incomplete or inconsistent."""


@dataclass(frozen=True)
class SparseFeatureSpec:
    name: str
    num_embeddings: int


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
    ) -> None:
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not overwrite:
            raise FileExistsError(f"{self.out_dir} already exists (pass overwrite to replace it)")
        self.tmp_dir = self.out_dir.with_name(self.out_dir.name + ".tmp")
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)
        self.tmp_dir.mkdir(parents=True)
        self.dense_features = list(dense_features)
        self.sparse_features = list(sparse_features)
        self.dtypes: dict[str, np.dtype] = {k: np.dtype(v) for k, v in _CORE.items()}
        for name, dt in (extra_columns or {}).items():
            self.dtypes[name] = np.dtype(dt)
        self.files = {k: open(self.tmp_dir / f"{k}.bin", "wb") for k in self.dtypes}
        self.num_rows = 0
        self.info: dict[str, Any] = {}

    def write(self, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray, **extras: np.ndarray) -> None:
        """labels [n], dense [n, n_dense], sparse [n, n_sparse]; extras [n] for each declared column."""
        n = len(labels)
        cols = {"labels": labels, "dense": dense, "sparse": sparse, **extras}
        if set(cols) != set(self.dtypes):
            raise ValueError(f"columns {sorted(cols)} do not match declared {sorted(self.dtypes)}")
        widths = {"dense": len(self.dense_features), "sparse": len(self.sparse_features)}
        for name, arr in cols.items():
            arr = np.asarray(arr)
            want = (n, widths[name]) if name in widths else (n,)
            if arr.shape != want:
                raise ValueError(f"column {name!r}: shape {arr.shape}, expected {want}")
            self.files[name].write(np.ascontiguousarray(arr, dtype=self.dtypes[name]).tobytes())
        self.num_rows += n

    def close(self) -> Path:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        widths = {"dense": len(self.dense_features), "sparse": len(self.sparse_features)}
        arrays = {
            k: {
                "file": f"{k}.bin",
                "dtype": dt.name,
                "shape": [self.num_rows, widths[k]] if k in widths else [self.num_rows],
            }
            for k, dt in self.dtypes.items()
        }
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "num_rows": self.num_rows,
            "dense_features": self.dense_features,
            "sparse_features": [
                {"name": s.name, "num_embeddings": int(s.num_embeddings)} for s in self.sparse_features
            ],
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
        if exc_type is None:
            self.close()
        else:
            self.abort()


class PreparedDataset:
    """Read-only view of a prepared directory; rows are memory-mapped, never loaded whole."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise PreparedFormatError(f"{self.path}: not a prepared data set (no meta.json)")
        try:
            self.meta = json.loads(meta_file.read_text())
        except json.JSONDecodeError as e:
            raise PreparedFormatError(f"{meta_file}: invalid JSON ({e})") from e
        if self.meta.get("format") != FORMAT_NAME or self.meta.get("version") != FORMAT_VERSION:
            raise PreparedFormatError(
                f"{meta_file}: format {self.meta.get('format')!r} version {self.meta.get('version')!r}, "
                f"expected {FORMAT_NAME!r} version {FORMAT_VERSION}"
            )
        self.num_rows = int(self.meta["num_rows"])
        self.dense_features: list[str] = list(self.meta["dense_features"])
        self.sparse_features = [
            SparseFeatureSpec(s["name"], int(s["num_embeddings"])) for s in self.meta["sparse_features"]
        ]
        self.info: dict[str, Any] = self.meta.get("info", {})
        self.arrays: dict[str, np.ndarray] = {}
        for name, spec in self.meta["arrays"].items():
            f = self.path / spec["file"]
            dt = np.dtype(spec["dtype"])
            shape = tuple(spec["shape"])
            want = int(np.prod(shape)) * dt.itemsize
            size = f.stat().st_size if f.is_file() else -1
            if size != want:
                raise PreparedFormatError(f"{f}: {size} bytes on disk, meta.json implies {want}")
            self.arrays[name] = (
                np.memmap(f, dtype=dt, mode="r", shape=shape) if want else np.zeros(shape, dt)
            )

    def __len__(self) -> int:
        return self.num_rows

    @property
    def table_sizes(self) -> list[int]:
        return [s.num_embeddings for s in self.sparse_features]

    def column(self, name: str) -> np.ndarray:
        if name not in self.arrays:
            raise KeyError(f"{self.path}: no column {name!r} (has {sorted(self.arrays)})")
        return self.arrays[name]

    def has(self, name: str) -> bool:
        return name in self.arrays

    def batch(self, start: int, end: int, extras: tuple[str, ...] = ()) -> Batch:
        """Rows [start, end) as a Batch (copies the slice out of the memory map)."""
        a = self.arrays
        return Batch(
            dense=torch.from_numpy(np.array(a["dense"][start:end], dtype=np.float32)),
            sparse=SparseFeatures.from_dense_ids(np.array(a["sparse"][start:end], dtype=np.int64)),
            labels=torch.from_numpy(np.array(a["labels"][start:end], dtype=np.float32)),
            extras={k: torch.from_numpy(np.array(a[k][start:end])) for k in extras},
        )

    def gather(self, rows: np.ndarray, extras: tuple[str, ...] = ()) -> Batch:
        """Arbitrary rows (sorted index arrays read fastest) as a Batch."""
        a = self.arrays
        return Batch(
            dense=torch.from_numpy(np.asarray(a["dense"][rows], dtype=np.float32)),
            sparse=SparseFeatures.from_dense_ids(np.asarray(a["sparse"][rows], dtype=np.int64)),
            labels=torch.from_numpy(np.asarray(a["labels"][rows], dtype=np.float32)),
            extras={k: torch.from_numpy(np.asarray(a[k][rows])) for k in extras},
        )
