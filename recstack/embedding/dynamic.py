"""Dynamic id tables: raw 64-bit ids -> rows of a table of fixed capacity, with admission and eviction.

A remapper in front of the ordinary tables (TorchRec's managed-collision idea): the fused lookup, the fused
sparse optimizers and checkpoints see a table of ``capacity`` rows and never a raw id. ``DynamicIdMap`` keeps,
per table:

- the admitted ids, sorted (``keys`` [K] int64) with their rows (``key_rows`` [K]), looked up with one
  ``searchsorted`` per batch (no Python loop per id); ``row_id`` [C] the id each row holds (-1: free, -2: row 0);
- row 0, the shared default row: ids not admitted yet and unknown ids (eval, serving) are looked up there;
- candidates: ids seen fewer than ``admit_after`` times, with their sighting counts (sorted ``cand_keys``),
  bounded by ``max_candidates`` (the least recently seen are forgotten first);
- per row the step it was last seen (``last_used``) and its sightings since admission (``hits``).

``remap(ids)`` is one training step: the step counter advances, admitted ids refresh their row, new ids are
counted, and an id at its ``admit_after``-th sighting (every occurrence in a batch counts) gets a free row; with
``eviction = "ttl"`` rows not seen for ``ttl_steps`` steps are freed first. Collisions: none, ever: a row holds
one id. When no row is free:

- ``lru`` / ``lfu`` evict the least recently used (fewest sightings, then least recently used) rows that the
  current step does not use; if every row is in use by this very step, the ids left over stay on the default
  row for this step and remain candidates (admitted at their next sighting when a row can be had);
- ``ttl`` evicts nothing under pressure: new ids stay on the default row (as candidates) until rows expire.

Ids that compete for the last rows are admitted in the order (more sightings first, then the smaller id), so the
map is a function of the id sequence alone: a resumed run rebuilds exactly the same map. A row given to a new id
is reported to ``on_assign`` (rows [k], their ids [k]): the owner re-initialises the row with values keyed by the
id (``id_values``: the same vector for an id wherever, and whenever, it is admitted) and resets its optimizer state
(``EmbeddingCollection.reset_rows``). ``id_owner`` deals ids to ranks by the same hash (row-wise sharded dynamic
tables: ``recstack.distributed.dynamic_dist``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from recstack.errors import ConfigError

EVICTIONS = ("lru", "lfu", "ttl")
_FREE, _RESERVED = -1, -2
_I64 = torch.int64


@dataclass
class DynamicIdsConfig:
    """``[model.dynamic_ids]``: which tables are keyed by raw ids, and their capacity and policies (module
    docstring). ``tables`` empty: every table. ``table_capacity`` {table: rows} overrides ``capacity`` per table.
    ``max_candidates`` 0: as many as the table's capacity."""

    enabled: bool = False
    capacity: int = 100_000
    admit_after: int = 1
    eviction: Literal["lru", "lfu", "ttl"] = "lru"
    ttl_steps: int = 0
    tables: list[str] = field(default_factory=list)
    table_capacity: dict[str, int] = field(default_factory=dict)
    max_candidates: int = 0

    def validate(self) -> None:
        """Each ConfigError names the key."""
        k = "model.dynamic_ids"
        if self.capacity < 2:
            raise ConfigError(f"{k}.capacity: must be >= 2 (row 0 is the default row), got {self.capacity}")
        if self.admit_after < 1:
            raise ConfigError(f"{k}.admit_after: must be >= 1 (1: an id gets a row when first seen), got "
                              f"{self.admit_after}")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"{k}.eviction: expected one of {', '.join(EVICTIONS)}, got {self.eviction!r}")
        if self.eviction == "ttl" and self.ttl_steps < 1:
            raise ConfigError(f"{k}.ttl_steps: eviction = \"ttl\" needs ttl_steps >= 1, got {self.ttl_steps}")
        if self.eviction != "ttl" and self.ttl_steps:
            raise ConfigError(f"{k}.ttl_steps: only used with eviction = \"ttl\" (eviction is {self.eviction!r})")
        for name, rows in self.table_capacity.items():
            if isinstance(rows, bool) or not isinstance(rows, int) or rows < 2:
                raise ConfigError(f"{k}.table_capacity.{name}: must be an integer >= 2, got {rows!r}")
        if self.max_candidates < 0:
            raise ConfigError(f"{k}.max_candidates: must be >= 0 (0: capacity), got {self.max_candidates}")

    def applies_to(self, table: str) -> bool:
        return self.enabled and (not self.tables or table in self.tables)

    def capacity_of(self, table: str) -> int:
        """The rows of dynamic table ``table``: its ``table_capacity`` entry, else ``capacity``."""
        return self.table_capacity.get(table, self.capacity)

    def check_table_names(self, names: list[str]) -> None:
        """Every ``tables`` and ``table_capacity`` entry against the data's table names."""
        for key, given in (("tables", self.tables), ("table_capacity", list(self.table_capacity))):
            for name in given:
                if name not in names:
                    shown = ", ".join(dict.fromkeys(names))
                    raise ConfigError(f"model.dynamic_ids.{key}: the data has no table {name!r} (tables: {shown})")


