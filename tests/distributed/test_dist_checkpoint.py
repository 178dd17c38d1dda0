"""Sharded checkpoints (save with 4 ranks, resume with 2 in another layout; per-rank error-feedback residuals)
and rank failure handling."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import cli_train, free_port, run_cli, start_cli, torchrun, train_args

COMMON = ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.threads=1",
          "train.progress=false", "train.log_every=10", 'optim.sparse="rowwise_adagrad"', "train.eval_batch_size=512"]
METRICS = ("auc", "logloss", "ne", "calibration", "train_samples", "steps")


def _torchrun(n: int, data: Path, out: Path, extra: list[str], resume: bool = False,
              log: list[str] | None = None) -> dict:
    """Train with ``n`` ranks -> summary.json (the ranks' stdout is appended to ``log`` when given)."""
    flags = ["--resume"] if resume else []
    return cli_train(out, data, [*COMMON, *extra], *flags, launcher=torchrun(n), timeout=400, log=log)


def test_save_with_4_resume_with_2(tiny_dataset: Path, tmp_path: Path) -> None:
    # 4 ranks x 32 (table-wise: one table per rank) for 30 steps, then 2 ranks x 64 row-wise to step 60:
    # the same global batches, so it must equal 2 ranks x 64 row-wise for all 60 steps.
    run = tmp_path / "run"
    _torchrun(4, tiny_dataset, run, ["train.batch_size=32", "train.max_steps=30", "train.checkpoint_every=30",
                                     'dist.sharding="table_wise"'])
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_000000030"]
    resumed = _torchrun(2, tiny_dataset, run, ["train.batch_size=64", "train.max_steps=60",
                                               'dist.sharding="row_wise"'], resume=True)
    straight = _torchrun(2, tiny_dataset, tmp_path / "straight", ["train.batch_size=64", "train.max_steps=60",
                                                                  'dist.sharding="row_wise"'])
    for k in METRICS:
        assert resumed[k] == pytest.approx(straight[k], abs=1e-5), k


def test_dead_rank_stops_the_others_with_a_clear_error(tiny_dataset: Path, tmp_path: Path) -> None:
    port = free_port()
    procs = []
    args = train_args(tmp_path / "run", tiny_dataset, ["train.epochs=50", "train.batch_size=32", "dist.timeout_s=20",
                                                       *COMMON])
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(start_cli(args, env=env))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.1)
    assert procs[0].poll() is None, "training ended before a rank could be killed"
    os.kill(procs[1].pid, signal.SIGKILL)
    killed_at = time.time()
    err = procs[0].communicate(timeout=120)[1]
    assert time.time() - killed_at < 60  # timeout 20 s plus start-up slack, never a hang
    assert procs[0].returncode == 3, err[-2000:]
    assert "a collective with the other ranks failed" in err


def test_a_ranks_own_error_is_not_reported_as_a_peer_failure() -> None:
    """Only errors of collectives become "a collective with the other ranks failed" (the test above: a killed peer);
    a rank's own error, such as a shape mismatch, keeps its message."""
    from recstack.distributed.parallelize import is_peer_failure

    with pytest.raises(RuntimeError) as own:
        torch.zeros(2, 3) @ torch.zeros(2, 3)
    assert not is_peer_failure(own.value)
    assert is_peer_failure(torch.distributed.DistNetworkError("recv failed"))


# Backward gradients through the error-bounded codec with error feedback. Row-wise: every table has rows on
# both ranks, so each rank sends chunks over the network and holds residuals of its own.
EF = ['dist.backward_codec="eb"', "compression.error_feedback=true", "compression.base_bound=0.05",
      "compression.tight_min_rows=1000", "compression.loose_max_rows=10", 'dist.sharding="row_wise"',
      "train.batch_size=64", "train.log_every=2"]


def _train_losses(run: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x["loss"] for x in lines if x["kind"] == "train"}


def test_error_feedback_residuals_survive_a_resume(tiny_dataset: Path, tmp_path: Path) -> None:
    """Stopped at step 8 and resumed to 16, a run with error feedback must continue exactly as one that never
    stopped: the residuals each rank carries into step 9 come back from its own file in the checkpoint."""
    run = tmp_path / "run"
    _torchrun(2, tiny_dataset, run, [*EF, "train.max_steps=8", "train.checkpoint_every=2"])
    ckpt = run / "checkpoints" / "step_000000008"
    for rank in range(2):
        saved = torch.load(ckpt / f"rank_{rank:05d}.pt", weights_only=True)["compression"]
        assert (saved["rank"], saved["world_size"]) == (rank, 2)
        residual = saved["residual"]["eb_bwd"]
        assert residual and all(float(r.abs().max()) > 0 for r in residual.values())
    # Step 6 (768 rows: 4 batches of 3 x 64) for three ranks: the data position must be a whole number of their
    # global batches.
    shutil.copytree(run / "checkpoints" / "step_000000006", tmp_path / "grown" / "checkpoints" / "step_000000006")
    log: list[str] = []
    resumed = _torchrun(2, tiny_dataset, run, [*EF, "train.max_steps=16"], resume=True, log=log)
    straight = _torchrun(2, tiny_dataset, tmp_path / "straight", [*EF, "train.max_steps=16"])
    assert "error-feedback residuals" not in log[0]  # restored, nothing to report
    after = {s: v for s, v in _train_losses(run).items() if s > 8}
    assert sorted(after) == [10, 12, 14, 16]
    assert after == {s: _train_losses(tmp_path / "straight")[s] for s in after}  # bit for bit
    for k in METRICS:
        assert resumed[k] == straight[k], k

    # Three ranks send other chunks: the residuals cannot be mapped, so they are dropped, and said so once.
    grown = _torchrun(3, tiny_dataset, tmp_path / "grown", [*EF, "train.max_steps=10"], resume=True, log=log)
    assert grown["steps"] == 10
    assert log[1].count("error-feedback residuals of every rank start from zero") == 1
    assert "written by 2 ranks and this run has 3" in log[1]


def test_checkpoint_of_other_table_sizes_stops_every_rank(tiny_dataset: Path, tmp_path: Path) -> None:
    """Saved with every table capped at 5 rows, resumed with the cap raised to 20 (row-wise on 2 ranks: rank 0's
    rows 0-9 partly covered by the checkpoint, rank 1's rows 10-19 not at all). Rows the checkpoint lacks must
    not keep their fresh initialisation: both ranks stop with the same error, and neither waits for the other."""
    run = tmp_path / "run"
    layout = ["train.batch_size=32", 'dist.sharding="row_wise"', "dist.timeout_s=60"]
    _torchrun(2, tiny_dataset, run, [*layout, "train.max_steps=4", "train.checkpoint_every=4",
                                     "model.max_table_size=5"])
    args = train_args(run, tiny_dataset, [*COMMON, *layout, "train.max_steps=8", "model.max_table_size=20"], "--resume")
    started = time.time()
    res = run_cli(args, launcher=torchrun(2), timeout=400)
    assert res.returncode != 0 and time.time() - started < 50, res.stderr[-3000:]  # an error, not a timeout
    message = f"{run / 'checkpoints' / 'step_000000004'}: table 'C1' was saved as 5 x 8, the model's is 20 x 8"
    assert res.stderr.count(f"recstack train: error: {message}") == 2, res.stderr[-3000:]
