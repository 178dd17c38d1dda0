"""`torchrun -m recstack train` with 2 ranks gives the single-process result (per-rank batch = half)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import RECSTACK, cli_train, kill_after_checkpoints, run_cli, torchrun, train_args

TORCHRUN = torchrun(2)
COMMON = ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.threads=1",
          "train.progress=false", "train.max_steps=60", "train.log_every=20"]


def _train(cmd: list[str], data: Path, out: Path, extra: list[str]) -> dict:
    return cli_train(out, data, [*COMMON, *extra], launcher=cmd)


@pytest.fixture(scope="module")
def single(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("single")
    return _train(RECSTACK, tiny_dataset, out, ["train.batch_size=128"])


@pytest.mark.parametrize("sharding,codec,aggregate", [("row_wise", "fp32", False), ("table_wise", "fp32", False),
                                                      ("column_wise", "fp16", False), ("table_wise", "fp32", True)])
def test_torchrun_two_ranks_match_single(
    tiny_dataset: Path, tmp_path: Path, single: dict, sharding: str, codec: str, aggregate: bool
) -> None:
    extra = ["train.batch_size=64", f'dist.sharding="{sharding}"', f'dist.forward_codec="{codec}"',
             f'dist.backward_codec="{codec}"', f"dist.aggregate_gradients={str(aggregate).lower()}"]
    if aggregate:  # evaluations between steps while the loader thread routes the next training batch
        extra.append("train.eval_every=15")
    two = _train(TORCHRUN, tiny_dataset, tmp_path / "two", extra)
    assert two["world_size"] == 2 and two["train_samples"] == single["train_samples"]
    tol = 1e-5 if codec == "fp32" else 2e-3  # fp16 messages: close, not equal
    for k in ("auc", "logloss", "ne"):
        assert two[k] == pytest.approx(single[k], abs=tol), k
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert all(x["bytes_fwd_a2a"] > 0 and x["bytes_bwd_a2a"] > 0 for x in train_lines)


def test_torchrun_learning_rate_schedule_matches_single(tiny_dataset: Path, tmp_path: Path) -> None:
    """Warm-up and decay reach every rank's embedding shards and the DDP-wrapped dense part alike."""
    sched = ["optim.lr_warmup_steps=20", "optim.lr_decay_start_step=30", "optim.lr_decay_steps=20",
             'optim.sparse="rowwise_adagrad"', 'dist.sharding="row_wise"']
    single = _train(RECSTACK, tiny_dataset, tmp_path / "one",
                    ["train.batch_size=128", *sched])
    two = _train(TORCHRUN, tiny_dataset, tmp_path / "two", ["train.batch_size=64", *sched])
    plain = _train(RECSTACK, tiny_dataset, tmp_path / "plain",
                   ["train.batch_size=128", 'optim.sparse="rowwise_adagrad"'])
    assert two["world_size"] == 2 and single["logloss"] != plain["logloss"]  # the schedule changed the run
    for k in ("auc", "logloss", "ne"):
        assert two[k] == pytest.approx(single[k], abs=1e-5), k


def test_planner_plan_trains_and_matches(tiny_dataset: Path, tmp_path: Path, single: dict) -> None:
    from recstack.cli.main import main

    plan = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(tiny_dataset), "--dim", "8", "--topology", "1x2", "--batch-size", "64",
                 "--out", str(plan)]) == 0
    placed = {t["name"]: t["sharding"] for t in json.loads(plan.read_text())["tables"]}
    assert sorted(placed) == ["C1", "C2", "C3", "C4"]
    two = _train(TORCHRUN, tiny_dataset, tmp_path / "two", ["train.batch_size=64", f'dist.plan="{plan}"'])
    for k in ("auc", "logloss"):
        assert two[k] == pytest.approx(single[k], abs=1e-5), k


def test_max_restarts_resumes_from_checkpoint(tiny_dataset: Path, tmp_path: Path, single: dict) -> None:
    """A worker killed mid-run: torchrun restarts the group, which resumes from the last checkpoint by itself
    and ends where an uninterrupted run ends."""
    out = tmp_path / "run"
    args = train_args(out, tiny_dataset, [*COMMON, "train.batch_size=64", "train.checkpoint_every=20",
                                          'dist.sharding="row_wise"'])
    agent = kill_after_checkpoints(args, out / "checkpoints", 1, launcher=torchrun(2, "--max-restarts", "1"),
                                   worker=True, timeout=200)
    _, err = agent.communicate(timeout=300)
    assert agent.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for k in ("auc", "logloss", "train_samples"):
        assert summary[k] == pytest.approx(single[k], abs=1e-5), k


