"""Bad ``[memory]`` budgets under torchrun stop every rank before any training step, with an error naming the
field, the shard and the rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import run_cli, torchrun, train_args
from test_tiered_checkpoint import COMMON, LAYOUT, _tiers


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
