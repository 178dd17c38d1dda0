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
from collections.abc import Mapping, Sequence

import numpy as np

from recstack.distributed.planner.cost import CostConfig, CostModel, Estimate
from recstack.distributed.planner.storage import ShardStorage
from recstack.distributed.planner.tiers import grow_caches, tiered_estimates
from recstack.distributed.planner.types import (
    PlanError,
    ShardingPlan,
    TableSharding,
    TableSpec,
    Topology,
)
from recstack.distributed.sharding import SHARDING_TYPES, row_blocks
from recstack.units import format_bytes

_EPS = 1e-12
_TOP_RANKS = 8  # tied slowest ranks tried per improvement step
_FINALISTS = 3  # best distinct plans that get the two-table moves
_PATIENCE = 8  # greedy starts without a better plan before the search moves on


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


class _Search:
    """Placement state (load [W] seconds, free [len(BUDGETS), W] bytes of device memory, host memory and SSD,
    each table's option and ranks) and moves."""

    def __init__(self, options: list[list[Option]], topology: Topology, tiers: bool = False) -> None:
        self.options, self.topo = options, topology
        W, L = topology.world_size, topology.devices_per_node
        self.all_ranks = np.arange(W)
        self.node_ranks = [np.arange(n * L, (n + 1) * L) for n in range(topology.nodes)]
        self.node = self.all_ranks // L
        self.load = np.zeros(W)
        budgets = topology.budgets()
        # Without tiers only device memory binds (options then need none of the others).
        self.free = np.array([[budgets.device or 0], [budgets.host or 0] if tiers else [0],
                              [budgets.ssd or 0] if tiers else [0]], dtype=np.int64).repeat(W, axis=1)
        self.choice: list[tuple[int, np.ndarray] | None] = [None] * len(options)
        self.on_rank: list[set[int]] = [set() for _ in range(W)]

    # -- state -------------------------------------------------------------------------------------
    def add(self, t: int, o: int, ranks: np.ndarray) -> None:
        opt = self.options[t][o]
        self.load[ranks] += opt.cost
        self.free[:, ranks] -= opt.mem
        self.choice[t] = (o, ranks)
        for r in ranks.tolist():
            self.on_rank[r].add(t)

    def placed(self, t: int) -> tuple[int, np.ndarray]:
        """(option, ranks) of table ``t``, which is placed."""
        choice = self.choice[t]
        assert choice is not None, f"table {t} is not placed"
        return choice

    def remove(self, t: int) -> tuple[int, np.ndarray]:
        o, ranks = self.placed(t)
        opt = self.options[t][o]
        self.load[ranks] -= opt.cost
        self.free[:, ranks] += opt.mem
        self.choice[t] = None
        for r in ranks.tolist():
            self.on_rank[r].discard(t)
        return o, ranks

    def fits(self, need: np.ndarray, ranks: np.ndarray | None = None) -> np.ndarray:
        """[len(ranks)] whether each rank (all by default) has ``need`` [len(BUDGETS), 1] bytes free."""
        free = self.free if ranks is None else self.free[:, ranks]
        return np.asarray((free >= need).all(axis=0))

    def score(self) -> tuple[float, float]:
        return float(self.load.max()), float(np.square(self.load).sum())

    # -- placement -----------------------------------------------------------------------------------
    def place(self, opt: Option) -> np.ndarray | None:
        """Ranks for each shard of ``opt`` on the least-loaded ranks with room, or None if it does not fit."""
        if opt.sharding == "data_parallel":
            return self.all_ranks if bool(self.fits(opt.mem[:, :1]).all()) else None
        if opt.sharding != "table_row_wise":
            return self._pick(opt, self.all_ranks)
        # Every node at once: its k least-loaded ranks with room take the shards, costliest first.
        L = self.topo.devices_per_node
        load = np.where(self.fits(opt.max_need), self.load, np.inf).reshape(-1, L)
        order = np.argsort(load, axis=1, kind="stable")[:, :opt.k]  # [nodes, k]
        peak = (np.take_along_axis(load, order, axis=1) + opt.cost[opt.by_cost]).max(axis=1)
        if np.isfinite(peak).any():
            node = int(np.argmin(peak))
            ranks = np.empty(opt.k, dtype=np.int64)
            ranks[opt.by_cost] = node * L + order[node]
            return ranks
        best, best_max = None, np.inf  # memory is tight on every node: shard by shard
        for cand in self.node_ranks:
            picked = self._pick(opt, cand)
            if picked is not None and (m := float((self.load[picked] + opt.cost).max())) < best_max:
                best, best_max = picked, m
        return best

    def _pick(self, opt: Option, cand: np.ndarray) -> np.ndarray | None:
        k, ranks = opt.k, np.empty(opt.k, dtype=np.int64)
        roomy = cand[self.fits(opt.max_need, cand)]
        if len(roomy) >= k:  # usual case: the k least-loaded (then emptiest) ranks, costliest shard first
            chosen = roomy[np.lexsort((-self.free[0, roomy], self.load[roomy]))[:k]]
            ranks[opt.by_cost] = chosen
            return ranks
        taken = np.zeros(len(cand), dtype=bool)
        for j in np.argsort(-opt.hbm, kind="stable"):  # memory is tight: biggest shard first
            fits = np.flatnonzero(self.fits(opt.mem[:, j:j + 1], cand) & ~taken)
            if not len(fits):
                return None
            i = fits[np.argmin(self.load[cand[fits]])]
            ranks[j], taken[i] = cand[i], True
        return ranks

    def loads_with(self, opt: Option, ranks: np.ndarray) -> np.ndarray:
        load = self.load.copy()
        load[ranks] += opt.cost
        return load

    # -- search ----------------------------------------------------------------------------------------
    def greedy(self, order: Sequence[int], cheapest: np.ndarray, max_shards: int | None = None) -> bool:
        """Place tables in ``order``; False if one does not fit. cheapest[t] = least total cost of table t.
        ``max_shards`` keeps splits to at most that many shards where such an option fits (data_parallel
        is always allowed): coarse starts leave room that fine splits would fragment."""
        W = len(self.load)
        rest = float(cheapest[list(order)].sum())
        for t in order:
            rest -= cheapest[t]
            best, best_key = None, None
            cur_max, cur_sum = float(self.load.max()), float(self.load.sum())
            for coarse_only in ((True, False) if max_shards else (False,)):
                for o, opt in enumerate(self.options[t]):
                    if coarse_only and max_shards and opt.k > max_shards and opt.sharding != "data_parallel":
                        continue
                    ranks = self.place(opt)
                    if ranks is None:
                        continue
                    new_max = max(cur_max, float((self.load[ranks] + opt.cost).max()))
                    key = (max(new_max, (cur_sum + opt.total + rest) / W), opt.total, new_max)
                    if best_key is None or key < best_key:
                        best, best_key = (o, ranks), key
                if best is not None:
                    break
            if best is None:
                return False
            self.add(t, *best)
        return True

    def improve(self, deadline: float, max_steps: int, pairs: bool) -> int:
        """Local improvement until no step helps, ``deadline`` (time.perf_counter()) or ``max_steps``;
        ``pairs`` adds the (slower) two-table moves."""
        steps = 0
        while steps < max_steps and time.perf_counter() < deadline:
            top = np.flatnonzero(self.load >= self.load.max() * (1 - 1e-9))[:_TOP_RANKS].tolist()
            if not (any(self._reseat(r) or self._swap(r) for r in top)
                    or (pairs and any(self._reseat_pair(r, deadline) for r in top))):
                break
            steps += 1
        return steps

    def _best_option(self, t: int, best_score: tuple[float, float]) -> tuple[tuple | None, tuple[float, float]]:
        """Best (option, ranks) for table t (not placed) that beats ``best_score`` = (max, sumsq), if any."""
        best = None
        for o, opt in enumerate(self.options[t]):
            ranks = self.place(opt)
            if ranks is None:
                continue
            load = self.loads_with(opt, ranks)
            s = (float(load.max()), float(np.square(load).sum()))
            if _better(s, best_score):
                best, best_score = (o, ranks), s
        return best, best_score

    def _reseat(self, r: int) -> bool:
        """Take a table off rank r and put it back with its best option; True if (max, sumsq) improved."""
        before = self.score()
        tables = sorted(self.on_rank[r], key=lambda t: -self._cost_on(t, r))
        for t in tables:
            old = self.remove(t)
            best, _ = self._best_option(t, before)
            self.add(t, *(best or old))
            if best is not None:
                return True
        return False

    def _reseat_pair(self, r: int, deadline: float) -> bool:
        """Take a table off rank r and a second one (from r or the least-loaded ranks), put both back with
        their best pair of options, either one first; True if (max, sumsq) improved."""
        before = self.score()
        light = np.argsort(self.load, kind="stable")[:_TOP_RANKS].tolist()
        partners = sorted(set(self.on_rank[r]).union(*(self.on_rank[q] for q in light)))
        for a in sorted(self.on_rank[r], key=lambda t: -self._cost_on(t, r)):
            for b in partners:
                if b == a:
                    continue
                if time.perf_counter() > deadline:
                    return False
                old = {a: self.remove(a), b: self.remove(b)}
                best, best_score = None, before
                for first, second in ((a, b), (b, a)):
                    for o, opt in enumerate(self.options[first]):
                        ranks = self.place(opt)
                        if ranks is None or float((self.load[ranks] + opt.cost).max()) > best_score[0]:
                            continue  # the second table can only add load
                        self.add(first, o, ranks)
                        pick, best_score = self._best_option(second, best_score)
                        if pick is not None:
                            best = {first: (o, ranks), second: pick}
                        self.remove(first)
                for t, choice in (best or old).items():
                    self.add(t, *choice)
                if best is not None:
                    return True
        return False

    def _cost_on(self, t: int, r: int) -> float:
        o, ranks = self.placed(t)
        return float(self.options[t][o].cost[ranks == r].sum())

    def _swap(self, r: int) -> bool:
        """Swap a shard on rank r with a cheaper shard of another table elsewhere, lowering both below
        r's load. True if a swap was made."""
        parts: list[tuple[np.ndarray, ...]] = []  # per table: table, shard index, rank, cost, memory, is trw
        for t in range(len(self.choice)):
            o, ranks = self.placed(t)
            opt = self.options[t][o]
            if opt.sharding != "data_parallel":
                k = opt.k
                parts.append((np.full(k, t), np.arange(k), ranks, opt.cost, opt.mem.T,
                              np.full(k, opt.sharding == "table_row_wise")))
        if not parts:
            return False
        s_table, s_index, s_rank, s_cost, s_mem_t, s_trw = (np.concatenate(col) for col in zip(*parts, strict=True))
        s_mem = s_mem_t.T  # [len(BUDGETS), shards]
        table_on_r = np.isin(s_table, list(self.on_rank[r]))
        best, best_peak = None, self.load[r] * (1 - 1e-9)
        for a in np.flatnonzero(s_rank == r):
            t, c1, m1 = s_table[a], s_cost[a], s_mem[:, a:a + 1]
            peak = np.maximum(self.load[r] - c1 + s_cost, self.load[s_rank] - s_cost + c1)
            same_node = self.node[s_rank] == self.node[r]
            ok = ((s_rank != r) & ~table_on_r & (s_cost < c1) & (peak < best_peak)
                  & (self.free[:, r:r + 1] + m1 - s_mem >= 0).all(axis=0)
                  & (self.free[:, s_rank] + s_mem - m1 >= 0).all(axis=0)
                  & ~np.isin(s_rank, self.choice[t][1]) & (same_node | ~(s_trw | s_trw[a])))
            if ok.any():
                b = np.flatnonzero(ok)[np.argmin(peak[ok])]
                best, best_peak = (a, b), peak[b]
        if best is None:
            return False
        a, b = best
        for x, new_rank in ((a, s_rank[b]), (b, r)):
            t, j = s_table[x], s_index[x]
            o, ranks = self.remove(t)
            ranks = ranks.copy()
            ranks[j] = new_rank
            self.add(t, o, ranks)
        return True


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """(max, sumsq) a clearly below b: a lower max, or an equal max and a lower sum of squares."""
    if a[0] < b[0] * (1 - 1e-9) - _EPS:
        return True
    return a[0] <= b[0] * (1 + 1e-12) + _EPS and a[1] < b[1] * (1 - 1e-9) - _EPS


