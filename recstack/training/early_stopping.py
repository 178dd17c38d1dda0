"""Model selection on the evaluation set: early stopping (``train.early_stopping``) and learning-rate reduction
on plateau (``optim.plateau_factor`` / ``optim.plateau_patience``), both watching one metric.

At every evaluation ``Monitor.update`` compares the metric with the best so far: an improvement is a value
better than the best by more than ``min_delta`` (AUC higher, logloss lower; an undefined NaN value never
improves). It then counts the evaluations since the best (the run stops when they reach ``patience``) and the
evaluations since the best or the last reduction (the learning rates are multiplied by ``plateau_factor`` when
they reach ``plateau_patience``, as torch's ``ReduceLROnPlateau`` without cooldown). The counters, the best and
the reduction are a checkpointed component (key ``early_stopping``), so a resumed run decides as an
uninterrupted one; every rank gets the same gathered metrics, so under torchrun all ranks decide alike.
"""

from __future__ import annotations

import math
from typing import Any

from recstack.training.config import EarlyStoppingConfig, OptimConfig


class Monitor:
    """The best evaluation so far and the counters of ``train.early_stopping`` and the plateau reduction."""

    def __init__(self, stopping: EarlyStoppingConfig, optim: OptimConfig) -> None:
        self.metric, self.patience, self.min_delta = stopping.metric, stopping.patience, stopping.min_delta
        self.plateau_factor, self.plateau_patience = optim.plateau_factor, optim.plateau_patience
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.best: dict[str, float] = {}  # the best evaluation's metrics
        self.since_best = 0  # evaluations since the best
        self.since_reduction = 0  # evaluations since the best or the last learning-rate reduction
        self.lr_factor = 1.0  # product of the plateau reductions so far
        self.stopped_step: int | None = None  # the evaluation that stopped the run

    @property
    def active(self) -> bool:
        """Early stopping or the plateau reduction is on (else the Trainer does not use this)."""
        return self.stops or self.plateau_patience > 0

    @property
    def stops(self) -> bool:
        """Early stopping is on: the best checkpoint is kept."""
        return self.patience > 0

    def improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        if self.metric == "auc":
            return value > self.best_value + self.min_delta
        return value < self.best_value - self.min_delta

    def update(self, step: int, result: dict[str, float]) -> bool:
        """Take the evaluation ``result`` at ``step`` -> whether it is the new best. Afterwards ``stopped_step``
        is set when the run should stop, and ``lr_factor`` is reduced when the metric has plateaued."""
        if self.improves(result[self.metric]):
            self.best_value, self.best_step, self.best = float(result[self.metric]), step, dict(result)
            self.since_best = self.since_reduction = 0
            return True
        self.since_best += 1
        self.since_reduction += 1
        if self.plateau_patience and self.since_reduction >= self.plateau_patience:
            self.lr_factor *= self.plateau_factor
            self.since_reduction = 0
        if self.patience and self.since_best >= self.patience:
            self.stopped_step = step
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"early_stopping": {
            "best_value": self.best_value, "best_step": self.best_step, "best": dict(self.best),
            "since_best": self.since_best, "since_reduction": self.since_reduction, "lr_factor": self.lr_factor,
            "stopped_step": self.stopped_step}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = state.get("early_stopping")
        if s is None:  # a checkpoint of a run without it: start watching from here
            return
        self.best_value, self.best_step, self.best = s["best_value"], s["best_step"], dict(s["best"])
        self.since_best, self.since_reduction = int(s["since_best"]), int(s["since_reduction"])
        self.lr_factor, self.stopped_step = float(s["lr_factor"]), s["stopped_step"]
