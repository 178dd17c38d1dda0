"""Checkpoints of cached-tier shards (DCP; caches flushed into their stores first) resharded on load: saved with
tiers on 4 ranks, table-wise, resumed all in memory on 2, row-wise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import cli_train, torchrun
from test_tiered_checkpoint import COMMON, LAYOUT, _same_end, _tiers, _torchrun, straight_run


@pytest.fixture(scope="module")
def straight(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return straight_run(tiny_dataset, tmp_path_factory)


def test_tiered_save_on_4_resumes_in_memory_on_2(tiny_dataset: Path, tmp_path: Path, straight: Path) -> None:
    """4 ranks x 32, table-wise shards in SSD-cached tiers, to step 10; then 2 ranks x 64, row-wise, all in memory,
    to step 20: the same global batches as ``straight``, so the same end (up to the order of the first 10 steps'
    sums over 4 ranks)."""
    run = tmp_path / "run"
    log: list[str] = []
    cli_train(run, tiny_dataset, [*COMMON, *_tiers(run), "train.batch_size=32", "train.max_steps=10",
                                  "train.checkpoint_every=10", 'dist.sharding="table_wise"'],
              launcher=torchrun(4), timeout=400, log=log)
    assert "rank 3:   C4.shard0" in log[0] and "ssd-cached" in log[0]  # every rank printed its own plan
    # C1 (50 rows) and C3 (7) fit in rank 0's and rank 2's device budgets; C2 and C4 go to files
    assert sorted(p.name for p in (run / "ssd").iterdir()) == ["rank_1", "rank_3"]
    _torchrun(2, tiny_dataset, run, LAYOUT, "--resume")
    _same_end(run, straight, tiny_dataset, tol=1e-6)


if os.environ.get("RECSTACK_SKIP_DIST"):
    pytestmark = pytest.mark.skip("RECSTACK_SKIP_DIST set")
