"""bench/netem.py: two ranks in two network namespaces, joined by a shaped bridge, train with ``eb``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import train_args

from bench.netem import NetemCluster

REASON = NetemCluster.available()


@pytest.mark.skipif(REASON is not None, reason=f"network namespaces not usable here: {REASON}")
def test_two_ranks_across_namespaces_train_with_eb(tiny_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["recstack", *train_args(out, tiny_dataset, [
        "model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.threads=1",
        "train.progress=false", "train.max_steps=12", "train.log_every=4", "train.batch_size=64",
        'dist.forward_codec="eb"', 'dist.backward_codec="eb"'])]
    with NetemCluster(2, rate="200mbit", delay="0.1ms") as cluster:
        made = list(cluster.made)
        assert len(made) == 3
        res = cluster.run(args, timeout=240, port=29511)
    assert all(r.returncode == 0 for r in res), res[0].stderr[-2000:] + res[1].stderr[-2000:]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in made)  # everything it created is gone
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    train = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in train if x["kind"] == "train"]
    assert all(x["eb_fwd_ratio"] > 2 and x["bytes_fwd_a2a"] > 0 for x in train)


def test_cleanup_runs_when_the_block_fails() -> None:
    if REASON is not None:
        pytest.skip(f"network namespaces not usable here: {REASON}")
    with pytest.raises(RuntimeError, match="boom"), NetemCluster(2, rate="1gbit") as cluster:
        made = list(cluster.made)
        raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert made and not any(name in listed for name in made)
