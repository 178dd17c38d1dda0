"""Feature interactions between the bottom-MLP output and the pooled embeddings.

Each takes dense [B, D] (or None when there are no dense features) and emb [B, F, D] and returns [B, out_dim].
"""

from __future__ import annotations

import torch
from torch import nn


class DotInteraction(nn.Module):
    """All pairwise dot products of the n = F (+1 with dense) vectors, strict lower triangle (diagonal too
    with ``itself``), concatenated after the dense vector: out_dim = D + n(n-1)/2 (DLRM paper, "dot")."""

    def __init__(self, num_features: int, dim: int, has_dense: bool, itself: bool = False) -> None:
        super().__init__()
        n = num_features + int(has_dense)
        li, lj = torch.tril_indices(n, n, offset=0 if itself else -1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.has_dense = has_dense
        self.out_dim = (dim if has_dense else 0) + li.numel()

    def forward(self, dense: torch.Tensor | None, emb: torch.Tensor) -> torch.Tensor:
        t = torch.cat([dense.unsqueeze(1), emb], dim=1) if dense is not None else emb  # [B, n, D]
        z = torch.bmm(t, t.transpose(1, 2))  # [B, n, n]
        pairs = z[:, self.li, self.lj]  # [B, n(n-1)/2]
        return torch.cat([dense, pairs], dim=1) if dense is not None else pairs


class CatInteraction(nn.Module):
    """Concatenation of the dense vector and all embeddings: out_dim = (F + 1) D."""

    def __init__(self, num_features: int, dim: int, dense_dim: int) -> None:
        super().__init__()
        self.out_dim = dense_dim + num_features * dim

    def forward(self, dense: torch.Tensor | None, emb: torch.Tensor) -> torch.Tensor:
        flat = emb.reshape(emb.shape[0], -1)
        return torch.cat([dense, flat], dim=1) if dense is not None else flat


class DCNv2Interaction(nn.Module):
    """Low-rank cross network (DCNv2, as in the MLPerf DLRMv2 model) over x0 = concat(dense, embeddings):
    x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l, U_l [n, r], V_l [r, n]; out_dim = n."""

    def __init__(self, num_features: int, dim: int, dense_dim: int, layers: int, low_rank: int) -> None:
        super().__init__()
        n = dense_dim + num_features * dim
        self.v = nn.ModuleList(nn.Linear(n, low_rank, bias=False) for _ in range(layers))
        self.u = nn.ModuleList(nn.Linear(low_rank, n, bias=True) for _ in range(layers))
        self.out_dim = n

    def forward(self, dense: torch.Tensor | None, emb: torch.Tensor) -> torch.Tensor:
        flat = emb.reshape(emb.shape[0], -1)
        x0 = torch.cat([dense, flat], dim=1) if dense is not None else flat  # [B, n]
        x = x0
        for v, u in zip(self.v, self.u, strict=True):
            x = x0 * u(v(x)) + x
        return x
