"""train.early_stopping, optim.plateau_* and the best checkpoint: where a run stops, which checkpoint eval uses,
the same decisions after a SIGKILL and --resume, and under torchrun."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import (
    RECSTACK,
    SMALL,
    cli_train,
    kill_after_checkpoints,
    run_cli,
    small_config,
    torchrun,
    train_args,
    write_tiny_dataset,
)

from recstack.errors import ConfigError
from recstack.training.trainer import Trainer

# 1500 training rows seen for 40 epochs: the evaluation logloss is best at the first evaluation and then grows.
OVERFIT = ["train.epochs=40", "train.eval_every=20", "data.eval_fraction=0.5", "train.log_every=20"]
STOP = ['train.early_stopping={metric="logloss", patience=3}', "train.keep_checkpoints=1"]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("overfit") / "data", rows=3000)


def _evals(run: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "eval"]


def _expected_stop(evals: list[dict], patience: int) -> tuple[int, int]:
    """(best step, stop step) by the rule written out: stop at the evaluation that is the ``patience``-th in a
    row not below the best logloss."""
    best, best_step, since = math.inf, -1, 0
    for e in evals:
        if e["logloss"] < best:
            best, best_step, since = e["logloss"], e["step"], 0
        else:
            since += 1
            if since == patience:
                return best_step, e["step"]
    raise AssertionError("the run did not overfit enough to stop")


def test_early_stopping_stops_and_eval_uses_the_best(small_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = Trainer(small_config(small_data, [*OVERFIT, *STOP]), run).train()
    evals = _evals(run)
    best_step, stop_step = _expected_stop(evals, patience=3)
    total = 40 * (1500 // 64)
    assert summary["steps"] == stop_step == summary["stopped_step"] < total
    assert evals[-1]["step"] == stop_step  # no evaluation after the one that stopped it
    assert summary["best_step"] == best_step
    best_eval = next(e for e in evals if e["step"] == best_step)
    assert summary["best"]["auc"] == pytest.approx(best_eval["auc"], abs=1e-12)
    # keep_checkpoints=1 pruned the regular checkpoint of the best step; best/ keeps it.
    ckpt = run / "checkpoints"
    assert [p.name for p in ckpt.glob("ckpt_*")] == [f"ckpt_{stop_step:09d}.pt"]
    assert [p.name for p in (ckpt / "best").iterdir()] == [f"ckpt_{best_step:09d}.pt"]
    assert json.loads((ckpt / "best.json").read_text())["step"] == best_step

    res = run_cli(["eval", "--checkpoint", str(run)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["auc"] == pytest.approx(best_eval["auc"], abs=1e-6)
    last = run_cli(["eval", "--checkpoint", str(run), "--last"])  # the newest: the model at the stop
    assert json.loads(last.stdout)["auc"] == pytest.approx(evals[-1]["auc"], abs=1e-6)
    explicit = run_cli(["eval", "--checkpoint", str(ckpt / f"ckpt_{stop_step:09d}.pt")])  # used as given
    assert json.loads(explicit.stdout)["auc"] == pytest.approx(evals[-1]["auc"], abs=1e-6)


def test_best_checkpoint_with_cached_tiers(small_data: Path, tmp_path: Path) -> None:
    """A directory checkpoint (ckpt_<step>/ with the cached tables' files) is kept and read back the same way."""
    run = tmp_path / "run"
    tiers = ['memory.device="4392"', 'memory.host="10800"', f'memory.ssd_dir="{tmp_path / "ssd"}"']
    summary = Trainer(small_config(small_data, [*OVERFIT, *STOP, *tiers]), run).train()
    best = run / "checkpoints" / "best" / f"ckpt_{summary['best_step']:09d}"
    assert best.is_dir() and summary["stopped_step"] is not None
    res = run_cli(["eval", "--checkpoint", str(run)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["auc"] == pytest.approx(summary["best"]["auc"], abs=1e-6)


def test_resume_after_sigkill_stops_at_the_same_step_with_the_same_best(small_data: Path, tmp_path: Path) -> None:
    options = [*SMALL, *OVERFIT, *STOP, "train.checkpoint_every=20", "train.keep_checkpoints=0"]
    whole = cli_train(tmp_path / "whole", small_data, options)
    run = tmp_path / "killed"
    # Killed once the checkpoints of steps 20 (the best) and 40 are written: 40 resumes one evaluation into the
    # patience count.
    proc = kill_after_checkpoints(train_args(run, small_data, options), run / "checkpoints", 2)
    assert proc.returncode == -9, "the run ended before it could be killed"
    resumed = cli_train(run, small_data, options, "--resume")
    for key in ("steps", "stopped_step", "best_step"):
        assert resumed[key] == whole[key], key
    for key, value in whole["best"].items():
        assert resumed["best"][key] == pytest.approx(value, abs=1e-9), key
    assert json.loads((run / "checkpoints" / "best.json").read_text())["step"] == whole["best_step"]


def test_plateau_reduces_both_learning_rates_at_the_right_evaluation(small_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = Trainer(small_config(small_data, [
        *OVERFIT, "train.max_steps=100", "train.log_every=1", "optim.plateau_patience=1", "optim.plateau_factor=0.5",
        'train.early_stopping.metric="logloss"']), run)
    summary = trainer.train()
    assert summary["steps"] == 100 and "best_step" not in summary  # no early stopping: it runs to the end
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    factors = {x["step"]: x["lr_factor"] for x in lines if x["kind"] == "train"}
    evals = _evals(run)  # the last, at step 100, after the last update
    best, factor, expected = math.inf, 1.0, {}
    for e in evals:  # the rule written out: x0.5 at every evaluation not below the best
        if e["logloss"] < best:
            best = e["logloss"]
        else:
            factor *= 0.5
        expected[e["step"]] = factor
    assert min(expected.values()) < 1.0  # it did plateau
    for step in range(1, 101):  # a train record's factor is the one its step trained with
        done = [s for s in expected if s < step]
        assert factors[step] == (expected[max(done)] if done else 1.0), step
    assert trainer.lr is not None and trainer.lr.reduction == expected[100]
    assert trainer.model.embeddings.optimizer.lr_scale == factors[100]  # the sparse optimizer too
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * factors[100])


@pytest.mark.parametrize("option,field", [("train.early_stopping.patience=2", "train.early_stopping"),
                                          ("optim.plateau_patience=2", "optim.plateau_patience")])
def test_early_stopping_and_plateau_need_eval_every(small_data: Path, tmp_path: Path, option: str,
                                                    field: str) -> None:
    with pytest.raises(ConfigError, match=f"{field}.*train.eval_every"):
        Trainer(small_config(small_data, ["train.max_steps=5", option]), tmp_path / "run")


def test_defaults_keep_no_best_and_no_monitor_state(small_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = Trainer(small_config(small_data, ["train.max_steps=30", "train.eval_every=10"]), run).train()
    assert "best_step" not in summary and not (run / "checkpoints" / "best.json").exists()
    import torch

    state = torch.load(run / "checkpoints" / "ckpt_000000030.pt", weights_only=True)
    assert "early_stopping" not in state  # the checkpoint format of a run without it is unchanged


@pytest.mark.slow
def test_torchrun_two_ranks_stop_at_the_same_step(small_data: Path, tmp_path: Path) -> None:
    options = [*SMALL, *OVERFIT, *STOP]
    one = cli_train(tmp_path / "one", small_data, options)
    two = cli_train(tmp_path / "two", small_data, [*options, "train.batch_size=32", 'dist.sharding="row_wise"'],
                    launcher=torchrun(2))
    assert two["world_size"] == 2 and one["world_size"] == 1
    for key in ("steps", "stopped_step", "best_step"):
        assert two[key] == one[key], key
    assert two["best"]["logloss"] == pytest.approx(one["best"]["logloss"], abs=1e-5)
    best = tmp_path / "two" / "checkpoints" / "best" / f"step_{one['best_step']:09d}"
    assert best.is_dir()
    res = run_cli(["eval", "--checkpoint", str(tmp_path / "two")], launcher=RECSTACK)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["auc"] == pytest.approx(two["best"]["auc"], abs=1e-6)
