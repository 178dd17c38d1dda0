"""Where each rank's shards live under torchrun: from a plan file's per-shard storage, or from the per-rank
``[memory]`` budgets; bad budgets stop every rank before any training step, with an error naming the field, the
shard and the rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import cli_train, run_cli, torchrun, train_args
from test_tiered_checkpoint import COMMON, LAYOUT, _same_end, _tiers, straight_run


def test_plan_file_storage_places_the_shards(tiny_dataset: Path, tmp_path: Path,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """A plan file whose tables carry ``storage`` entries (``recstack plan`` with tiers writes them): each rank
    holds the shards it names in those tiers with those caches, the others on the device, with no [memory]
    budget; the run ends bit for bit where the all-in-memory one does."""
    import json

    plan = tmp_path / "plan.json"
    storage = {"C2": {"1": {"tier": "host-cached", "cache_rows": 20}},
               "C4": {"0": {"tier": "host-cached", "cache_rows": 40}, "1": {"tier": "ssd-cached", "cache_rows": 30}}}
    entries = [{"name": n, "sharding": "row_wise", "ranks": [0, 1], **({"storage": storage[n]} if n in storage else {})}
               for n in ("C1", "C2", "C3", "C4")]
    plan.write_text(json.dumps({"world_size": 2, "tables": entries}))
    run = tmp_path / "run"
    log: list[str] = []
    cli_train(run, tiny_dataset, [*COMMON, *LAYOUT, f'dist.plan="{plan}"', f'memory.ssd_dir="{tmp_path / "ssd"}"'],
              launcher=torchrun(2), timeout=400, log=log)
    lines = log[0].splitlines()
    for rank, table, tier, rows in ((0, "C4", "host-cached", 40), (1, "C2", "host-cached", 20),
                                    (1, "C4", "ssd-cached", 30), (0, "C2", "device", None)):
        line = next(x for x in lines if x.startswith(f"rank {rank}:   {table}.shard{rank} "))
        assert tier in line and (rows is None or f" {rows} " in line), line
    _same_end(run, straight_run(tiny_dataset, tmp_path_factory), tiny_dataset)


def test_bad_budgets_stop_every_rank_before_training(tiny_dataset: Path, tmp_path: Path) -> None:
    """A device budget below one row per cache, and an SSD directory that cannot be written: an error naming the
    field, the shard and the rank, on every rank, before any step."""
    base = [*COMMON, *LAYOUT, "dist.timeout_s=60"]
    res = run_cli(train_args(tmp_path / "small", tiny_dataset, [*base, 'memory.device="40"']), launcher=torchrun(2),
                  timeout=300)
    assert res.returncode != 0
    assert "rank 0: memory.device leaves 40 B for caches, less than one row (36 B) for each of the 4 tables it " \
           "cannot hold ('C1.shard0', 'C2.shard0', 'C3.shard0', 'C4.shard0')" in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "small" / "metrics.jsonl").exists()

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes anywhere: a path below a plain file cannot be made
            ssd = tmp_path / "file"
            ssd.write_text("")
        else:
            ssd = locked
        res = run_cli(train_args(tmp_path / "ssd", tiny_dataset, [*base, *_tiers(tmp_path)[:2],
                                                                  f'memory.ssd_dir="{ssd}"']),
                      launcher=torchrun(2), timeout=300)
    finally:
        locked.chmod(0o700)
    assert res.returncode != 0
    for rank in range(2):
        assert f"rank {rank}: memory.ssd_dir='{ssd}': cannot write files in {ssd / f'rank_{rank}'} for the " \
               "ssd-cached shards 'C2.shard" in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "ssd" / "metrics.jsonl").exists()


if os.environ.get("RECSTACK_SKIP_DIST"):
    pytestmark = pytest.mark.skip("RECSTACK_SKIP_DIST set")


def test_local_shards_planned_within_the_rank_budgets(tmp_path: Path) -> None:
    """Shards of different dims (a column-wise split) share one rank's budget; a shard whose storage was decided
    elsewhere (a plan file's tier and cache size) keeps it and the others get what it leaves; the data-parallel
    tables' bytes come off the device budget first."""
    from recstack.distributed.tiered_shards import plan_local_shards
    from recstack.embedding.collection import TableConfig
    from recstack.embedding.sparse_optim import SparseOptimizerConfig
    from recstack.embedding.tiered.collection import TablePlacement
    from recstack.embedding.tiered.config import MemoryConfig
    from recstack.errors import ConfigError

    opt = SparseOptimizerConfig("rowwise_adagrad", lr=0.1)
    shards = [TableConfig("a.shard0", 1000, 8, (0,)), TableConfig("b.shard1", 1000, 4, (1,)),
              TableConfig("c.shard0", 10, 8, (2,))]  # rows of 36, 20 and 36 bytes
    memory = MemoryConfig(device="3000", host="30000", ssd_dir=str(tmp_path), cache_policy="lfu")
    p = plan_local_shards(memory, 1, shards, opt)
    assert [x.tier for x in p] == ["ssd-cached", "host-cached", "device"]
    assert 36 * p[0].cache_rows + 20 * p[1].cache_rows + 360 <= 3000 and p[0].cache_rows == p[1].cache_rows
    assert (tmp_path / "rank_1").is_dir()  # checked writable for the ssd-cached shard

    given = {"a.shard0": TablePlacement("host-cached", 50)}
    wider = MemoryConfig(device="3000", host="40000", ssd_dir=str(tmp_path), cache_policy="lfu")
    q = plan_local_shards(wider, 1, shards, opt, storage=given)
    assert (q[0].tier, q[0].cache_rows, q[0].policy) == ("host-cached", 50, "lfu")
    assert q[1].tier == "ssd-cached"  # the given shard's 36,000 bytes leave the host budget too little
    assert 20 * q[1].cache_rows + 360 <= 3000 - 36 * 50
    with pytest.raises(ConfigError, match=r"rank 1: memory.host='30000' .* of shards 'a.shard0' takes there"):
        plan_local_shards(memory, 1, shards, opt, storage=given)  # a plan that overcommits host memory

    with pytest.raises(ConfigError, match=r"rank 1: memory.device='3000' .* below the 3.5 KiB of the data-parallel"):
        plan_local_shards(memory, 1, shards, opt, replicated_bytes=3600)
