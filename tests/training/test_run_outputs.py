"""What a run tells and writes: each checkpoint once, intermediate evaluations on the console, the checkpoint
``eval`` used, data paths that ``eval`` finds from anywhere, and clear errors for a model that cannot be built
(``model.bottom_mlp=[]`` with dense features, tables too large for the machine's memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, run_cli, set_options, train_args, train_steps

from recstack.cli.main import main
from recstack.data.format import SparseFeatureSpec
from recstack.data.prepared_writer import PreparedWriter
from recstack.training.checkpoint import single


def test_each_checkpoint_is_written_once_and_evaluations_reach_the_console(
        tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    saved: list[int] = []
    real = single.save_checkpoint

    def recording(directory, step, *args, **kwargs):  # the real writer, counted
        saved.append(step)
        return real(directory, step, *args, **kwargs)

    monkeypatch.setattr(single, "save_checkpoint", recording)
    monkeypatch.setattr("recstack.training.checkpoint.checkpointer.save_checkpoint", recording)
    options = [f'data.train="{tiny_dataset}"', *SMALL, "train.max_steps=6", "train.checkpoint_every=2",
               "train.eval_every=2"]
    assert main(["train", "--output-dir", str(tmp_path / "run"), *set_options(options)]) == 0
    assert saved == [2, 4, 6]  # the last one once, not again after the final evaluation
    out = capsys.readouterr().out
    evals = [line for line in out.splitlines() if line.startswith("eval at step ")]
    assert [line.split(":")[0] for line in evals] == ["eval at step 2", "eval at step 4"], out
    assert all("AUC " in line and "logloss " in line and "NE " in line for line in evals)
    assert "final eval: AUC " in out


def test_eval_names_the_checkpoint_and_finds_relative_data_from_anywhere(
        tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run trained with data.train relative to where it started; eval started from another directory, with
    the checkpoint file itself: it says which checkpoint and step, and reads the run's data."""
    run = tmp_path / "run"
    monkeypatch.chdir(tiny_dataset.parent)
    train_steps(tiny_dataset, run, ["train.max_steps=2", f'data.train="{tiny_dataset.name}"'])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ckpt = run / "checkpoints" / "ckpt_000000002.pt"
    res = subprocess.run([sys.executable, "-m", "recstack", "eval", "--checkpoint", str(ckpt)], cwd=elsewhere,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"checkpoint: {ckpt} (step 2)" in res.stderr
    assert json.loads(res.stdout)["data"] == str(tiny_dataset)


def test_an_empty_bottom_mlp_with_dense_features_is_a_config_error(tiny_dataset: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    options = [f'data.train="{tiny_dataset}"', *SMALL, "model.bottom_mlp=[]", "train.max_steps=1"]
    assert main(["train", "--output-dir", str(tmp_path / "run"), *set_options(options)]) == 2
    assert "model.bottom_mlp: the data has 13 dense features, which need a bottom MLP" in capsys.readouterr().err


def test_a_table_too_large_for_memory_is_an_error_before_allocating(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "huge"
    specs = [SparseFeatureSpec("small", 10), SparseFeatureSpec("huge", 10**13)]
    with PreparedWriter(data, ["I1"], specs) as w:
        w.write(np.zeros(64, np.float32), np.zeros((64, 1), np.float32), np.zeros((64, 2), np.int64))
    options = [f'data.train="{data}"', *SMALL, "model.bottom_mlp=[8]", "train.max_steps=1", "train.batch_size=16"]
    assert main(["train", *set_options(options)]) == 2
    err = capsys.readouterr().err  # 10^13 rows x (8 float32 + a row-wise Adagrad accumulator): 3.6e14 bytes
    assert "table 'huge': 10,000,000,000,000 rows x 8 need 327.4 TiB" in err and "of memory on cpu" in err, err


def test_a_thread_count_past_the_bound_is_an_error_not_a_crash(tiny_dataset: Path,
                                                               tmp_path: Path) -> None:
    """``train.threads=100000`` (torch's pool dies by SIGSEGV starting that many) and ``serve
    --threads``: one line naming the option and the bound, exit 2, before anything is written."""
    args = train_args(tmp_path / "run", tiny_dataset, [*SMALL, "train.threads=100000"])
    res = run_cli(args, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    want = "recstack train: error: train.threads: must be <= 1024, got 100000"
    assert want in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "run").exists()
    res = run_cli(["serve", str(tmp_path / "none"), "--threads", "100000"], timeout=120)
    assert res.returncode == 2, res.stderr
    assert "argument --threads: must be at most 1024, got 100000" in res.stderr, res.stderr
