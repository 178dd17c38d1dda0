"""Embedding tables larger than memory: per-table storage tiers with a software-managed cache.

Each table has a tier:

- ``device``: all rows in the compute buffer (device memory);
- ``host-cached``: a cache of ``cache_rows`` rows in the compute buffer over all rows in host memory;
- ``ssd-cached``: a cache of ``cache_rows`` rows in the compute buffer over all rows in a file on disk (on a
  CPU machine the compute buffer is RAM, so this is a cache in RAM over the SSD).

The compute buffer is one tensor [device rows + cache slots + staging, D] (and its row-wise Adagrad
accumulator [same]), so a batch is looked up and updated exactly like ``FusedEmbeddingBagCollection`` does, one
``embedding_bag`` and one fused optimizer step, only on buffer rows instead of table rows. Before the lookup,
the rows the batch needs are made resident (``SetAssociativeCache`` picks slots for every cached table in one
pass; evicted dirty rows are written back to their store first); a row whose set has no evictable slot left
goes to a staging area for that one batch and is written back after it. The values and the order of every sum
are those of the all-in-memory collection, so training is bit-identical to it for any tier and cache size.

A training batch's rows are pinned (never evicted) until its backward has applied the update. When the trainer
announces batches (``next_batch_hook``, called by the data loader's thread as it prepares them), the next
batch's rows are fetched in a background thread while the current batch computes; only unpinned slots are
evicted, and rows the current batch staged are left for the next forward pass, so prefetching never changes a
result. Checkpoints and whole-table access are in ``files.py``; rows given to new ids (dynamic id tables,
``reset_rows``) in ``reset.py``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from recstack.data.batch import Batch, SparseFeatures, feature_bounds
from recstack.embedding.collection import EmbeddingCollection, TableConfig, init_table
from recstack.embedding.fused import TableInit, _FusedLookup
from recstack.embedding.sparse_optim import SparseOptimizerConfig
from recstack.embedding.tiered.cache import POLICIES, CacheCounters, SetAssociativeCache
from recstack.embedding.tiered.files import CHUNK_ROWS, TableFilesMixin
from recstack.embedding.tiered.reset import RowResetMixin
from recstack.embedding.tiered.store import (
    HostStore,
    RowStore,
    SSDStore,
    init_chunks,
    init_chunks_of,
    record_width,
)
from recstack.errors import ConfigError

TIERS = ("device", "host-cached", "ssd-cached")


@dataclass(frozen=True)
class TablePlacement:
    """Where one table lives. ``cache_rows`` is used by the cached tiers only."""

    tier: str = "device"
    cache_rows: int = 0
    policy: str = "lru"

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier {self.tier!r}: expected one of {', '.join(TIERS)}")
        if self.tier != "device" and self.cache_rows < 1:
            raise ValueError(f"a {self.tier} table needs cache_rows >= 1, got {self.cache_rows}")
        if self.policy not in POLICIES:
            raise ValueError(f"cache policy {self.policy!r}: expected one of {', '.join(POLICIES)}")


@dataclass
class _Hint:
    """A batch the loader has prepared: its ids [N] and offsets [F*B+1] on the CPU."""

    ids: torch.Tensor
    offsets: torch.Tensor
    prefetched: bool = False
    # What the prefetch resolved: (positions of cached ids [n], inverse [n], buffer rows of the distinct keys
    # [U]) and the cache's request count right after; still valid if no request has run since.
    resolved: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    stamp: int = -1


class _CacheLog:
    """``pop()`` -> cache counters over all tables since the last pop (the trainer logs them per step)."""

    def __init__(self, counters: CacheCounters) -> None:
        self._counters = counters
        self._last: dict[str, float] = {}

    def pop(self) -> dict[str, float]:
        now = self._counters.totals()
        keys = ("requests", "hits", "staged", "late", "writebacks", "fetch_seconds", "prefetch_seconds")
        out = {f"cache_{k}": now[k] - self._last.get(k, 0.0) for k in keys}
        self._last = now
        return out


def refuse_tiers(optimizer: SparseOptimizerConfig) -> None:
    """Cached tiers keep SGD's or row-wise Adagrad's state with each row (a record of D + 1 values) and update
    the rows a step touches; Adam's 2 D + 1 values per row and a pass over every row each step are not there
    yet: a ConfigError naming the keys."""
    if optimizer.kind == "adam":
        raise ConfigError('optim.sparse = "adam" cannot be combined with memory tiers ([memory] device / host '
                          'budgets, or a plan that places shards in cached tiers): use "rowwise_adagrad" or "sgd" '
                          "there, or hold the tables in memory (no [memory] budgets)")
    if optimizer.weight_decay_mode == "all_rows":
        raise ConfigError('optim.sparse_weight_decay_mode = "all_rows" cannot be combined with memory tiers '
                          "([memory] device / host budgets, or a plan that places shards in cached tiers): it "
                          'steps every row each step; use "touched" there, or hold the tables in memory')


class TieredEmbeddingCollection(TableFilesMixin, RowResetMixin, EmbeddingCollection):
    """Pooled lookups [B, F, D] over tables placed on device, host-cached or ssd-cached tiers."""

    stores_rows_in_files = True
    # buffers, declared for the type checker (nn.Module's __getattr__ would type them Tensor | Module)
    weight: torch.Tensor  # [R, D]
    accumulator: torch.Tensor | None  # [R]

    def __init__(
        self,
        tables: list[TableConfig],
        optimizer: SparseOptimizerConfig,
        placements: Sequence[TablePlacement],
        seed: int = 0,
        device: torch.device | str = "cpu",
        ssd_dir: str | Path | None = None,
        prefetch: bool = True,
        ways: int = 32,
        init: TableInit | None = None,
    ) -> None:
        """Rows of ``init_table`` with ``seed``, or from ``init`` when given (``init(i, out)`` writes table i's
        initial rows into ``out`` [rows, D]: a sharded collection's local shards hold blocks of whole tables)."""
        super().__init__(tables, optimizer)
        if len(placements) != len(tables):
            raise ValueError(f"{len(placements)} placements for {len(tables)} tables")
        refuse_tiers(optimizer)
        self.placements = list(placements)
        self.device = torch.device(device)
        self.prefetch_enabled = prefetch
        d = self.embedding_dim
        self.width = record_width(d, self.optimizer.needs_accumulator)
        acc_init = optimizer.initial_accumulator_value
        cached = [i for i, p in enumerate(placements) if p.tier != "device"]
        if any(placements[i].tier == "ssd-cached" for i in cached) and not ssd_dir:
            raise ValueError("ssd-cached tables need an ssd_dir (memory.ssd_dir)")
        policies = {placements[i].policy for i in cached}
        if len(policies) > 1:
            raise ValueError(f"cached tables share one cache and one policy, got {sorted(policies)}")
        # Compute buffer: device tables, then the cache's slots, then staging rows.
        self._offsets = [0] * len(tables)
        row = 0
        for i, p in enumerate(placements):
            if p.tier == "device":
                self._offsets[i], row = row, row + tables[i].num_embeddings
        self._cache_base = row
        self.cached_tables = cached  # table indices, in the cache's table order
        self._cache = SetAssociativeCache([tables[i].num_embeddings for i in cached],
                                          [placements[i].cache_rows for i in cached],
                                          policies.pop() if policies else "lru", ways)
        self._stores: list[RowStore] = []
        for i in cached:
            t = tables[i]
            if placements[i].tier == "host-cached":
                store: RowStore = HostStore(t.num_embeddings, self.width, pin_memory=self.device.type == "cuda")
            else:
                directory = Path(ssd_dir)  # type: ignore[arg-type]
                store = SSDStore(t.num_embeddings, self.width, directory, name=t.name)
            if init is None:
                store.fill(init_chunks(t, seed, i, self.width, acc_init, CHUNK_ROWS))
            elif isinstance(store, HostStore):  # straight into the store's records
                init(i, store.data[:, :d])
                if self.width > d:
                    store.data[:, d] = acc_init
            else:  # one shard-sized block, written to the file in chunks
                block = torch.empty(t.num_embeddings, d)
                init(i, block)
                store.fill(init_chunks_of(block, self.width, acc_init, CHUNK_ROWS))
            self._stores.append(store)
        self._fixed_rows = row + self._cache.num_slots
        weight = torch.zeros(self._fixed_rows, d, device=self.device)
        for i, p in enumerate(placements):
            if p.tier == "device":
                rows = weight[self._offsets[i] : self._offsets[i] + tables[i].num_embeddings]
                if init is not None:
                    init(i, rows)
                else:
                    rows.copy_(init_table(tables[i], seed, i))
        self.register_buffer("weight", weight, persistent=False)  # [R, D]
        acc = None
        if self.optimizer.needs_accumulator:
            acc = torch.full((self._fixed_rows,), acc_init, device=self.device)
        self.register_buffer("accumulator", acc, persistent=False)  # [R] or None
        # Per feature: buffer offset (device tables), whether it is cached, its first cache key, its table's rows.
        part = {t: k for k, t in enumerate(cached)}
        ft = self.feature_table
        self._feature_offsets = torch.tensor([self._offsets[t] for t in ft], dtype=torch.int64)
        self._feature_cached = torch.tensor([t in part for t in ft])
        self._feature_key_base = torch.tensor([int(self._cache.key_base[part[t]]) if t in part else 0 for t in ft])
        self._feature_rows = torch.tensor([tables[t].num_embeddings for t in ft], dtype=torch.int64)
        self._anchor = torch.zeros(0, device=self.device)
        self._stage_capacity = 0  # staging rows allocated after the fixed rows
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (keys, buffer rows) of unfinished batches
        self._staged_dirty = False
        self._inflight = 0  # training forwards whose backward has not run yet: their rows stay pinned
        self._hints: deque[_Hint] = deque()
        self._hint_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._needs_restore = False
        self._requests = 0  # calls of _ensure: a prefetch's result is reusable while this has not moved
        self.counters = CacheCounters(len(cached))
        self.stats = _CacheLog(self.counters)

    # -- lookup ----------------------------------------------------------------------------------------
    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        if sparse.num_features != self.num_features:
            raise ValueError(f"got {sparse.num_features} sparse features, collection has {self.num_features}")
        if self._needs_restore:
            raise RuntimeError("tiered tables were loaded from a state dict without their table files: "
                               "call restore_files(checkpoint_dir) first")
        self._wait_prefetch()
        if self._inflight == 0:
            self._release()
        ids, offsets = sparse.ids.cpu(), sparse.offsets.cpu()
        hint, nxt = self._match_hint(ids, offsets)
        training = self.training and torch.is_grad_enabled()
        rows = self._resolve(ids, offsets, hint, training)
        if training:
            self._inflight += 1
        if nxt is not None and self.prefetch_enabled:
            self._start_prefetch(nxt)
        rows = rows.to(self.device, non_blocking=True)
        b, f = sparse.batch_size, sparse.num_features
        if training:
            anchor = self._anchor.detach().requires_grad_()
            pooled = _FusedLookup.apply(anchor, self, rows, sparse.offsets, sparse.weights)
        else:
            pooled = F.embedding_bag(rows, self.weight, sparse.offsets, mode="sum",
                                     per_sample_weights=sparse.weights, include_last_offset=True)
        return pooled.view(f, b, self.embedding_dim).transpose(0, 1)  # [F*B, D] -> [B, F, D]

    def defer_updates(self) -> None:
        """Refused: a kept update names compute-buffer rows, whose cache slots the prefetch of the next batch
        may reassign before the training step applies it."""
        raise ConfigError("optim.max_grad_norm cannot be combined with memory tiers ([memory] device / host "
                          "budgets, or a plan that places shards in cached tiers): set optim.max_grad_norm = 0 "
                          "there, or hold the tables in memory")

    def apply_gradients(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Called from backward: rows [N] of the compute buffer, grads [N, D] -> one optimizer update."""
        state = {"accumulator": self.accumulator} if self.accumulator is not None else {}
        self.optimizer.step(self.weight, state, rows, grads)
        self._inflight = max(0, self._inflight - 1)

    def _cache_keys(self, ids: torch.Tensor, per_feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [N] (feature-major), ids per feature [F] -> (positions [n] of ids of cached tables, their keys [n])."""
        n = ids.numel()
        pos = self._feature_cached.repeat_interleave(per_feature, output_size=n).nonzero().squeeze(1)
        if pos.numel() == 0:
            return pos, pos
        feature = torch.arange(self.num_features).repeat_interleave(per_feature, output_size=n).index_select(0, pos)
        local = ids.index_select(0, pos)
        bad = (local < 0) | (local >= self._feature_rows.index_select(0, feature))
        if bool(bad.any()):
            k = int(bad.nonzero()[0])
            t = self.tables[self.feature_table[int(feature[k])]]
            raise ValueError(f"table {t.name!r}: id {int(local[k])} outside [0, {t.num_embeddings})")
        return pos, local + self._feature_key_base.index_select(0, feature)

    def _resolve(
        self, ids: torch.Tensor, offsets: torch.Tensor, hint: _Hint | None, training: bool
    ) -> torch.Tensor:
        """Make a batch's rows resident and pin them -> compute-buffer rows [N] (CPU)."""
        per_feature = feature_bounds(offsets, self.num_features).diff()  # [F]
        rows = ids + self._feature_offsets.repeat_interleave(per_feature, output_size=ids.numel())
        if hint is not None and hint.resolved is not None and hint.stamp == self._requests:
            pos, inverse, buf = hint.resolved  # prefetched whole, nothing evicted since: no work left here
        else:
            pos, keys = self._cache_keys(ids, per_feature)
            inverse = buf = keys
            if keys.numel():
                uniq, inverse, counts = torch.unique(keys, sorted=True, return_inverse=True, return_counts=True)
                late = hint is not None and hint.prefetched
                buf = self._ensure(uniq, counts, staging=True, exclude=None, late=late)
        if pos.numel():
            rows[pos] = buf.index_select(0, inverse)
            slots = buf - self._cache_base
            slots = slots[(slots >= 0) & (slots < self._cache.num_slots)]
            self._cache.pinned[slots] = True
            if training:  # marked now, not in backward, so the prefetch thread never races on the flags
                self._cache.dirty[slots] = True
        self._staged_dirty = self._staged_dirty or training
        return rows

    def _ensure(
        self, uniq: torch.Tensor, counts: torch.Tensor, staging: bool, exclude: torch.Tensor | None, late: bool
    ) -> torch.Tensor:
        """Bring distinct keys [U] (sorted) into the cache -> compute-buffer rows [U] (-1: not fetched, only
        without ``staging``). Evicted dirty rows are written back before their slots are reused."""
        t0 = time.perf_counter()
        self._requests += 1
        c, base = self._cache, self._cache_base
        tables = c.table_of(uniq)
        c.next_tick()
        slots = c.lookup(uniq, tables)
        hit = slots >= 0
        hit_slots = slots[hit]
        c.touch(hit_slots, counts[hit])
        out = torch.where(hit, slots + base, -1)
        miss = (~hit).nonzero().squeeze(1)
        if exclude is not None and exclude.numel():
            miss = miss[~torch.isin(uniq[miss], exclude)]
        if staging and self._staged and miss.numel():  # a pending batch staged some: use that copy, not a second
            found, srows = self._find_staged(uniq[miss])
            out[miss[found]] = srows[found]
            hit[miss[found]] = True
            miss = miss[~found]
        if not late:
            self.counters.add("requests", tables)
            self.counters.add("hits", tables[hit])
        if miss.numel():
            protect = c.pinned.clone()
            protect[hit_slots] = True
            new, old, old_dirty = c.place(uniq[miss], tables[miss], counts[miss], protect)
            placed = new >= 0
            wb = placed & old_dirty & (old >= 0)
            if bool(wb.any()):
                self._write_back(old[wb], new[wb] + base)
            fetch = miss[placed]
            if fetch.numel():
                self._fetch(uniq[fetch], new[placed] + base)
                out[fetch] = new[placed] + base
            self.counters.add("evictions", c.table_of(old[placed & (old >= 0)]))
            rest = miss[~placed]
            if staging and rest.numel():
                out[rest] = self._stage(uniq[rest])
                self.counters.add("staged", tables[rest])
            if late:  # rows of a prefetched batch that still had to come in now
                self.counters.add("late", tables[torch.cat([fetch, rest])] if staging else tables[fetch])
        self.counters.add_time(time.perf_counter() - t0, ahead=not staging)
        return out

    # -- moving rows between the compute buffer and the stores ------------------------------------------
    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Compute-buffer rows [V] -> records [V, width] on the CPU (weights, then the accumulator)."""
        r = rows.to(self.device)
        w = self.weight.index_select(0, r)
        if self.accumulator is not None:
            w = torch.cat([w, self.accumulator.index_select(0, r).unsqueeze(1)], 1)
        return w.cpu()

    def _scatter(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        r, rec = rows.to(self.device), records.to(self.device, non_blocking=True)
        d = self.embedding_dim
        self.weight[r] = rec[:, :d]  # rows are distinct; indexed assignment is much cheaper than index_copy_
        if self.accumulator is not None:
            self.accumulator[r] = rec[:, d]

    def _by_table(self, keys: torch.Tensor) -> list[tuple[int, int, int]]:
        """Sorted keys [V] -> (cached table, start, end) of each table's run."""
        cuts = torch.searchsorted(keys, self._cache.key_base).tolist()
        return [(t, cuts[t], cuts[t + 1]) for t in range(len(self._stores)) if cuts[t + 1] > cuts[t]]

    def _fetch(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Read sorted keys [M] from their stores into compute-buffer rows [M]."""
        kb = self._cache.key_base
        parts = [self._stores[t].read(keys[a:b] - kb[t]) for t, a, b in self._by_table(keys)]
        self._scatter(rows, parts[0] if len(parts) == 1 else torch.cat(parts))

    def _write_back(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Write compute-buffer rows [V] to their stores under keys [V] (any order)."""
        keys, order = torch.sort(keys)
        records = self._gather(rows[order])
        kb = self._cache.key_base
        for t, a, b in self._by_table(keys):
            self._stores[t].write(keys[a:b] - kb[t], records[a:b])
        self.counters.add("writebacks", self._cache.table_of(keys))

    def _stage(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows that found no slot: fetched into staging rows for this batch only -> their buffer rows [n]."""
        used = sum(int(r.numel()) for _, r in self._staged)
        need = used + keys.numel()
        if need > self._stage_capacity:  # grow (only here, on the training thread, with no prefetch running)
            new_cap = max(need, 2 * self._stage_capacity, 64)
            extra = self._fixed_rows + new_cap - self.weight.shape[0]
            self.weight = torch.cat([self.weight, self.weight.new_zeros(extra, self.embedding_dim)])
            if self.accumulator is not None:
                self.accumulator = torch.cat([self.accumulator, self.accumulator.new_zeros(extra)])
            self._stage_capacity = new_cap
        rows = torch.arange(self._fixed_rows + used, self._fixed_rows + need)
        self._fetch(keys, rows)
        self._staged.append((keys, rows))
        return rows

    def _find_staged(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys [M] -> (found [M] bool, their staging rows [M] where found)."""
        st_keys, order = torch.sort(torch.cat([k for k, _ in self._staged]))
        st_rows = torch.cat([r for _, r in self._staged])[order]
        pos = torch.searchsorted(st_keys, keys).clamp(max=st_keys.numel() - 1)
        found = st_keys[pos] == keys
        return found, torch.where(found, st_rows[pos], -1)

    def _release(self) -> None:
        """Between batches: write staged rows back (when a training batch may have changed them), unpin."""
        if self._staged_dirty:
            for keys, rows in self._staged:
                self._write_back(keys, rows)
        self._staged.clear()
        self._staged_dirty = False
        self._cache.pinned.zero_()

    # -- prefetch --------------------------------------------------------------------------------------
    def next_batch_hook(self) -> Callable[[Batch], Batch] | None:
        """A function for the data loader to call on each batch as it is prepared (in its own thread, ahead of
        training): it records the batch's ids so their rows can be fetched while the batch before it computes.
        None when nothing is cached or prefetching is off."""
        hook = self.ids_hook()
        if hook is None:
            return None

        def announce(batch: Batch) -> Batch:
            hook(batch.sparse)
            return batch

        return announce

    def ids_hook(self) -> Callable[[SparseFeatures], None] | None:
        """Records the ids of a coming forward (``next_batch_hook`` for what they are for)."""
        if not (self.prefetch_enabled and self.cached_tables):
            return None

        def announce(s: SparseFeatures) -> None:
            with self._hint_lock:
                self._hints.append(_Hint(s.ids.cpu(), s.offsets.cpu()))
                while len(self._hints) > 64:  # batches that were loaded but never trained (a stopped epoch)
                    self._hints.popleft()

        return announce

    def _match_hint(self, ids: torch.Tensor, offsets: torch.Tensor) -> tuple[_Hint | None, _Hint | None]:
        """The announced batch this forward computes (dropping older ones) and the one after it, if known.
        ids [N], offsets [F*B+1]: both must match, since the same ids split into other bags belong to other
        features (other tables) and a prefetch's resolved rows would then be wrong."""
        with self._hint_lock:
            for i, h in enumerate(self._hints):
                same_ids = h.ids is ids or (h.ids.shape == ids.shape and torch.equal(h.ids, ids))
                if same_ids and h.offsets.shape == offsets.shape and torch.equal(h.offsets, offsets):
                    for _ in range(i + 1):
                        self._hints.popleft()
                    return h, (self._hints[0] if self._hints else None)
        return None, None

    def _start_prefetch(self, hint: _Hint) -> None:
        # Rows the current batch staged are being updated by its backward: the next forward fetches them.
        exclude = torch.cat([k for k, _ in self._staged]) if self._staged else None
        if self._pool is None:  # its thread works on this collection's GPU (a new thread's current one is cuda:0)
            on_gpu = self.device.type == "cuda"
            # typeshed ties initializer and initargs by their types; a conditional pair does not type
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="embedding-prefetch",
                                            initializer=torch.cuda.set_device if on_gpu else None,  # type: ignore[arg-type]
                                            initargs=(self.device,) if on_gpu else ())  # type: ignore[arg-type]
        self._pending = self._pool.submit(self._prefetch, hint, exclude)

    def _prefetch(self, hint: _Hint, exclude: torch.Tensor | None) -> None:
        per_feature = feature_bounds(hint.offsets, self.num_features).diff()  # [F]
        pos, keys = self._cache_keys(hint.ids, per_feature)
        if keys.numel():
            uniq, inverse, counts = torch.unique(keys, sorted=True, return_inverse=True, return_counts=True)
            buf = self._ensure(uniq, counts, staging=False, exclude=exclude, late=False)
            if bool((buf >= 0).all()):
                hint.resolved = (pos, inverse, buf)
        else:
            hint.resolved = (pos, keys, keys)
        hint.stamp = self._requests
        hint.prefetched = True

    def _wait_prefetch(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises what the prefetch thread hit

    def cache_stats(self) -> dict[str, dict[str, float]]:
        """Per cached table: counters and hit rate since construction (or ``reset_cache_stats``), its capacity
        and resident rows. Fetch times are in ``counters.totals()``."""
        resident = self._cache.resident().tolist()
        return {self.tables[i].name: {**self.counters.table(k), "capacity": self._cache.capacities[k],
                                      "resident": resident[k]} for k, i in enumerate(self.cached_tables)}

    def reset_cache_stats(self) -> None:
        self.counters.reset()

    def pop_counters(self) -> dict[str, float]:
        return self.stats.pop()

    def close(self) -> None:
        """Stop the prefetch thread and release the stores' files."""
        self._wait_prefetch()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for s in self._stores:
            s.close()
