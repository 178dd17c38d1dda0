"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save with N ranks, resume with M.

A checkpoint is a directory ``checkpoints/step_<step>/``:
  - DCP files holding every embedding shard under a key that names its table and rectangle,
    ``emb/<table>/<weight|accumulator>/r<row0>-<row1>/c<col0>-<col1>`` (replicated tables are one full-table
    rectangle that every rank offers; DCP writes it once);
  - ``trainer.pt`` (rank 0): the dense model, dense optimizer, data position, RNG and config, which DDP keeps
    identical on every rank;
  - ``rank_<rank>.pt`` (every rank): state that differs between ranks, such as the error-feedback residuals
    of the chunks the rank sent. It only fits the world size that wrote it; the trainer drops it otherwise.
It is written into ``step_<step>.tmp`` and renamed by rank 0 after every rank has finished, so a crash leaves
no directory that looks complete. On load each rank computes the rectangles of its new shards, reads the
saved rectangles that overlap them (whatever layout wrote them) and copies the overlaps: resharding.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
from recstack.distributed.sharding import Shard

_STEP_DIR = re.compile(r"^step_(\d{9})$")
_KEY = re.compile(r"^emb/(?P<table>.+)/(?P<part>weight|accumulator)/r(?P<r0>\d+)-(?P<r1>\d+)/c(?P<c0>\d+)-(?P<c1>\d+)$")


def _key(table: str, part: str, r0: int, r1: int, c0: int, c1: int) -> str:
    return f"emb/{table}/{part}/r{r0}-{r1}/c{c0}-{c1}"


def _local_shards(coll: ShardedEmbeddingCollection) -> list[tuple[str, Shard, torch.Tensor, torch.Tensor | None]]:
    """(table name, shard, weight view [rows, d], accumulator view [rows] or None) held by this rank."""
    out = []
    for group in coll.groups.values():
        for i, tc in enumerate(group.tables):
            name, si = tc.name.rsplit(".shard", 1)
            t = next(j for j, x in enumerate(coll.tables) if x.name == name)
            lo, hi = int(group.table_offsets[i]), int(group.table_offsets[i + 1])
            acc = group.accumulator[lo:hi] if group.accumulator is not None else None
            out.append((name, coll.shards[t][int(si)], group.weight[lo:hi], acc))
    if coll.replicated is not None:
        rep = coll.replicated
        for i, tc in enumerate(rep.tables):
            lo, hi = int(rep.table_offsets[i]), int(rep.table_offsets[i + 1])
            full = Shard(-1, 0, coll.rank, 0, tc.num_embeddings, 0, tc.embedding_dim, "local")
            acc = rep.accumulator[lo:hi] if rep.accumulator is not None else None
            out.append((tc.name, full, rep.weight[lo:hi], acc))
    return out


def embedding_state(coll: ShardedEmbeddingCollection) -> dict[str, torch.Tensor]:
    state = {}
    for name, s, w, acc in _local_shards(coll):
        state[_key(name, "weight", s.row0, s.row1, s.col0, s.col1)] = w
        if acc is not None:
            state[_key(name, "accumulator", s.row0, s.row1, s.col0, s.col1)] = acc
    return state


def load_embedding_state(coll: ShardedEmbeddingCollection, path: Path) -> None:
    """Fill this rank's shards from a checkpoint written with any number of ranks and any layout."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    pieces: dict[tuple[str, str], list[tuple[str, int, int, int, int]]] = {}
    for key in saved:
        m = _KEY.match(key)
        if m:
            pieces.setdefault((m["table"], m["part"]), []).append(
                (key, int(m["r0"]), int(m["r1"]), int(m["c0"]), int(m["c1"]))
            )
    plan: list[tuple[torch.Tensor, Shard, str, tuple[str, int, int, int, int]]] = []
    request: dict[str, torch.Tensor] = {}
    for name, s, w, acc in _local_shards(coll):
        for part, target in (("weight", w), ("accumulator", acc)):
            if target is None:
                continue
            found = [p for p in pieces.get((name, part), []) if p[1] < s.row1 and p[2] > s.row0
                     and p[3] < s.col1 and p[4] > s.col0]
            if s.rows and not found:
                raise KeyError(f"{path}: no saved {part} covers table {name!r} rows {s.row0}-{s.row1}")
            for p in found:
                shape = saved[p[0]].size
                request.setdefault(p[0], torch.empty(tuple(shape), dtype=target.dtype))
                plan.append((target, s, part, p))
    dcp.load(request, checkpoint_id=str(path))  # collective: every rank reads what it asked for
    # Row-wise Adagrad state: the width-weighted mean of the overlapping column blocks' accumulators (exact
    # unless a column-wise layout is read into a different column split).
    acc_parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (target, summed widths per row)
    with torch.no_grad():
        for target, s, part, (key, r0, r1, c0, c1) in plan:
            lo, hi = max(r0, s.row0), min(r1, s.row1)
            src = request[key][lo - r0 : hi - r0].to(target.device)
            dst = target[lo - s.row0 : hi - s.row0]
            a, b = max(c0, s.col0), min(c1, s.col1)
            if part == "weight":
                dst[:, a - s.col0 : b - s.col0] = src[:, a - c0 : b - c0]
                continue
            if id(target) not in acc_parts:
                target.zero_()
                acc_parts[id(target)] = (target, torch.zeros_like(target))
            dst += src * (b - a)
            acc_parts[id(target)][1][lo - s.row0 : hi - s.row0] += b - a
        for target, widths in acc_parts.values():
            target /= widths.clamp_min(1)


def rank_file(path: Path, rank: int) -> Path:
    return path / f"rank_{rank:05d}.pt"


def _write(path: Path, state: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def save_sharded(directory: Path, step: int, coll: ShardedEmbeddingCollection, trainer_state: dict[str, Any],
                 keep: int = 0, rank_state: dict[str, Any] | None = None) -> Path:
    """Collective. ``trainer_state``: rank 0's (replicated) state; ``rank_state``: this rank's own, written
    to ``rank_<rank>.pt``. Returns the final checkpoint directory."""
    final = directory / f"step_{step:09d}"
    tmp = directory / f"step_{step:09d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(embedding_state(coll), checkpoint_id=str(tmp))
    if rank_state is not None:  # inside the .tmp directory, so it appears with the rest or not at all
        _write(rank_file(tmp, dist.get_rank()), rank_state)
    if dist.get_rank() == 0:
        _write(tmp / "trainer.pt", {**trainer_state, "step": step, "complete": True})
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep > 0:
            for old in list_sharded(directory)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_sharded(directory: Path) -> list[Path]:
    """Complete sharded checkpoints, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _STEP_DIR.match(p.name) and (p / "trainer.pt").is_file()
                  and (p / ".metadata").is_file())


def load_sharded(path: Path, coll: ShardedEmbeddingCollection, map_location: torch.device) -> dict[str, Any]:
    """Collective. Loads the embedding shards in place; returns the trainer state (dense model etc.) updated
    with this rank's ``rank_<rank>.pt`` when there is one (a rank beyond the saving world size has none)."""
    state = torch.load(path / "trainer.pt", map_location=map_location, weights_only=True)
    if state.get("complete") is not True:
        raise RuntimeError(f"{path}: incomplete checkpoint")
    mine = rank_file(path, dist.get_rank())
    if mine.is_file():
        state.update(torch.load(mine, map_location=map_location, weights_only=True))
    load_embedding_state(coll, path)
    return state
