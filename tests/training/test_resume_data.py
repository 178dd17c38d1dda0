"""``--resume`` continues only on the data its checkpoint trained on: other ``[data.synth]`` options, another
prepared set behind the same path or another ``data.eval_fraction`` are refused naming what differs (before any
data is generated again), unless ``--resume-on-new-data`` is given; a refused resume, for any reason, leaves every
file of the run directory as it was. Real ``recstack train`` processes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, run_cli, small_config, snapshot_files, train_args, write_tiny_dataset

from recstack.training.trainer import Trainer

SYNTH = ["data.synth.rows=3000", "data.synth.seed=1", "data.synth.max_table_size=40", "data.synth.calibration_rows=500"]
STEPS = [*SMALL, "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=0"]


def _train(run: Path, data: Path | None, options: list[str], **flags: bool) -> dict:
    """A run in this process (what the refused resumes below start from; the user path is theirs)."""
    trainer = Trainer(small_config(data, options), run, **flags)
    try:
        return trainer.train()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def finished_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    _train(run, tiny_dataset, STEPS)
    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _refused(args: list[str], run: Path, pattern: str) -> str:
    before = snapshot_files(run)
    res = run_cli(args)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    line = [x for x in res.stderr.splitlines() if x.strip()][-1]
    assert re.match(rf"recstack train: error: .*{pattern}", line), line
    assert snapshot_files(run) == before  # config.json, data/, checkpoints, metrics: nothing changed
    return line


def test_other_synth_options_are_refused_before_the_data_is_generated_again(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, None, [*STEPS, *SYNTH])
    line = _refused(train_args(run, None, [*STEPS, *SYNTH, "data.synth.rows=4000", "train.max_steps=6"], "--resume"),
                    run, r"run/data was generated with other \[data.synth\] options \(rows 3000 there, 4000 now\): "
                         r"the checkpoints in .* trained on it")
    assert "--resume-on-new-data" in line
    # Meant: the data is generated again and the run continues from its checkpoint on the new rows.
    res = run_cli(train_args(run, None, [*STEPS, *SYNTH, "data.synth.rows=4000", "train.max_steps=6"],
                             "--resume-on-new-data"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resume: continuing from" in res.stdout and "(step 4)" in res.stdout
    assert re.search(r"trained on other data than this run's: data.synth.rows: 3000 then, 4000 now; continuing",
                     res.stderr), res.stderr[-2000:]
    assert json.loads((run / "data" / "meta.json").read_text())["num_rows"] == 4000
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    # The checkpoints now record the new rows: a plain resume on them goes on.
    assert _train(run, None, [*STEPS, *SYNTH, "data.synth.rows=4000", "train.max_steps=8"], resume=True)["steps"] == 8


def test_a_synth_set_generated_again_elsewhere_is_refused_by_its_record(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, None, [*STEPS, *SYNTH])
    shutil.rmtree(run / "data")  # gone: generated again, with the options given now, before the checkpoint is read
    res = run_cli(train_args(run, None, [*STEPS, *SYNTH, "data.synth.seed=2", "train.max_steps=6"], "--resume"))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert re.search(r"error: resume: .*ckpt_000000004.pt trained on other data than this run's: data.synth.seed: "
                     r"1 then, 2 now\. --resume continues only on the data", res.stderr), res.stderr[-2000:]


def test_another_prepared_set_behind_the_same_path_is_refused(tmp_path: Path) -> None:
    data, run = write_tiny_dataset(tmp_path / "data", rows=3000), tmp_path / "run"
    _train(run, data, STEPS)
    labels = np.memmap(data / "labels.bin", np.float32, "r+")
    labels[-1] = 1 - labels[-1]  # one label of the last row: another set of rows
    labels.flush()
    del labels
    _refused(train_args(run, data, [*STEPS, "train.max_steps=6"], "--resume"), run,
             r"resume: .*ckpt_000000004.pt trained on other data than this run's: data.train: 'rows=3000, sha256=\w+' "
             r"then, 'rows=3000, sha256=\w+' now")
    assert _train(run, data, [*STEPS, "train.max_steps=6"], resume_on_new_data=True)["steps"] == 6


def test_another_eval_fraction_trains_on_other_rows(tiny_dataset: Path, finished_run: Path, tmp_path: Path) -> None:
    run = _copy(finished_run, tmp_path / "run")
    _refused(train_args(run, tiny_dataset, [*STEPS, "train.max_steps=6", "data.eval_fraction=0.2"], "--resume"),
             run, r"training rows: \[0, 18000\] then, \[0, 16000\] now")


@pytest.mark.parametrize("why", ["model", "unreadable"])
def test_a_resume_refused_for_another_reason_changes_nothing(tiny_dataset: Path, finished_run: Path, tmp_path: Path,
                                                            why: str) -> None:
    run = _copy(finished_run, tmp_path / "run")
    if why == "model":
        _refused(train_args(run, tiny_dataset, [*STEPS, "model.top_mlp=[16, 1]"], "--resume"), run,
                 r"does not match the model")
    else:
        for ckpt in (run / "checkpoints").glob("ckpt_*.pt"):
            ckpt.write_bytes(ckpt.read_bytes()[:1000])
        _refused(train_args(run, tiny_dataset, STEPS, "--resume"), run, r"none of the 2 checkpoints .* is readable")



@pytest.mark.parametrize(("option", "was", "now"),
                         [("train.seed", 0, 5), ("train.shuffle_window", 1000, 500)])
def test_an_order_option_changed_mid_epoch_is_refused(tiny_dataset: Path, tmp_path: Path,
                                                      option: str, was: int, now: int) -> None:
    """Stopped after 4 of an epoch's 282 shuffled batches, resumed with another ``train.seed`` or
    ``train.shuffle_window``: the rest of the epoch would come from another permutation (rows
    trained twice or never), so it is refused, like a ``train.shuffle`` change, naming the option
    and both values; nothing of the run changes."""
    window = [*STEPS, 'train.shuffle="window"', "train.shuffle_window=1000"]
    run = tmp_path / "run"
    _train(run, tiny_dataset, window)
    more = [*window, "train.max_steps=6", f"{option}={now}"]
    _refused(train_args(run, tiny_dataset, more, "--resume"), run,
             rf"{option} changed from {was} to {now} in the middle of epoch 0 \(256 rows done\): "
             rf"the rows still due are unknown. Resume with {option} = {was}, or change it at an "
             "epoch boundary")
