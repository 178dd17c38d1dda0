"""Dual-level adaptive error bound: per table class (by table size) and per iteration (a decaying multiplier).

    bound(table, iter) = class_bound(table) * m(iter)

Table level: tables with at least ``tight_min_rows`` rows get ``tight_bound`` (their rows are many and
mostly distinct, so errors reach many samples' features), those with at most ``loose_max_rows`` rows get
``loose_bound`` (a handful of rows, each seen in most batches), the rest ``base_bound``; ``table_bounds``
overrides single tables. Iteration level, t = min(iter / E, 1):

    step      m = c * max(1 - k (1 - 1/c) / 10, 1/c),  k = floor(10 * iter / E)   (Feng et al.)
    linear    m = c - (c - 1) t
    log       m = c - (c - 1) ln(1 + 9 t) / ln(10)      (falls fastest at the start)
    constant  m = c while iter < E, then 1
    off       m = 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recstack.compression.config import CompressionConfig

CLASSES = ("tight", "base", "loose")


def multiplier(schedule: str, iteration: int, c: float, stage: int) -> float:
    """m(iter) of one schedule (see the module docstring); 1 from iteration ``stage`` on."""
    if schedule == "off" or c == 1.0:
        return 1.0
    t = min(max(iteration, 0) / stage, 1.0)
    if schedule == "step":
        k = math.floor(10 * min(max(iteration, 0), stage) / stage)
        return c * max(1.0 - k * (1.0 - 1.0 / c) / 10.0, 1.0 / c)
    if schedule == "linear":
        return c - (c - 1.0) * t
    if schedule == "log":
        return c - (c - 1.0) * math.log1p(9.0 * t) / math.log(10.0)
    if schedule == "constant":
        return c if iteration < stage else 1.0
    raise ValueError(f"unknown bound schedule {schedule!r}")


@dataclass
class TableBound:
    name: str
    rows: int
    klass: str  # tight | base | loose | table (an explicit per-table bound)
    bound: float  # before the iteration multiplier


class DualLevelBound:
    """Bounds of a set of tables [(name, rows)] under a CompressionConfig; ``scale`` multiplies all of them
    (the backward direction uses ``backward_scale``)."""

    def __init__(self, cfg: CompressionConfig, tables: list[tuple[str, int]], scale: float = 1.0) -> None:
        self.cfg, self.scale = cfg, scale
        unknown = sorted(set(cfg.table_bounds) - {name for name, _ in tables})
        if unknown:
            raise ValueError(f"compression.table_bounds: no table named {', '.join(unknown)}")
        self.tables = [self._classify(name, rows) for name, rows in tables]

    def _classify(self, name: str, rows: int) -> TableBound:
        c = self.cfg
        if name in c.table_bounds:
            return TableBound(name, rows, "table", float(c.table_bounds[name]))
        if rows >= c.tight_min_rows:
            return TableBound(name, rows, "tight", c.tight_bound)
        if rows <= c.loose_max_rows:
            return TableBound(name, rows, "loose", c.loose_bound)
        return TableBound(name, rows, "base", c.base_bound)

    def multiplier(self, iteration: int) -> float:
        c = self.cfg
        return multiplier(c.schedule, iteration, c.schedule_c, c.schedule_stage)

    def bound(self, table: int, iteration: int) -> float:
        """The bound in force for table index ``table`` at ``iteration`` (0 = the first step)."""
        return self.tables[table].bound * self.multiplier(iteration) * self.scale

    def default_bound(self, iteration: int) -> float:
        """For chunks whose table is unknown: the base class bound."""
        return self.cfg.base_bound * self.multiplier(iteration) * self.scale

    def in_force(self, iteration: int) -> dict[str, float]:
        """Every distinct bound in force: per class, and per table for explicit overrides."""
        m = self.multiplier(iteration) * self.scale
        c = self.cfg
        out = {"tight": c.tight_bound * m, "base": c.base_bound * m, "loose": c.loose_bound * m}
        out.update({t.name: t.bound * m for t in self.tables if t.klass == "table"})
        return out

    def describe(self) -> list[dict[str, object]]:
        """Per table: name, rows, class and bound before the multiplier (for compression.json)."""
        return [{"table": t.name, "rows": t.rows, "class": t.klass, "bound": t.bound * self.scale}
                for t in self.tables]
