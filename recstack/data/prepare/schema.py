"""The data schema: which columns of a Parquet, CSV/TSV or libFM file are the label, dense and sparse features.

A schema is a TOML file (``configs/schemas/*.toml``) read by :func:`load_schema`, or inferred from a file by
``recstack data inspect FILE --infer-schema`` and edited. Sections:

``[source]``   format (parquet | csv | tsv | libfm; empty = from the file name), CSV ``delimiter``, ``header``
               and ``columns`` (names when there is no header), libFM ``fields`` (the i-th ``idx:val`` of a
               row belongs to the i-th field) or ``field_ranges`` (a field per index range [start, end)).
``[label]``    ``column``; without ``threshold`` every value must be 0 or 1, with it the label is
               ``value >= threshold`` (a rating >= 4, or a -1/+1 libSVM label with threshold 0); ``min`` and
               ``max`` bound the raw value.
``[[dense]]``  ``name``, ``column`` (default: the name), ``transform`` none | log1p | standardize (mean and
               standard deviation of the training split), ``fill``: the value of a missing entry after the
               transform (0 = the training mean for standardize).
``[[sparse]]`` ``name``, ``column``, ``multi_hot`` (+ ``separator`` for string columns, ``max_length``),
               ``encoding`` hash (``hash_size`` rows) | vocab (``min_freq``, ``max_vocab``) | identity
               (integer ids below ``size``), ``table`` (features naming one table share it), ``pooling``
               sum | mean, ``weight_column`` (per-value weights of a multi-hot feature).
``[columns]``  optional per-row ``example_id``, ``timestamp`` and ``vertical`` columns.
``[split]``    ``method`` none | fraction (``valid``, ``test``, ``seed``) | time (``valid_from``, ``test_from``).

Rows of every embedding table: 0 is "missing" (an empty value or bag), vocab tables have 1 = out of
vocabulary and 2.. the values seen at least ``min_freq`` times in the training split, most frequent first;
hash tables put values in 1..hash_size-1; identity tables put id i in row i + 1.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recstack.data.prepare.columns import text_to_seconds
from recstack.errors import RecstackError
from recstack.typed_toml import read_toml, toml_value

FORMATS = ("parquet", "csv", "tsv", "libfm")
TRANSFORMS = ("none", "log1p", "standardize")
ENCODINGS = ("hash", "vocab", "identity")
POOLINGS = ("sum", "mean")
SPLITS = ("none", "fraction", "time")
RESERVED_ROWS = {"hash": 1, "vocab": 2, "identity": 1}  # missing (+ out of vocabulary)
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")
_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".libfm": "libfm",
             ".libsvm": "libfm", ".svm": "libfm", ".ffm": "libfm", ".libffm": "libfm"}


class SchemaError(RecstackError, ValueError):
    """A schema file or value is invalid; the message names the file and the key."""


@dataclass
class SourceSpec:
    format: str = ""
    delimiter: str = ""
    header: bool = True
    columns: list[str] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)
    field_ranges: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class LabelSpec:
    column: str = "label"
    threshold: float | None = None
    min: float | None = None
    max: float | None = None


@dataclass
class DenseSpec:
    name: str = ""
    column: str = ""
    transform: str = "none"
    fill: float = 0.0


@dataclass
class SparseSpec:
    name: str = ""
    column: str = ""
    multi_hot: bool = False
    separator: str = "|"
    max_length: int = 0
    encoding: str = "vocab"
    hash_size: int = 0
    size: int = 0
    min_freq: int = 1
    max_vocab: int = 0
    table: str = ""
    pooling: str = "sum"
    weight_column: str = ""

    @property
    def table_name(self) -> str:
        return self.table or self.name

    def table_options(self) -> tuple[Any, ...]:
        """What features sharing a table must agree on."""
        return (self.encoding, self.hash_size, self.size, self.min_freq, self.max_vocab)


@dataclass
class ColumnsSpec:
    example_id: str = ""
    timestamp: str = ""
    vertical: str = ""


@dataclass
class SplitSpec:
    method: str = "none"
    valid: float = 0.0
    test: float = 0.0
    seed: int = 0
    valid_from: int | float | str | None = None
    test_from: int | float | str | None = None


@dataclass
class Schema:
    source: SourceSpec = field(default_factory=SourceSpec)
    label: LabelSpec = field(default_factory=LabelSpec)
    dense: list[DenseSpec] = field(default_factory=list)
    sparse: list[SparseSpec] = field(default_factory=list)
    columns: ColumnsSpec = field(default_factory=ColumnsSpec)
    split: SplitSpec = field(default_factory=SplitSpec)
    origin: str = field(default="schema", compare=False)  # file name, for messages

    def tables(self) -> dict[str, list[SparseSpec]]:
        """Table name -> the features that look it up, in feature order."""
        out: dict[str, list[SparseSpec]] = {}
        for s in self.sparse:
            out.setdefault(s.table_name, []).append(s)
        return out

    def input_columns(self) -> list[str]:
        """Every source column the schema reads, without repeats."""
        cols = [self.label.column, *(d.column for d in self.dense), *(s.column for s in self.sparse)]
        cols += [s.weight_column for s in self.sparse if s.weight_column]
        c = self.columns
        cols += [x for x in (c.example_id, c.timestamp, c.vertical) if x]
        return list(dict.fromkeys(cols))

    def to_dict(self) -> dict[str, Any]:
        """Plain values (TOML/JSON ready); default values are left out of dense/sparse entries."""
        out: dict[str, Any] = {}
        for name in ("source", "label", "columns", "split"):
            d = _non_default(getattr(self, name), keep=("column",) if name == "label" else ())
            if d:
                out[name] = d
        out["dense"] = [_non_default(d, keep=("name",)) for d in self.dense]
        out["sparse"] = [_non_default(s, keep=("name", "encoding")) for s in self.sparse]
        return out


def _non_default(obj: Any, keep: tuple[str, ...] = ()) -> dict[str, Any]:
    base = type(obj)()
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name == "column" and v == getattr(obj, "name", None):
            continue
        if f.name in keep or v != getattr(base, f.name):
            out[f.name] = v
    return out


# --------------------------------------------------------------------------------------------- loading
_SECTIONS = {"source": SourceSpec, "label": LabelSpec, "columns": ColumnsSpec, "split": SplitSpec}


def _typed(value: Any, tp: Any, where: str) -> Any:
    """Check one TOML value against a field's annotation (given as a string, see ``from __future__``)."""
    allowed = [t.strip() for t in str(tp).split("|")]
    for t in allowed:
        if t == "None" and value is None:
            return None
        if t == "bool" and isinstance(value, bool):
            return value
        if t == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t == "float" and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if t == "str" and isinstance(value, str):
            return value
        if t.startswith("list[str]") and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        if t.startswith("dict[") and isinstance(value, dict):
            return dict(value)
    if "str" in allowed and isinstance(value, dt.datetime | dt.date):
        return value.isoformat()  # TOML date-times are kept as ISO text and parsed like the data
    raise SchemaError(f"{where}: expected {' or '.join(allowed)}, got {type(value).__name__} {value!r}")


