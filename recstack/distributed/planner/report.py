"""A readable summary of a plan: per-table rows (all of them, or the costliest ``top`` plus one line per
sharding type), then per-rank load (every rank up to 16, else one line per node and the slowest ranks).
A plan with storage tiers also shows each table's tier, cache size and predicted hit rate, one line per tier
(shards, rows cached, hit rates) and each rank's device memory, host memory and SSD."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from recstack.distributed.planner.cost import TERMS, CostModel, Estimate
from recstack.distributed.planner.inputs import TableSpec
from recstack.distributed.planner.plan import ShardingPlan
from recstack.distributed.planner.storage import TIERS
from recstack.distributed.planner.table_sharding import TableSharding
from recstack.units import format_bytes

T = TypeVar("T")


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def format_count(n: float) -> str:
    """12_030_000_000_000 -> '12.0T'; 540_200_000 -> '540M'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def format_ranks(ranks: Sequence[int], world_size: int) -> str:
    """[0, 1, 2, 3, 9] -> '0-3,9'; every rank in order -> 'all'. Order is kept (it is the shard order)."""
    if list(ranks) == list(range(world_size)) and world_size > 1:
        return "all"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], right: set[int]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = [(str.rjust if i in right else str.ljust) for i in range(len(header))]
    return ["  ".join(f(str(x), w) for f, x, w in zip(fmt, row, widths, strict=True)).rstrip()
            for row in [header, *rows]]


def _known(x: T | None) -> T:
    """A field that a hand-written plan may leave out and that every plan the planner makes has."""
    assert x is not None, "the report needs a plan with the planner's estimates"
    return x


def render_plan(plan: ShardingPlan, tables: Sequence[TableSpec], model: CostModel, top: int = 30) -> str:
    """The text report. ``tables`` and ``model`` give each table's shard costs (plans store totals only)."""
    topo, W = plan.topology, plan.world_size
    specs = {t.name: t for t in tables}
    cost = plan.cost
    params = sum(_known(t.rows) * _known(t.dim) for t in plan.tables)
    lines = [
        f"{len(plan.tables)} tables, {format_count(params)} parameters on {W} ranks; batch "
        f"{plan.batch_size_per_rank} per rank ({_known(plan.batch_size_per_rank) * W} global)",
        f"topology: {topo.describe()}",
        "",
    ]
    tiered = any(e.storage for e in plan.tables)
    per_table = []  # (cost on its busiest rank, entry)
    estimates: dict[str, Estimate] = {}
    for e in plan.tables:
        estimates[e.name] = est = model.estimate(specs[e.name], e.sharding, len(e.ranks), e.shard_storage())
        per_table.append((float(est.cost.max()), e))
    shown = per_table if len(per_table) <= top else sorted(per_table, key=lambda x: -x[0])[:top]
    rows = [(e.name, f"{e.rows:,}", e.dim, e.sharding, format_ranks(e.ranks, W),
             format_bytes(max(_known(e.memory_bytes_per_rank).values()), decimal=True), format_seconds(c))
            + (_storage_cells(e, estimates[e.name]) if tiered else ())
            for c, e in shown]
    if len(shown) < len(per_table):
        lines.append(f"the {len(shown)} costliest of {len(per_table)} tables:")
    header = ("table", "rows", "dim", "sharding", "ranks", "memory/rank", "cost/rank")
    lines += _table(header + (("tier", "cache rows/shard", "hit rate") if tiered else ()), rows,
                    {1, 2, 5, 6, 8, 9})
    lines.append("")
    if tiered:
        lines += _tier_summary(plan.tables, estimates) + [""]
    by_type: dict[str, list] = {}
    for c, e in per_table:
        by_type.setdefault(e.sharding, []).append((c, e))
    kinds = [(kind, len(group), format_count(sum(_known(e.rows) * _known(e.dim) for _, e in group)),
              format_bytes(sum(sum(_known(e.memory_bytes_per_rank).values()) for _, e in group), decimal=True),
              f"{Counter(len(e.ranks) for _, e in group).most_common(1)[0][0]}")
             for kind, group in sorted(by_type.items())]
    lines += _table(("sharding", "tables", "parameters", "memory (all ranks)", "typical #ranks"), kinds, {1, 2, 3, 4})
    lines.append("")

    load = np.array(cost["per_rank"])
    hbm = np.array(cost["hbm_bytes_per_rank"])
    comm = np.array(cost["comm_per_rank"])
    host = np.array(cost.get("host_bytes_per_rank", [0] * W))
    ssd = np.array(cost.get("ssd_bytes_per_rank", [0] * W))
    miss = np.array(cost.get("breakdown", {}).get("cache_miss", [0.0] * W))
    budgets = topo.budgets()
    shards = Counter(r for e in plan.tables for r in e.ranks)
    if W <= 16:
        ranks = list(range(W))
        lines.append("per rank:")
    else:
        node_rows = []
        for n in range(topo.nodes):
            sl = slice(n * topo.devices_per_node, (n + 1) * topo.devices_per_node)
            node_rows.append((n, format_seconds(load[sl].min()), format_seconds(load[sl].mean()),
                              format_seconds(load[sl].max()), format_bytes(hbm[sl].max(), decimal=True),
                              f"{100 * hbm[sl].max() / topo.hbm_bytes:.0f}%")
                             + ((format_bytes(host[sl].max(), decimal=True), format_bytes(ssd[sl].max(), decimal=True))
                                if tiered else ()))
        lines.append("per node:")
        lines += _table(("node", "min cost", "mean cost", "max cost", "max memory", "of HBM")
                        + (("max host", "max SSD") if tiered else ()), node_rows, {1, 2, 3, 4, 5, 6, 7})
        ranks = np.argsort(-load, kind="stable")[:5].tolist()
        lines += ["", "slowest ranks:"]
    if not tiered:
        rank_rows = [(r, topo.node_of(r), shards[r], format_bytes(hbm[r], decimal=True),
                      f"{100 * hbm[r] / topo.hbm_bytes:.0f}%", format_seconds(load[r] - comm[r]),
                      format_seconds(comm[r]), format_seconds(load[r])) for r in ranks]
        lines += _table(("rank", "node", "shards", "memory", "of HBM", "compute", "comm", "cost"), rank_rows,
                        {0, 1, 2, 3, 4, 5, 6, 7})
    else:
        def of(used: float, limit: int | None) -> str:
            return f"{format_bytes(used, decimal=True)} ({100 * used / limit:.0f}%)" if limit else \
                format_bytes(used, decimal=True)

        tier_rows = [(r, topo.node_of(r), shards[r], of(hbm[r], budgets.device), of(host[r], budgets.host),
                      of(ssd[r], budgets.ssd), format_seconds(load[r] - comm[r] - miss[r]), format_seconds(miss[r]),
                      format_seconds(comm[r]), format_seconds(load[r])) for r in ranks]
        lines += _table(("rank", "node", "shards", "device", "host", "SSD", "compute", "cache misses", "comm",
                         "cost"), tier_rows, set(range(10)))
        dev, hst, sd = (format_bytes(b or 0, decimal=True) for b in (budgets.device, budgets.host, budgets.ssd))
        pcie, ssd_bw = (format_bytes(b, decimal=True) for b in (topo.pcie_bw, topo.ssd_bw))
        lines.append(f"budgets per rank: device {dev}, host {hst}, SSD {sd} (host memory and SSD per host / "
                     f"{topo.devices_per_node} ranks); assumed PCIe {pcie}/s, SSD {ssd_bw}/s")
    lines += ["", f"predicted step cost: max {format_seconds(cost['max'])} (rank {int(load.argmax())}), "
                  f"mean {format_seconds(cost['mean'])}, imbalance {cost['imbalance']:.3f} (max / mean)"]
    return "\n".join(lines)


