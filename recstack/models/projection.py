"""The projection of mixed-dimension embeddings to the model's common dim (``model.table_dims``).

A table of dim d_t != D gets a learned linear map [d_t, D] (a dense parameter: trained by the dense optimizer,
all-reduced by DDP, exported with the dense program); features that share a table share its map, and tables
of dim D pass through unchanged. So the interaction sees [B, F, D] whatever the tables' dims.
"""

from __future__ import annotations

import torch
from torch import nn


class TableProjection(nn.Module):
    """pooled [B, sum_f d_f] (or [B, F, d] when every table has one dim d) -> [B, F, D].

    ``feature_dims`` [F]: each feature's table dim; ``feature_table`` [F]: its table (of ``num_tables``); one
    [d_t, D] weight per projected table, in table order, drawn uniform(-1/sqrt(d_t), 1/sqrt(d_t)) from torch's
    global RNG (the bound ``nn.Linear`` draws its weight from), so a run's seed fixes them."""

    def __init__(self, feature_dims: list[int], feature_table: list[int], num_tables: int, dim: int) -> None:
        super().__init__()
        if len(feature_dims) != len(feature_table):
            raise ValueError(f"{len(feature_dims)} feature dims for {len(feature_table)} features")
        table_dim: dict[int, int] = {}
        for width, t in zip(feature_dims, feature_table, strict=True):
            table_dim[t] = width
        self.dim = dim
        self.feature_dims = list(feature_dims)
        self.weights = nn.ParameterList()
        index: dict[int, int] = {}  # table -> its weight in ``weights``
        for t in range(num_tables):
            width = table_dim.get(t, dim)  # a table no feature reads has nothing to project
            if width != dim:
                bound = width**-0.5
                index[t] = len(self.weights)
                self.weights.append(nn.Parameter(torch.empty(width, dim).uniform_(-bound, bound)))
        self.feature_weight = [index.get(t, -1) for t in feature_table]  # [F], -1: passed through

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        b = pooled.shape[0]
        cols = torch.split(pooled.reshape(b, sum(self.feature_dims)), self.feature_dims, dim=1)
        outs = [c if w < 0 else c @ self.weights[w] for c, w in zip(cols, self.feature_weight, strict=True)]
        return torch.stack(outs, dim=1)  # [B, F, D] (B may be 0)
