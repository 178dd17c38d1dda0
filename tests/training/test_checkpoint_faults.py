"""Damaged checkpoints: a flipped byte in any file of a checkpoint (single file, directory with table files,
sharded step directory) is refused naming the file; sharded eval and resume fall back to the newest intact
checkpoint as single-process ones do; ``--resume`` with checkpoints of which none is readable is an error, and
a refused resume leaves the run directory as it was. Checkpoints written before the checksums still load."""

from __future__ import annotations

import json
import re
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import CHECKPOINT_STEPS, SMALL, run_cli, torchrun, train_args, train_steps

DIGESTS = "file_sha256"  # the key of trainer.pt / state.pt that records the other files' checksums
STEPS = CHECKPOINT_STEPS
SSD = ['memory.device="16452"', 'memory.host="0"']  # the tiny set's C4 in an ssd-cached tier: table files


def flip_byte(path: Path) -> None:
    """One bit changed in the middle of the file (of a torch file's largest record: a tensor's bytes)."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            big = max(z.infolist(), key=lambda i: i.file_size)
        names, extra = struct.unpack("<HH", data[big.header_offset + 26 : big.header_offset + 30])
        at = big.header_offset + 30 + names + extra + big.file_size // 2
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``directory``: its bytes and modification time."""
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiered_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("tiered")
    train_steps(tiny_dataset, base / "run", [*STEPS, *SSD, f'memory.ssd_dir="{base / "ssd"}"'])
    return base / "run"


