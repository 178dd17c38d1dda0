"""``recstack export``: a trained checkpoint -> a serving artifact (layout in ``recstack.serving.artifact``).

The model is read by ``recstack.training.inference.load_model`` (a single-process, cached-tier or torchrun
sharded checkpoint, or a run directory's newest), so every table arrives whole in one process. The artifact
holds three parts:

* the dense part, everything after the pooled embeddings (the QR combine of split tables, bottom MLP,
  interaction, top MLP), through ``torch.export`` with a dynamic batch dimension, saved as ``dense.pt2``
  without sample inputs (so that loading it unpickles nothing; see ``ServingModel``);
* every table of the collection (after the QR split, i.e. quotient and remainder tables) quantized row-wise
  to its width (``--tables`` for all, ``--table NAME=WIDTH`` for one), the tables of one width stacked in one
  file;
* the feature transforms of the prepared training data (``recstack.serving.transforms``).

An ExFM vertical model is exported through :func:`export_model` with ``VerticalModel.serving_model()`` (its
serving path is a DLRM); ExFM stream checkpoints are not train checkpoints, so ``load_model`` (and the command
line) does not read them.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from recstack import __version__
from recstack.config import Config
from recstack.data.format import DataDescription
from recstack.data.prepared_dataset import PreparedDataset
from recstack.embedding.collection import EmbeddingCollection
from recstack.io import check_free_space
from recstack.models.dlrm import DLRM
from recstack.serving.artifact import ArtifactError, write_artifact
from recstack.serving.quantized import (
    LEVELS,
    WIDTHS,
    GroupArrays,
    bytes_per_row,
    code_columns,
    open_group,
    write_table,
)
from recstack.serving.transforms import transforms_from_data
from recstack.training.inference import check_data, load_model, run_directory

PROGRAM_FILE = "dense.pt2"
TRANSFORMS_FILE = "transforms.json"


class DenseProgram(nn.Module):
    """The model after its embedding lookup: pooled [B, F', D] (F' = F + split features; with per-table dims
    ``model.table_dims`` [B, sum of feature dims], projected here), dense [R, n_dense] and dense_row [B] int64
    (row i's dense features are ``dense[dense_row[i]]``; both absent without dense features) -> logits [B].

    ``dense_row`` lets rows share their dense features: one user's request of 100 candidates sends its dense
    features once (R = 1) and the bottom MLP runs once for it, not 100 times (the rows' bottom outputs are
    gathered after it); a batch of independent rows sends R = B and ``arange(B)``."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.bottom, self.interaction, self.top, self.qr = model.bottom, model.interaction, model.top, model.qr
        self.projection = model.projection

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor | None = None,
                dense_row: torch.Tensor | None = None) -> torch.Tensor:
        if self.projection is not None:
            emb = self.projection(pooled)
        else:
            emb = self.qr.combine(pooled) if self.qr is not None else pooled
        x = self.bottom(dense) if self.bottom is not None else None
        if x is not None and dense_row is not None:
            x = x.index_select(0, dense_row)  # [R, D] -> [B, D]
        return self.top(self.interaction(x, emb)).squeeze(1)


def export_program(model: DLRM, path: Path) -> None:
    """torch.export the dense part with dynamic batch and dense-row dimensions (1 .. any each) and save it to
    ``path``."""
    prog = DenseProgram(model).eval()
    f = model.qr.num_split_features if model.qr is not None else model.embeddings.num_features
    d, b = model.embeddings.embedding_dim, 4
    device = next(model.parameters()).device
    batch = torch.export.Dim("batch", min=1)
    shape = (b, sum(model.embeddings.feature_dims)) if model.projection is not None else (b, f, d)
    args: tuple[torch.Tensor, ...] = (torch.randn(*shape, device=device),)
    shapes: dict[str, Any] = {"pooled": {0: batch}}
    if model.num_dense:  # fewer dense rows than rows in the example: the two dimensions are traced apart
        args += (torch.randn(b - 1, model.num_dense, device=device),
                 torch.tensor([0, 1, 2, 0][:b], device=device))
        shapes["dense"] = {0: torch.export.Dim("dense_rows", min=1)}
        shapes["dense_row"] = {0: batch}
    with torch.no_grad(), warnings.catch_warnings():
        # torch 2.13's own notices while tracing and saving (a deprecated pytree check; the weights grouping
        # note, about weights off the CPU, which these are not): nothing the user can act on.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="No complete tensor found", category=UserWarning)
        ep = torch.export.export(prog, args, dynamic_shapes=shapes)
        ep = ep.run_decompositions({})  # core aten operators only
        ep._example_inputs = None  # sample inputs would be pickled into the archive; the loader refuses them
        # Into memory, then a plain write: torch's zip writer, on a full disk, throws from its
        # destructor too and ends the process in std::terminate (SIGABRT); a write of bytes fails
        # with an OSError instead.
        buf = io.BytesIO()
        torch.export.save(ep, buf)
    path.write_bytes(buf.getbuffer())


