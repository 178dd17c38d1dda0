"""DLRM on one device: bottom MLP on dense features, pooled embeddings, interaction, top MLP -> logit.

The model takes any ``EmbeddingCollection``, so the same class runs with a fused local collection, a sharded
one (``recstack.distributed``) or a tiered one; nothing here is distributed.
"""

from __future__ import annotations

import torch
from torch import nn

from recstack.config import ModelConfig
from recstack.data.batch import Batch
from recstack.embedding.collection import EmbeddingCollection
from recstack.models.fused_mlp import MLP
from recstack.models.interaction import CatInteraction, DCNv2Interaction, DotInteraction


def mlp(sizes: list[int], last_activation: bool) -> nn.Sequential:
    """Linear layers sizes[0] -> ... -> sizes[-1], ReLU between (and after the last if asked): an ``MLP``
    (a Sequential of Linear/ReLU modules with a fused training step), DLRM reference init."""
    return MLP(sizes, last_activation)


class DLRM(nn.Module):
    """dense [B, n_dense] + sparse (F features) -> logits [B]."""

    def __init__(self, cfg: ModelConfig, num_dense: int, embeddings: EmbeddingCollection) -> None:
        super().__init__()
        d, f = embeddings.embedding_dim, embeddings.num_features
        self.embeddings = embeddings
        self.num_dense = num_dense
        # No dense features -> no bottom MLP (schema-driven data sets may have only categorical columns).
        self.bottom = mlp([num_dense, *cfg.bottom_mlp], last_activation=True) if num_dense else None
        dense_dim = cfg.bottom_mlp[-1] if num_dense else 0
        self.interaction: nn.Module
        if cfg.interaction == "dot":
            self.interaction = DotInteraction(f, d, bool(num_dense), cfg.interaction_itself)
        elif cfg.interaction == "cat":
            self.interaction = CatInteraction(f, d, dense_dim)
        else:
            self.interaction = DCNv2Interaction(f, d, dense_dim, cfg.dcn_layers, cfg.dcn_low_rank)
        self.top = mlp([self.interaction.out_dim, *cfg.top_mlp], last_activation=False)

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters trained by the dense optimizer (and all-reduced by DDP); embeddings update themselves."""
        return [p for n, p in self.named_parameters() if not n.startswith("embeddings.")]

    def forward_features(self, batch: Batch) -> torch.Tensor:
        """-> interaction output [B, interaction.out_dim] (the shared body for heads built on top)."""
        dense = self.bottom(batch.dense) if self.bottom is not None else None
        emb = self.embeddings(batch.sparse)  # [B, F, D]
        return self.interaction(dense, emb)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.top(self.forward_features(batch)).squeeze(1)
