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
memory that is still free on its caches where it saves the most miss traffic (equal saving per byte at the
margin; a cache that reaches its shard's rows becomes a device shard and frees its host memory or SSD): caches
only grow, so no rank's predicted cost rises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from recstack.distributed.planner.cost import CostModel, Estimate
from recstack.distributed.planner.hit_rate import ZipfRows
from recstack.distributed.planner.inputs import TableSpec
from recstack.distributed.planner.storage import ShardStorage, row_bytes
from recstack.distributed.planner.table_sharding import TableSharding
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
                device_budget: int) -> None:
    """Give each rank's free device memory to the caches on it (module docstring); ``entries`` (with
    ``storage`` and ``memory_bytes_per_rank``) are updated in place. Caches only grow."""
    specs = {t.name: t for t in tables}
    cfg, topo = model.config, model.topology
    used = np.zeros(topo.world_size, dtype=np.int64)
    caches: list[list[_Cached]] = [[] for _ in range(topo.world_size)]
    for e in entries:
        spec = specs[e.name]
        for r, (r0, r1, c0, c1) in zip(e.ranks, shard_blocks(e.sharding, spec.rows, spec.dim, len(e.ranks)),
                                       strict=True):
            used[r] += _known(e.memory_bytes_per_rank)[r]
            if r in e.storage:
                seconds_per_byte = 1 / topo.pcie_bw + (1 / topo.ssd_bw if e.storage[r].tier == "ssd-cached" else 0)
                caches[r].append(_Cached(e, r, r1 - r0, row_bytes(c1 - c0, cfg.weight_bytes, cfg.state_bytes),
                                         spec, seconds_per_byte))
    for r, items in enumerate(caches):
        free = device_budget - int(used[r])
        if free <= 0 or not items:
            continue
        for item, rows in zip(items, _water_fill(items, free, model), strict=True):
            e, q, st = item.entry, item.rank, item.entry.storage[item.rank]
            if rows >= item.rows:  # cached whole: a device shard
                del e.storage[q]
                _known(e.memory_bytes_per_rank)[q] = item.rows * item.row_bytes
            elif rows > st.cache_rows:
                e.storage[q] = ShardStorage(st.tier, rows)
                _known(e.memory_bytes_per_rank)[q] = rows * item.row_bytes


@dataclass(frozen=True)
class _Cached:
    """A cached shard on a rank: ``rows`` rows of ``row_bytes``; a miss moves 2 rows at ``seconds_per_byte``."""

    entry: TableSharding
    rank: int
    rows: int
    row_bytes: int
    table: TableSpec
    seconds_per_byte: float


def _water_fill(items: list[_Cached], free: int, model: CostModel) -> list[int]:
    """Cache rows of each shard once ``free`` more bytes are spent where they save the most miss traffic.

    One more cached row of a shard holding fraction f of its table's rows is the row at table rank C / f;
    it saves 2 * seconds_per_byte * q per byte of cache, q = 1 - exp(-N p) the chance a step requests it
    (the LFU view, used for both policies). The saving falls as caches grow, so the best split gives every
    cache the size where its saving per byte is one threshold, found by bisection; caches never shrink."""
    cur = np.array([it.entry.storage[it.rank].cache_rows for it in items], dtype=np.int64)
    rows = np.array([it.rows for it in items], dtype=np.int64)
    rb = np.array([it.row_bytes for it in items], dtype=np.int64)
    budget = free + int((cur * rb).sum())
    if int((rows * rb).sum()) <= budget:
        return rows.tolist()
    laws = [_law(it.table.rows, model.config.zipf_exponent if it.table.zipf is None else it.table.zipf)
            for it in items]
    ids = [model.batch * model.topology.world_size * it.table.pooling for it in items]

    def sizes(threshold: float) -> np.ndarray:
        out = np.empty(len(items), dtype=np.int64)
        for j, (it, (p, ranks), n) in enumerate(zip(items, laws, ids, strict=True)):
            q = threshold / (2 * it.seconds_per_byte)
            if q >= 1 or n <= 0:
                out[j] = 0
                continue
            p_edge = -np.log1p(-q) / n  # rows requested with probability q per step have this popularity
            hot = int(np.searchsorted(-p, -p_edge, side="right"))  # bins at least that popular
            out[j] = int(ranks[hot - 1] * it.rows / it.table.rows) if hot else 0
        return np.clip(out, cur, rows)

    lo, hi = 1e-30, 1.0  # threshold: lo spends too much, hi (nothing is worth a second per byte) too little
    for _ in range(100):
        mid = float(np.sqrt(lo * hi))
        if int((sizes(mid) * rb).sum()) > budget:
            lo = mid
        else:
            hi = mid
        if hi <= lo * (1 + 1e-6):
            break
    return sizes(hi).tolist()


@lru_cache(maxsize=64)
def _law(rows: int, exponent: float) -> tuple[np.ndarray, np.ndarray]:
    """(popularity p of each bin, ranks up to the end of each bin) of a table's Zipf law."""
    law = ZipfRows(rows, exponent)
    return law.p, np.cumsum(law.width)


def _known(x: dict[int, int] | None) -> dict[int, int]:
    assert x is not None, "planner entries carry their memory estimates"
    return x