def parse_table_widths(default: str, overrides: list[str], names: list[str]) -> dict[str, str]:
    """``--tables`` and ``--table NAME=WIDTH`` -> {table: width} for every table of the collection. A QR
    split table's remainder ``NAME_rem`` follows ``NAME`` unless named itself."""
    if default not in WIDTHS:
        raise ArtifactError(f"--tables {default!r}: expected one of {', '.join(WIDTHS)}")
    widths = dict.fromkeys(names, default)
    given: dict[str, str] = {}
    for text in overrides:
        name, sep, width = text.partition("=")
        if not sep or width not in WIDTHS:
            raise ArtifactError(f"--table {text!r}: expected NAME=WIDTH with WIDTH one of {', '.join(WIDTHS)}")
        if name not in widths:
            raise ArtifactError(f"--table {text!r}: no table {name!r} (tables: {', '.join(names)})")
        given[name] = width
    for name in names:
        base = name.removesuffix("_rem")
        widths[name] = given.get(name, given.get(base, default))
    return widths


def find_training_data(cfg: Config, checkpoint: str | Path) -> Path:
    """The prepared training data of a run: ``data.train`` (as given, or relative to the run directory's
    parent), or a ``[data.synth]`` run's ``<run>/data``."""
    run = run_directory(checkpoint)
    candidates = []
    if cfg.data.train:
        candidates.append(Path(cfg.data.train))
        if run is not None:
            candidates += [run.parent / cfg.data.train, run / cfg.data.train]
    elif run is not None:
        candidates.append(run / "data")
    for c in candidates:
        if (c / "meta.json").is_file():
            return c
    raise ArtifactError(f"{checkpoint}: cannot find the run's prepared training data (tried "
                        f"{', '.join(map(str, candidates)) or 'nothing'}); pass --data DIR")


@dataclass
class TableLayout:
    """Where every table's rows go in an artifact: ``files`` (manifest ``table_files``: one group per width, or
    width and dim, the tables of a group stacked), ``entries`` (manifest ``tables``: each table's group and first
    row in it) and ``widths`` (table -> width)."""

    widths: dict[str, str]
    files: dict[str, dict[str, Any]]
    entries: list[dict[str, Any]]


def table_layout(emb: EmbeddingCollection, widths: dict[str, str]) -> TableLayout:
    """The layout of a collection's tables at ``widths``."""
    group = {t.name: widths[t.name] + (f"_d{t.embedding_dim}" if emb.mixed_dims else "") for t in emb.tables}
    files: dict[str, dict[str, Any]] = {}
    for w, dim in sorted({(widths[t.name], t.embedding_dim) for t in emb.tables},
                         key=lambda k: (WIDTHS.index(k[0]), k[1])):
        key = w + (f"_d{dim}" if emb.mixed_dims else "")
        rows = sum(t.num_embeddings for t in emb.tables if group[t.name] == key)
        cols = code_columns(w, dim) if w in LEVELS else dim
        dtype = {"fp32": "float32", "fp16": "float16"}.get(w, "uint8")
        files[key] = {"width": w, "dim": dim, "data": f"tables/{key}.npy", "data_dtype": dtype,
                      "data_shape": [rows, cols], "scale_bias": f"tables/{key}.sb.npy" if w in LEVELS else None}
    entries: list[dict[str, Any]] = []
    offsets = dict.fromkeys(files, 0)
    for t in emb.tables:
        w, key = widths[t.name], group[t.name]
        entries.append({"name": t.name, "rows": t.num_embeddings, "dim": t.embedding_dim, "width": w,
                        "group": key, "features": list(t.features), "offset": offsets[key],
                        "bytes": t.num_embeddings * bytes_per_row(w, t.embedding_dim)})
        offsets[key] += t.num_embeddings
    return TableLayout(widths, files, entries)


def quantize_tables(emb: EmbeddingCollection, layout: TableLayout, arrays: GroupArrays) -> None:
    """Quantize every table of ``emb`` into its rows of ``arrays`` (memory maps or in-memory arrays of the
    layout's shapes)."""
    for e in layout.entries:
        codes, sb = arrays[e["group"]]
        try:
            write_table(emb.table_weight(e["name"]), e["width"], codes, sb, e["offset"])
        except ValueError as err:
            raise ArtifactError(f"table {e['name']!r}: cannot store it as {e['width']}: {err}") from err


