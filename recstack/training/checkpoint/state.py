"""The checkpointed components, each exposing its state the same way (torchtitan's ``Stateful``): the model,
the dense optimizer, the data position (a stream's too), the RNGs, the run's description and the compression
runtime (the progress counters are ``recstack.training.step.Progress``).

The on-disk format (keys and files, see ``single.py`` and ``sharded.py``) predates the components and stays as
it was, so a component's ``state_dict()`` is its part of the checkpoint's top-level keys, and its
``load_state_dict(state)`` reads its keys from the whole checkpoint (older checkpoints lack some; a key such as
``world_size`` tells how to read another's).
"""

from __future__ import annotations

import os
import random
from typing import Any, Protocol, cast

import numpy as np
import torch

from recstack.compression.runtime import CompressionRuntime
from recstack.data.loader import BatchLoader
from recstack.data.stream.source import StreamPosition
from recstack.embedding.collection import EmbeddingCollection
from recstack.errors import ConfigError
from recstack.metrics import BinaryMetrics
from recstack.models.dlrm import DLRM
from recstack.training.checkpoint.resume import rebatched_position


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Keyed:
    """An object with torch's own ``state_dict`` / ``load_state_dict`` (the dense optimizer) under one key."""

    def __init__(self, key: str, obj: torch.optim.Optimizer) -> None:
        self.key, self.obj = key, obj

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.obj.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state[self.key])


class ModelState:
    """``model``: the dense part, and the tables unless they are ``sharded`` (those go through DCP, before this
    loads). A single-process checkpoint of the other embedding layout (all tables in memory vs cached tiers
    with table files) is converted on the way."""

    def __init__(self, model: DLRM, sharded: bool, device: torch.device) -> None:
        self.model, self.sharded, self.device = model, sharded, device

    def state_dict(self) -> dict[str, Any]:
        state = self.model.state_dict()
        if self.sharded:  # embedding shards go through DCP, not into the replicated file
            state = {k: v for k, v in state.items() if not k.startswith("embeddings.")}
        return {"model": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        where = state.get("path", "the checkpoint")
        emb = self.model.embeddings
        tables = None if self.sharded else convert_embedding_layout(state, emb, self.device)
        try:
            missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        except RuntimeError as e:  # shapes differ; torch's message has a line per tensor: one line
            detail = "; ".join(x.strip() for x in str(e).splitlines() if x.strip())
            raise ConfigError(f"resume: {where} does not match the model: {detail}") from e
        if self.sharded:  # the sharded tables came from DCP
            missing = [k for k in missing if not k.startswith("embeddings.")]
        if unexpected or missing:
            raise ConfigError(f"resume: {where} does not match the model (was it trained with another [model] or "
                              f"optim.sparse?): missing {missing}, unexpected {unexpected}")
        if tables is not None:  # an all-in-memory checkpoint's tables, into cached tiers
            emb.restore_tensors(*tables)
        elif emb.stores_rows_in_files:  # cached embedding tiers: their rows are files beside the state
            emb.restore_files(state.get("checkpoint_dir"))


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


class LoaderState:
    """``position``: where the training loader is, restored in this run's global batches (which may differ from
    the checkpoint's, see ``resume.rebatched_position``)."""

    def __init__(self, loader: BatchLoader, shuffle: bool | str, announce: bool) -> None:
        self.loader, self.shuffle, self.announce = loader, shuffle, announce

    def state_dict(self) -> dict[str, Any]:
        pos = self.loader.position
        return {"position": {"epoch": pos.epoch, "row": pos.row, "global_batch_size": self.loader.global_batch_size,
                             "shuffle": self.loader.shuffle, "seed": self.loader.seed,
                             "shuffle_window": self.loader.shuffle_window}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stream" in state:
            raise ConfigError(f"resume: {state.get('path', 'the checkpoint')} was written by a stream run: resume it "
                              "with recstack train --stream DIR --resume, or train into another --output-dir")
        self.loader.position = rebatched_position(state, self.loader, self.shuffle, self.announce)


class RNGState:
    """``rng``: the Python, NumPy and torch generators (see :func:`rng_state`)."""

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state["rng"])


class RunInfo:
    """What the run was (``config``, ``num_dense``, ``table_sizes``, ``table_names`` per feature, ``world_size``,
    and ``workdir``, the directory its relative data paths are relative to): saved so that evaluation can
    rebuild the model and find its data from anywhere; a resumed run is built from its own config, so loading
    reads nothing."""

    def __init__(self, config: dict[str, Any], num_dense: int, table_sizes: list[int], table_names: list[str],
                 world: int) -> None:
        self.info = {"config": config, "num_dense": num_dense, "table_sizes": table_sizes,
                     "table_names": table_names, "world_size": world, "workdir": os.getcwd()}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.info)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class StreamState:
    """``stream``: where a stream run is: ``position``, the last partition consumed (its name and index; None
    before the first), and ``progressive``, the accumulated progressive-validation predictions of every partition
    so far (``BinaryMetrics.state``: 8 bytes a row), so a resumed run's running aggregate is the uninterrupted
    run's."""

    def __init__(self) -> None:
        self.position: StreamPosition | None = None
        self.progressive = BinaryMetrics()

    def state_dict(self) -> dict[str, Any]:
        pos = self.position
        return {"stream": {"position": None if pos is None else {"name": pos.name, "index": pos.index},
                           "progressive": self.progressive.state()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("stream")
        if not isinstance(saved, dict):
            raise ConfigError(f"resume: {state.get('path', 'the checkpoint')} was not written by a stream run "
                              "(no stream position); resume it without --stream, or train into another --output-dir")
        pos = saved.get("position")
        self.position = None if pos is None else StreamPosition(str(pos["name"]), int(pos["index"]))
        self.progressive = BinaryMetrics.from_state(saved["progressive"])


class CompressionState:
    """``compression``: this rank's error-feedback residuals (rank-local: sharded checkpoints keep them in one
    file per rank, and they only fit the world size that wrote them)."""

    def __init__(self, runtime: CompressionRuntime, device: torch.device) -> None:
        self.runtime, self.device = runtime, device

    def state_dict(self) -> dict[str, Any]:
        return {"compression": self.runtime.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.runtime.load_state_dict(state.get("compression"), state.get("world_size"), self.device)


def rng_state() -> dict[str, Any]:
    """Python, NumPy legacy and torch (CPU, and the current CUDA device's when there is one) RNG states as
    weights_only-safe values. One CUDA state, not every visible device's: a rank draws on its own device only,
    and a resume may see fewer devices than the run that saved."""
    py = random.getstate()
    np_state = cast(tuple[Any, ...], np.random.get_state())  # legacy (the default): the tuple form; stubs say dict
    out: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda_device"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore ``rng_state()``. Its tensors may be on a GPU (a checkpoint loaded with ``map_location`` the
    training device): numpy reads host memory only, and torch takes generator states as CPU byte tensors."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].cpu().numpy().astype(np.uint32), *n[2:]))
    torch.set_rng_state(state["torch"].cpu())
    if not torch.cuda.is_available():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"].cpu())
    elif "cuda" in state:  # an older checkpoint: every device's state; this rank's device's, if it saved one
        saved, here = state["cuda"], torch.cuda.current_device()
        if here < len(saved):
            torch.cuda.set_rng_state(saved[here].cpu())
