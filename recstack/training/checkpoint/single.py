"""Atomic single-process checkpoints: one ``torch.save`` of a state dict, or a directory with table files.

A checkpoint is written to a temporary file in the same directory, fsynced, then renamed over its final name,
so a crash mid-write leaves either the previous checkpoints or a stray ``.tmp`` file, never a file that loads
wrong. Files are ``ckpt_<step>.pt``; loading checks their zip CRC32s and uses ``torch.load(weights_only=True)``
(``integrity.load_pt``), so a checkpoint holds only tensors and plain Python values and a damaged one is refused.

A checkpoint with ``files`` (tables too large to pass through one ``torch.save``, written by their own writers
in chunks) is a directory ``ckpt_<step>/`` holding ``state.pt`` beside those files. It is built as
``ckpt_<step>.tmp/``, every file fsynced, then renamed into place the same way, so it is equally atomic.
``state.pt``, written last, records the size and SHA-256 of every file beside it, checked on load.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from recstack.errors import CheckpointError
from recstack.io import fsync_dir, fsync_file, open_synced, writing
from recstack.training.checkpoint.integrity import DIGESTS, file_digests, load_pt, note_unverified, verify_files

_NAME = re.compile(r"^ckpt_(\d{9})(\.pt)?$")  # a file ckpt_<step>.pt or a directory ckpt_<step>
STATE_FILE = "state.pt"  # the torch.save part of a directory checkpoint


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt_{step:09d}.pt"


def _write_state(path: Path, step: int, state: dict[str, Any]) -> None:
    with open_synced(path) as f:
        torch.save({**state, "step": step, "complete": True}, f)


def save_checkpoint(
    directory: str | Path,
    step: int,
    state: dict[str, Any],
    keep: int = 0,
    files: dict[str, Callable[[Path], None]] | None = None,
) -> Path:
    """Write ``state`` atomically as ``ckpt_<step>.pt``; keep only ``keep`` (0 = all): this one and the newest
    ``keep - 1`` others.

    With ``files`` ({relative path: writer}), the checkpoint is the directory ``ckpt_<step>/``: each writer is
    called with the path it must create inside it, then ``state.pt`` is written last.
    """
    directory = Path(directory)
    final = checkpoint_path(directory, step) if not files else directory / f"ckpt_{step:09d}"
    tmp = final.with_name(final.name + ".tmp")
    # A disk fault (full, read-only) is a DiskError naming the file; the .tmp is removed, the earlier
    # checkpoints stay the newest valid ones.
    with writing(final, remove=[tmp]):
        _write_checkpoint(directory, final, tmp, step, state, files)
    if keep > 0:
        # The one just written always stays, even when a stale one has a higher step (a run resumed from an
        # earlier checkpoint because the newest did not load): pruning by step alone would delete it.
        others = [p for p in list_checkpoints(directory) if p != final]
        for old_ckpt in others[: max(len(others) - (keep - 1), 0)]:
            if old_ckpt.is_dir():
                shutil.rmtree(old_ckpt, ignore_errors=True)
            else:
                old_ckpt.unlink(missing_ok=True)
    return final


def _write_checkpoint(directory: Path, final: Path, tmp: Path, step: int, state: dict[str, Any],
                      files: dict[str, Callable[[Path], None]] | None) -> None:
    """``save_checkpoint``'s writes: ``tmp`` filled and renamed to ``final``."""
    directory.mkdir(parents=True, exist_ok=True)
    if not files:
        _write_state(tmp, step, state)
        os.replace(tmp, final)
    else:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        tmp.mkdir()
        for rel, writer in files.items():
            path = tmp / rel
            if tmp.resolve() not in path.resolve().parents:
                raise ValueError(f"checkpoint file {rel!r} would be written outside {tmp}")
            path.parent.mkdir(parents=True, exist_ok=True)
            writer(path)
            fsync_file(path)  # whatever the writer did, the bytes must be on disk before the rename
        for sub in {(tmp / rel).parent for rel in files}:
            fsync_dir(sub)
        _write_state(tmp / STATE_FILE, step, {**state, DIGESTS: file_digests(tmp, files)})
        fsync_dir(tmp)
        if final.exists():  # saved again at the same step: move the old one aside first (a rename cannot
            old = final.with_name(final.name + ".old")  # replace a non-empty directory)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    fsync_dir(directory)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoints (files and directories) in step order (oldest first); temporary ones are ignored."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(m, p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for m, p in sorted(found, key=lambda mp: (int(mp[0].group(1)), mp[1].name))]


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint file, or a checkpoint directory (its ``state.pt``; ``state["checkpoint_dir"]`` then names the
    directory so the caller can read the files beside it)."""
    path = Path(path)
    directory = None
    if path.is_dir():
        directory, path = path, path / STATE_FILE
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (incomplete checkpoint directory)")
    state = load_pt(path, map_location)  # CheckpointError naming the file: damaged, or not only tensors
    if not isinstance(state, dict) or state.get("complete") is not True:
        raise CheckpointError(f"{path}: incomplete checkpoint (no completion marker)")
    digests = state.pop(DIGESTS, None)
    if directory is not None:
        if isinstance(digests, dict):
            verify_files(directory, digests)  # the table files beside state.pt
        else:
            note_unverified(directory)
        state["checkpoint_dir"] = str(directory)
    return state


def latest_checkpoint(directory: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
    """The newest checkpoint that loads; unreadable ones are reported and skipped."""
    for path in reversed(list_checkpoints(directory)):
        try:
            state = load_checkpoint(path, map_location)
        except CheckpointError as e:
            warnings.warn(f"skipping {e}", stacklevel=2)
            continue
        state["path"] = str(path)
        return state
    return None