def _allowed_types(tables: Sequence[TableSpec], constraints: Mapping[str, str | Sequence[str]] | None,
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
) -> ShardingPlan:
    """Choose a sharding type and ranks for every table (see the module docstring).

    ``constraints`` maps a table name to the sharding type (or list of types) it may use; ``force`` applies
    one type to every table without a constraint. ``time_limit_s`` bounds the search after the first
    start; ``restarts`` is the number of shuffled starts tried within it. ``tiers``: where the tables do not
    fit in device memory, keep shards in host memory or on SSD behind device caches, within each rank's share
    of ``topology.ddr_bytes`` and ``topology.ssd_bytes`` (``tiers.py``); a plan that fits in device memory is
    the device-only plan whatever ``tiers`` says (caches only add miss traffic).
    """
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise PlanError(f"table names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    model = CostModel(topology, batch_size_per_rank, config)
    allowed = _allowed_types(tables, constraints, force)
    splits = []
    for t, kinds in zip(tables, allowed, strict=True):
        splits.append(candidate_splits(t, topology, kinds, min_column_dim))
        if not splits[-1]:
            raise PlanError(f"table {t.name!r} ({t.rows:,} rows x {t.dim}): no valid {' or '.join(kinds)} "
                            f"sharding on {topology.world_size} ranks")
    try:
        return _plan_device(tables, splits, model, time_limit_s, restarts)
    except _NoRoom:
        if not tiers:
            raise
    return _plan_tiered(tables, splits, model, time_limit_s, restarts)


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

    best = _search(options, topology, time_limit_s, restarts)
    if best is None:
        raise _NoRoom(f"could not fit the tables in HBM: they need at least "
                      f"{format_bytes(least_total / W, decimal=True)} per rank on average, each of the {W} ranks "
                      f"has {format_bytes(cap, decimal=True)}; allow more sharding types or add memory")
    return _plan_of(tables, options, best, model)


def _plan_of(tables: Sequence[TableSpec], options: list[list[Option]], best: _Search, model: CostModel,
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
        best = _search(options, topology, left, restarts, tiers=True)
        if best is not None:
            return _plan_of(tables, options, best, model, grow=True)
        fraction /= 4
    raise PlanError(f"could not fit the tables in device memory, host memory and SSD: they need at least "
                    f"{format_bytes(total / W, decimal=True)} per rank on average; each rank has {have}, and a "
                    f"shard's device cache holds at least twice the rows it looks up per step (raise --hbm or "
                    f"lower the batch size)")


def _search(options: list[list[Option]], topology: Topology, time_limit_s: float, restarts: int,
            tiers: bool = False) -> _Search | None:
    """Greedy starts, each improved locally; the best, or None if nothing fits (module docstring, 3-5)."""
    W, n = topology.world_size, len(options)
    cheapest = np.array([min(o.total for o in opts) for opts in options])
    footprint = np.array([min(int(o.hbm.sum()) for o in opts) for opts in options])
    start = time.perf_counter()
    deadline = start + time_limit_s
    by_cost = np.argsort(-cheapest, kind="stable").tolist()
    starts: list[tuple[list[int], int | None]] = [(by_cost, m) for m in _granularities(W)]
    starts.append((np.argsort(-footprint, kind="stable").tolist(), None))
    rng = np.random.default_rng(0)
    caps = _granularities(W) + [None]
    for _ in range(restarts):  # shuffled cost order (noise on the sort key), random shard-count cap
        noisy = cheapest * rng.lognormal(0.0, 0.5, n)
        starts.append((np.argsort(-noisy, kind="stable").tolist(), caps[rng.integers(len(caps))]))
    bound = max([cheapest.sum() / W] + [min(float(o.cost.max()) for o in opts) for opts in options])
    found: list[_Search] = []
    best, stale = None, 0  # stale: starts since the best plan last improved
    for order, max_shards in starts:
        if best is not None and (time.perf_counter() >= start + time_limit_s / 2 or stale >= _PATIENCE
                                 or best.score()[0] <= bound * (1 + 1e-9)):
            break
        search = _Search(options, topology, tiers)
        if search.greedy(order, cheapest, max_shards):
            search.improve(deadline, 50 * n + 1000, pairs=False)
            found.append(search)
            stale = 0 if best is None or _better(search.score(), best.score()) else stale + 1
            best = search if stale == 0 else best
    if not found and (spread := _spread(options, topology, tiers)) is not None:
        found.append(spread)
    # Two-table moves on the few best distinct plans, then the best wins.
    found.sort(key=lambda f: f.score())
    finalists = [f for i, f in enumerate(found) if i == 0 or f.score() != found[i - 1].score()][:_FINALISTS]
    for i, f in enumerate(finalists):
        now = time.perf_counter()
        f.improve(now + (deadline - now) / (len(finalists) - i), 50 * n + 1000, pairs=True)
    return min(finalists, key=lambda f: f.score(), default=None)


def _granularities(world_size: int) -> list[int]:
    """Shard-count caps of the greedy starts: 1, then powers of 2 (powers of 4 past 8 ranks), then W."""
    step = 2 if world_size <= 8 else 4
    caps, k = [1], step
    while k < world_size:
        caps.append(k)
        k *= step
    return caps + [world_size]


def _smallest(opts: list[Option]) -> int:
    """The option of least peak memory (then least total cost)."""
    return min(range(len(opts)), key=lambda o: (opts[o].max_hbm, opts[o].total))


def _spread(options: list[list[Option]], topology: Topology, tiers: bool = False) -> _Search | None:
    """Every table with its smallest-footprint option, largest first; None if even that does not fit."""
    search = _Search(options, topology, tiers)
    picks = [_smallest(opts) for opts in options]
    for t in sorted(range(len(options)), key=lambda t: -options[t][picks[t]].hbm.sum()):
        ranks = search.place(options[t][picks[t]])
        if ranks is None:
            return None
        search.add(t, picks[t], ranks)
    return search
