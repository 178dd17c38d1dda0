"""The divergence guard: a run whose loss blows up (finite or not) or whose weights hold a NaN stops with one line
and exit 2, and no checkpoint of the diverged values is left where ``--resume`` or ``eval`` would take it. Real
``recstack train`` processes at learning rates that diverge (one process and two gloo ranks)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import SMALL, rank_errors, run_cli, small_config, torchrun, train_args

from recstack.errors import ConfigError, DivergenceError
from recstack.training.checkpoint.single import list_checkpoints, load_checkpoint
from recstack.training.divergence import DivergenceGuard
from recstack.training.trainer import Trainer

# Adam at lr 10 over the dense layers: the loss goes 0.72, 7.8e6, 3e12, ... (finite for 15 steps, as a diverged run
# with loss 1e6 and AUC 0.5 that ends with exit 0 without the guard); SGD at lr 30 climbs more slowly, 0.73, 2.4,
# 93 (58 x its level: accepted), 1.7e8 (step 4), 1.5e27, then NaN.
ADAM_10 = ['optim.dense="adam"', "optim.dense_lr=10", "optim.sparse_lr=0.1"]
SGD_30 = ['optim.dense="sgd"', "optim.dense_lr=30", "optim.sparse_lr=30", 'optim.sparse="sgd"']
RUN = ["train.max_steps=30", "train.checkpoint_every=1", "train.log_every=1", "train.eval_every=0"]


def _last_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [x for x in stderr.splitlines() if x.strip()][-1]


def _train_losses(run: Path) -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_a_finite_divergence_stops_the_run_and_leaves_no_checkpoint_of_it(tiny_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = run_cli(train_args(run, tiny_dataset, [*SMALL, *ADAM_10, *RUN]))
    assert res.returncode == 2, res.stderr[-3000:]
    line = _last_line(res.stderr)
    aside = run / "checkpoints" / "ckpt_000000001.pt.diverged"
    assert re.fullmatch(rf"recstack train: error: training diverged at step 2: the training loss [0-9.e+]+ is "
                        rf"[0-9.e+]+ x its running level 0\.7\d+ .*above train.divergence_factor=100; its checkpoint "
                        rf"was set aside as {re.escape(str(aside))}\. Lower the learning rates .*", line), line
    loss = float(line.split("the training loss ")[1].split()[0])
    assert math.isfinite(loss) and loss > 1e3
    assert aside.is_file() and list_checkpoints(run / "checkpoints") == []  # step 1's weights gave that loss
    assert not (run / "summary.json").exists()


def test_the_checkpoints_before_the_divergence_stay_and_eval_takes_the_newest(tiny_dataset: Path,
                                                                              tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = run_cli(train_args(run, tiny_dataset, [*SMALL, *SGD_30, *RUN, "train.keep_checkpoints=0"]))
    assert res.returncode == 2, res.stderr[-3000:]
    line = _last_line(res.stderr)
    step = int(re.search(r"training diverged at step (\d+): the training loss", line).group(1))
    losses = _train_losses(run)
    assert len(losses) == step - 1 and all(math.isfinite(x) for x in losses)  # every logged step was accepted
    kept = list_checkpoints(run / "checkpoints")
    assert step == 4 and [int(p.name[5:14]) for p in kept] == list(range(1, step - 1))
    assert (run / "checkpoints" / f"ckpt_{step - 1:09d}.pt.diverged").is_file()
    newest = load_checkpoint(kept[-1])
    assert all(bool(torch.isfinite(t).all()) for t in newest["model"].values() if t.is_floating_point())
    res = run_cli(["eval", "--checkpoint", str(run)])
    assert res.returncode == 0, res.stderr[-3000:]
    # With the level check off only the NaN stops it, later: the guard is what stopped the run above.
    off = tmp_path / "off"
    with pytest.raises(DivergenceError, match=r"at step 6: the training loss is nan"):
        Trainer(small_config(tiny_dataset, [*SGD_30, *RUN, "train.divergence_factor=0"]), off).train()
    assert len(_train_losses(off)) == 5


def test_under_torchrun_every_rank_stops_at_the_same_step(tiny_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = run_cli(train_args(run, tiny_dataset, [*SMALL, *ADAM_10, *RUN]), launcher=torchrun(2), timeout=300)
    assert res.returncode != 0
    errors = rank_errors(res.stderr)
    assert len(errors) == 2 and errors[0] == errors[1], res.stderr[-3000:]
    assert "training diverged at step 2: the training loss" in errors[0]
    assert "exitcode  : 2" in res.stderr  # both ranks' own exit code, no timeout (3) on a waiting peer
    assert not [p for p in (run / "checkpoints").iterdir() if re.fullmatch(r"step_\d{9}", p.name)]


def test_a_non_finite_weight_is_never_checkpointed(tiny_dataset: Path, tmp_path: Path) -> None:
    trainer = Trainer(small_config(tiny_dataset, ["train.max_steps=2"]), tmp_path / "run")
    trainer.train()
    before = list_checkpoints(tmp_path / "run" / "checkpoints")
    with torch.no_grad():
        trainer.model.embeddings.weight[-1, 3] = float("nan")  # a row no batch looks up: the loss stays finite
    with pytest.raises(DivergenceError, match=r"step 2: the model's embeddings.weight holds a non-finite value; "
                                              r"its checkpoint was set aside"):
        trainer.save()
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == [p for p in before if p.name != "ckpt_000000002.pt"]


def test_the_guard_on_its_own() -> None:
    g = DivergenceGuard(factor=10, window=3)
    assert g.check_loss(0.01) is None and g.level == pytest.approx(math.log(2))  # never below ln 2
    assert g.check_loss(6.0) is None  # below 10 x ln 2
    assert g.level == pytest.approx((0.01 + 6.0) / 2)
    assert "above train.divergence_factor=10" in g.check_loss(40.0)
    assert g.check_loss(float("inf")) == "the training loss is inf"
    assert g.check_eval(float("nan")) == "the evaluation logloss is nan"
    off = DivergenceGuard(factor=0, window=3)
    assert off.check_loss(0.5) is None and off.check_loss(1e30) is None and off.check_loss(float("nan"))
    for bad in ("train.divergence_factor=1", "train.divergence_factor=-2", "train.divergence_window=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            small_config(None, [bad])
