"""Search for a sharding plan that minimises the slowest rank's predicted cost under memory limits.

1. Options: for each table, every allowed (sharding, k): ``data_parallel``; ``table_wise``; ``row_wise``
   over k ranks (k = 2..8, the powers of two, and W); ``column_wise`` over k ranks, k dividing the dim with
   blocks of at least ``min_column_dim`` columns; ``table_row_wise`` over k ranks of one node (k as for
   row_wise, up to the node size; on one node only if row_wise is barred, as row_wise then does the same
   with less traffic). An option is the cost and HBM bytes of each shard (``cost.py``); the topology is
   homogeneous, so they do not depend on the rank.
2. Feasibility: a table whose smallest per-rank footprint exceeds HBM, or tables that together need more
   than all ranks have, raise :class:`PlanError` with the bytes needed per rank.
3. Greedy, largest table first: each option is put on the least-loaded ranks with room (its costliest
   shard on the least-loaded rank; table_row_wise tries every node) and scored by max(resulting max load,
   (all load so far + this option + the cheapest option of every table still to place) / W), a lower bound
   on the final slowest rank given this choice; ties go to less total work. Splitting a table thus wins
   only where it lowers that bound. A start may cap the shard count (1, 2, 4, ... W): coarse pieces pack
   better when fine splits would fragment the ranks.
4. Local improvement on the most loaded rank(s): (a) take one of its tables off and put it back with its
   best option given the rest (a move or a change of sharding type); (b) swap one of its shards with a
   cheaper shard of another table elsewhere; (c) take off one of its tables and a second one (on it or on
   the least-loaded ranks) and put both back with their best pair of options. A step is kept only if it
   lowers (max load, sum of squared loads), so the search ends.
5. Starts: cost order under each shard-count cap, memory order, then ``restarts`` shuffled cost orders
   (seeded: plans repeat unless the time limit cuts the search short), each improved with steps (a) and
   (b); they stop after half of ``time_limit_s``, after 8 starts without a better plan, or once a plan
   meets the lower bound (mean of the cheapest options; each table's smallest slowest shard). The best few
   distinct plans then also get step (c) and the best wins. If no greedy start fits in memory, the search
   starts from each table's smallest-footprint option.
6. Storage tiers (``tiers=True``): if the tables do not fit in device memory, the same search runs over
   host-cached and ssd-cached options (``tiers.py``), each rank holding device memory, host memory and SSD
   (``Topology.budgets``); every placement checks all three.
"""


from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence

from recstack.distributed.planner.cost import CostConfig, CostModel
from recstack.distributed.planner.inputs import PlanError, TableSpec, Topology
from recstack.distributed.planner.options import Option, allowed_types, candidate_splits
from recstack.distributed.planner.plan import ShardingPlan
from recstack.distributed.planner.search import SearchState, run_search
from recstack.distributed.planner.table_sharding import TableSharding
from recstack.distributed.planner.tiers import grow_caches, tiered_estimates
from recstack.units import format_bytes


class _NoRoom(PlanError):
    """The tables do not fit in device memory (the tiered search may still place them)."""


