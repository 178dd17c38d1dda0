"""What the planner writes: the sharding plan (:class:`ShardingPlan`), its JSON form and its checks, and
:class:`PlanPlacements`, a plan file given to ``dist.plan`` checked against the model. One table's entry
is in ``table_sharding.py``, the planner's inputs (topology, table specs) in ``inputs.py``.

The plan is the contract with the distributed training code, serialised by :meth:`ShardingPlan.to_json` as::

    {"version": 1, "world_size": W, "topology": {...}, "batch_size_per_rank": B,
     "tables": [{"name": str, "rows": int, "dim": int, "sharding": str, "ranks": [int, ...],
                 "memory_bytes_per_rank": {"<rank>": int, ...},
                 "storage": {"<rank>": {"tier": "host-cached" | "ssd-cached", "cache_rows": int}, ...}}, ...],
     "cost": {"per_rank": [...], "max": float, "mean": float, "imbalance": float, ...}}

``ranks`` lists the rank of each shard in order: the column blocks of a ``column_wise`` table, the row blocks
of a ``row_wise`` / ``table_row_wise`` table (block = ceil(rows / k) rows, shard i = [i*block,
min((i+1)*block, rows))), every rank 0..W-1 for ``data_parallel`` and one rank for ``table_wise``. Tables
keep the input order. Sizes are bytes, bandwidths bytes per second, costs seconds per training step.
``memory_bytes_per_rank`` is device memory (a cached shard's cache). ``storage`` (optional, ``storage.py``)
names the shards kept in host memory or on SSD behind a device cache; absent, every shard is on the device.

A plan written by hand for ``dist.plan`` may leave out what the planner derives: ``version``, ``topology``
(default: the job's nodes and ranks per node), ``batch_size_per_rank``, ``cost`` and, per table, ``rows``,
``dim`` (taken from the model) and ``memory_bytes_per_rank``. Fields that are present are checked all the same
(:meth:`ShardingPlan.from_json` with ``estimates=False``, then :class:`PlanPlacements`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from recstack.distributed.planner.inputs import PlanError, TableSpec, Topology
from recstack.distributed.planner.storage import (
    OPTIMIZER_STATE_BYTES,
    ShardStorage,
    StorageError,
    TierBudgets,
    check_budgets,
    shard_bytes,
)
from recstack.distributed.planner.table_sharding import (
    TableSharding,
    check_one_node,
    is_int,
    require_field,
    validate_entry,
)
from recstack.distributed.sharding import shard_blocks
from recstack.units import format_bytes

PLAN_VERSION = 1


def parse_json(text: str, source: str, kind: type) -> Any:
    """JSON text whose top level must be a ``kind`` (dict or list); errors name ``source`` and the line."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{source}, line {e.lineno}, column {e.colno}: not valid JSON: {e.msg}") from e
    except RecursionError:  # nested thousands deep: the parser recurses once per level
        raise PlanError(f"{source}: not valid JSON: nested too deeply") from None
    if not isinstance(value, kind):
        raise PlanError(f"{source}, line 1: expected a JSON {'object' if kind is dict else 'list'}, "
                        f"got {type(value).__name__}")
    return value


