"""No code runs from a checkpoint file: crafted pickles in ``.metadata``, ``trainer.pt``, ``rank_<rank>.pt``,
``ckpt_<step>.pt`` and ExFM snapshots are refused with an error naming the file, through the real command line
(``recstack eval``, ``predict``, ``torchrun ... train --resume``). The attacker is taken to be thorough: the
checksums the checkpoint records are recomputed for the crafted file (or removed, as in an older checkpoint), so
the restricted readers themselves are what stops it."""

from __future__ import annotations

import hashlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import CHECKPOINT_STEPS, SMALL, Payload, run_cli, torchrun, train_args

from recstack.errors import CheckpointError

DIGESTS = "file_sha256"  # the key of trainer.pt / state.pt that records the other files' checksums

STEPS = CHECKPOINT_STEPS


def crafted_pickle(marker: Path) -> bytes:
    data = pickle.dumps(Payload(marker))
    assert len(data) < 120  # the size of the reported attack: a few dozen bytes
    return data


def write_crafted_pt(path: Path, marker: Path) -> None:
    """A valid torch file (its zip CRCs intact) whose pickle calls ``os.system`` when loaded unrestricted."""
    torch.save({"complete": True, "step": 4, "x": Payload(marker)}, path)


def forge_digests(step_dir: Path, keep: bool = True) -> None:
    """Rewrite a sharded checkpoint's ``trainer.pt`` with checksums of the files as they are now (``keep``), or
    with none (an older checkpoint)."""
    trainer = step_dir / "trainer.pt"
    state = torch.load(trainer, weights_only=True)
    state.pop(DIGESTS, None)
    if keep:
        state[DIGESTS] = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                          for p in step_dir.iterdir() if p.name != "trainer.pt"}
    torch.save(state, trainer)


