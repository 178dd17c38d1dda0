"""Lazy Adam and the all-rows weight decay on sharded tables: 2 spawned gloo ranks against one process (same
global batches), and sharded checkpoints of Adam's state resumed bit for bit and resharded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cli_train, run_cli, torchrun
from test_sharded import _run, _spawn, assert_match_single_process

from recstack.data.prepared_dataset import PreparedDataset
from recstack.embedding.collection import TableConfig
from recstack.embedding.sparse_optim import SparseOptimizer, SparseOptimizerConfig
from recstack.training.checkpoint.sharded import read_full_tables

# every layout; column-wise shards split m and v with the columns and each keeps the rows' step counts
NAMES = ["table_wise", "row_wise", "column_wise", "data_parallel", "mixed"]
ALL_ROWS = ("optim.sparse_weight_decay=0.01", 'optim.sparse_weight_decay_mode="all_rows"')


@pytest.mark.parametrize(("extra", "names"), [(("optim.sparse_weight_decay=0.01",), NAMES),
                                             (ALL_ROWS, ["row_wise", "column_wise", "data_parallel"])],
                         ids=["touched", "all_rows"])
def test_adam_sharded_matches_single_process(tiny_dataset: Path, tmp_path: Path, extra: tuple[str, ...],
                                             names: list[str]) -> None:
    """All-rows decay: each rank steps every row it holds (its row or column block, or its replica)."""
    torch.set_num_threads(1)
    ref = _run(tiny_dataset, "adam", 0, 1, extra=extra, steps=20)
    assert_match_single_process(_spawn(tmp_path, tiny_dataset, 2, "adam", names, extra, steps=20), names, ref)


COMMON = ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.threads=1",
          "train.progress=false", "train.log_every=10", 'optim.sparse="adam"', "optim.sparse_lr=0.01",
          "train.eval_batch_size=512", "train.batch_size=64", "train.checkpoint_every=10"]
ADAM = SparseOptimizer(SparseOptimizerConfig("adam"))


def _tables(run: Path, data: Path, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ds = PreparedDataset(data)
    tables = [TableConfig(f.name, n, 8, (i,)) for i, (f, n) in enumerate(zip(ds.sparse_features, ds.table_sizes,
                                                                          strict=True))]
    return read_full_tables(run / "checkpoints" / f"step_{step:09d}", tables, ADAM)


@pytest.mark.slow  # three torchrun launches
def test_adam_state_resumes_bit_exact_and_reshards(tiny_dataset: Path, tmp_path: Path) -> None:
    """2 ranks row-wise for 20 steps; its step-10 checkpoint resumed row-wise: the same tables and Adam state at
    step 20, bit for bit. Resumed column-wise (m and v split by columns now): the same up to float rounding."""
    def train(run: Path, sharding: str, *flags: str) -> dict:
        return cli_train(run, tiny_dataset, [*COMMON, f'dist.sharding="{sharding}"', "train.max_steps=20"], *flags,
                         launcher=torchrun(2), timeout=400)

    def resume_from_step_10(run: Path, sharding: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(straight / "checkpoints" / "step_000000010", run / "checkpoints" / "step_000000010")
        train(run, sharding, "--resume")
        return _tables(run, tiny_dataset, 20)

    straight = tmp_path / "straight"
    summary = train(straight, "row_wise")
    # one process reads the sharded checkpoint with its Adam state (recstack eval puts the tables together)
    res = run_cli(["eval", "--checkpoint", str(straight)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["auc"] == pytest.approx(summary["auc"], abs=1e-6)
    w_ref, s_ref = _tables(straight, tiny_dataset, 20)
    assert sorted(s_ref) == ["exp_avg", "exp_avg_sq", "row_step"]
    assert float(s_ref["row_step"].max()) > 10 and float(s_ref["exp_avg_sq"].abs().sum()) > 0
    w, s = resume_from_step_10(tmp_path / "resumed", "row_wise")
    assert torch.equal(w, w_ref)
    for part in s:
        assert torch.equal(s[part], s_ref[part]), part
    w2, s2 = resume_from_step_10(tmp_path / "resharded", "column_wise")
    torch.testing.assert_close(w2, w_ref, atol=1e-5, rtol=1e-4)
    for part in s2:
        torch.testing.assert_close(s2[part], s_ref[part], atol=1e-5, rtol=1e-4, msg=part)
