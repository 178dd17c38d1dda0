"""DLRM on one device: bottom MLP on dense features, pooled embeddings, interaction, top MLP -> logit.

The model takes any ``EmbeddingCollection``, so the same class runs with a fused local collection, a sharded
one (``recstack.distributed``) or a tiered one; nothing here is distributed.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from recstack.data.batch import Batch
from recstack.embedding.collection import EmbeddingCollection
from recstack.embedding.dynamic_stage import DynamicIds
from recstack.embedding.qr import QRSplit
from recstack.models.config import ModelConfig
from recstack.models.fused_mlp import MLP, BiasInit, Norm
from recstack.models.interaction import CatInteraction, DCNv2Interaction, DeepFMTop, DotInteraction, FMInteraction
from recstack.models.projection import TableProjection


def mlp(sizes: list[int], last_activation: bool, dropout: float = 0.0, norm: Norm = "none",
        bias_init: BiasInit = "normal") -> nn.Sequential:
    """Linear layers sizes[0] -> ... -> sizes[-1], ReLU between (and after the last if asked): an ``MLP``
    (a Sequential of Linear/ReLU modules with a fused training step), DLRM reference init (biases at 0 with
    ``bias_init = "zero"``); ``dropout`` and ``norm`` regularise the hidden layers (``mlp_layers``)."""
    return MLP(sizes, last_activation, dropout, norm, bias_init=bias_init)


class DLRM(nn.Module):
    """dense [B, n_dense] + sparse (F features) -> logits [B].

    With quotient-remainder tables (``qr``) the collection reads F + K features: the batch's F are split
    (here, or by the loader ahead of a sharded collection's id distribution: ``split_batch``) and the pooled
    [B, F + K, D] combined back to [B, F, D] before the interaction.

    With tables of other dims than ``cfg.embedding_dim`` (``cfg.table_dims``) the pooled output is projected
    to it per table (``projection``, a dense part) before the interaction; None otherwise."""

    def __init__(self, cfg: ModelConfig, num_dense: int, embeddings: EmbeddingCollection,
                 qr: QRSplit | None = None) -> None:
        super().__init__()
        d = cfg.embedding_dim
        f = qr.num_features if qr is not None else embeddings.num_features
        self.embeddings = embeddings
        self.qr = qr
        # The id maps of dynamic id tables (``recstack.embedding.dynamic_stage``), set by whoever trains or loads
        # the model; an input stage, not part of the state dict (checkpoints keep them under ``dynamic_ids``).
        self.dynamic_ids: DynamicIds | None = None
        self.num_dense = num_dense
        # No dense features -> no bottom MLP (schema-driven data sets may have only categorical columns).
        drop, norm, bias = cfg.dropout, cfg.mlp_norm, cfg.mlp_bias_init  # every MLP's hidden layers; their biases
        bottom_drop = drop if cfg.bottom_dropout < 0 else cfg.bottom_dropout
        self.bottom = mlp([num_dense, *cfg.bottom_mlp], True, bottom_drop, norm, bias) if num_dense else None
        dense_dim = cfg.bottom_mlp[-1] if num_dense else 0
        self.interaction: nn.Module
        if cfg.interaction == "dot":
            self.interaction = DotInteraction(f, d, bool(num_dense), cfg.interaction_itself)
        elif cfg.interaction == "cat":
            self.interaction = CatInteraction(f, d, dense_dim)
        elif cfg.interaction == "fm":
            self.interaction = FMInteraction(f, d, dense_dim)
        else:
            self.interaction = DCNv2Interaction(f, d, dense_dim, cfg.dcn_layers, cfg.dcn_low_rank, cfg.dcn_structure,
                                                cfg.dcn_parallel_mlp, cfg.dcn_stacked_mlp, drop, norm, bias)
        if cfg.interaction == "fm":  # the DNN on the features, the FM's logit added to its own
            self.top: nn.Sequential = DeepFMTop([self.interaction.out_dim - 1, *cfg.top_mlp], False, drop, norm,
                                                bias_init=bias)
        else:
            self.top = mlp([self.interaction.out_dim, *cfg.top_mlp], False, drop, norm, bias)
        # Drawn after the MLPs, so that a model without it draws exactly as before. (DeepFM's tables are D + 1
        # wide by design: their last column is the FM's first-order weight.)
        width = cfg.table_width
        self.projection = (TableProjection(embeddings.feature_dims, embeddings.feature_table, len(embeddings.tables), d)
                           if any(x != width for x in embeddings.feature_dims) else None)

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters trained by the dense optimizer (and all-reduced by DDP); embeddings update themselves."""
        return [p for n, p in self.named_parameters() if not n.startswith("embeddings.")]

    def forward_features(self, batch: Batch) -> torch.Tensor:
        """-> interaction output [B, interaction.out_dim] (the shared body for heads built on top)."""
        dense = self.bottom(batch.dense) if self.bottom is not None else None
        if self.projection is not None:  # tables of their own dims: [B, sum of feature dims] -> [B, F, D]
            emb = self.projection(self.embeddings(batch.sparse))
        elif self.qr is None:
            emb = self.embeddings(batch.sparse)  # [B, F, D]
        else:
            emb = self.qr.combine(self.embeddings(self.qr.split(batch.sparse)))  # [B, F + K, D] -> [B, F, D]
        return self.interaction(dense, emb)

    def feature_rows(self) -> list[int]:
        """[F] rows of the table each input feature's ids index (as the data has them: before a split)."""
        if self.qr is not None:
            rows = {f: t.num_embeddings for t in self.qr.raw_tables for f in t.features}
            return [rows[f] for f in range(self.qr.num_features)]
        emb = self.embeddings
        return [emb.tables[t].num_embeddings for t in emb.feature_table]

    def split_batch(self, batch: Batch) -> Batch:
        """The batch as the collection reads it (its ids split into quotients and remainders when the model
        has QR tables; otherwise the batch itself)."""
        if self.qr is None:
            return batch
        return dataclasses.replace(batch, sparse=self.qr.split(batch.sparse))

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.top(self.forward_features(batch)).squeeze(1)
