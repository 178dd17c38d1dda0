"""Disk faults end in one line naming the path and the cause, exit code 2, and leave nothing a later run takes
as valid: every writer (``train`` with its checkpoints, ``data prepare``, ``data synth``, ``predict``, ``plan
--out``, ``export``) on a read-only place and on a full disk, as real processes. ``disk_helpers`` says how a full
or read-only disk is made here (a tmpfs where the tests may mount one, else a file-size limit or a file in place
of a directory)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import CHECKPOINT_STEPS, SMALL, train_args, train_steps
from disk_helpers import Disk, error_line, leftovers, read_only_dir, small_disk

from recstack.cli.main import main
from recstack.training.checkpoint.single import list_checkpoints

# Tables of 64 columns: a checkpoint of ~0.7 MB, far more than the 128 KiB left on the full disk, while the
# run's other files (config.json, metrics.jsonl, TensorBoard events) fit in it.
WIDE = [*SMALL, "model.embedding_dim=64", "model.bottom_mlp=[32, 64]"]
FREE = 128 * 1024


def criteo_tsv(path: Path, rows: int = 200) -> Path:
    """A raw Criteo Kaggle file: label, 13 integers, 26 hex categories per line."""
    rng = np.random.default_rng(0)
    lines = ["\t".join([str(int(rng.random() < 0.3)), *(str(int(v)) for v in rng.integers(0, 50, 13)),
                        *(f"{int(v):08x}" for v in rng.integers(0, 20, 26))]) for _ in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_full_disk_during_a_checkpoint_keeps_the_last_good_one(tiny_dataset: Path, tmp_path: Path) -> None:
    """A resumed run whose next checkpoint does not fit: one line naming ckpt_<step>.pt and the cause, exit 2,
    no .tmp; once there is room again, --resume continues from the last good checkpoint."""
    with small_disk(tmp_path) as disk:
        run = disk.path / "run"
        train_steps(tiny_dataset, run, [*WIDE, *CHECKPOINT_STEPS])  # checkpoints at steps 2 and 4
        ckpts = run / "checkpoints"
        assert [p.name for p in list_checkpoints(ckpts)] == ["ckpt_000000002.pt", "ckpt_000000004.pt"]
        disk.fill(FREE)
        more = [*WIDE, *CHECKPOINT_STEPS, "train.max_steps=6"]
        line = error_line(disk.run(train_args(run, tiny_dataset, more, "--resume")))
        assert f"cannot write {ckpts / 'ckpt_000000006.pt'}: {disk.error}" in line, line
        assert leftovers(run) == []
        assert [p.name for p in list_checkpoints(ckpts)] == ["ckpt_000000002.pt", "ckpt_000000004.pt"]
        disk.free_up()
        res = disk.run(train_args(run, tiny_dataset, more, "--resume"))
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"continuing from {ckpts / 'ckpt_000000004.pt'} (step 4)" in res.stdout
        assert json.loads((run / "summary.json").read_text())["steps"] == 6


def test_predict_on_a_full_disk_leaves_no_tmp(single_run: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    """20,000 scores (80 KB as .npy) on a disk with 16 KiB left: the error names the scores file; no .tmp."""
    with small_disk(tmp_path) as disk:
        out = disk.path / "scores" / "p.npy"
        disk.fill(16 * 1024)
        line = error_line(disk.run(["predict", "--checkpoint", str(single_run), "--data", str(tiny_dataset),
                                    "--out", str(out)]))
        assert f"cannot write {out}: {disk.error}" in line, line
        assert not out.exists() and leftovers(disk.path) == []


def test_prepare_on_a_full_disk_leaves_no_tmp(tmp_path: Path) -> None:
    """The prepared arrays do not fit: the error names the output's .tmp directory, which is removed."""
    raw = criteo_tsv(tmp_path / "day_0.tsv", rows=3000)  # labels and dense alone are 168 KB
    with small_disk(tmp_path) as disk:
        out = disk.path / "prepared"
        disk.fill(32 * 1024)
        line = error_line(disk.run(["data", "prepare", str(raw), "--out", str(out), "--max-ind-range", "100"]))
        assert f"{out}.tmp" in line and disk.error in line, line
        assert not out.exists() and leftovers(disk.path) == []


