"""A stream's partition as rows in memory: labels float32 [n], dense float32 [n, D], sparse ids int64 [n, F].

Two formats, as ``recstack data prepare`` reads them:

* raw Criteo TSV (plain or gzip), read by ``CriteoReader``: the 26 categorical fields stay the raw 32-bit hash
  values (int64); the ids become rows of ordinary tables only in the loader (``recstack.data.loader.cap_ids``,
  modulo the table size: ``model.max_table_size``, else ``DEFAULT_TABLE_ROWS``);
* a schema format (``--schema``: Parquet, CSV/TSV, libFM) with ``hash`` or ``identity`` encodings, which need no
  statistics: the ids are the encoder's rows. ``vocab`` tables and ``standardize`` need statistics learned over
  a fixed training set, and multi-hot bags are not streamed yet: each is an error naming the feature.

A bad line is an error naming the file and line (the readers' own errors).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from recstack.data.batch import Batch, SparseFeatures
from recstack.data.format import RAW_ID_RANGE, SparseFeatureSpec
from recstack.data.prepare.criteo import DENSE_NAMES, DENSE_TRANSFORM, SPARSE_NAMES, CriteoReader
from recstack.data.prepare.encode import Encoder, EncodingState, parse_chunk
from recstack.data.prepare.readers import open_source
from recstack.data.prepare.readers.base import BadRowLog
from recstack.data.prepare.schema import RESERVED_ROWS, Schema, SchemaError, load_schema
from recstack.errors import StreamError

DEFAULT_TABLE_ROWS = 20000  # a raw Criteo stream's rows per table without model.max_table_size (configs/demo.toml)


@dataclass(frozen=True)
class StreamLayout:
    """What a model built for the stream needs, per feature: dense feature names; the table each sparse feature
    looks up (shared tables repeat), its rows, and its reserved rows (missing / out of vocabulary, start at 0)."""

    dense_names: list[str]
    table_names: list[str]
    table_sizes: list[int]
    reserved_rows: list[int]


@dataclass(frozen=True)
class StreamDescription:
    """A stream's partitions described as a prepared set describes itself (a
    ``recstack.data.format.DataDescription``), so that a model trained on them exports and publishes like one
    trained on a prepared set: ``path`` the stream's directory, ``info`` how raw values become ids."""

    path: Path
    info: dict[str, Any]
    dense_features: list[str]
    sparse_features: list[SparseFeatureSpec]

    @property
    def table_sizes(self) -> list[int]:
        return [s.num_embeddings for s in self.sparse_features]

    @property
    def table_names(self) -> list[str]:
        return [s.table_name for s in self.sparse_features]


class PartitionRows:
    """One partition's rows in memory (a ``recstack.data.loader.RowSet``): ``labels`` float32 [n], ``dense``
    float32 [n, D], ``ids`` int64 [n, F] as read (raw); ``extras``: per-row columns [n] by name (a schema's
    ``[columns]``: ``example_id``, ``timestamp``, ``vertical``), as a prepared set holds them."""

    def __init__(self, labels: np.ndarray, dense: np.ndarray, ids: np.ndarray,
                 extras: dict[str, np.ndarray] | None = None) -> None:
        self.labels, self.dense, self.ids = labels, dense, ids
        self.extras = extras or {}

    def __len__(self) -> int:
        return len(self.labels)

    def has(self, name: str) -> bool:
        return name in self.extras

    def batch(self, start: int, end: int, extras: tuple[str, ...] = ()) -> Batch:
        return self.gather(np.arange(start, end), extras)

    def gather(self, rows: np.ndarray, extras: tuple[str, ...] = ()) -> Batch:
        """Rows ``rows`` as a Batch (one id per feature), with the extra columns ``extras``."""
        return Batch(dense=torch.from_numpy(self.dense[rows]),
                     sparse=SparseFeatures.from_dense_ids(torch.from_numpy(self.ids[rows])),
                     labels=torch.from_numpy(self.labels[rows]),
                     extras={k: torch.from_numpy(self.extras[k][rows]) for k in extras})


class PartitionReader(Protocol):
    layout: StreamLayout

    def read(self, path: Path) -> PartitionRows: ...

    def describe(self, directory: Path, raw: list[bool]) -> StreamDescription:
        """The partitions of ``directory`` (the stream's location) as export and serving see the data
        (features, tables, transforms); ``raw``: per feature, whether its ids reach the model raw (a dynamic id
        table keyed by them) instead of modulo its table's rows."""
        ...


