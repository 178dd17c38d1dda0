"""From raw chunks to prepared arrays: check and convert every column the schema names (parse), learn
statistics on the training split (stats), and turn values into embedding rows and model inputs (encode).

Checks are per row: a bad value marks its row, and the first bad row of a chunk (in row order, first bad
column of the row) is raised as a :class:`DataError` naming file, line/row and column, unless bad rows are
skipped. A column of a type that can never fit (a list where a number is wanted) is a file-level error.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recstack.data.format import SparseFeatureSpec
from recstack.data.prepare.columns import (
    Bag,
    as_text,
    hash_strings,
    is_numeric,
    to_bag,
    to_numbers,
    to_seconds,
    truncate,
)
from recstack.data.prepare.readers.base import BadRow, BadRowLog, DataError, RawChunk, report_in_order
from recstack.data.prepare.schema import RESERVED_ROWS, Schema, SchemaError, SparseSpec

# Prepared data stores float32: a larger magnitude (Parquet's doubles, "1e308" in a CSV) would
# become inf there.
F32_MAX = float(np.finfo(np.float32).max)
F32_RANGE = "not a float32 (its magnitude is above 3.4e38, the largest prepared data can hold)"

MISSING, OOV = 0, 1


@dataclass
class ParsedChunk:
    """The good rows of a chunk, converted. labels float32 [n]; dense float64 [n, d] (NaN = missing, raw);
    bags: one per sparse feature; example_id / timestamp int64 [n] or None; vertical: text [n] or None;
    ordinals int64 [n] (0-based record numbers in the file) and file_index locate the rows for the
    fraction split."""

    labels: np.ndarray
    dense: np.ndarray
    bags: list[Bag]
    example_id: np.ndarray | None
    timestamp: np.ndarray | None
    vertical: pa.Array | None
    ordinals: np.ndarray
    file_index: int

    def __len__(self) -> int:
        return len(self.labels)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _check_type(chunk: RawChunk, column: str, want: str) -> pa.Array:
    """The column as one array; a file-level DataError when its type can never hold ``want`` values."""
    arr = chunk.table.column(column).combine_chunks()
    t = arr.type
    ok = {
        "number": is_numeric(t) or _is_text(t),
        "time": is_numeric(t) or _is_text(t) or pa.types.is_timestamp(t) or pa.types.is_date(t),
        "sparse": not (pa.types.is_struct(t) or pa.types.is_map(t))
        and (not _is_list(t) or not _is_list(t.value_type)),
    }[want]
    if not ok:
        raise DataError(chunk.file, column, None, f"has type {t}, which cannot hold a {want} value")
    return arr


class Problems:
    """Bad rows found in one chunk, by column, in the order the checks ran."""

    def __init__(self, chunk: RawChunk) -> None:
        self.chunk = chunk
        self.bad = np.zeros(len(chunk), bool)
        self.found: list[tuple[np.ndarray, str, str, dict[int, Any] | None]] = []

    def add(self, mask: np.ndarray, column: str, reason: str, values: dict[int, Any] | None = None) -> None:
        if mask.any():
            self.found.append((mask, column, reason, values))
            self.bad |= mask

    def report(self, log: BadRowLog) -> np.ndarray:
        """Log every bad row, together with the records the reader rejected in this chunk, in file order
        (raises on the first unless skipping); -> keep mask [n]."""
        found: list[tuple[int, BadRow]] = []
        for i in np.flatnonzero(self.bad).tolist():
            mask, column, reason, values = next(f for f in self.found if f[0][i])
            value = values[i] if values is not None and i in values else self.chunk.table.column(column)[i].as_py()
            found.append((int(self.chunk.positions[i]), BadRow(self.chunk.where(i), column, value, reason)))
        report_in_order(log, self.chunk.rejected, found)
        return ~self.bad


def parse_chunk(chunk: RawChunk, schema: Schema, log: BadRowLog) -> ParsedChunk:
    """Convert and check one chunk; bad rows are raised or (when skipping) dropped and logged."""
    n = len(chunk)
    probs = Problems(chunk)
    lab = schema.label
    raw, bad = to_numbers(_check_type(chunk, lab.column, "number"))
    probs.add(bad, lab.column, "label is not a number")
    probs.add(np.isnan(raw) & ~bad, lab.column, "label is missing")
    ok = ~np.isnan(raw)
    if lab.min is not None or lab.max is not None:
        lo = -np.inf if lab.min is None else lab.min
        hi = np.inf if lab.max is None else lab.max
        probs.add(ok & ((raw < lo) | (raw > hi)), lab.column, f"label outside its range [{lo:g}, {hi:g}]")
    if lab.threshold is None:
        probs.add(ok & (raw != 0) & (raw != 1), lab.column,
                  "label must be 0 or 1 (set [label] threshold to binarise other values)")
        labels = (raw == 1).astype(np.float32)
    else:
        labels = (raw >= lab.threshold).astype(np.float32)

    dense = np.zeros((n, len(schema.dense)), np.float64)
    for j, d in enumerate(schema.dense):
        vals, bad = to_numbers(_check_type(chunk, d.column, "number"))
        probs.add(bad, d.column, "not a number")
        probs.add(np.isinf(vals), d.column, "not a finite number")
        probs.add(np.abs(vals) > F32_MAX, d.column, F32_RANGE)  # else inf (-inf standardized)
        dense[:, j] = vals

    bags = [_parse_sparse(chunk, s, probs) for s in schema.sparse]

    c = schema.columns
    example_id = timestamp = vertical = None
    if c.example_id:
        arr = chunk.table.column(c.example_id).combine_chunks()
        if _is_text(arr.type):
            try:  # integer ids written as text (CSV) stay the same integers
                arr = pc.cast(arr, pa.int64())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                pass
        if pa.types.is_integer(arr.type):
            example_id = pc.fill_null(arr, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        else:  # other ids: a 63-bit hash, so every id is a non-negative int64
            example_id = (hash_strings(arr) >> np.uint64(1)).astype(np.int64)
            example_id[arr.is_null().to_numpy(zero_copy_only=False)] = -1
    if c.timestamp:
        timestamp, bad = to_seconds(_check_type(chunk, c.timestamp, "time"))
        probs.add(bad, c.timestamp, "not a timestamp (seconds, or an ISO date/time)")
    if c.vertical:
        vertical = as_text(chunk.table.column(c.vertical).combine_chunks())

    keep = probs.report(log)
    if keep.all():
        return ParsedChunk(labels, dense, bags, example_id, timestamp, vertical, chunk.ordinals, chunk.file_index)
    k = pa.array(keep)
    return ParsedChunk(
        labels[keep], dense[keep], [_filter_bag(b, keep) for b in bags],
        example_id[keep] if example_id is not None else None,
        timestamp[keep] if timestamp is not None else None,
        vertical.filter(k) if vertical is not None else None,
        chunk.ordinals[keep], chunk.file_index,
    )


def _parse_sparse(chunk: RawChunk, s: SparseSpec, probs: Problems) -> Bag:
    arr = _check_type(chunk, s.column, "sparse")
    n = len(arr)
    weights = _weights(chunk, s, arr, probs) if s.weight_column else None
    bag = to_bag(arr, s.multi_hot, s.separator, weights)
    if not s.multi_hot:
        probs.add(bag.too_many, s.column, "has several values but the feature is not multi_hot")
    if s.encoding == "identity":
        ids, bad_vals = _int_ids(bag.values)
        bad_vals |= ids < 0
        out_of_range = ~bad_vals & (ids >= s.size)
        rows = bag.rows
        for mask, why in ((bad_vals, "id is not a non-negative integer"),
                          (out_of_range, f"id is beyond the declared size {s.size} (ids must be 0..{s.size - 1})")):
            if mask.any():
                vals = bag.values.filter(pa.array(mask)).to_pylist()
                shown: dict[int, Any] = {}
                for r, v in zip(rows[mask].tolist(), vals, strict=True):
                    shown.setdefault(r, v)
                probs.add(np.bincount(rows[mask], minlength=n) > 0, s.column, why, shown)
        bag = Bag(bag.lengths, pa.array(np.where(bad_vals | out_of_range, 0, ids)), bag.weights, bag.too_many)
    return truncate(bag, s.max_length)


def _weights(chunk: RawChunk, s: SparseSpec, arr: pa.Array, probs: Problems) -> np.ndarray:
    """Per-value weights of a multi-hot feature from its weight column (a list, or text split by the same
    separator), aligned with the flattened values: float32 [sum of list lengths]. Rows whose weights do not
    match their values one to one are bad."""
    def as_list(a: pa.Array) -> pa.Array:
        if _is_text(a.type):
            return pc.split_pattern(a, s.separator)
        if _is_list(a.type):
            return a
        return pa.ListArray.from_arrays(pa.array(np.arange(len(a) + 1, dtype=np.int32)), a)  # one per row

    values, w = as_list(arr), as_list(_check_type(chunk, s.weight_column, "sparse"))
    lv = pc.fill_null(pc.list_value_length(values), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    lw = pc.fill_null(pc.list_value_length(w), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    nums, bad = to_numbers(pc.list_flatten(w))
    bad |= ~np.isfinite(nums) | (np.abs(nums) > F32_MAX)
    rows_w = pc.list_parent_indices(w).to_numpy(zero_copy_only=False)
    bad_row = np.bincount(rows_w[bad], minlength=len(lv)) > 0
    probs.add(lv != lw, s.weight_column, f"has a different number of values than {s.column!r}")
    probs.add(bad_row & (lv == lw), s.weight_column, "weight is not a finite number")  # in float32
    out = np.ones(int(lv.sum()), np.float32)  # rows that do not match keep 1.0 (they are dropped or raised)
    ok = np.repeat(lv == lw, lw)
    start_v, start_w = np.cumsum(lv) - lv, np.cumsum(lw) - lw
    rank = np.arange(len(nums)) - np.repeat(start_w, lw)
    out[np.repeat(start_v, lw)[ok] + rank[ok]] = nums[ok]
    return out


def _int_ids(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Integer ids (text allowed) -> (int64 [m], bad [m]: not an integer). Ids beyond int64 become the
    int64 maximum (beyond any table), negative ones stay negative."""
    big = np.iinfo(np.int64).max
    if pa.types.is_integer(values.type):
        raw = values.to_numpy(zero_copy_only=False)
        if raw.dtype == np.uint64:
            raw = np.minimum(raw, np.uint64(big))
        return raw.astype(np.int64), np.zeros(len(values), bool)
    nums, bad = to_numbers(values if _is_text(values.type) or is_numeric(values.type) else as_text(values))
    bad |= ~np.isfinite(nums) | (np.nan_to_num(nums) != np.floor(np.nan_to_num(nums)))
    nums = np.where(bad, 0, np.nan_to_num(nums))
    huge = nums >= 2.0**63
    ids = np.where(huge, 0, np.maximum(nums, -(2.0**62))).astype(np.int64)
    ids[huge] = big
    return ids, bad


