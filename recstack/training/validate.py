"""What a training loop decides on its figures, in one component both loops share (the fixed-set ``Trainer``
and the stream loop): the divergence guard's checks (every step's loss, every evaluation's logloss, the weights
before every checkpoint), ``train.target_auc``, and the ``early_stopping.Monitor`` (early stopping, learning-rate
reduction on plateau, the best checkpoint kept in ``checkpoints/best/``).

Every method that may save or stop is collective under torchrun: every rank has the same gathered figures, so
all ranks decide alike.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
from tqdm import tqdm

from recstack.errors import DivergenceError
from recstack.training.checkpoint.checkpointer import Checkpointer
from recstack.training.divergence import DivergenceGuard
from recstack.training.early_stopping import Monitor
from recstack.training.evaluate import figures, select_metrics
from recstack.training.logger import MetricsLogger
from recstack.training.lr_schedule import LRScaler
from recstack.training.step import Progress


class Validator:
    """``target_auc``: ``train.target_auc`` (0 = none); ``model``: what ``check_weights`` looks at; ``lr``: the
    scaler the monitor's plateau reductions go to (None: no schedule and no plateau)."""

    def __init__(self, target_auc: float, guard: DivergenceGuard, monitor: Monitor, lr: LRScaler | None,
                 progress: Progress, checkpointer: Checkpointer, model: torch.nn.Module, is_main: bool) -> None:
        self.target_auc, self.guard, self.monitor, self.lr = target_auc, guard, monitor, lr
        self.progress, self.checkpointer, self.model, self.is_main = progress, checkpointer, model, is_main

    @property
    def finished(self) -> bool:
        """The run stopped at an evaluation (target reached, or early stopping): a resumed one trains no more."""
        return self.progress.target_step is not None or self.monitor.stopped_step is not None

    # -- the guard -------------------------------------------------------------------------------------
    def check_loss(self, loss: float) -> None:
        """The loss of the step about to be counted (``progress.step`` + 1). Collective under torchrun."""
        why = self.guard.check_loss(loss)
        if why is not None:
            step = self.progress.step
            self.diverged(f"step {step + 1}: {why}", step)  # the weights this loss was computed with

    def check_eval(self, result: dict[str, float]) -> None:
        why = self.guard.check_eval(result.get("logloss"))
        if why is not None:
            self.diverged(f"the evaluation of step {self.progress.step}: {why}", self.progress.step)

    def check_weights(self, step: int) -> None:
        """Before a checkpoint of ``step`` (the Checkpointer's ``before_save``). Collective under torchrun."""
        why = self.guard.check_weights(self.model)
        if why is not None:
            self.diverged(f"step {step}: {why}", step)

    def diverged(self, why: str, weights_step: int) -> NoReturn:
        """Stop the run: the weights after ``weights_step`` steps diverged, so a checkpoint of them is set aside
        (``<name>.diverged``: --resume and eval take the newest before it) and the error names it."""
        aside = self.checkpointer.set_aside(weights_step, ".diverged", self.is_main)
        note = f"; its checkpoint was set aside as {aside}" if aside is not None else ""
        raise DivergenceError(f"training diverged at {why}{note}. Lower the learning rates (optim.dense_lr, "
                              "optim.sparse_lr) or check the data; train.divergence_factor=0 turns the level check off")

    # -- evaluations -----------------------------------------------------------------------------------
    def validate(self, result: dict[str, float], logger: MetricsLogger) -> dict[str, float] | None:
        """An evaluation during training: checked, logged, held to the target and given to the monitor
        -> ``result`` when the run stops on it (target reached, or early stopping), else None."""
        p, m = self.progress, self.monitor
        self.check_eval(result)
        logger.log(p.step, "eval", result)
        if self.is_main:  # one line each, as the final one (above the progress bar)
            tqdm.write(f"eval at step {p.step}: {figures(result)}")
        stop = result if self.reached_target(result) else None
        self.select(result)  # after target_step is set: a checkpoint it writes records it
        if m.stopped_step is not None:
            stop = result
            if self.is_main:
                print(f"early stopping at step {p.step}: eval {m.metric} has not improved for "
                      f"{m.patience} evaluations (best {m.best_value:.6f} at step {m.best_step})")
        return stop

    def final(self, result: dict[str, float], logger: MetricsLogger) -> None:
        """The evaluation at the end of a run that did not stop at one; checked before the final checkpoint."""
        p, m = self.progress, self.monitor
        self.check_eval(result)
        new = not any(r["step"] == p.step and r["kind"] == "eval" for r in logger.kept)
        if new:
            logger.log(p.step, "eval", result)  # (a finished run resumed has it already)
        self.reached_target(result)  # the last evaluation counts too
        if new and m.active and m.stopped_step is None:
            self.select(result, final=True)

    def reached_target(self, result: dict[str, float]) -> bool:
        """Whether this evaluation reaches train.target_auc for the first time (recorded as target_step)."""
        p = self.progress
        if not self.target_auc or p.target_step is not None or result["auc"] < self.target_auc:
            return False
        p.target_step = p.step
        if self.is_main:
            print(f"reached train.target_auc={self.target_auc:g} at step {p.step} ({p.samples} samples)")
        return True

    def select(self, result: dict[str, float], final: bool = False) -> bool:
        """Give the evaluation ``result`` of this step to the monitor: a new best is saved as a checkpoint and
        kept (with early stopping), a plateau lowers the learning rates. -> whether a checkpoint was saved."""
        m, step = self.monitor, self.progress.step
        if not m.active:
            return False
        best = m.update(step, result)
        if self.lr is not None and self.lr.reduction != m.lr_factor:
            self.lr.reduction = m.lr_factor
            if self.is_main and not final:
                print(f"step {step}: eval {m.metric} has not improved for {m.plateau_patience} evaluations; "
                      f"learning rates x{m.lr_factor:g}")
        if not (best and m.stops):
            return False
        path = self.checkpointer.save(step)
        if path is not None:
            self.checkpointer.mark_best(path, step, select_metrics(result), self.is_main)
        return True

    def summary_fields(self) -> dict[str, Any]:
        """What ``summary.json`` adds with early stopping: the best step and metrics, the step it stopped at."""
        m = self.monitor
        return {"best_step": m.best_step, "best": select_metrics(m.best), "stopped_step": m.stopped_step} \
            if m.stops else {}

    def resumed(self) -> None:
        """After a resume: the learning rates at the monitor's reduction, and a best checkpoint written but not yet
        linked (stopped in between) linked now."""
        m, ckpt = self.monitor, self.checkpointer
        if self.lr is not None:
            self.lr.reduction = m.lr_factor
        if m.stops and m.best_step is not None and ckpt.best_step() != m.best_step:
            path: Path | None = ckpt.checkpoint_at(m.best_step)
            if path is not None:
                ckpt.mark_best(path, m.best_step, m.best, self.is_main)
            elif self.is_main:
                print(f"resume: the best checkpoint (step {m.best_step}) is gone; the best from here on is kept",
                      file=sys.stderr)
