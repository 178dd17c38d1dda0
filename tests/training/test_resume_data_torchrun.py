"""``--resume`` under torchrun: every rank refuses other data than the sharded checkpoint trained on with the same
error, leaving the run directory as it was, and ``--resume-on-new-data`` lets every rank go on."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from conftest import SMALL, cli_train, rank_errors, run_cli, snapshot_files, torchrun, train_args, write_tiny_dataset

STEPS = [*SMALL, "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=0"]


def test_under_torchrun_every_rank_refuses_and_the_flag_lets_them_go_on(tmp_path: Path) -> None:
    data, run = write_tiny_dataset(tmp_path / "data", rows=3000), tmp_path / "run"
    cli_train(run, data, STEPS, launcher=torchrun(2), timeout=300)
    shutil.rmtree(data)
    write_tiny_dataset(data, rows=3000, seed=1)  # other rows behind the same path
    before = snapshot_files(run)
    res = run_cli(train_args(run, data, [*STEPS, "train.max_steps=6"], "--resume"), launcher=torchrun(2))
    errors = rank_errors(res.stderr)
    assert res.returncode != 0 and len(errors) == 2 and errors[0] == errors[1], res.stderr[-3000:]
    assert re.search(r"step_000000004 trained on other data than this run's: data.train: ", errors[0]), errors[0]
    assert snapshot_files(run) == before
    summary = cli_train(run, data, [*STEPS, "train.max_steps=6"], "--resume-on-new-data", launcher=torchrun(2))
    assert summary["steps"] == 6