def plan_sharding(
    tables: Sequence[TableSpec],
    topology: Topology,
    batch_size_per_rank: int,
    *,
    config: CostConfig | None = None,
    constraints: Mapping[str, str | Sequence[str]] | None = None,
    force: str | None = None,
    min_column_dim: int = 8,
    time_limit_s: float = 5.0,
    restarts: int = 16,
    tiers: bool = False,
    even_row_wise: Collection[str] = (),
) -> ShardingPlan:
    """Choose a sharding type and ranks for every table (see the module docstring).

    ``constraints`` maps a table name to the sharding type (or list of types) it may use; ``force`` applies
    one type to every table without a constraint. ``time_limit_s`` bounds the search after the first
    start; ``restarts`` is the number of shuffled starts tried within it. ``tiers``: where the tables do not
    fit in device memory, keep shards in host memory or on SSD behind device caches, within each rank's share
    of ``topology.ddr_bytes`` and ``topology.ssd_bytes`` (``tiers.py``); a plan that fits in device memory is
    the device-only plan whatever ``tiers`` says (caches only add miss traffic). ``even_row_wise``: tables sharded
    row_wise over every rank in rank order, an even split (dynamic id tables: rank k owns the ids hashing to k and
    rows [k * rows / W, (k + 1) * rows / W)), on the device, whatever else would cost less.
    """
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise PlanError(f"table names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    model = CostModel(topology, batch_size_per_rank, config)
    allowed = allowed_types(tables, constraints, force)
    splits = []
    W, even = topology.world_size, set(even_row_wise)
    for t, kinds in zip(tables, allowed, strict=True):
        if t.name in even:
            if t.rows % W or t.rows < 2 * W:
                raise PlanError(f"table {t.name!r}: a dynamic table's {t.rows:,} rows must split evenly over the {W} "
                                "ranks, at least 2 rows each")
            splits.append([("row_wise", W)])
            continue
        splits.append(candidate_splits(t, topology, kinds, min_column_dim))
        if not splits[-1]:
            raise PlanError(f"table {t.name!r} ({t.rows:,} rows x {t.dim}): no valid {' or '.join(kinds)} "
                            f"sharding on {topology.world_size} ranks")
    try:
        plan = _plan_device(tables, splits, model, time_limit_s, restarts)
    except _NoRoom:
        if not tiers:
            raise
        plan = _plan_tiered(tables, splits, model, time_limit_s, restarts)
    for entry in plan.tables:
        if entry.name in even:  # W equal shards, one a rank: in rank order they cost and weigh the same
            entry.ranks = sorted(entry.ranks)
            if entry.storage:
                raise PlanError(f"table {entry.name!r}: a dynamic table stays on the device, but the tables fit only "
                                "with some of its shards in host memory or on SSD (raise --hbm)")
    return plan


def _plan_device(tables: Sequence[TableSpec], splits: list[list[tuple[str, int]]], model: CostModel,
                 time_limit_s: float, restarts: int) -> ShardingPlan:
    topology = model.topology
    W, cap = topology.world_size, topology.hbm_bytes
    options: list[list[Option]] = []
    same_shape: dict[tuple, list[Option]] = {}  # models made of many identical tables cost each shape once
    for t, table_splits in zip(tables, splits, strict=True):
        shape = (t.rows, t.dim, t.pooling, t.access_counts, tuple(table_splits))
        if shape not in same_shape:
            same_shape[shape] = [Option(sharding, est.cost, est.hbm) for sharding, k in table_splits
                                 for est in [model.estimate(t, sharding, k)]]
        opts = same_shape[shape]
        smallest = min(opts, key=lambda o: o.max_hbm)
        if smallest.max_hbm > cap:
            need = smallest.max_hbm
            where = "on one rank" if smallest.k == 1 else f"per rank ({smallest.sharding} over {smallest.k} ranks)"
            raise _NoRoom(f"table {t.name!r} ({t.rows:,} rows x {t.dim}) does not fit: its smallest footprint "
                          f"needs {format_bytes(need, decimal=True)} ({need:,} bytes) {where}, HBM per rank is "
                          f"{format_bytes(cap, decimal=True)} ({cap:,} bytes)")
        options.append(opts)
    least_total = sum(min(int(o.hbm.sum()) for o in opts) for opts in options)
    if least_total > W * cap:
        need = -(-least_total // W)
        raise _NoRoom(f"the tables need at least {format_bytes(least_total, decimal=True)} of HBM in total, "
                      f"{format_bytes(need, decimal=True)} ({need:,} bytes) per rank, but each of the {W} ranks has "
                      f"{format_bytes(cap, decimal=True)} ({cap:,} bytes)")

    best = run_search(options, topology, time_limit_s, restarts)
    if best is None:
        raise _NoRoom(f"could not fit the tables in HBM: they need at least "
                      f"{format_bytes(least_total / W, decimal=True)} per rank on average, each of the {W} ranks "
                      f"has {format_bytes(cap, decimal=True)}; allow more sharding types or add memory")
    return _plan_of(tables, options, best, model)


def _plan_of(tables: Sequence[TableSpec], options: list[list[Option]], best: SearchState, model: CostModel,
             grow: bool = False) -> ShardingPlan:
    entries = []
    for i, t in enumerate(tables):
        o, ranks = best.placed(i)
        opt = options[i][o]
        storage = {int(r): st for r, st in zip(ranks, opt.storage or [None] * opt.k, strict=True) if st is not None}
        entries.append(TableSharding(t.name, t.rows, t.dim, opt.sharding, ranks.tolist(),
                                     {int(r): int(b) for r, b in zip(ranks, opt.hbm, strict=True)}, storage))
    if grow:
        grow_caches(entries, tables, model, model.topology.hbm_bytes)
    W = model.topology.world_size
    return ShardingPlan(W, model.topology, model.batch, entries, model.plan_cost(tables, entries))


def _plan_tiered(tables: Sequence[TableSpec], splits: list[list[tuple[str, int]]], model: CostModel,
                 time_limit_s: float, restarts: int) -> ShardingPlan:
    """The search over tiered options (``tiers.py``) at shrinking cache fractions until a plan fits."""
    topology = model.topology
    W, budgets = topology.world_size, topology.budgets()
    kinds = [tier for tier, b in (("host-cached", budgets.host), ("ssd-cached", budgets.ssd)) if b]
    deadline = time.perf_counter() + time_limit_s
    footprint: dict[tuple, int] = {}  # least device bytes of each table shape
    for t, sp in zip(tables, splits, strict=True):
        size = (t.rows, t.dim, tuple(sp))
        if size not in footprint:
            footprint[size] = min(int(model.estimate(t, s, k).hbm.sum()) for s, k in sp)
    total = sum(footprint[(t.rows, t.dim, tuple(sp))] for t, sp in zip(tables, splits, strict=True))
    per_rank = sum(b or 0 for b in (budgets.device, budgets.host, budgets.ssd))
    have = ", ".join(f"{name} {format_bytes(b or 0, decimal=True)}" for name, b in
                     (("device", budgets.device), ("host", budgets.host), ("SSD", budgets.ssd)))
    if not kinds or total > W * per_rank:
        raise PlanError(f"the tables need at least {format_bytes(total, decimal=True)} in total, "
                        f"{format_bytes(-(-total // W), decimal=True)} per rank, but each of the {W} ranks has {have} "
                        f"(host memory and SSD per host, split between its ranks: raise --hbm, --ddr or --ssd)")
    fraction = min(1.0, 0.9 * W * topology.hbm_bytes / total)
    while fraction * max(t.rows for t in tables) >= 1:
        options: list[list[Option]] = []
        same_shape: dict[tuple, list[Option]] = {}
        for t, table_splits in zip(tables, splits, strict=True):
            shape = (t.rows, t.dim, t.pooling, t.access_counts, t.zipf, tuple(table_splits))
            if shape not in same_shape:
                same_shape[shape] = [Option.of(s, est) for s, k in table_splits
                                     for est in tiered_estimates(model, t, s, k, kinds, fraction)]
            options.append(same_shape[shape])
        left = max(deadline - time.perf_counter(), time_limit_s / 10)
        best = run_search(options, topology, left, restarts, tiers=True)
        if best is not None:
            return _plan_of(tables, options, best, model, grow=True)
        fraction /= 4
    raise PlanError(f"could not fit the tables in device memory, host memory and SSD: they need at least "
                    f"{format_bytes(total / W, decimal=True)} per rank on average; each rank has {have}, and a "
                    f"shard's device cache holds at least twice the rows it looks up per step (raise --hbm or "
                    f"lower the batch size)")
