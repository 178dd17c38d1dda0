"""Tiered embedding shards under real gloo processes against one process with every table in memory.

Each rank places its local shards within small per-rank ``[memory]`` budgets (caches of a few percent of their
rows, so most lookups miss): host-cached or ssd-cached, LRU or LFU, every sharding type, SGD and row-wise
Adagrad. The cached tiers compute exactly what the in-memory shards compute (same values, same order of sums),
so a tiered run equals the same sharded run in memory bit for bit, and one process on the global batch within
1e-6 (the sharded run sums in another order). Column-wise shards with row-wise Adagrad are the one exception to
the second comparison: each shard keeps its own accumulator (as TorchRec's do), so they equal only the same
sharded run in memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_sharded import _plans
from test_sharded import _run as sharded_run

STEPS = 12
TOL = 1e-6
# (sharding, sparse optimizer, cache policy, tier)
CASES_2 = [("table_wise", "rowwise_adagrad", "lfu", "ssd"), ("row_wise", "rowwise_adagrad", "lru", "host"),
           ("column_wise", "sgd", "lfu", "host"), ("column_wise", "rowwise_adagrad", "lru", "ssd"),
           ("table_row_wise", "rowwise_adagrad", "lfu", "host"), ("table_row_wise", "sgd", "lru", "ssd"),
           ("data_parallel", "rowwise_adagrad", "lru", "host"), ("mixed", "sgd", "lru", "ssd")]
# 4 ranks: table_row_wise then spreads each table over the 2 ranks of one node (2 nodes of 2 ranks)
CASES_4 = [("mixed", "sgd", "lfu", "host"), ("row_wise", "rowwise_adagrad", "lru", "ssd"),
           ("table_row_wise", "rowwise_adagrad", "lru", "ssd"), ("column_wise", "sgd", "lru", "host")]
# Layouts whose sharded run differs from one process by design: a column-wise shard's row-wise Adagrad
# accumulator is the mean square of that shard's columns only (one accumulator per row per shard, as TorchRec
# keeps them; recstack/distributed/sharding.py), not of the whole row, so its steps differ from one process's.
# They are compared bit for bit with the same sharded run in memory, not with one process.
OWN_SHARD_STATE = {("column_wise", "rowwise_adagrad")}


def _memory(policy: str, tier: str, ssd_dir: Path, sharding: str, world: int) -> list[str]:
    """Per-rank budgets of a few KiB of device cache (a 1000-row table is 25% cached or less), beside the
    data-parallel tables (48.9 KiB all four, with row-wise Adagrad), which stay on the device. Column-wise
    shards hold DIM / world columns, so their budget shrinks with their rows' bytes."""
    device = 56_000 if sharding == "data_parallel" else 12_000 // world if sharding == "column_wise" else 6000
    out = [f'memory.device="{device}"', f'memory.cache_policy="{policy}"']
    if tier == "ssd":  # no host budget to speak of: every cached shard goes to a file
        out += ['memory.host="1"', f'memory.ssd_dir="{ssd_dir}"']
    return out


def _run(data: Path, opt: str, rank: int, world: int, placements=None, rpn=None, memory: tuple[str, ...] = ()
         ) -> dict:
    """``test_sharded``'s training run, STEPS steps -> its results and this rank's cache requests and hits."""
    cache: dict = {"requests": 0, "hits": 0}
    losses, auc, tables, _ = sharded_run(data, opt, rank, world, placements, rpn, extra=memory, steps=STEPS,
                                         cache=cache)
    return {"losses": losses, "auc": auc, "tables": tables, **cache}