def test_last_eval_batch_leaves_a_rank_without_rows(tmp_path: Path) -> None:
    """1001 evaluation rows in global batches of 2 x 500: the last one has a single row, so rank 0 gets none.
    It still joins the collectives: the metrics over all 1001 rows equal one process's, and the run ends with
    its final checkpoint."""
    from conftest import write_tiny_dataset

    data = write_tiny_dataset(tmp_path / "data", rows=10010)  # data.eval_fraction 0.1: 1001 evaluation rows
    steps = ["train.max_steps=20", "train.eval_every=10", 'dist.sharding="row_wise"']
    one = _train(RECSTACK, data, tmp_path / "one",
                 ["train.batch_size=128", "train.eval_batch_size=1000", *steps])
    two = _train(TORCHRUN, data, tmp_path / "two", ["train.batch_size=64", "train.eval_batch_size=500", *steps])
    assert two["eval_examples"] == one["eval_examples"] == 1001
    for k in ("auc", "logloss", "ne", "calibration", "accuracy"):
        assert two[k] == pytest.approx(one[k], abs=1e-5), k
    assert (tmp_path / "two" / "checkpoints" / "step_000000020" / "trainer.pt").is_file()


def test_hand_written_plan_is_validated_and_trains(tiny_dataset: Path, tmp_path: Path, single: dict) -> None:
    """A plan file without the planner's estimates trains like one process; one whose table does not fit the
    model (rows given wrong) stops every rank with an error naming the file, the table and the field."""
    entries = [{"name": "C1", "sharding": "row_wise", "ranks": [1, 0]},
               {"name": "C2", "sharding": "table_wise", "ranks": [1]},
               {"name": "C3", "sharding": "column_wise", "ranks": [0, 1]},
               {"name": "C4", "sharding": "data_parallel", "ranks": [0, 1]}]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"world_size": 2, "tables": entries}))
    two = _train(TORCHRUN, tiny_dataset, tmp_path / "two", ["train.batch_size=64", f'dist.plan="{plan}"'])
    for k in ("auc", "logloss"):
        assert two[k] == pytest.approx(single[k], abs=1e-5), k

    bad = tmp_path / "bad_plan.json"
    bad.write_text(json.dumps({"world_size": 2, "tables": [*entries[:3], {**entries[3], "rows": 999}]}))
    res = run_cli(train_args(tmp_path / "bad", tiny_dataset, [*COMMON, "train.batch_size=64", f'dist.plan="{bad}"']),
                  launcher=TORCHRUN)
    assert res.returncode != 0
    message = f"{bad}: plan table 3 ('C4'): field 'rows' is 999 in the plan, the table is 1000 x 8"
    assert res.stderr.count(message) == 2, res.stderr[-3000:]  # from both ranks, before any collective


def test_resume_refuses_the_other_checkpoint_format(tiny_dataset: Path, tmp_path: Path) -> None:
    """Sharded checkpoints (torchrun) and single-process ones do not load into each other: a resume whose newest
    checkpoint is of the other kind stops with an error naming it instead of training from scratch beside it."""
    def run(cmd: list[str], out: Path, extra: list[str], resume: bool) -> subprocess.CompletedProcess:
        options = [*COMMON, "train.max_steps=20", "train.checkpoint_every=20", 'dist.sharding="row_wise"', *extra]
        return run_cli(train_args(out, tiny_dataset, options, *(["--resume"] if resume else [])), launcher=cmd)

    single = RECSTACK
    assert run(TORCHRUN, tmp_path / "two", ["train.batch_size=64"], False).returncode == 0
    res = run(single, tmp_path / "two", ["train.batch_size=128", "train.max_steps=40"], True)
    assert res.returncode == 2 and "step_000000020, a sharded checkpoint written under torchrun" in res.stderr
    assert "starting from scratch" not in res.stdout
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step_000000020"]

    assert run(single, tmp_path / "one", ["train.batch_size=128"], False).returncode == 0
    res = run(TORCHRUN, tmp_path / "one", ["train.batch_size=64", "train.max_steps=40"], True)
    assert res.returncode != 0 and "ckpt_000000020.pt, written by a single process" in res.stderr, res.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "one" / "checkpoints").iterdir()) == ["ckpt_000000020.pt"]


