"""``[optim]`` and ``[train]``: the optimizers and the training loop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from recstack.errors import ConfigError
from recstack.units import MAX_THREADS


@dataclass
class OptimConfig:
    """Dense part: ``dense`` in sgd | adagrad | adam. Embeddings: ``sparse`` in sgd | rowwise_adagrad | adam
    (lazy Adam: moments per element, bias correction by each row's own step count; ``sparse_betas``, ``eps``),
    applied inside backward (no dense table gradient is built; ``recstack.embedding.sparse_optim``).

    L2 regularisation, off (0) by default: ``dense_weight_decay`` is the dense optimizer's ``weight_decay``
    (grad += wd * p on every dense parameter, torch's coupled L2 for all three optimizers);
    ``sparse_weight_decay`` with ``sparse_weight_decay_mode = "touched"`` decays only the embedding rows a step
    touches, once per distinct row, inside the fused update; ``"all_rows"`` is FuxiCTR's
    ``embedding_regularizer`` (same value): (wd / 2) ||W||^2 over the whole tables in every step's loss, so every
    row takes every step (a dense pass over the tables per step; docs/training.md).

    ``max_grad_norm`` > 0 clips the global norm of every gradient of a step, the embedding rows' included, at
    that value before any update (torch's ``clip_grad_norm_``, FuxiCTR's ``max_gradient_norm``;
    ``recstack.training.step.clip_before_step``); 0 = off."""

    dense: Literal["sgd", "adagrad", "adam"] = "sgd"
    dense_lr: float = 0.1
    sparse: Literal["sgd", "rowwise_adagrad", "adam"] = "sgd"
    sparse_lr: float = 0.1
    eps: float = 1e-8
    adagrad_init: float = 0.0
    dense_weight_decay: float = 0.0
    sparse_weight_decay: float = 0.0
    sparse_weight_decay_mode: Literal["touched", "all_rows"] = "touched"
    sparse_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's (beta1, beta2)
    max_grad_norm: float = 0.0  # the clip of every gradient's global norm (docstring); 0 = off
    # Both learning rates x a schedule (recstack.training.lr_schedule): linear warm-up over lr_warmup_steps (the first
    # update at 1/lr_warmup_steps), then from lr_decay_start_step a quadratic decay to 0 over lr_decay_steps (0 =
    # none), as the DLRM reference.
    lr_warmup_steps: int = 0
    lr_decay_start_step: int = 0
    lr_decay_steps: int = 0
    # Reduce both learning rates x plateau_factor when train.early_stopping.metric has not improved by its
    # min_delta for plateau_patience evaluations (0 = off; needs train.eval_every > 0).
    plateau_factor: float = 0.5
    plateau_patience: int = 0

    def validate(self) -> None:
        """Learning rates and eps finite and in range, a schedule LRSchedule accepts; errors name the field."""
        from recstack.training.lr_schedule import LRSchedule  # torch: only when a config is checked

        for name in ("dense_lr", "sparse_lr", "adagrad_init", "dense_weight_decay", "sparse_weight_decay",
                     "max_grad_norm"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"optim.{name}: must be finite and >= 0, got {getattr(self, name)}")
        if not 0.0 < self.eps < math.inf:
            raise ConfigError(f"optim.eps: must be finite and > 0, got {self.eps}")
        b = self.sparse_betas
        if len(b) != 2 or not all(0.0 <= x < 1.0 for x in b):
            raise ConfigError(f"optim.sparse_betas: must be two numbers in [0, 1) (Adam's beta1, beta2), got {b}")
        if not 0.0 < self.plateau_factor < 1.0:
            raise ConfigError(f"optim.plateau_factor: must be in (0, 1), got {self.plateau_factor}")
        if self.plateau_patience < 0:
            raise ConfigError(f"optim.plateau_patience: must be >= 0, got {self.plateau_patience}")
        try:
            LRSchedule(self.lr_warmup_steps, self.lr_decay_start_step, self.lr_decay_steps)
        except ValueError as e:
            raise ConfigError(str(e)) from e


@dataclass
class EarlyStoppingConfig:
    """``train.early_stopping``: stop when ``metric`` on the evaluation set has not improved by more than
    ``min_delta`` for ``patience`` evaluations in a row (0 = off), and keep the best checkpoint. ``metric`` is
    also what ``optim.plateau_patience`` watches."""

    metric: Literal["auc", "logloss"] = "auc"
    patience: int = 0  # evaluations; 0 = never stop early
    min_delta: float = 0.0

    def validate(self) -> None:
        if self.patience < 0:
            raise ConfigError(f"train.early_stopping.patience: must be >= 0, got {self.patience}")
        if not 0.0 <= self.min_delta < math.inf:
            raise ConfigError(f"train.early_stopping.min_delta: must be finite and >= 0, got {self.min_delta}")


@dataclass
class TrainConfig:
    batch_size: int = 128
    epochs: int = 1
    max_steps: int = 0  # 0 = as many as the epochs give
    eval_every: int = 0  # steps; 0 = only at the end
    target_auc: float = 0.0  # stop at the first evaluation that reaches it (MLPerf's AUC threshold); 0 = never
    eval_batch_size: int = 16384
    log_every: int = 50
    checkpoint_every: int = 0  # steps; 0 = only the final checkpoint
    keep_checkpoints: int = 3
    # The order of each epoch's rows (recstack.data.order): "none" (file order) | "blocks" (batch-sized blocks
    # of consecutive rows in a permuted order; true means this) | "rows" (a permutation of all rows) | "window"
    # (windows of shuffle_window consecutive rows in a permuted order, rows permuted inside each); false = none.
    shuffle: bool | Literal["none", "blocks", "rows", "window"] = False
    shuffle_window: int = 1 << 20  # rows per window of shuffle = "window" (8 bytes of index a row)
    drop_last: bool = False  # true: an epoch ends before its short last batch (those rows are not trained on)
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # float32 matrix products and convolutions on TF32 tensor cores (a GPU; 10-bit mantissa products, fp32 sums)
    tf32: bool = False
    # "bf16": the training step's forward under torch.autocast to bfloat16 (the matrix products of the MLPs and
    # the interaction; lookups, optimizers and the loss stay fp32; evaluation runs in fp32); "none": fp32
    autocast: Literal["none", "bf16"] = "none"
    progress: bool = True
    # The divergence guard (recstack.training.divergence): stop when a step's loss exceeds divergence_factor x the
    # mean of the last divergence_window steps' losses (at least ln 2); 0 = no level check (NaN/Inf still stop).
    divergence_factor: float = 100.0
    divergence_window: int = 100
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)

    def validate(self, check_device: bool = True) -> None:
        """Counts in range, something to train, a device of the right form; with ``check_device`` a CUDA
        ``device`` must exist on this machine. Errors name the field."""
        for name, low in (("epochs", 0), ("max_steps", 0), ("eval_every", 0), ("log_every", 1),
                          ("checkpoint_every", 0), ("keep_checkpoints", 0), ("threads", 0), ("seed", 0),
                          ("shuffle_window", 1)):
            if getattr(self, name) < low:  # keep_checkpoints 0 = keep all
                raise ConfigError(f"train.{name}: must be >= {low}, got {getattr(self, name)}")
        if self.threads > MAX_THREADS:
            raise ConfigError(f"train.threads: must be <= {MAX_THREADS}, got {self.threads}")
        if self.seed > 2**32 - 1:  # numpy's seed range
            raise ConfigError(f"train.seed: must be <= 2**32 - 1, got {self.seed}")
        if self.epochs == 0 and self.max_steps == 0:
            raise ConfigError("train.epochs: 0 trains nothing (set train.epochs or train.max_steps)")
        check_device_name(self.device, check_device)
        if self.batch_size <= 0 or self.eval_batch_size <= 0:
            raise ConfigError("train.batch_size and train.eval_batch_size: must be positive")
        if not 0.0 <= self.target_auc < 1.0:
            raise ConfigError(f"train.target_auc: must be in [0, 1), got {self.target_auc}")
        if not (self.divergence_factor == 0 or 1 < self.divergence_factor < math.inf):
            raise ConfigError(f"train.divergence_factor: must be 0 (off) or finite and > 1, got "
                              f"{self.divergence_factor}")
        if self.divergence_window < 1:
            raise ConfigError(f"train.divergence_window: must be >= 1, got {self.divergence_window}")
        if self.target_auc and not self.eval_every:
            raise ConfigError("train.target_auc: needs train.eval_every > 0 (the AUC is checked at each evaluation)")
        self.early_stopping.validate()
        if self.early_stopping.patience and not self.eval_every:
            raise ConfigError("train.early_stopping: needs train.eval_every > 0 (the metric is checked at each "
                              "evaluation)")


def check_device_name(name: str, check_available: bool, field: str = "train.device") -> None:
    """``field`` (``train.device``, or a command's ``--device``): auto | cpu | cuda | cuda:N; with
    ``check_available``, a CUDA device must exist here."""
    if name == "auto":
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ConfigError(f"{field}: {name!r} is not one of auto, cpu, cuda, cuda:N") from e
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index is not None):
        raise ConfigError(f"{field}: {name!r} is not one of auto, cpu, cuda, cuda:N")
    if device.type == "cuda" and check_available:
        if not torch.cuda.is_available():
            raise ConfigError(f"{field}: {name!r} but CUDA is not available on this machine "
                              f"(use auto or cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{field}: {name!r} but this machine has {torch.cuda.device_count()} CUDA "
                              f"device(s)")