def _checkpoint_case(rank: int, world: int, tmp: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Shards in host-cached tiers (LRU), trained a step and saved; loaded into another sharding in ssd-cached
    tiers (LFU) with other cache sizes. -> (loaded, saved) tables after the load and again after one more
    identical step on both (which reads the row-wise Adagrad state too)."""
    from test_sharded import _samples, _sparse_batch

    from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
    from recstack.distributed.tiered_shards import tiered_local
    from recstack.embedding.collection import TableConfig
    from recstack.embedding.sparse_optim import SparseOptimizerConfig
    from recstack.embedding.tiered.collection import TieredEmbeddingCollection
    from recstack.embedding.tiered.config import MemoryConfig
    from recstack.training.checkpoint.sharded import load_sharded, save_sharded

    tables = [TableConfig("a", 90, 8, (0,)), TableConfig("b", 40, 8, (1, 2)), TableConfig("c", 7, 8, (3,))]
    cfg = SparseOptimizerConfig("rowwise_adagrad", lr=0.1)
    host = tiered_local(MemoryConfig(device="900", cache_policy="lru"), rank, replicated_bytes=7 * 36)
    saved = ShardedEmbeddingCollection(tables, cfg, [("row_wise", [0, 1]), ("table_wise", [1]),
                                                     ("data_parallel", [0, 1])], 5, "cpu", local_collection=host)
    ssd = tiered_local(MemoryConfig(device="700", host="1", ssd_dir=str(tmp / "ssd_ckpt"), cache_policy="lfu"),
                       rank, replicated_bytes=7 * 36)
    loaded = ShardedEmbeddingCollection(tables, cfg, [("table_wise", [0]), ("row_wise", [1, 0]),
                                                      ("data_parallel", [0, 1])], 9, "cpu", local_collection=ssd)

    def step(coll: ShardedEmbeddingCollection, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        sparse = _samples(_sparse_batch(6, [90, 40, 40, 7], g, False, 3), 3 * rank, 3 * rank + 3)
        coll.train()
        (coll(sparse) * torch.randn(3, 4, 8, generator=g)).sum().backward()

    for coll in (saved, loaded):  # every rank holds its model-parallel shards in cached tiers
        assert all(isinstance(g, TieredEmbeddingCollection) for g in coll.groups.values())
    step(saved, 1)
    path = save_sharded(tmp / "ckpt", 1, saved, {})
    load_sharded(path, loaded, torch.device("cpu"))
    out = [(loaded.table_weight(t.name), saved.table_weight(t.name)) for t in tables]
    step(saved, 2)
    step(loaded, 2)
    return out + [(loaded.table_weight(t.name), saved.table_weight(t.name)) for t in tables]


def _worker(rank: int, world: int, init_file: str, data: str, out: str, cases: list, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results: dict = {}
        plans = _plans(world)
        for sharding, opt, policy, tier in cases:
            placements, rpn = plans[sharding]
            ssd = Path(tmp) / f"ssd_{world}_{sharding}_{opt}"
            name = f"{sharding}/{opt}/{policy}/{tier}"
            results[name] = {
                "memory": _run(Path(data), opt, rank, world, placements, rpn),
                "tiered": _run(Path(data), opt, rank, world, placements, rpn,
                               tuple(_memory(policy, tier, ssd, sharding, world))),
                "ssd_files": sorted(p.name for p in ssd.iterdir()) if ssd.is_dir() else [],
            }
        checkpoint = _checkpoint_case(rank, world, Path(tmp)) if world == 2 else []
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {k: (v["tiered"]["requests"], v["tiered"]["hits"])
                                          for k, v in results.items()})
        if rank == 0:
            torch.save({"results": results, "cache": gathered, "checkpoint": checkpoint}, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check(tmp_path: Path, data: Path, world: int, cases: list) -> None:
    out = tmp_path / f"res_{world}.pt"
    mp.spawn(_worker, args=(world, str(tmp_path / f"init_{world}"), str(data), str(out), cases, str(tmp_path)),
             nprocs=world, join=True)
    saved = torch.load(out, weights_only=False)
    refs = {opt: _run(data, opt, 0, 1) for opt in sorted({c[1] for c in cases})}
    for sharding, opt, policy, tier in cases:
        name = f"{sharding}/{opt}/{policy}/{tier}"
        res = saved["results"][name]
        mem, tiered, ref = res["memory"], res["tiered"], refs[opt]
        # the tiers change where rows live, never a value or the order of a sum: equal to the in-memory shards
        assert tiered["losses"] == mem["losses"], name
        assert tiered["auc"] == mem["auc"], name
        for t, m in zip(tiered["tables"], mem["tables"], strict=True):
            assert torch.equal(t, m), f"{name}: tables differ from the in-memory shards'"
        if (sharding, opt) in OWN_SHARD_STATE:  # by design not one process's steps (see OWN_SHARD_STATE): the
            # exception holds only while the difference is real
            assert not all(torch.allclose(t, r, atol=TOL, rtol=0) for t, r in zip(tiered["tables"], ref["tables"],
                                                                                   strict=True)), name
        else:  # and one process with every table in memory, up to the sharded run's order of sums
            assert tiered["losses"] == pytest.approx(ref["losses"], abs=TOL), name
            assert tiered["auc"] == pytest.approx(ref["auc"], abs=TOL), name
            for t, r in zip(tiered["tables"], ref["tables"], strict=True):
                torch.testing.assert_close(t, r, atol=TOL, rtol=0, msg=f"{name}: tables differ from one process's")
        requests = sum(c[name][0] for c in saved["cache"])
        hits = sum(c[name][1] for c in saved["cache"])
        if sharding == "data_parallel":  # replicated tables stay on the device: nothing cached
            assert requests == 0, name
        else:
            assert requests > 0 and hits < 0.5 * requests, f"{name}: {hits} hits of {requests}"
        if tier == "ssd" and sharding != "data_parallel":  # each rank's files in its own directory (a rank
            # whose shards all fit on the device has none)
            assert res["ssd_files"] and set(res["ssd_files"]) <= {f"rank_{r}" for r in range(world)}, name
    assert refs[cases[0][1]]["losses"][-1] < refs[cases[0][1]]["losses"][0]  # training moved at all
    for i, (got, want) in enumerate(saved["checkpoint"]):  # resharded across shardings and tiers, bit for bit
        assert torch.equal(got, want), f"checkpoint table {i % 3} differs ({'after' if i >= 3 else 'at'} load)"


def test_tiered_shards_two_ranks_match_one_process(tiny_dataset: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    _check(tmp_path, tiny_dataset, 2, CASES_2)


def test_tiered_shards_four_ranks_match_one_process(tiny_dataset: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    _check(tmp_path, tiny_dataset, 4, CASES_4)


if os.environ.get("RECSTACK_SKIP_DIST"):
    pytestmark = pytest.mark.skip("RECSTACK_SKIP_DIST set")