_M1, _M2, _GOLDEN = -4658895280553007687, -7723592293110705685, -7046029254386353131  # splitmix64, as int64


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 [..] (wrapping arithmetic; logical shifts through a mask): a bijection
    whose output bits all depend on every input bit, so consecutive raw ids spread evenly."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def id_owner(ids: torch.Tensor, world: int) -> torch.Tensor:
    """Raw ids [n] int64 -> the rank [n] int64 in [0, world) that owns each (its id map and rows)."""
    return _mix64(ids.to(_I64)).remainder(world)


def id_values(ids: torch.Tensor, key: int, dim: int, bound: float) -> torch.Tensor:
    """The initial vector of each raw id [k] int64 admitted to a row: [k, dim] float32, uniform(-bound, bound),
    a function of (``key``, id, column) alone (``key``: the run's seed and the table), so an id gets the same
    vector on any rank, in any row, at any admission."""
    col = torch.arange(dim, dtype=_I64)
    x = _mix64(_mix64(ids.to(_I64).cpu() ^ _mix64(torch.tensor(key, dtype=_I64))).view(-1, 1) + (col + 1) * _GOLDEN)
    unit = ((x >> 11) & ((1 << 53) - 1)).to(torch.float64) * 2.0**-53  # [k, dim] in [0, 1), 53 random bits
    return ((2 * unit - 1) * bound).to(torch.float32)


