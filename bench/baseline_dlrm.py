"""The straightforward DLRM that the throughput benchmark compares recstack against.

Written the way the DLRM reference code builds it: one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table,
looked up in a Python loop; the bottom output and the pooled embeddings are concatenated, multiplied with one
``bmm`` and the strict lower triangle is read with precomputed index tensors; ``torch.optim.SGD`` over all
parameters applies the sparse embedding gradients and the dense ones alike. Same initialisation scheme and
MLP layout as ``recstack.models.dlrm``, built from plain ``nn`` modules so that autograd runs every step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recstack.models.fused_mlp import mlp_layers


def mlp(sizes: list[int], last_activation: bool) -> nn.Sequential:
    """Plain ``nn.Sequential`` of recstack's Linear and ReLU layers (the DLRM reference init,
    ``mlp_layers``); autograd does the backward."""
    return nn.Sequential(*mlp_layers(sizes, last_activation))


class BaselineDLRM(nn.Module):
    """dense [B, n_dense], per-table ids [B] and offsets [B] -> logits [B].

    ``table_sizes`` gives the rows of each of the T tables (one feature per table); ``bottom_mlp`` ends in
    ``dim`` (the dot interaction needs all vectors of one size); ``top_mlp`` ends in 1.
    """

    def __init__(
        self,
        num_dense: int,
        table_sizes: list[int],
        dim: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
    ) -> None:
        super().__init__()
        if bottom_mlp[-1] != dim:
            raise ValueError(f"bottom_mlp must end in the embedding dim {dim}, got {bottom_mlp}")
        self.emb_l = nn.ModuleList()
        for n in table_sizes:
            bag = nn.EmbeddingBag(n, dim, mode="sum", sparse=True)
            with torch.no_grad():  # the reference's uniform(-1/sqrt(n), 1/sqrt(n))
                bag.weight.uniform_(-(n**-0.5), n**-0.5)
            self.emb_l.append(bag)
        self.bot_l = mlp([num_dense, *bottom_mlp], last_activation=True)
        n_vec = len(table_sizes) + 1
        li, lj = torch.tril_indices(n_vec, n_vec, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.top_l = mlp([dim + li.numel(), *top_mlp], last_activation=False)

    def interact(self, x: torch.Tensor, ly: list[torch.Tensor]) -> torch.Tensor:
        """x [B, D] and T tensors [B, D] -> [B, D + (T+1)T/2]."""
        b, d = x.shape
        t = torch.cat([x, *ly], dim=1).view(b, -1, d)  # [B, T+1, D]
        z = torch.bmm(t, t.transpose(1, 2))  # [B, T+1, T+1]
        return torch.cat([x, z[:, self.li, self.lj]], dim=1)

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x = self.bot_l(dense)
        ly = [bag(i, o) for bag, i, o in zip(self.emb_l, ids, offsets, strict=True)]
        return self.top_l(self.interact(x, ly)).squeeze(1)


def make_optimizer(model: BaselineDLRM, lr: float) -> torch.optim.Optimizer:
    """Plain SGD over every parameter; the embedding weights receive sparse gradients."""
    return torch.optim.SGD(model.parameters(), lr=lr)


def train_step(
    model: BaselineDLRM,
    optimizer: torch.optim.Optimizer,
    dense: torch.Tensor,
    ids: list[torch.Tensor],
    offsets: list[torch.Tensor],
    labels: torch.Tensor,
) -> float:
    """One step as in the reference loop: forward, BCE with logits, zero_grad, backward, optimizer step."""
    logits = model(dense, ids, offsets)
    loss = F.binary_cross_entropy_with_logits(logits, labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()
