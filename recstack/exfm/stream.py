"""Streaming training: windows in time order, each evaluated before it is trained on, each trained on once.

For window t the ``StreamTrainer`` (1) evaluates the model on window t (progressive validation: the model
has seen only windows < t), (2) trains one pass over window t with the step shared with ``recstack.training.step``,
(3) runs the end-of-window hook (the FM publishes a snapshot there), (4) writes a checkpoint holding the
model, the optimizer, the next window, every window's metrics and the running totals. A resumed run starts
at the window after the newest checkpoint with the state it had then, so an interrupted stream ends in
exactly the model and metrics of an uninterrupted one: nothing is lost and no example is trained on twice.
The hook runs before the checkpoint, so a crash in between repeats the hook, never skips it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recstack.data.batch import Batch
from recstack.exfm.windows import Window
from recstack.io import json_safe
from recstack.metrics import BinaryMetrics
from recstack.training.checkpoint.single import latest_checkpoint, save_checkpoint
from recstack.training.checkpoint.state import Stateful, rng_state, set_rng_state
from recstack.training.logger import MetricsLogger, read_jsonl
from recstack.training.step import optimizer_step

# evaluate(window) -> {group name: accumulated metrics of that window}, e.g. {"serving": ..., "fm": ...}
Evaluator = Callable[[Window], dict[str, BinaryMetrics]]
# t -> window t, or None when the stream has no window t (a ``recstack.exfm.source.WindowSource``'s ``window``)
WindowLookup = Callable[[int], Window | None]
METRIC_KEYS = ("ne", "logloss", "auc", "calibration", "ctr", "num_examples")


def metric_values(m: BinaryMetrics) -> dict[str, float | None]:
    """The subset of ``BinaryMetrics.compute()`` a stream reports, JSON-ready (NaN -> None)."""
    out = m.compute()
    return json_safe({k: out[k] for k in METRIC_KEYS})


class StreamTrainer:
    """Trains ``model`` through ``windows[first:]`` in order; totals count windows >= ``eval_from``.

    Args:
        windows: the windows, or a lookup t -> window t (None: the stream ended before it), which may wait for
            window t to arrive.
        loss_fn: batch -> scalar training loss (the model's forward inside).
        train_batches: window -> the batches to train on (may raise when FM labels are missing).
        evaluate: window -> metric groups of the progressive evaluation (the model is in eval mode).
        ckpt_dir: per-window checkpoints (None: none, no resume).
        on_window_end: called with the window index after training on it, before the checkpoint.
        describe: window -> extra fields of its record (e.g. the FM snapshot version it was labelled with).
        states: more state of the checkpoint (e.g. dynamic id maps), each merged in with its own keys.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Batch], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        windows: Sequence[Window] | WindowLookup,
        train_batches: Callable[[Window], Iterable[Batch]],
        evaluate: Evaluator,
        *,
        device: torch.device | str = "cpu",
        first: int = 0,
        eval_from: int = 0,
        ckpt_dir: str | Path | None = None,
        log_dir: str | Path | None = None,
        on_window_end: Callable[[int], None] | None = None,
        describe: Callable[[Window], dict[str, Any]] | None = None,
        resume: bool = True,
        states: Sequence[Stateful] = (),
    ) -> None:
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.window_at: WindowLookup = windows if callable(windows) else _lookup(windows)
        self.train_batches, self.evaluate = train_batches, evaluate
        self.device = torch.device(device)
        self.next_window = first
        self.eval_from = eval_from
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir else None
        self.on_window_end = on_window_end
        self.describe = describe
        self.states = list(states)
        self.records: list[dict[str, Any]] = []  # one per finished window
        self.totals: dict[str, BinaryMetrics] = {}
        self.log_dir = Path(log_dir) if log_dir else None
        if resume and self.ckpt_dir is not None:
            state = latest_checkpoint(self.ckpt_dir)
            if state is not None:
                self.load_state_dict(state)

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        for s in self.states:
            extra.update(s.state_dict())
        return {
            **extra,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "next_window": self.next_window,
            "records_json": json.dumps(self.records),  # plain text: NaN-free and safe to load weights_only
            "totals": {k: m.state() for k, m in self.totals.items()},
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.next_window = int(state["next_window"])
        self.records = json.loads(state["records_json"])
        self.totals = {k: BinaryMetrics.from_state(v) for k, v in state["totals"].items()}
        set_rng_state(state["rng"])
        for s in self.states:
            s.load_state_dict(state)

    # -- loop ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _evaluate(self, window: Window) -> dict[str, BinaryMetrics]:
        self.model.eval()
        try:
            return self.evaluate(window)
        finally:
            self.model.train()

    def _train(self, window: Window) -> dict[str, float | None]:
        self.model.train()
        loss_sum, steps, rows, t0 = 0.0, 0, 0, time.perf_counter()
        for batch in self.train_batches(window):
            loss = optimizer_step(self.loss_fn, self.optimizer, batch, self.device)
            if not math.isfinite(loss):
                raise FloatingPointError(f"window {window.index}, step {steps + 1}: loss is {loss}; lower the "
                                         "learning rates")
            loss_sum += loss
            steps += 1
            rows += batch.batch_size
        seconds = time.perf_counter() - t0
        return {"train_loss": loss_sum / steps if steps else None, "train_steps": steps, "train_rows": rows,
                "train_seconds": seconds}

    def run_window(self, window: Window) -> dict[str, Any]:
        """Evaluate, train and checkpoint ``window`` (the next one); -> its record."""
        groups = self._evaluate(window)
        record: dict[str, Any] = {"window": window.index}
        for name, m in groups.items():
            record[name] = metric_values(m)
            if window.index >= self.eval_from and m.num_examples:
                self.totals.setdefault(name, BinaryMetrics()).merge(m)
        record.update(self._train(window))
        if self.describe is not None:
            record.update(self.describe(window))
        if self.on_window_end is not None:
            self.on_window_end(window.index)
        self.records.append(record)
        self.next_window += 1
        if self.ckpt_dir is not None:
            save_checkpoint(self.ckpt_dir, self.next_window, self.state_dict(), keep=1)
        return record

    def run(self, until: int | None = None) -> list[dict[str, Any]]:
        """Run windows up to (not including) ``until`` (default: until the stream ends); -> every window's record
        so far."""
        logger = MetricsLogger(self.log_dir, tensorboard=False) if self.log_dir else None
        try:
            if logger is not None:
                self._log_missing(logger)
            while until is None or self.next_window < until:
                window = self.window_at(self.next_window)
                if window is None:
                    break
                record = self.run_window(window)
                if logger is not None:
                    logger.log(record["window"], "window", _flat(record))
        finally:
            if logger is not None:
                logger.close()
        return self.records

    def _log_missing(self, logger: MetricsLogger) -> None:
        """After a resume: log the checkpointed windows that the killed run had not logged yet."""
        done = {r["step"] for r in read_jsonl(logger.path)} if logger.path and logger.path.is_file() else set()
        for record in self.records:
            if record["window"] not in done:
                logger.log(record["window"], "window", _flat(record))

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Metrics over every evaluated window >= eval_from, per group (pooled, not averaged over windows)."""
        return {name: metric_values(m) for name, m in self.totals.items()}


def _lookup(windows: Sequence[Window]) -> WindowLookup:
    return lambda t: windows[t] if t < len(windows) else None


def _flat(record: dict[str, Any]) -> dict[str, float | int | None]:
    """{"serving": {"ne": ..}, "train_loss": ..} -> {"serving_ne": .., "train_loss": ..} for the JSONL log."""
    out: dict[str, float | int | None] = {}
    for k, v in record.items():
        if k == "window":
            continue
        items = v.items() if isinstance(v, dict) else [(None, v)]
        for kk, vv in items:
            out[k if kk is None else f"{k}_{kk}"] = math.nan if vv is None else vv  # the logger writes null
    return out
