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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from recstack import __version__
from recstack.config import Config
from recstack.data.prepared_dataset import PreparedDataset
from recstack.io import check_free_space
from recstack.models.dlrm import DLRM
from recstack.serving.artifact import ArtifactError, write_artifact
from recstack.serving.quantized import LEVELS, WIDTHS, bytes_per_row, open_group, write_table
from recstack.serving.transforms import transforms_from_data
from recstack.training.inference import check_data, load_model, run_directory

PROGRAM_FILE = "dense.pt2"
TRANSFORMS_FILE = "transforms.json"


class DenseProgram(nn.Module):
    """The model after its embedding lookup: pooled [B, F', D] (F' = F + split features; with per-table dims
    ``model.table_dims`` [B, sum of feature dims], projected here) and dense [B, n_dense] (absent without
    dense features) -> logits [B]."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.bottom, self.interaction, self.top, self.qr = model.bottom, model.interaction, model.top, model.qr
        self.projection = model.projection

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
        if self.projection is not None:
            emb = self.projection(pooled)
        else:
            emb = self.qr.combine(pooled) if self.qr is not None else pooled
        x = self.bottom(dense) if self.bottom is not None else None
        return self.top(self.interaction(x, emb)).squeeze(1)


def export_program(model: DLRM, path: Path) -> None:
    """torch.export the dense part with a dynamic batch dimension (1 .. any) and save it to ``path``."""
    prog = DenseProgram(model).eval()
    f = model.qr.num_split_features if model.qr is not None else model.embeddings.num_features
    d, b = model.embeddings.embedding_dim, 4
    device = next(model.parameters()).device
    batch = torch.export.Dim("batch", min=1)
    shape = (b, sum(model.embeddings.feature_dims)) if model.projection is not None else (b, f, d)
    args: tuple[torch.Tensor, ...] = (torch.randn(*shape, device=device),)
    shapes: dict[str, Any] = {"pooled": {0: batch}}
    if model.num_dense:
        args += (torch.randn(b, model.num_dense, device=device),)
        shapes["dense"] = {0: batch}
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


def export_model(cfg: Config, model: DLRM, data: PreparedDataset, out: str | Path, tables: str = "fp32",
                 table_widths: list[str] = (), source: dict[str, Any] | None = None) -> tuple[Path, int]:  # type: ignore[assignment]
    """Write the artifact of a loaded model (eval mode, any collection) trained on ``data`` (its meta.json
    names the features and their transforms). -> (artifact directory, version)."""
    check_data(cfg, model, data)
    model = model.eval()
    emb = model.embeddings
    names = [t.name for t in emb.tables]
    widths = parse_table_widths(tables, list(table_widths), names)
    caps = model.feature_rows()
    feats = [{"name": s.name, "table": s.table_name, "rows": s.num_embeddings, "capped_rows": caps[i],
              "multi_hot": s.multi_hot, "pooling": s.pooling, "weighted": s.weighted}
             for i, s in enumerate(data.sparse_features)]
    m = cfg.model
    doc, arrays = transforms_from_data(data)
    id_maps = dynamic_id_arrays(model)
    arrays.update({rel: a for entry in id_maps.values() for rel, a in entry.pop("arrays").items()})
    qr = ({"collisions": m.qr_collisions, "threshold": m.qr_threshold, "operation": m.qr_operation}
          if model.qr is not None else None)

    def fill(tmp: Path, version: int) -> dict[str, Any]:
        export_program(model, tmp / PROGRAM_FILE)
        (tmp / "tables").mkdir()
        # One file (and one scale/bias file) per width (and dim, with per-table dims), the tables of that group
        # stacked in table order: a lookup then gathers from one array per group, whatever the number of tables.
        entries: list[dict[str, Any]] = []
        files: dict[str, dict[str, Any]] = {}
        offsets: dict[str, int] = {}
        group = {t.name: widths[t.name] + (f"_d{t.embedding_dim}" if emb.mixed_dims else "") for t in emb.tables}
        for w, dim in sorted({(widths[t.name], t.embedding_dim) for t in emb.tables},
                             key=lambda k: (WIDTHS.index(k[0]), k[1])):
            key = w + (f"_d{dim}" if emb.mixed_dims else "")
            rows = sum(t.num_embeddings for t in emb.tables if group[t.name] == key)
            data_rel, sb_rel = f"tables/{key}.npy", f"tables/{key}.sb.npy" if w in LEVELS else None
            codes, sb = open_group(w, rows, dim, tmp / data_rel, tmp / sb_rel if sb_rel else Path())
            files[key] = {"width": w, "dim": dim, "data": data_rel, "data_dtype": str(codes.dtype),
                          "data_shape": list(codes.shape), "scale_bias": sb_rel, "maps": (codes, sb)}
            offsets[key] = 0
        for t in emb.tables:
            w, key = widths[t.name], group[t.name]
            codes, sb = files[key]["maps"]
            try:
                write_table(emb.table_weight(t.name), w, codes, sb, offsets[key])
            except ValueError as e:
                raise ArtifactError(f"table {t.name!r}: cannot store it as {w}: {e}") from e
            entries.append({"name": t.name, "rows": t.num_embeddings, "dim": t.embedding_dim, "width": w,
                            "group": key, "features": list(t.features), "offset": offsets[key],
                            "bytes": t.num_embeddings * bytes_per_row(w, t.embedding_dim)})
            offsets[key] += t.num_embeddings
        for f in files.values():
            for a in f.pop("maps"):
                if a is not None:
                    a.flush()
        fp32_bytes = sum(t.num_embeddings * bytes_per_row("fp32", t.embedding_dim) for t in emb.tables)
        for rel, a in arrays.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            np.save(tmp / rel, a, allow_pickle=False)
        (tmp / TRANSFORMS_FILE).write_text(json.dumps(doc, allow_nan=False))
        table_bytes = sum(e["bytes"] for e in entries)
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
            "tables": entries,
            "dynamic_ids": id_maps,
            "table_files": files,
            "table_bytes": {"total": table_bytes, "fp32": fp32_bytes, "ratio": table_bytes / max(fp32_bytes, 1)},
            "dense_program": {"file": PROGRAM_FILE, "inputs": ["pooled", "dense"] if model.num_dense else ["pooled"],
                              "dynamic": {"batch": [1, None]}},
            "transforms": TRANSFORMS_FILE,
        }

    # A lower bound of the artifact's bytes (tables, scales, dense weights, transform arrays),
    # checked before the export program is traced: the writes still handle ENOSPC, this saves work.
    need = sum(t.num_embeddings * bytes_per_row(widths[t.name], t.embedding_dim)
               for t in emb.tables)
    need += sum(p.numel() * p.element_size() for p in DenseProgram(model).parameters())
    need += sum(a.nbytes for a in arrays.values())
    check_free_space(out, need, "the artifact")
    return write_artifact(out, fill)


def dynamic_id_arrays(model: DLRM) -> dict[str, dict[str, Any]]:
    """The id map of each dynamic table: {table: {"ids": rel, "rows": rel, "arrays": {rel: array}}}, the raw ids
    ascending (int64) and their rows, as ``.npy`` files of the artifact (checksummed like every file)."""
    out: dict[str, dict[str, Any]] = {}
    for name, m in (model.dynamic_ids.maps.items() if model.dynamic_ids is not None else ()):
        ids, rows = m.arrays()
        rel = {k: f"dynamic_ids/{name}.{k}.npy" for k in ("ids", "rows")}
        out[name] = {**rel, "count": int(ids.size), "arrays": {rel["ids"]: ids, rel["rows"]: rows}}
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
