"""Storage tiers in the search: the options of a table whose shards sit behind device caches, and the cache
sizes that fill each rank's device memory once every shard has its place.

When the tables do not fit in device memory (``partition.plan_sharding`` with ``tiers``), every table gets,
for each (sharding, k) the device-only search would try:

- ``data_parallel``: on the device (replicas stay there);
- otherwise one option per tier with a budget (``host-cached`` where the ranks have host memory,
  ``ssd-cached`` where they have SSD): every shard keeps ``fraction`` of its rows in a device cache, at least
  twice the distinct rows it requests per step (the cache holds the batch being trained and the next,
  prefetched one) and at least one row. A shard whose cache would hold all its rows is a device shard; a
  table whose shards are all such keeps its device option.

``fraction`` starts at the share of the tables' bytes that device memory can hold (90% of it, leaving room
for imbalance) and is quartered until a plan fits. A plan found, :func:`grow_caches` spends each rank's device
memory that is still free on its caches, in proportion to their sizes (a cache that reaches its shard's rows
becomes a device shard and frees its host memory or SSD): hit rates only grow, so no rank's predicted cost
rises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from recstack.distributed.planner.cost import CostModel, Estimate
from recstack.distributed.planner.storage import ShardStorage, row_bytes
from recstack.distributed.planner.types import TableSharding, TableSpec
from recstack.distributed.sharding import shard_blocks


def min_cache_rows(model: CostModel, table: TableSpec, shard_rows: int) -> int:
    """Smallest cache the planner gives a shard of ``shard_rows`` rows: twice its distinct rows per step."""
    ids = model.batch * model.topology.world_size * table.pooling
    exponent = model.config.zipf_exponent if table.zipf is None else table.zipf
    requests = model.cache_estimate(table.rows, exponent, 0, ids, shard_rows / table.rows).requests
    return max(1, math.ceil(2 * requests))


def cached_storage(model: CostModel, table: TableSpec, sharding: str, k: int, tier: str,
                   fraction: float) -> tuple[ShardStorage | None, ...]:
    """Storage of each of the k shards: ``tier`` with ``fraction`` of its rows cached, or None (device)
    where that cache would hold every row."""
    out: list[ShardStorage | None] = []
    for r0, r1, _, _ in shard_blocks(sharding, table.rows, table.dim, k):
        rows = r1 - r0
        cache = max(min_cache_rows(model, table, rows), math.ceil(fraction * rows))
        out.append(ShardStorage(tier, cache) if cache < rows else None)
    return tuple(out)


def tiered_estimates(model: CostModel, table: TableSpec, sharding: str, k: int, tiers: Sequence[str],
                     fraction: float) -> list[Estimate]:
    """The estimates a table offers for one (sharding, k) when tiers are on (module docstring)."""
    device = model.estimate(table, sharding, k)
    if sharding == "data_parallel":
        return [device]
    k = len(device.hbm)
    out = []
    for tier in tiers:
        storage = cached_storage(model, table, sharding, k, tier, fraction)
        if any(storage):
            out.append(model.estimate(table, sharding, k, storage))
    return out or [device]


def grow_caches(entries: list[TableSharding], tables: Sequence[TableSpec], model: CostModel,
                device_budget: int, rounds: int = 4) -> None:
    """Give each rank's free device memory to the caches on it, in proportion to their sizes (module
    docstring); ``entries`` (with ``storage`` and ``memory_bytes_per_rank``) are updated in place."""
    specs = {t.name: t for t in tables}
    cfg = model.config
    for _ in range(rounds):
        used = np.zeros(model.topology.world_size, dtype=np.int64)
        caches: list[list[tuple[TableSharding, int, int, int]]] = [[] for _ in range(len(used))]
        for e in entries:
            spec = specs[e.name]
            for r, (r0, r1, c0, c1) in zip(e.ranks, shard_blocks(e.sharding, spec.rows, spec.dim, len(e.ranks)),
                                           strict=True):
                used[r] += _known(e.memory_bytes_per_rank)[r]
                if r in e.storage:
                    caches[r].append((e, r, r1 - r0, row_bytes(c1 - c0, cfg.weight_bytes, cfg.state_bytes)))
        grew = False
        for r, items in enumerate(caches):
            free = device_budget - int(used[r])
            total = sum(e.storage[q].cache_rows * rb for e, q, _, rb in items)
            if free <= 0 or total <= 0:
                continue
            for e, q, rows, rb in items:
                st = e.storage[q]
                extra = int(free * (st.cache_rows * rb / total)) // rb
                if extra <= 0:
                    continue
                grew = True
                if st.cache_rows + extra >= rows:  # cached whole: a device shard
                    del e.storage[q]
                    _known(e.memory_bytes_per_rank)[q] = rows * rb
                else:
                    e.storage[q] = ShardStorage(st.tier, st.cache_rows + extra)
                    _known(e.memory_bytes_per_rank)[q] = (st.cache_rows + extra) * rb
        if not grew:
            return


def _known(x: dict[int, int] | None) -> dict[int, int]:
    assert x is not None, "planner entries carry their memory estimates"
    return x