def _filter_bag(b: Bag, keep: np.ndarray) -> Bag:
    kv = keep[b.rows]
    w = b.weights[kv] if b.weights is not None else None
    return Bag(b.lengths[keep], b.values.filter(pa.array(kv)), w, b.too_many[keep])


# ------------------------------------------------------------------------------------------------ stats
@dataclass
class EncodingState:
    """What preparing learns from the training split and every split then uses (saved as stats.json).

    dense: name -> (mean, std) of the raw values; vocab: table -> values (row 2 + i); verticals: names
    (id = index)."""

    dense: dict[str, tuple[float, float]] = field(default_factory=dict)
    vocab: dict[str, list[str]] = field(default_factory=dict)
    verticals: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"dense": {k: list(v) for k, v in self.dense.items()}, "vocab": self.vocab,
                "verticals": self.verticals}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> EncodingState:
        return EncodingState({k: (float(v[0]), float(v[1])) for k, v in d.get("dense", {}).items()},
                             {k: list(v) for k, v in d.get("vocab", {}).items()}, list(d.get("verticals", [])))


def needs_stats(schema: Schema) -> bool:
    return any(d.transform == "standardize" for d in schema.dense) or any(
        s.encoding == "vocab" for s in schema.sparse)


class StatsCollector:
    """Streaming statistics over the training rows: dense mean/std (Chan's pairwise merge of per-chunk
    moments in float64: the same on every run, but another ``chunk_rows`` can change them in the last bits)
    and value counts of every vocab table."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.moments = {d.name: (0, 0.0, 0.0) for d in schema.dense if d.transform == "standardize"}
        self.counts: dict[str, Counter] = {t: Counter() for t, fs in schema.tables().items()
                                            if fs[0].encoding == "vocab"}

    def update(self, p: ParsedChunk, train: np.ndarray) -> None:
        for j, d in enumerate(self.schema.dense):
            if d.name not in self.moments:
                continue
            x = p.dense[train, j]
            x = x[~np.isnan(x)]
            if not len(x):
                continue
            n0, m0, s0 = self.moments[d.name]
            n1, m1, s1 = len(x), float(x.mean()), float(((x - x.mean()) ** 2).sum())
            n = n0 + n1
            delta = m1 - m0
            self.moments[d.name] = (n, m0 + delta * n1 / n, s0 + s1 + delta * delta * n0 * n1 / n)
        for s, bag in zip(self.schema.sparse, p.bags, strict=True):
            if s.table_name not in self.counts:
                continue
            vals = bag.values.filter(pa.array(train[bag.rows])) if not train.all() else bag.values
            vc = pc.value_counts(as_text(vals))
            self.counts[s.table_name].update(dict(zip(vc.field("values").to_pylist(),
                                                      vc.field("counts").to_pylist(), strict=True)))

    def state(self) -> EncodingState:
        out = EncodingState()
        for name, (n, mean, m2) in self.moments.items():
            std = (m2 / n) ** 0.5 if n else 1.0
            out.dense[name] = (mean, std if std > 0 else 1.0)
        for table, counts in self.counts.items():
            spec = self.schema.tables()[table][0]
            kept = sorted(((v, c) for v, c in counts.items() if c >= spec.min_freq), key=lambda vc: (-vc[1], vc[0]))
            if spec.max_vocab:
                kept = kept[: spec.max_vocab]
            out.vocab[table] = [v for v, _ in kept]
        return out


# ------------------------------------------------------------------------------------------------ encode
def _only(names: dict[str, Any]) -> str:
    """" (only for a, b)" naming what a statistics file does hold, or nothing when it holds none."""
    return f" (only for {', '.join(names)})" if names else ""


class Encoder:
    """Parsed rows -> the arrays :class:`~recstack.data.prepared_writer.PreparedWriter` takes."""

    def __init__(self, schema: Schema, state: EncodingState, stats_file: str | None = None) -> None:
        """``stats_file``: where ``state`` was read from (``--stats-from``), named when it lacks something."""
        self.schema, self.state = schema, state
        source = stats_file or "the statistics"
        for d in schema.dense:
            if d.transform == "standardize" and d.name not in state.dense:
                raise SchemaError(
                    f"{schema.origin}: dense feature {d.name!r} has transform 'standardize', but {source} holds "
                    f"no mean and standard deviation for it{_only(state.dense)}; prepare the training data with "
                    "this schema"
                )
        self.lookup: dict[str, dict[str, int]] = {}
        for table, feats in schema.tables().items():
            if feats[0].encoding == "vocab":
                if table not in state.vocab:
                    raise SchemaError(
                        f"{schema.origin}: sparse feature {feats[0].name!r}: {source} holds no vocabulary for "
                        f"table {table!r}{_only(state.vocab)}; prepare the training data with this schema"
                    )
                self.lookup[table] = {v: i + RESERVED_ROWS["vocab"] for i, v in enumerate(state.vocab[table])}
        self.verticals = {v: i for i, v in enumerate(state.verticals)}

    def num_embeddings(self, s: SparseSpec) -> int:
        if s.encoding == "hash":
            return s.hash_size
        if s.encoding == "identity":
            return s.size + RESERVED_ROWS["identity"]
        return len(self.lookup[s.table_name]) + RESERVED_ROWS["vocab"]

    def feature_specs(self) -> list[SparseFeatureSpec]:
        shared = {t for t, fs in self.schema.tables().items() if len(fs) > 1}
        return [
            SparseFeatureSpec(s.name, self.num_embeddings(s), s.multi_hot, s.table if s.table_name in shared else "",
                              s.pooling, bool(s.weight_column), RESERVED_ROWS[s.encoding])
            for s in self.schema.sparse
        ]

    def ids(self, s: SparseSpec, values: pa.Array) -> np.ndarray:
        """Embedding rows of a feature's values (int64 [m]); row 0 (missing) is never returned."""
        if s.encoding == "identity":
            return values.to_numpy(zero_copy_only=False).astype(np.int64) + RESERVED_ROWS["identity"]
        enc = as_text(values).dictionary_encode()  # each distinct value is hashed or looked up once
        if s.encoding == "hash":
            uniq = (hash_strings(enc.dictionary) % np.uint64(s.hash_size - 1)).astype(np.int64) + 1
            return uniq[enc.indices.to_numpy(zero_copy_only=False)]
        lookup = self.lookup[s.table_name]
        uniq = np.array([lookup.get(v, OOV) for v in enc.dictionary.to_pylist()], np.int64)
        return uniq[enc.indices.to_numpy(zero_copy_only=False)] if len(uniq) else np.zeros(0, np.int64)

    def encode(self, p: ParsedChunk) -> dict[str, Any]:
        """-> keyword arguments of PreparedWriter.write (labels, dense, sparse, jagged, extras)."""
        n = len(p)
        dense = np.zeros((n, len(self.schema.dense)), np.float32)
        for j, d in enumerate(self.schema.dense):
            x = p.dense[:, j]
            if d.transform == "log1p":
                x = np.log1p(np.maximum(x, 0))
            elif d.transform == "standardize":
                mean, std = self.state.dense[d.name]
                x = (x - mean) / std
            dense[:, j] = np.where(np.isnan(x), d.fill, x)
        single = [s for s in self.schema.sparse if not s.multi_hot]
        sparse = np.zeros((n, len(single)), np.int32)
        jagged: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
        col = 0
        for s, bag in zip(self.schema.sparse, p.bags, strict=True):
            ids = self.ids(s, bag.values)
            if not s.multi_hot:
                sparse[bag.rows, col] = ids  # rows without a value keep row 0, "missing"
                col += 1
                continue
            # An empty bag gets the single id "missing", so every bag has at least one id.
            lengths = np.maximum(bag.lengths, 1)
            starts = np.cumsum(lengths) - lengths
            out = np.zeros(int(lengths.sum()), np.int32)
            rank = np.arange(len(ids)) - np.repeat(np.cumsum(bag.lengths) - bag.lengths, bag.lengths)
            pos = starts[bag.rows] + rank
            out[pos] = ids
            w = None
            if s.weight_column:
                w = np.ones(len(out), np.float32)
                w[pos] = bag.weights if bag.weights is not None else 1.0
            jagged[s.name] = (lengths, out, w)
        extras: dict[str, np.ndarray] = {}
        if p.example_id is not None:
            extras["example_id"] = p.example_id
        if p.timestamp is not None:
            extras["timestamp"] = p.timestamp
        if p.vertical is not None:
            extras["vertical"] = self._verticals(p.vertical)
        return {"labels": p.labels, "dense": dense, "sparse": sparse, "jagged": jagged, **extras}

    def _verticals(self, arr: pa.Array) -> np.ndarray:
        """Vertical names -> ids in order of first appearance (-1 = missing); the table grows as needed."""
        enc = arr.dictionary_encode()
        ids = []
        for v in enc.dictionary.to_pylist():
            if v not in self.verticals:
                self.verticals[v] = len(self.verticals)
                self.state.verticals.append(v)
            ids.append(self.verticals[v])
        idx = enc.indices.to_numpy(zero_copy_only=False)
        out = np.asarray(ids, np.int32)[np.nan_to_num(idx).astype(np.int64)] if ids else np.zeros(len(arr), np.int32)
        out[arr.is_null().to_numpy(zero_copy_only=False)] = -1
        return out
