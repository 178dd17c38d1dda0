"""The bookkeeping of a software-managed row cache: which table row sits in which cache slot.

One cache serves every cached table of a collection, so a batch's rows are looked up, evicted and placed in one
vectorised pass whatever the number of tables. Rows are named by a *key*: the row's id plus the first key of
its table (tables are laid end to end). Each table owns ``ceil(capacity / ways)`` sets of ``ways`` slots (32 by
default, like FBGEMM's cache; slots beyond the table's capacity in its last set are disabled, so capacities are
exact). A row may only live in the set its id hashes to, so a lookup compares each key with ``ways`` candidates
([U, ways] in one pass) and an eviction chooses among ``ways`` slots, never scanning the cache: every operation
costs O(rows in the batch x ways), whatever the table or cache size, and the bookkeeping takes O(slots) memory,
nothing per table row. Within a set, the policy key decides the victim:

- ``lru``: key = the tick (request counter) of the last use;
- ``lfu``: key = (uses while resident) << 32 | tick, so the least used row goes first and ties go to the least
  recent. Counts are halved when one nears 2**31 so the key never overflows.

This class holds no row values: the caller moves rows between its buffers and the backing stores using the
slots returned here (and writes back the dirty rows that ``place`` evicts).
"""

from __future__ import annotations

import math
import threading

import torch

POLICIES = ("lru", "lfu")
_KEY_MAX = torch.iinfo(torch.int64).max
_COUNT_CAP = (1 << 31) - 1
_TICK_MASK = (1 << 32) - 1
_DISABLED = -2  # id_of of a slot past its table's capacity


COUNTERS = ("requests", "hits", "evictions", "writebacks", "staged", "late")


