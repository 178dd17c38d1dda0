"""Feature interactions between the bottom-MLP output and the pooled embeddings.

Each takes dense [B, D] (or None when there are no dense features) and emb [B, F, D] and returns [B, out_dim].
"""

from __future__ import annotations

import torch
from torch import nn

from recstack.models.fused_mlp import MLP, BiasInit, Norm


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
    """DCNv2's cross network over x0 = concat(dense, embeddings) [B, n]: x_{l+1} = x0 * (W_l x_l + b_l) + x_l,
    W_l = U_l V_l of rank ``low_rank`` (U_l [n, r], V_l [r, n], as in the MLPerf DLRMv2 model, torch's default
    initialisation), or a full W_l [n, n] with ``low_rank`` = 0 (FuxiCTR's CrossNetV2, use_low_rank_mixture =
    False, initialised as FuxiCTR does: Xavier normal, bias 0).

    ``structure`` (FuxiCTR DCNv2's ``model_structure``): ``stacked`` returns the cross output [B, n] (the top MLP
    is the DNN stacked on it; a top MLP of [1] is FuxiCTR's crossnet_only); ``parallel`` returns
    concat(cross(x0), DNN_p(x0)); ``stacked_parallel`` concat(DNN_s(cross(x0)), DNN_p(x0)): a top MLP of [1] is
    then FuxiCTR's final fc. The DNNs (``parallel_mlp``, ``stacked_mlp`` hidden units) regularise every layer
    with ``norm`` and ``dropout``, as FuxiCTR's ``batch_norm`` and ``net_dropout`` do; their biases start as
    ``bias_init`` says (``mlp_layers``)."""

    def __init__(self, num_features: int, dim: int, dense_dim: int, layers: int, low_rank: int,
                 structure: str = "stacked", parallel_mlp: list[int] | None = None,
                 stacked_mlp: list[int] | None = None, dropout: float = 0.0, norm: Norm = "none",
                 bias_init: BiasInit = "normal") -> None:
        super().__init__()
        n = dense_dim + num_features * dim
        self.v = nn.ModuleList((nn.Linear(n, low_rank, bias=False) if low_rank else nn.Identity())
                               for _ in range(layers))
        cross = [nn.Linear(low_rank or n, n, bias=True) for _ in range(layers)]
        if not low_rank:  # as FuxiCTR initialises its CrossNetV2 (BaseModel.reset_parameters)
            with torch.no_grad():
                for u in cross:
                    nn.init.xavier_normal_(u.weight)
                    u.bias.zero_()
        self.u = nn.ModuleList(cross)
        # Drawn after the cross layers, so that a stacked network draws exactly as before.
        self.stacked = (MLP([n, *stacked_mlp], True, dropout, norm, hidden_last=True, bias_init=bias_init)
                        if structure == "stacked_parallel" and stacked_mlp else None)
        self.parallel = (MLP([n, *parallel_mlp], True, dropout, norm, hidden_last=True, bias_init=bias_init)
                         if structure != "stacked" and parallel_mlp else None)
        cross_out = stacked_mlp[-1] if self.stacked is not None and stacked_mlp else n
        self.out_dim = cross_out + (parallel_mlp[-1] if self.parallel is not None and parallel_mlp else 0)

    def forward(self, dense: torch.Tensor | None, emb: torch.Tensor) -> torch.Tensor:
        flat = emb.reshape(emb.shape[0], emb.shape[1] * emb.shape[2])  # [B, F D] (B may be 0)
        x0 = torch.cat([dense, flat], dim=1) if dense is not None else flat  # [B, n]
        x = x0
        for v, u in zip(self.v, self.u, strict=True):
            x = x0 * u(v(x)) + x
        if self.stacked is not None:
            x = self.stacked(x)  # [B, stacked_mlp[-1]]
        if self.parallel is not None:
            x = torch.cat([x, self.parallel(x0)], dim=1)  # [B, out_dim]
        return x


class FMInteraction(nn.Module):
    """DeepFM's factorization machine beside its DNN. Each table holds D + 1 columns: the feature's vector v_f
    [D] and its first-order (logistic regression) weight w_f, so the FM's weights live, are updated, sharded and
    checkpointed with the rows like every other column (FuxiCTR keeps them in a separate table of dim 1).

    dense [B, dense_dim] or None, emb [B, F, D + 1] -> [B, dense_dim + F D + 1]: the DNN's input
    concat(dense, v_1, ..., v_F), then one column, the FM logit b + sum_f w_f + 0.5 sum_d ((sum_f v_fd)^2 -
    sum_f v_fd^2), which ``DeepFMTop`` adds to the DNN's logit instead of feeding it in."""

    def __init__(self, num_features: int, dim: int, dense_dim: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1))
        self.out_dim = dense_dim + num_features * dim + 1

    def forward(self, dense: torch.Tensor | None, emb: torch.Tensor) -> torch.Tensor:
        v, w = emb[..., :-1], emb[..., -1]  # [B, F, D], [B, F]
        summed = v.sum(1)  # [B, D]
        second = 0.5 * (summed.pow(2) - v.pow(2).sum(1)).sum(1, keepdim=True)  # [B, 1]
        logit = second + w.sum(1, keepdim=True) + self.bias  # [B, 1]
        flat = v.reshape(v.shape[0], v.shape[1] * v.shape[2])  # [B, F D] (B may be 0)
        parts = [dense, flat, logit] if dense is not None else [flat, logit]
        return torch.cat(parts, dim=1)


class DeepFMTop(MLP):
    """The top MLP of a DeepFM (``FMInteraction``): the DNN on every column but the last, plus the last (the FM
    logit): x [B, n + 1] -> [B, 1]. An ``MLP`` of the same layers and state-dict keys as any top MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x[:, :-1]) + x[:, -1:]