@dataclass
class ShardingPlan:
    """Sharding type and placement of every table, with the predicted per-rank cost (see ``cost.py``)."""

    world_size: int
    topology: Topology
    batch_size_per_rank: int | None  # None: a hand-written plan that does not say
    tables: list[TableSharding]
    cost: dict[str, Any] = field(default_factory=dict)
    # False: a hand-written plan without a topology (the job's stands in; its memory sizes are only defaults)
    topology_given: bool = field(default=True, compare=False)

    def table(self, name: str) -> TableSharding:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"version": PLAN_VERSION, "world_size": self.world_size, "topology": self.topology.to_dict(),
                "batch_size_per_rank": self.batch_size_per_rank, "tables": [t.to_dict() for t in self.tables],
                "cost": self.cost}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str, source: str = "plan", estimates: bool = True,
                  topology: Topology | None = None) -> ShardingPlan:
        """Parse a plan; ``source`` (e.g. the file name) prefixes every error. Checks the shape only: call
        :meth:`validate` to check the sharding itself. ``estimates=False`` reads a hand-written plan: the
        fields the planner derives may be missing (see the module docstring); a missing ``topology`` is
        ``topology``."""
        d = parse_json(text, source, dict)
        known = {"version", "world_size", "topology", "batch_size_per_rank", "tables", "cost"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"{source}: unknown field(s) {unknown} (known: {sorted(known)})")
        version = require_field(d, "version", source) if estimates else d.get("version", PLAN_VERSION)
        if version != PLAN_VERSION:
            raise PlanError(f"{source}: field 'version' is {version!r}, this planner reads version {PLAN_VERSION}")
        tables = require_field(d, "tables", source)
        if not isinstance(tables, list):
            raise PlanError(f"{source}: field 'tables' must be a list")
        world_size = require_field(d, "world_size", source)
        if not is_int(world_size) or world_size <= 0:
            raise PlanError(f"{source}: field 'world_size' must be a positive integer, got {world_size!r}")
        given = estimates or "topology" in d or topology is None
        if given:
            topology = Topology.from_dict(require_field(d, "topology", source), f"{source}: topology")
        assert topology is not None
        return cls(
            world_size=world_size,
            topology=topology,
            batch_size_per_rank=require_field(d, "batch_size_per_rank", source) if estimates
            else d.get("batch_size_per_rank"),
            tables=[TableSharding.from_dict(t, f"{source}: plan table {i}", estimates) for i, t in enumerate(tables)],
            cost=d.get("cost", {}),
            topology_given=given,
        )

    def validate(self, world_size: int, tables: Sequence[TableSpec] | None = None, estimates: bool = True) -> None:
        """Raise :class:`PlanError` naming the table, the field and the problem if this plan cannot be executed
        on ``world_size`` ranks (and, given ``tables``, for exactly those tables; rows and dims the plan
        leaves out are theirs). ``estimates=False``: a hand-written plan, which may leave out
        ``batch_size_per_rank`` and ``memory_bytes_per_rank`` and whose memory use is not compared with an HBM
        size; without ``tables`` the checks that need a table's size are skipped where the plan does not give
        it."""
        if not is_int(world_size) or world_size <= 0:
            raise PlanError(f"world size must be a positive integer, got {world_size!r}")
        if self.world_size != world_size:
            raise PlanError(f"field 'world_size': plan is for world size {self.world_size}, running with "
                            f"{world_size}")
        if self.topology.world_size != world_size:
            raise PlanError(f"field 'topology': plan topology has {self.topology.nodes} x "
                            f"{self.topology.devices_per_node} = {self.topology.world_size} ranks, world size is "
                            f"{world_size}")
        if (estimates or self.batch_size_per_rank is not None) and (
                not is_int(self.batch_size_per_rank) or self.batch_size_per_rank <= 0):
            raise PlanError(f"field 'batch_size_per_rank' must be a positive integer, got "
                            f"{self.batch_size_per_rank!r}")
        names = [t.name for t in self.tables]
        dupes = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
        if dupes:
            raise PlanError(f"plan lists table(s) {dupes} more than once")
        specs = {t.name: t for t in tables} if tables is not None else {}
        if tables is not None:
            self.check_names(list(specs))
        used = [0] * world_size
        for i, t in enumerate(self.tables):
            where = f"plan table {i} ({t.name!r})"
            rows, dim = t.rows, t.dim
            spec = specs.get(t.name)
            if spec is not None:
                for name, value, real in (("rows", rows, spec.rows), ("dim", dim, spec.dim)):
                    if (value is not None or estimates) and value != real:
                        raise PlanError(f"{where}: field '{name}' is {value!r} in the plan, the table is "
                                        f"{spec.rows} x {spec.dim}")
                rows, dim = spec.rows, spec.dim
            validate_entry(t, where, self.topology, rows, dim, estimates)
            for r, b in (t.memory_bytes_per_rank or {}).items():
                used[r] += b
        for r, b in enumerate(used):
            # A hand-written plan's topology may be the job's own, whose HBM size is only a default.
            if estimates and b > self.topology.hbm_bytes:
                raise PlanError(f"rank {r} holds {format_bytes(b, decimal=True)} ({b:,} bytes) of tables, "
                                f"HBM per rank is {format_bytes(self.topology.hbm_bytes, decimal=True)}")
        # Tiered shards are held to the plan's own budgets where it states them (plans without storage are
        # checked as they always were).
        if self.topology_given and any(t.storage for t in self.tables):
            self.check_tiers(self.topology.budgets(), tables, self.topology.explain_budgets())

    def element_bytes(self) -> tuple[int, int]:
        """(weight bytes, optimizer state bytes per row) the plan was made for: its cost config, else fp32
        weights and row-wise Adagrad."""
        config = self.cost.get("config", {}) if isinstance(self.cost, dict) else {}
        w = config.get("weight_bytes", 4)
        state = OPTIMIZER_STATE_BYTES.get(config.get("optimizer", "rowwise_adagrad"), 4)
        return (w if is_int(w) and w > 0 else 4), state

    def tier_usage(self, tables: Sequence[TableSpec] | None = None,
                   state_bytes: int | None = None) -> list[tuple[str, int, str, int]]:
        """(table, rank, budget, bytes) of every shard, in plan order (``storage.shard_bytes``); tables whose
        size neither the plan nor ``tables`` gives are left out. ``state_bytes``: optimizer state per row (the
        job's optimizer; default :meth:`element_bytes`'). Call after :meth:`validate`'s entry checks."""
        specs = {t.name: t for t in tables} if tables is not None else {}
        w, state = self.element_bytes()
        state = state if state_bytes is None else state_bytes
        out = []
        for i, t in enumerate(self.tables):
            spec = specs.get(t.name)
            rows, dim = (spec.rows, spec.dim) if spec is not None else (t.rows, t.dim)
            if rows is None or dim is None:
                continue
            where = f"plan table {i} ({t.name!r})"
            rects = shard_blocks(t.sharding, rows, dim, len(t.ranks))
            for r, (r0, r1, c0, c1), st in zip(t.ranks, rects, t.shard_storage(), strict=True):
                used = shard_bytes(r1 - r0, c1 - c0, st, w, state, replica=t.sharding == "data_parallel")
                out += [(where, r, b, n) for b, n in used.items() if n]
        return out

    def check_tiers(self, budgets: TierBudgets, tables: Sequence[TableSpec] | None = None,
                    explain: dict[str, str] | None = None, state_bytes: int | None = None) -> None:
        """Raise :class:`PlanError` naming the table, the rank and the budget where the shards on a rank
        need more device memory, host memory or SSD than ``budgets`` give each rank."""
        try:
            check_budgets(self.tier_usage(tables, state_bytes), budgets, self.world_size, explain)
        except StorageError as e:
            raise PlanError(f"field 'storage': {e}") from e

    def check_names(self, names: Sequence[str]) -> None:
        """The plan has one entry for each of ``names`` and none for other tables."""
        known = set(names)
        for i, t in enumerate(self.tables):
            if t.name not in known:
                raise PlanError(f"plan table {i} ({t.name!r}): unknown table (known: {sorted(known)})")
        planned = {t.name for t in self.tables}
        missing = [n for n in names if n not in planned]
        if missing:
            raise PlanError(f"plan has no entry for table(s) {missing}")


