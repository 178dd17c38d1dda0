"""Tiered embedding tables: the cache's bookkeeping, placement from budgets, and bit-identical training against
the all-in-memory fused collection for every tier, cache size and policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recstack.data.batch import SparseFeatures
from recstack.embedding import FusedEmbeddingBagCollection, SparseOptimizerConfig, TableConfig
from recstack.embedding.collection import init_table
from recstack.embedding.tiered import store as tiered_store
from recstack.embedding.tiered.cache import SetAssociativeCache, id_hash
from recstack.embedding.tiered.collection import TablePlacement, TieredEmbeddingCollection
from recstack.embedding.tiered.placement import format_plan, plan_placement
from recstack.embedding.tiered.store import SSDStore, init_chunks
from recstack.units import parse_bytes

# Table "b" is shared by features 1 and 3; the cached tables are "b" and "d".
TABLES = [TableConfig("a", 50, 8, (0,)), TableConfig("b", 300, 8, (1, 3)), TableConfig("c", 7, 8, (2,)),
          TableConfig("d", 1000, 8, (4,))]
FEATURE_ROWS = [50, 300, 7, 300, 1000]


class _Loaded:
    """What the data loader hands the hook: something with a ``sparse``."""

    def __init__(self, sparse: SparseFeatures) -> None:
        self.sparse = sparse


def _batches(n: int, batch: int, seed: int, weighted: bool = True) -> list[SparseFeatures]:
    """Multi-hot, skewed ids (a few rows hot, many rare), empty bags allowed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (len(FEATURE_ROWS), batch), generator=g)
        ids = torch.cat([(torch.rand(int(lengths[f].sum()), generator=g) ** 3 * r).long()
                         for f, r in enumerate(FEATURE_ROWS)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.reshape(-1).cumsum(0)])
        w = torch.rand(ids.numel(), generator=g) if weighted else None
        out.append(SparseFeatures(ids, offsets, len(FEATURE_ROWS), w))
    return out


def _train_pair(tier: str, cache_rows: int, policy: str, kind: str, tmp_path: Path, prefetch: bool = True):
    """Train the fused and a tiered collection on the same batches and upstream gradients; outputs must agree
    bit for bit at every step. -> (fused, tiered)."""
    opt = SparseOptimizerConfig(kind, 0.1, 1e-8, 0.01)
    ref = FusedEmbeddingBagCollection(TABLES, opt, seed=3)
    cached = TablePlacement(tier, cache_rows, policy)
    placements = [TablePlacement("device"), cached, TablePlacement("device"), cached]
    tc = TieredEmbeddingCollection(TABLES, opt, placements, seed=3, ssd_dir=tmp_path / "ssd", prefetch=prefetch)
    batches = _batches(10, 16, seed=0)
    hook = tc.next_batch_hook()
    assert (hook is not None) == prefetch
    g = torch.Generator().manual_seed(1)
    for i, b in enumerate(batches):
        if hook is not None:  # the loader thread runs ahead: announce this batch and the next one
            for ahead in batches[i : i + 2] if i == 0 else batches[i + 1 : i + 2]:
                hook(_Loaded(ahead))
        grad = torch.randn(16, len(FEATURE_ROWS), 8, generator=g)
        out_ref, out = ref(b), tc(b)
        assert torch.equal(out_ref, out), f"step {i}: pooled outputs differ"
        (out_ref * grad).sum().backward()
        (out * grad).sum().backward()
    return ref, tc


