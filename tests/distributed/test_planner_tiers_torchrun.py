"""A plan file whose storage tiers are malformed or overcommit a rank stops ``torchrun -m recstack train`` on
every rank before the first step, with one error line naming the plan file, the table, the field and the rank."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli, torchrun, train_args

COMMON = ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.threads=1",
          "train.progress=false", "train.max_steps=5", "train.batch_size=64"]
ENTRIES = [{"name": "C1", "sharding": "row_wise", "ranks": [1, 0]},
           {"name": "C2", "sharding": "table_wise", "ranks": [1]},
           {"name": "C3", "sharding": "column_wise", "ranks": [0, 1]},
           {"name": "C4", "sharding": "data_parallel", "ranks": [0, 1]}]


def test_bad_storage_in_a_plan_stops_every_rank_before_training(tiny_dataset: Path, tmp_path: Path) -> None:
    plans = {
        "malformed": ({**ENTRIES[0], "storage": {"0": {"tier": "host-cached", "cache_rows": 0}}},
                      "plan table 0 ('C1'): field 'storage': rank 0: 'cache_rows' must be an integer of at least "
                      "one row, got 0"),
        # C2's 300 rows x (8 + 1) x 4 bytes on rank 1's SSD; the plan gives its host 20 KB, 10 KB per rank
        "overcommit": ({**ENTRIES[1], "storage": {"1": {"tier": "ssd-cached", "cache_rows": 10}}},
                       "field 'storage': plan table 1 ('C2'): rank 1 holds 10.8 KB (10,800 bytes) in SSD with this "
                       "table, over its ssd budget of 10.0 KB"),
    }
    for name, (entry, message) in plans.items():
        entries = [entry if e["name"] == entry["name"] else e for e in ENTRIES]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"world_size": 2, "tables": entries,
                                    "topology": {"nodes": 1, "devices_per_node": 2, "ssd_bytes": 20_000}}))
        res = run_cli(train_args(tmp_path / name, tiny_dataset, [*COMMON, f'dist.plan="{path}"']),
                      launcher=torchrun(2))
        assert res.returncode != 0
        assert res.stderr.count(f"{path}: {message}") == 2, res.stderr[-3000:]  # from both ranks
        assert not (tmp_path / name / "summary.json").exists()
