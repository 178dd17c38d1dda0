"""The planner's cache hit-rate model (``recstack.distributed.planner.hit_rate``) against simulated caches: a
fully associative LRU over single ids (Che's approximation), a perfect LFU (the top C rows by count so far), and
the set-associative LRU / LFU cache that tiered tables use (``recstack.embedding.tiered.cache``), fed batches of
ids drawn from the synthetic generator's Zipf law."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from recstack.data.synth.generate import SynthConfig
from recstack.data.synth.zipf import fit_zipf_exponent, zipf_ranks
from recstack.distributed.planner.hit_rate import SYNTH_ZIPF_EXPONENT, ZipfRows, che_time, estimate_cache
from recstack.embedding.tiered.cache import SetAssociativeCache

CASES = [(100_000, 1.1, 5_000, 2048), (100_000, 0.8, 10_000, 2048), (50_000, 1.2, 1_000, 512)]


def _batches(n: int, s: float, ids: int, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield zipf_ranks(rng.random(ids), n, s)


def _set_associative(n: int, s: float, cache_rows: int, ids: int, policy: str, steps: int = 300,
                     warm: int = 150) -> float:
    """Hit rate (hits / distinct rows per batch, after ``warm`` batches) of the tiered tables' cache, driven as
    the tiered collection drives it: tick, look up, touch the hits, place the misses around them."""
    cache = SetAssociativeCache([n], [cache_rows], policy)
    requests = hits = 0
    for b, ids_np in enumerate(_batches(n, s, ids, steps)):
        keys, counts = torch.unique(torch.from_numpy(ids_np), return_counts=True)
        tables = torch.zeros_like(keys)
        cache.next_tick()
        slots = cache.lookup(keys, tables)
        hit = slots >= 0
        cache.touch(slots[hit], counts[hit])
        protect = torch.zeros(cache.num_slots, dtype=torch.bool)
        protect[slots[hit]] = True
        cache.place(keys[~hit], tables[~hit], counts[~hit], protect)
        if b >= warm:
            requests += len(keys)
            hits += int(hit.sum())
    return hits / requests


def _perfect_lfu(n: int, s: float, cache_rows: int, ids: int, steps: int = 150, history: int = 4_000_000) -> float:
    """Each batch hits the rows among the ``cache_rows`` most requested so far (per distinct row), after a
    history of ``history`` ids (a short one ranks the rows near the cache's edge by noise)."""
    counts = np.bincount(zipf_ranks(np.random.default_rng(2).random(history), n, s), minlength=n).astype(float)
    requests = hits = 0
    for batch in _batches(n, s, ids, steps):
        rows = np.unique(batch)
        top = np.argpartition(-counts, cache_rows)[:cache_rows]
        requests += len(rows)
        hits += int(np.isin(rows, top).sum())
        np.add.at(counts, batch, 1)
    return hits / requests


def _lru_ids(n: int, s: float, cache_rows: int, total: int = 300_000, warm: int = 100_000) -> float:
    """A fully associative LRU over single ids; the hit rate per id after ``warm`` ids."""
    ids = zipf_ranks(np.random.default_rng(1).random(total), n, s)
    resident: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for i, x in enumerate(ids.tolist()):
        if x in resident:
            resident.move_to_end(x)
            hits += i >= warm
        else:
            resident[x] = None
            if len(resident) > cache_rows:
                resident.popitem(last=False)
    return hits / (total - warm)


def test_default_exponent_is_the_synthetic_generators() -> None:
    assert SYNTH_ZIPF_EXPONENT == SynthConfig().zipf_exponent


def test_bins_hold_the_whole_law() -> None:
    for rows in (1, 7, 1024, 1025, 94_000_000):
        law = ZipfRows(rows, 1.1)
        assert law.width.sum() == pytest.approx(rows)
        assert (law.width * law.p).sum() == pytest.approx(1.0)
        assert np.all(np.diff(law.p) <= 1e-18)  # popularity order


@pytest.mark.parametrize("n,s,cache_rows,ids", CASES)
def test_che_approximation_matches_a_simulated_lru_over_ids(n, s, cache_rows, ids) -> None:
    model = estimate_cache(n, s, cache_rows, 0.0, "lru").id_hit_rate
    assert model == pytest.approx(_lru_ids(n, s, cache_rows), abs=0.01)


@pytest.mark.parametrize("n,s,cache_rows,ids", CASES)
def test_batch_hit_rates_match_the_tiered_tables_cache(n, s, cache_rows, ids) -> None:
    """LRU: Che's approximation per batch within 0.01 of the 32-way cache. LFU: the model is a perfect LFU,
    within 0.01 of a simulated one; the 32-way cache with counts kept only while a row is resident gets less,
    by at most 0.06 (the planner's LFU figures are that much optimistic)."""
    lru = estimate_cache(n, s, cache_rows, ids, "lru")
    assert lru.hit_rate == pytest.approx(_set_associative(n, s, cache_rows, ids, "lru"), abs=0.01)
    lfu = estimate_cache(n, s, cache_rows, ids, "lfu")
    assert lfu.hit_rate == pytest.approx(_perfect_lfu(n, s, cache_rows, ids), abs=0.01)
    measured = _set_associative(n, s, cache_rows, ids, "lfu")
    assert 0 <= lfu.hit_rate - measured <= 0.06
    assert lfu.hit_rate > lru.hit_rate  # a stationary law: frequency beats recency


def test_lfu_is_the_zipf_mass_of_the_top_rows_and_limits_hold() -> None:
    from recstack.data.synth.zipf import zipf_mass_below

    for c in (1, 100, 1000, 5000, 77_777):
        e = estimate_cache(100_000, 1.1, c, 0.0, "lfu")
        assert e.id_hit_rate == pytest.approx(float(zipf_mass_below(np.array([c]), 100_000, 1.1)[0]), rel=1e-6)
    assert estimate_cache(1000, 1.1, 1000, 512, "lru").hit_rate == 1.0
    assert estimate_cache(1000, 0.0, 0, 512, "lfu").misses == pytest.approx(estimate_cache(1000, 0.0, 0, 512,
                                                                                             "lfu").requests)
    uniform = estimate_cache(10_000, 0.0, 2_500, 0.0, "lru")  # uniform ids: the cache's share of the rows
    assert uniform.id_hit_rate == pytest.approx(0.25, rel=1e-6)
    # hit rates grow with the cache, for both policies
    for policy in ("lru", "lfu"):
        rates = [estimate_cache(100_000, 1.0, c, 2048, policy).hit_rate for c in (100, 1000, 10_000, 50_000)]
        assert rates == sorted(rates) and rates[0] < rates[-1]


def test_a_row_shard_with_a_fraction_of_the_cache_behaves_like_the_table() -> None:
    whole = estimate_cache(1_000_000, 1.1, 40_000, 4096, "lru")
    quarter = estimate_cache(1_000_000, 1.1, 10_000, 4096, "lru", fraction=0.25)
    assert quarter.hit_rate == pytest.approx(whole.hit_rate, rel=1e-9)
    assert quarter.requests == pytest.approx(whole.requests / 4, rel=1e-9)
    law = ZipfRows(1_000_000, 1.1)
    tau = che_time(law, 40_000)
    assert (law.width * -np.expm1(-law.p * tau)).sum() == pytest.approx(40_000, rel=1e-6)


@pytest.mark.parametrize("s", [0.8, 1.1, 1.3])
def test_zipf_fit_recovers_the_generators_exponent(s) -> None:
    counts = np.bincount(zipf_ranks(np.random.default_rng(0).random(500_000), 100_000, s), minlength=100_000)
    # the generator's head is marginally flatter than an exact Zipf law: the fit lands a little below s
    assert fit_zipf_exponent(counts) == pytest.approx(s, abs=0.05)
    assert fit_zipf_exponent(np.ones(1000) * 50) == pytest.approx(0.0, abs=1e-9)
    assert fit_zipf_exponent(np.array([3])) == 0.0