@pytest.mark.parametrize(("tier", "cache_rows", "kind"), [  # 1 row, ~5%, 20%, 100% of the larger table
    ("host-cached", 1, "sgd"), ("ssd-cached", 1, "rowwise_adagrad"),
    ("host-cached", 15, "rowwise_adagrad"), ("ssd-cached", 15, "sgd"),
    ("host-cached", 60, "sgd"), ("ssd-cached", 60, "rowwise_adagrad"),
    ("host-cached", 1000, "rowwise_adagrad"), ("ssd-cached", 1000, "sgd"),
])
def test_tiered_training_is_bit_identical(tier: str, cache_rows: int, kind: str, tmp_path: Path) -> None:
    ref, tc = _train_pair(tier, cache_rows, "lru" if tier == "host-cached" else "lfu", kind, tmp_path)
    acc_ref = ref.accumulator
    for i, t in enumerate(TABLES):
        w, acc = tc.table_state(t.name)
        assert torch.equal(w, ref.table_weight(t.name)), t.name
        if kind == "sgd":
            assert acc is None
        else:  # the optimizer state travelled with its rows through every eviction
            lo, hi = int(ref.table_offsets[i]), int(ref.table_offsets[i + 1])
            assert torch.equal(acc, acc_ref[lo:hi]), t.name
    stats = tc.cache_stats()
    assert set(stats) == {"b", "d"}
    if cache_rows == 1:  # a batch needs more rows than the cache holds: the rest went around it
        assert stats["d"]["staged"] > 0
    if cache_rows >= 60:
        assert stats["d"]["evictions"] > 0 or cache_rows >= 1000
        assert stats["d"]["hits"] > 0
    tc.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_prefetch_changes_nothing_but_when_rows_arrive(policy: str, tmp_path: Path) -> None:
    _, with_prefetch = _train_pair("host-cached", 60, policy, "rowwise_adagrad", tmp_path / "a", prefetch=True)
    _, without = _train_pair("host-cached", 60, policy, "rowwise_adagrad", tmp_path / "b", prefetch=False)
    for t in TABLES:
        assert torch.equal(with_prefetch.table_weight(t.name), without.table_weight(t.name))
    a, b = with_prefetch.counters.totals(), without.counters.totals()
    assert a["prefetch_seconds"] > 0 and b["prefetch_seconds"] == 0
    assert a["requests"] == b["requests"]  # every batch's distinct rows counted once, ahead or not


def test_prefetched_rows_are_not_reused_for_the_same_ids_in_other_bags() -> None:
    """A forward whose ids equal an announced batch's but whose bags differ (other features, other tables) must
    not take the rows that batch's prefetch resolved."""
    opt = SparseOptimizerConfig("sgd", 0.1)
    ref = FusedEmbeddingBagCollection(TABLES, opt, seed=3)
    cached = TablePlacement("host-cached", 64)
    tc = TieredEmbeddingCollection(TABLES, opt, [TablePlacement(), cached, TablePlacement(), cached], seed=3)
    hook = tc.next_batch_hook()
    first = SparseFeatures.from_dense_ids(torch.tensor([[7, 8, 1, 9, 10]]))
    announced = SparseFeatures(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 3, 4, 5]), 5)
    other_bags = SparseFeatures(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 0, 1, 2, 3, 5]), 5)
    hook(_Loaded(first))
    hook(_Loaded(announced))
    for coll in (ref, tc):
        coll(first).sum().backward()  # prefetches ``announced`` behind it
    with torch.no_grad():
        assert torch.equal(tc(other_bags), ref(other_bags))
    tc.close()


def test_two_forwards_before_backward_keep_rows_pinned(tmp_path: Path) -> None:
    """Gradient accumulation: the first batch's rows must survive the second batch's evictions until backward."""
    opt = SparseOptimizerConfig("sgd", 0.1)
    ref = FusedEmbeddingBagCollection(TABLES, opt, seed=5)
    p = TablePlacement("ssd-cached", 40, "lru")
    tc = TieredEmbeddingCollection(TABLES, opt, [p, p, p, p], seed=5, ssd_dir=tmp_path)
    b1, b2, b3 = _batches(3, 32, seed=7)
    for coll in (ref, tc):
        loss = coll(b1).square().sum() + coll(b2).sum()
        loss.backward()
        coll(b3).sum().backward()
    for t in TABLES:
        assert torch.equal(tc.table_weight(t.name), ref.table_weight(t.name)), t.name


def test_eval_forward_does_not_update(tmp_path: Path) -> None:
    opt = SparseOptimizerConfig("rowwise_adagrad", 0.1)
    p = TablePlacement("ssd-cached", 32, "lfu")
    tc = TieredEmbeddingCollection(TABLES, opt, [p] * 4, seed=1, ssd_dir=tmp_path)
    before = {t.name: tc.table_weight(t.name).clone() for t in TABLES}
    tc.eval()
    for b in _batches(4, 16, seed=2):
        tc(b)
    with torch.no_grad():
        tc.train()
        tc(_batches(1, 16, seed=3)[0])
    for t in TABLES:
        assert torch.equal(tc.table_weight(t.name), before[t.name])
        assert torch.equal(before[t.name], init_table(t, 1, TABLES.index(t)))
    assert sum(s["writebacks"] for s in tc.cache_stats().values()) == 0  # nothing was dirty


def test_out_of_range_id_names_the_table(tmp_path: Path) -> None:
    p = TablePlacement("host-cached", 32)
    tc = TieredEmbeddingCollection(TABLES, SparseOptimizerConfig(), [TablePlacement(), p, TablePlacement(), p])
    b = SparseFeatures.from_dense_ids(torch.tensor([[0, 1, 2, 3, 1000]]))
    with pytest.raises(ValueError, match="table 'd': id 1000 outside"):
        tc(b)


