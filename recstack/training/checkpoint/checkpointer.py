"""One Checkpointer over every kind of checkpoint a run writes and reads.

The kind follows from the world size and the embedding collection:
  - one process, tables in memory: a file ``ckpt_<step>.pt`` (``single.py``);
  - one process, cached tiers: a directory ``ckpt_<step>/`` with ``state.pt`` beside the collection's table
    files (``embeddings.checkpoint_files()``);
  - torchrun: a directory ``step_<step>/`` of DCP files with the embedding shards, ``trainer.pt`` with the
    replicated state and ``rank_<rank>.pt`` with each rank's own (``sharded.py``).
The components (``state.py``, ``step.Progress``) give their state the same way; the Checkpointer puts it into
the checkpoint of the right kind, finds the newest valid one and loads it back (``load_latest``), and reads any
kind in one process for evaluation (``read``, ``gather_tables``). Damaged or refused checkpoints are skipped for
the newest intact one (``integrity.py`` says what is checked). A run never silently starts over beside the
other kind, nor when checkpoints exist but none is readable.

With ``train.early_stopping`` the best checkpoint is kept apart from the newest ``keep``: ``mark_best`` links
its files (hard links: no copy on disk) into ``best/`` and names it in ``best.json``, so pruning leaves it, and
``read`` of a run or checkpoints directory gives it (the newest with ``last``).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
from recstack.embedding.collection import EmbeddingCollection
from recstack.errors import CheckpointError, ConfigError
from recstack.io import fsync_dir, json_safe
from recstack.training.checkpoint.sharded import (
    _STEP_DIR,
    SHARDED_STATE_FILE,
    list_sharded,
    load_newest_sharded,
    open_sharded,
    read_full_tables,
    save_sharded,
)
from recstack.training.checkpoint.single import (
    _NAME,
    STATE_FILE,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from recstack.training.checkpoint.state import Stateful

BEST_DIR = "best"  # in the checkpoints directory: hard links to the best checkpoint's files
BEST_FILE = "best.json"  # beside it: {"step", "checkpoint" (relative to the checkpoints directory), "metrics"}


class Checkpointer:
    """``replicated``: components whose state every rank holds alike (rank 0 writes it); ``rank_local``: each
    rank's own. Components load in the order given. ``directory`` None: nothing is saved or resumed.
    ``every``: ``train.checkpoint_every`` (0 = only at the end), the cadence of ``maybe_save``.
    ``before_save(step)``: called before every checkpoint written (the divergence guard's weight check, which
    raises rather than let diverged weights be saved)."""

    def __init__(self, directory: Path | None, embeddings: EmbeddingCollection, world: int, device: torch.device,
                 replicated: list[Stateful], rank_local: list[Stateful], keep: int = 0, every: int = 0,
                 before_save: Callable[[int], None] | None = None) -> None:
        self.directory, self.embeddings, self.world, self.device = directory, embeddings, world, device
        self.replicated, self.rank_local, self.keep = replicated, rank_local, keep
        self.every, self.before_save = every, before_save
        self.saved_at: int | None = None  # the step of the last checkpoint this run wrote

    def maybe_save(self, step: int, last: bool) -> bool:
        """The checkpoint cadence: a checkpoint of ``step`` when it is a multiple of ``every`` or the run's
        ``last``, unless this step has one already (an evaluation's best) -> whether one was due. Collective."""
        if self.saved_at == step or not (last or (self.every and step % self.every == 0)):
            return False
        self.save(step)
        return True

    def save(self, step: int) -> Path | None:
        """Collective under torchrun. -> the checkpoint written (None without a directory)."""
        if self.directory is not None and self.before_save is not None:
            self.before_save(step)
        self.saved_at = step
        if self.directory is None:
            return None
        state = _collect(self.replicated)
        if self.world > 1:
            coll = cast(ShardedEmbeddingCollection, self.embeddings)
            return save_sharded(self.directory, step, coll, state, self.keep, rank_state=_collect(self.rank_local))
        state.update(_collect(self.rank_local))  # one process: its own state is the run's
        files = self.embeddings.checkpoint_files()  # tables streamed beside the state (cached tiers)
        return save_checkpoint(self.directory, step, state, keep=self.keep, files=files)

    def load_latest(self) -> dict[str, Any] | None:
        """Resume: load the newest valid checkpoint of this run's kind into every component -> its state (with
        ``path``), None when there is none. Collective under torchrun (the shards are read on the way)."""
        state = self._newest()
        if state is not None:
            for component in (*self.replicated, *self.rank_local):
                component.load_state_dict(state)
        return state

    def _newest(self) -> dict[str, Any] | None:
        """The newest valid checkpoint's state. A ConfigError when the newest checkpoint is of the other kind (a
        single process cannot resume a sharded one, nor torchrun a single-process one)."""
        if self.directory is None:
            return None
        ckpt_dir = self.directory
        sharded = list_sharded(ckpt_dir)  # step_<step>/, written under torchrun
        single = list_checkpoints(ckpt_dir)  # ckpt_<step>[.pt], by one process
        if self.world > 1:
            if single and (not sharded or _step_of(single[-1]) > _step_of(sharded[-1])):
                raise ConfigError(
                    f"resume: the newest checkpoint in {ckpt_dir} is {single[-1].name}, written by a single process "
                    f"(step {_step_of(single[-1])}); a torchrun run resumes from sharded checkpoints (step_<step>/) "
                    "only. Resume it with one process (recstack train --resume), or train into another --output-dir"
                )
            coll = cast(ShardedEmbeddingCollection, self.embeddings)
            return load_newest_sharded(sharded, coll, self.device)
        state = latest_checkpoint(ckpt_dir, self.device)
        if sharded and (state is None or _step_of(sharded[-1]) > int(state["step"])):
            raise ConfigError(
                f"resume: the newest checkpoint in {ckpt_dir} is {sharded[-1].name}, a sharded checkpoint written "
                f"under torchrun (step {_step_of(sharded[-1])}); a single process resumes from its own checkpoints "
                "(ckpt_<step>.pt) only. Resume it under torchrun, or train into another --output-dir"
            )
        if state is None and single:
            raise CheckpointError(
                f"resume: none of the {len(single)} checkpoints in {ckpt_dir} is readable (see the warnings "
                "above); remove them to start over, or train into another --output-dir")
        return state

    def mark_best(self, checkpoint: Path, step: int, metrics: dict[str, float], is_main: bool) -> None:
        """Keep ``checkpoint`` (just written at ``step``) as the best: its files linked into ``best/`` (the one
        before it removed) and ``best.json`` rewritten. Rank 0 only; call it after ``save``."""
        if self.directory is None or not is_main:
            return
        best_dir = self.directory / BEST_DIR
        best_dir.mkdir(exist_ok=True)
        target = best_dir / checkpoint.name
        _remove(target)
        # A file checkpoint with any files beside it that share its name (such as a checksum), or a directory.
        for src in [checkpoint, *checkpoint.parent.glob(checkpoint.name + ".*")]:
            if not src.name.endswith((".tmp", ".old")):
                _link(src, best_dir / src.name)
        record = {"step": step, "checkpoint": f"{BEST_DIR}/{checkpoint.name}",
                  "metrics": json_safe(metrics)}
        tmp = self.directory / (BEST_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, self.directory / BEST_FILE)  # best.json names the new one before the old one goes
        for old in best_dir.iterdir():
            if not old.name.startswith(checkpoint.name):
                _remove(old)

    def set_aside(self, step: int, suffix: str, is_main: bool) -> Path | None:
        """Rename this run's checkpoint of ``step`` to ``<name><suffix>`` (no longer a checkpoint name, so neither
        ``--resume`` nor ``eval`` takes it) -> its new path; None when there is none. Rank 0 renames it, after
        every rank has looked (collective under torchrun)."""
        ckpt = self.checkpoint_at(step)
        if self.world > 1:
            torch.distributed.barrier()
        if ckpt is None:
            return None
        target = ckpt.with_name(ckpt.name + suffix)
        if is_main:
            _remove(target)
            os.replace(ckpt, target)
            fsync_dir(ckpt.parent)
        return target

    def best_step(self) -> int | None:
        """The step that ``best.json`` names (None: no best kept)."""
        record = read_best(self.directory) if self.directory is not None else None
        return None if record is None else int(record["step"])

    def checkpoint_at(self, step: int) -> Path | None:
        """This run's checkpoint of ``step`` in the checkpoints directory, None when it is not there (pruned)."""
        if self.directory is None:
            return None
        found = list_sharded(self.directory) if self.world > 1 else list_checkpoints(self.directory)
        return next((p for p in found if _step_of(p) == step), None)

    @staticmethod
    def read(checkpoint: str | Path, device: str | torch.device = "cpu", last: bool = False) -> dict[str, Any]:
        """One process, no process group: a checkpoint of any kind, or a run or checkpoints directory (the best
        checkpoint when the run kept one (``best.json``) and not ``last``, else its newest valid checkpoint)
        -> its state with ``path``. A sharded checkpoint's tables are not in it: :meth:`gather_tables` puts
        them there once the model is built."""
        path = Path(checkpoint)
        sharded = path  # a torchrun checkpoint: tables in DCP files, the rest in trainer.pt
        if not (path / SHARDED_STATE_FILE).is_file():
            if not path.is_dir() or (path / STATE_FILE).is_file():
                return {**load_checkpoint(path, device), "path": str(path)}
            ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
            best = None if last else read_best(ckpt_dir)
            if best is not None:
                kept = Checkpointer.read(ckpt_dir / best["checkpoint"], device)
                if kept.get("step") != best["step"]:
                    raise CheckpointError(
                        f"{ckpt_dir / BEST_FILE}: records step {best['step']}, but the checkpoint "
                        f"it names, {kept['path']}, holds step {kept.get('step')}")
                return kept
            state = latest_checkpoint(ckpt_dir, device)  # the newest valid one of one process, else of torchrun
            if state is not None:
                return state
            refused = []
            for step_dir in reversed(list_sharded(ckpt_dir)):
                try:
                    return {**open_sharded(step_dir, device), "path": str(step_dir)}
                except CheckpointError as e:
                    warnings.warn(f"skipping {e}", stacklevel=2)
                    refused.append(str(e))
            if refused or list_checkpoints(ckpt_dir):
                raise CheckpointError(f"{path}: no readable checkpoint"
                                      + (f" (newest: {refused[0]})" if refused else " (see the warnings above)"))
            raise FileNotFoundError(f"{path}: no loadable checkpoint")
        return {**open_sharded(sharded, device), "path": str(sharded)}

    @staticmethod
    def gather_tables(state: dict[str, Any], embeddings: EmbeddingCollection, device: str | torch.device) -> None:
        """For a sharded checkpoint read by :meth:`read`: every table put together from its shards into
        ``state["model"]``, as the single-process ``embeddings`` hold them. Nothing for the other kinds."""
        path = Path(state["path"])
        if not (path / SHARDED_STATE_FILE).is_file():
            return
        for prefix, tables in embeddings.weight_groups():  # one weight per group (per dim with model.table_dims)
            weight, parts = read_full_tables(path, tables, embeddings.optimizer)
            state["model"][f"embeddings.{prefix}weight"] = weight.to(device)
            for part, value in parts.items():
                state["model"][f"embeddings.{prefix}{part}"] = value.to(device)


def any_checkpoint(ckpt_dir: Path) -> bool:
    """Whether ``ckpt_dir`` holds a checkpoint of either kind (by name: nothing is read)."""
    return bool(list_checkpoints(ckpt_dir) or list_sharded(ckpt_dir))


def read_best(ckpt_dir: Path) -> dict[str, Any] | None:
    """``best.json`` of a checkpoints directory: {"step", "checkpoint", "metrics"}; None when there
    is none. Checked, as any file of a checkpoint: the checkpoint it names lies inside ``ckpt_dir``
    (after symbolic links) and is named for the step it records (``read`` checks the step inside it
    too); else a CheckpointError naming best.json, so that eval, predict, export and --resume never
    take another run's or another step's weights."""
    path = ckpt_dir / BEST_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    fields = record if isinstance(record, dict) else {}
    step, name = fields.get("step"), fields.get("checkpoint")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(name, str):
        raise CheckpointError(f"{path}: expected an object with an integer \"step\" and a "
                              "\"checkpoint\" path")
    target = ckpt_dir / name
    if Path(name).is_absolute() or ".." in Path(name).parts or \
            not target.resolve().is_relative_to(ckpt_dir.resolve()):
        raise CheckpointError(f"{path}: names {name!r}, which lies outside the run's checkpoints "
                              f"({ckpt_dir})")
    try:
        named: int | None = _step_of(target)
    except ValueError:
        named = None
    if named != step:
        what = ", not a checkpoint" if named is None else f", a checkpoint of step {named}"
        raise CheckpointError(f"{path}: records step {step}, but names {name!r}{what}")
    return record


def _link(src: Path, dst: Path) -> None:
    """Hard-link the file or directory tree ``src`` to ``dst`` (a copy where the file system has no links)."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if src.is_dir():
        shutil.copytree(src, dst, copy_function=link)
    else:
        link(str(src), str(dst))


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _collect(components: list[Stateful]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for component in components:
        state.update(component.state_dict())
    return state


def _step_of(checkpoint: Path) -> int:
    """ckpt_<step>.pt, ckpt_<step>/ or step_<step>/ -> step."""
    m = _NAME.match(checkpoint.name) or _STEP_DIR.match(checkpoint.name)
    if m is None:
        raise ValueError(f"{checkpoint}: not a checkpoint name")
    return int(m.group(1))
