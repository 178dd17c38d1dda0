"""Load a trained model from a checkpoint and evaluate or score a prepared data set."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from recstack.config import Config, config_from_dict
from recstack.data.format import DataDescription, capped_table_sizes
from recstack.data.integrity import check_values
from recstack.data.loader import BatchLoader
from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.sources import held_out_rows
from recstack.embedding.dynamic_stage import DynamicIds, dynamic_table_layout
from recstack.embedding.sparse_optim import sparse_optimizer_config
from recstack.metrics import BinaryMetrics
from recstack.models.build import build_model
from recstack.models.dlrm import DLRM
from recstack.training.checkpoint.checkpointer import Checkpointer
from recstack.training.checkpoint.state import convert_embedding_layout


def load_model(checkpoint: str | Path, device: str | torch.device = "cpu", last: bool = False
               ) -> tuple[Config, DLRM]:
    """A checkpoint (a ``ckpt_<step>.pt`` file, a ``ckpt_<step>/`` directory of cached-tier tables, or a
    ``step_<step>/`` directory of a torchrun run's sharded tables), used as given, or a run or checkpoints
    directory (the best checkpoint of a run with ``train.early_stopping`` unless ``last``, else its newest valid
    checkpoint) -> (config, model) in one process. Notes such as the embedding placement and the checkpoint
    chosen go to stderr, so that stdout carries only the caller's results."""
    state = Checkpointer.read(checkpoint, device, last=last)
    print(f"checkpoint: {state['path']} (step {state.get('step')})", file=sys.stderr)  # which one, always
    where = state["path"]
    missing = [k for k in ("config", "num_dense", "table_sizes", "model") if k not in state]
    if missing:  # e.g. an ExFM stream's checkpoint
        raise ValueError(f"{where}: not a recstack train checkpoint (no {', '.join(missing)})")
    cfg = config_from_dict(state["config"])
    workdir = state.get("workdir")  # where the run started: its relative data paths are relative to it
    if isinstance(workdir, str):
        d = cfg.data
        d.train, d.eval = (str(Path(workdir) / p) if p and not Path(p).is_absolute() else p
                           for p in (d.train, d.eval))
    # Placement notes to stderr: stdout is the JSON of `recstack eval`.
    model = build_model(cfg.model, sparse_optimizer_config(cfg.optim), state["num_dense"], state["table_sizes"],
                        seed=cfg.train.seed, device=device, names=state.get("table_names"), memory=cfg.memory,
                        log=sys.stderr)
    emb = model.embeddings
    # A sharded checkpoint's tables put together from their shards, as one process holds them in memory; where
    # the run's [memory] budgets give this process cached tiers, they are loaded into those below.
    Checkpointer.gather_tables(state, emb, device)
    tables = convert_embedding_layout(state, emb, torch.device(device))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:  # missing, unexpected or reshaped
        raise ValueError(f"{where}: its weights do not fit the model its config describes: {e}") from e
    if tables is not None:  # in-memory tables into cached tiers
        emb.restore_tensors(*tables)
    elif emb.stores_rows_in_files:  # cached embedding tiers: their rows are files beside the checkpoint's state
        emb.restore_files(state.get("checkpoint_dir"))
    if cfg.model.dynamic_ids.enabled:  # the id maps, for lookups only (eval, predict, export)
        model.dynamic_ids = DynamicIds(cfg.model.dynamic_ids, list(state["table_names"]), None, cfg.train.seed)
        model.dynamic_ids.load_state_dict(state)
    model.eval()
    return cfg, model


def run_directory(checkpoint: str | Path) -> Path | None:
    """The training run's output directory of a checkpoint path (the run directory itself, its
    ``checkpoints/``, or a checkpoint in there); None when the path is elsewhere."""
    path = Path(checkpoint).resolve()
    if (path / "checkpoints").is_dir():
        return path
    for p in (path, *path.parents):
        if p.name == "checkpoints":
            return p.parent
    return None


def evaluation_rows(cfg: Config, checkpoint: str | Path) -> tuple[PreparedDataset, tuple[int, int], str]:
    """The rows the training run evaluated on -> (data set, row range, what they are): ``data.eval`` when it
    was set, else the held-out tail of the training set that the run did not train on (``data.eval_fraction``).
    A ``[data.synth]`` set without ``data.train`` is found in the run directory."""
    d = cfg.data
    if d.eval:
        ev = PreparedDataset(d.eval)
        return ev, (0, len(ev)), f"data.eval {ev.path}: all {len(ev)} rows"
    train = d.train
    if not train and d.synth:
        run = run_directory(checkpoint)
        train = str(run / "data") if run is not None else ""
    if not train:
        raise ValueError("no data set to evaluate: the run's config names none here (pass --data DIR)")
    ds = PreparedDataset(train)
    lo, hi = held_out_rows(len(ds), d.eval_fraction)
    if hi <= lo:
        raise ValueError(f"the run trained on all of {ds.path} (data.eval_fraction={d.eval_fraction:g} holds no "
                         "row), so it has no held-out rows: pass --data DIR")
    return ds, (lo, hi), (f"{ds.path}: rows {lo}..{hi - 1}, the last data.eval_fraction={d.eval_fraction:g} of the "
                          "training set, which the run held out of training")


def check_data(cfg: Config, model: DLRM, data: DataDescription) -> None:
    """Raise a ValueError naming the data set and the first feature whose layout the model does not have
    (dense features, sparse features, each feature's table size and which features share a table)."""
    emb = model.embeddings
    sizes = model.feature_rows()  # per feature (tables may be shared)
    trained_on = f" (trained on {cfg.data.train})" if cfg.data.train else ""
    if len(data.sparse_features) != len(sizes) or len(data.dense_features) != model.num_dense:
        raise ValueError(
            f"{data.path}: {len(data.dense_features)} dense / {len(data.sparse_features)} sparse features, "
            f"the model{trained_on} expects {model.num_dense} / {len(sizes)}"
        )
    have = capped_table_sizes(data.table_sizes, cfg.model.max_table_size)
    have = dynamic_table_layout(cfg.model.dynamic_ids, data.table_names, have, None, [0] * len(have))[0]
    names, tables = data.table_names, emb.feature_table
    for i, s in enumerate(data.sparse_features):
        if have[i] != sizes[i]:
            cap = cfg.model.max_table_size
            capped = f" (capped at model.max_table_size={cap})" if have[i] != s.num_embeddings else ""
            raise ValueError(
                f"{data.path}: sparse feature #{i + 1} ({s.name!r}) has a table of {have[i]} rows{capped}, the "
                f"model's{trained_on} has {sizes[i]}: the data was prepared with other statistics than the "
                "training data (prepare it with --stats-from the training output, or the same Criteo "
                "--max-ind-range)"
            )
        # Features share a table in the data exactly when they share one in the model.
        if names.index(names[i]) != tables.index(tables[i]):
            raise ValueError(
                f"{data.path}: sparse feature #{i + 1} ({s.name!r}) looks up table {names[i]!r}, which does not "
                "match how the model's features share tables"
            )


def _loader(
    cfg: Config, model: DLRM, data: PreparedDataset, batch_size: int, rows: tuple[int, int] | None = None
) -> BatchLoader:
    check_data(cfg, model, data)
    check_values(data, rows)  # labels, dense inputs, bags: an error naming the file and row, not NaN metrics
    caps = model.feature_rows() if cfg.model.max_table_size > 0 else None
    dyn = model.dynamic_ids
    if dyn is not None:  # raw ids of the dynamic tables: looked up in their maps (unknown -> row 0), no modulo
        caps = [0 if f in dyn.dynamic_features else n for f, n in enumerate(model.feature_rows())]
    return BatchLoader(data, batch_size, rows, drop_last=False, table_caps=caps,
                       transform=dyn.lookup_batch if dyn is not None else None)


@torch.no_grad()
def predict_logits(
    cfg: Config, model: DLRM, data: PreparedDataset, batch_size: int = 16384, progress: bool = True,
    rows: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """-> (logits [N] float32, labels [N] float32) over the rows [lo, hi) of ``data`` (default: all), in row
    order."""
    device = next(model.parameters()).device
    loader = _loader(cfg, model, data, batch_size, rows)
    logits, labels = [], []
    for batch in tqdm(loader.iterate_epoch(), total=len(loader), disable=not progress, unit="batch"):
        batch = batch.to(device)
        logits.append(model(batch).float().cpu())
        labels.append(batch.labels.cpu())
    if not logits:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return torch.cat(logits).numpy(), torch.cat(labels).numpy()


def evaluate(
    cfg: Config, model: DLRM, data: PreparedDataset, batch_size: int = 16384, rows: tuple[int, int] | None = None
) -> dict[str, float]:
    logits, labels = predict_logits(cfg, model, data, batch_size, rows=rows)
    m = BinaryMetrics()
    m.update(torch.from_numpy(logits), torch.from_numpy(labels))
    return m.compute()
