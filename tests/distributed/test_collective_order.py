"""Every rank issues every collective from its training thread, in one program order (pipelined
input distribution, evaluations between steps, gradient aggregation, checkpoints): recorded per
rank on gloo under torchrun and compared. On NCCL two threads issuing collectives on two groups
could enqueue them in opposite orders on two ranks and deadlock; gloo cannot show that, so the
order itself is what is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from conftest import SMALL, train_args

RECORDER = Path(__file__).resolve().parent / "collective_recorder.py"


def test_collectives_come_from_the_training_thread_in_one_order(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    steps = 24
    opts = [
        *SMALL,
        "train.batch_size=64",
        f"train.max_steps={steps}",
        "train.eval_every=10",
        "train.checkpoint_every=12",
        'dist.sharding="row_wise"',
        "dist.pipeline=true",
        "dist.aggregate_gradients=true",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(RECORDER),
        str(tmp_path),
        *train_args(tmp_path / "run", tiny_dataset, opts),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for calls in ranks:
        threads = Counter(thread for _, _, thread in calls)
        assert set(threads) == {"MainThread"}, threads
    assert [c[:2] for c in ranks[0]] == [c[:2] for c in ranks[1]]
    # the recording saw the step's exchanges: per step at least the id sizes, the ids, the pooled
    # rows forward and their gradients back, and DDP's all-reduce
    ops = Counter(op for op, _, _ in ranks[0])
    assert ops["all_to_all_single"] >= 4 * steps and ops["all_reduce"] >= steps, ops
