"""A first schema from ``recstack data inspect`` statistics, printed as TOML to edit.

The rules are deliberately plain, and every choice is written as a comment above its feature:

* label: ``--label``, else the first column named like a label (label, click, target, rating, ...); 0/1
  needs nothing, -1/1 gets threshold 0, other scales (ratings) a threshold on the upper quarter;
* timestamp / example id / vertical: timestamp-typed or time-named columns, id-named columns with one
  value per row, a column named ``vertical``;
* list columns and text with a separator: multi-hot sparse; other text: sparse;
* integer columns named ``*id`` or with at most 100 distinct values: sparse; other numbers: dense, with
  log1p when they are non-negative and skewed (max above 20x the mean), else standardize;
* sparse encoding: a vocabulary (``min_freq`` 2 above 10,000 distinct values) up to 2 million distinct
  values, beyond that hashing into the next power of two (at most 2^24 rows);
* libFM files with a fixed number of pairs per row: one single-valued field per position;
* feature names: the column name, with characters other than ASCII letters, digits, ``_`` and ``-``
  replaced by ``_`` (prefixed with ``col`` when starting with ``-``, and suffixed ``_2``, ``_3``, ... when two
  columns would get the same name); a column without a name is left out (a schema cannot refer to it).
"""

from __future__ import annotations

import math

from recstack.data.prepare.inspect import ColumnStats, FileReport, suggest_threshold
from recstack.data.prepare.readers import VALUE_SUFFIX
from recstack.data.prepare.schema import (
    _NAME,
    ColumnsSpec,
    DenseSpec,
    LabelSpec,
    Schema,
    SourceSpec,
    SparseSpec,
    validate_schema,
)

TIME_NAMES = ("ts", "time", "timestamp", "datetime", "date", "event_time", "created_at")
ID_NAMES = ("id", "example_id", "event_id", "impression_id", "request_id", "row_id")


def _summary(c: ColumnStats) -> str:
    distinct = f"{c.distinct.value():,}{'' if c.distinct.is_exact else '~'}"
    text = f"{c.name}: {c.kind}, {100 * c.missing_share:.1f}% missing, {distinct} distinct"
    if c.kind in ("int", "float") and c.values:
        text += f", {c.min:g}..{c.max:g}, mean {c.total / c.values:.4g}"
    return text


def _encoding(spec: SparseSpec, distinct: int) -> None:
    if distinct > 2_000_000:
        spec.encoding = "hash"
        spec.hash_size = min(1 << 24, 1 << math.ceil(math.log2(distinct)))
    else:
        spec.encoding, spec.min_freq = "vocab", 2 if distinct > 10_000 else 1


def _clean_name(column: str) -> str:
    """A column name with every character a feature name cannot hold (anything but ASCII letters, digits,
    '_' and '-') replaced by '_', and a 'col' prefix when it is empty or starts with '-'."""
    name = "".join(ch if (ch.isascii() and ch.isalnum()) or ch in "_-" else "_" for ch in column)
    return "col" + name if not name or name[0] == "-" else name


def feature_names(columns: list[str]) -> dict[str, str]:
    """A valid, distinct feature name for every column: valid names stay as they are, others are cleaned
    (:func:`_clean_name`) and get a suffix ``_2``, ``_3``, ... when the result is taken."""
    keep = {c for c in columns if _NAME.match(c)}
    out: dict[str, str] = {}
    used: set[str] = set()
    for c in columns:
        if c in keep and c not in used:
            name = c
        else:
            base = name = _clean_name(c)
            k = 2
            while name in used or name in keep:
                name, k = f"{base}_{k}", k + 1
        out[c] = name
        used.add(name)
    return out


def infer_schema(report: FileReport, label: str | None = None) -> tuple[Schema, dict[str, str]]:
    """-> (schema, comments by feature name) for the files of ``report``."""
    comments: dict[str, str] = {}
    source = SourceSpec(format=report.format)
    if report.libfm is not None and report.libfm.mode == "position":
        source.fields = list(report.libfm.fields)
    elif report.libfm is not None and report.libfm.mode == "ffm":
        source.fields = list(report.libfm.fields)
    label_name = label or report.label
    if label_name is None:
        raise ValueError(f"{report.paths[0]}: no column looks like the label; name it with --label")
    lab_col = report.column(label_name)
    lab = LabelSpec(column=label_name)
    values = {float(k) for k in lab_col.counts} if lab_col.kind in ("int", "float", "bool") else set()
    if values and not values <= {0.0, 1.0}:
        lab.threshold = 0.0 if values <= {-1.0, 1.0} else suggest_threshold(lab_col)
    cols = ColumnsSpec()
    names = feature_names([c.name for c in report.columns])
    dense: list[DenseSpec] = []
    sparse: list[SparseSpec] = []
    for c in report.columns:
        name, low = c.name, c.name.lower()
        if name == label_name or name.endswith(VALUE_SUFFIX):
            continue
        if c.values == 0:
            comments[name] = f"{_summary(c)}: always missing, left out"
            continue
        if not name:  # a schema's empty ``column`` means "the feature's name": this column cannot be named
            continue
        distinct = c.distinct.value()
        if not cols.timestamp and (c.kind == "time" or (low in TIME_NAMES and c.kind in ("int", "text"))):
            cols.timestamp = name
            continue
        if not cols.example_id and low in ID_NAMES and distinct >= 0.99 * c.rows:
            cols.example_id = name
            continue
        if not cols.vertical and low == "vertical":
            cols.vertical = name
            continue
        feature = names[name]
        numeric = c.kind == "float" or (c.kind == "int" and not (low.endswith("id") or distinct <= 100))
        if numeric and report.format != "libfm":  # libFM columns are feature indices, never amounts
            mean = c.total / c.values
            skewed = c.min >= 0 and c.max > 20 * max(mean, 1e-12)
            dense.append(DenseSpec(feature, name, "log1p" if skewed else "standardize"))
        else:
            spec = SparseSpec(feature, name, multi_hot=c.kind == "list" or bool(c.separator))
            if c.separator:
                spec.separator = c.separator
            _encoding(spec, distinct)
            sparse.append(spec)
        comments[feature] = _summary(c)
    schema = Schema(source, lab, dense, sparse, cols, origin=f"inferred from {report.paths[0]}")
    validate_schema(schema)
    return schema, comments