class CriteoPartitions:
    """Raw Criteo TSV partitions; every table has ``table_rows`` rows."""

    def __init__(self, table_rows: int) -> None:
        self.layout = StreamLayout(list(DENSE_NAMES), list(SPARSE_NAMES), [table_rows] * len(SPARSE_NAMES),
                                   [0] * len(SPARSE_NAMES))

    def describe(self, directory: Path, raw: list[bool]) -> StreamDescription:
        """Served as a hashed Criteo set: the server takes raw rows and applies ``raw % rows`` as the loader, or
        keeps the raw values when every table is dynamic (one ``max_ind_range`` holds for all 26 features, so
        either all tables or none may be dynamic)."""
        if any(raw) and not all(raw):
            raise StreamError(f"--stream {directory}: a raw Criteo stream is exported with one id range for its 26 "
                              "features, so either every table or none is dynamic (model.dynamic_ids.tables)")
        rows = RAW_ID_RANGE if any(raw) else self.layout.table_sizes[0]
        info = {"source": "criteo", "dense_transform": DENSE_TRANSFORM,
                "categorical": {"mode": "hash", "max_ind_range": rows, "formula": "raw % max_ind_range"}}
        return StreamDescription(directory, info, list(DENSE_NAMES),
                                 [SparseFeatureSpec(n, rows) for n in SPARSE_NAMES])

    def read(self, path: Path) -> PartitionRows:
        chunks = list(CriteoReader(path))  # a bad line: CriteoFormatError naming file, line and field
        return PartitionRows(np.concatenate([c.labels for c in chunks]).astype(np.float32),
                             np.concatenate([c.dense for c in chunks]).astype(np.float32),
                             np.concatenate([c.sparse for c in chunks]).astype(np.int64))


class SchemaPartitions:
    """Partitions in a schema's format (``hash`` and ``identity`` encodings, one value per feature). The
    schema's ``[columns]`` are carried as extra columns, numbered as ``recstack data prepare`` numbers them
    (``vertical``: names -> ids in order of first appearance over the partitions this reader read)."""

    EXTRAS = ("example_id", "timestamp", "vertical")

    def __init__(self, schema: Schema, verticals: list[str] | None = None) -> None:
        """``verticals``: vertical names already numbered (id = position), as a reader that read the stream's
        earlier partitions would hold them; new names get the next ids in order of first appearance."""
        for s in schema.sparse:
            if s.encoding == "vocab":
                raise SchemaError(f"{schema.origin}: sparse feature {s.name!r}: a stream cannot use encoding "
                                  "'vocab' (its vocabulary is learned over a fixed training set); use 'hash' "
                                  "(hash_size rows) or 'identity'")
            if s.multi_hot:
                raise SchemaError(f"{schema.origin}: sparse feature {s.name!r}: multi-hot features are not "
                                  "streamed (one value per feature)")
        for d in schema.dense:
            if d.transform == "standardize":
                raise SchemaError(f"{schema.origin}: dense feature {d.name!r}: a stream cannot use transform "
                                  "'standardize' (its mean and deviation are learned over a fixed training set); "
                                  "use 'log1p' or 'none'")
        self.schema, self.encoder = schema, Encoder(schema, EncodingState(verticals=list(verticals or [])))
        self.layout = StreamLayout([d.name for d in schema.dense], [s.table_name for s in schema.sparse],
                                   [self.encoder.num_embeddings(s) for s in schema.sparse],
                                   [RESERVED_ROWS[s.encoding] for s in schema.sparse])

    def describe(self, directory: Path, raw: list[bool]) -> StreamDescription:
        """Served with the schema's own encoders (hash and identity need no learned statistics)."""
        info = {"reader": "schema", "schema": self.schema.to_dict(), "dense_stats": {}}
        return StreamDescription(directory, info, [d.name for d in self.schema.dense],
                                 self.encoder.feature_specs())

    def read(self, path: Path) -> PartitionRows:
        source = open_source(path, self.schema.source, 65536, BadRowLog())  # a bad row: DataError, file and line
        parts = [self.encoder.encode(parse_chunk(raw, self.schema, source.log))
                 for raw in source.chunks(self.schema.input_columns())]
        if not parts or not sum(len(p["labels"]) for p in parts):
            raise StreamError(f"{path}: no rows")
        extras = {k: np.concatenate([p[k] for p in parts]) for k in self.EXTRAS if k in parts[0]}
        return PartitionRows(np.concatenate([p["labels"] for p in parts]).astype(np.float32),
                             np.concatenate([p["dense"] for p in parts]).astype(np.float32),
                             np.concatenate([p["sparse"] for p in parts]).astype(np.int64), extras)

    @property
    def verticals(self) -> list[str]:
        """Vertical names seen so far (the ``vertical`` column's id of a name is its position)."""
        return list(self.encoder.state.verticals)


def partition_reader(schema: str | None, max_table_size: int) -> PartitionReader:
    """The reader of a stream: ``schema`` (a schema TOML file) for the schema formats, else raw Criteo TSV with
    ``max_table_size`` rows a table (0: ``DEFAULT_TABLE_ROWS``)."""
    if schema:
        return SchemaPartitions(load_schema(schema))
    return CriteoPartitions(max_table_size or DEFAULT_TABLE_ROWS)
