"""Feature interactions between the bottom-MLP output and the pooled embeddings.

Each takes dense [B, D] (or None when there are no dense features) and emb [B, F, D] and returns [B, out_dim].
"""

from __future__ import annotations

import torch
from torch import nn


class _GramPairs(torch.autograd.Function):
    """Selected entries of each sample's Gram matrix: t [B, n, D] -> (t t^T).view(B, n*n)[:, pick] [B, P].

    Autograd through ``bmm`` + advanced indexing would run two bmm's, a zero fill and an accumulating
    index_put in backward. With Z = t t^T, dL/dt = (G + G^T) t where G [n, n] holds the pair gradients at
    the picked positions, so backward is one gather that builds G + G^T directly (``spread`` maps every
    position of the [n, n] matrix to its pair, or to a zero column) and one bmm.
    """

    @staticmethod
    def forward(ctx, t, pick, spread, diagonal):
        z = torch.bmm(t, t.transpose(1, 2))  # [B, n, n]
        ctx.save_for_backward(t, spread)
        ctx.diagonal = diagonal
        return z.view(t.shape[0], t.shape[1] * t.shape[1]).index_select(1, pick)

    @staticmethod
    def backward(ctx, grad):
        t, spread = ctx.saved_tensors
        b, n, _ = t.shape
        padded = torch.cat([grad, grad.new_zeros(b, 1)], dim=1)  # [B, P + 1], column P is the zero
        sym = padded.index_select(1, spread).view(b, n, n)  # G + G^T, except the diagonal holds G only
        if ctx.diagonal:
            sym.diagonal(dim1=1, dim2=2).mul_(2.0)  # d(t_i . t_i) / dt_i = 2 t_i
        # under bf16 autocast the forward's product (so grad) is bf16 while t kept its dtype
        return torch.bmm(sym.to(t.dtype), t), None, None, None


class DotInteraction(nn.Module):
    """All pairwise dot products of the n = F (+1 with dense) vectors, strict lower triangle (diagonal too
    with ``itself``), concatenated after the dense vector: out_dim = D + n(n-1)/2 (DLRM paper, "dot").

    Pairs come in ``torch.tril_indices`` order (row by row), as in the DLRM reference.
    """

    def __init__(self, num_features: int, dim: int, has_dense: bool, itself: bool = False) -> None:
        super().__init__()
        n = num_features + int(has_dense)
        li, lj = torch.tril_indices(n, n, offset=0 if itself else -1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        # pick [P]: flat position of each pair in the [n, n] Gram matrix. spread [n * n]: the pair at each
        # position, mirrored across the diagonal; positions that are no pair read column P (zeros).
        self.register_buffer("pick", li * n + lj, persistent=False)
        spread = torch.full((n, n), li.numel(), dtype=torch.int64)
        spread[li, lj] = torch.arange(li.numel())
        spread[lj, li] = torch.arange(li.numel())
        self.register_buffer("spread", spread.view(-1), persistent=False)
        self.has_dense = has_dense
        self.itself = itself
        self.out_dim = (dim if has_dense else 0) + li.numel()

    def forward(self, dense: torch.Tensor | None, emb: torch.Tensor) -> torch.Tensor:
        t = torch.cat([dense.unsqueeze(1), emb], dim=1) if dense is not None else emb  # [B, n, D]
        pairs = _GramPairs.apply(t, self.pick, self.spread, self.itself)  # [B, P]
        return torch.cat([dense, pairs], dim=1) if dense is not None else pairs


class CatInteraction(nn.Module):
    """Concatenation of the dense vector and all embeddings: out_dim = (F + 1) D."""

    def __init__(self, num_features: int, dim: int, dense_dim: int) -> None:
        super().__init__()
        self.out_dim = dense_dim + num_features * dim

    def forward(self, dense: torch.Tensor | None, emb: torch.Tensor) -> torch.Tensor:
        flat = emb.reshape(emb.shape[0], emb.shape[1] * emb.shape[2])  # [B, F D] (B may be 0)
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
        flat = emb.reshape(emb.shape[0], emb.shape[1] * emb.shape[2])  # [B, F D] (B may be 0)
        x0 = torch.cat([dense, flat], dim=1) if dense is not None else flat  # [B, n]
        x = x0
        for v, u in zip(self.v, self.u, strict=True):
            x = x0 * u(v(x)) + x
        return x