def copy_run(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("checksums", ["forged", "absent"])
def test_crafted_dcp_metadata_runs_nothing_in_eval_or_predict(sharded_run: Path, tiny_dataset: Path, tmp_path: Path,
                                                               checksums: str) -> None:
    run = copy_run(sharded_run, tmp_path)
    step_dir = run / "checkpoints" / "step_000000004"
    marker = tmp_path / "pwned"
    (step_dir / ".metadata").write_bytes(crafted_pickle(marker))
    forge_digests(step_dir, keep=checksums == "forged")
    for args in (["eval", "--checkpoint", str(step_dir)],
                 ["predict", "--checkpoint", str(step_dir), "--data", str(tiny_dataset),
                  "--out", str(tmp_path / "p.npy")]):
        res = run_cli(args)
        assert res.returncode == 2, res.stderr[-3000:]
        assert f"{step_dir / '.metadata'}: refused as DCP checkpoint metadata" in res.stderr, res.stderr[-3000:]
        assert "posix.system" in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert not marker.exists()
    assert not (tmp_path / "p.npy").exists()


@pytest.mark.parametrize("name", ["trainer.pt", "rank_00000.pt"])
def test_crafted_sharded_torch_files_run_nothing(sharded_run: Path, tmp_path: Path, name: str) -> None:
    run = copy_run(sharded_run, tmp_path)
    step_dir = run / "checkpoints" / "step_000000004"
    marker = tmp_path / "pwned"
    write_crafted_pt(step_dir / name, marker)
    if name != "trainer.pt":
        forge_digests(step_dir)
    res = run_cli(["eval", "--checkpoint", str(step_dir)])
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"{step_dir / name}: refused: it holds objects other than tensors and plain values" in res.stderr, \
        res.stderr[-3000:]
    assert not marker.exists()


def test_crafted_single_process_checkpoint_runs_nothing(single_run: Path, tmp_path: Path) -> None:
    run = copy_run(single_run, tmp_path)
    ckpt = run / "checkpoints" / "ckpt_000000004.pt"
    marker = tmp_path / "pwned"
    write_crafted_pt(ckpt, marker)
    res = run_cli(["eval", "--checkpoint", str(ckpt)])
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"{ckpt}: refused: it holds objects other than tensors and plain values" in res.stderr, res.stderr[-3000:]
    assert not marker.exists()


def test_torchrun_resume_skips_a_crafted_checkpoint(sharded_run: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    """The newest checkpoint's ``.metadata`` and rank 1's own file are crafted (checksums forged): every rank
    skips it for the older intact one, nothing runs, and training continues from there."""
    run = copy_run(sharded_run, tmp_path)
    step_dir = run / "checkpoints" / "step_000000004"
    marker = tmp_path / "pwned"
    (step_dir / ".metadata").write_bytes(crafted_pickle(marker))
    write_crafted_pt(step_dir / "rank_00001.pt", marker)
    forge_digests(step_dir)
    args = train_args(run, tiny_dataset, [*SMALL, *STEPS[1:], "train.max_steps=6"], "--resume")
    res = run_cli(args, launcher=torchrun(2), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not marker.exists()
    assert f"skipping {step_dir / '.metadata'}: refused as DCP checkpoint metadata" in res.stderr, res.stderr[-3000:]
    assert f"resume: continuing from {run / 'checkpoints' / 'step_000000002'} (step 2)" in res.stdout, res.stdout


def test_crafted_exfm_snapshot_runs_nothing(tmp_path: Path) -> None:
    """ExFM snapshots (read by the DAS) and stream checkpoints are single-process checkpoint files."""
    from recstack.exfm.fm import load_snapshot, snapshot_file

    marker = tmp_path / "pwned"
    write_crafted_pt(snapshot_file(tmp_path, 3), marker)
    with pytest.raises(CheckpointError, match="refused: it holds objects other than tensors") as e:
        load_snapshot(tmp_path, 3)
    assert str(snapshot_file(tmp_path, 3)) in str(e.value)
    assert not marker.exists()


def class_patching_pickle() -> bytes:
    """A ``.metadata`` that, unpickled with BUILD allowed on any object, sets
    ``pathlib.PosixPath.__fspath__`` (an allowed global) to ``torch.serialization._get_layout``
    (another), so every later ``os.fspath`` of a path in the process raises KeyError; only then does
    it reference ``posix.system``, which is refused."""
    return (b"\x80\x04" + b"cpathlib\nPosixPath\n" + b"N}" + b"X\x0a\x00\x00\x00__fspath__"
            + b"ctorch.serialization\n_get_layout\n" + b"s\x86b0" + b"cposix\nsystem\n"
            + b"X\x04\x00\x00\x00true\x85R.")


def test_metadata_patching_a_class_is_refused(sharded_run: Path, tmp_path: Path) -> None:
    """The crafted ``.metadata`` in the newest checkpoint: ``recstack eval`` of it refuses it naming
    the file (nothing set on the class: the error is the refusal, not a KeyError of a patched path),
    and ``recstack eval`` of the run falls back to the older intact checkpoint and evaluates it."""
    run = copy_run(sharded_run, tmp_path)
    step_dir = run / "checkpoints" / "step_000000004"
    (step_dir / ".metadata").write_bytes(class_patching_pickle())
    forge_digests(step_dir)
    res = run_cli(["eval", "--checkpoint", str(step_dir)])
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "KeyError" not in res.stderr, res.stderr[-3000:]
    assert (f"{step_dir / '.metadata'}: refused as DCP checkpoint metadata (UnpicklingError: it "
            "sets attributes of the class PosixPath, which DCP checkpoint metadata never does)"
            ) in res.stderr, res.stderr[-3000:]
    res = run_cli(["eval", "--checkpoint", str(run)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"skipping {step_dir}" in res.stderr and "KeyError" not in res.stderr, res.stderr[-3000:]
    older = run / "checkpoints" / "step_000000002"
    assert f"checkpoint: {older} (step 2)" in res.stderr, res.stderr[-2000:]


def test_the_metadata_reader_sets_nothing_on_any_class(sharded_run: Path, tmp_path: Path) -> None:
    """In this process: the crafted file is refused and ``PosixPath`` keeps its own ``__fspath__``;
    a real checkpoint's ``.metadata`` (dataclasses built from their fields, TensorProperties from
    its tuple) still reads."""
    from recstack.training.checkpoint.integrity import read_dcp_metadata

    file = tmp_path / ".metadata"
    file.write_bytes(class_patching_pickle())
    before = dict(vars(Path)), dict(vars(type(tmp_path)))
    with pytest.raises(CheckpointError, match="sets attributes of the class PosixPath"):
        read_dcp_metadata(file)
    assert (dict(vars(Path)), dict(vars(type(tmp_path)))) == before
    assert str(tmp_path / "x").endswith("/x") and Path(str(tmp_path)).exists()
    real = read_dcp_metadata(sharded_run / "checkpoints" / "step_000000004" / ".metadata")
    props = [m.properties for m in real.state_dict_metadata.values() if hasattr(m, "properties")]
    assert props and all(p.memory_format == torch.contiguous_format for p in props)