def _find(keys: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted ``keys`` [K], ``query`` [Q] -> (position [Q] clamped into keys, found [Q] bool)."""
    if keys.numel() == 0:
        return torch.zeros_like(query), torch.zeros(query.shape, dtype=torch.bool)
    pos = torch.searchsorted(keys, query.contiguous()).clamp_(max=keys.numel() - 1)
    return pos, keys[pos] == query


def _merge(keys: torch.Tensor, new: torch.Tensor, *values: tuple[torch.Tensor, torch.Tensor]
           ) -> tuple[torch.Tensor, ...]:
    """Sorted ``keys`` [K] and ``new`` [n] (ascending, none of them in ``keys``) -> the merged keys [K + n] and
    each (old values [K], new values [n]) pair merged alike: O(K + n log K), no sort of the whole array."""
    n, k = new.numel(), keys.numel()
    at_new = torch.searchsorted(keys, new) + torch.arange(n)  # where each new key lands
    keep = torch.ones(k + n, dtype=torch.bool)
    keep[at_new] = False
    out = []
    for old, add in ((keys, new), *values):
        merged = torch.empty(k + n, dtype=old.dtype)
        merged[at_new] = add
        merged[keep] = old
        out.append(merged)
    return tuple(out)


def _drop(keys: torch.Tensor, gone: torch.Tensor) -> torch.Tensor:
    """Mask [K] of the sorted ``keys`` that are not in ``gone`` (every id of ``gone`` found or not)."""
    keep = torch.ones(keys.numel(), dtype=torch.bool)
    pos, found = _find(keys, gone)
    keep[pos[found]] = False
    return keep


class DynamicIdMap:
    """Raw int64 ids -> rows in [1, capacity) of one table, row 0 the default (module docstring)."""

    def __init__(self, capacity: int, admit_after: int = 1, eviction: str = "lru", ttl_steps: int = 0,
                 max_candidates: int = 0, on_assign: Callable[[torch.Tensor, torch.Tensor], None] | None = None
                 ) -> None:
        if capacity < 2 or eviction not in EVICTIONS:
            raise ValueError(f"DynamicIdMap: capacity {capacity} (>= 2), eviction {eviction!r}")
        self.capacity, self.admit_after, self.eviction, self.ttl_steps = capacity, admit_after, eviction, ttl_steps
        self.max_candidates = max_candidates or capacity
        self.on_assign = on_assign
        self.keys = torch.zeros(0, dtype=_I64)  # [K] admitted ids, ascending
        self.key_rows = torch.zeros(0, dtype=_I64)  # [K] their rows
        self.row_id = torch.full((capacity,), _FREE, dtype=_I64)  # [C] the id a row holds
        self.row_id[0] = _RESERVED
        self.last_used = torch.zeros(capacity, dtype=_I64)  # [C] step of the last sighting
        self.hits = torch.zeros(capacity, dtype=_I64)  # [C] sightings since admission
        self.cand_keys = torch.zeros(0, dtype=_I64)  # [M] candidate ids, ascending
        self.cand_count = torch.zeros(0, dtype=_I64)  # [M] their sightings
        self.cand_seen = torch.zeros(0, dtype=_I64)  # [M] step of their last sighting
        self.step = 0
        self.counters = {"admissions": 0, "evictions": 0, "expirations": 0, "default_hits": 0}

    # -- lookups ---------------------------------------------------------------------------------------------
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] int64 -> rows [n] int64 (0 for ids without a row); changes nothing (eval, serving)."""
        flat = ids.reshape(-1).to(_I64).cpu()
        pos, found = _find(self.keys, flat)
        rows = torch.where(found, self.key_rows[pos] if self.keys.numel() else flat.new_zeros(()), 0)
        return rows.view(ids.shape).to(ids.device)

    def remap(self, ids: torch.Tensor) -> torch.Tensor:
        """One training step's ids [n] int64 -> rows [n] int64, admitting and evicting (module docstring)."""
        self.step += 1
        flat = ids.reshape(-1).to(_I64).cpu()
        if flat.numel() == 0:
            return ids.to(_I64).clone()
        uniq, inverse, count = torch.unique(flat, return_inverse=True, return_counts=True)  # [U]
        pos, hit = _find(self.keys, uniq)
        rows = torch.zeros_like(uniq)
        rows[hit] = self.key_rows[pos[hit]]
        seen = rows[hit]
        self.last_used[seen] = self.step
        self.hits[seen] += count[hit]
        if self.eviction == "ttl":
            self._expire()
        miss = (~hit).nonzero().squeeze(1)
        if miss.numel():
            total = self._count(uniq[miss], count[miss])  # sightings so far, this step's included
            ready = total >= self.admit_after
            if bool(ready.any()):
                want, want_total = uniq[miss][ready], total[ready]
                # more sightings first, ties by the smaller id (``want`` is ascending: a stable sort keeps that)
                order = torch.sort(-want_total, stable=True)[1]
                got = self._take_rows(order.numel())
                chosen = order[: got.numel()]
                self._admit(want[chosen], want_total[chosen], got)
                rows[miss[ready.nonzero().squeeze(1)[chosen]]] = got
            self._bound_candidates()
        self.counters["default_hits"] += int(count[rows == 0].sum())
        return rows[inverse].view(ids.shape).to(ids.device)

    # -- admission and eviction --------------------------------------------------------------------------------
    def _count(self, new: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Add this step's sightings of ids without a row ``new`` [m] (ascending) -> their totals [m]."""
        if self.admit_after <= 1:
            return count
        pos, found = _find(self.cand_keys, new)
        total = count.clone()
        total[found] += self.cand_count[pos[found]]
        self.cand_count[pos[found]] = total[found]
        self.cand_seen[pos[found]] = self.step
        fresh = ~found
        seen = torch.full((int(fresh.sum()),), self.step, dtype=_I64)
        self.cand_keys, self.cand_count, self.cand_seen = _merge(
            self.cand_keys, new[fresh], (self.cand_count, total[fresh]), (self.cand_seen, seen))
        return total

    def _bound_candidates(self) -> None:
        """Forget the least recently seen candidates (then the least counted) beyond ``max_candidates``."""
        extra = self.cand_keys.numel() - self.max_candidates
        if extra <= 0:
            return
        # most recently seen first, then most counted (one int64 key: step < 2^32, count capped at 2^31 - 1)
        key = (self.cand_seen << 31) | self.cand_count.clamp(max=2**31 - 1)
        keep = torch.zeros(key.numel(), dtype=torch.bool)
        keep[torch.topk(key, self.max_candidates, sorted=False)[1]] = True  # a mask keeps the keys ascending
        self.cand_keys, self.cand_count, self.cand_seen = (
            self.cand_keys[keep], self.cand_count[keep], self.cand_seen[keep])

    def _expire(self) -> None:
        """ttl: free the rows not seen for ``ttl_steps`` steps."""
        old = (self.row_id >= 0) & (self.last_used <= self.step - self.ttl_steps)
        if bool(old.any()):
            self._release(old.nonzero().squeeze(1))
            self.counters["expirations"] += int(old.sum())

    def _take_rows(self, n: int) -> torch.Tensor:
        """Up to ``n`` rows for new ids [<= n]: free rows (ascending), then, with lru / lfu, evicted ones."""
        take = (self.row_id == _FREE).nonzero().squeeze(1)[:n]
        short = n - take.numel()
        if short <= 0 or self.eviction == "ttl":
            return take
        idle = ((self.row_id >= 0) & (self.last_used < self.step)).nonzero().squeeze(1)  # [V] ascending
        short = min(short, idle.numel())
        if self.eviction == "lru":  # the oldest first, ties by row: one unique int64 key, the k smallest
            key = self.last_used[idle] * self.capacity + idle
            victims = idle[torch.topk(key, short, largest=False, sorted=True)[1]]
        else:  # lfu: fewest sightings first, ties by the least recently used, then by row
            order = torch.sort(self.last_used[idle], stable=True)[1]
            order = order[torch.sort(self.hits[idle][order], stable=True)[1]]
            victims = idle[order[:short]]
        self._release(victims)
        self.counters["evictions"] += victims.numel()
        return torch.cat([take, victims])

    def _release(self, rows: torch.Tensor) -> None:
        keep = _drop(self.keys, self.row_id[rows])
        self.keys, self.key_rows = self.keys[keep], self.key_rows[keep]
        self.row_id[rows] = _FREE

    def _admit(self, ids: torch.Tensor, total: torch.Tensor, rows: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        self.row_id[rows] = ids
        self.last_used[rows] = self.step
        self.hits[rows] = total
        order = torch.argsort(ids)
        self.keys, self.key_rows = _merge(self.keys, ids[order], (self.key_rows, rows[order]))
        if self.cand_keys.numel():
            keep = _drop(self.cand_keys, ids)
            self.cand_keys, self.cand_count, self.cand_seen = (
                self.cand_keys[keep], self.cand_count[keep], self.cand_seen[keep])
        self.counters["admissions"] += ids.numel()
        if self.on_assign is not None:
            self.on_assign(rows, ids)

    # -- stats, state, export --------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """rows_in_use (never above capacity - 1), candidates, and the cumulative admissions, evictions (lru /
        lfu), expirations (ttl) and default_hits (training ids looked up on row 0)."""
        return {"rows_in_use": int(self.keys.numel()), "candidates": int(self.cand_keys.numel()), **self.counters}

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids [K] int64 ascending, rows [K] int64): the map as served."""
        return self.keys.numpy().copy(), self.key_rows.numpy().copy()

    _TENSORS = ("keys", "key_rows", "row_id", "last_used", "hits", "cand_keys", "cand_count", "cand_seen")

    def state_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k).clone() for k in self._TENSORS}, "step": self.step,
                "counters": dict(self.counters), "capacity": self.capacity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["capacity"] != self.capacity:
            raise ConfigError(f"model.dynamic_ids.capacity: the checkpoint's id map has {state['capacity']} rows, "
                              f"the config gives {self.capacity}")
        for k in self._TENSORS:
            setattr(self, k, state[k].to(_I64).clone())
        self.step, self.counters = int(state["step"]), dict(state["counters"])