def copy_run(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def eval_cli(checkpoint: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    from recstack.cli.main import main

    capsys.readouterr()
    code = main(["eval", "--checkpoint", str(checkpoint)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", ["ckpt_000000004.pt", "tiered:tables/003.f32", "tiered:state.pt",
                                  "sharded:__1_0.distcp", "sharded:.metadata", "sharded:trainer.pt",
                                  "sharded:rank_00000.pt"])
def test_a_flipped_byte_is_refused_naming_the_file(single_run: Path, tiered_run: Path, sharded_run: Path,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture, name: str) -> None:
    kind, _, rel = name.rpartition(":")
    run = copy_run({"": single_run, "tiered": tiered_run, "sharded": sharded_run}[kind], tmp_path)
    ckpt = run / "checkpoints" / {"": rel, "tiered": "ckpt_000000004", "sharded": "step_000000004"}[kind]
    file = ckpt if kind == "" else ckpt / rel
    flip_byte(file)
    code, err = eval_cli(ckpt, capsys)
    assert code == 2, err
    assert f"{file}: checksum mismatch" in err, err


def test_a_truncated_table_file_is_refused_naming_the_file(tiered_run: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    run = copy_run(tiered_run, tmp_path)
    file = run / "checkpoints" / "ckpt_000000004" / "tables" / "003.f32"
    truncate(file)
    code, err = eval_cli(file.parent.parent, capsys)
    assert code == 2 and f"{file}: " in err and "bytes" in err, err


@pytest.mark.parametrize("damage", [truncate, flip_byte])
def test_sharded_eval_falls_back_to_the_newest_intact_checkpoint(sharded_run: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture, damage) -> None:
    run = copy_run(sharded_run, tmp_path)
    newest = run / "checkpoints" / "step_000000004"
    damage(newest / "__1_0.distcp")
    with pytest.warns(UserWarning, match=f"skipping {newest}: its tables could not be read"):
        code, err = eval_cli(run, capsys)
    assert code == 0, err
    damage(run / "checkpoints" / "step_000000002" / "__1_0.distcp")  # every checkpoint damaged: eval stops
    with pytest.warns(UserWarning):
        code, err = eval_cli(run, capsys)
    assert code == 2 and "no readable checkpoint" in err and f"{newest}: its tables could not be read" in err, err


def test_checkpoints_without_checksums_still_load_unverified(tiered_run: Path, sharded_run: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    """Written by a recstack that recorded no checksums: they load, and say once that they are unverified."""
    import recstack.training.checkpoint.integrity as integrity

    for name, run, state_file in (("tiered", tiered_run, "ckpt_000000004/state.pt"),
                                  ("sharded", sharded_run, "step_000000004/trainer.pt")):
        run = copy_run(run, tmp_path / name)
        path = run / "checkpoints" / state_file
        state = torch.load(path, weights_only=True)
        assert isinstance(state.pop(DIGESTS), dict)
        torch.save(state, path)
        integrity._told_unverified = False
        code, err = eval_cli(path.parent, capsys)
        assert code == 0, err
        assert err.count("unverified") == 1 and f"note: {path.parent} records no checksums" in err, err


def test_single_resume_with_no_readable_checkpoint_is_an_error_that_changes_nothing(
        single_run: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    run = copy_run(single_run, tmp_path)
    for ckpt in (run / "checkpoints").iterdir():
        flip_byte(ckpt)
    before = snapshot(run)
    res = run_cli(train_args(run, tiny_dataset, [*SMALL, *STEPS[1:], "train.max_steps=6"], "--resume"))
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"resume: none of the 2 checkpoints in {run / 'checkpoints'} is readable" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and snapshot(run) == before


def test_a_refused_resume_leaves_the_run_directory_as_it_was(single_run: Path, tiny_dataset: Path,
                                                             tmp_path: Path) -> None:
    """A resume refused because the checkpoint does not fit the model keeps the run's own config.json."""
    run = copy_run(single_run, tmp_path)
    before = snapshot(run)
    res = run_cli(train_args(run, tiny_dataset, [*SMALL, *STEPS[1:], "model.embedding_dim=16",
                                                 "model.bottom_mlp=[32, 16]"], "--resume"))
    assert res.returncode == 2 and "does not match the model" in res.stderr, res.stderr[-3000:]
    assert snapshot(run) == before


@pytest.mark.parametrize(("name", "refusal"), [("trainer.pt", "cannot be loaded"),
                                               (".metadata", r"\d+ bytes, the checkpoint recorded \d+")],
                         ids=["trainer.pt", "metadata"])
def test_sharded_resume_falls_back_and_stops_when_none_is_readable(sharded_run: Path, tiny_dataset: Path,
                                                                   tmp_path: Path, name: str, refusal: str) -> None:
    """The newest checkpoint's ``trainer.pt`` or DCP ``.metadata`` truncated: every rank resumes from the older
    one. Every one damaged: the resume stops with an error on every rank (not a start from scratch) and leaves
    the run as it was."""
    run = copy_run(sharded_run, tmp_path)
    ckpts = run / "checkpoints"
    truncate(ckpts / "step_000000004" / name)
    args = train_args(run, tiny_dataset, [*SMALL, *STEPS[1:], "train.max_steps=6"], "--resume")
    res = run_cli(args, launcher=torchrun(2), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resume: continuing from {ckpts / 'step_000000002'} (step 2)" in res.stdout, res.stdout
    assert re.search(rf"skipping .*{re.escape(str(ckpts / 'step_000000004' / name))}: {refusal}", res.stderr), \
        res.stderr[-3000:]

    for step_dir in ckpts.iterdir():
        truncate(step_dir / "__0_0.distcp")
    before = snapshot(run)
    res = run_cli(args, launcher=torchrun(2), timeout=400)
    assert res.returncode != 0, res.stderr[-3000:]
    assert res.stderr.count(f"resume: none of the 3 checkpoints in {ckpts} is readable") == 2, res.stderr[-3000:]
    assert "starting from scratch" not in res.stdout and snapshot(run) == before


# Early stopping on: evaluations at steps 2 and 4, the better one kept in best/, named in best.json.
BEST = [*STEPS, "train.eval_every=2", 'train.early_stopping={metric="logloss", patience=5}']


@pytest.fixture(scope="module")
def best_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("best") / "run"
    train_steps(tiny_dataset, run, BEST)
    return run


@pytest.mark.parametrize("damage", ["outside", "other step", "other content"])
def test_a_best_json_that_names_another_checkpoint_is_refused(best_run: Path, tiny_dataset: Path,
                                                              tmp_path: Path, damage: str) -> None:
    """``best.json`` naming a checkpoint outside the run (another run's), one of another step than
    it records, or a file under the right name that holds another step: ``eval``, ``predict`` and
    ``export`` of the run refuse it with one line naming best.json, instead of using those weights
    (nor does ``--resume``, through the same reader)."""
    run = copy_run(best_run, tmp_path)
    shutil.copytree(best_run, tmp_path / "other")
    ckpts = run / "checkpoints"
    best = json.loads((ckpts / "best.json").read_text())
    kept = ckpts / best["checkpoint"]
    step = best["step"]
    if damage == "outside":
        best["checkpoint"] = f"../../other/checkpoints/{best['checkpoint']}"
        error = f"names {best['checkpoint']!r}, which lies outside the run's checkpoints ({ckpts})"
    elif damage == "other step":
        best["checkpoint"] = f"ckpt_{6 - step:09d}.pt"
        error = (f"records step {step}, but names {best['checkpoint']!r}, a checkpoint of step "
                 f"{6 - step}")
    else:
        kept.unlink()
        shutil.copy(ckpts / f"ckpt_{6 - step:09d}.pt", kept)
        error = f"records step {step}, but the checkpoint it names, {kept}, holds step {6 - step}"
    (ckpts / "best.json").write_text(json.dumps(best))
    # all three read a run's best checkpoint alike: each in one case
    commands = [["eval", "--checkpoint", str(run)],
                ["predict", "--checkpoint", str(run), "--data", str(tiny_dataset), "--out",
                 str(tmp_path / "p.npy")],
                ["export", "--checkpoint", str(run), "--out", str(tmp_path / "artifact")]]
    for args in commands if damage == "outside" else commands[:1]:
        res = run_cli(args, timeout=120)
        assert res.returncode == 2, (args[0], res.stderr[-2000:])
        assert "Traceback" not in res.stderr, res.stderr[-2000:]
        want = f"recstack {args[0]}: error: {ckpts / 'best.json'}: {error}"
        assert want in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "p.npy").exists() and not (tmp_path / "artifact").exists()
