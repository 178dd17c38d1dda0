"""The ways to shard and store one table that the search chooses between (step 1 of ``partition.py``'s module
docstring): :class:`Option`, the cost and memory of each shard of one way, and the (sharding, shard count)
pairs worth costing for a table under its allowed sharding types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from recstack.distributed.planner.cost import Estimate
from recstack.distributed.planner.inputs import PlanError, TableSpec, Topology
from recstack.distributed.planner.storage import ShardStorage
from recstack.distributed.sharding import SHARDING_TYPES, row_blocks


class Option:
    """One way to shard and store a table: ``cost`` [k] seconds per step and ``mem`` [len(BUDGETS), k] bytes of
    device memory, host memory and SSD of each shard (``hbm`` = mem[0]); ``storage`` per shard (() = all on
    the device)."""

    def __init__(self, sharding: str, cost: np.ndarray, hbm: np.ndarray, mem: np.ndarray | None = None,
                 storage: tuple[ShardStorage | None, ...] = ()) -> None:
        self.sharding, self.cost, self.hbm, self.storage = sharding, cost, hbm, storage
        self.mem = mem if mem is not None else np.stack([hbm, np.zeros_like(hbm), np.zeros_like(hbm)])
        self.k = len(cost)
        self.total = float(cost.sum())
        self.max_hbm = int(hbm.max())
        self.max_need = self.mem.max(axis=1)[:, None]  # [len(BUDGETS), 1]
        self.by_cost = np.argsort(-cost, kind="stable")  # costliest shard first

    @classmethod
    def of(cls, sharding: str, est: Estimate) -> Option:
        return cls(sharding, est.cost, est.hbm, est.memory(), est.storage)


def split_counts(limit: int) -> list[int]:
    """Shard counts tried for row splits over at most ``limit`` ranks: 2..8, powers of two, limit."""
    ks = set(range(2, min(limit, 8) + 1)) | {2**i for i in range(1, limit.bit_length()) if 2**i <= limit}
    return sorted(ks | ({limit} if limit >= 2 else set()))


def candidate_splits(table: TableSpec, topology: Topology, allowed: Sequence[str],
                     min_column_dim: int) -> list[tuple[str, int]]:
    """(sharding, number of shards) pairs worth costing for ``table``."""
    W, L = topology.world_size, topology.devices_per_node
    out: list[tuple[str, int]] = []
    single = [] if "table_wise" in allowed else [1]  # a one-shard split stands in for table_wise when barred
    for sharding in allowed:
        if sharding == "data_parallel":
            out.append((sharding, W))
        elif sharding == "table_wise":
            out.append((sharding, 1))
        elif sharding == "column_wise":
            out += [(sharding, k) for k in single + list(range(2, W + 1))
                    if table.dim % k == 0 and (k == 1 or table.dim // k >= min_column_dim)]
        elif sharding in ("row_wise", "table_row_wise"):
            if sharding == "table_row_wise" and topology.nodes == 1 and "row_wise" in allowed:
                continue  # on one node row_wise does the same with less traffic
            limit = W if sharding == "row_wise" else L
            out += [(sharding, k) for k in single + split_counts(limit)
                    if all(hi > lo for lo, hi in row_blocks(table.rows, k))]
    return out


def allowed_types(tables: Sequence[TableSpec], constraints: Mapping[str, str | Sequence[str]] | None,
                  force: str | None) -> list[list[str]]:
    names = {t.name for t in tables}
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - names)
    if unknown:
        raise PlanError(f"constraints name unknown table(s) {unknown}")
    out = []
    for t in tables:
        want = constraints.get(t.name, force)
        allowed = list(SHARDING_TYPES) if want is None else [want] if isinstance(want, str) else list(want)
        bad = [s for s in allowed if s not in SHARDING_TYPES]
        if bad or not allowed:
            raise PlanError(f"table {t.name!r}: unknown sharding {bad or allowed} (one of {', '.join(SHARDING_TYPES)})")
        out.append(allowed)
    return out