def _build(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, dict):
        raise SchemaError(f"{where}: expected a table, got {type(values).__name__}")
    hints = {f.name: f.type for f in dataclasses.fields(cls) if f.name != "origin"}
    obj = cls()
    for key, value in values.items():
        if key not in hints:
            raise SchemaError(f"{where}: unknown key {key!r} (valid: {', '.join(sorted(hints))})")
        setattr(obj, key, _typed(value, hints[key], f"{where}.{key}"))
    return obj


def schema_from_dict(values: dict[str, Any], origin: str = "schema") -> Schema:
    """Build and validate a Schema from parsed TOML (or :meth:`Schema.to_dict`) values."""
    sch = Schema(origin=origin)
    for key, value in values.items():
        if key in _SECTIONS:
            setattr(sch, key, _build(_SECTIONS[key], value, f"{origin}: [{key}]"))
        elif key in ("dense", "sparse"):
            if not isinstance(value, list):
                raise SchemaError(f"{origin}: {key} must be an array of tables ([[{key}]])")
            cls = DenseSpec if key == "dense" else SparseSpec
            setattr(sch, key, [_build(cls, v, f"{origin}: {key}[{i}]") for i, v in enumerate(value)])
        else:
            raise SchemaError(
                f"{origin}: unknown section {key!r} (valid: columns, dense, label, source, sparse, split)"
            )
    specs: list[DenseSpec | SparseSpec] = [*sch.dense, *sch.sparse]
    for spec in specs:
        spec.column = spec.column or spec.name
    validate_schema(sch)
    return sch


