"""A rank's local embedding shards over memory tiers (``[memory]`` budgets under torchrun).

Under torchrun ``memory.device`` and ``memory.host`` are budgets per rank: each rank places its own local shards
(a table-, row-, column- or table-row-wise shard is a local table of some rows x dims) with the single-process
planner (``recstack.embedding.tiered.placement.plan_placement``) against them, and holds them in one
``TieredEmbeddingCollection`` per shard dim (``device``, ``host-cached`` or ``ssd-cached``, the LRU/LFU cache
and its row-wise Adagrad state with its rows, as in one process). Data-parallel tables stay on the device, whole
on every rank (they are updated by an all-reduce); their bytes are taken off the device budget first. A rank's
SSD files go to ``<memory.ssd_dir>/rank_<rank>/``, so ranks never share a file. Each rank prints its plan, every
line prefixed with its rank.

Per-shard storage decisions made elsewhere (a plan file's shards with a tier and a cache size) come in through
``storage``: {local table name ``<table>.shard<index>``: ``TablePlacement``}; the shards it names keep their
placement, the others are planned from what the budgets leave.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

import torch

from recstack.distributed.sharded_collection import LocalCollection, LocalGroup
from recstack.embedding.collection import EmbeddingCollection, TableConfig
from recstack.embedding.fused import FusedEmbeddingBagCollection
from recstack.embedding.sparse_optim import SparseOptimizerConfig
from recstack.embedding.tiered.collection import TablePlacement, TieredEmbeddingCollection
from recstack.embedding.tiered.config import MemoryConfig
from recstack.embedding.tiered.placement import format_plan, plan_placement
from recstack.embedding.tiered.store import record_width
from recstack.errors import ConfigError
from recstack.units import format_bytes, parse_bytes


def row_bytes(dim: int, optimizer: SparseOptimizerConfig) -> int:
    """Bytes per row of a table of ``dim`` columns: its weights and, with row-wise Adagrad, its accumulator."""
    return 4 * record_width(dim, optimizer.kind == "rowwise_adagrad")


def rank_ssd_dir(memory: MemoryConfig, rank: int) -> str:
    """This rank's directory of SSD files, "" without ``memory.ssd_dir``."""
    return str(Path(memory.ssd_dir) / f"rank_{rank}") if memory.ssd_dir else ""


def plan_local_shards(
    memory: MemoryConfig, rank: int, tables: list[TableConfig], optimizer: SparseOptimizerConfig,
    replicated_bytes: int = 0, storage: Mapping[str, TablePlacement] | None = None,
) -> list[TablePlacement]:
    """The placement of this rank's local shards ``tables`` within its budgets, less ``replicated_bytes`` of
    data-parallel tables on the device. ConfigError naming the field, the shard and the rank when the budgets
    cannot hold them."""
    storage = storage or {}
    rb = [row_bytes(t.embedding_dim, optimizer) for t in tables]
    dev, host = parse_bytes(memory.device), parse_bytes(memory.host)
    given = {i: storage[t.name] for i, t in enumerate(tables) if t.name in storage}
    need = {"device": 0, "host": 0}
    for i, p in given.items():  # decided elsewhere: taken off the budgets the other shards are planned in
        need["device"] += (tables[i].num_embeddings if p.tier == "device" else p.cache_rows) * rb[i]
        if p.tier == "host-cached":
            need["host"] += tables[i].num_embeddings * rb[i]
    for field, budget in (("device", dev), ("host", host)):
        if budget is not None and need[field] > budget:
            names = ", ".join(repr(tables[i].name) for i, p in given.items()
                              if field == "device" or p.tier == "host-cached")
            raise ConfigError(f"rank {rank}: memory.{field}={getattr(memory, field)!r} ({format_bytes(budget)}) "
                              f"is below the {format_bytes(need[field])} the planned storage of shards {names} "
                              f"takes there: raise memory.{field} or give those shards another tier")
    dev = None if dev is None else dev - need["device"]
    host = None if host is None else host - need["host"]
    if dev is not None:
        dev -= replicated_bytes
        if dev < 0:
            raise ConfigError(f"rank {rank}: memory.device={memory.device!r} ({format_bytes(dev + replicated_bytes)}) "
                              f"is below the {format_bytes(replicated_bytes)} of the data-parallel tables and the "
                              "shards placed by the plan, which stay on the device: raise memory.device")
    rest = [i for i in range(len(tables)) if i not in given]
    try:
        planned = plan_placement([tables[i] for i in rest], [rb[i] for i in rest], dev, host,
                                 rank_ssd_dir(memory, rank), memory.cache_policy)
    except ValueError as e:
        raise ConfigError(f"rank {rank}: {e}") from e
    out = dict(zip(rest, planned, strict=True))
    out.update({i: TablePlacement(p.tier, p.cache_rows, memory.cache_policy) for i, p in given.items()})
    placements = [out[i] for i in range(len(tables))]
    on_ssd = [t.name for t, p in zip(tables, placements, strict=True) if p.tier == "ssd-cached"]
    if on_ssd:
        check_ssd_dir(memory, rank, on_ssd)
    return placements


def check_ssd_dir(memory: MemoryConfig, rank: int, tables: list[str]) -> None:
    """This rank's SSD directory can hold files (made when missing); else a ConfigError naming the field, the
    shards that need it and the rank."""
    names = ", ".join(repr(n) for n in tables)
    if not memory.ssd_dir:
        raise ConfigError(f"rank {rank}: memory.ssd_dir is not set, and the ssd-cached shards {names} need it")
    directory = Path(rank_ssd_dir(memory, rank))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory, prefix="recstack-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"rank {rank}: memory.ssd_dir={memory.ssd_dir!r}: cannot write files in {directory} "
                          f"for the ssd-cached shards {names} ({e.strerror or e})") from e


def tiered_local(memory: MemoryConfig, rank: int, replicated_bytes: int = 0,
                 storage: Mapping[str, TablePlacement] | None = None, log: TextIO | None = None) -> LocalCollection:
    """The sharded collection's factory of local collections under ``memory``'s budgets (see the module doc):
    a group whose shards all stay on the device is the fused in-memory collection, any other a
    ``TieredEmbeddingCollection``. The plan is printed to ``log`` (standard output by default)."""

    def build(groups: list[LocalGroup], optimizer: SparseOptimizerConfig,
              device: torch.device) -> list[EmbeddingCollection]:
        tables = [t for group, _ in groups for t in group]
        placements = plan_local_shards(memory, rank, tables, optimizer, replicated_bytes, storage)
        dev, host = parse_bytes(memory.device), parse_bytes(memory.host)
        text = format_plan(tables, placements, [row_bytes(t.embedding_dim, optimizer) for t in tables], dev, host,
                           rank_ssd_dir(memory, rank))
        if replicated_bytes:
            text += f"\n  data-parallel tables on the device: {format_bytes(replicated_bytes)}"
        print("\n".join(f"rank {rank}: {line}" for line in text.splitlines()), file=log or sys.stdout, flush=True)
        out: list[EmbeddingCollection] = []
        at = 0
        for group, init in groups:
            mine, at = placements[at : at + len(group)], at + len(group)
            if all(p.tier == "device" for p in mine):
                out.append(FusedEmbeddingBagCollection(group, optimizer, device=device, init=init))
            else:
                out.append(TieredEmbeddingCollection(group, optimizer, mine, device=device,
                                                     ssd_dir=rank_ssd_dir(memory, rank) or None,
                                                     prefetch=memory.prefetch, init=init))
        return out

    return build
