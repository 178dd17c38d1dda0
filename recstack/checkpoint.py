"""Atomic single-process checkpoints: model, optimizers, data position, RNG state.

A checkpoint is written to a temporary file in the same directory, fsynced, then renamed over its final name,
so a crash mid-write leaves either the previous checkpoints or a stray ``.tmp`` file, never a file that loads
wrong. Files are ``ckpt_<step>.pt``; loading uses ``torch.load(weights_only=True)``, so a checkpoint holds
only tensors and plain Python values.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

_NAME = re.compile(r"^ckpt_(\d{9})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file is unreadable or incomplete."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt_{step:09d}.pt"


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep: int = 0) -> Path:
    """Write ``state`` atomically as ``ckpt_<step>.pt``; keep only the newest ``keep`` (0 = all)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    tmp = final.with_name(final.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({**state, "step": step, "complete": True}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if keep > 0:
        for old in list_checkpoints(directory)[:-keep]:
            old.unlink(missing_ok=True)
    return final


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in step order (oldest first); temporary files are ignored."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, disallowed type: all mean "not usable"
        raise CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or state.get("complete") is not True:
        raise CheckpointError(f"{path}: incomplete checkpoint (no completion marker)")
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


def rng_state() -> dict[str, Any]:
    """Python, NumPy legacy and torch (CPU, and CUDA when present) RNG states as weights_only-safe values."""
    py = random.getstate()
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), *n[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
