"""A loaded serving artifact: encode request rows, score them.

Contract (what ``recstack serve`` and any other caller build on)::

    model = ServingModel.load(model_dir, device="cpu", verify=True)
        Reads an artifact written by ``recstack export`` (``recstack.serving.artifact``). With ``verify`` every
        file's size and sha256 are checked against the manifest first; a missing, truncated, tampered or
        unlisted file raises ``ArtifactError`` naming it. Arrays (tables, vocabularies) are read whole into
        memory and checked on the bytes read, never memory-mapped, so a file changed under a running server
        changes nothing it serves (``recstack serve --workers N`` loads once and forks: the workers share
        them); on another device they are copied there. Nothing is unpickled (see ``load_program``).
    model = ServingModel.load(delta_dir, device, base=served_model)
        A delta (``recstack.serving.delta``, written by ``publish.Publisher``) applied to the model it was made on
        (its version and manifest checksum); any other base, or none, is an ArtifactError. ``served_model`` is
        never modified: changed table groups are new arrays, unchanged ones are shared with it.
    model.version: int          the artifact's version (its directory number in a versions directory)
    model.manifest_sha256: str  sha256 of its manifest file (what a delta names as its base)
    model.groups                table group -> QuantizedRows (the stacked tables of one width)
    model.manifest: dict        the manifest (format, source checkpoint, model config, features, tables)
    model.path: Path            the artifact directory
    model.feature_names         the sparse features in model order (OOV counters are keyed by these)
    model.raw_fields            the field names raw rows carry (Criteo I1..I13, C1..C26, or the schema's columns)
    model.id_fields             the field names encoded rows carry (prepared dense names + sparse feature names)

    batch = model.encode(rows, ids=False) -> EncodedBatch
        rows: list of dicts. Raw (``ids=False``): values as in the raw data, every raw field present (null =
        a missing value, as an empty field of the file). Encoded (``ids=True``): prepared dense values and
        sparse ids (an int; a list for multi-hot; {"ids": [...], "weights": [...]} for a weighted feature).
        A missing or unknown field, a wrong type, NaN / Inf, an id outside its table raise ``RequestError``
        (``.field``, ``.row``). A category the training data did not have maps to the row the trained
        transforms give it (Criteo vocabulary: row 0; schema vocab: row 1) and is counted in
        ``batch.oov_counts[feature]``.
    batch = model.encode_candidates(shared, candidates, ids=False) -> EncodedBatch
        One user, many candidates: row i is ``{**shared, **candidates[i]}``; a field in both is a RequestError.
        The same batch as ``encode`` of those rows, the shared fields read once (``FeatureTransforms``).
    logits = model.score(batch) -> torch.Tensor float32 [B] on CPU (no grad; it mutates nothing, so threads may
        call it at once; probabilities are ``torch.sigmoid(logits)``)

    EncodedBatch(dense [R, n_dense] float32, sparse SparseFeatures, oov_counts={}, one_id_per_bag=False,
                 dense_row=None)   (dense_row [B] int64: row i's dense features are dense[dense_row[i]]; None:
        R = B, row i's are dense[i]. ``encode_candidates`` sends the shared dense features once: R = 1)
    EncodedBatch.concat(batches) -> EncodedBatch   (dynamic batching: rows in order; split the logits by
        ``batch.size``)

Errors: ``ArtifactError`` and ``RequestError`` (``recstack.serving.artifact``), both ``RecstackError`` and
``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.export.passes import move_to_device_pass

from recstack.data.batch import SparseFeatures
from recstack.embedding.qr import QRSplit
from recstack.models.build import table_configs
from recstack.serving.artifact import MANIFEST, ArtifactError, RequestError, read_array, read_manifest
from recstack.serving.compile import example_inputs
from recstack.serving.delta import IdMap, apply_delta, apply_id_map_delta, delta_base
from recstack.serving.quantized import QuantizedEmbeddingCollection, QuantizedRows
from recstack.serving.transforms import Bags, FeatureTransforms

__all__ = ["EncodedBatch", "ServingModel", "check_program_pickle_free", "load_program"]


@dataclass
class EncodedBatch:
    """Model inputs of ``size`` rows: dense float32 [R, n_dense] (R = B unless ``dense_row`` is given);
    sparse: F features of capped ids as the training loader gives them (before the model's QR split);
    oov_counts: feature -> values of this batch that mapped to the out-of-vocabulary row; dense_row [B]
    int64: the row of ``dense`` each row takes (None: its own)."""

    dense: torch.Tensor
    sparse: SparseFeatures
    oov_counts: dict[str, int] = field(default_factory=dict)
    one_id_per_bag: bool = False  # every bag holds one id (offsets = 0..F*B): concat is a reshape
    dense_row: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.dense.shape[0] if self.dense_row is None else self.dense_row.shape[0])

    def dense_rows(self) -> torch.Tensor:
        """dense_row, or [0 .. B) when every row has its own."""
        return self.dense_row if self.dense_row is not None else torch.arange(self.size)

    @staticmethod
    def concat(batches: list[EncodedBatch]) -> EncodedBatch:
        """The rows of every batch, in order, as one batch (feature-major ids re-interleaved)."""
        if len(batches) == 1:
            return batches[0]
        f = batches[0].sparse.num_features
        oov: dict[str, int] = {}
        for b in batches:
            for k, v in b.oov_counts.items():
                oov[k] = oov.get(k, 0) + v
        dense = torch.cat([b.dense for b in batches])
        dense_row = None
        if any(b.dense_row is not None for b in batches):  # each batch's rows, shifted past the earlier dense rows
            starts = np.cumsum([0] + [len(b.dense) for b in batches[:-1]]).tolist()
            dense_row = torch.cat([b.dense_rows() + s for b, s in zip(batches, starts, strict=True)])
        if all(b.one_id_per_bag for b in batches):
            ids = torch.cat([b.sparse.ids.view(f, -1) for b in batches], dim=1).reshape(-1)
            ws = [b.sparse.weights for b in batches]
            w = torch.cat([x.view(f, -1) for x in ws], dim=1).reshape(-1) if ws[0] is not None else None  # type: ignore[union-attr]
            return EncodedBatch(dense, SparseFeatures(ids, torch.arange(ids.numel() + 1), f, w), oov, True, dense_row)
        id_parts: list[torch.Tensor] = []
        length_parts: list[torch.Tensor] = []
        weight_parts: list[torch.Tensor] = []
        for feat in range(f):
            for b in batches:
                s = b.sparse.feature_slice(feat, feat + 1)
                id_parts.append(s.ids)
                length_parts.append(s.lengths)
                if s.weights is not None:
                    weight_parts.append(s.weights)
        ln = torch.cat(length_parts)
        offsets = torch.cat([ln.new_zeros(1), ln.cumsum(0)])
        w = torch.cat(weight_parts) if weight_parts else None
        return EncodedBatch(dense, SparseFeatures(torch.cat(id_parts), offsets, f, w), oov, dense_row=dense_row)


def check_program_pickle_free(path: Path) -> None:
    """Refuse a ``.pt2`` archive in which ``torch.export.load`` (torch 2.13) would unpickle something:
    pickled weights or constants (tensor subclasses, loaded with ``torch.load(weights_only=False)``),
    torchbind / opaque object constants (``pickle.loads``) or non-empty sample inputs (``torch.load``, which
    falls back to ``weights_only=False`` when the restricted load fails). ``recstack export`` writes none."""
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                name = info.filename
                if "/data/sample_inputs/" in name and info.file_size:
                    raise ArtifactError(f"{path}: holds pickled sample inputs ({name}); refused")
                if name.endswith("_config.json") and ("/data/weights/" in name or "/data/constants/" in name):
                    for key, entry in json.loads(z.read(name))["config"].items():
                        if entry.get("use_pickle") or not str(entry.get("path_name", "")).startswith(
                                ("weight_", "tensor_")):
                            raise ArtifactError(f"{path}: {key!r} is a pickled object ({name}); refused")
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        if isinstance(e, ArtifactError):
            raise
        raise ArtifactError(f"{path}: not a torch.export archive ({e})") from e


def load_exported(path: Path, device: torch.device) -> torch.export.ExportedProgram:
    """The exported dense program on ``device``, after ``check_program_pickle_free``. The program is moved by
    torch.export's ``move_to_device_pass``, not by ``Module.to``: a program traced on the CPU holds
    ``device=cpu`` in the operators that make tensors (the QR combine's identity row), which ``.to`` leaves."""
    check_program_pickle_free(path)
    try:
        ep = torch.export.load(path)
    except Exception as e:  # a damaged archive raises many kinds of errors
        raise ArtifactError(f"{path}: torch.export.load failed ({type(e).__name__}: {e})") from e
    return move_to_device_pass(ep, device)


def load_program(path: Path, device: torch.device) -> torch.nn.Module:
    """The exported dense program as a module on ``device`` (``load_exported``)."""
    return load_exported(path, device).module()


class ServingModel:
    """See the module docstring for the contract."""

    def __init__(self, path: Path, manifest: dict[str, Any], device: torch.device, verify: bool = True,
                 base: ServingModel | None = None, manifest_sha256: str = "") -> None:
        self.path, self.manifest, self.device, self.verify = path, manifest, device, verify
        self.manifest_sha256 = manifest_sha256  # what a delta names as its base
        self.version = int(manifest["version"])
        m = manifest["model"]
        self.num_dense = int(m["num_dense"])
        if base is not None:  # a delta: the base's groups, the changed ones copied with their new rows
            self.groups: dict[str, QuantizedRows] = apply_delta(base.groups, base.manifest, path, manifest,
                                      lambda rel: read_array(path, manifest, rel, verify), device)
        else:
            self.groups = {}
            # A group of tables per width, or per width and dim with per-table dims (artifacts written before
            # those name the group by its width, their dim is the model's).
            for key, f in manifest["table_files"].items():
                data = self._array(f["data"], f["data_shape"], f["data_dtype"])
                sb = self._array(f["scale_bias"], [f["data_shape"][0], 2], "float16") if f["scale_bias"] else None
                self.groups[key] = QuantizedRows(f.get("width", key), int(f.get("dim", m["embedding_dim"])), data,
                                                 sb, device)
        groups = list(self.groups.values())
        index = {key: i for i, key in enumerate(self.groups)}
        tables = manifest["tables"]
        slot = {f: t for t in tables for f in t["features"]}  # collection feature -> its table
        feats = range(len(slot))
        self.collection = QuantizedEmbeddingCollection(groups, [index[slot[f].get("group", slot[f]["width"])]
                                                                for f in feats], [slot[f]["offset"] for f in feats],
                                                       flat=m.get("feature_dims") is not None)
        self.qr: QRSplit | None = None
        if m.get("qr"):
            q, feats = m["qr"], manifest["features"]
            raw = table_configs([f["capped_rows"] for f in feats], int(m["embedding_dim"]), [f["table"] for f in feats])
            self.qr = QRSplit.build(raw, q["collisions"], q["threshold"], q["operation"])
        self.program_path = path / manifest["dense_program"]["file"]
        ep = load_exported(self.program_path, device)
        self.program = ep.module()
        # (shape without the batch dimension, dtype) of each input of the program: what a probe batch needs
        self.input_specs = [(list(t.shape[1:]), t.dtype) for t in example_inputs(ep, 1)]
        # Programs exported before ``dense_row`` take dense [B, n_dense]: shared dense rows are repeated for them.
        self.takes_dense_row = "dense_row" in manifest["dense_program"].get("inputs", [])
        # The graph itself, without the hooks of torch.export's unlifted module (a check that its state was
        # not reassigned and one of the input constraints, on every call): they cost more than the graph at
        # small batches (batch 1: 0.9 ms a score with them, 0.35 ms without, measured), and the inputs are
        # built by score() below, so the constraints hold by construction.
        self._dense = self._graph = self.program.forward
        self.compiled = False  # running the native code of ``compile`` instead of the graph
        if base is not None and manifest["delta"].get("transforms") == "base":
            self.transforms: FeatureTransforms = base.transforms  # unchanged since the base (read-only once loaded)
        else:
            self.transforms = FeatureTransforms.load(path, manifest,
                                                     lambda rel: read_array(path, manifest, rel, verify))
        self.feature_names = self.transforms.feature_names
        # Dynamic id tables: per feature, (raw ids ascending, their rows); unknown ids score with row 0.
        self.id_maps: dict[int, IdMap] = {}
        self.table_id_maps: dict[str, IdMap] = {}  # the same per table: what a delta's owner changes apply to
        capacity = {t["name"]: int(t["rows"]) for t in tables}
        for name, e in manifest.get("dynamic_ids", {}).items():
            if "owner_rows" in e:  # a delta: the base's map with the rows whose owner changed
                if base is None or name not in base.table_id_maps:
                    raise ArtifactError(f"{path / 'manifest.json'}: dynamic_ids.{name}: a delta of an id map "
                                        "needs its base's map")
                id_map = apply_id_map_delta(base.table_id_maps[name], e, capacity[name], path,
                                            lambda rel: read_array(path, manifest, rel, verify))
            else:
                id_map = (self._array(e["ids"], [e["count"]], "int64"),
                          self._array(e["rows"], [e["count"]], "int64"))
            self.table_id_maps[name] = id_map
            for k, f in enumerate(manifest["features"]):
                if f["table"] == name:
                    self.id_maps[k] = id_map
        self.raw_fields, self.id_fields = self.transforms.raw_fields, self.transforms.id_fields
        self._capped = self.transforms.caps < self.transforms.rows  # [F]: features whose ids are taken modulo

    def _array(self, rel: str, shape: list[int], dtype: str) -> np.ndarray:
        a = read_array(self.path, self.manifest, rel, self.verify)
        if list(a.shape) != list(shape) or a.dtype != np.dtype(dtype):
            raise ArtifactError(f"{self.path / rel}: {a.dtype} {list(a.shape)}, the manifest says {dtype} "
                                f"{list(shape)}")
        return a

    @staticmethod
    def load(model_dir: str | Path, device: str | torch.device = "cpu", verify: bool = True,
             base: ServingModel | None = None) -> ServingModel:
        """A full artifact, or a delta (``recstack.serving.delta``) applied to ``base``, the model it was made on
        (a delta on any other base, or none, is an ArtifactError); ``base`` is never modified."""
        path = Path(model_dir)
        # Arrays are checked as they are read into memory (read_array), every other file here.
        manifest = read_manifest(path, verify, hashed_when_read=lambda rel: rel.endswith(".npy"))
        sha = hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()
        try:
            want = delta_base(manifest)
            if want is None:
                base = None
            elif base is None or base.version != want:
                served = "no model" if base is None else f"version {base.version}"
                raise ArtifactError(f"{path / MANIFEST}: a delta on version {want}, but the base in use is {served}")
            elif base.manifest_sha256 != manifest["delta"]["base"]["manifest_sha256"]:
                raise ArtifactError(f"{path / MANIFEST}: a delta on another version {want} than the one in use "
                                    "(its manifest checksum differs)")
            return ServingModel(path, manifest, torch.device(device), verify, base, sha)
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"{path / 'manifest.json'}: incomplete manifest ({type(e).__name__}: {e})") from e

    # ------------------------------------------------------------------------------------------ encode
    def encode(self, rows: list[dict[str, Any]], ids: bool = False) -> EncodedBatch:
        t = self.transforms
        dense, bags, oov = t.encode_ids(rows) if ids else t.encode_raw(rows)
        return self._batch(dense, bags, oov)

    def encode_candidates(self, shared: dict[str, Any], candidates: list[dict[str, Any]],
                          ids: bool = False) -> EncodedBatch:
        if not isinstance(shared, dict):
            raise RequestError("shared features must be an object", "shared")
        if not isinstance(candidates, list) or not candidates:
            raise RequestError("expected a non-empty list of candidates", "candidates")
        fast = self.transforms.encode_candidates(shared, candidates, ids)  # the shared fields read once
        if fast is not None:
            return self._batch(*fast)
        rows = []
        for i, c in enumerate(candidates):
            if not isinstance(c, dict):
                raise RequestError("a candidate must be an object", None, i)
            both = shared.keys() & c.keys()
            if both:
                raise RequestError("given both in shared and in a candidate", sorted(both)[0], i)
            rows.append({**shared, **c})
        return self.encode(rows, ids)

    def _batch(self, dense: np.ndarray, bags: Bags, oov: dict[str, int]) -> EncodedBatch:
        """Per-feature bags -> feature-major SparseFeatures with ids capped (modulo, as the loader does) and
        the weights the prepared data gives (mean pooling: 1 / bag size). ``dense`` of one row for bags of
        more: every row's dense features (one user's, from ``encode_candidates``)."""
        t = self.transforms
        f = len(bags)
        n = len(bags[0][0]) if bags else len(dense)
        dense_t = torch.from_numpy(np.ascontiguousarray(dense, np.float32))
        dense_row = torch.zeros(n, dtype=torch.int64) if len(dense) != n else None
        if not any(s["multi_hot"] for s in t.features):  # one id a bag: [F, B] ids, capped at once
            ids = np.stack([b[1] for b in bags])
            if self.id_maps:
                ids = np.stack([self._rows(k, row) for k, row in enumerate(ids)])
            elif self._capped.any():  # every feature's modulo in one numpy call, not one a feature
                ids = np.where(self._capped[:, None], ids % t.caps[:, None], ids)
            w = torch.ones(f * n) if t.needs_weights else None
            sparse = SparseFeatures(torch.from_numpy(ids.reshape(-1)), torch.arange(f * n + 1), f, w)
            return EncodedBatch(dense_t, sparse, oov, one_id_per_bag=True, dense_row=dense_row)
        id_parts: list[np.ndarray] = []
        length_parts: list[np.ndarray] = []
        weight_parts: list[np.ndarray] = []
        for k, (ln, fid, bag_w) in enumerate(bags):
            id_parts.append(self._rows(k, fid))
            length_parts.append(ln)
            wk: np.ndarray = np.ones(len(fid), np.float32) if bag_w is None else bag_w.astype(np.float32)
            if t.features[k]["pooling"] == "mean":
                wk = wk / np.repeat(np.maximum(ln, 1), ln).astype(np.float32)
            weight_parts.append(wk)
        ln = np.concatenate(length_parts)
        offsets = np.zeros(len(ln) + 1, np.int64)
        np.cumsum(ln, out=offsets[1:])
        sparse = SparseFeatures(torch.from_numpy(np.concatenate(id_parts).astype(np.int64)),
                                torch.from_numpy(offsets), f,
                                torch.from_numpy(np.concatenate(weight_parts)) if t.needs_weights else None)
        return EncodedBatch(dense_t, sparse, oov, dense_row=dense_row)

    def _rows(self, k: int, ids: np.ndarray) -> np.ndarray:
        """Feature ``k``'s ids [n] -> rows of its table: through its id map (dynamic ids: unknown -> 0), else
        capped (modulo, as the training loader does)."""
        m = self.id_maps.get(k)
        if m is None:
            cap = self.transforms.caps[k]
            return ids % cap if cap < self.transforms.rows[k] else ids
        keys, rows = m
        if not keys.size:
            return np.zeros_like(ids)
        pos = np.minimum(np.searchsorted(keys, ids), keys.size - 1)
        return np.where(keys[pos] == ids, rows[pos], 0)

    # ------------------------------------------------------------------------------------------ score
    def probe_inputs(self, rows: int) -> list[torch.Tensor]:
        """Zeros shaped like the dense program's inputs for ``rows`` rows (to check a compiled program)."""
        return [torch.zeros([rows, *shape], dtype=dtype) for shape, dtype in self.input_specs]

    def graph_forward(self, *args: torch.Tensor) -> torch.Tensor:
        """The exported graph on the dense program's inputs, whatever runs ``score``."""
        return self._graph(*args)

    def use_compiled(self, program: Callable[..., torch.Tensor]) -> None:
        """Score with ``program`` (``compile.load_checked``: the graph compiled, checked against it) from now on:
        one reference assignment, so a call in flight finishes on what it started with."""
        self._dense = program
        self.compiled = True

    @torch.inference_mode()
    def score(self, batch: EncodedBatch) -> torch.Tensor:
        sparse = batch.sparse.to(self.device)
        if self.qr is not None:
            sparse = self.qr.split(sparse)
        pooled = self.collection(sparse, batch.one_id_per_bag and self.qr is None)  # (QR splits the bags)
        if not self.num_dense:
            return self._dense(pooled).float().cpu()
        dense = batch.dense.to(self.device)
        if not self.takes_dense_row:
            dense = dense if batch.dense_row is None else dense.index_select(0, batch.dense_row.to(self.device))
            return self._dense(pooled, dense).float().cpu()
        return self._dense(pooled, dense, batch.dense_rows().to(self.device)).float().cpu()
