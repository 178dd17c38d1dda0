"""Dynamic id tables: admission, eviction per policy, row and optimizer-state reset on reuse, no collisions
under capacity, the behaviour when full, config errors, the planner, and training runs stopped (in process, or
SIGKILLed) and resumed to the same maps, weights and metrics as uninterrupted ones."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import kill_after_checkpoints, run_cli, train_args

from recstack.config import load_config
from recstack.data.batch import Batch, SparseFeatures
from recstack.embedding.collection import TableConfig, init_bound
from recstack.embedding.dynamic import DynamicIdMap, DynamicIdsConfig, id_owner, id_values
from recstack.embedding.dynamic_stage import DynamicIds
from recstack.embedding.fused import FusedEmbeddingBagCollection
from recstack.embedding.mixed import MixedDimEmbeddingCollection
from recstack.embedding.sparse_optim import SparseOptimizerConfig
from recstack.errors import ConfigError

BIG = 1 << 60  # raw ids as a log carries them: large, sparse values


def ids(*values: int) -> torch.Tensor:
    return torch.tensor([BIG + v for v in values], dtype=torch.int64)


def test_admission_after_k_sightings() -> None:
    m = DynamicIdMap(capacity=8, admit_after=3)
    assert m.remap(ids(5)).tolist() == [0]
    assert m.remap(ids(5)).tolist() == [0]  # two sightings: still the default row
    row = m.remap(ids(5)).item()
    assert row > 0 and m.remap(ids(5)).item() == row
    assert m.remap(ids(7, 7, 7)).tolist()[0] > 0  # three sightings in one batch count too
    assert m.lookup(ids(9)).tolist() == [0] and m.lookup(ids(9)).tolist() == [0]  # lookups admit nothing
    assert m.remap(ids(9)).tolist() == [0]
    s = m.stats()
    assert (s["rows_in_use"], s["admissions"], s["candidates"], s["default_hits"]) == (2, 2, 1, 3)


def test_no_collisions_under_capacity() -> None:
    g = torch.Generator().manual_seed(0)
    universe = torch.randint(0, 2**62, (900,), generator=g)
    m = DynamicIdMap(capacity=1000)
    for _ in range(30):
        batch = universe[torch.randint(0, 900, (256,), generator=g)]
        rows = m.remap(batch)
        assert (rows > 0).all()
    rows = m.lookup(universe)
    seen = rows > 0
    assert rows[seen].unique().numel() == int(seen.sum())  # one row per id, never shared
    assert m.stats()["evictions"] == 0 and m.stats()["rows_in_use"] == int(seen.sum())


def _fill(m: DynamicIdMap, *values: int) -> list[int]:
    return [m.remap(ids(v)).item() for v in values]


def test_lru_evicts_the_least_recently_used() -> None:
    m = DynamicIdMap(capacity=4, eviction="lru")  # rows 1..3
    r1, r2, r3 = _fill(m, 1, 2, 3)
    m.remap(ids(1))  # 2 is now the least recently used
    assert m.remap(ids(4)).item() == r2
    assert m.lookup(ids(2)).item() == 0 and m.lookup(ids(1, 3)).tolist() == [r1, r3]
    assert m.stats()["evictions"] == 1


def test_lfu_evicts_the_least_frequently_used() -> None:
    m = DynamicIdMap(capacity=4, eviction="lfu")
    r1, r2, r3 = _fill(m, 1, 2, 3)
    m.remap(ids(1, 1, 1))  # sightings: 1 -> 4
    m.remap(ids(2, 2))  # 2 -> 3
    m.remap(ids(3))  # 3 -> 2, and the most recently used: lru would evict 1, lfu evicts 3
    assert m.remap(ids(4)).item() == r3
    assert m.lookup(ids(1, 2, 3)).tolist() == [r1, r2, 0]


def test_ttl_expires_rows_and_evicts_nothing_when_full() -> None:
    m = DynamicIdMap(capacity=3, eviction="ttl", ttl_steps=3)  # rows 1..2
    r1, r2 = _fill(m, 1, 2)  # steps 1, 2
    assert m.remap(ids(3)).item() == 0  # step 3: full, nothing expired: 3 waits on the default row
    assert m.lookup(ids(1, 2)).tolist() == [r1, r2]
    assert m.remap(ids(3)).item() == r1  # step 4: 1 (last seen at step 1) expired, 3 gets its row
    assert m.lookup(ids(1)).item() == 0
    assert m.stats()["expirations"] == 1 and m.stats()["evictions"] == 0


def test_full_with_every_row_in_use_this_step() -> None:
    m = DynamicIdMap(capacity=3, eviction="lru")  # 2 rows for 3 new ids in one step
    rows = m.remap(ids(3, 1, 2)).tolist()
    assert rows[0] == 0 and sorted(rows[1:]) == [1, 2]  # equal sightings: the smaller ids first
    assert m.remap(ids(3)).item() > 0  # next step: a row not used by this step is evicted for it


def test_candidates_are_bounded() -> None:
    m = DynamicIdMap(capacity=4, admit_after=2, max_candidates=3)
    for v in range(10):
        m.remap(ids(v))
    assert m.stats()["candidates"] == 3
    assert m.cand_keys.tolist() == (ids(7, 8, 9)).tolist()  # the most recently seen are kept


def test_reused_row_is_reinitialised_with_fresh_optimizer_state() -> None:
    table = TableConfig("C1", 4, 3, (0,), zero_rows=1)
    coll = FusedEmbeddingBagCollection([table], SparseOptimizerConfig("rowwise_adagrad", lr=0.1), seed=1)
    dyn = DynamicIds(DynamicIdsConfig(enabled=True, capacity=4), ["C1"], coll, seed=7)

    def batch(*vals: int) -> Batch:
        return Batch(torch.zeros(len(vals), 0), SparseFeatures.from_dense_ids(ids(*vals).view(-1, 1)),
                     torch.zeros(len(vals)))

    rows = dyn.remap_batch(batch(1, 2, 3)).sparse.ids  # rows 1..3, admissions 0..2
    coll.apply_gradients(rows, torch.ones(3, 3))  # train them: accumulators > 0
    assert (coll.accumulator[1:] > 0).all()
    dyn.remap_batch(batch(2, 3))
    row = dyn.remap_batch(batch(4)).sparse.ids.item()  # admission 3 evicts 1 (least recently used)
    assert row == rows[0].item()
    assert coll.accumulator[row].item() == 0.0 and (coll.accumulator[rows[1:]] > 0).all()
    # the values are keyed by (seed, table, raw id): id 4 gets them in any row, on any rank
    assert torch.equal(coll.weight[row], id_values(ids(4), 7 * 1_000_003 + 0, 3, init_bound(table))[0])
    assert coll.weight[0].abs().sum() == 0  # the default row starts at zero


def test_mixed_dim_collection_resets_the_row_of_its_table() -> None:
    tables = [TableConfig("A", 4, 3, (0,), 1), TableConfig("B", 5, 2, (1,), 1, init_bound=0.5)]
    coll = MixedDimEmbeddingCollection(tables, SparseOptimizerConfig("adam"), seed=0)
    group = coll._group("d2")
    group.weight[2].fill_(9.0)
    group.exp_avg[2].fill_(1.0)
    group.row_step[2] = 4.0
    values = id_values(ids(11), 3, 2, init_bound(tables[1]))
    coll.reset_rows("B", torch.tensor([2]), values)
    assert torch.equal(coll.table_weight("B")[2], values[0])
    assert coll.table_weight("B")[2].abs().max() <= 0.5  # the table's own init bound
    assert group.exp_avg[2].abs().sum() == 0 and group.row_step[2] == 0


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    bad = {"capacity=1": "model.dynamic_ids.capacity", "admit_after=0": "model.dynamic_ids.admit_after",
           'eviction="fifo"': "model.dynamic_ids.eviction", 'eviction="ttl"': "model.dynamic_ids.ttl_steps",
           "ttl_steps=5": "model.dynamic_ids.ttl_steps", "max_candidates=-1": "model.dynamic_ids.max_candidates"}
    for option, key in bad.items():
        with pytest.raises(ConfigError, match=key):
            load_config(None, ["model.dynamic_ids.enabled=true", f"model.dynamic_ids.{option}"])
    with pytest.raises(ConfigError, match="model.dynamic_ids: not supported with quotient"):
        load_config(None, ["model.dynamic_ids.enabled=true", "model.qr_collisions=4"])
    assert load_config(None, ["model.dynamic_ids.enabled=true", 'memory.device="1MB"']).memory.device == "1MB"
    with pytest.raises(ConfigError, match="model.dynamic_ids.tables: the data has no table 'C9'"):
        DynamicIdsConfig(enabled=True, tables=["C9"]).check_table_names(["C1", "C2"])
    from recstack.exfm.config import load_exfm_config

    with pytest.raises(ConfigError, match="fm.model.dynamic_ids: the foundation model takes raw ids"):
        load_exfm_config(None, ["fm.model.dynamic_ids.enabled=true"])
    from recstack.distributed.dynamic_dist import check_capacities

    with pytest.raises(ConfigError, match="model.dynamic_ids.capacity: 101 rows of table 'C1' must split evenly"):
        check_capacities(DynamicIdsConfig(enabled=True, capacity=101), ["C1"], 2)
    with pytest.raises(ConfigError, match="model.dynamic_ids.table_capacity.C2: 9 rows"):
        check_capacities(DynamicIdsConfig(enabled=True, capacity=100, table_capacity={"C2": 9}), ["C1", "C2"], 2)


DYN = ["model.embedding_dim=4", "model.bottom_mlp=[8, 4]", "model.top_mlp=[8, 1]", "train.batch_size=128",
       "train.progress=false", "train.eval_every=0", "train.threads=1", "model.dynamic_ids.enabled=true",
       "model.dynamic_ids.capacity=150", "model.dynamic_ids.admit_after=2", 'optim.sparse="adam"']


def test_resume_restores_maps_and_weights_exactly(churn_data: Path, tmp_path: Path, stop_at) -> None:
    from recstack.training.trainer import Trainer

    opts = [f'data.train="{churn_data}"', *DYN, "train.max_steps=30", "train.checkpoint_every=10",
            'model.dynamic_ids.tables=["C1", "C2"]', "model.max_table_size=30"]  # C3: raw ids hashed, % 30
    whole = Trainer(load_config(None, opts), tmp_path / "whole")
    whole.train()
    part = Trainer(load_config(None, opts), tmp_path / "part")
    stop_at(part, 20)
    resumed = Trainer(load_config(None, opts), tmp_path / "part", resume=True)
    assert resumed.step == 20
    resumed.train()
    assert whole.dynamic is not None and resumed.dynamic is not None
    assert set(whole.dynamic.maps) == {"C1", "C2"}
    assert whole.dynamic.maps["C1"].stats()["evictions"] > 0  # the run did reuse rows
    for name, m in whole.dynamic.maps.items():
        for k, v in m.state_dict().items():
            other = resumed.dynamic.maps[name].state_dict()[k]
            assert torch.equal(v, other) if isinstance(v, torch.Tensor) else v == other, (name, k)
    for k, v in whole.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    assert whole.dynamic.stats()["dynamic_ids/collisions"] == 0
    assert whole.model.embeddings.tables[0].num_embeddings == 150  # capacity, not the id range
    assert whole.model.embeddings.tables[2].num_embeddings == 30


def test_planner_sizes_dynamic_tables_by_capacity(churn_data: Path, tmp_path: Path, capsys) -> None:
    from recstack.cli.main import main

    out = tmp_path / "plan.json"  # a raw-id set: 2**62 ids per table, planned at the capacity
    assert main(["plan", "--tables", str(churn_data), "--topology", "1x2", "--dynamic-capacity", "1K",
                 "--dynamic-tables", "C1,C2", "--max-table-size", "30", "--out", str(out)]) == 0
    rows = {e["name"]: e["rows"] for e in json.loads(out.read_text())["tables"]}
    assert rows == {"C1": 1000, "C2": 1000, "C3": 30}
    assert main(["plan", "--tables", str(churn_data), "--dynamic-capacity", "1K", "--dynamic-tables", "C9"]) != 0
    assert "--dynamic-tables: no table 'C9'" in capsys.readouterr().err


def test_sigkill_then_resume_matches_uninterrupted(churn_data: Path, tmp_path: Path) -> None:
    opts = [*DYN, "train.max_steps=70", "train.checkpoint_every=10", "data.eval_fraction=0.2", "train.shuffle=true"]
    ref = run_cli(train_args(tmp_path / "ref", churn_data, opts))
    assert ref.returncode == 0, ref.stderr
    killed = kill_after_checkpoints(train_args(tmp_path / "run", churn_data, opts), tmp_path / "run" / "checkpoints",
                                    2)
    assert killed.returncode == -signal.SIGKILL, "training finished before it could be killed"
    resumed = run_cli(train_args(tmp_path / "run", churn_data, opts, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    a, b = (json.loads((tmp_path / r / "summary.json").read_text()) for r in ("ref", "run"))
    keys = ["auc", "logloss", *(k for k in a if k.startswith("dynamic_ids/"))]
    assert len(keys) == 9 and a["dynamic_ids/evictions"] > 0
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_id_values_and_owners_depend_on_the_id_alone() -> None:
    """An id's initial vector is a function of (key, id): the same in any batch, row or rank; others differ.
    Owners spread consecutive ids evenly over the ranks."""
    a = id_values(ids(5, 2**62 + 3, -7), 11, 6, 0.25)
    assert a.shape == (3, 6) and a.abs().max() < 0.25 and len({tuple(r) for r in a.tolist()}) == 3
    assert torch.equal(id_values(ids(-7, 5), 11, 6, 0.25), a[[2, 0]])
    assert not torch.equal(id_values(ids(5), 12, 6, 0.25), a[:1])  # another table or seed: other values
    owners = id_owner(torch.arange(10_000), 4)
    assert owners.min() >= 0 and owners.max() <= 3
    assert (torch.bincount(owners, minlength=4) - 2500).abs().max() < 150

