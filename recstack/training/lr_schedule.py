"""Learning-rate warm-up and decay for the dense and the embedding optimizers together, as the DLRM
reference's ``--lr-num-warmup-steps / --lr-decay-start-step / --lr-num-decay-steps`` (used by its large-batch
Terabyte runs): linear warm-up, constant, then a quadratic decay to 0.

The factor is a pure function of the step about to run, so a resumed run continues the schedule exactly
(the step counter is in every checkpoint) and no state needs saving. ``LRScaler.reduction`` multiplies it by
the plateau reductions (``recstack.training.early_stopping.Monitor``, which checkpoints them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recstack.embedding.collection import EmbeddingCollection


@dataclass(frozen=True)
class LRSchedule:
    """Step s (0 = the first update) trains at ``lr * factor(s)``. The reference evaluates its policy at torch's
    scheduler step count, which is already 1 at the first update (an ``_LRScheduler`` steps once when it is
    made, then once after every update), so with k = s + 1:

    - k < warmup_steps: k / warmup_steps (the first update has factor 1 / warmup_steps, as in the reference);
    - decay_start_step <= k < decay_start_step + decay_steps: ((decay_steps - (k - start)) / decay_steps) ** 2;
    - k >= decay_start_step + decay_steps (when decay_steps > 0): 0 (the reference keeps its last decayed rate);
    - otherwise 1 (the reference keeps its last warm-up rate there when decay_steps > 0).
    """

    warmup_steps: int = 0
    decay_start_step: int = 0
    decay_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "decay_start_step", "decay_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"optim.lr_{name}: must be >= 0, got {getattr(self, name)}")
        if self.decay_steps and self.decay_start_step < self.warmup_steps:
            raise ValueError(f"optim.lr_decay_start_step: the decay must start after the warm-up "
                             f"({self.decay_start_step} < lr_warmup_steps={self.warmup_steps})")

    @property
    def active(self) -> bool:
        return self.warmup_steps > 0 or self.decay_steps > 0

    def factor(self, step: int) -> float:
        k = step + 1  # the reference's scheduler step count at update ``step``
        if k < self.warmup_steps:
            return k / self.warmup_steps
        if self.decay_steps and k >= self.decay_start_step:
            left = self.decay_steps - (k - self.decay_start_step)
            return (left / self.decay_steps) ** 2 if left > 0 else 0.0
        return 1.0


class LRScaler:
    """Applies ``schedule.factor(step) * reduction`` to every parameter group of ``dense`` (from the learning
    rates it had when this was made) and to every embedding collection's sparse optimizer in ``model``.
    ``reduction``: the learning-rate reduction on plateau so far (1 = none), set by the Trainer."""

    def __init__(self, schedule: LRSchedule, dense: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self.schedule = schedule
        self.dense = dense
        self.base = [float(g["lr"]) for g in dense.param_groups]  # before a checkpoint's (scaled) lr is loaded
        self.collections = [m for m in model.modules() if isinstance(m, EmbeddingCollection)]
        self.reduction = 1.0

    def set_step(self, step: int) -> float:
        """Set the learning rates for ``step``; -> the factor."""
        f = self.schedule.factor(step) * self.reduction
        for g, lr in zip(self.dense.param_groups, self.base, strict=True):
            g["lr"] = lr * f
        for c in self.collections:
            c.optimizer.lr_scale = f
        return f
