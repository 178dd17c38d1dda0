"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save with N ranks, resume with M.

A checkpoint is a directory ``checkpoints/step_<step>/``:
  - DCP files holding every embedding shard under a key that names its table and rectangle,
    ``emb/<table>/<part>/r<row0>-<row1>/c<col0>-<col1>``, the part ``weight`` or a part of the sparse
    optimizer's state (``accumulator``; Adam's ``exp_avg``, ``exp_avg_sq``, ``row_step``: ``StatePart``)
    (replicated tables are one full-table rectangle that every rank offers; DCP writes it once);
  - ``trainer.pt`` (rank 0): the dense model, dense optimizer, data position, RNG and config, which DDP keeps
    identical on every rank;
  - ``rank_<rank>.pt`` (every rank): state that differs between ranks, such as the error-feedback residuals
    of the chunks the rank sent. It only fits the world size that wrote it; the trainer drops it otherwise.
It is written into ``step_<step>.tmp`` and renamed by rank 0 after every rank has finished, so a crash leaves
no directory that looks complete; ``trainer.pt``, written last, records the size and SHA-256 of every other file
(``integrity.py``), checked on load, and ``.metadata`` is read with a restricted unpickler. Resuming falls back
from a damaged checkpoint to the newest intact one, every rank alike (:func:`load_newest_sharded`). On load
each rank computes the rectangles of its new shards, reads the saved rectangles that overlap them (whatever
layout wrote them) and copies the overlaps: resharding. First the saved rectangles of every table must tile
the model's table exactly (same rows and dim, nothing missing or overlapping), and the ranks agree on it: if
the check or reading fails on any rank, every rank raises :class:`CheckpointError` before any shard is read.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from recstack.distributed.agreement import gather_failures
from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
from recstack.distributed.sharding import Shard
from recstack.embedding import TableConfig
from recstack.embedding.sparse_optim import SparseOptimizer
from recstack.errors import CheckpointError, DiskError
from recstack.io import disk_error, fsync_dir, open_synced, os_error_in, writing
from recstack.training.checkpoint.integrity import (
    DIGESTS,
    SafeFileSystemReader,
    file_digests,
    load_pt,
    note_unverified,
    read_dcp_metadata,
    verify_files,
)

SHARDED_STATE_FILE = "trainer.pt"  # the replicated state beside the DCP files
METADATA_FILE = ".metadata"  # DCP's index of the shard files
_STEP_DIR = re.compile(r"^step_(\d{9})$")
_KEY = re.compile(r"^emb/(?P<table>.+)/(?P<part>[a-z_]+)/r(?P<r0>\d+)-(?P<r1>\d+)/c(?P<c0>\d+)-(?P<c1>\d+)$")


def _key(table: str, part: str, r0: int, r1: int, c0: int, c1: int) -> str:
    return f"emb/{table}/{part}/r{r0}-{r1}/c{c0}-{c1}"


def embedding_state(coll: ShardedEmbeddingCollection) -> dict[str, torch.Tensor]:
    state = {}
    for name, s, w, parts in coll.local_shards():
        for part, tensor in {"weight": w, **parts}.items():
            state[_key(name, part, s.row0, s.row1, s.col0, s.col1)] = tensor
    return state


def _saved_pieces(path: Path) -> tuple[Any, dict[tuple[str, str], list[tuple[str, int, int, int, int]]]]:
    """-> (DCP metadata per key, {(table, part): [(key, row0, row1, col0, col1), ...]})."""
    saved = read_dcp_metadata(path / METADATA_FILE).state_dict_metadata
    pieces: dict[tuple[str, str], list[tuple[str, int, int, int, int]]] = {}
    for key in saved:
        m = _KEY.match(key)
        if m:
            if not isinstance(saved[key], TensorStorageMetadata):  # only tensors are ever read (no pickled bytes)
                raise CheckpointError(f"{path / METADATA_FILE}: {key} is not a tensor")
            pieces.setdefault((m["table"], m["part"]), []).append(
                (key, int(m["r0"]), int(m["r1"]), int(m["c0"]), int(m["c1"]))
            )
    return saved, pieces


