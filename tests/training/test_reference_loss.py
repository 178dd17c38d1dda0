"""Numerics guard: a fixed small run must reproduce the recorded per-step losses.

A change that should not move numerics (refactoring, speed work) keeps this test green. A change that moves
them on purpose regenerates the file: ``RECSTACK_UPDATE_REFERENCE=1 pytest tests/training/test_reference_loss.py``,
and says why in its commit message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import train_step

from recstack.config import load_config
from recstack.data.loader import BatchLoader
from recstack.data.prepared_dataset import PreparedDataset
from recstack.embedding.sparse_optim import sparse_optimizer_config
from recstack.models.build import build_model
from recstack.training.step import build_dense_optimizer

REFERENCE = Path(__file__).with_name("reference_loss.json")
CASES = {
    "dot_sgd": ["optim.sparse=\"sgd\""],
    "dot_adagrad_adam": ["optim.sparse=\"rowwise_adagrad\"", "optim.dense=\"adam\"", "optim.dense_lr=0.001"],
    "dcn_adagrad": ["model.interaction=\"dcn\"", "model.dcn_low_rank=8", "optim.sparse=\"rowwise_adagrad\"",
                    "optim.dense=\"adagrad\"", "optim.dense_lr=0.01"],
    "cat_sgd": ["model.interaction=\"cat\""],
}


def _losses(data: Path, overrides: list[str], steps: int = 30) -> list[float]:
    cfg = load_config(None, ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]",
                             *overrides])
    torch.manual_seed(0)
    ds = PreparedDataset(data)
    model = build_model(cfg.model, sparse_optimizer_config(cfg.optim), len(ds.dense_features), ds.table_sizes,
                        seed=cfg.train.seed)
    opt = build_dense_optimizer(cfg.optim, model.dense_parameters())
    out = []
    it = BatchLoader(ds, 64, prefetch=0).iterate_epoch()
    for _ in range(steps):
        out.append(train_step(model, opt, next(it)).item())
    return out


def test_reference_losses(tiny_dataset: Path) -> None:
    torch.set_num_threads(1)
    got = {name: _losses(tiny_dataset, o) for name, o in CASES.items()}
    if os.environ.get("RECSTACK_UPDATE_REFERENCE"):
        REFERENCE.write_text(json.dumps(got, indent=1))
    want = json.loads(REFERENCE.read_text())
    assert sorted(want) == sorted(got)
    for name in CASES:
        assert got[name] == pytest.approx(want[name], abs=1e-6, rel=1e-5), name