def _place(c: SetAssociativeCache, keys: list[int], protect: torch.Tensor | None = None):
    k = torch.tensor(keys)
    p = torch.zeros(c.num_slots, dtype=torch.bool) if protect is None else protect
    return c.place(k, c.table_of(k), torch.ones_like(k), p)


def test_lru_and_lfu_pick_their_victims() -> None:
    for policy, victim in (("lru", 3), ("lfu", 9)):
        c = SetAssociativeCache([100], [4], policy, ways=4)  # one set: every id competes for the same 4 slots
        slots, evicted, _ = _place(c, [3, 9, 12, 20])
        assert evicted.tolist() == [-1] * 4 and sorted(slots.tolist()) == [0, 1, 2, 3]
        for ids, uses in (([3], 5), ([9], 1), ([12, 20], 5)):  # 3: many uses long ago; 9: few uses, later
            c.next_tick()
            k = torch.tensor(ids)
            c.touch(c.lookup(k, c.table_of(k)), torch.full((len(ids),), uses))
        c.dirty[c.lookup(torch.tensor([victim]), torch.tensor([0]))] = True
        c.next_tick()
        slots, evicted, dirty = _place(c, [40])
        assert evicted.tolist() == [victim] and dirty.tolist() == [True], policy
        assert int(c.lookup(torch.tensor([40]), torch.tensor([0]))) == int(slots) >= 0
        assert int(c.lookup(torch.tensor([victim]), torch.tensor([0]))) == -1


def test_protected_slots_are_never_evicted() -> None:
    c = SetAssociativeCache([100], [8], "lru", ways=8)
    _place(c, list(range(8)))
    protect = torch.ones(8, dtype=torch.bool)
    protect[5] = False
    slots, evicted, _ = _place(c, [50, 51], protect)
    assert slots.tolist() == [5, -1]  # one slot could be taken, the other miss got none
    assert evicted.tolist() == [5, -1]
    assert c.id_of.tolist() == [0, 1, 2, 3, 4, 50, 6, 7]


def test_tables_keep_their_own_capacity() -> None:
    """Two tables in one cache: keys are offset per table, each table's capacity is exact (40 = 32 + 8 ways)."""
    c = SetAssociativeCache([1000, 50], [40, 3], "lru", ways=32)
    assert c.num_slots == 3 * 32 and c.capacities == [40, 3]
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        c.next_tick()
        keys = torch.cat([torch.randperm(1000, generator=g)[:20], 1000 + torch.randperm(50, generator=g)[:10]])
        keys = keys.sort().values
        tables = c.table_of(keys)
        hit = c.lookup(keys, tables) >= 0
        protect = torch.zeros(c.num_slots, dtype=torch.bool)
        slots, _, _ = c.place(keys[~hit], tables[~hit], torch.ones_like(keys[~hit]), protect)
        assert bool(((slots < 0) | (c.table_of(keys[~hit]) == (slots >= 64).long())).all())  # own sets only
    assert c.resident().tolist() == [40, 3]
    assert torch.equal(c.table_of(torch.tensor([0, 999, 1000, 1049])), torch.tensor([0, 0, 1, 1]))


def test_id_hash_spreads_consecutive_ids() -> None:
    counts = torch.bincount(torch.remainder(id_hash(torch.arange(32 * 1024)), 1024), minlength=1024)
    assert int(counts.max()) <= 2 * 32  # no set gets more than twice its share of a contiguous id range


def test_chunked_init_matches_init_table() -> None:
    t = TableConfig("x", 1001, 6, (0,))
    chunks = list(init_chunks(t, seed=4, index=2, width=7, acc_init=0.5, chunk_rows=97))
    rec = torch.cat(chunks)
    assert torch.equal(rec[:, :6], init_table(t, 4, 2))
    assert torch.equal(rec[:, 6], torch.full((1001,), 0.5))


