"""The prepared (memory-mapped, columnar) data format that every reader writes and the trainer reads.

A prepared data set is a directory:

    meta.json          {"format": "recstack-prepared", "version": 1, "num_rows": N,
                        "dense_features": [names], "sparse_features": [{"name", "num_embeddings"}],
                        "arrays": {name: {"file", "dtype", "shape"}}, "info": {...}}
    labels.bin         float32 [N]
    dense.bin          float32 [N, n_dense]
    sparse.bin         int32   [N, n_single]   ids already in [0, num_embeddings), one column per
                                               single-valued sparse feature (in feature order); int64
                                               for raw ids (``RAW_ID_DTYPE``, dynamic id tables)
    <f>.values.bin     int32   [nnz_f]         multi-hot feature f: all ids, row after row
    <f>.offsets.bin    int64   [N + 1]         row r of f holds values[offsets[r] : offsets[r + 1]]
    <f>.weights.bin    float32 [nnz_f]         optional per-id weights of f (weighted sum pooling)
    <extra>.bin        optional per-row columns, e.g. probability (synthetic ground truth), vertical,
                       timestamp, example_id

Arrays are raw little-endian files so they can be appended chunk by chunk while preparing (bounded memory,
no need to know N up front) and opened with ``np.memmap`` without reading them. The writer fills
``<dir>.tmp`` and renames it at the end, so a crash never leaves a half-written directory that looks valid.

A sparse feature's meta entry may add ``"multi_hot": true`` (stored jagged as above), ``"table": name``
(features naming the same table share one embedding table), ``"pooling": "mean"`` (default sum) and
``"weighted": true``. Entries without them read as before, so single-valued data sets are stored exactly as
they always were. ``"reserved_rows": k`` says that rows [0, k) stand for no known value (missing, and in a
vocabulary out of it: unseen or rare); a new model starts them at zero (``recstack.embedding.collection``).

This module holds the format's definition: its name and version, the dtypes it fixes, the sparse feature
entry (:class:`SparseFeatureSpec`) and its checks, and the error for a broken set.
:class:`~recstack.data.prepared_writer.PreparedWriter` writes a set and
:class:`~recstack.data.prepared_dataset.PreparedDataset` reads (and checks) one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from recstack.errors import RecstackError

FORMAT_NAME = "recstack-prepared"
FORMAT_VERSION = 1
CORE_DTYPES = {"labels": np.float32, "dense": np.float32, "sparse": np.int32}
# ``sparse`` may instead be int64: raw ids (large, sparse values) for dynamic id tables (``recstack.embedding.
# dynamic``), whose features give ``num_embeddings`` = RAW_ID_RANGE; no modulo or vocabulary applies to them.
RAW_ID_DTYPE = np.int64
RAW_ID_RANGE = 2**62
JAGGED_DTYPES = {"values": np.int32, "offsets": np.int64, "weights": np.float32}  # <feature>.<part> arrays


class PreparedFormatError(RecstackError, ValueError):
    """A prepared directory is missing, incomplete or inconsistent, or holds values training cannot use (the
    message names the file, and the row where one is to blame)."""


POOLINGS = ("sum", "mean")


@dataclass(frozen=True)
class SparseFeatureSpec:
    """One sparse feature. ``table``: features naming the same table share it (empty = a table of its own,
    named after the feature). ``multi_hot``: a bag of ids per row instead of exactly one. ``pooling``: sum
    or mean of the bag. ``weighted``: per-id weights are stored (multi-hot only). ``reserved_rows``: rows
    [0, k) stand for no known value (missing, out of vocabulary); a new model starts them at zero."""

    name: str
    num_embeddings: int
    multi_hot: bool = False
    table: str = ""
    pooling: str = "sum"
    weighted: bool = False
    reserved_rows: int = 0

    @property
    def table_name(self) -> str:
        return self.table or self.name

    def to_meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "num_embeddings": int(self.num_embeddings)}
        if self.multi_hot:
            out["multi_hot"] = True
        if self.table:
            out["table"] = self.table
        if self.pooling != "sum":
            out["pooling"] = self.pooling
        if self.weighted:
            out["weighted"] = True
        if self.reserved_rows:
            out["reserved_rows"] = int(self.reserved_rows)
        return out

    @staticmethod
    def from_meta(entry: dict[str, Any]) -> SparseFeatureSpec:
        """A meta.json entry, each key of its JSON type (``"num_embeddings": "50"`` is an error
        naming the key, not a table size read from a string); a ValueError otherwise."""
        if not isinstance(entry, dict):
            raise ValueError(f"expected an object, got {type(entry).__name__} {entry!r:.80}")
        values: dict[str, Any] = {}
        for key, (kind, default) in _META_KEYS.items():
            if key not in entry and default is None:
                raise ValueError(f"sparse feature {entry.get('name')!r}: no {key!r} key")
            value = entry.get(key, default)
            if type(value) is not kind:  # exact: True is not an int here, nor "50" or 5.0
                raise ValueError(f"sparse feature {entry.get('name')!r}: {key} must be a JSON "
                                 f"{_JSON_TYPES[kind]}, got {type(value).__name__} {value!r:.80}")
            values[key] = value
        return SparseFeatureSpec(**values)


# The keys of a sparse feature's meta.json entry: its type and default (None: the key is required).
_META_KEYS: dict[str, tuple[type, Any]] = {
    "name": (str, None), "num_embeddings": (int, None), "multi_hot": (bool, False),
    "table": (str, ""), "pooling": (str, "sum"), "weighted": (bool, False),
    "reserved_rows": (int, 0)}
_JSON_TYPES = {str: "string", int: "integer", bool: "boolean"}


def check_sparse_specs(specs: list[SparseFeatureSpec]) -> None:
    """Names unique, pooling known, weights only on multi-hot features, shared tables of one size."""
    seen: set[str] = set()
    sizes: dict[str, tuple[str, int]] = {}
    for s in specs:
        if s.name in seen:
            raise ValueError(f"sparse feature {s.name!r} appears twice")
        if s.num_embeddings < 1:
            raise ValueError(f"sparse feature {s.name!r}: table size {s.num_embeddings}, must be at least 1")
        seen.add(s.name)
        if s.pooling not in POOLINGS:
            raise ValueError(f"sparse feature {s.name!r}: pooling {s.pooling!r} is not one of {POOLINGS}")
        if s.weighted and not s.multi_hot:
            raise ValueError(f"sparse feature {s.name!r}: weights need a multi-hot feature")
        first = sizes.setdefault(s.table_name, (s.name, s.num_embeddings))
        if first[1] != s.num_embeddings:
            raise ValueError(
                f"table {s.table_name!r}: feature {first[0]!r} gives {first[1]} rows, {s.name!r} gives "
                f"{s.num_embeddings}"
            )



def capped_table_sizes(table_sizes: list[int], max_table_size: int) -> list[int]:
    """Rows per table after ``model.max_table_size`` (0 = no cap): the table sizes a model is built with and
    that ``BatchLoader(table_caps=...)`` takes ids modulo."""
    return [min(n, max_table_size) if max_table_size > 0 else n for n in table_sizes]


class DataDescription(Protocol):
    """What export, serving and the publisher need to know of the data a model trained on: its features and
    tables, and ``info`` (how raw values became ids: the ``info`` of a prepared set's meta.json). A
    :class:`~recstack.data.prepared_dataset.PreparedDataset` is one; a stream describes its partitions alike
    (``recstack.data.stream.partition.StreamDescription``)."""

    @property
    def path(self) -> Path: ...

    @property
    def info(self) -> dict[str, Any]: ...

    @property
    def dense_features(self) -> list[str]: ...

    @property
    def sparse_features(self) -> list[SparseFeatureSpec]: ...

    @property
    def table_sizes(self) -> list[int]: ...

    @property
    def table_names(self) -> list[str]: ...