def check_coverage(tables: list[TableConfig], parts: list[str], path: Path,
                   pieces: dict[tuple[str, str], list[tuple[str, int, int, int, int]]]) -> None:
    """Raise :class:`CheckpointError` unless, for every table of the model and every part (``weight``, and
    each part of the optimizer's state), the saved rectangles tile exactly [0, rows) x [0, dim): none
    outside it, none overlapping, none missing. Depends only on the checkpoint and the model, so every rank
    decides alike."""
    for t in tables:
        rows, dim = t.num_embeddings, t.embedding_dim
        for part in parts:
            found = pieces.get((t.name, part), [])
            if not found:
                if any(n == t.name for n, _ in pieces):  # the table is there, saved with another optimizer
                    held = sorted(p for n, p in pieces if n == t.name)
                    raise CheckpointError(f"{path}: no saved {part} for table {t.name!r} (it has {held}: was it "
                                          "trained with another optim.sparse?)")
                raise CheckpointError(f"{path}: no saved {part} for table {t.name!r} (the checkpoint has "
                                      f"tables {sorted({n for n, _ in pieces})})")
            saved_rows = max(p[2] for p in found)
            saved_dim = max(p[4] for p in found)
            if (saved_rows, saved_dim) != (rows, dim):
                raise CheckpointError(f"{path}: table {t.name!r} was saved as {saved_rows} x {saved_dim}, the "
                                      f"model's is {rows} x {dim}")
            rects = sorted((r0, r1, c0, c1) for _, r0, r1, c0, c1 in found if r1 > r0 and c1 > c0)
            for i, a in enumerate(rects):
                for b in rects[i + 1 :]:
                    if b[0] >= a[1]:
                        break  # sorted by first row: no later rectangle reaches back into ``a``
                    if b[2] < a[3] and b[3] > a[2]:
                        raise CheckpointError(f"{path}: saved {part} pieces of table {t.name!r} overlap: "
                                              f"rows {a[0]}-{a[1]} x cols {a[2]}-{a[3]} and rows {b[0]}-{b[1]} "
                                              f"x cols {b[2]}-{b[3]}")
            area = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in rects)
            if area != rows * dim:
                raise CheckpointError(f"{path}: saved {part} pieces of table {t.name!r} cover {area} of its "
                                      f"{rows} x {dim} values")


def _parts(optimizer: SparseOptimizer) -> list[str]:
    return ["weight", *(p.name for p in optimizer.state_parts)]


def agree(error: BaseException | None) -> None:
    """Collective: every rank says whether it failed; if any did, every rank raises: the error itself where
    all ranks failed alike (a verdict on the checkpoint), else a :class:`CheckpointError` with the lowest failing
    rank's message. No rank is left waiting in a later collective."""
    failed = gather_failures(error, CheckpointError)
    if not failed:
        return
    world = dist.get_world_size()
    if error is not None and len(failed) == world and len({m for _, m in failed}) == 1:
        raise error
    rank, message = failed[0]
    raise CheckpointError(f"rank {rank} of {world} could not load the checkpoint: {message}") from error


def load_embedding_state(coll: ShardedEmbeddingCollection, path: Path, error: BaseException | None = None) -> None:
    """Collective. Fill this rank's shards from a checkpoint written with any number of ranks and any layout.
    The checkpoint must hold every table of the model at the model's size (:func:`check_coverage`); if it does
    not, or reading it fails on any rank (or ``error``, an earlier failure of this rank, is given), every rank
    raises :class:`CheckpointError` and none reads."""
    plan: list[tuple[torch.Tensor, Shard, str, tuple[str, int, int, int, int]]] = []
    request: dict[str, torch.Tensor] = {}
    shards: list[tuple[str, Shard, torch.Tensor, dict[str, torch.Tensor]]] = []
    if error is None:
        try:
            saved, pieces = _saved_pieces(path)
            check_coverage(coll.tables, _parts(coll.optimizer), path, pieces)
            shards = coll.local_shards()  # views of in-memory shards, copies of cached ones
            for name, s, w, state in shards:
                for part, target in {"weight": w, **state}.items():
                    found = [p for p in pieces.get((name, part), []) if p[1] < s.row1 and p[2] > s.row0
                             and p[3] < s.col1 and p[4] > s.col0]
                    for p in found:
                        shape = saved[p[0]].size
                        request.setdefault(p[0], torch.empty(tuple(shape), dtype=target.dtype))
                        plan.append((target, s, part, p))
        except Exception as e:  # decided together below: a rank that raised alone would leave the rest waiting
            error = e
    agree(error)
    dcp.load(request, checkpoint_id=str(path), storage_reader=SafeFileSystemReader(str(path)))  # collective
    _copy_overlaps(plan, request)
    coll.store_local_shards(shards)  # the copies of shards in cached tiers, into their tiers


def _copy_overlaps(plan: list[tuple[torch.Tensor, Shard, str, tuple[str, int, int, int, int]]],
                   request: dict[str, torch.Tensor]) -> None:
    """Copy each saved piece's overlap with a target shard into the target: the weight and per-column state
    ([rows, cols] targets) column by column; per-row state ([rows] targets: Adagrad's accumulator, Adam's step
    count) is the width-weighted mean of the overlapping column blocks' values (exact unless a column-wise
    layout of row-wise Adagrad is read into a different column split; every column block of a row holds the same
    step count)."""
    acc_parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (target, summed widths per row)
    with torch.no_grad():
        for target, s, _, (key, r0, r1, c0, c1) in plan:
            lo, hi = max(r0, s.row0), min(r1, s.row1)
            src = request[key][lo - r0 : hi - r0].to(target.device)
            dst = target[lo - s.row0 : hi - s.row0]
            a, b = max(c0, s.col0), min(c1, s.col1)
            if target.dim() == 2:
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
    with open_synced(path) as f:
        torch.save(state, f)


