"""A vertical model (VM) that learns from a foundation model's logged predictions.

The VM is a ``DLRM``: its bottom MLP, embeddings and interaction are the shared body (``forward_features``,
[B, H]) and its top MLP is the serving head. The arms add, on top of that body:

* ``distill``  single-head distillation: the serving head also fits the FM prediction.
* ``distill_sa`` single-head distillation from the adapted FM: the Student Adapter (below) is fitted to the
               fresh labels, and its output, with gradients stopped, replaces the FM prediction as the
               serving head's second target (same weight): the SA's effect where no second head can
               absorb a recalibration.
* ``aux``      an Auxiliary Head: a second head (same shape as the serving head) fits the FM prediction,
               the serving head sees true labels only, and the distillation head's gradient into the body
               is scaled by ``beta``.
* ``aux_sa``   the Auxiliary Head plus a Student Adapter: y_SA = f + MLP(f), f the FM logit, fitted to the
               fresh labels; sigmoid(y_SA), with gradients stopped, is a second target of the distillation
               head. The residual form starts the adapter as the identity (its last layer is zero), so its
               target is the FM's own prediction until fresh labels say otherwise.

Only the serving path (``serving_model()``: the DLRM itself) is served, so the served parameters and FLOPs are
exactly those of the VM trained alone.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from recstack.data.batch import Batch
from recstack.exfm.config import ADAPTER_ARMS, ARMS, DistillConfig
from recstack.models.dlrm import DLRM, mlp

FM_LOGIT = "fm_logit"  # the Batch extra that carries the FM's logged logit [B]


class GradScale(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``scale`` (beta of the Auxiliary Head)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class StudentAdapter(nn.Module):
    """FM logit f [B] -> adapted logit f + MLP(f) [B]; an MLP 1 -> hidden -> 1 whose last layer starts at 0."""

    def __init__(self, hidden: list[int]) -> None:
        super().__init__()
        self.mlp = mlp([1, *hidden, 1], last_activation=False)
        last = [m for m in self.mlp if isinstance(m, nn.Linear)][-1]
        with torch.no_grad():
            last.weight.zero_()
            last.bias.zero_()

    def forward(self, fm_logit: torch.Tensor) -> torch.Tensor:
        return fm_logit + self.mlp(fm_logit.unsqueeze(1)).squeeze(1)


class VerticalModel(nn.Module):
    """One VM arm: ``body`` (a DLRM, serving head = its top MLP) plus the arm's training-only modules."""

    def __init__(self, body: DLRM, arm: str, distill: DistillConfig) -> None:
        super().__init__()
        if arm not in ARMS:
            raise ValueError(f"arm {arm!r}: expected one of {', '.join(ARMS)}")
        self.body = body
        self.arm = arm
        self.cfg = distill
        # A fresh copy of the serving head's shape; copy.deepcopy would also copy its trained weights.
        sizes = [m.in_features for m in body.top if isinstance(m, nn.Linear)] + [1]
        self.distill_head = mlp(sizes, last_activation=False) if arm in ("aux", "aux_sa") else None
        self.adapter = StudentAdapter(distill.sa_hidden) if arm in ADAPTER_ARMS else None

    def init_distill_head_from_serving(self) -> None:
        """Start the distillation head as a copy of the (warm) serving head: a fresh random head would send
        random gradients into a trained body until it has learned something itself."""
        if self.distill_head is not None:
            self.distill_head.load_state_dict(self.body.top.state_dict())

    @property
    def needs_fm(self) -> bool:
        return self.arm != "alone"

    def forward(self, batch: Batch) -> torch.Tensor:
        """Serving logits [B] (the only path that is served)."""
        return self.body(batch)

    def outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """features [B, H], serving [B], and where the arm has them distill [B] and adapter [B] logits."""
        feats = self.body.forward_features(batch)
        out = {"features": feats, "serving": self.body.top(feats).squeeze(1)}
        if self.distill_head is not None:
            out["distill"] = self.distill_head(GradScale.apply(feats, self.cfg.beta)).squeeze(1)
        if self.adapter is not None:
            out["adapter"] = self.adapter(self.fm_logit(batch).detach())
        return out

    def fm_logit(self, batch: Batch) -> torch.Tensor:
        if FM_LOGIT not in batch.extras:
            raise ValueError(f"arm {self.arm!r} trains on FM labels, but the batch has no {FM_LOGIT!r} column")
        return batch.extras[FM_LOGIT].float()

    def losses(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Each loss term (scalars, weights applied); the training loss is their sum.

        ``serving``: h(y_S, y). ``distill``: w h(., min(alpha y_F, 1)) on the serving head (single-head arms;
        weight 0 in ``distill_sa``) or the distillation head. ``adapter``: h(y_SA, y), reaching only the
        adapter. ``adapter_target``: sa_weight h(y_D, stop_grad(sigmoid(y_SA))) (w h(y_S, ...) in
        ``distill_sa``), reaching only the VM.
        """
        out = self.outputs(batch)
        y = batch.labels
        terms = {"serving": F.binary_cross_entropy_with_logits(out["serving"], y)}
        if not self.needs_fm:
            return terms
        c = self.cfg
        fm_target = torch.clamp(c.alpha * torch.sigmoid(self.fm_logit(batch)), max=1.0)
        head = out["distill"] if self.distill_head is not None else out["serving"]
        terms["distill"] = c.fm_weight(self.arm) * F.binary_cross_entropy_with_logits(head, fm_target)
        if self.adapter is not None:
            terms["adapter"] = F.binary_cross_entropy_with_logits(out["adapter"], y)
            sa_target = torch.sigmoid(out["adapter"]).detach()
            sa_head = out["distill"] if c.sa_target == "distill" and "distill" in out else out["serving"]
            weight = c.adapter_weight(self.arm)
            terms["adapter_target"] = weight * F.binary_cross_entropy_with_logits(sa_head, sa_target)
        return terms

    def loss(self, batch: Batch) -> torch.Tensor:
        return sum(self.losses(batch).values())  # type: ignore[return-value]

    def dense_param_groups(self, lr: float) -> list[dict]:
        """Optimizer groups: body + heads at ``lr``, the adapter at lr * sa_lr_scale (embeddings update
        themselves inside backward and are not here)."""
        main = [p for n, p in self.named_parameters() if not n.startswith(("body.embeddings.", "adapter."))]
        groups: list[dict] = [{"params": main}]
        if self.adapter is not None:
            groups.append({"params": list(self.adapter.parameters()), "lr": lr * self.cfg.sa_lr_scale})
        return groups

    def serving_model(self) -> DLRM:
        """A copy of the serving path alone (body + serving head), in eval mode, for export."""
        return copy.deepcopy(self.body).eval()


def parameter_count(model: nn.Module) -> int:
    """Learned numbers: parameters plus embedding tables (fused tables are ``weight`` buffers, not parameters;
    optimizer state such as the Adagrad ``accumulator`` is not counted)."""
    n = sum(p.numel() for p in model.parameters())
    return n + sum(b.numel() for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] == "weight")


def forward_flops(model: nn.Module, batch: Batch) -> int:
    """Floating-point operations of one eval-mode forward over ``batch`` (torch's FLOP counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(batch)
    model.train(was_training)
    return int(counter.get_total_flops())
