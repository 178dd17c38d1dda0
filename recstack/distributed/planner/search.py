"""The placement search over the tables' options (steps 3-5 of ``partition.py``'s module docstring):
:class:`SearchState`, the per-rank load and free memory of a placement with its greedy placement and local
improvement moves, and :func:`run_search`, the greedy starts, each improved, of which the best wins.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from recstack.distributed.planner.inputs import Topology
from recstack.distributed.planner.options import Option

_EPS = 1e-12
_TOP_RANKS = 8  # tied slowest ranks tried per improvement step
_FINALISTS = 3  # best distinct plans that get the two-table moves
_PATIENCE = 8  # greedy starts without a better plan before the search moves on


class SearchState:
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


def run_search(options: list[list[Option]], topology: Topology, time_limit_s: float, restarts: int,
               tiers: bool = False) -> SearchState | None:
    """Greedy starts, each improved locally; the best, or None if nothing fits (``partition.py``'s module
    docstring, 3-5)."""
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
    found: list[SearchState] = []
    best, stale = None, 0  # stale: starts since the best plan last improved
    for order, max_shards in starts:
        if best is not None and (time.perf_counter() >= start + time_limit_s / 2 or stale >= _PATIENCE
                                 or best.score()[0] <= bound * (1 + 1e-9)):
            break
        search = SearchState(options, topology, tiers)
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


def _spread(options: list[list[Option]], topology: Topology, tiers: bool = False) -> SearchState | None:
    """Every table with its smallest-footprint option, largest first; None if even that does not fit."""
    search = SearchState(options, topology, tiers)
    picks = [_smallest(opts) for opts in options]
    for t in sorted(range(len(options)), key=lambda t: -options[t][picks[t]].hbm.sum()):
        ranks = search.place(options[t][picks[t]])
        if ranks is None:
            return None
        search.add(t, picks[t], ranks)
    return search