def _storage_cells(e: TableSharding, est: Estimate) -> tuple[str, str, str]:
    """(tier, cache rows per shard, hit rate) of one table: its shards' tiers with counts where they differ,
    the range of cache sizes and of predicted hit rates (per distinct row per step) of its cached shards."""
    tiers = Counter(st.tier if st is not None else "device" for st in e.shard_storage())
    tier = next(iter(tiers)) if len(tiers) == 1 else ", ".join(f"{t} x{n}" for t, n in sorted(tiers.items()))
    caches = [st.cache_rows for st in e.storage.values()]
    if not caches:
        return tier, "-", "-"
    hits = est.hit_rate[~np.isnan(est.hit_rate)] if est.hit_rate is not None else np.zeros(0)

    def span(lo: str, hi: str) -> str:
        return lo if lo == hi else f"{lo}-{hi}"

    return (tier, span(format_count(min(caches)), format_count(max(caches))),
            span(f"{hits.min():.3f}", f"{hits.max():.3f}"))


def _tier_summary(entries: Sequence[TableSharding], estimates: dict[str, Estimate]) -> list[str]:
    """One line per tier: shards, rows cached, the shards' predicted hit rates and miss cost."""
    rows = []
    miss_term = TERMS.index("cache_miss")
    for tier in TIERS:
        shards = cached = 0
        rates: list[float] = []
        worst = 0.0
        for e in entries:
            est = estimates[e.name]
            for j, st in enumerate(e.shard_storage()):
                if (st.tier if st is not None else "device") != tier:
                    continue
                shards += 1
                if st is not None and est.hit_rate is not None:
                    cached += st.cache_rows
                    rates.append(float(est.hit_rate[j]))
                    worst = max(worst, float(est.terms[j, miss_term]))
        if not shards:
            continue
        spread = f"{min(rates):.3f} / {np.mean(rates):.3f} / {max(rates):.3f}" if rates else "-"
        rows.append((tier, shards, format_count(cached) if rates else "-", spread,
                     format_seconds(worst) if rates else "-"))
    return _table(("tier", "shards", "rows cached", "hit rate min / mean / max", "max miss cost/shard"), rows,
                  {1, 2, 3, 4})
