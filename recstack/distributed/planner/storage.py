"""Where a shard's rows live: the storage tiers of a plan and the per-rank memory budgets they are held to.

A shard is on the ``device`` (all its rows and their optimizer state in device memory), ``host-cached`` (all
rows in host memory, a cache of ``cache_rows`` rows in device memory) or ``ssd-cached`` (all rows in a file on
the rank's SSD, the same device cache). In a plan file a table's cached shards are listed by rank::

    "storage": {"<rank>": {"tier": "host-cached" | "ssd-cached", "cache_rows": N}, ...}

Ranks the field does not name, and tables without it, are on the device, so plans written before tiers existed
read as before. Each rank holds at most one shard of a table, so the rank names the shard;
:meth:`TableSharding.shard_storage <recstack.distributed.planner.table_sharding.TableSharding.shard_storage>` gives
them in shard order (``ShardStorage`` or None for the device). ``data_parallel`` tables stay on the device.

Bytes per shard (w bytes per weight, s bytes of optimizer state per row; rows x cols the shard's block):
device rows * (cols*w + s), plus the dense gradient rows * cols * w of a data_parallel replica; a cached shard
cache_rows * (cols*w + s) on the device and rows * (cols*w + s) in host memory or on SSD.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from recstack.errors import ConfigError
from recstack.units import format_bytes

TIERS = ("device", "host-cached", "ssd-cached")
CACHED_TIERS = TIERS[1:]
BUDGETS = ("device", "host", "ssd")  # the memory each tier's rows use: device memory, host memory, SSD
_STORAGE_FIELDS = ("tier", "cache_rows")


OPTIMIZER_STATE_BYTES = {"sgd": 0, "rowwise_adagrad": 4}  # per row and shard


class StorageError(ConfigError):
    """A malformed storage entry or budget (a plan re-raises it as a PlanError with the table in front)."""


@dataclass(frozen=True)
class ShardStorage:
    """A cached shard: ``tier`` (``host-cached`` or ``ssd-cached``) and the rows of its device cache
    (1 <= cache_rows < the shard's rows)."""

    tier: str
    cache_rows: int

    def __post_init__(self) -> None:
        if self.tier not in CACHED_TIERS:
            raise StorageError(f"'tier' must be one of {', '.join(CACHED_TIERS)} (a device shard has no "
                               f"storage entry), got {self.tier!r}")
        if isinstance(self.cache_rows, bool) or not isinstance(self.cache_rows, int) or self.cache_rows < 1:
            raise StorageError(f"'cache_rows' must be an integer of at least one row, got {self.cache_rows!r}")

    @property
    def budget(self) -> str:
        """The budget the shard's rows count against: ``host`` or ``ssd``."""
        return "host" if self.tier == "host-cached" else "ssd"

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "cache_rows": int(self.cache_rows)}

    @classmethod
    def from_dict(cls, d: Any) -> ShardStorage:
        if not isinstance(d, dict):
            raise StorageError(f"expected an object {{'tier': ..., 'cache_rows': N}}, got {d!r}")
        unknown = sorted(set(d) - set(_STORAGE_FIELDS))
        if unknown:
            raise StorageError(f"unknown field(s) {unknown} (known: {list(_STORAGE_FIELDS)})")
        for key in _STORAGE_FIELDS:
            if key not in d:
                raise StorageError(f"missing field '{key}'")
        return cls(d["tier"], d["cache_rows"])


def parse_storage(value: Any) -> dict[int, ShardStorage]:
    """A table's ``storage`` field -> {rank: ShardStorage}; errors say which rank's entry is bad."""
    if not isinstance(value, dict):
        raise StorageError(f"must be an object {{\"<rank>\": {{\"tier\": ..., \"cache_rows\": N}}}}, got {value!r}")
    out = {}
    for key, entry in value.items():
        try:
            rank = int(key)
        except ValueError:
            raise StorageError(f"key {key!r} is not a rank") from None
        try:
            out[rank] = ShardStorage.from_dict(entry)
        except StorageError as e:
            raise StorageError(f"rank {rank}: {e}") from None
    return out


@dataclass(frozen=True)
class TierBudgets:
    """Bytes each rank may hold in device memory, host memory and SSD (None: not limited)."""

    device: int | None = None
    host: int | None = None
    ssd: int | None = None

    def __post_init__(self) -> None:
        for name in BUDGETS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise StorageError(f"{name} budget must be a non-negative number of bytes, got {value!r}")

    def limit(self, budget: str) -> int | None:
        return getattr(self, budget)


def row_bytes(cols: int, weight_bytes: int, state_bytes: int) -> int:
    """Bytes of one row of a ``cols``-column block with its optimizer state."""
    return cols * weight_bytes + state_bytes


def shard_bytes(rows: int, cols: int, storage: ShardStorage | None, weight_bytes: int, state_bytes: int,
                replica: bool = False) -> dict[str, int]:
    """Bytes per budget of a shard of ``rows`` x ``cols`` (``replica``: a data_parallel copy, with its dense
    gradient buffer)."""
    rb = row_bytes(cols, weight_bytes, state_bytes)
    out = dict.fromkeys(BUDGETS, 0)
    if storage is None:
        out["device"] = rows * rb + (rows * cols * weight_bytes if replica else 0)
    else:
        out["device"] = storage.cache_rows * rb
        out[storage.budget] = rows * rb
    return out


def check_budgets(usage: Sequence[tuple[str, int, str, int]], budgets: TierBudgets,
                  world_size: int, explain: dict[str, str] | None = None) -> None:
    """``usage``: (where, rank, budget, bytes) in plan order. Raise a :class:`StorageError` at the first entry
    after which a rank's total for a budget exceeds it, naming the entry (table), the rank and the budget.
    ``explain`` may say where each budget came from (e.g. '--ddr per node / 8 ranks')."""
    used = {b: [0] * world_size for b in BUDGETS}
    for where, rank, budget, nbytes in usage:
        used[budget][rank] += nbytes
        limit = budgets.limit(budget)
        if limit is not None and used[budget][rank] > limit:
            total = used[budget][rank]
            src = f" ({explain[budget]})" if explain and budget in explain else ""
            raise StorageError(f"{where}: rank {rank} holds {format_bytes(total, decimal=True)} ({total:,} bytes) "
                               f"in {_NAMES[budget]} with this table, over its {budget} budget of "
                               f"{format_bytes(limit, decimal=True)} ({limit:,} bytes){src}")


_NAMES = {"device": "device memory", "host": "host memory", "ssd": "SSD"}
