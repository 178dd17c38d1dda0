"""Dynamic id tables under `torchrun -m recstack train` (2 ranks, gloo): the id maps split by id hash over the
tables' row shards. Under capacity the run is the single-process run on the same global batches, and its export
serves raw ids as the single-process export does; under eviction each rank stays within its share of the
capacity, and a worker killed mid-run resumes from the sharded checkpoint to the uninterrupted run's end; with the
row shards in cached tiers too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RECSTACK, cli_train, kill_after_checkpoints, run_cli, torchrun, train_args

from recstack.cli.main import main
from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.synth.generate import SynthConfig, generate
from recstack.distributed.dynamic_dist import merge_maps, split_map
from recstack.embedding.dynamic import DynamicIdMap, id_owner
from recstack.errors import ConfigError
from recstack.serving.model import ServingModel

TWO = torchrun(2)
COMMON = ["model.embedding_dim=4", "model.bottom_mlp=[8, 4]", "model.top_mlp=[8, 1]", "train.threads=1",
          "train.progress=false", "train.log_every=10", "train.eval_every=0", "model.dynamic_ids.enabled=true",
          'optim.sparse="rowwise_adagrad"', "optim.sparse_lr=0.05", 'dist.sharding="table_wise"']
ROOMY = ["model.dynamic_ids.capacity=4096", "model.dynamic_ids.admit_after=2", "train.max_steps=30"]


@pytest.fixture(scope="module")
def churn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = SynthConfig(rows=5000, num_dense=2, table_sizes=(800, 200, 30), num_days=2, id_churn=0.3, raw_ids=True,
                      calibration_rows=2048)
    return generate(cfg, tmp_path_factory.mktemp("churn") / "data", progress=False)


def _served(models: Path, rows: list[dict]) -> np.ndarray:
    model = ServingModel.load(models / "1")
    return model.score(model.encode(rows, ids=True)).double().numpy()


def killed_and_restarted(out: Path, data: Path, opts: list[str]) -> dict:
    """A 2-rank run whose worker is SIGKILLed after the first checkpoint and that torchrun starts again (it
    resumes) -> its summary."""
    agent = kill_after_checkpoints(train_args(out, data, opts), out / "checkpoints", 1,
                                   launcher=torchrun(2, "--max-restarts", "1"), worker=True, timeout=200)
    _, err = agent.communicate(timeout=300)
    assert agent.returncode == 0, err[-3000:]
    assert "failed (exitcode: " in err, err[-3000:]  # the group failed, was started again and resumed
    return json.loads((out / "summary.json").read_text())


def test_two_ranks_match_one_process_and_export_alike(churn: Path, tmp_path: Path) -> None:
    """Every id of a step gets a row as in one process (the default row 0 for ids seen once, admit_after = 2),
    with the same initial vector wherever it lands, so the evaluation (every rank's predictions) and the served
    scores are one process's (the logged loss is rank 0's half batch's); the dynamic tables are row_wise whatever
    dist.sharding says."""
    one = cli_train(tmp_path / "one", churn, [*COMMON, *ROOMY, "train.batch_size=128"])
    two = cli_train(tmp_path / "two", churn, [*COMMON, *ROOMY, "train.batch_size=64"], launcher=TWO)
    assert two["world_size"] == 2 and two["train_samples"] == one["train_samples"]
    assert one["dynamic_ids/evictions"] == two["dynamic_ids/evictions"] == 0
    assert two["dynamic_ids/admissions"] == one["dynamic_ids/admissions"] > 0
    assert two["dynamic_ids/default_hits"] == one["dynamic_ids/default_hits"] > 0
    assert two["dynamic_ids/collisions"] == 0
    for k in ("auc", "logloss", "ne"):
        assert two[k] == pytest.approx(one[k], abs=1e-5), k
    # the export of the sharded checkpoint: the union of the ranks' maps, in the table's rows
    for run in ("one", "two"):
        (tmp_path / f"models_{run}").mkdir()
        assert main(["export", "--checkpoint", str(tmp_path / run), "--out", str(tmp_path / f"models_{run}")]) == 0
    ds = PreparedDataset(churn)
    raw = np.array(ds.arrays["sparse"][:50], np.int64)
    raw[::3, 0] = np.arange(0, 50, 3) + 5  # ids no run has seen: the default row
    dense = np.array(ds.arrays["dense"][:50], np.float32)
    rows = [{"I1": float(d[0]), "I2": float(d[1]), **{f"C{j + 1}": int(v) for j, v in enumerate(r)}}
            for d, r in zip(dense, raw, strict=True)]
    a, b = _served(tmp_path / "models_one", rows), _served(tmp_path / "models_two", rows)
    assert np.abs(a - b).max() <= 1e-5
    assert np.ptp(a) > 1e-3  # the scores do depend on the rows


def test_eviction_within_each_ranks_capacity_and_resume(churn: Path, tmp_path: Path) -> None:
    """A capacity of 60 rows per table: each map of a rank holds at most 29 ids, rows are evicted and reused, no
    collision; a worker SIGKILLed after the first checkpoint is restarted by torchrun, resumes from the sharded
    checkpoint (maps split again per rank) and ends exactly where the uninterrupted run ends."""
    opts = [*COMMON, "train.batch_size=64", "model.dynamic_ids.capacity=60", 'model.dynamic_ids.eviction="lfu"',
            "train.max_steps=40", "train.checkpoint_every=10"]
    ref = cli_train(tmp_path / "ref", churn, opts, launcher=TWO)
    assert ref["dynamic_ids/evictions"] > 0 and ref["dynamic_ids/collisions"] == 0
    assert 0 < ref["dynamic_ids/rank_rows_in_use_max"] <= 29
    assert ref["dynamic_ids/rows_in_use"] <= 3 * 2 * 29  # three tables, two ranks
    out = tmp_path / "run"
    resumed = killed_and_restarted(out, churn, opts)
    keys = ["auc", "logloss", "train_samples", *(k for k in ref if k.startswith("dynamic_ids/"))]
    assert {k: resumed[k] for k in keys} == {k: ref[k] for k in keys}
    # one process reads the merged maps of the sharded checkpoint
    assert main(["eval", "--checkpoint", str(out)]) == 0


def test_cached_tier_shards_match_in_memory_and_resume(churn: Path, tmp_path: Path) -> None:
    """Each rank's row shards of the dynamic tables in host- and ssd-cached tiers with 6-row caches over their 30
    rows (rows reused by the maps are reset in the tiers): a worker SIGKILLed after the first checkpoint, restarted
    by torchrun, ends exactly where the same run with every row in memory ends."""
    opts = [*COMMON, "train.batch_size=64", "model.dynamic_ids.capacity=60", 'model.dynamic_ids.eviction="lfu"',
            "train.max_steps=40", "train.checkpoint_every=10"]
    ref = cli_train(tmp_path / "ref", churn, opts, launcher=TWO)
    out = tmp_path / "run"
    tiers = ['memory.device="400"', 'memory.host="600"', f'memory.ssd_dir="{tmp_path / "ssd"}"']
    run = killed_and_restarted(out, churn, [*opts, *tiers])
    keys = ["auc", "logloss", "train_samples", *(k for k in ref if k.startswith("dynamic_ids/"))]
    assert ref["dynamic_ids/evictions"] > 0 and {k: run[k] for k in keys} == {k: ref[k] for k in keys}
    logs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # cached tiers, missing
    assert sum(x["cache_requests"] - x["cache_hits"] for x in logs if x["kind"] == "train") > 0
    assert sorted(p.name for p in (tmp_path / "ssd").iterdir()) == ["rank_0", "rank_1"]


def test_unsupported_combinations_stop_with_the_key(churn: Path, tmp_path: Path) -> None:
    """A capacity that the ranks cannot split evenly, and a plan file that shards a dynamic table otherwise:
    one line naming the key, on every rank, before training."""
    res = run_cli(train_args(tmp_path / "odd", churn, [*COMMON, "model.dynamic_ids.capacity=101"]), launcher=TWO)
    message = "recstack train: error: model.dynamic_ids.capacity: 101 rows of table 'C1' must split evenly over the 2"
    assert res.returncode != 0 and message in res.stderr, res.stderr[-3000:]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"world_size": 2, "tables": [{"name": n, "sharding": "table_wise", "ranks": [0]}
                                                            for n in ("C1", "C2", "C3")]}))
    res = run_cli(train_args(tmp_path / "plan", churn, [*COMMON, "model.dynamic_ids.capacity=100",
                                                        f'dist.plan="{plan}"']), launcher=TWO)
    message = f"recstack train: error: dist.plan: {plan}: table 'C1' is a dynamic id table"
    assert res.returncode != 0 and message in res.stderr, res.stderr[-3000:]
    res = run_cli(train_args(tmp_path / "one", churn, [*COMMON, "model.dynamic_ids.capacity=100",
                                                       "model.qr_collisions=4"]), launcher=RECSTACK)
    assert res.returncode != 0 and "error: model.dynamic_ids: not supported with quotient" in res.stderr


def test_plan_places_dynamic_tables_row_wise_over_every_rank(churn: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(churn), "--topology", "1x4", "--dynamic-capacity", "1K",
                 "--dynamic-tables", "C1,C2", "--max-table-size", "30", "--out", str(out)]) == 0
    placed = {e["name"]: (e["sharding"], e["ranks"], e["rows"]) for e in json.loads(out.read_text())["tables"]}
    assert placed["C1"] == placed["C2"] == ("row_wise", [0, 1, 2, 3], 1000)
    assert "row_wise" in capsys.readouterr().out
    assert main(["plan", "--tables", str(churn), "--topology", "1x3", "--dynamic-capacity", "1K"]) != 0
    assert "--dynamic-capacity: 1,000 rows must split evenly over the 3 ranks" in capsys.readouterr().err


def test_sharded_maps_merge_into_one_process_form_and_split_back() -> None:
    """Two ranks' maps (each of the ids hashing to it, 8 rows) merge into one map of 16 table rows that looks ids
    up as the ranks do (rank 1's row r is table row 8 + r, unknown ids row 0), and split back exactly."""
    every = torch.arange(100, 140)
    maps = [DynamicIdMap(capacity=8, admit_after=2) for _ in range(2)]
    for step in range(3):
        batch = every[step * 6 : step * 6 + 12]
        for k, m in enumerate(maps):
            m.remap(batch[id_owner(batch, 2) == k])
    merged = merge_maps([m.state_dict() for m in maps])
    one = DynamicIdMap(capacity=16, admit_after=2)
    one.load_state_dict(merged)  # what recstack eval / export load
    for k, m in enumerate(maps):
        mine = every[id_owner(every, 2) == k]
        local = m.lookup(mine)
        assert torch.equal(one.lookup(mine), torch.where(local > 0, local + 8 * k, 0))
        assert (local > 0).any() and (local == 0).any()  # admitted ids and ids on the default row
        back = split_map(merged, k, 2, "ckpt")
        for key, value in m.state_dict().items():
            assert torch.equal(back[key], value) if isinstance(value, torch.Tensor) else back[key] == value, key
    assert one.stats()["admissions"] == sum(m.stats()["admissions"] for m in maps)
    with pytest.raises(ConfigError, match="holds id maps dealt to 2 rank"):
        split_map(merged, 0, 4, "ckpt")