@pytest.mark.parametrize("parallel", [False, True])
def test_ssd_store_log_compaction_and_files(parallel: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes append to the file's log; reads follow the newest copy (split over threads when large);
    compaction and save keep row order."""
    if parallel:
        monkeypatch.setattr(tiered_store, "PARALLEL_READ_MIN_RUNS", 2)
    expect = torch.arange(500, dtype=torch.float32).view(100, 5)
    s = SSDStore(100, 5, tmp_path, compact_ratio=0.5, io_threads=3)
    s.fill(iter([expect[:30], expect[30:]]))
    assert list(tmp_path.iterdir()) == []  # the table file has no name: nothing can outlive the process
    g = torch.Generator().manual_seed(0)
    for step in range(12):  # 12 x 10 rows appended: more than half a table, twice over
        ids = torch.randperm(100, generator=g)[:10]
        rec = torch.full((10, 5), float(-step)) - ids.unsqueeze(1).float()
        s.write(ids, rec)
        expect[ids] = rec
        probe = torch.randint(0, 100, (40,), generator=g)
        assert torch.equal(s.read(probe), expect[probe]), step
    assert s.compactions == 2 and s.end < 100 + 50
    s.save(tmp_path / "t.f32")
    t = SSDStore(100, 5, tmp_path / "other")
    t.load(tmp_path / "t.f32")
    assert torch.equal(t.read(torch.arange(100)), expect)
    (tmp_path / "short.f32").write_bytes(b"\0" * 12)
    with pytest.raises(ValueError, match="short.f32: 12 bytes, expected 2000"):
        t.load(tmp_path / "short.f32")
    s.close()
    t.close()


def test_parse_bytes() -> None:
    assert parse_bytes("") is None
    assert parse_bytes(1234) == 1234
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("40kb") == 40_000
    for bad in ("2 parsecs", "-3MB", "GB", True, -1):
        with pytest.raises(ValueError):
            parse_bytes(bad)  # type: ignore[arg-type]


def test_placement_from_budgets() -> None:
    tables = [TableConfig("small", 100, 16, (0,)), TableConfig("big", 100_000, 16, (1,)),
              TableConfig("mid", 10_000, 16, (2,)), TableConfig("shared", 18_000, 16, (3, 4))]
    rb = 64  # 16 float32
    total = sum(t.num_embeddings for t in tables) * rb
    assert all(p.tier == "device" for p in plan_placement(tables, rb, total))
    assert all(p.tier == "device" for p in plan_placement(tables, rb, None))
    # room for everything but "big": big gets a cache of the rest of the budget, its rows go to host memory
    budget = (100 + 10_000 + 18_000 + 5_000) * rb
    p = plan_placement(tables, rb, budget, host_budget=None)
    assert [x.tier for x in p] == ["device", "host-cached", "device", "device"]
    assert p[1].cache_rows == 5_000
    # a tight budget: small and the shared table (more lookups per byte than "mid") stay on the device; the
    # others get the same 5% of their rows as cache; host memory takes the smaller, the larger goes to the SSD
    budget = (100 + 18_000 + 5_500) * rb
    p = plan_placement(tables, rb, budget, host_budget=10_000 * rb, ssd_dir="/ssd", policy="lfu")
    assert [x.tier for x in p] == ["device", "ssd-cached", "host-cached", "device"]
    assert p[1].cache_rows == 5_000 and p[2].cache_rows == 500 and p[1].policy == "lfu"
    text = format_plan(tables, p, rb, budget, 10_000 * rb, "/ssd")
    assert "ssd-cached" in text and "5.0%" in text
    with pytest.raises(ValueError, match="table 'big'.*set memory.ssd_dir"):
        plan_placement(tables, rb, budget, host_budget=10_000 * rb)


def test_placement_stays_within_the_device_budget() -> None:
    """Caches raised to their minimum take their rows from the other caches, never from beyond the budget; a
    budget below the minimum caches gets smaller ones, and one without a row per cache is refused."""
    sizes = {"a": 50, "b": 300, "c": 7, "d": 1000}
    tables = [TableConfig(name, n, 8, (f,)) for f, (name, n) in enumerate(sizes.items())]
    rb = 36

    def used(p: list[TablePlacement]) -> int:
        rows = [t.num_embeddings if x.tier == "device" else x.cache_rows for t, x in zip(tables, p, strict=True)]
        return rb * sum(rows)

    p = plan_placement(tables, rb, 4392)  # a and c stay (2052 bytes); 65 rows of cache are left for b and d
    assert [x.tier for x in p] == ["device", "host-cached", "device", "host-cached"]
    assert (p[1].cache_rows, p[3].cache_rows) == (32, 33)  # b's 5% share is below its 32-row minimum
    assert used(p) == 4392
    p = plan_placement(tables, rb, 40 * rb)  # less than the minimum caches (103 rows): nothing stays
    assert all(x.tier == "host-cached" and x.cache_rows >= 1 for x in p)
    assert used(p) <= 40 * rb
    for too_small in (0, 4 * rb - 1):
        with pytest.raises(ValueError, match="less than one row .* for each of the 4 tables"):
            plan_placement(tables, rb, too_small)
