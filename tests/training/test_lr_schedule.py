"""Learning-rate warm-up and decay: the DLRM reference's factors, both optimizers follow them, resume
continues the schedule, bad settings name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import small_config

from recstack.config import load_config
from recstack.errors import ConfigError
from recstack.training.lr_schedule import LRSchedule
from recstack.training.trainer import Trainer

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=[32, 8]", "model.top_mlp=[32, 1]", "train.batch_size=64",
         "train.threads=1", "train.progress=false", 'optim.sparse="rowwise_adagrad"', 'optim.dense="adam"',
         "optim.dense_lr=0.01"]


def _policy(count: int, warmup: int, decay_start: int, decay_steps: int) -> float:
    """The DLRM reference's policy written out case by case, at its scheduler step count (1 = first update)."""
    if count < warmup:
        return 1.0 - (warmup - count) / warmup
    if decay_start <= count < decay_start + decay_steps:
        return ((decay_steps - (count - decay_start)) / decay_steps) ** 2
    if decay_steps > 0 and count >= decay_start + decay_steps:
        return 0.0
    return 1.0


def _reference_factor(step: int, warmup: int, decay_start: int, decay_steps: int) -> float:
    """The factor of update ``step`` (0 = the first)."""
    return _policy(step + 1, warmup, decay_start, decay_steps)


class _ReferenceScheduler(torch.optim.lr_scheduler.LRScheduler):
    """The policy read at torch's ``_step_count``, as the reference's scheduler does."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int, start: int, steps: int) -> None:
        self.policy = (warmup, start, steps)
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [base * _policy(self._step_count, *self.policy) for base in self.base_lrs]


@pytest.mark.parametrize(("warmup", "start", "steps"), [(0, 0, 0), (4, 0, 0), (4, 10, 4), (0, 0, 5), (3, 3, 7)])
def test_factors_follow_the_reference_policy(warmup: int, start: int, steps: int) -> None:
    s = LRSchedule(warmup, start, steps)
    assert s.active == (warmup > 0 or steps > 0)
    for step in range(40):
        assert s.factor(step) == pytest.approx(_reference_factor(step, warmup, start, steps), abs=1e-15), step
    assert LRSchedule(4, 10, 4).factor(0) == 0.25 and LRSchedule(4, 10, 4).factor(10) == 0.5625


@pytest.mark.parametrize(("warmup", "start", "steps"), [(4, 4, 0), (4, 10, 4), (0, 0, 5), (3, 3, 7)])
def test_update_s_trains_at_the_rate_a_torch_scheduler_gives_it(warmup: int, start: int, steps: int) -> None:
    """The reference's loop: the scheduler is made (its step count becomes 1), then each update runs
    ``optimizer.step(); scheduler.step()``. So the first update already trains at 1 / warmup, not at 0."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = _ReferenceScheduler(opt, warmup, start, steps)
    s = LRSchedule(warmup, start, steps)
    for step in range(20):
        assert s.factor(step) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-15), step
        opt.step()
        sched.step()


def _trainer(data: Path, out: Path | None, extra: list[str]) -> Trainer:
    return Trainer(small_config(data, extra, base=SMALL), out)


def _weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.model.state_dict().items() if "accumulator" not in k}


def test_the_first_warm_up_step_trains_at_one_over_warmup(tiny_dataset: Path) -> None:
    """Factor 1/4 at step 0 must reach the dense optimizer and the embedding tables alike: Adam's and row-wise
    Adagrad's first updates are linear in the learning rate, so every weight moves 1/4 as far as without."""
    moves = []
    for warmup in (0, 4):
        t = _trainer(tiny_dataset, None, ["train.max_steps=1", f"optim.lr_warmup_steps={warmup}"])
        before = _weights(t)
        t.train()
        moves.append({k: v - before[k] for k, v in _weights(t).items()})
    plain, warm = moves
    assert {"embeddings.weight", "bottom.0.weight", "top.0.weight"} <= {k for k, v in plain.items() if v.any()}
    for k in plain:
        torch.testing.assert_close(warm[k], plain[k] / 4, rtol=1e-3, atol=1e-7, msg=k)


def test_decay_to_zero_freezes_the_model_and_factors_are_logged(tiny_dataset: Path, tmp_path: Path) -> None:
    t = _trainer(tiny_dataset, tmp_path, ["train.max_steps=12", "train.log_every=1", "optim.lr_warmup_steps=4",
                                          "optim.lr_decay_start_step=4", "optim.lr_decay_steps=4"])
    t.train()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    factors = [x["lr_factor"] for x in lines if x["kind"] == "train"]
    assert factors == pytest.approx([_reference_factor(s, 4, 4, 4) for s in range(12)])
    before = _weights(t)  # steps 7-11 ran at factor 0: one more such step changes nothing
    t.lr.set_step(12)
    t.train_step(next(iter(t.train_loader.iterate_epoch(limit=1))))
    assert all(torch.equal(before[k], v) for k, v in _weights(t).items())


def test_resume_continues_the_schedule(tiny_dataset: Path, tmp_path: Path) -> None:
    sched = ["optim.lr_warmup_steps=12", "optim.lr_decay_start_step=14", "optim.lr_decay_steps=10"]
    whole = _trainer(tiny_dataset, tmp_path / "whole", ["train.max_steps=24", *sched]).train()
    _trainer(tiny_dataset, tmp_path / "cut", ["train.max_steps=10", *sched]).train()  # checkpoint at step 10
    cfg = small_config(tiny_dataset, ["train.max_steps=24", *sched], base=SMALL)
    resumed = Trainer(cfg, tmp_path / "cut", resume=True)
    assert resumed.step == 10
    out = resumed.train()
    assert {k: out[k] for k in ("auc", "logloss", "steps")} == {k: whole[k] for k in ("auc", "logloss", "steps")}



def test_tiered_tables_follow_the_schedule(tiny_dataset: Path, tmp_path: Path) -> None:
    """Host- and ssd-cached tables (memory budgets) train as the all-in-memory ones under the same schedule."""
    sched = ["train.max_steps=40", "optim.lr_warmup_steps=10", "optim.lr_decay_start_step=20",
             "optim.lr_decay_steps=15"]
    budgets = ['memory.device="4392"', 'memory.host="10800"', f'memory.ssd_dir="{tmp_path / "ssd"}"']
    ref = _trainer(tiny_dataset, None, sched).train()
    tiered = _trainer(tiny_dataset, None, [*sched, *budgets])
    assert any(type(m).__name__ == "TieredEmbeddingCollection" for m in tiered.model.modules())
    run = tiered.train()
    plain = _trainer(tiny_dataset, None, ["train.max_steps=40"]).train()
    assert {k: run[k] for k in ("auc", "logloss")} == {k: ref[k] for k in ("auc", "logloss")} != \
        {k: plain[k] for k in ("auc", "logloss")}

@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.lr_warmup_steps=-1"], "optim.lr_warmup_steps: must be >= 0"),
    (["optim.lr_decay_steps=-3"], "optim.lr_decay_steps: must be >= 0"),
    (["optim.lr_warmup_steps=10", "optim.lr_decay_start_step=5", "optim.lr_decay_steps=4"],
     "optim.lr_decay_start_step: the decay must start after the warm-up"),
    (["optim.lr_warmup_steps=1.5"], "optim.lr_warmup_steps: expected int"),
])
def test_bad_schedules_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
