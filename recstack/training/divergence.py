"""The divergence guard: a run whose loss or weights blow up stops with a DivergenceError instead of training on
(a finite divergence ends at loss 1e6 and AUC 0.5 with exit 0 otherwise) and writing checkpoints of its values.

Checked, every step, on the loss (the mean over ranks under torchrun, so every rank decides alike): not finite,
or above ``train.divergence_factor`` x its running level, the mean of the last ``train.divergence_window`` steps'
losses but never below ln 2 (the logloss of predicting 0.5 for every row: a run whose loss is near 0 on easy data
may see a batch 100x its level without diverging; a logloss 100 x ln 2 = 69 means logits wrong by about 69 on
average). The default factor 100 is far above what a training loss does between steps; 0 turns the level check
off (non-finite losses still stop the run). Each evaluation's logloss is held to the same bound, and before every
checkpoint every floating tensor of the model (dense layers, the embedding rows in memory: this rank's shards
under torchrun) must be finite.

A checkpoint of step s holds the weights the loss of step s + 1 is computed with, so when the guard stops the run
at step s + 1, that checkpoint (if one was written) is set aside as ``<name>.diverged``: the newest valid
checkpoint is then one whose weights gave a loss the guard accepted.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

_FLOOR = math.log(2.0)


class DivergenceGuard:
    """``factor``: ``train.divergence_factor`` (0 = level check off); ``window``: ``train.divergence_window``
    steps; ``world`` > 1: losses and verdicts are reduced over the default process group on ``device``."""

    def __init__(self, factor: float, window: int, world: int = 1, device: torch.device | None = None) -> None:
        self.factor, self.world, self.device = factor, world, device or torch.device("cpu")
        self.recent: deque[float] = deque(maxlen=window)

    @property
    def level(self) -> float | None:
        """The running level the next loss is compared with (None before the first step)."""
        return max(sum(self.recent) / len(self.recent), _FLOOR) if self.recent else None

    def check_loss(self, loss: float) -> str | None:
        """This step's loss (this rank's) -> why the run diverged, or None (the loss then joins the level).
        Collective under torchrun."""
        if self.world > 1:
            t = torch.tensor([loss], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)  # a NaN or Inf on any rank reaches every rank
            loss = float(t.item()) / self.world
        why = self._judge("the training loss", loss)
        if why is None:
            self.recent.append(loss)
        return why

    def check_eval(self, logloss: float | None) -> str | None:
        """An evaluation's logloss (the same on every rank) -> why the model diverged, or None."""
        return None if logloss is None else self._judge("the evaluation logloss", logloss)

    def _judge(self, what: str, loss: float) -> str | None:
        if not math.isfinite(loss):
            return f"{what} is {loss}"
        level = self.level
        if self.factor > 0 and level is not None and loss > self.factor * level:
            return (f"{what} {loss:.4g} is {loss / level:.3g} x its running level {level:.4g} (the mean loss of "
                    f"the last {len(self.recent)} step(s), at least ln 2), above "
                    f"train.divergence_factor={self.factor:g}")
        return None

    def check_weights(self, model: torch.nn.Module) -> str | None:
        """-> the first model tensor holding a NaN or Inf (on any rank: collective under torchrun), or None."""
        bad = first_non_finite(model)
        if self.world > 1:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, bad)
            bad = next((f"{b} on rank {r}" for r, b in enumerate(gathered) if b is not None), None)
        return None if bad is None else f"the model's {bad} holds a non-finite value"

    def state_dict(self) -> dict[str, Any]:
        return {"divergence": {"recent": list(self.recent)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("divergence")  # absent in checkpoints written before the guard: the level starts anew
        self.recent.clear()
        if isinstance(saved, dict):
            self.recent.extend(float(x) for x in saved.get("recent", []))


def first_non_finite(model: torch.nn.Module, chunk: int = 1 << 22) -> str | None:
    """The name of the first floating tensor of ``model.state_dict()`` with a NaN or Inf, or None. Large tables are
    checked ``chunk`` elements at a time (a bool per element: bounded extra memory)."""
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.device.type == "meta":
            continue
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), chunk):
            if not bool(torch.isfinite(flat[start : start + chunk]).all()):
                return name
    return None