def load_schema(path: str | Path) -> Schema:
    return schema_from_dict(read_toml(path, "schema file", SchemaError), str(Path(path)))


def validate_schema(sch: Schema) -> None:
    """Cross-field checks; every message names the schema file and the feature or key."""
    o = sch.origin

    def bad(msg: str) -> SchemaError:
        return SchemaError(f"{o}: {msg}")

    if sch.source.format and sch.source.format not in FORMATS:
        raise bad(f"source.format {sch.source.format!r} is not one of {', '.join(FORMATS)}")
    if sch.source.fields and sch.source.field_ranges:
        raise bad("source: give either fields (by position) or field_ranges (by index), not both")
    for fname, rng in sch.source.field_ranges.items():
        if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int) for x in rng) and
                0 <= rng[0] < rng[1]):
            raise bad(f"source.field_ranges.{fname}: expected [start, end) with 0 <= start < end, got {rng!r}")
    if not sch.label.column:
        raise bad("label.column is empty")
    lab = sch.label
    if lab.min is not None and lab.max is not None and lab.min > lab.max:
        raise bad(f"label: min {lab.min} is above max {lab.max}")
    names: dict[str, str] = {}
    kinds: tuple[tuple[str, Sequence[DenseSpec | SparseSpec]], ...] = (("dense", sch.dense), ("sparse", sch.sparse))
    for kind, specs in kinds:
        for i, s in enumerate(specs):
            if not s.name or not _NAME.match(s.name):
                raise bad(f"{kind}[{i}]: name {s.name!r} must be letters, digits, '_' or '-'")
            if s.name in names:
                raise bad(f"{kind} feature {s.name!r} is declared twice ({names[s.name]} and {kind})")
            names[s.name] = kind
    for d in sch.dense:
        if d.transform not in TRANSFORMS:
            raise bad(f"dense {d.name!r}: transform {d.transform!r} is not one of {', '.join(TRANSFORMS)}")
    for s in sch.sparse:
        _validate_sparse(s, bad)
    for table, feats in sch.tables().items():
        if len({f.table_options() for f in feats}) > 1:
            names_ = ", ".join(f.name for f in feats)
            raise bad(f"table {table!r}: features {names_} share it but declare different encodings or sizes")
    _validate_split(sch, bad)
    if not sch.sparse:
        raise bad("no [[sparse]] feature: the model needs at least one (dense features alone have no embedding)")


