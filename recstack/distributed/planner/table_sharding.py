"""The plan for one table (:class:`TableSharding`, one entry of a plan's ``tables``): its JSON form, read
field by field with errors that name the table and the field, and the checks of one entry against a topology
(sharding type, ranks, storage entries, memory per rank). The plan as a whole is in ``plan.py``, whose module
docstring gives the JSON format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from recstack.distributed.planner.inputs import PlanError, Topology
from recstack.distributed.planner.storage import ShardStorage, StorageError, parse_storage
from recstack.distributed.sharding import SHARDING_TYPES, row_blocks, shard_blocks

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
        name = require_field(d, "name", where)
        if isinstance(name, str) and name:
            where = f"{where} ({name!r})"
        unknown = sorted(set(d) - set(_TABLE_FIELDS) - set(_OPTIONAL_TABLE_FIELDS))
        if unknown:
            known = list(_TABLE_FIELDS + _OPTIONAL_TABLE_FIELDS)
            raise PlanError(f"{where}: unknown field(s) {unknown} (known: {known})")
        optional = () if estimates else ("rows", "dim", "memory_bytes_per_rank")
        values: dict[str, Any] = {k: d.get(k) if k in optional else require_field(d, k, where)
                                  for k in _TABLE_FIELDS[1:]}
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


def require_field(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise PlanError(f"{where}: missing field '{key}'")
    return d[key]


def is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)



def validate_entry(t: TableSharding, where: str, topo: Topology, rows: int | None = None, dim: int | None = None,
                   estimates: bool = True) -> None:
    """One table's entry; ``rows`` and ``dim`` are the table's (None where neither the plan nor the caller
    gives them: the checks that need them are skipped)."""
    world = topo.world_size
    if not isinstance(t.name, str) or not t.name:
        raise PlanError(f"{where}: field 'name' must be a non-empty string")
    for name, value in (("rows", rows), ("dim", dim)):
        if (value is not None or estimates) and not (is_int(value) and value > 0):
            raise PlanError(f"{where}: field '{name}' must be a positive integer, got {value!r}")
    if t.sharding not in SHARDING_TYPES:
        raise PlanError(f"{where}: field 'sharding': unknown sharding {t.sharding!r} "
                        f"(one of {', '.join(SHARDING_TYPES)})")
    if not t.ranks or not all(is_int(r) for r in t.ranks):
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
    check_one_node(t, where, topo)
    _check_storage(t, where, rows, dim)
    if t.memory_bytes_per_rank is None:
        if estimates:
            raise PlanError(f"{where}: missing field 'memory_bytes_per_rank'")
        return
    if not all(is_int(b) and b >= 0 for b in t.memory_bytes_per_rank.values()):
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


def check_one_node(t: TableSharding, where: str, topo: Topology, planned_for: Topology | None = None) -> None:
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