def artifact_manifest(cfg: Config, model: DLRM, data: DataDescription, layout: TableLayout,
                      source: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest of an artifact of ``model`` but its file list (``write_artifact`` adds it)."""
    emb, m = model.embeddings, cfg.model
    caps = model.feature_rows()
    feats = [{"name": s.name, "table": s.table_name, "rows": s.num_embeddings, "capped_rows": caps[i],
              "multi_hot": s.multi_hot, "pooling": s.pooling, "weighted": s.weighted}
             for i, s in enumerate(data.sparse_features)]
    qr = ({"collisions": m.qr_collisions, "threshold": m.qr_threshold, "operation": m.qr_operation}
          if model.qr is not None else None)
    fp32_bytes = sum(t.num_embeddings * bytes_per_row("fp32", t.embedding_dim) for t in emb.tables)
    table_bytes = sum(e["bytes"] for e in layout.entries)
    return {
        "created": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "recstack_version": __version__, "torch_version": torch.__version__,
        "source": {**(source or {}), "data": str(Path(data.path).resolve())},
        "config": cfg.to_dict(),
        "model": {"num_dense": model.num_dense, "dense_features": list(data.dense_features),
                  "embedding_dim": m.embedding_dim if model.projection is not None else emb.embedding_dim,
                  "interaction": m.interaction,
                  "feature_table": list(emb.feature_table), "qr": qr,
                  # per-table dims: the dense program takes the pooled features flat, each at its dim
                  "feature_dims": list(emb.feature_dims) if model.projection is not None else None},
        "features": feats,
        "tables": layout.entries,
        "dynamic_ids": dynamic_id_entries(model),
        "table_files": layout.files,
        "table_bytes": {"total": table_bytes, "fp32": fp32_bytes, "ratio": table_bytes / max(fp32_bytes, 1)},
        "dense_program": {"file": PROGRAM_FILE,
                          "inputs": ["pooled", "dense", "dense_row"] if model.num_dense else ["pooled"],
                          "dynamic": {"batch": [1, None]}},
        "transforms": TRANSFORMS_FILE,
    }


def write_transforms(tmp: Path, doc: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """``transforms.json`` and its arrays into an artifact being written."""
    for rel, a in arrays.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        np.save(tmp / rel, a, allow_pickle=False)
    (tmp / TRANSFORMS_FILE).write_text(json.dumps(doc, allow_nan=False))


def export_model(cfg: Config, model: DLRM, data: DataDescription, out: str | Path, tables: str = "fp32",
                 table_widths: list[str] = (), source: dict[str, Any] | None = None) -> tuple[Path, int]:  # type: ignore[assignment]
    """Write the artifact of a loaded model (eval mode, any collection) trained on ``data`` (its meta.json
    names the features and their transforms). -> (artifact directory, version)."""
    check_data(cfg, model, data)
    model = model.eval()
    emb = model.embeddings
    widths = parse_table_widths(tables, list(table_widths), [t.name for t in emb.tables])
    layout = table_layout(emb, widths)
    doc, arrays = transforms_from_data(data)
    arrays.update(dynamic_id_arrays(model))

    def fill(tmp: Path, version: int) -> dict[str, Any]:
        export_program(model, tmp / PROGRAM_FILE)
        (tmp / "tables").mkdir()
        # One file (and one scale/bias file) per width (and dim, with per-table dims), the tables of that group
        # stacked in table order: a lookup then gathers from one array per group, whatever the number of tables.
        maps = {key: open_group(f["width"], f["data_shape"][0], f["dim"], tmp / f["data"],
                                tmp / f["scale_bias"] if f["scale_bias"] else Path())
                for key, f in layout.files.items()}
        quantize_tables(emb, layout, maps)
        for pair in maps.values():
            for a in pair:
                if isinstance(a, np.memmap):
                    a.flush()
        write_transforms(tmp, doc, arrays)
        return artifact_manifest(cfg, model, data, layout, source)

    # A lower bound of the artifact's bytes (tables, scales, dense weights, transform arrays),
    # checked before the export program is traced: the writes still handle ENOSPC, this saves work.
    need = sum(e["bytes"] for e in layout.entries)
    need += sum(p.numel() * p.element_size() for p in DenseProgram(model).parameters())
    need += sum(a.nbytes for a in arrays.values())
    check_free_space(out, need, "the artifact")
    return write_artifact(out, fill)


def dynamic_id_entries(model: DLRM) -> dict[str, dict[str, Any]]:
    """The manifest's entry of each dynamic table's id map: {table: {"ids": rel, "rows": rel, "count": n}}."""
    return {name: {k: f"dynamic_ids/{name}.{k}.npy" for k in ("ids", "rows")} | {"count": int(m.keys.numel())}
            for name, m in (model.dynamic_ids.maps.items() if model.dynamic_ids is not None else ())}


def dynamic_id_arrays(model: DLRM) -> dict[str, np.ndarray]:
    """The files of the id maps: {rel: array}, each table's raw ids ascending (int64) and their rows, as
    ``.npy`` files of the artifact (checksummed like every file)."""
    out: dict[str, np.ndarray] = {}
    for name, m in (model.dynamic_ids.maps.items() if model.dynamic_ids is not None else ()):
        out[f"dynamic_ids/{name}.ids.npy"], out[f"dynamic_ids/{name}.rows.npy"] = m.arrays()
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path, tables: str = "fp32", table_widths: list[str] = (),  # type: ignore[assignment]
                      data: str | Path | None = None) -> tuple[Path, int]:
    """``recstack export``: load any checkpoint kind with ``load_model`` (on CPU) and export it."""
    parse_table_widths(tables, [], [])  # a bad width fails before the (long) load
    cfg, model = load_model(checkpoint, "cpu")
    try:
        ds = PreparedDataset(data if data is not None else find_training_data(cfg, checkpoint))
        return export_model(cfg, model, ds, out, tables, table_widths, {"checkpoint": str(Path(checkpoint).resolve())})
    finally:
        model.embeddings.close()
