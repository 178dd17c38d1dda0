"""`torchrun -m recstack train` with 2 ranks gives the single-process result (per-rank batch = half)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

COMMON = ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.threads=1",
          "train.progress=false", "train.max_steps=60", "train.log_every=20"]


def _train(cmd: list[str], data: Path, out: Path, extra: list[str]) -> dict:
    args = [*cmd, "train", "--output-dir", str(out), "--set", f'data.train="{data}"']
    for o in [*COMMON, *extra]:
        args += ["--set", o]
    res = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def single(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("single")
    return _train([sys.executable, "-m", "recstack"], tiny_dataset, out, ["train.batch_size=128"])


@pytest.mark.parametrize("sharding,codec", [("row_wise", "fp32"), ("table_wise", "fp32"), ("column_wise", "fp16")])
def test_torchrun_two_ranks_match_single(
    tiny_dataset: Path, tmp_path: Path, single: dict, sharding: str, codec: str
) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "recstack"]
    extra = ["train.batch_size=64", f'dist.sharding="{sharding}"', f'dist.forward_codec="{codec}"',
             f'dist.backward_codec="{codec}"']
    two = _train(torchrun, tiny_dataset, tmp_path / "two", extra)
    assert two["world_size"] == 2 and two["train_samples"] == single["train_samples"]
    tol = 1e-5 if codec == "fp32" else 2e-3  # fp16 messages: close, not equal
    for k in ("auc", "logloss", "ne"):
        assert two[k] == pytest.approx(single[k], abs=tol), k
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert all(x["bytes_fwd_a2a"] > 0 and x["bytes_bwd_a2a"] > 0 for x in train_lines)
