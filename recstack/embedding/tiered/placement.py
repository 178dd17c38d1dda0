"""Placement of embedding tables on storage tiers from memory budgets (``[memory]`` in the config).

The plan, for tables of ``row_bytes`` per row (D float32 weights, plus one accumulator with row-wise Adagrad):

1. Without a device budget, or when every table fits in it, every table stays on the device.
2. Otherwise tables are taken in order of bytes per feature that looks them up (small tables, and tables several
   features share, are the hottest per byte) and kept on the device while what is left of the device budget
   still covers a minimum cache (1% of the rows, at least one set of 32) for each table not kept.
3. The rest of the device budget becomes the caches of the other tables, the same fraction of each table's
   rows (so a cache holds 5% of its table when the leftover is 5% of their bytes); a table whose share is below
   its minimum cache gets the minimum and the others share the rest, so the plan never exceeds the budget (a
   budget below the minimum caches gives caches as large as it allows, down to one row; below that, an error).
4. Their rows go to host memory while the host budget lasts (smallest first), then to files in ``ssd_dir``.

The plan is printed as a table when the trainer builds the model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TextIO

import torch

from recstack.embedding.collection import EmbeddingCollection, TableConfig
from recstack.embedding.fused import FusedEmbeddingBagCollection
from recstack.embedding.sparse_optim import SparseOptimizerConfig
from recstack.embedding.tiered.cache import POLICIES
from recstack.embedding.tiered.collection import TablePlacement, TieredEmbeddingCollection
from recstack.embedding.tiered.config import MemoryConfig
from recstack.embedding.tiered.store import record_width
from recstack.units import format_bytes, parse_bytes

MIN_CACHE_FRACTION = 0.01
MIN_CACHE_ROWS = 32  # one set of the set-associative cache
def _min_cache_rows(table: TableConfig) -> int:
    return min(table.num_embeddings, max(MIN_CACHE_ROWS, math.ceil(MIN_CACHE_FRACTION * table.num_embeddings)))


def _per_table(row_bytes: int | Sequence[int], n: int) -> list[int]:
    return [row_bytes] * n if isinstance(row_bytes, int) else list(row_bytes)


def plan_placement(
    tables: list[TableConfig],
    row_bytes: int | Sequence[int],
    device_budget: int | None,
    host_budget: int | None = None,
    ssd_dir: str = "",
    policy: str = "lru",
) -> list[TablePlacement]:
    """One ``TablePlacement`` per table (same order) within the budgets (bytes; None = unlimited). ``row_bytes``:
    bytes per row of every table, or of each table (the local shards of a rank, whose dims differ where a table
    is split by columns)."""
    if policy not in POLICIES:
        raise ValueError(f"cache policy {policy!r}: expected one of {', '.join(POLICIES)}")
    rb = _per_table(row_bytes, len(tables))
    size = [t.num_embeddings * rb[i] for i, t in enumerate(tables)]
    if device_budget is None or sum(size) <= device_budget:
        return [TablePlacement("device") for _ in tables]
    order = sorted(range(len(tables)), key=lambda i: (size[i] / max(1, len(tables[i].features)), i))
    on_device = {i for i in order if size[i] == 0}  # an empty row shard: nothing to cache
    used = 0
    for i in order:
        others = [j for j in range(len(tables)) if j != i and j not in on_device]
        reserve = sum(_min_cache_rows(tables[j]) * rb[j] for j in others)
        if i not in on_device and used + size[i] + reserve <= device_budget:
            on_device.add(i)
            used += size[i]
    cached = [i for i in range(len(tables)) if i not in on_device]
    cache_rows = _cache_rows(tables, cached, device_budget - used, rb)
    host_used = 0
    tiers: dict[int, str] = {}
    for i in sorted(cached, key=lambda i: (size[i], i)):
        if host_budget is None or host_used + size[i] <= host_budget:
            tiers[i], host_used = "host-cached", host_used + size[i]
        elif ssd_dir:
            tiers[i] = "ssd-cached"
        else:
            left = "unlimited" if host_budget is None else format_bytes(host_budget - host_used)
            raise ValueError(
                f"table {tables[i].name!r} ({format_bytes(size[i])}) fits neither memory.device nor memory.host "
                f"({left} left): set memory.ssd_dir or raise a budget"
            )
    out = []
    for i in range(len(tables)):
        if i in on_device:
            out.append(TablePlacement("device"))
        else:
            out.append(TablePlacement(tiers[i], cache_rows[i], policy))
    return out


def _cache_rows(tables: list[TableConfig], cached: list[int], budget: int, rb: list[int]) -> dict[int, int]:
    """Split ``budget`` bytes into the caches of tables ``cached`` -> {table: cache rows}: the same fraction of
    each table's rows, except that a table whose share is below its minimum cache gets the minimum and the others
    share what is left, so the caches together never exceed the budget. A budget below the minimum caches gives
    caches as large as it allows, down to one row."""
    minimum = {i: _min_cache_rows(tables[i]) for i in cached}
    if budget < sum(minimum[i] * rb[i] for i in cached):
        minimum = dict.fromkeys(cached, 1)  # any cache size works (rows that find no slot are staged)
        if budget < sum(rb[i] for i in cached):
            row = ", ".join(sorted({f"{rb[i]} B" for i in cached}))
            names = ", ".join(repr(tables[i].name) for i in cached)
            raise ValueError(
                f"memory.device leaves {budget:,} B for caches, less than one row ({row}) for each of the "
                f"{len(cached)} tables it cannot hold ({names}): raise memory.device"
            )
    floor: set[int] = set()
    while True:
        free = [i for i in cached if i not in floor]
        left = budget - sum(minimum[i] * rb[i] for i in floor)
        free_bytes = max(1, sum(tables[i].num_embeddings * rb[i] for i in free))
        # integer arithmetic: rows = left * n / free_bytes, rounded down, so the shares never add up past ``left``
        # (the same fraction of every table's rows, whatever its bytes per row)
        share = {i: min(tables[i].num_embeddings, left * tables[i].num_embeddings // free_bytes) for i in free}
        low = {i for i in free if share[i] < minimum[i]}
        if not low:
            return {**share, **{i: minimum[i] for i in floor}}
        floor |= low


def format_plan(
    tables: list[TableConfig], placements: list[TablePlacement], row_bytes: int | Sequence[int],
    device_budget: int | None, host_budget: int | None, ssd_dir: str = "",
) -> str:
    """A human-readable table of the plan and the memory it uses per tier."""
    rb = _per_table(row_bytes, len(tables))
    def budget(b: int | None) -> str:
        return "unlimited" if b is None else format_bytes(b)

    lines = [f"embedding placement (device budget {budget(device_budget)}, host budget {budget(host_budget)}"
             + (f", ssd_dir {ssd_dir})" if ssd_dir else ")")]
    w = max([5, *(len(t.name) for t in tables)])
    lines.append(f"  {'table':<{w}} {'rows':>12} {'size':>10}  {'tier':<12} {'cache rows':>11} {'cache':>7}")
    use = {"device": 0, "host": 0, "ssd": 0}
    for t, p, rbt in zip(tables, placements, rb, strict=True):
        nbytes = t.num_embeddings * rbt
        line = f"  {t.name:<{w}} {t.num_embeddings:>12,} {format_bytes(nbytes):>10}  {p.tier:<12}"
        if p.tier == "device":
            use["device"] += nbytes
        else:
            use["device"] += p.cache_rows * rbt
            use["host" if p.tier == "host-cached" else "ssd"] += nbytes
            line += f" {p.cache_rows:>11,} {100 * p.cache_rows / t.num_embeddings:>6.1f}%"
        lines.append(line.rstrip())
    lines.append("  uses: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in use.items()))
    return "\n".join(lines)


def memory_budgets_set(memory: MemoryConfig) -> bool:
    return parse_bytes(memory.device) is not None or parse_bytes(memory.host) is not None


def build_collection(
    memory: MemoryConfig,
    tables: list[TableConfig],
    optimizer: SparseOptimizerConfig,
    seed: int,
    device: torch.device | str = "cpu",
    log: TextIO | None = None,
) -> EmbeddingCollection:
    """The embedding collection the ``[memory]`` budgets call for: the fused all-in-memory one when every table
    fits on the device, a ``TieredEmbeddingCollection`` otherwise; rows from ``init_table`` with ``seed``.
    Prints the plan to ``log`` (standard output by default)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one collection of every whole table: not a rank's shards
        raise ValueError("build_collection places whole tables in one process; under torchrun each rank places its "
                         "own shards (build the model with tables_on_meta=True and shard it)")
    dev, host = parse_bytes(memory.device), parse_bytes(memory.host)
    row_bytes = 4 * record_width(tables[0].embedding_dim, optimizer.kind == "rowwise_adagrad")
    placements = plan_placement(tables, row_bytes, dev, host, memory.ssd_dir, memory.cache_policy)
    print(format_plan(tables, placements, row_bytes, dev, host, memory.ssd_dir), file=log, flush=True)
    if all(p.tier == "device" for p in placements):
        return FusedEmbeddingBagCollection(tables, optimizer, seed=seed, device=device)
    return TieredEmbeddingCollection(tables, optimizer, placements, seed=seed, device=device,
                                     ssd_dir=memory.ssd_dir or None, prefetch=memory.prefetch)
