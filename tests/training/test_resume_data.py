"""``--resume`` continues only on the data its checkpoint trained on: other ``[data.synth]`` options, another
prepared set behind the same path or another ``data.eval_fraction`` are refused naming what differs (before any
data is generated again), unless ``--resume-on-new-data`` is given; a refused resume, for any reason, leaves every
file of the run directory as it was. Real ``recstack train`` processes."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, cli_train, run_cli, torchrun, train_args, write_tiny_dataset

SYNTH = ["data.synth.rows=3000", "data.synth.seed=1", "data.synth.max_table_size=40", "data.synth.calibration_rows=500"]
STEPS = [*SMALL, "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=0"]


def _snapshot(run: Path) -> dict[str, str]:
    """Every file under ``run`` -> a SHA-256 of its bytes (names and contents: what a refused resume must keep)."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def _refused(args: list[str], run: Path, pattern: str) -> str:
    before = _snapshot(run)
    res = run_cli(args)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    line = [x for x in res.stderr.splitlines() if x.strip()][-1]
    assert re.match(rf"recstack train: error: .*{pattern}", line), line
    assert _snapshot(run) == before  # config.json, data/, checkpoints, metrics: nothing changed
    return line


def test_other_synth_options_are_refused_before_the_data_is_generated_again(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cli_train(run, None, [*STEPS, *SYNTH])
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
    # The checkpoints now record the new rows: a plain --resume on them goes on.
    cli_train(run, None, [*STEPS, *SYNTH, "data.synth.rows=4000", "train.max_steps=8"], "--resume")


def test_a_synth_set_generated_again_elsewhere_is_refused_by_its_record(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cli_train(run, None, [*STEPS, *SYNTH])
    shutil.rmtree(run / "data")  # gone: generated again, with the options given now, before the checkpoint is read
    res = run_cli(train_args(run, None, [*STEPS, *SYNTH, "data.synth.seed=2", "train.max_steps=6"], "--resume"))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert re.search(r"error: resume: .*ckpt_000000004.pt trained on other data than this run's: data.synth.seed: "
                     r"1 then, 2 now\. --resume continues only on the data", res.stderr), res.stderr[-2000:]


def test_another_prepared_set_behind_the_same_path_is_refused(tmp_path: Path) -> None:
    data, run = write_tiny_dataset(tmp_path / "data", rows=3000), tmp_path / "run"
    cli_train(run, data, STEPS)
    labels = np.memmap(data / "labels.bin", np.float32, "r+")
    labels[-1] = 1 - labels[-1]  # one label of the last row: another set of rows
    labels.flush()
    del labels
    _refused(train_args(run, data, [*STEPS, "train.max_steps=6"], "--resume"), run,
             r"resume: .*ckpt_000000004.pt trained on other data than this run's: data.train: 'rows=3000, sha256=\w+' "
             r"then, 'rows=3000, sha256=\w+' now")
    _refused(train_args(run, data, [*STEPS, "train.max_steps=6", "data.eval_fraction=0.2"], "--resume"), run,
             r"data.train: ")  # still the other rows first
    res = run_cli(train_args(run, data, [*STEPS, "train.max_steps=6"], "--resume-on-new-data"))
    assert res.returncode == 0, res.stderr[-3000:]


def test_another_eval_fraction_trains_on_other_rows(tiny_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cli_train(run, tiny_dataset, STEPS)
    _refused(train_args(run, tiny_dataset, [*STEPS, "train.max_steps=6", "data.eval_fraction=0.2"], "--resume"),
             run, r"training rows: \[0, 18000\] then, \[0, 16000\] now")


@pytest.mark.parametrize("why", ["model", "unreadable"])
def test_a_resume_refused_for_another_reason_changes_nothing(tiny_dataset: Path, tmp_path: Path, why: str) -> None:
    run = tmp_path / "run"
    cli_train(run, tiny_dataset, STEPS)
    if why == "model":
        _refused(train_args(run, tiny_dataset, [*STEPS, "model.top_mlp=[16, 1]"], "--resume"), run,
                 r"does not match the model")
    else:
        for ckpt in (run / "checkpoints").glob("ckpt_*.pt"):
            ckpt.write_bytes(ckpt.read_bytes()[:1000])
        _refused(train_args(run, tiny_dataset, STEPS, "--resume"), run, r"none of the 2 checkpoints .* is readable")


def test_under_torchrun_every_rank_refuses_and_the_flag_lets_them_go_on(tmp_path: Path) -> None:
    data, run = write_tiny_dataset(tmp_path / "data", rows=3000), tmp_path / "run"
    cli_train(run, data, STEPS, launcher=torchrun(2), timeout=300)
    shutil.rmtree(data)
    write_tiny_dataset(data, rows=3000, seed=1)  # other rows behind the same path
    before = _snapshot(run)
    res = run_cli(train_args(run, data, [*STEPS, "train.max_steps=6"], "--resume"), launcher=torchrun(2))
    errors = [x for x in res.stderr.splitlines() if x.startswith("recstack train: error:")]
    assert res.returncode != 0 and len(errors) == 2 and errors[0] == errors[1], res.stderr[-3000:]
    assert re.search(r"step_000000004 trained on other data than this run's: data.train: ", errors[0]), errors[0]
    assert _snapshot(run) == before
    summary = cli_train(run, data, [*STEPS, "train.max_steps=6"], "--resume-on-new-data", launcher=torchrun(2))
    assert summary["steps"] == 6
