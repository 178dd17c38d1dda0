"""A run's directory and a resumed run's data position: claiming ``--output-dir`` for a run that starts at
step 0 (an earlier run's outputs there are an error or are removed), and a checkpoint's loader position in this
run's global batches. Finding and loading the checkpoint itself is ``checkpointer.Checkpointer``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recstack.data.loader import BatchLoader, LoaderPosition
from recstack.data.order import shuffle_mode
from recstack.errors import ConfigError
from recstack.training.logger import METRICS_FILE, TB_DIR

if TYPE_CHECKING:
    pass

# What a run writes into its --output-dir that a later run into the same directory would mix with its own
# (generated data under data/ is a cache keyed by its options and stays).
RUN_OUTPUTS = ("checkpoints", METRICS_FILE, TB_DIR, "summary.json", "curves.png", "reliability.png",
               "comm_breakdown.png")


def claim_output_dir(output_dir: Path, overwrite: bool, is_main: bool) -> None:
    """Make ``output_dir`` safe for a run that starts from step 0 (no ``--resume``).

    An earlier run's outputs there would mix with this run's: metrics.jsonl would hold both runs' steps, and its
    checkpoints beyond this run's steps would outlive this run's and be the ones ``--resume`` and ``recstack
    eval`` pick. Without ``overwrite`` that is a ConfigError (raised on every rank alike, so none waits for the
    others); with it the main rank removes the earlier outputs first."""
    ckpt_dir = output_dir / "checkpoints"
    earlier = [p for p in ckpt_dir.glob("*") if p.name.startswith(("ckpt_", "step_"))]
    metrics = output_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        earlier.append(metrics)
    if not earlier:
        return
    if not overwrite:
        names = ", ".join(str(p.relative_to(output_dir)) for p in sorted(earlier)[-3:])
        raise ConfigError(f"{output_dir} holds an earlier run ({names}): pass --resume to continue it, "
                          "--overwrite to replace it, or train into another --output-dir")
    if is_main:
        for name in RUN_OUTPUTS:
            path = output_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


def saved_position(state: dict[str, Any], epoch_rows: int) -> tuple[LoaderPosition, int, str]:
    """A checkpoint's data position -> (position, its global batch in rows, its shuffle mode). Checkpoints from
    before row positions counted whole global batches of an epoch that dropped its short last batch: a count
    that reaches the end of those is the start of the next epoch."""
    pos = state["position"]
    old = pos.get("global_batch_size")  # absent in older checkpoints: their batch size x world size
    if old is None:
        old = int(state["config"]["train"]["batch_size"]) * int(state.get("world_size") or 1)
    old = int(old)
    mode = pos.get("shuffle")
    if mode is None:
        mode = shuffle_mode(state.get("config", {}).get("train", {}).get("shuffle", False))
    if "row" in pos:
        return LoaderPosition(int(pos["epoch"]), int(pos["row"])), old, str(mode)
    epoch, batch = int(pos["epoch"]), int(pos["batch"])
    if batch >= epoch_rows // old:
        return LoaderPosition(epoch + 1, 0), old, str(mode)
    return LoaderPosition(epoch, batch * old), old, str(mode)


def rebatched_position(state: dict[str, Any], loader: BatchLoader, shuffle: bool | str, announce: bool
                       ) -> LoaderPosition:
    """The checkpoint's data position in ``loader``'s global batches (train.batch_size x processes), which may
    differ from the ones the checkpoint was written with: the next batch starts at the next row of the epoch's
    sequence. A change mid-epoch of an option that defines the epoch's order (``train.shuffle``,
    and the ``train.seed`` of a shuffle, the ``train.shuffle_window`` of the window shuffle) is
    refused: the rows still due would come from another permutation, some trained twice and others
    never."""
    saved, old, was_mode = saved_position(state, loader.end - loader.start)
    new, mode = loader.global_batch_size, shuffle_mode(shuffle)
    where = state.get("path", "the checkpoint")
    if saved.row:
        pos, train = state["position"], state.get("config", {}).get("train", {})
        # (option, checkpoint's value, this run's); older checkpoints: the values of their config
        order: list[tuple[str, Any, Any]] = [("train.shuffle", was_mode, mode)]
        if mode != "none":
            order.append(("train.seed", pos.get("seed", train.get("seed")), loader.seed))
        if mode == "window":
            window = pos.get("shuffle_window", train.get("shuffle_window"))
            order.append(("train.shuffle_window", window, loader.shuffle_window))
        for name, was, now in order:
            if was != now:
                raise ConfigError(
                    f"resume: {where}: {name} changed from {was!r} to {now!r} in the middle of "
                    f"epoch {saved.epoch} ({saved.row} rows done): the rows still due are unknown. "
                    f"Resume with {name} = {was!r}, or change it at an epoch boundary")
    try:
        moved = loader.normalised(saved.rebatched(old, new, mode))
    except ValueError as e:
        was = f"{old // int(state.get('world_size') or 1)} x {state.get('world_size') or 1} processes"
        raise ConfigError(
            f"resume: {where}: {e}. Resume with the global batch it was written "
            f"with (train.batch_size x processes = {was}), or change it at an epoch boundary"
        ) from e
    if old != new and announce:
        print(f"resume: global batch of {old} rows now {new}: the {saved.row} rows done in epoch "
              f"{saved.epoch} continue at epoch {moved.epoch}, row {moved.row}")
    return moved