@pytest.mark.parametrize("command", ["synth", "plan"])
def test_synth_and_plan_on_a_full_disk_leave_nothing(command: str, tmp_path: Path) -> None:
    """``data synth --out`` (190 KB of arrays for 1000 rows) and ``plan --out`` (a 2 KB plan) on a disk with
    1 KiB left: one line naming the output and the cause, exit 2, nothing left on the disk (no .tmp, no part of
    the output)."""
    with small_disk(tmp_path) as disk:
        out = disk.path / ("synth" if command == "synth" else "plan.json")
        args = {"synth": ["data", "synth", "--rows", "1000", "--out", str(out)],
                "plan": ["plan", "--synthetic-tables", "2", "--rows", "1000", "--dim", "16", "--topology", "1x2",
                         "--out", str(out)]}[command]
        disk.fill(1024)
        line = error_line(disk.run(args))
        assert f"cannot write {out}" in line and line.endswith(disk.error), line
        assert sorted(p.name for p in disk.path.iterdir() if p != disk.filler) == []
        disk.free_up()  # the same command succeeds once there is room: the disk was the only fault
        assert disk.run(args).returncode == 0 and out.exists()


def _commands(ro: Path, single_run: Path, tiny_dataset: Path, raw: Path) -> dict[str, list[str]]:
    out = ro / "out"
    return {
        "train": train_args(out, tiny_dataset, [*SMALL, "train.max_steps=2"]),
        "prepare": ["data", "prepare", str(raw), "--out", str(out), "--max-ind-range", "100"],
        "synth": ["data", "synth", "--rows", "1000", "--out", str(out)],
        "predict": ["predict", "--checkpoint", str(single_run), "--data", str(tiny_dataset), "--out",
                    str(out / "p.npy")],
        "plan": ["plan", "--synthetic-tables", "2", "--rows", "1000", "--dim", "16", "--topology", "1x2",
                 "--out", str(out / "plan.json")],
        "export": ["export", "--checkpoint", str(single_run), "--out", str(out)],
    }


@pytest.mark.parametrize("command", ["train", "prepare", "synth", "predict", "plan", "export"])
def test_every_writer_on_a_read_only_place_fails_at_once(command: str, single_run: Path, tiny_dataset: Path,
                                                        tmp_path: Path) -> None:
    """Checked before the work: one line naming the output and the cause, exit 2, nothing written."""
    raw = criteo_tsv(tmp_path / "day_0.tsv")
    with read_only_dir(tmp_path) as ro:
        res = Disk(tmp_path, mounted=False).run(_commands(ro, single_run, tiny_dataset, raw)[command])
        line = error_line(res)
        assert f"cannot write {ro / 'out'}" in line, line
        assert any(cause in line for cause in ("(EROFS)", "(EACCES)", "(ENOTDIR)")), line
        assert not (ro / "out").exists()


def test_prepare_over_an_existing_file_fails_before_the_work(tmp_path: Path, capsys: pytest.CaptureFixture
                                                             ) -> None:
    raw = criteo_tsv(tmp_path / "day_0.tsv")
    out = tmp_path / "prepared"
    out.write_text("not a directory\n")
    assert main(["data", "prepare", str(raw), "--out", str(out), "--overwrite", "--max-ind-range", "10"]) == 2
    assert f"cannot write {out}: it is a file, not a directory" in capsys.readouterr().err
    assert out.read_text() == "not a directory\n" and leftovers(tmp_path) == []


def test_infer_schema_to_a_read_only_place_fails_before_the_work(tmp_path: Path) -> None:
    """``data inspect --infer-schema OUT`` checks OUT first: one line, exit 2, and no statistics
    computed (the report, printed before the schema is written, never comes)."""
    raw = tmp_path / "train.csv"
    raw.write_text("label,x,item\n" + "".join(f"{i % 2},{i * 0.5},i{i % 7}\n" for i in range(500)))
    with read_only_dir(tmp_path) as ro:
        args = ["data", "inspect", str(raw), "--infer-schema", str(ro / "out")]
        res = Disk(tmp_path, mounted=False).run(args)
        line = error_line(res)
        assert f"cannot write {ro / 'out'}" in line, line
        assert "rows" not in res.stdout and res.stdout.strip() == "", res.stdout[-2000:]
        assert not (ro / "out").exists()
