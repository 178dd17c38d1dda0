"""Build a DLRM and its optimizers from a Config and the data set's shape."""

from __future__ import annotations

from typing import TextIO

import torch

from recstack.config import Config
from recstack.embedding import EmbeddingCollection, FusedEmbeddingBagCollection, SparseOptimizerConfig, TableConfig
from recstack.embedding.qr import QRSplit
from recstack.embedding.tiered.placement import build_collection, memory_budgets_set
from recstack.models.dlrm import DLRM


def table_configs(table_sizes: list[int], dim: int, names: list[str] | None = None) -> list[TableConfig]:
    """``table_sizes`` and ``names`` have one entry per sparse feature: the table it looks up. Features that
    name the same table share it (a schema's ``table = ...``), so their sizes must agree."""
    names = names or [f"t{i}" for i in range(len(table_sizes))]
    features: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        features.setdefault(name, []).append(i)
    tables = []
    for name, feats in features.items():
        sizes = {table_sizes[i] for i in feats}
        if len(sizes) != 1:
            raise ValueError(f"table {name!r} is shared by features {feats} with different sizes {sorted(sizes)}")
        tables.append(TableConfig(name, table_sizes[feats[0]], dim, tuple(feats)))
    return tables


def sparse_optimizer_config(cfg: Config) -> SparseOptimizerConfig:
    o = cfg.optim
    return SparseOptimizerConfig(o.sparse, o.sparse_lr, o.eps, o.adagrad_init)


def build_model(
    cfg: Config,
    num_dense: int,
    table_sizes: list[int],
    device: torch.device | str = "cpu",
    names: list[str] | None = None,
    log: TextIO | None = None,
) -> DLRM:
    """Dense layers are initialised from torch's global RNG (seeded by the caller), tables from per-table
    generators (seeded by ``train.seed``), so the same seed gives the same model on any placement. With ``[memory]``
    budgets the placement of tables over memory tiers is printed to ``log`` (standard output by default)."""
    tables = table_configs(table_sizes, cfg.model.embedding_dim, names)
    m = cfg.model
    qr = QRSplit.build(tables, m.qr_collisions, m.qr_threshold, m.qr_operation)
    if qr is not None:  # the collection holds the quotient and remainder tables
        tables = list(qr.tables)
    emb: EmbeddingCollection
    if memory_budgets_set(cfg):  # [memory] budgets: tables that do not fit get cached tiers (plan printed)
        emb = build_collection(cfg, tables, sparse_optimizer_config(cfg), device, log)
    else:
        emb = FusedEmbeddingBagCollection(tables, sparse_optimizer_config(cfg), seed=cfg.train.seed, device=device)
    return DLRM(cfg.model, num_dense, emb, qr).to(device)
