"""``[optim]`` and ``[train]``: the optimizers and the training loop."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimConfig:
    """Dense part: ``dense`` in sgd | adagrad | adam. Embeddings: ``sparse`` in sgd | rowwise_adagrad,
    applied inside backward (no dense table gradient is built)."""

    dense: str = "sgd"
    dense_lr: float = 0.1
    sparse: str = "sgd"
    sparse_lr: float = 0.1
    eps: float = 1e-8
    adagrad_init: float = 0.0
    # Both learning rates x a schedule (recstack.training.lr_schedule): linear warm-up over lr_warmup_steps (the first
    # update at 1/lr_warmup_steps), then from lr_decay_start_step a quadratic decay to 0 over lr_decay_steps (0 =
    # none), as the DLRM reference.
    lr_warmup_steps: int = 0
    lr_decay_start_step: int = 0
    lr_decay_steps: int = 0


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
    shuffle: bool = False  # shuffle batch order per epoch (rows inside a batch stay contiguous)
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    progress: bool = True