def save_sharded(directory: Path, step: int, coll: ShardedEmbeddingCollection, trainer_state: dict[str, Any],
                 keep: int = 0, rank_state: dict[str, Any] | None = None) -> Path:
    """Collective. ``trainer_state``: rank 0's (replicated) state; ``rank_state``: this rank's own, written
    to ``rank_<rank>.pt``. Returns the final checkpoint directory. A disk fault on any rank (full, read-only) is
    an error on every rank (a :class:`DiskError` naming the file where it happened, a :class:`CheckpointError`
    naming that rank elsewhere); the ``.tmp`` directory is removed and the earlier checkpoints stay the newest."""
    final = directory / f"step_{step:09d}"
    tmp = directory / f"step_{step:09d}.tmp"
    rank = dist.get_rank()
    error: BaseException | None = None
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    except OSError as e:
        error = disk_error(e, tmp)
    _agree_on_write(error, tmp)  # (the barrier before any rank writes into tmp)
    writer = _RecordingWriter(str(tmp))
    try:  # collective: a failure on one rank fails all
        dcp.save(embedding_state(coll), checkpoint_id=str(tmp), storage_writer=writer)
        if rank_state is not None:  # inside the .tmp directory, so it appears with the rest or not at all
            with writing(rank_file(tmp, rank)):
                _write(rank_file(tmp, rank), rank_state)
    except (Exception, dcp.CheckpointException) as e:  # DCP's own error is a BaseException
        cause = writer.failure or os_error_in(e)
        error = disk_error(cause, tmp) if cause is not None else e
    _agree_on_write(error, tmp)  # every rank's files are complete: rank 0 records their checksums, last
    try:
        if rank == 0:
            with writing(tmp / SHARDED_STATE_FILE):
                others = [p.name for p in tmp.iterdir() if p.name != SHARDED_STATE_FILE]
                _write(tmp / SHARDED_STATE_FILE, {**trainer_state, "step": step, "complete": True,
                                                  DIGESTS: file_digests(tmp, others)})
                fsync_dir(tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
            if keep > 0:
                for old in list_sharded(directory)[:-keep]:
                    shutil.rmtree(old, ignore_errors=True)
    except Exception as e:
        error = e
    _agree_on_write(error, tmp)
    return final


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer that keeps the ``OSError`` behind a failed write on this rank (``failure``): DCP passes
    the failure on as torch.save's "unexpected pos", pickled between ranks without its cause."""

    failure: OSError | None = None

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except BaseException as e:
            self.failure = os_error_in(e)
            raise


def _agree_on_write(error: BaseException | None, tmp: Path) -> None:
    """Collective: if any rank failed to write, rank 0 removes the ``.tmp`` directory and every rank raises, in
    one line: a rank with a disk fault its DiskError, the others a CheckpointError with the first disk fault's
    message (else the first failed rank's)."""
    report = None if error is None else (str(error).splitlines() or [type(error).__name__])[0]
    reports: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (isinstance(error, DiskError), report) if report is not None else None)
    failed = [(r, m) for r, m in enumerate(reports) if m is not None]
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(error, DiskError):
        raise error
    rank, (_, message) = next(((r, m) for r, m in failed if m[0]), failed[0])
    raise CheckpointError(f"rank {rank} of {len(reports)} could not write the checkpoint: {message}") from error


def list_sharded(directory: Path) -> list[Path]:
    """Complete sharded checkpoints, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _STEP_DIR.match(p.name) and (p / SHARDED_STATE_FILE).is_file()
                  and (p / ".metadata").is_file())


def load_sharded(path: Path, coll: ShardedEmbeddingCollection, map_location: torch.device) -> dict[str, Any]:
    """Collective. Loads the embedding shards in place; returns the trainer state (dense model etc.) updated
    with this rank's ``rank_<rank>.pt`` when there is one (a rank beyond the saving world size has none)."""
    error: BaseException | None = None
    state: dict[str, Any] = {}
    try:
        state = open_sharded(path, map_location, dist.get_rank(), dist.get_world_size())
    except Exception as e:  # every rank learns of it in load_embedding_state, before anyone reads shards
        error = e
    load_embedding_state(coll, path, error)
    return state


