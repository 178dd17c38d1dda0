"""What the planner reads and writes: the cluster topology, the table specs, and the sharding plan.

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
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeGuard

from recstack.distributed.planner.storage import (
    OPTIMIZER_STATE_BYTES,
    ShardStorage,
    StorageError,
    TierBudgets,
    check_budgets,
    parse_storage,
    shard_bytes,
)
from recstack.distributed.sharding import SHARDING_TYPES, row_blocks, shard_blocks
from recstack.errors import ConfigError
from recstack.units import format_bytes

PLAN_VERSION = 1


class PlanError(ConfigError):
    """A request the planner cannot satisfy, or a plan that does not describe a valid sharding (a
    ``ValueError`` too, as it always was)."""


@dataclass(frozen=True)
class Topology:
    """``nodes`` hosts of ``devices_per_node`` devices; rank r lives on node r // devices_per_node.

    Defaults are the TorchRec planner's (HBM 32 GB, DDR 128 GB, 600 GB/s inside a node, 12.5 GB/s across
    nodes); ``hbm_bw`` is the device memory bandwidth used for lookups and updates (900 GB/s: V100 data
    sheet, the device class those memory defaults describe). ``inter_bw`` is each device's share of the
    scale-out network (ZionEX gives every GPU its own NIC).

    Storage tiers: ``ddr_bytes`` (host memory) and ``ssd_bytes`` (0: no SSD) are per host, split evenly
    between its devices' ranks (:meth:`budgets`). ``pcie_bw`` is each device's host<->device link (25 GB/s, a
    PCIe 4.0 x16 link in practice) and ``ssd_bw`` each rank's share of its host's SSD bandwidth (2 GB/s);
    both are assumptions of the cost model, not measured.
    """

    nodes: int = 1
    devices_per_node: int = 8
    hbm_bytes: int = 32 * 10**9
    ddr_bytes: int = 128 * 10**9
    intra_bw: float = 600e9
    inter_bw: float = 12.5e9
    hbm_bw: float = 900e9
    ssd_bytes: int = 0
    pcie_bw: float = 25e9
    ssd_bw: float = 2e9

    def __post_init__(self) -> None:
        whole = ("nodes", "devices_per_node", "hbm_bytes", "ddr_bytes", "ssd_bytes")
        for f in fields(self):
            value = getattr(self, f.name)
            optional = f.name in ("ddr_bytes", "ssd_bytes")  # 0: no host memory / SSD for tables
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    value >= 0 if optional else value > 0) or (value == math.inf and f.name in whole):
                kind = "non-negative" if optional else "positive"
                raise PlanError(f"topology: {f.name} must be a {kind} number, got {value!r}")
        for name in whole:
            if int(getattr(self, name)) != getattr(self, name):
                raise PlanError(f"topology: {name} must be an integer, got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def budgets(self) -> TierBudgets:
        """Per-rank bytes of device memory, host memory and SSD: HBM, and each host's DDR and SSD split
        evenly between its ranks."""
        L = self.devices_per_node
        return TierBudgets(self.hbm_bytes, self.ddr_bytes // L, self.ssd_bytes // L)

    def explain_budgets(self) -> dict[str, str]:
        L = self.devices_per_node
        per_host = {"host": self.ddr_bytes, "ssd": self.ssd_bytes}
        return {"device": "HBM per rank", **{k: f"{format_bytes(v, decimal=True)} per host / {L} ranks"
                                             for k, v in per_host.items()}}

    def describe(self) -> str:
        hbm, ddr, intra, inter, mem = (format_bytes(b, decimal=True) for b in (
            self.hbm_bytes, self.ddr_bytes, self.intra_bw, self.inter_bw, self.hbm_bw))
        text = (f"{self.nodes} node(s) x {self.devices_per_node} devices, HBM {hbm}, DDR {ddr}/host, "
                f"links {intra}/s intra, {inter}/s inter, memory {mem}/s")
        if self.ssd_bytes:
            ssd, pcie, ssd_bw = (format_bytes(b, decimal=True) for b in (self.ssd_bytes, self.pcie_bw, self.ssd_bw))
            text += f"; SSD {ssd}/host, PCIe {pcie}/s, SSD {ssd_bw}/s per rank"
        return text

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
    """One embedding table. ``pooling`` is the mean number of ids per sample (1.0 for one-hot features; 0 for
    a feature that is always empty: the table still needs a place, and its bags still travel, empty).

    ``access_counts`` (optional) is a histogram of lookups over equal row ranges: entry j counts the ids
    that fall in rows [j*rows/n, (j+1)*rows/n). It tells the cost model how lookups split between row
    blocks and how many distinct rows a batch touches; without it ids are taken as uniform over the rows.
    ``zipf`` is the exponent of the ids' popularity law, which sets the hit rate of a cached shard
    (``hit_rate.py``).
    """

    name: str
    rows: int
    dim: int
    pooling: float = 1.0
    access_counts: tuple[float, ...] | None = None
    zipf: float | None = None  # Zipf exponent of the ids (cache hit rates); None: the cost config's

    def __post_init__(self) -> None:
        where = f"table {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"table name must be a non-empty string, got {self.name!r}")
        for name in ("rows", "dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PlanError(f"{where}: field '{name}' must be a positive integer, got {value!r}")
        if (isinstance(self.pooling, bool) or not isinstance(self.pooling, int | float)
                or not 0 <= self.pooling < math.inf):
            raise PlanError(f"{where}: field 'pooling' must be a non-negative number, got {self.pooling!r}")
        if self.access_counts is not None:
            counts = tuple(self.access_counts)
            if not counts or any(isinstance(c, bool) or not isinstance(c, int | float) or not c >= 0
                                 for c in counts) or not sum(counts) > 0:
                raise PlanError(f"{where}: field 'access_counts' must be a non-empty list of non-negative "
                                f"numbers with a positive sum")
            object.__setattr__(self, "access_counts", counts)
        if self.zipf is not None and (isinstance(self.zipf, bool) or not isinstance(self.zipf, int | float)
                                      or not 0 <= self.zipf < math.inf):
            raise PlanError(f"{where}: field 'zipf' must be a non-negative number, got {self.zipf!r}")


_TABLE_FIELDS = ("name", "rows", "dim", "sharding", "ranks", "memory_bytes_per_rank")
_OPTIONAL_TABLE_FIELDS = ("storage",)


@dataclass
class TableSharding:
    """The plan for one table: sharding type, rank of each shard in order, bytes held on each rank.

    In a hand-written plan ``rows`` and ``dim`` may be None (the model's are used) and so may
    ``memory_bytes_per_rank`` (no estimate). ``storage``: {rank: ShardStorage} of the shards kept behind a
    device cache (``storage.py``); a rank it does not name holds its shard on the device."""

    name: str
    rows: int | None
    dim: int | None
    sharding: str
    ranks: list[int]
    memory_bytes_per_rank: dict[int, int] | None = field(default_factory=dict)
    storage: dict[int, ShardStorage] = field(default_factory=dict)

    def shard_storage(self) -> list[ShardStorage | None]:
        """Storage of each shard, in shard order (the order of ``ranks``): None for a device shard."""
        return [self.storage.get(r) for r in self.ranks]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "rows": self.rows, "dim": self.dim, "sharding": self.sharding,
             "ranks": list(self.ranks)}
        if self.memory_bytes_per_rank is not None:
            d["memory_bytes_per_rank"] = {str(r): int(b) for r, b in self.memory_bytes_per_rank.items()}
        if self.storage:
            d["storage"] = {str(r): s.to_dict() for r, s in sorted(self.storage.items())}
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str, estimates: bool = True) -> TableSharding:
        """``estimates=False``: ``rows``, ``dim`` and ``memory_bytes_per_rank`` may be missing."""
        if not isinstance(d, dict):
            raise PlanError(f"{where}: expected an object, got {type(d).__name__}")
        name = _field(d, "name", where)
        if isinstance(name, str) and name:
            where = f"{where} ({name!r})"
        unknown = sorted(set(d) - set(_TABLE_FIELDS) - set(_OPTIONAL_TABLE_FIELDS))
        if unknown:
            known = list(_TABLE_FIELDS + _OPTIONAL_TABLE_FIELDS)
            raise PlanError(f"{where}: unknown field(s) {unknown} (known: {known})")
        optional = () if estimates else ("rows", "dim", "memory_bytes_per_rank")
        values: dict[str, Any] = {k: d.get(k) if k in optional else _field(d, k, where) for k in _TABLE_FIELDS[1:]}
        if not isinstance(values["ranks"], list):
            raise PlanError(f"{where}: field 'ranks' must be a list of ranks, got {values['ranks']!r}")
        memory = values["memory_bytes_per_rank"]
        mem = None
        if memory is not None or estimates:
            if not isinstance(memory, dict):
                raise PlanError(f"{where}: field 'memory_bytes_per_rank' must be an object, got {memory!r}")
            try:
                mem = {int(r): b for r, b in memory.items()}
            except ValueError as e:
                raise PlanError(f"{where}: field 'memory_bytes_per_rank' has a key that is not a rank: {e}") from e
        storage = {}
        if "storage" in d:
            try:
                storage = parse_storage(d["storage"])
            except StorageError as e:
                raise PlanError(f"{where}: field 'storage': {e}") from e
        return cls(name, values["rows"], values["dim"], values["sharding"], values["ranks"], mem, storage)


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


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


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
        version = _field(d, "version", source) if estimates else d.get("version", PLAN_VERSION)
        if version != PLAN_VERSION:
            raise PlanError(f"{source}: field 'version' is {version!r}, this planner reads version {PLAN_VERSION}")
        tables = _field(d, "tables", source)
        if not isinstance(tables, list):
            raise PlanError(f"{source}: field 'tables' must be a list")
        world_size = _field(d, "world_size", source)
        if not _is_int(world_size) or world_size <= 0:
            raise PlanError(f"{source}: field 'world_size' must be a positive integer, got {world_size!r}")
        given = estimates or "topology" in d or topology is None
        if given:
            topology = Topology.from_dict(_field(d, "topology", source), f"{source}: topology")
        assert topology is not None
        return cls(
            world_size=world_size,
            topology=topology,
            batch_size_per_rank=_field(d, "batch_size_per_rank", source) if estimates
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
        if not _is_int(world_size) or world_size <= 0:
            raise PlanError(f"world size must be a positive integer, got {world_size!r}")
        if self.world_size != world_size:
            raise PlanError(f"field 'world_size': plan is for world size {self.world_size}, running with "
                            f"{world_size}")
        if self.topology.world_size != world_size:
            raise PlanError(f"field 'topology': plan topology has {self.topology.nodes} x "
                            f"{self.topology.devices_per_node} = {self.topology.world_size} ranks, world size is "
                            f"{world_size}")
        if (estimates or self.batch_size_per_rank is not None) and (
                not _is_int(self.batch_size_per_rank) or self.batch_size_per_rank <= 0):
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
            _validate_entry(t, where, self.topology, rows, dim, estimates)
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
        return (w if _is_int(w) and w > 0 else 4), state

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


def _validate_entry(t: TableSharding, where: str, topo: Topology, rows: int | None = None, dim: int | None = None,
                    estimates: bool = True) -> None:
    """One table's entry; ``rows`` and ``dim`` are the table's (None where neither the plan nor the caller
    gives them: the checks that need them are skipped)."""
    world = topo.world_size
    if not isinstance(t.name, str) or not t.name:
        raise PlanError(f"{where}: field 'name' must be a non-empty string")
    for name, value in (("rows", rows), ("dim", dim)):
        if (value is not None or estimates) and not (_is_int(value) and value > 0):
            raise PlanError(f"{where}: field '{name}' must be a positive integer, got {value!r}")
    if t.sharding not in SHARDING_TYPES:
        raise PlanError(f"{where}: field 'sharding': unknown sharding {t.sharding!r} "
                        f"(one of {', '.join(SHARDING_TYPES)})")
    if not t.ranks or not all(_is_int(r) for r in t.ranks):
        raise PlanError(f"{where}: field 'ranks' must be a non-empty list of integers, got {t.ranks!r}")
    bad = [r for r in t.ranks if not 0 <= r < world]
    if bad:
        raise PlanError(f"{where}: field 'ranks': rank(s) {bad} out of range 0..{world - 1}")
    if len(set(t.ranks)) != len(t.ranks):
        raise PlanError(f"{where}: field 'ranks': a rank appears twice in {t.ranks}; each shard needs its own rank")
    k = len(t.ranks)
    if t.sharding == "data_parallel" and t.ranks != list(range(world)):
        raise PlanError(f"{where}: field 'ranks': data_parallel must list every rank 0..{world - 1} in order, "
                        f"got {t.ranks}")
    if t.sharding == "table_wise" and k != 1:
        raise PlanError(f"{where}: field 'ranks': table_wise takes exactly one rank, got {t.ranks}")
    if dim is not None and t.sharding == "column_wise" and dim % k:
        raise PlanError(f"{where}: field 'ranks': column_wise over {k} ranks needs dim divisible by {k}, "
                        f"dim is {dim}")
    if estimates and rows is not None and t.sharding in ("row_wise", "table_row_wise"):
        # The planner never leaves a row block empty; a hand-written plan may (that rank holds no rows).
        empty = [i for i, (lo, hi) in enumerate(row_blocks(rows, k)) if hi <= lo]
        if empty:
            raise PlanError(f"{where}: field 'ranks': {rows} rows in blocks of {math.ceil(rows / k)} over {k} "
                            f"ranks leave shard(s) {empty} empty; use fewer ranks")
    _check_one_node(t, where, topo)
    _check_storage(t, where, rows, dim)
    if t.memory_bytes_per_rank is None:
        if estimates:
            raise PlanError(f"{where}: missing field 'memory_bytes_per_rank'")
        return
    if not all(_is_int(b) and b >= 0 for b in t.memory_bytes_per_rank.values()):
        raise PlanError(f"{where}: field 'memory_bytes_per_rank' values must be non-negative integers")
    if set(t.memory_bytes_per_rank) != set(t.ranks):
        raise PlanError(f"{where}: field 'memory_bytes_per_rank' names ranks {sorted(t.memory_bytes_per_rank)}, "
                        f"the table is on ranks {sorted(t.ranks)}")


def _check_storage(t: TableSharding, where: str, rows: int | None, dim: int | None) -> None:
    """Storage entries name ranks of the table, never a data_parallel replica, and caches smaller than their
    shards (a cache of every row is the device tier)."""
    if not t.storage:
        return
    if t.sharding == "data_parallel":
        raise PlanError(f"{where}: field 'storage': data_parallel tables stay on the device (rank "
                        f"{min(t.storage)} has a {t.storage[min(t.storage)].tier} entry)")
    stray = sorted(set(t.storage) - set(t.ranks))
    if stray:
        raise PlanError(f"{where}: field 'storage': rank(s) {stray} hold no shard of this table (its ranks: "
                        f"{t.ranks})")
    if rows is None or dim is None:
        return
    for r, (r0, r1, _, _) in zip(t.ranks, shard_blocks(t.sharding, rows, dim, len(t.ranks)), strict=True):
        st = t.storage.get(r)
        if st is not None and st.cache_rows >= r1 - r0:
            raise PlanError(f"{where}: field 'storage': rank {r}: 'cache_rows' {st.cache_rows:,} is not below the "
                            f"shard's {r1 - r0:,} rows (a shard cached whole is a device shard: drop its entry)")


def _check_one_node(t: TableSharding, where: str, topo: Topology, planned_for: Topology | None = None) -> None:
    """A table_row_wise table's ranks share one node of ``topo``. ``planned_for``: the plan's own topology, when
    ``topo`` is the running job's and splits the ranks into nodes differently (the error says what to plan for)."""
    if t.sharding != "table_row_wise":
        return
    nodes = sorted({topo.node_of(r) for r in t.ranks})
    if len(nodes) == 1:
        return
    if planned_for is None:
        raise PlanError(f"{where}: field 'ranks': table_row_wise ranks {t.ranks} span nodes {nodes} "
                        f"({topo.devices_per_node} ranks per node); they must share one node")
    raise PlanError(f"{where}: field 'ranks': table_row_wise ranks {t.ranks} span nodes {nodes} of this job "
                    f"({topo.devices_per_node} ranks per node; the plan is for {planned_for.nodes} x "
                    f"{planned_for.devices_per_node}); they must share one node: plan again with --topology "
                    f"{topo.nodes}x{topo.devices_per_node}")


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
                    _check_one_node(t, f"plan table {i} ({t.name!r})", job, plan.topology)
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
