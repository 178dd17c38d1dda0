"""``recstack data inspect``: what is in a raw file (per column type, missing share, cardinality, top values,
label rate) or a prepared directory (rows, label rate, features, and the embedding tables the model gets).

Raw files are read in chunks with the schema readers (bounded memory). Cardinality is exact up to
``EXACT_LIMIT`` distinct values and estimated beyond with a HyperLogLog sketch (about 1.6% error); top values
are exact while a column has at most ``TOP_LIMIT`` distinct values and approximate after (the counter keeps
the most frequent ones). Text columns where a separator (``|``, ``;``, ``,``) occurs in at least a fifth of
the values of the first chunk are treated as multi-valued and counted per value.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recstack.data.prepare.columns import as_text, hash_strings, to_bag
from recstack.data.prepare.readers import BadRowLog, LibfmSource, expand_inputs, open_source
from recstack.data.prepare.readers.base import open_binary, report_in_order
from recstack.data.prepare.schema import LabelSpec, SourceSpec, detect_format
from recstack.data.synth.zipf import fit_zipf_exponent

EXACT_LIMIT = 200_000
TOP_LIMIT = 50_000
HLL_BITS = 12
SEPARATORS = ("|", ";", ",")
LABEL_NAMES = ("label", "click", "clicked", "is_click", "target", "y", "rating", "score", "conversion")


class Cardinality:
    """Distinct count of 64-bit hashes: exact set, then a HyperLogLog sketch."""

    def __init__(self) -> None:
        self.exact: np.ndarray | None = np.zeros(0, np.uint64)
        self.registers = np.zeros(1 << HLL_BITS, np.uint8)

    def update(self, h: np.ndarray) -> None:
        idx = (h >> np.uint64(64 - HLL_BITS)).astype(np.int64)
        w = h << np.uint64(HLL_BITS)
        for s in (1, 2, 4, 8, 16, 32):  # smear the top bit right; the count of set bits gives its position
            w |= w >> np.uint64(s)
        rho = (65 - np.bitwise_count(w).astype(np.int64)).clip(1, 64 - HLL_BITS + 1)  # leading zeros + 1
        np.maximum.at(self.registers, idx, rho.astype(np.uint8))
        if self.exact is not None:
            self.exact = np.union1d(self.exact, h)
            if len(self.exact) > EXACT_LIMIT:
                self.exact = None

    @property
    def is_exact(self) -> bool:
        return self.exact is not None

    def value(self) -> int:
        if self.exact is not None:
            return len(self.exact)
        m = len(self.registers)
        est = 0.7213 / (1 + 1.079 / m) * m * m / np.sum(2.0 ** -self.registers.astype(np.float64))
        zeros = int((self.registers == 0).sum())
        if est <= 2.5 * m and zeros:
            est = m * np.log(m / zeros)
        return int(round(est))


@dataclass
class ColumnStats:
    name: str
    type: str = ""
    kind: str = ""  # int | float | text | list | time | bool
    rows: int = 0
    missing: int = 0
    values: int = 0  # non-missing values (several per row for multi-valued columns)
    separator: str = ""
    min: float = np.inf
    max: float = -np.inf
    total: float = 0.0
    distinct: Cardinality = field(default_factory=Cardinality)
    counts: Counter = field(default_factory=Counter)
    top_exact: bool = True

    def update(self, arr: pa.Array) -> None:
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        t = arr.type
        self.type = self.type or str(t)
        self.rows += len(arr)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            self.kind = "list"
        elif pa.types.is_string(t) or pa.types.is_large_string(t):
            arr = self._text(arr)
        elif pa.types.is_timestamp(t) or pa.types.is_date(t):
            self.kind = "time"
        elif pa.types.is_boolean(t):
            self.kind = "bool"
        else:
            self.kind = "float" if pa.types.is_floating(t) else "int"
        if self.separator or self.kind == "list":
            bag = to_bag(arr, True, self.separator or "|")
            self.missing += int((bag.lengths == 0).sum())
            values = bag.values
        else:
            valid = arr.is_valid()
            self.missing += len(arr) - int(pc.sum(valid).as_py() or 0)
            values = arr.filter(valid)
        self.values += len(values)
        if self.kind in ("int", "float", "bool") and len(values):
            num = pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
            self.min, self.max = min(self.min, float(num.min())), max(self.max, float(num.max()))
            self.total += float(num.sum())
        if not len(values):
            return
        vc = pc.value_counts(as_text(values))
        keys = vc.field("values")
        self.distinct.update(hash_strings(keys))
        self.counts.update(dict(zip(keys.to_pylist(), vc.field("counts").to_pylist(), strict=True)))
        if len(self.counts) > TOP_LIMIT:
            self.counts = Counter(dict(self.counts.most_common(TOP_LIMIT // 5)))
            self.top_exact = False

    def _text(self, arr: pa.Array) -> pa.Array:
        """Text: numbers written as text count as numbers; multi-valued text is split (decided once)."""
        if not self.kind:
            nonnull = arr.drop_null()
            for sep in SEPARATORS:
                has = pc.sum(pc.greater(pc.count_substring(nonnull, sep), 0)).as_py() or 0
                if len(nonnull) and has >= 0.2 * len(nonnull):
                    self.separator, self.kind = sep, "text"
                    return arr
        if self.kind in ("", "int", "float"):
            for kind, tp in (("int", pa.int64()), ("float", pa.float64())):
                if kind == "int" and self.kind == "float":
                    continue
                try:
                    out = pc.cast(arr, tp)
                    self.kind = kind
                    return out
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    continue
        self.kind = "text"
        return arr

    @property
    def missing_share(self) -> float:
        return self.missing / self.rows if self.rows else 0.0

    def top(self, k: int = 5) -> list[tuple[str, int]]:
        return self.counts.most_common(k)


@dataclass
class FileReport:
    paths: list[Path]
    format: str
    rows: int
    columns: list[ColumnStats]
    label: str | None
    label_rate: float | None
    label_rule: str
    bad_rows: int
    notes: list[str] = field(default_factory=list)
    libfm: LibfmSource | None = None

    def column(self, name: str) -> ColumnStats:
        return next(c for c in self.columns if c.name == name)


def _libfm_spec(path: Path, spec: SourceSpec) -> SourceSpec:
    """A libFM file whose first rows all have K pairs is inspected as K positional fields."""
    if spec.fields or spec.field_ranges:
        return spec
    with open_binary(path) as f:
        head = f.read(1 << 20).split(b"\n")[:-1][:2000]
    counts = {len(ln.split()) - 1 for ln in head if ln.strip()}
    first = next((ln.split()[1] for ln in head if len(ln.split()) > 1), b"")
    if len(counts) == 1 and (k := counts.pop()) > 1 and first.count(b":") == 1:
        return SourceSpec(format="libfm", fields=[f"field{i}" for i in range(k)])
    return spec


def inspect_file(
    paths: list[str | Path], spec: SourceSpec | None = None, label: LabelSpec | None = None, max_rows: int = 0,
    chunk_rows: int = 65536,
) -> FileReport:
    """Statistics of every column of raw input files (the first ``max_rows`` rows when > 0)."""
    spec = spec or SourceSpec()
    files = expand_inputs(list(paths), spec)
    fmt = detect_format(files[0], spec)
    if fmt == "libfm":
        spec = _libfm_spec(files[0], spec)
    log = BadRowLog(skip=True, keep=5)
    stats: dict[str, ColumnStats] = {}
    rows = 0
    source = None
    for i, f in enumerate(files):
        source = open_source(f, spec, chunk_rows, log)
        for chunk in source.chunks(source.columns, i):
            report_in_order(log, chunk.rejected, [])
            table = chunk.table.slice(0, max_rows - rows) if max_rows else chunk.table
            for name in table.column_names:
                stats.setdefault(name, ColumnStats(name)).update(table.column(name))
            rows += table.num_rows
            if max_rows and rows >= max_rows:
                break
        if max_rows and rows >= max_rows:
            break
    cols = list(stats.values())
    label_name = label.column if label else next(
        (c.name for n in LABEL_NAMES for c in cols if c.name.lower() == n), None)
    rate, rule = None, ""
    if label_name in stats:
        rate, rule = _label_rate(stats[label_name], label)
    notes = [f"{log.count} rows did not parse and were left out, e.g. {log.rows[0]}"] if log.count else []
    libfm = source if isinstance(source, LibfmSource) else None
    return FileReport(files, fmt, rows, cols, label_name, rate, rule, log.count, notes, libfm)


def _label_rate(c: ColumnStats, label: LabelSpec | None) -> tuple[float | None, str]:
    """Share of positive rows by the schema's rule, or a guessed one (0/1, -1/1, or a rating's top values)."""
    if c.kind not in ("int", "float", "bool") or not c.values or not c.top_exact:
        return None, "not numeric"
    values = {float(k): v for k, v in c.counts.items()}
    if label is not None and label.threshold is not None:
        thr, rule = label.threshold, f">= {label.threshold:g}"
    elif set(values) <= {0.0, 1.0}:
        thr, rule = 1.0, "== 1"
    elif set(values) <= {-1.0, 1.0}:
        thr, rule = 0.0, "-1/1 label, > 0"
    else:
        thr = suggest_threshold(c)
        rule = f">= {thr:g} (a guess for this {c.min:g}..{c.max:g} scale; set [label] threshold)"
    return sum(v for k, v in values.items() if k >= thr) / c.values, rule


def suggest_threshold(c: ColumnStats) -> float:
    """For a rating scale: the top two values of 1..5 (4), else the upper quarter of the range."""
    return float(np.ceil(c.min + 0.75 * (c.max - c.min)))


# ------------------------------------------------------------------------------------------ prepared data
@dataclass
class PreparedReport:
    path: Path
    rows: int
    label_rate: float
    dense: list[dict[str, Any]]
    sparse: list[dict[str, Any]]
    tables: list[dict[str, Any]]
    info: dict[str, Any]


def inspect_prepared(path: str | Path, max_table_size: int = 0, embedding_dim: int = 16,
                     chunk_rows: int = 1 << 20) -> PreparedReport:
    """Rows, label rate, per-feature statistics and the embedding tables a model built on ``path`` gets
    (after ``model.max_table_size``), with their memory at ``embedding_dim`` float32 columns. Features of up
    to 50M rows also get the Zipf exponent of their value counts (``zipf``, ``fit_zipf_exponent``), and each
    table that of its features' counts together (``recstack plan --zipf-from`` sizes caches with it)."""
    from recstack.data.format import capped_table_sizes
    from recstack.data.prepared_dataset import PreparedDataset

    ds = PreparedDataset(path)
    n = len(ds)
    labels = ds.column("labels")
    pos = sum(float(np.asarray(labels[i : i + chunk_rows], np.float64).sum()) for i in range(0, n, chunk_rows))
    dense_stats = ds.info.get("dense_stats", {})
    dense = []
    d = ds.column("dense")
    for j, name in enumerate(ds.dense_features):
        x = np.asarray(d[: min(n, chunk_rows), j], np.float64)
        dense.append({"name": name, "mean": float(x.mean()) if n else 0.0, "std": float(x.std()) if n else 0.0,
                      "raw_mean_std": dense_stats.get(name)})
    caps = capped_table_sizes(ds.table_sizes, max_table_size)
    schema_reader = ds.info.get("reader") == "schema"
    sparse: list[dict[str, Any]] = []
    table_counts: dict[str, np.ndarray] = {}
    for s, col, cap in zip(ds.sparse_features, ds.sparse_column, caps, strict=True):
        used = np.zeros(s.num_embeddings, np.int64) if s.num_embeddings <= 50_000_000 else None  # value counts
        zeros = bag_total = 0
        for i in range(0, n, chunk_rows):
            j = min(n, i + chunk_rows)
            if col is not None:
                ids = np.asarray(ds.column("sparse")[i:j, col])
            else:
                off = ds.column(f"{s.name}.offsets")
                ids = np.asarray(ds.column(f"{s.name}.values")[int(off[i]) : int(off[j])])
            bag_total += len(ids)
            zeros += int((ids == 0).sum())
            if used is not None:
                values, counts = np.unique(ids, return_counts=True)
                used[values] += counts
        if used is not None:
            seen = table_counts.get(s.table_name)
            table_counts[s.table_name] = used if seen is None or len(seen) != len(used) else seen + used
        sparse.append({
            "name": s.name, "table": s.table_name, "rows": s.num_embeddings, "model_rows": cap,
            "multi_hot": s.multi_hot, "pooling": s.pooling, "mean_ids": bag_total / n if n else 0.0,
            "used_rows": int((used > 0).sum()) if used is not None else None,
            "missing_share": zeros / bag_total if schema_reader and bag_total else None,
            "zipf": fit_zipf_exponent(used) if used is not None else None,
        })
    tables: dict[str, dict[str, Any]] = {}
    for f in sparse:
        t = tables.setdefault(f["table"], {"name": f["table"], "rows": f["model_rows"], "features": []})
        t["features"].append(f["name"])
    for t in tables.values():
        t["mib"] = t["rows"] * embedding_dim * 4 / 2**20
        t["zipf"] = fit_zipf_exponent(table_counts[t["name"]]) if t["name"] in table_counts else None
    return PreparedReport(Path(path), n, pos / n if n else 0.0, dense, sparse, list(tables.values()), ds.info)


