"""Mixed-dimension embeddings on one device: tables of different dims, one fused collection per dim.

A table with few rows carries little information per row, so a narrower row saves memory at no loss (the
DLRM reference's mixed-dimension embeddings). The tables are grouped by dim; each group is an ordinary
``FusedEmbeddingBagCollection`` (one weight, one ``embedding_bag``, the sparse optimizer in backward) holding
that group's tables with their features renumbered. The pooled output is flat, [B, sum of feature dims], each
sample's features in feature order: the model projects the narrow ones to its common dim
(``recstack.models.projection``).

Every table is drawn with its index in the whole collection (``init_block``), so the rows are those of the
same table in a sharded collection of the same tables, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from recstack.data.batch import SparseFeatures
from recstack.embedding.collection import EmbeddingCollection, TableConfig, init_block
from recstack.embedding.fused import FusedEmbeddingBagCollection
from recstack.embedding.sparse_optim import SparseOptimizerConfig


def group_key(dim: int) -> str:
    """The name of the group of tables of ``dim`` columns (``groups.<key>`` in the state dict)."""
    return f"d{dim}"


class MixedDimEmbeddingCollection(EmbeddingCollection):
    """F features over tables of several dims -> pooled [B, sum_f d_f] (feature-major within a sample)."""

    holds_mixed_dims = True

    def __init__(self, tables: list[TableConfig], optimizer: SparseOptimizerConfig, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        """As ``FusedEmbeddingBagCollection``; on the ``meta`` device shapes only (tables to be sharded)."""
        super().__init__(tables, optimizer)
        by_dim: dict[int, list[int]] = {}  # dim -> indices of its tables, in table order
        for i, t in enumerate(tables):
            by_dim.setdefault(t.embedding_dim, []).append(i)
        self.groups = nn.ModuleDict()
        self.group_features: dict[str, list[int]] = {}  # group -> its features (collection numbering), in order
        for dim, idxs in sorted(by_dim.items()):
            feats = sorted(f for i in idxs for f in tables[i].features)
            local = {f: j for j, f in enumerate(feats)}
            cfgs = [TableConfig(tables[i].name, tables[i].num_embeddings, dim,
                                tuple(local[f] for f in tables[i].features), init_bound=tables[i].init_bound)
                    for i in idxs]

            def init(j: int, out: torch.Tensor, idxs: list[int] = idxs) -> None:  # drawn as table idxs[j]
                t = tables[idxs[j]]
                init_block(t, seed, idxs[j], (0, t.num_embeddings), (0, t.embedding_dim), out=out)

            key = group_key(dim)
            self.groups[key] = FusedEmbeddingBagCollection(cfgs, optimizer, device=device, init=init)
            self.group_features[key] = feats
        # Where each feature's columns come from: (group, position among the group's features).
        self._slot = {f: (key, j) for key, feats in self.group_features.items() for j, f in enumerate(feats)}

    def _group(self, key: str) -> FusedEmbeddingBagCollection:
        group = self.groups[key]
        assert isinstance(group, FusedEmbeddingBagCollection)  # a ModuleDict types its values Module
        return group

    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        if sparse.num_features != self.num_features:
            raise ValueError(f"got {sparse.num_features} sparse features, collection has {self.num_features}")
        single = len(self.groups) == 1
        pooled = {key: self._group(key)(sparse if single else sparse.select(feats))  # [B, F_g, d_g]
                  for key, feats in self.group_features.items()}
        parts = [pooled[key][:, j] for key, j in (self._slot[f] for f in range(self.num_features))]
        return torch.cat(parts, dim=1)  # [B, sum of feature dims] (B may be 0)

    def table_weight(self, name: str) -> torch.Tensor:
        t = next(t for t in self.tables if t.name == name)
        return self._group(group_key(t.embedding_dim)).table_weight(name)

    def weight_groups(self) -> list[tuple[str, list[TableConfig]]]:
        return [(f"groups.{key}.", [t for t in self.tables if group_key(t.embedding_dim) == key])
                for key in self.groups]

    resets_rows = True

    def reset_rows(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        t = next(t for t in self.tables if t.name == name)
        self._group(group_key(t.embedding_dim)).reset_rows(name, rows, values)

    def defer_updates(self) -> None:
        for key in self.groups:
            self._group(key).defer_updates()

    def deferred_sq_norm(self) -> float:
        return sum((self._group(key).deferred_sq_norm() for key in self.groups), 0.0)

    def apply_deferred(self, scale: float) -> None:
        for key in self.groups:
            self._group(key).apply_deferred(scale)