def load_newest_sharded(paths: list[Path], coll: ShardedEmbeddingCollection, map_location: torch.device
                        ) -> dict[str, Any] | None:
    """Collective. Resume from the newest of ``paths`` (oldest first) that is intact on every rank: one that is
    damaged or refused (:func:`open_sharded`) on any rank is skipped by all. Its shards are loaded in place ->
    its state with ``path``; None without ``paths``. A checkpoint that is intact but does not fit the model is an
    error, as is having checkpoints of which none is readable (a resume never silently starts over)."""
    refused: list[str] = []
    for path in reversed(paths):
        error: BaseException | None = None
        state: dict[str, Any] = {}
        try:
            state = open_sharded(path, map_location, dist.get_rank(), dist.get_world_size())
        except Exception as e:  # decided together: every rank skips it, or none does
            error = e
        try:
            agree(error)
        except Exception as e:
            if dist.get_rank() == 0:
                warnings.warn(f"skipping {e}", stacklevel=2)
            refused.append(str(e))
            continue
        load_embedding_state(coll, path)
        return {**state, "path": str(path)}
    if refused:
        raise CheckpointError(f"resume: none of the {len(paths)} checkpoints in {paths[0].parent} is readable "
                              f"(newest: {refused[0]}); remove them to start over, or train into another "
                              "--output-dir")
    return None


def open_sharded(path: Path, map_location: str | torch.device, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Check a sharded checkpoint before any shard is read -> its trainer state (with ``rank_<rank>.pt``'s when
    there is one): ``trainer.pt`` loads, this rank's share of the other files (every ``world``-th, all in one
    process) matches the checksums it records, ``.metadata`` passes the restricted unpickler. CheckpointError
    naming the file otherwise. No process group needed."""
    state = read_trainer_state(path, map_location)
    digests = state.pop(DIGESTS, None)
    if isinstance(digests, dict):
        for name in sorted(digests)[rank::world]:
            try:
                verify_files(path, digests, [name])
            except CheckpointError as e:
                if name.endswith(".distcp") or name == METADATA_FILE:
                    raise CheckpointError(f"{path}: its tables could not be read ({e})") from e
                raise
    else:
        note_unverified(path)
    read_dcp_metadata(path / METADATA_FILE)
    mine = rank_file(path, rank)
    if mine.is_file():
        own = load_pt(mine, map_location)
        if not isinstance(own, dict):
            raise CheckpointError(f"{mine}: not a rank state")
        state.update(own)
    return state


def read_trainer_state(path: Path, map_location: str | torch.device) -> dict[str, Any]:
    """A sharded checkpoint's replicated state (dense model and optimizer, data position, config, table sizes,
    the checksums of the other files), no process group needed; :class:`CheckpointError` naming the file when
    it is unreadable, damaged, refused or incomplete."""
    file = path / SHARDED_STATE_FILE
    state = load_pt(file, map_location)
    if not isinstance(state, dict) or state.get("complete") is not True:
        raise CheckpointError(f"{file}: incomplete checkpoint")
    return state


def read_full_tables(path: Path, tables: list[TableConfig], optimizer: SparseOptimizer
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, no process group: every table of a sharded checkpoint, whatever layout wrote it, for
    evaluation and scoring -> (weight [sum of rows, D], the optimizer's state {part: [sum of rows] or [sum of
    rows, D]}), the tables one after another in ``tables``' order, as a single-process collection holds them.
    Raises :class:`CheckpointError` when the saved pieces do not tile every table."""
    saved, pieces = _saved_pieces(path)
    check_coverage(tables, _parts(optimizer), path, pieces)
    rows = [t.num_embeddings for t in tables]
    dim = tables[0].embedding_dim if tables else 0
    weight = torch.empty(sum(rows), dim)
    state = {p.name: torch.empty((sum(rows), dim) if p.per_column else (sum(rows),)) for p in optimizer.state_parts}
    plan: list[tuple[torch.Tensor, Shard, str, tuple[str, int, int, int, int]]] = []
    request: dict[str, torch.Tensor] = {}
    r0 = 0
    for i, t in enumerate(tables):
        whole = Shard(i, 0, 0, 0, t.num_embeddings, 0, t.embedding_dim, "identity")
        for part, full in {"weight": weight, **state}.items():
            target = full[r0 : r0 + t.num_embeddings]  # one view per table: _copy_overlaps keys on it
            for p in pieces[(t.name, part)]:
                request.setdefault(p[0], torch.empty(tuple(saved[p[0]].size), dtype=target.dtype))
                plan.append((target, whole, part, p))
        r0 += t.num_embeddings
    try:
        with warnings.catch_warnings():  # that it reads in one process is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(request, checkpoint_id=str(path), storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    except (Exception, dcp.CheckpointException) as e:  # DCP's own error is a BaseException
        raise CheckpointError(f"{path}: its tables could not be read ({type(e).__name__}: {e})") from e
    _copy_overlaps(plan, request)
    return weight, state