# ------------------------------------------------------------------------------------------ text output
def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_file_report(r: FileReport) -> str:
    lines = [f"{', '.join(map(str, r.paths[:3]))}{' ...' if len(r.paths) > 3 else ''}: {r.format}, "
             f"{r.rows:,} rows, {len(r.columns)} columns"]
    if r.label:
        rate = "n/a" if r.label_rate is None else _pct(r.label_rate)
        lines.append(f"label {r.label!r}: positive rate {rate} ({r.label_rule})")
    lines.append("")
    lines.append(f"{'column':<20} {'type':<14} {'kind':<6} {'missing':>8} {'distinct':>12}  top values")
    for c in r.columns:
        distinct = f"{c.distinct.value():,}" + ("" if c.distinct.is_exact else "~")
        kind = c.kind + (f"[{c.separator}]" if c.separator else "")
        top = ", ".join(f"{v[:16]} ({_pct(n / c.values)})" for v, n in c.top(3)) if c.values else ""
        rng = f"  range {c.min:g}..{c.max:g}, mean {c.total / c.values:.4g}" if c.kind in ("int", "float") \
            and c.values else ""
        approx = "" if c.top_exact else " (approx.)"
        lines.append(f"{c.name[:20]:<20} {c.type[:14]:<14} {kind:<6} {_pct(c.missing_share):>8} {distinct:>12}  "
                     f"{top}{approx}{rng}")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def format_prepared_report(r: PreparedReport) -> str:
    lines = [f"{r.path}: prepared, {r.rows:,} rows, label rate {_pct(r.label_rate)}, "
             f"{len(r.dense)} dense / {len(r.sparse)} sparse features"]
    for d in r.dense:
        raw = f" (raw mean {d['raw_mean_std'][0]:.4g}, std {d['raw_mean_std'][1]:.4g})" if d["raw_mean_std"] else ""
        lines.append(f"  dense  {d['name']:<20} mean {d['mean']:.4g}  std {d['std']:.4g}{raw}")
    for s in r.sparse:
        kind = f"multi-hot ({s['pooling']}, {s['mean_ids']:.2f} ids/row)" if s["multi_hot"] else "single"
        used = f", {s['used_rows']:,} rows used" if s["used_rows"] is not None else ""
        miss = f", {_pct(s['missing_share'])} missing" if s["missing_share"] is not None else ""
        zipf = f", Zipf {s['zipf']:.2f}" if s.get("zipf") is not None else ""
        lines.append(f"  sparse {s['name']:<20} table {s['table']:<16} {s['rows']:>11,} rows{used}{miss}, {kind}{zipf}")
    lines.append("embedding tables the model gets:")
    for t in r.tables:
        zipf = f"  Zipf {t['zipf']:.2f}" if t.get("zipf") is not None else ""
        lines.append(f"  {t['name']:<20} {t['rows']:>11,} rows  {t['mib']:>9.1f} MiB{zipf}  "
                     f"<- {', '.join(t['features'])}")
    return "\n".join(lines)
