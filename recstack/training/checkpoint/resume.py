"""What ``recstack train --resume`` reads back: the newest checkpoint of the kind this run writes, its data
position in this run's batches, and its embedding tables in this run's memory layout.

A single process writes ``ckpt_<step>.pt`` (or ``ckpt_<step>/`` with memory tiers), ``torchrun`` writes
``step_<step>/`` (``torch.distributed.checkpoint``); a run never silently starts over beside the other kind.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from recstack.data.loader import BatchLoader, LoaderPosition
from recstack.embedding.collection import EmbeddingCollection
from recstack.errors import ConfigError
from recstack.training.checkpoint.single import _NAME, latest_checkpoint, list_checkpoints
from recstack.training.logger import METRICS_FILE, TB_DIR

if TYPE_CHECKING:
    from recstack.distributed.sharded_collection import ShardedEmbeddingCollection

# What a run writes into its --output-dir that a later run into the same directory would mix with its own
# (generated data under data/ is a cache keyed by its options and stays).
RUN_OUTPUTS = ("checkpoints", METRICS_FILE, TB_DIR, "summary.json", "curves.png", "comm_breakdown.png")


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


def step_of(checkpoint: Path) -> int:
    """ckpt_<step>.pt, ckpt_<step>/ or step_<step>/ -> step."""
    from recstack.training.checkpoint.sharded import _STEP_DIR

    m = _NAME.match(checkpoint.name) or _STEP_DIR.match(checkpoint.name)
    if m is None:
        raise ValueError(f"{checkpoint}: not a checkpoint name")
    return int(m.group(1))


def find_resume_state(ckpt_dir: Path | None, world: int, embeddings: EmbeddingCollection,
                      device: torch.device) -> dict[str, Any] | None:
    """The newest valid checkpoint's state (with ``path``), None when there is none. Under torchrun the sharded
    tables are loaded into ``embeddings`` on the way. Raises a ConfigError when the newest checkpoint is of the
    other kind (a single process cannot resume a sharded one, nor torchrun a single-process one)."""
    if ckpt_dir is None:
        return None
    from recstack.training.checkpoint.sharded import list_sharded, load_sharded

    sharded = list_sharded(ckpt_dir)  # step_<step>/, written under torchrun
    single = list_checkpoints(ckpt_dir)  # ckpt_<step>[.pt], by one process
    if world > 1:
        if single and (not sharded or step_of(single[-1]) > step_of(sharded[-1])):
            raise ConfigError(
                f"resume: the newest checkpoint in {ckpt_dir} is {single[-1].name}, written by a single process "
                f"(step {step_of(single[-1])}); a torchrun run resumes from sharded checkpoints (step_<step>/) "
                "only. Resume it with one process (recstack train --resume), or train into another --output-dir"
            )
        state = load_sharded(sharded[-1], cast("ShardedEmbeddingCollection", embeddings), device) if sharded else None
        if state is not None:
            state["path"] = str(sharded[-1])
        return state
    state = latest_checkpoint(ckpt_dir, device)
    if sharded and (state is None or step_of(sharded[-1]) > int(state["step"])):
        raise ConfigError(
            f"resume: the newest checkpoint in {ckpt_dir} is {sharded[-1].name}, a sharded checkpoint written under "
            f"torchrun (step {step_of(sharded[-1])}); a single process resumes from its own checkpoints "
            "(ckpt_<step>.pt) only. Resume it under torchrun, or train into another --output-dir"
        )
    return state


def rebatched_position(state: dict[str, Any], loader: BatchLoader, shuffle: bool, announce: bool) -> LoaderPosition:
    """The checkpoint's data position in ``loader``'s global batches (train.batch_size x processes), which may
    differ from the ones the checkpoint was written with."""
    pos = state["position"]
    saved = LoaderPosition(int(pos["epoch"]), int(pos["batch"]))
    old = pos.get("global_batch_size")  # absent in older checkpoints: their batch size x world size
    if old is None:
        old = int(state["config"]["train"]["batch_size"]) * int(state.get("world_size") or 1)
    new = loader.global_batch_size
    try:
        moved = saved.rebatched(int(old), new, loader.end - loader.start, shuffle)
    except ValueError as e:
        was = f"{old // int(state.get('world_size') or 1)} x {state.get('world_size') or 1} processes"
        raise ConfigError(
            f"resume: {state.get('path', 'the checkpoint')}: {e}. Resume with the global batch it was written "
            f"with (train.batch_size x processes = {was}), or change it at an epoch boundary"
        ) from e
    if old != new and announce:
        print(f"resume: global batch of {old} rows now {new}: the {saved.batch * old} rows done in epoch "
              f"{saved.epoch} continue at epoch {moved.epoch}, batch {moved.batch}")
    return moved


def convert_embedding_layout(state: dict[str, Any], embeddings: EmbeddingCollection, device: torch.device
                             ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A single-process checkpoint of the other embedding layout (this run's memory budgets put every table in
    memory where the checkpoint's had cached tiers, or the reverse): all-in-memory tables are filled from the
    checkpoint's table files here, in ``state``; cached tiers get (weight, accumulator) back, to load once the
    rest of the state is in. None when the layouts agree."""
    model_state = state["model"]
    tiered_ckpt = "embeddings._extra_state" in model_state
    if tiered_ckpt == embeddings.stores_rows_in_files:
        return None
    from recstack.embedding.tiered.files import read_table_files

    if tiered_ckpt:
        extra = model_state.pop("embeddings._extra_state")
        want = [{"name": t.name, "rows": t.num_embeddings, "dim": t.embedding_dim} for t in embeddings.tables]
        have = [{k: t.get(k) for k in ("name", "rows", "dim")} for t in extra.get("tables", [])]
        if have != want:
            raise ConfigError(f"resume: {state.get('path')}: checkpoint tables {have} do not match this model's "
                              f"{want}")
        weight, acc = read_table_files(state.get("checkpoint_dir"), extra)
        model_state["embeddings.weight"] = weight.to(device)
        if acc is not None:
            model_state["embeddings.accumulator"] = acc.to(device)
        return None
    if "embeddings.weight" not in model_state:
        return None  # not a checkpoint of this model: load_state_dict says what is missing
    weight = model_state.pop("embeddings.weight")
    acc = model_state.pop("embeddings.accumulator", None)
    model_state["embeddings._extra_state"] = embeddings.get_extra_state()
    return weight, acc