def _validate_sparse(s: SparseSpec, bad: Any) -> None:
    if s.encoding not in ENCODINGS:
        raise bad(f"sparse {s.name!r}: encoding {s.encoding!r} is not one of {', '.join(ENCODINGS)}")
    if s.encoding == "hash" and s.hash_size < 2:
        raise bad(f"sparse {s.name!r}: hash encoding needs hash_size >= 2 (row 0 is 'missing')")
    if s.encoding == "identity" and s.size < 1:
        raise bad(f"sparse {s.name!r}: identity encoding needs size >= 1 (ids are 0..size-1)")
    if s.min_freq < 1 or s.max_vocab < 0 or s.max_length < 0:
        raise bad(f"sparse {s.name!r}: min_freq must be >= 1, max_vocab and max_length >= 0")
    if s.pooling not in POOLINGS:
        raise bad(f"sparse {s.name!r}: pooling {s.pooling!r} is not one of {', '.join(POOLINGS)}")
    if s.weight_column and not s.multi_hot:
        raise bad(f"sparse {s.name!r}: weight_column needs multi_hot = true")
    if s.multi_hot and not s.separator:
        raise bad(f"sparse {s.name!r}: separator is empty")
    if s.table and not _NAME.match(s.table):
        raise bad(f"sparse {s.name!r}: table name {s.table!r} must be letters, digits, '_' or '-'")


def _validate_split(sch: Schema, bad: Any) -> None:
    sp = sch.split
    if sp.method not in SPLITS:
        raise bad(f"split.method {sp.method!r} is not one of {', '.join(SPLITS)}")
    if sp.method == "fraction":
        if not (0 <= sp.valid < 1 and 0 <= sp.test < 1 and sp.valid + sp.test < 1):
            raise bad(f"split: valid ({sp.valid}) and test ({sp.test}) must be fractions summing below 1")
    if sp.method == "time":
        if not sch.columns.timestamp:
            raise bad("split.method = 'time' needs columns.timestamp")
        if sp.valid_from is None and sp.test_from is None:
            raise bad("split.method = 'time' needs valid_from and/or test_from")
        v, t = split_time(sp.valid_from), split_time(sp.test_from)
        if v is not None and t is not None and v > t:
            raise bad(f"split: valid_from ({sp.valid_from}) is after test_from ({sp.test_from})")


def split_time(value: int | float | str | None) -> int | None:
    """A time cut -> whole seconds since the epoch (UTC), rounded down like the rows' timestamps; numbers
    are taken as seconds already, text as seconds or an ISO 8601 date/time (UTC without a zone)."""
    if value is None:
        return None
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise SchemaError(f"split time {value!r}: not a finite number of seconds")
        return math.floor(value)
    try:
        return text_to_seconds(value)
    except (ValueError, OverflowError) as e:
        raise SchemaError(f"split time {value!r}: not a number of seconds or an ISO date/time") from e


def detect_format(path: str | Path, spec: SourceSpec | None = None) -> str:
    """The source format: the schema's, else from the file name (``.gz`` ignored)."""
    if spec is not None and spec.format:
        return spec.format
    p = Path(path)
    suffixes = [s.lower() for s in p.suffixes if s.lower() not in (".gz", ".bz2", ".zst")]
    if p.is_dir():
        return "parquet"
    for suf in reversed(suffixes):
        if suf in _SUFFIXES:
            return _SUFFIXES[suf]
    raise SchemaError(
        f"{p}: cannot tell the format from the name; set [source] format = one of {', '.join(FORMATS)} in "
        f"the schema (`recstack data inspect`: --format)"
    )


# --------------------------------------------------------------------------------------------- writing
def schema_to_toml(sch: Schema, comments: dict[str, str] | None = None) -> str:
    """TOML text that :func:`load_schema` reads back to an equal schema; ``comments`` (feature name ->
    text) are written above each feature, e.g. the statistics an inferred choice was based on."""
    comments = comments or {}
    d = sch.to_dict()
    lines: list[str] = []
    for section in ("source", "label", "columns", "split"):
        if section in d:
            lines.append(f"[{section}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in d[section].items() if v is not None]
            lines.append("")
    for kind in ("dense", "sparse"):
        for entry in d[kind]:
            if entry["name"] in comments:
                lines.append(f"# {comments[entry['name']]}")
            lines.append(f"[[{kind}]]")
            lines += [f"{k} = {toml_value(v)}" for k, v in entry.items()]
            lines.append("")
    return "\n".join(lines)
