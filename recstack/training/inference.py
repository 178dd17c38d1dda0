"""Load a trained model from a checkpoint and evaluate or score a prepared data set."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from recstack.config import Config, config_from_dict
from recstack.data.format import PreparedDataset
from recstack.data.loader import BatchLoader
from recstack.metrics import BinaryMetrics
from recstack.models.build import build_model, capped_table_sizes
from recstack.models.dlrm import DLRM
from recstack.training.checkpoint.sharded import (
    SHARDED_STATE_FILE,
    list_sharded,
    read_full_tables,
    read_trainer_state,
)
from recstack.training.checkpoint.single import STATE_FILE, latest_checkpoint, load_checkpoint


def load_model(checkpoint: str | Path, device: str | torch.device = "cpu") -> tuple[Config, DLRM]:
    """A checkpoint (a ``ckpt_<step>.pt`` file, a ``ckpt_<step>/`` directory of cached-tier tables, or a
    ``step_<step>/`` directory of a torchrun run's sharded tables), or a run or checkpoints directory (its newest
    valid checkpoint) -> (config, model) in one process. Notes such as the embedding placement go to stderr, so
    that stdout carries only the caller's results."""
    path = Path(checkpoint)
    sharded: Path | None = None  # a torchrun checkpoint: tables in DCP files, the rest in trainer.pt
    if (path / SHARDED_STATE_FILE).is_file():
        sharded = path
    elif path.is_dir() and not (path / STATE_FILE).is_file():
        ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        state = latest_checkpoint(ckpt_dir, device)
        if state is None:
            steps = list_sharded(ckpt_dir)
            if not steps:
                raise FileNotFoundError(f"{path}: no loadable checkpoint")
            sharded = steps[-1]
    else:
        state = load_checkpoint(path, device)
    if sharded is not None:
        state = {**read_trainer_state(sharded, device), "path": str(sharded)}
    assert state is not None  # latest_checkpoint found one, or the sharded state replaced it
    where = state.get("path", str(path))
    missing = [k for k in ("config", "num_dense", "table_sizes", "model") if k not in state]
    if missing:  # e.g. an ExFM stream's checkpoint
        raise ValueError(f"{where}: not a recstack train checkpoint (no {', '.join(missing)})")
    cfg = config_from_dict(state["config"])
    # Placement notes to stderr: stdout is the JSON of `recstack eval`.
    model = build_model(cfg, state["num_dense"], state["table_sizes"], device, state.get("table_names"), sys.stderr)
    emb = model.embeddings
    if sharded is not None:  # every table put together from its shards, as one process holds it (torchrun
        # refuses [memory] budgets, so this model's tables are all in memory too)
        weight, acc = read_full_tables(sharded, emb.tables, emb.optimizer.needs_accumulator)
        state["model"]["embeddings.weight"] = weight.to(device)
        if acc is not None:
            state["model"]["embeddings.accumulator"] = acc.to(device)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:  # missing, unexpected or reshaped
        raise ValueError(f"{where}: its weights do not fit the model its config describes: {e}") from e
    if emb.stores_rows_in_files:  # cached embedding tiers: their rows are files beside the checkpoint's state
        emb.restore_files(state.get("checkpoint_dir"))
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
    from recstack.training.trainer import held_out_rows

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


def check_data(cfg: Config, model: DLRM, data: PreparedDataset) -> None:
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
    caps = model.feature_rows() if cfg.model.max_table_size > 0 else None
    return BatchLoader(data, batch_size, rows, drop_last=False, table_caps=caps)


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
