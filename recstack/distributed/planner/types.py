"""What the planner reads and writes: the cluster topology, the table specs, and the sharding plan.

The plan is the contract with the distributed training code, serialised by :meth:`ShardingPlan.to_json` as::

    {"version": 1, "world_size": W, "topology": {...}, "batch_size_per_rank": B,
     "tables": [{"name": str, "rows": int, "dim": int, "sharding": str, "ranks": [int, ...],
                 "memory_bytes_per_rank": {"<rank>": int, ...}}, ...],
     "cost": {"per_rank": [...], "max": float, "mean": float, "imbalance": float, ...}}

``ranks`` lists the rank of each shard in order: the column blocks of a ``column_wise`` table, the row blocks
of a ``row_wise`` / ``table_row_wise`` table (block = ceil(rows / k) rows, shard i = [i*block,
min((i+1)*block, rows))), every rank 0..W-1 for ``data_parallel`` and one rank for ``table_wise``. Tables
keep the input order. Sizes are bytes, bandwidths bytes per second, costs seconds per training step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from recstack.distributed.sharding import SHARDING_TYPES, row_blocks

PLAN_VERSION = 1


class PlanError(ValueError):
    """A request the planner cannot satisfy, or a plan that does not describe a valid sharding."""


def format_bytes(n: float) -> str:
    """Decimal units, as device memory is sold: 80e9 -> '80.0 GB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Topology:
    """``nodes`` hosts of ``devices_per_node`` devices; rank r lives on node r // devices_per_node.

    Defaults are the TorchRec planner's (HBM 32 GB, DDR 128 GB, 600 GB/s inside a node, 12.5 GB/s across
    nodes); ``hbm_bw`` is the device memory bandwidth used for lookups and updates (900 GB/s: V100 data
    sheet, the device class those memory defaults describe). ``inter_bw`` is each device's share of the
    scale-out network (ZionEX gives every GPU its own NIC). ``ddr_bytes`` is per host; no storage lives in
    host memory yet (a later tiered-storage feature puts an HBM cache over it), but plans record it.
    """

    nodes: int = 1
    devices_per_node: int = 8
    hbm_bytes: int = 32 * 10**9
    ddr_bytes: int = 128 * 10**9
    intra_bw: float = 600e9
    inter_bw: float = 12.5e9
    hbm_bw: float = 900e9

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise PlanError(f"topology: {f.name} must be a positive number, got {value!r}")
        for name in ("nodes", "devices_per_node", "hbm_bytes", "ddr_bytes"):
            if int(getattr(self, name)) != getattr(self, name):
                raise PlanError(f"topology: {name} must be an integer, got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def describe(self) -> str:
        return (f"{self.nodes} node(s) x {self.devices_per_node} devices, HBM {format_bytes(self.hbm_bytes)}, "
                f"DDR {format_bytes(self.ddr_bytes)}/host, links {format_bytes(self.intra_bw)}/s intra, "
                f"{format_bytes(self.inter_bw)}/s inter, memory {format_bytes(self.hbm_bw)}/s")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "topology") -> Topology:
        if not isinstance(d, dict):
            raise PlanError(f"{where}: expected an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"{where}: unknown field(s) {unknown} (known: {sorted(known)})")
        return cls(**d)


@dataclass(frozen=True)
class TableSpec:
    """One embedding table. ``pooling`` is the mean number of ids per sample (1.0 for one-hot features).

    ``access_counts`` (optional) is a histogram of lookups over equal row ranges: entry j counts the ids
    that fall in rows [j*rows/n, (j+1)*rows/n). It tells the cost model how lookups split between row
    blocks and how many distinct rows a batch touches; without it ids are taken as uniform over the rows.
    """

    name: str
    rows: int
    dim: int
    pooling: float = 1.0
    access_counts: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        where = f"table {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"table name must be a non-empty string, got {self.name!r}")
        for name in ("rows", "dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PlanError(f"{where}: field '{name}' must be a positive integer, got {value!r}")
        if isinstance(self.pooling, bool) or not isinstance(self.pooling, int | float) or not self.pooling > 0:
            raise PlanError(f"{where}: field 'pooling' must be a positive number, got {self.pooling!r}")
        if self.access_counts is not None:
            counts = tuple(self.access_counts)
            if not counts or any(isinstance(c, bool) or not isinstance(c, int | float) or not c >= 0
                                 for c in counts) or not sum(counts) > 0:
                raise PlanError(f"{where}: field 'access_counts' must be a non-empty list of non-negative "
                                f"numbers with a positive sum")
            object.__setattr__(self, "access_counts", counts)


@dataclass
class TableSharding:
    """The plan for one table: sharding type, rank of each shard in order, bytes held on each rank."""

    name: str
    rows: int
    dim: int
    sharding: str
    ranks: list[int]
    memory_bytes_per_rank: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rows": self.rows, "dim": self.dim, "sharding": self.sharding,
                "ranks": list(self.ranks),
                "memory_bytes_per_rank": {str(r): int(b) for r, b in self.memory_bytes_per_rank.items()}}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> TableSharding:
        if not isinstance(d, dict):
            raise PlanError(f"{where}: expected an object, got {type(d).__name__}")
        values = {k: _field(d, k, where) for k in ("name", "rows", "dim", "sharding", "ranks")}
        memory = _field(d, "memory_bytes_per_rank", where)
        if not isinstance(values["ranks"], list) or not isinstance(memory, dict):
            raise PlanError(f"{where}: 'ranks' must be a list and 'memory_bytes_per_rank' an object")
        try:
            mem = {int(r): b for r, b in memory.items()}
        except ValueError as e:
            raise PlanError(f"{where}: field 'memory_bytes_per_rank' has a key that is not a rank: {e}") from e
        return cls(values["name"], values["rows"], values["dim"], values["sharding"], values["ranks"], mem)


def parse_json(text: str, source: str, kind: type) -> Any:
    """JSON text whose top level must be a ``kind`` (dict or list); errors name ``source`` and the line."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{source}, line {e.lineno}, column {e.colno}: not valid JSON: {e.msg}") from e
    if not isinstance(value, kind):
        raise PlanError(f"{source}, line 1: expected a JSON {'object' if kind is dict else 'list'}, "
                        f"got {type(value).__name__}")
    return value


def _field(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise PlanError(f"{where}: missing field '{key}'")
    return d[key]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class ShardingPlan:
    """Sharding type and placement of every table, with the predicted per-rank cost (see ``cost.py``)."""

    world_size: int
    topology: Topology
    batch_size_per_rank: int
    tables: list[TableSharding]
    cost: dict[str, Any] = field(default_factory=dict)

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
    def from_json(cls, text: str, source: str = "plan") -> ShardingPlan:
        """Parse a plan; ``source`` (e.g. the file name) prefixes every error. Checks the shape only: call
        :meth:`validate` to check the sharding itself."""
        d = parse_json(text, source, dict)
        version = _field(d, "version", source)
        if version != PLAN_VERSION:
            raise PlanError(f"{source}: field 'version' is {version!r}, this planner reads version {PLAN_VERSION}")
        tables = _field(d, "tables", source)
        if not isinstance(tables, list):
            raise PlanError(f"{source}: field 'tables' must be a list")
        return cls(
            world_size=_field(d, "world_size", source),
            topology=Topology.from_dict(_field(d, "topology", source), f"{source}: topology"),
            batch_size_per_rank=_field(d, "batch_size_per_rank", source),
            tables=[TableSharding.from_dict(t, f"{source}: tables[{i}]") for i, t in enumerate(tables)],
            cost=d.get("cost", {}),
        )

    def validate(self, world_size: int, tables: Sequence[TableSpec] | None = None) -> None:
        """Raise :class:`PlanError` naming the table and the problem if this plan cannot be executed on
        ``world_size`` ranks (and, given ``tables``, for exactly those tables)."""
        if not _is_int(world_size) or world_size <= 0:
            raise PlanError(f"world size must be a positive integer, got {world_size!r}")
        if self.world_size != world_size:
            raise PlanError(f"plan is for world size {self.world_size}, running with {world_size}")
        if self.topology.world_size != world_size:
            raise PlanError(f"plan topology has {self.topology.nodes} x {self.topology.devices_per_node} = "
                            f"{self.topology.world_size} ranks, world size is {world_size}")
        if not _is_int(self.batch_size_per_rank) or self.batch_size_per_rank <= 0:
            raise PlanError(f"batch_size_per_rank must be a positive integer, got {self.batch_size_per_rank!r}")
        names = [t.name for t in self.tables]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise PlanError(f"plan lists table(s) {dupes} more than once")
        if tables is not None:
            specs = {t.name: t for t in tables}
            for i, t in enumerate(self.tables):
                spec = specs.get(t.name)
                if spec is None:
                    raise PlanError(f"plan table {i} ({t.name!r}): unknown table (known: {sorted(specs)})")
                if (t.rows, t.dim) != (spec.rows, spec.dim):
                    raise PlanError(f"plan table {i} ({t.name!r}): {t.rows} x {t.dim} in the plan, the table is "
                                    f"{spec.rows} x {spec.dim}")
            missing = [n for n in specs if n not in set(names)]
            if missing:
                raise PlanError(f"plan has no entry for table(s) {missing}")
        used = [0] * world_size
        for i, t in enumerate(self.tables):
            _validate_entry(t, f"plan table {i} ({t.name!r})", self.topology)
            for r, b in t.memory_bytes_per_rank.items():
                used[r] += b
        for r, b in enumerate(used):
            if b > self.topology.hbm_bytes:
                raise PlanError(f"rank {r} holds {format_bytes(b)} ({b:,} bytes) of tables, HBM per rank is "
                                f"{format_bytes(self.topology.hbm_bytes)}")


def _validate_entry(t: TableSharding, where: str, topo: Topology) -> None:
    world = topo.world_size
    if not isinstance(t.name, str) or not t.name:
        raise PlanError(f"{where}: 'name' must be a non-empty string")
    if not (_is_int(t.rows) and t.rows > 0 and _is_int(t.dim) and t.dim > 0):
        raise PlanError(f"{where}: 'rows' and 'dim' must be positive integers, got {t.rows!r} x {t.dim!r}")
    if t.sharding not in SHARDING_TYPES:
        raise PlanError(f"{where}: unknown sharding {t.sharding!r} (one of {', '.join(SHARDING_TYPES)})")
    if not t.ranks or not all(_is_int(r) for r in t.ranks):
        raise PlanError(f"{where}: 'ranks' must be a non-empty list of integers, got {t.ranks!r}")
    bad = [r for r in t.ranks if not 0 <= r < world]
    if bad:
        raise PlanError(f"{where}: rank(s) {bad} out of range 0..{world - 1}")
    if len(set(t.ranks)) != len(t.ranks):
        raise PlanError(f"{where}: a rank appears twice in {t.ranks}; each shard needs its own rank")
    k = len(t.ranks)
    if t.sharding == "data_parallel" and t.ranks != list(range(world)):
        raise PlanError(f"{where}: data_parallel must list every rank 0..{world - 1} in order, got {t.ranks}")
    if t.sharding == "table_wise" and k != 1:
        raise PlanError(f"{where}: table_wise takes exactly one rank, got {t.ranks}")
    if t.sharding == "column_wise" and t.dim % k:
        raise PlanError(f"{where}: column_wise over {k} ranks needs dim divisible by {k}, dim is {t.dim}")
    if t.sharding in ("row_wise", "table_row_wise"):
        empty = [i for i, (lo, hi) in enumerate(row_blocks(t.rows, k)) if hi <= lo]
        if empty:
            raise PlanError(f"{where}: {t.rows} rows in blocks of {math.ceil(t.rows / k)} over {k} ranks leave "
                            f"shard(s) {empty} empty; use fewer ranks")
    if t.sharding == "table_row_wise":
        nodes = sorted({topo.node_of(r) for r in t.ranks})
        if len(nodes) != 1:
            raise PlanError(f"{where}: table_row_wise ranks {t.ranks} span nodes {nodes} "
                            f"({topo.devices_per_node} ranks per node); they must share one node")
    if not all(_is_int(b) and b >= 0 for b in t.memory_bytes_per_rank.values()):
        raise PlanError(f"{where}: 'memory_bytes_per_rank' values must be non-negative integers")
    if set(t.memory_bytes_per_rank) != set(t.ranks):
        raise PlanError(f"{where}: 'memory_bytes_per_rank' names ranks {sorted(t.memory_bytes_per_rank)}, "
                        f"the table is on ranks {sorted(t.ranks)}")