@contextmanager
def _prefixed(source: str) -> Iterator[None]:
    """Re-raise a :class:`PlanError` with ``source`` (the plan file) in front."""
    try:
        yield
    except PlanError as e:
        raise PlanError(f"{source}: {e}") from e


class PlanPlacements(list):
    """``(sharding, ranks)`` per table, in the model's table order, from a plan file (``dist.plan``),
    validated as far as the table names allow. The sharded collection calls :meth:`check` with the tables'
    sizes before its first collective, so every rank rejects a plan that does not fit the model alike.
    ``storage[i]``: the storage of each shard of table i, in shard order (None: on the device)."""

    def __init__(self, plan: ShardingPlan, names: Sequence[str], world_size: int, source: str,
                 job: Topology | None = None) -> None:
        """``job``: the running job's nodes and ranks per node, where the plan was made for another split."""
        self.plan, self.world_size, self.source = plan, world_size, source
        with _prefixed(source):
            plan.validate(world_size, estimates=False)
            plan.check_names(names)
            if job is not None and job.devices_per_node != plan.topology.devices_per_node:
                for i, t in enumerate(plan.tables):
                    check_one_node(t, f"plan table {i} ({t.name!r})", job, plan.topology)
        super().__init__((plan.table(n).sharding, list(plan.table(n).ranks)) for n in names)
        self.storage: list[list[ShardStorage | None]] = [plan.table(n).shard_storage() for n in names]

    def check(self, tables: Sequence[TableSpec], budgets: TierBudgets | None = None,
              state_bytes: int | None = None) -> None:
        """Raise :class:`PlanError` (naming the plan file, the table and the field) unless the plan fits
        tables of these sizes: rows and dim where the plan gives them, shard counts that split them, caches
        below their shards' rows and, with ``budgets`` (each rank's, e.g. from ``[memory]``), every rank's
        shards within its device, host and SSD budgets (``tables`` sizes them: the optimizer state is taken
        from the plan's cost config, else row-wise Adagrad, unless ``state_bytes`` gives the job's per row)."""
        with _prefixed(self.source):
            self.plan.validate(self.world_size, tables, estimates=False)
            if budgets is not None:
                self.plan.check_tiers(budgets, tables, state_bytes=state_bytes)