class CacheCounters:
    """Per-table counters of a cache, updated from any thread.

    ``requests``: distinct rows a batch needs, counted once per batch (when its rows are prefetched, or else at
    its forward pass); ``hits``: those already resident; ``evictions``; ``writebacks``: dirty rows written to
    their store (on eviction or flush); ``staged``: rows that found no evictable slot in their set and were served
    around the cache for one batch; ``late``: rows a prefetched batch still had to fetch at its forward pass.
    Time spent fetching at forward time (it blocks the step) and ahead of it (it overlaps the previous step) is
    kept for all tables together.
    """

    def __init__(self, num_tables: int) -> None:
        self.counts = torch.zeros(num_tables, len(COUNTERS), dtype=torch.int64)
        self.fetch_seconds = 0.0
        self.prefetch_seconds = 0.0
        self._lock = threading.Lock()

    def add(self, name: str, tables: torch.Tensor) -> None:
        """One more ``name`` for each entry of ``tables`` [n] (table indices)."""
        if tables.numel():
            n = torch.bincount(tables, minlength=self.counts.shape[0])
            with self._lock:
                self.counts[:, COUNTERS.index(name)] += n

    def add_time(self, seconds: float, ahead: bool) -> None:
        with self._lock:
            if ahead:
                self.prefetch_seconds += seconds
            else:
                self.fetch_seconds += seconds

    def table(self, t: int) -> dict[str, float]:
        with self._lock:
            row = self.counts[t].tolist()
        out: dict[str, float] = dict(zip(COUNTERS, row, strict=True))
        out["misses"] = out["requests"] - out["hits"]
        out["hit_rate"] = out["hits"] / out["requests"] if out["requests"] else 0.0
        return out

    def totals(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(zip(COUNTERS, self.counts.sum(0).tolist(), strict=True))
            out.update(fetch_seconds=self.fetch_seconds, prefetch_seconds=self.prefetch_seconds)
        out["misses"] = out["requests"] - out["hits"]
        out["hit_rate"] = out["hits"] / out["requests"] if out["requests"] else 0.0
        return out

    def reset(self) -> None:
        with self._lock:
            self.counts.zero_()
            self.fetch_seconds = self.prefetch_seconds = 0.0


def id_hash(ids: torch.Tensor) -> torch.Tensor:
    """ids [U] int64 >= 0 -> non-negative int64 hashes [U].

    Multiplicative mixing so that runs of consecutive ids (a common layout of hot rows) spread over all sets;
    the 32-bit halves are multiplied by 31-bit constants so no product overflows int64.
    """
    h = (ids & 0xFFFFFFFF) * 0x5BD1E995 + (ids >> 32) * 0x1B873593
    return h ^ (h >> 29)


class SetAssociativeCache:
    """Slot bookkeeping for tables of ``rows[t]`` rows cached in ``capacities[t]`` slots each.

    State, all CPU tensors over the slots: ``id_of`` (key of the resident row, -1 when empty, -2 when disabled),
    ``key`` (policy key, lowest goes first), ``dirty`` (changed since it was fetched), ``pinned`` (used by a batch
    whose backward has not run: never evicted). Table t's slots are ``slot_base[t] : slot_base[t + 1]``.
    """

    def __init__(self, rows: list[int], capacities: list[int], policy: str = "lru", ways: int = 32) -> None:
        if policy not in POLICIES:
            raise ValueError(f"cache policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if ways < 1 or len(rows) != len(capacities) or any(c < 1 for c in capacities):
            raise ValueError(f"need ways >= 1 and a capacity >= 1 per table, got {ways} and {capacities}")
        self.policy, self.ways = policy, ways
        self.capacities = [min(c, n) for c, n in zip(capacities, rows, strict=True)]
        sets = [math.ceil(c / ways) for c in self.capacities]
        self.num_sets = torch.tensor(sets, dtype=torch.int64)  # [T]
        self.set_base = torch.cat([torch.zeros(1, dtype=torch.int64), self.num_sets.cumsum(0)])  # [T + 1]
        self.key_base = torch.cat([torch.zeros(1, dtype=torch.int64),
                                   torch.tensor(rows, dtype=torch.int64).cumsum(0)])  # [T + 1] first key
        self.slot_base = (self.set_base * ways).tolist()
        total = self.slot_base[-1]
        self.id_of = torch.full((total,), -1, dtype=torch.int64)
        for t, c in enumerate(self.capacities):  # the last set of a table may have fewer usable ways
            self.id_of[self.slot_base[t] + c : self.slot_base[t + 1]] = _DISABLED
        self.key = torch.zeros(total, dtype=torch.int64)
        self.dirty = torch.zeros(total, dtype=torch.bool)
        self.pinned = torch.zeros(total, dtype=torch.bool)
        self.tick = 0

    @property
    def num_slots(self) -> int:
        return self.slot_base[-1]

    def table_of(self, keys: torch.Tensor) -> torch.Tensor:
        """keys [U] -> the table each belongs to [U]."""
        return torch.searchsorted(self.key_base, keys, right=True) - 1

    def set_of(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """keys [U] of tables [U] -> their sets [U] (inside each table's own range of sets)."""
        # index_select: several times faster than advanced indexing for these gathers
        local = keys - self.key_base.index_select(0, tables)
        spread = torch.remainder(id_hash(local), self.num_sets.index_select(0, tables))
        return self.set_base.index_select(0, tables) + spread

    def next_tick(self) -> int:
        """Advance the clock once per request (recency is counted in batches)."""
        self.tick += 1
        return self.tick

    def lookup(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """keys [U] -> slots [U] int64, -1 where the row is not resident."""
        if keys.numel() == 0:
            return keys.new_empty(0)
        sets = self.set_of(keys, tables)
        match = self.id_of.view(-1, self.ways).index_select(0, sets) == keys.unsqueeze(1)  # [U, ways]
        way = match.to(torch.uint8).argmax(1)
        return torch.where(match.any(1), sets * self.ways + way, -1)

    def _new_keys(self, counts: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
        tick = self.tick & _TICK_MASK
        if self.policy == "lru":
            return torch.full_like(counts, tick)
        total = counts if old is None else (old >> 32) + counts
        if total.numel() and int(total.max()) >= _COUNT_CAP:  # age every count so keys stay below 2**63
            self.key = ((self.key >> 32) // 2 << 32) | (self.key & _TICK_MASK)
            total = total // 2
        return (total.clamp(max=_COUNT_CAP) << 32) | tick

    def touch(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """Record a use of resident ``slots`` [H] (``counts`` [H] ids each) at the current tick."""
        if slots.numel():
            self.key[slots] = self._new_keys(counts, self.key.index_select(0, slots))

    def place(
        self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor, protect: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Give slots to non-resident rows ``keys`` [M] (distinct), evicting the lowest-key slots of their sets.

        ``protect`` [slots] bool marks slots that must stay (pinned rows, rows this batch already hit). Misses
        that share a set take its candidates in key order, one each; a miss whose set has no candidate left gets
        no slot. -> (slots [M] (-1 = no room), evicted keys [M] (-1 = the slot was empty), evicted-dirty [M]).
        The new rows are recorded as resident and clean; the caller must write back the dirty evicted rows
        before it overwrites their slots.
        """
        m, w = keys.numel(), self.ways
        if m == 0:
            return keys.new_empty(0), keys.new_empty(0), torch.zeros(0, dtype=torch.bool)
        sets = self.set_of(keys, tables)
        order = torch.argsort(sets, stable=True)
        sets_sorted = sets.index_select(0, order)
        uset, set_index, per_set = torch.unique_consecutive(sets_sorted, return_inverse=True, return_counts=True)
        # rank of each miss among the misses of its set: its position minus where its set's run starts
        run_start = torch.cumsum(per_set, 0) - per_set
        rank = torch.arange(m) - run_start.index_select(0, set_index)
        ids = self.id_of.view(-1, w).index_select(0, uset)  # [S, ways]
        cand = torch.where(ids == -1, -1, self.key.view(-1, w).index_select(0, uset))  # empty slots go first
        cand = cand.masked_fill(protect.view(-1, w).index_select(0, uset) | (ids == _DISABLED), _KEY_MAX)
        way_sorted = torch.full((m,), -1, dtype=torch.int64)
        for r in range(min(int(per_set.max()), w)):  # usually 1-3 rounds: few misses share a set
            best = cand.argmin(1)  # [S]
            free = cand.gather(1, best.unsqueeze(1)).squeeze(1) < _KEY_MAX
            sel = (rank == r).nonzero().squeeze(1)
            s = set_index.index_select(0, sel)
            way_sorted[sel] = torch.where(free.index_select(0, s), best.index_select(0, s), -1)
            cand.scatter_(1, best.unsqueeze(1), _KEY_MAX)  # taken
        slots = torch.empty(m, dtype=torch.int64)
        slots[order] = torch.where(way_sorted >= 0, sets_sorted * w + way_sorted, -1)
        placed = slots >= 0
        ps = slots[placed]
        evicted = torch.full_like(keys, -1)
        evicted_dirty = torch.zeros(m, dtype=torch.bool)
        evicted[placed] = self.id_of.index_select(0, ps)
        evicted_dirty[placed] = self.dirty.index_select(0, ps)
        self.id_of[ps] = keys[placed]
        self.key[ps] = self._new_keys(counts[placed], None)
        self.dirty[ps] = False
        return slots, evicted, evicted_dirty

    def resident_dirty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (slots [V], keys [V]) of resident dirty rows."""
        slots = (self.dirty & (self.id_of >= 0)).nonzero().squeeze(1)
        return slots, self.id_of[slots]

    def clear(self) -> None:
        """Forget every row (after the backing stores were replaced wholesale, e.g. from a checkpoint)."""
        self.id_of.masked_fill_(self.id_of >= 0, -1)
        self.key.zero_()
        self.dirty.zero_()
        self.pinned.zero_()

    def resident(self) -> torch.Tensor:
        """-> resident rows per table [T]."""
        present = (self.id_of >= 0).to(torch.int64)
        bounds = zip(self.slot_base[:-1], self.slot_base[1:], strict=True)
        return torch.tensor([int(present[a:b].sum()) for a, b in bounds], dtype=torch.int64)
