"""The training step and what every training loop shares: device, seeding, the dense optimizer, the counters.

Used by ``Trainer`` and by the ExFM streams (``recstack.exfm``), which run their own loops over windows.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from recstack.data.batch import Batch
from recstack.embedding.collection import EmbeddingCollection
from recstack.training.config import OptimConfig


def resolve_device(name: str) -> torch.device:
    """``train.device``: auto (CUDA when there is one) | cpu | cuda | cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def set_tf32(enabled: bool) -> None:
    """``train.tf32``: float32 matrix products and cuDNN convolutions on TF32 tensor cores (CUDA only; the
    CPU's kernels are unaffected). Process-wide, as torch's switches are."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def dense_autocast(device: torch.device, mode: str) -> contextlib.AbstractContextManager:
    """``train.autocast``: "bf16" -> torch.autocast to bfloat16 on ``device``'s type (its matrix products run in
    bf16, everything else as it is); "none" -> a context that does nothing."""
    if mode == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch global RNGs (the dense layers' initialisation draws from torch's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


_DENSE = {"sgd": "SGD", "adagrad": "Adagrad", "adam": "Adam"}  # optim.dense -> the class in torch.optim


def build_dense_optimizer(optim: OptimConfig, params: list[torch.nn.Parameter] | list[dict],
                          embeddings: EmbeddingCollection | None = None) -> torch.optim.Optimizer:
    """The dense optimizer (``optim.dense``), with torch's fused kernels (one pass over each parameter for the
    whole update) where the parameters' devices have them (``fused_where_supported``): for 0.4M DLRM parameters
    on one core, Adam takes 0.6 ms instead of 2.7 ms a step, Adagrad 0.3 ms instead of 1.2 ms, SGD 0.14 ms
    instead of 0.16 ms. ``optim.dense_weight_decay`` is the optimizers' ``weight_decay`` (L2 added to the
    gradient; 0 = off, the same update as without it). With ``optim.max_grad_norm`` > 0 its steps clip the
    gradients of ``params`` and ``embeddings`` (the model's tables; None: a model without any) together
    (``clip_before_step``)."""
    fused = fused_where_supported(optim.dense, params)
    wd = optim.dense_weight_decay
    opt: torch.optim.Optimizer
    if optim.dense == "sgd":
        opt = torch.optim.SGD(params, lr=optim.dense_lr, weight_decay=wd, fused=fused)
    elif optim.dense == "adagrad":
        opt = torch.optim.Adagrad(params, lr=optim.dense_lr, eps=optim.eps, weight_decay=wd,
                                  initial_accumulator_value=optim.adagrad_init, fused=fused)
    else:
        opt = torch.optim.Adam(params, lr=optim.dense_lr, weight_decay=wd, fused=fused)
    if optim.max_grad_norm > 0:
        clip_before_step(opt, embeddings, optim.max_grad_norm)
    return opt


def clip_before_step(optimizer: torch.optim.Optimizer, embeddings: EmbeddingCollection | None,
                     max_norm: float) -> None:
    """``optim.max_grad_norm``: torch's ``clip_grad_norm_`` over every gradient of a step, the tables' rows
    included (FuxiCTR's ``max_gradient_norm``). The tables keep their updates from backward
    (``defer_updates``); before each step of ``optimizer`` (a step pre-hook, so every loop that steps it clips),
    norm = sqrt(sum of squares of its parameters' gradients + ``embeddings.deferred_sq_norm()``), every dense
    gradient is multiplied by scale = min(1, max_norm / (norm + 1e-6)) and the tables apply their updates with
    their gradients multiplied by the same scale. The dense gradients are those the optimizer uses (after DDP's
    all-reduce); the tables' are summed per distinct row with the sparse weight-decay term in
    (``recstack.embedding.sparse_optim``). The dense optimizer's own ``weight_decay`` is added after the clip, as
    torch's optimizers do. Under torchrun ``deferred_sq_norm`` is a collective: every rank steps in one order."""
    if embeddings is not None:
        embeddings.defer_updates()

    def clip(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        dense_sq = float(torch.nn.utils.get_total_norm([p.grad for p in params])) ** 2 if params else 0.0
        sq = dense_sq + (embeddings.deferred_sq_norm() if embeddings is not None else 0.0)
        scale = min(1.0, max_norm / (math.sqrt(sq) + 1e-6))
        if scale < 1.0:
            for p in params:
                p.grad.mul_(scale)
        if embeddings is not None:
            embeddings.apply_deferred(scale)

    optimizer.register_step_pre_hook(clip)


def fused_where_supported(kind: str, params: list[torch.nn.Parameter] | list[dict]) -> bool | None:
    """True when every parameter is a floating tensor on a device where torch has the fused kernel of optimizer
    ``kind`` (``fused_kernel_runs``); else None (torch's default: foreach kernels where it can)."""
    flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    if not flat or not all(p.is_floating_point() for p in flat):  # type: ignore[union-attr]
        return None
    devices = {str(p.device) for p in flat}  # type: ignore[union-attr]
    return True if all(fused_kernel_runs(kind, d) for d in sorted(devices)) else None


@functools.cache
def fused_kernel_runs(kind: str, device: str) -> bool:
    """Whether torch's fused ``kind`` optimizer steps a parameter on ``device``, asked of the installed torch
    by one step on a one-element parameter there: which devices have which fused kernel changes between
    releases (torch 2.11's fused Adagrad is CPU-only: on CUDA it raises at the first step)."""
    p = torch.zeros(1, device=device, requires_grad=True)
    p.grad = torch.zeros(1, device=device)
    try:
        getattr(torch.optim, _DENSE[kind])([p], lr=0.1, fused=True).step()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def optimizer_step(
    loss_fn: Callable[[Batch], torch.Tensor], optimizer: torch.optim.Optimizer, batch: Batch, device: torch.device
) -> float:
    """One training step shared by every loop (the Trainer, the ExFM streams): move the batch to the device,
    compute ``loss_fn(batch)``, backward (which also applies the embedding updates, or keeps them for the
    gradient-norm clip of the dense optimizer's step: ``clip_before_step``), dense optimizer step.
    -> the loss as a float."""
    batch = batch.to(device, non_blocking=True)
    loss = loss_fn(batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # also applies the embedding updates (unless the step's clip applies them)
    optimizer.step()
    return loss.item()


@dataclass
class Progress:
    """How far a run has come; checkpointed (``step`` is written by the checkpointer beside the state, as the
    file's step)."""

    step: int = 0
    samples: int = 0  # global: every rank's
    train_seconds: float = 0.0  # data wait + steps, not evaluation or checkpoints
    target_step: int | None = None  # the step whose evaluation reached train.target_auc

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "target_step": self.target_step, "train_seconds": self.train_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples = int(state["samples"])
        self.target_step = state.get("target_step")  # a run that reached train.target_auc stays finished
        self.train_seconds = float(state["train_seconds"])