def test_data_synth_is_generated_once_under_torchrun(tmp_path: Path) -> None:
    """A [data.synth] set is generated by rank 0 while the others wait (two ranks writing the same files would
    race), also when an earlier set with other options is replaced."""
    synth = ["data.synth.rows=3000", "data.synth.table_sizes=[50, 30, 20]", "data.synth.num_dense=2",
             "data.synth.calibration_rows=1024", "train.batch_size=64", "train.max_steps=4"]
    for rows in (3000, 3500):  # the second run regenerates the set (rows differ)
        res = run_cli(train_args(tmp_path / "run", None, [*COMMON, *synth, f"data.synth.rows={rows}"], "--overwrite"),
                      launcher=TORCHRUN)
        assert res.returncode == 0, res.stderr[-3000:]
        meta = json.loads((tmp_path / "run" / "data" / "meta.json").read_text())
        assert meta["num_rows"] == rows
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise"])
def test_eval_and_predict_read_a_sharded_checkpoint(tiny_dataset: Path, tmp_path: Path, single: dict,
                                                    sharding: str, capsys: pytest.CaptureFixture) -> None:
    """`recstack eval` and `predict` run in one process on a torchrun run's checkpoint: the tables are put
    together from their shards, so the run's own final evaluation is reproduced (and matches one process)."""
    import numpy as np

    from recstack.cli.main import main

    run = tmp_path / "two"
    two = _train(TORCHRUN, tiny_dataset, run, ["train.batch_size=64", f'dist.sharding="{sharding}"'])
    step_dir = run / "checkpoints" / "step_000000060"
    capsys.readouterr()
    for checkpoint in (run, step_dir):
        assert main(["eval", "--checkpoint", str(checkpoint)]) == 0
        evaluated = json.loads(capsys.readouterr().out)
        for k in ("auc", "logloss", "ne"):
            assert evaluated[k] == pytest.approx(two[k], abs=1e-6), k
            assert evaluated[k] == pytest.approx(single[k], abs=1e-5), k
    out = tmp_path / "p.npy"
    assert main(["predict", "--checkpoint", str(run), "--data", str(tiny_dataset), "--out", str(out)]) == 0
    p = np.load(out)
    assert p.shape == (20000,) and ((p > 0) & (p < 1)).all()

    for f in step_dir.glob("*.distcp"):  # a shard file lost: a clear error naming the checkpoint
        f.unlink()
        break
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{step_dir}: its tables could not be read" in err, err


@pytest.mark.parametrize("shuffle", ["rows", "window"])
def test_short_last_batch_and_row_shuffle_match_single(tmp_path: Path, shuffle: str) -> None:
    """2561 training rows in global batches of 128: each epoch ends with a batch of one row, which leaves rank 0
    without rows. Shuffled per row, for 2 epochs, with a resume in the middle of the second: two ranks train
    every row once per epoch in the same global batches as one process and give its result."""
    from conftest import write_tiny_dataset

    data = write_tiny_dataset(tmp_path / "data", rows=2845)  # data.eval_fraction 0.1: 284 eval, 2561 training
    opts = ["train.epochs=2", f'train.shuffle="{shuffle}"', "train.shuffle_window=500", 'dist.sharding="row_wise"',
            'optim.sparse="rowwise_adagrad"']
    one = _train(RECSTACK, data, tmp_path / "one", ["train.batch_size=128", *opts, "train.max_steps=0"])
    run = tmp_path / "two"
    _train(TORCHRUN, data, run, ["train.batch_size=64", *opts, "train.max_steps=30", "train.checkpoint_every=30"])
    res = run_cli(train_args(run, data, [*COMMON, "train.batch_size=64", *opts, "train.max_steps=0"], "--resume"),
                  launcher=TORCHRUN)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    two = json.loads((run / "summary.json").read_text())
    assert one["steps"] == two["steps"] == 2 * 21 and one["train_samples"] == two["train_samples"] == 2 * 2561
    for k in ("auc", "logloss", "ne"):
        assert two[k] == pytest.approx(one[k], abs=1e-5), k
