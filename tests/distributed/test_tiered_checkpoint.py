"""`torchrun -m recstack train` with ``[memory]`` budgets: every rank's shards in cached tiers, checkpointed with
DCP (caches flushed into their stores first) and resumed after a SIGKILL; the tiers never change a value, so
every run ends where the all-in-memory one does, bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import cli_train, kill_after_checkpoints, run_cli, torchrun, train_args

from recstack.data.prepared_dataset import PreparedDataset
from recstack.embedding.collection import TableConfig
from recstack.embedding.sparse_optim import SparseOptimizer, SparseOptimizerConfig
from recstack.training.checkpoint.sharded import read_full_tables

COMMON = ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.threads=1",
          "train.progress=false", "train.log_every=10", 'optim.sparse="rowwise_adagrad"', "train.eval_batch_size=512"]
METRICS = ("auc", "logloss", "ne", "calibration", "train_samples", "steps")
# 2 ranks x 64, row-wise, 20 steps: the reference every run below must end at
LAYOUT = ["train.batch_size=64", 'dist.sharding="row_wise"', "train.max_steps=20"]


def _tiers(run: Path, device: str = "6000") -> list[str]:
    """Per-rank budgets: a few KiB of device cache, the rest of each shard in a file of the rank's own."""
    return [f'memory.device="{device}"', 'memory.host="1"', f'memory.ssd_dir="{run / "ssd"}"',
            'memory.cache_policy="lfu"']


def _torchrun(n: int, data: Path, out: Path, extra: list[str], *flags: str) -> dict:
    return cli_train(out, data, [*COMMON, *extra], *flags, launcher=torchrun(n), timeout=400)


def _tables(run: Path, data: Path, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ds = PreparedDataset(data)
    tables = [TableConfig(f.name, n, 8, (i,)) for i, (f, n) in enumerate(zip(ds.sparse_features, ds.table_sizes,
                                                                          strict=True))]
    weight, state = read_full_tables(run / "checkpoints" / f"step_{step:09d}", tables,
                                     SparseOptimizer(SparseOptimizerConfig("rowwise_adagrad")))
    return weight, state["accumulator"]


def straight_run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, every table in memory."""
    run = tmp_path_factory.mktemp("straight")
    _torchrun(2, data, run, LAYOUT)
    return run


@pytest.fixture(scope="module")
def straight(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return straight_run(tiny_dataset, tmp_path_factory)


def _same_end(run: Path, straight: Path, data: Path, tol: float = 0.0) -> None:
    """Summary and final tables (weights and row-wise Adagrad state) those of ``straight``: bit for bit, or
    within ``tol`` where part of the run summed in another order (another world size)."""
    got, want = (json.loads((r / "summary.json").read_text()) for r in (run, straight))
    for k in METRICS:
        assert got[k] == pytest.approx(want[k], abs=tol, rel=0), k
    for a, b in zip(_tables(run, data, 20), _tables(straight, data, 20), strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, atol=tol, rtol=0)


def test_tiered_run_killed_and_resumed_ends_bit_identical(tiny_dataset: Path, tmp_path: Path, straight: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """`torchrun ... train --set memory.device=... --set memory.ssd_dir=...`: every rank's shards in SSD-cached
    tiers behind small caches. A worker SIGKILLed after the first checkpoint (torchrun then stops the other), the
    run resumed with --resume in tiers again: it ends bit for bit where the uninterrupted all-in-memory run ends
    (so also its AUC). The input pipeline tells the shards their coming ids, so their rows are prefetched."""
    run = tmp_path / "run"
    options = [*COMMON, *LAYOUT, *_tiers(run), "train.checkpoint_every=5"]
    agent = kill_after_checkpoints(train_args(run, tiny_dataset, options), run / "checkpoints", 1,
                                   launcher=torchrun(2), worker=True, timeout=200)
    agent.communicate(timeout=300)
    assert agent.returncode != 0 and not (run / "summary.json").exists()  # stopped mid-run
    res = run_cli(train_args(run, tiny_dataset, options, "--resume"), launcher=torchrun(2), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resume: continuing from" in res.stdout
    _same_end(run, straight, tiny_dataset)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]  # rank 0's caches: most lookups missed
    requests, hits = sum(x["cache_requests"] for x in train), sum(x["cache_hits"] for x in train)
    assert requests > 0 and hits < 0.5 * requests, (hits, requests)
    # dist.pipeline (the default) routes each batch ahead: its rows were fetched before its forward
    assert sum(x["cache_prefetch_seconds"] for x in train) > 0
    # `recstack eval` in one process puts the tables together from the shards into the tiers the run's budgets
    # give one process, and reproduces the run's final evaluation
    from recstack.cli.main import main

    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    summary = json.loads((run / "summary.json").read_text())
    for k in ("auc", "logloss"):
        assert evaluated[k] == pytest.approx(summary[k], abs=1e-6), k


if os.environ.get("RECSTACK_SKIP_DIST"):
    pytestmark = pytest.mark.skip("RECSTACK_SKIP_DIST set")
