"""The training loop's components on their own: the checkpoint cadence (``Checkpointer.maybe_save``) and the log
window (``MetricsWindow``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from recstack.embedding.collection import TableConfig
from recstack.embedding.fused import FusedEmbeddingBagCollection
from recstack.embedding.sparse_optim import SparseOptimizerConfig
from recstack.training.checkpoint.checkpointer import Checkpointer
from recstack.training.checkpoint.single import list_checkpoints
from recstack.training.logger import MetricsWindow


class Weights:
    def __init__(self) -> None:
        self.w = torch.zeros(2)

    def state_dict(self) -> dict:
        return {"w": self.w.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"]


def test_maybe_save_cadence(tmp_path: Path) -> None:
    """Every ``every`` steps and at the last step, once per step; ``before_save`` sees every save."""
    checked: list[int] = []
    emb = FusedEmbeddingBagCollection([TableConfig("t", 5, 2, (0,))], SparseOptimizerConfig())
    c = Checkpointer(tmp_path, emb, 1, torch.device("cpu"), [Weights()], [], every=3, before_save=checked.append)
    due = [step for step in range(1, 8) if c.maybe_save(step, last=False)]
    assert due == [3, 6] and checked == [3, 6]
    assert c.maybe_save(7, last=True) and not c.maybe_save(7, last=True)  # the last step once
    assert c.save(7) is not None and c.saved_at == 7
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"ckpt_{s:09d}.pt" for s in (3, 6, 7)]
    never = Checkpointer(None, emb, 1, torch.device("cpu"), [], [], every=0)
    assert not never.maybe_save(5, last=False) and never.maybe_save(5, last=True) and never.saved_at == 5


def test_metrics_window() -> None:
    w = MetricsWindow(samples_per_step=64)
    for loss in (1.0, 0.5):
        started = time.perf_counter()
        time.sleep(0.01)
        assert w.add(loss, started) >= 0.01
    values, n = w.take()
    assert n == 2 and values["loss"] == 0.75 and values["time_step"] >= 0.01
    assert 0 < values["samples_per_sec"] <= 128 / 0.02
    assert w.n == 0 and w.loss == 0.0  # a new window
