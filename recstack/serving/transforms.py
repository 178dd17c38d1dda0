"""The feature transforms a model was trained with, so a server can take raw feature values.

Three kinds, read from the prepared training data's ``meta.json`` (and ``vocab.npz`` / ``stats.json``) at
export and written as JSON (plus ``.npy`` vocabularies) into the artifact:

* ``criteo``: raw Criteo rows, fields named I1..I13 (integers, null = missing) and C1..C26 (1..8 hex digits,
  null or "" = missing). Dense: log(1 + max(x, 0)) in float64 rounded to float32, missing -> 0. Categorical:
  ``raw % max_ind_range`` (hash mode) or the sorted vocabulary's position + 1, 0 for missing / rare / unseen
  (vocabulary mode), exactly as ``recstack data prepare`` (``recstack.data.prepare.criteo_prepare``).
* ``schema``: rows named by the schema's source columns, parsed and encoded by the data layer's own
  ``parse_chunk`` and ``Encoder`` with the schema and statistics the training data was prepared with
  (log1p / standardize, hash / vocab / identity, multi-hot bags, weights, shared tables, ``max_length``).
* ``ids``: no raw form is known (a synthetic data set): rows must carry encoded ids.

Every kind also takes encoded rows (``ids=True``): the prepared data's dense values (already transformed)
and sparse ids, named as the prepared features. Ids are then capped by ``model.max_table_size`` (modulo, as
the training loader does) and the model applies its own QR split.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from recstack.data.format import DataDescription
from recstack.data.prepare.criteo import DENSE_NAMES, SPARSE_NAMES, transform_dense
from recstack.data.prepare.encode import OOV, Encoder, EncodingState, parse_chunk
from recstack.data.prepare.readers.base import BadRowLog, DataError, RawChunk
from recstack.data.prepare.schema import ColumnsSpec, schema_from_dict
from recstack.data.prepare.schema_prepare import load_state
from recstack.serving.artifact import ArtifactError, RequestError
from recstack.serving.columns import broadcast_columns, criteo_columns, id_columns, split_fields

_HEX = re.compile(r"^[0-9a-fA-F]{1,8}$")
# Per feature: bag sizes [B] int64, ids [sum] int64, weights [sum] float32 or None.
Bags = list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]


def transforms_from_data(data: DataDescription) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """What the training data (a prepared set, a stream) says about its transforms -> (transforms.json document,
    {artifact path: array} of the arrays it refers to)."""
    info = data.info
    if info.get("source") == "criteo":
        cat = info.get("categorical", {})
        doc: dict[str, Any] = {"kind": "criteo", "dense_transform": info.get("dense_transform"), "mode": cat["mode"]}
        if cat["mode"] == "hash":
            doc["max_ind_range"] = int(cat["max_ind_range"])
            return doc, {}
        with np.load(data.path / cat["file"]) as z:  # arrays only: np.load never unpickles without allow_pickle
            vocabs = [np.asarray(z[n], np.uint64) for n in SPARSE_NAMES]
        # One sorted array of keys (feature << 32 | raw value) for all features: one searchsorted a request.
        keys = np.concatenate([(np.uint64(f) << np.uint64(32)) | v for f, v in enumerate(vocabs)])
        doc["vocab"] = {"keys": "transforms/criteo_vocab_keys.npy",
                        "starts": np.cumsum([0] + [len(v) for v in vocabs]).tolist()}
        return doc, {"transforms/criteo_vocab_keys.npy": keys}
    if info.get("reader") == "schema":
        schema = schema_from_dict(info["schema"], "the training data's schema")
        stats = data.path / "stats.json"
        state = load_state(stats) if stats.is_file() else EncodingState(
            {k: (float(v[0]), float(v[1])) for k, v in info.get("dense_stats", {}).items()})
        return {"kind": "schema", "schema": schema.to_dict(), "state": state.to_dict()}, {}
    return {"kind": "ids"}, {}


def _finite(value: Any, field: str, row: int) -> None:
    """NaN / Inf anywhere in a value (lists included) -> RequestError."""
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError("NaN or Inf is not a value", field, row)
    if isinstance(value, list | tuple):
        for v in value:
            _finite(v, field, row)


def _bad() -> int:
    raise ValueError("not a Criteo categorical value")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


_F32_MAX = float(np.finfo(np.float32).max)


def _float32(v: Any, field: str, row: int) -> None:
    """A number the model takes as float32: finite there too (1e300 is a finite JSON number, not a float32)."""
    if not _number(v):
        raise RequestError(f"expected a number, got {type(v).__name__}", field, row)
    if not -_F32_MAX <= v <= _F32_MAX:  # NaN fails this too
        raise RequestError(f"{v!r:.40} is outside float32's range", field, row)


class FeatureTransforms:
    """Raw or encoded request rows -> per-feature bags of capped ids and the dense matrix.

    ``features``: the manifest's feature list (name, rows, capped_rows, multi_hot, pooling, weighted), in
    the model's feature order; ``dense_names``: the prepared dense features, in order."""

    def __init__(self, doc: dict[str, Any], root: Path, features: list[dict[str, Any]], dense_names: list[str],
                 read: Callable[[str], np.ndarray]):
        self.kind = doc.get("kind")
        self.features, self.dense_names = features, dense_names
        self.feature_names = [f["name"] for f in features]
        self.rows = np.array([f["rows"] for f in features], np.int64)
        self.caps = np.array([f["capped_rows"] for f in features], np.int64)
        self.needs_weights = any(f["weighted"] or f["pooling"] == "mean" for f in features)
        if self.kind == "criteo":
            self.mode = doc["mode"]
            self.max_ind_range = int(doc.get("max_ind_range", 0))
            if self.mode == "vocabulary":
                self.vocab_keys = read(doc["vocab"]["keys"])
                self.vocab_starts = np.asarray(doc["vocab"]["starts"], np.int64)
            self.raw_fields = DENSE_NAMES + SPARSE_NAMES
        elif self.kind == "schema":
            self.schema = schema_from_dict(doc["schema"], "the artifact's schema")
            self.schema.columns = ColumnsSpec()  # example ids, timestamps and verticals are no model input
            self.encoder = Encoder(self.schema, EncodingState.from_dict(doc["state"]))
            self.raw_fields = [c for c in self.schema.input_columns() if c != self.schema.label.column]
            self._vocab_features = [i for i, s in enumerate(self.schema.sparse) if s.encoding == "vocab"]
        elif self.kind == "ids":
            self.raw_fields = []
        else:
            raise ArtifactError(f"{root}: transforms of unknown kind {self.kind!r}")
        self.id_fields = dense_names + self.feature_names
        self._feature_at = {name: k for k, name in enumerate(self.feature_names)}
        self._field_sets = {True: frozenset(self.id_fields), False: frozenset(self.raw_fields)}  # by ``ids``

    @staticmethod
    def load(root: Path, manifest: dict[str, Any], read: Callable[[str], np.ndarray]) -> FeatureTransforms:
        """``read(rel)``: an array of the artifact (``artifact.read_array``)."""
        doc = json.loads((root / manifest["transforms"]).read_text())
        return FeatureTransforms(doc, root, manifest["features"], manifest["model"]["dense_features"], read)

    # ---------------------------------------------------------------------------------------- checks
    def _check_keys(self, rows: list[dict[str, Any]], fields: list[str], what: str, finite_check: bool = True) -> None:
        """Every row an object with exactly ``fields``; with ``finite_check`` no NaN / Inf in any value (the
        Criteo path's type checks refuse every float instead, naming NaN / Inf where it is one)."""
        if not isinstance(rows, list) or not rows:
            raise RequestError("expected a non-empty list of rows")
        want = set(fields)
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise RequestError(f"a row must be an object of {what}", None, i)
            if r.keys() == want and not finite_check:  # the common case, checked in C
                continue
            for k in r:
                if k not in want:
                    raise RequestError(f"unknown field (the model takes {what})", str(k), i)
            for k in fields:
                if k not in r:
                    raise RequestError("missing", k, i)
                _finite(r[k], k, i)

    # ---------------------------------------------------------------------------------------- encoded
    def encode_ids(self, rows: list[dict[str, Any]]) -> tuple[np.ndarray, Bags, dict[str, int]]:
        """Encoded rows: dense names -> numbers, sparse names -> an id, a list of ids (multi-hot), or for a
        weighted feature {"ids": [...], "weights": [...]}. -> (dense float32 [B, d], bags, OOV counts).
        The common form (numbers and one id a feature) is checked and converted a column at a time; anything
        else, or any value that fails those checks, goes through ``encode_ids_each`` (which names it)."""
        what = "encoded dense values and sparse ids: " + ", ".join(self.id_fields)
        self._check_keys(rows, self.id_fields, what, finite_check=False)
        fast = self._ids_by_column(rows)
        return fast if fast is not None else self.encode_ids_each(rows)

    def _ids_by_column(self, rows: list[dict[str, Any]]) -> tuple[np.ndarray, Bags, dict[str, int]] | None:
        """Vectorised ``encode_ids`` of rows whose values are all of the common form and in range
        (``columns.id_columns``); None when any is not."""
        if any(f["multi_hot"] or f["weighted"] for f in self.features):
            return None
        cols = id_columns(rows, self.dense_names, self.feature_names, self.rows)
        return None if cols is None else self._id_bags(*cols)

    @staticmethod
    def _id_bags(dense: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, Bags, dict[str, int]]:
        """dense float32 [B, d] and one id a bag [F, B] -> (dense, bags, no OOV counts)."""
        ones = np.ones(ids.shape[1], np.int64)
        return dense, [(ones, ids[k], None) for k in range(len(ids))], {}

    def encode_ids_each(self, rows: list[dict[str, Any]]) -> tuple[np.ndarray, Bags, dict[str, int]]:
        """``encode_ids`` value by value, naming the first bad one (RequestError)."""
        self._check_keys(rows, self.id_fields, "encoded dense values and sparse ids: " + ", ".join(self.id_fields))
        dense = np.zeros((len(rows), len(self.dense_names)), np.float32)
        for j, name in enumerate(self.dense_names):
            for i, r in enumerate(rows):
                _float32(r[name], name, i)
                dense[i, j] = r[name]
        bags: Bags = []
        for spec in self.features:
            name = spec["name"]
            lengths: list[int] = []
            ids: list[int] = []
            weights: list[float] = []
            for i, r in enumerate(rows):
                v, w = r[name], None
                if spec["weighted"] and isinstance(v, dict):
                    if set(v) != {"ids", "weights"}:
                        raise RequestError('expected {"ids": [...], "weights": [...]}', name, i)
                    v, w = v["ids"], v["weights"]
                    if not isinstance(w, list):
                        raise RequestError("weights must be a list of numbers", name, i)
                    for x in w:
                        _float32(x, name, i)
                vals = v if spec["multi_hot"] and isinstance(v, list) else [v]
                if not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
                    kind = "an id or a list of ids" if spec["multi_hot"] else "an integer id"
                    raise RequestError(f"expected {kind}, got {v!r:.60}", name, i)
                if w is not None and len(w) != len(vals):
                    raise RequestError(f"{len(w)} weights for {len(vals)} ids", name, i)
                bad = [x for x in vals if not 0 <= x < spec["rows"]]
                if bad:
                    raise RequestError(f"id {bad[0]} outside the table's rows 0..{spec['rows'] - 1}", name, i)
                lengths.append(len(vals))
                ids.extend(vals)
                weights.extend(w if w is not None else [1.0] * len(vals))
            ln = np.array(lengths, np.int64)
            bags.append((ln, np.array(ids, np.int64), np.array(weights, np.float32)))
        return dense, bags, {}

    # ---------------------------------------------------------------------------------------- one user
    def encode_candidates(self, shared: dict[str, Any], candidates: list[Any],
                          ids: bool) -> tuple[np.ndarray, Bags, dict[str, int]] | None:
        """One user, many candidates (row i = ``{**shared, **candidates[i]}``) with the shared fields read once
        (``columns``): what ``encode_ids`` / ``encode_raw`` give for those rows (but dense of one row [1, d] when
        ``shared`` holds every dense feature: the rows' dense features), or None when the request is
        not of the common form (the fields not split exactly between the two parts, a value to check one by
        one, a multi-hot or weighted feature, a schema's raw fields): the caller then encodes the rows."""
        if ids and any(f["multi_hot"] or f["weighted"] for f in self.features) or not ids and self.kind != "criteo":
            return None
        own = split_fields(shared, candidates, self._field_sets[ids])
        if own is None:
            return None
        mine = set(own)
        dense_names = self.dense_names if ids else DENSE_NAMES
        sparse_names = self.feature_names if ids else SPARSE_NAMES
        parts = [([x for x in dense_names if x not in mine], [x for x in sparse_names if x not in mine]),
                 ([x for x in dense_names if x in mine], [x for x in sparse_names if x in mine])]
        cols = []
        for rows, (dn, sn) in zip(([shared], candidates), parts, strict=True):
            col = (id_columns(rows, dn, sn, self.rows[[self._feature_at[x] for x in sn]]) if ids
                   else criteo_columns(rows, dn, sn))
            if col is None:
                return None
            cols.append(col)
        n = len(candidates)
        (sd, ss), (cd, cs) = cols
        (sdn, ssn), (cdn, csn) = parts
        # Every dense feature shared: one row of them (the model's bottom MLP then runs once, ``DenseProgram``).
        dense = sd if not cdn else broadcast_columns(dense_names, sd, sdn, cd, cdn, n, axis=1)
        if ids:  # ids [F, n]
            return self._id_bags(dense, broadcast_columns(sparse_names, ss, ssn, cs, csn, n, axis=0))
        return self._criteo_bags(dense, broadcast_columns(sparse_names, ss, ssn, cs, csn, n, axis=1))

    # ---------------------------------------------------------------------------------------- raw
    def encode_raw(self, rows: list[dict[str, Any]]) -> tuple[np.ndarray, Bags, dict[str, int]]:
        """Raw rows as in the data -> (dense float32 [B, d], bags, {feature: values mapped to the
        out-of-vocabulary row})."""
        if self.kind == "ids":
            raise RequestError("this model's training data has no raw form (synthetic ids): send encoded ids")
        self._check_keys(rows, self.raw_fields, "raw fields: " + ", ".join(self.raw_fields), self.kind != "criteo")
        return self._criteo(rows) if self.kind == "criteo" else self._schema(rows)

    def _criteo(self, rows: list[dict[str, Any]]) -> tuple[np.ndarray, Bags, dict[str, int]]:
        """Raw Criteo rows -> (dense float32 [B, 13], bags, OOV counts). All values of a kind go
        through one list and one array (a lone row costs a few numpy calls, not a few per field);
        when any is wrong, ``_criteo_error`` goes field by field to name it."""
        cols = criteo_columns(rows, DENSE_NAMES, SPARSE_NAMES)
        return self._criteo_bags(*(cols if cols is not None else self._criteo_each(rows)))

    def _criteo_each(self, rows: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """``criteo_columns`` through Python's own parsers, for rows it did not take: (dense float32 [B, 13],
        raw categoricals int64 [B, 26]), or RequestError naming the first bad value."""
        n = len(rows)
        values = [r[name] for r in rows for name in DENSE_NAMES]
        big = 10**18
        in_range = (type(v) is int and -big < v < big or v is None for v in values)  # noqa: E721
        if not all(in_range):
            self._criteo_error(rows)
        raw = np.array([0 if v is None else v for v in values], np.int64)
        dense = transform_dense(raw.reshape(n, len(DENSE_NAMES)), in_place=True)  # [B, 13]
        texts = [r[name] for r in rows for name in SPARSE_NAMES]
        try:
            hexes = [0 if v is None or v == "" else (int(v, 16) if _HEX.match(v) else _bad()) for v in texts]
            return dense, np.array(hexes, np.int64).reshape(n, len(SPARSE_NAMES))  # [B, 26]
        except (TypeError, ValueError):
            self._criteo_error(rows)
            raise

    def _criteo_bags(self, dense: np.ndarray, cats: np.ndarray) -> tuple[np.ndarray, Bags, dict[str, int]]:
        """dense float32 [B or 1, 13] and the raw categoricals int64 [B, 26] -> (dense, bags, OOV counts)."""
        if self.mode == "hash":
            ids = cats % self.max_ind_range
            oov: dict[str, int] = {}
        else:  # as criteo_vocab.apply_vocabularies: position + 1 in the feature's vocabulary, 0 if not there
            keys = (np.arange(len(SPARSE_NAMES), dtype=np.uint64) << np.uint64(32)) | cats.astype(np.uint64)
            pos = np.searchsorted(self.vocab_keys, keys)
            found = self.vocab_keys[np.minimum(pos, len(self.vocab_keys) - 1)] == keys
            ids = np.where(found, pos - self.vocab_starts[:-1] + 1, 0)
            unseen = ((cats != 0) & ~found).sum(axis=0)
            oov = {name: int(c) for name, c in zip(SPARSE_NAMES, unseen, strict=True)}
        ones = np.ones(len(cats), np.int64)
        return dense, [(ones, ids[:, j], None) for j in range(len(SPARSE_NAMES))], oov

    @staticmethod
    def _criteo_error(rows: list[dict[str, Any]]) -> None:
        """Raise RequestError naming the first bad value of raw Criteo rows (field by field)."""
        for name in DENSE_NAMES:
            for i, v in enumerate(r[name] for r in rows):
                if isinstance(v, float) and not math.isfinite(v):
                    raise RequestError("NaN or Inf is not a value", name, i)
                if type(v) is not int and v is not None:  # noqa: E721 (no bool)
                    raise RequestError(f"expected an integer or null, got {v!r:.60}", name, i)
                if v is not None and abs(v) >= 10**18:
                    raise RequestError("integer has more than 18 digits", name, i)
        for name in SPARSE_NAMES:
            for i, v in enumerate(r[name] for r in rows):
                if isinstance(v, float) and not math.isfinite(v):
                    raise RequestError("NaN or Inf is not a value", name, i)
                if not (v is None or v == "" or isinstance(v, str) and _HEX.match(v)):
                    raise RequestError(
                        f"expected 1..8 hex digits, \"\" or null, got {v!r:.60}", name, i)

    def _schema(self, rows: list[dict[str, Any]]) -> tuple[np.ndarray, Bags, dict[str, int]]:
        sch, n = self.schema, len(rows)
        columns: dict[str, pa.Array] = {}
        dense_cols = {d.column for d in sch.dense}
        for c in self.raw_fields:
            values = [r[c] for r in rows]
            if c in dense_cols:
                for i, v in enumerate(values):
                    if v is not None:
                        _float32(v, c, i)
            else:  # one text form for ids given as numbers in some rows and text in others ("12" either way)
                kinds = {type(x) for v in values for x in (v if isinstance(v, list) else [v]) if x is not None}
                if str in kinds and len(kinds) > 1:
                    values = [[str(x) for x in v] if isinstance(v, list) else (None if v is None else str(v))
                              for v in values]
            try:
                columns[c] = pa.array(values)
            except (pa.ArrowException, OverflowError) as e:  # an integer past int64 overflows
                raise RequestError(f"values of a type the column cannot hold ({e})", c) from None
        lab = sch.label
        label = lab.min if lab.min is not None else (0.0 if lab.max is None or lab.max >= 0 else lab.max)
        columns[lab.column] = pa.array(np.full(n, label, np.float64))
        chunk = RawChunk(pa.table(columns), "request", np.arange(n), "row", first=0)
        try:
            parsed = parse_chunk(chunk, sch, BadRowLog(skip=False))
        except (pa.ArrowException, OverflowError) as e:  # a value Arrow cannot cast to the column's type
            raise RequestError(f"a value the schema's types cannot hold ({e})") from None
        except DataError as e:
            row = int(e.where.rsplit(" ", 1)[-1]) if e.where.startswith("request row") else None
            shown = "" if e.value is None else f" (got {e.value!r:.60})"
            raise RequestError(f"{e.reason}{shown}", e.column, row) from None
        arrays = self.encoder.encode(parsed)
        bad = np.argwhere(~np.isfinite(arrays["dense"]))
        if len(bad):  # a finite value its transform takes out of float32 (standardizing 3e38)
            raise RequestError("its transformed value is not finite in float32", sch.dense[bad[0][1]].column,
                               int(bad[0][0]))
        bags: Bags = []
        col, oov = 0, {}
        for k, s in enumerate(sch.sparse):
            if s.multi_hot:
                lengths, ids, w = arrays["jagged"][s.name]
                bags.append((lengths.astype(np.int64), ids.astype(np.int64), w))
            else:
                ids = arrays["sparse"][:, col].astype(np.int64)
                col += 1
                bags.append((np.ones(n, np.int64), ids, None))
            if k in self._vocab_features:
                oov[s.name] = int((bags[-1][1] == OOV).sum())
        return arrays["dense"], bags, oov
