"""A readable summary of a plan: per-table rows (all of them, or the costliest ``top`` plus one line per
sharding type), then per-rank load (every rank up to 16, else one line per node and the slowest ranks)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from recstack.distributed.planner.cost import CostModel
from recstack.distributed.planner.types import ShardingPlan, TableSpec
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
    per_table = []  # (cost on its busiest rank, entry)
    for e in plan.tables:
        per_table.append((float(model.estimate(specs[e.name], e.sharding, len(e.ranks)).cost.max()), e))
    shown = per_table if len(per_table) <= top else sorted(per_table, key=lambda x: -x[0])[:top]
    rows = [(e.name, f"{e.rows:,}", e.dim, e.sharding, format_ranks(e.ranks, W),
             format_bytes(max(_known(e.memory_bytes_per_rank).values()), decimal=True), format_seconds(c))
            for c, e in shown]
    if len(shown) < len(per_table):
        lines.append(f"the {len(shown)} costliest of {len(per_table)} tables:")
    lines += _table(("table", "rows", "dim", "sharding", "ranks", "memory/rank", "cost/rank"), rows, {1, 2, 5, 6})
    lines.append("")
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
                              f"{100 * hbm[sl].max() / topo.hbm_bytes:.0f}%"))
        lines.append("per node:")
        lines += _table(("node", "min cost", "mean cost", "max cost", "max memory", "of HBM"), node_rows,
                        {1, 2, 3, 4, 5})
        ranks = np.argsort(-load, kind="stable")[:5].tolist()
        lines += ["", "slowest ranks:"]
    rank_rows = [(r, topo.node_of(r), shards[r], format_bytes(hbm[r], decimal=True),
                  f"{100 * hbm[r] / topo.hbm_bytes:.0f}%", format_seconds(load[r] - comm[r]),
                  format_seconds(comm[r]), format_seconds(load[r])) for r in ranks]
    lines += _table(("rank", "node", "shards", "memory", "of HBM", "compute", "comm", "cost"), rank_rows,
                    {0, 1, 2, 3, 4, 5, 6, 7})
    lines += ["", f"predicted step cost: max {format_seconds(cost['max'])} (rank {int(load.argmax())}), "
                  f"mean {format_seconds(cost['mean'])}, imbalance {cost['imbalance']:.3f} (max / mean)"]
    return "\n".join(lines)
