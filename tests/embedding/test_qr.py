"""Quotient-remainder tables: the reference's formula, unique vectors per id, every placement (one process,
memory tiers, two ranks under torchrun) training alike, checkpoints, the planner and config errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RECSTACK, cli_train, small_config, torchrun, train_steps

from recstack.cli.main import main
from recstack.config import Config, load_config
from recstack.data.batch import Batch, SparseFeatures
from recstack.embedding.collection import TableConfig
from recstack.embedding.qr import QRSplit
from recstack.embedding.sparse_optim import sparse_optimizer_config
from recstack.errors import ConfigError
from recstack.models.build import build_model
from recstack.training.trainer import Trainer

QR = ["model.qr_collisions=4", "model.qr_threshold=100"]  # the tiny set's C2 (300 rows) and C4 (1000) split
SMALL = ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.threads=1",
         "train.progress=false", "train.log_every=20", 'optim.sparse="rowwise_adagrad"']


def _model(operation: str = "mult", sizes=(5, 100, 37), names=("a", "b", "c")):
    cfg = Config()
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
    cfg.model.qr_collisions, cfg.model.qr_threshold, cfg.model.qr_operation = 4, 10, operation
    return build_model(cfg.model, sparse_optimizer_config(cfg.optim), 3, list(sizes), seed=cfg.train.seed,
                       names=list(names))


def _jagged(bags: list[list[list[int]]], weights: bool) -> SparseFeatures:
    """bags[f][b] -> feature-major SparseFeatures (weights 1, 2, 3, ... when asked)."""
    ids = [i for f in bags for bag in f for i in bag]
    lengths = [len(bag) for f in bags for bag in f]
    offsets = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
    w = torch.arange(1, len(ids) + 1, dtype=torch.float32) if weights else None
    return SparseFeatures(torch.tensor(ids, dtype=torch.int64), offsets, len(bags), w)


@pytest.mark.parametrize("operation", ["mult", "add"])
@pytest.mark.parametrize("weights", [False, True])
def test_pooled_embeddings_follow_the_reference_formula(operation: str, weights: bool) -> None:
    """Features a (5 rows, not split), b (100), c (37, shared with feature d): bags of 0-3 ids; each split
    feature is sum_i w_i Q[id_i // 4] (op) sum_i w_i R[id_i % 4], pooled apart and then combined."""
    m = _model(operation, sizes=(5, 100, 37, 37), names=("a", "b", "c", "c"))
    assert [(t.name, t.num_embeddings, t.features) for t in m.embeddings.tables] == [
        ("a", 5, (0,)), ("b", 25, (1,)), ("c", 10, (2, 3)), ("b_rem", 4, (4,)), ("c_rem", 4, (5, 6))]
    rng = np.random.default_rng(0)
    sizes = [5, 100, 37, 37]
    bags = [[list(rng.integers(0, n, rng.integers(0, 4))) for _ in range(6)] for n in sizes]
    sparse = _jagged(bags, weights)
    got = m.qr.combine(m.embeddings(m.qr.split(sparse)))  # [6, 4, 4]
    w = {t.name: m.embeddings.table_weight(t.name) for t in m.embeddings.tables}
    table = ["a", "b", "c", "c"]
    pos = 0
    for f in range(len(sizes)):
        for b in range(6):
            ids = bags[f][b]
            ws = [float(pos + k + 1) if weights else 1.0 for k in range(len(ids))]
            pos += len(ids)
            if f == 0:
                want = sum((wk * w["a"][i] for wk, i in zip(ws, ids, strict=True)), torch.zeros(4))
            else:
                q = sum((wk * w[table[f]][i // 4] for wk, i in zip(ws, ids, strict=True)), torch.zeros(4))
                r = sum((wk * w[table[f] + "_rem"][i % 4] for wk, i in zip(ws, ids, strict=True)), torch.zeros(4))
                want = q * r if operation == "mult" else q + r
            torch.testing.assert_close(got[b, f], want, rtol=1e-5, atol=1e-6)


def test_every_id_gets_its_own_vector_where_hashing_would_share() -> None:
    """100 ids of table b in 25 + 4 rows: all 100 vectors differ. Hashing into 29 rows would give ids 0 and
    29 one row."""
    m = _model()
    ids = torch.arange(100)
    sparse = SparseFeatures.from_dense_ids(torch.stack([ids % 5, ids, ids % 37], 1))
    with torch.no_grad():
        vectors = m.qr.combine(m.embeddings(m.qr.split(sparse)))[:, 1]  # [100, 4]
    assert torch.unique(vectors, dim=0).shape[0] == 100
    assert sum(t.num_embeddings for t in m.embeddings.tables) == 5 + 25 + 10 + 4 + 4


def test_model_splits_itself_or_takes_split_ids_and_trains_both_parts() -> None:
    m = _model()
    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.rand(8, 3, generator=g), SparseFeatures.from_dense_ids(
        torch.stack([torch.randint(0, n, (8,), generator=g) for n in (5, 100, 37)], 1)), torch.ones(8))
    split = m.split_batch(batch)
    assert split.sparse.num_features == 5 and m.split_batch(split) is not split  # split ids pass through
    assert m.qr.split(split.sparse) is split.sparse
    torch.testing.assert_close(m(batch), m(split))
    before = {t.name: m.embeddings.table_weight(t.name).clone() for t in m.embeddings.tables}
    torch.nn.functional.binary_cross_entropy_with_logits(m(batch), batch.labels).backward()
    for name in ("b", "b_rem", "c", "c_rem"):
        assert not torch.equal(m.embeddings.table_weight(name), before[name]), name


def test_no_split_when_off_or_no_table_is_large() -> None:
    tables = [TableConfig("a", 50, 4, (0,)), TableConfig("b", 200, 4, (1,))]
    assert QRSplit.build(tables, 0, 10, "mult") is None
    assert QRSplit.build(tables, 4, 200, "mult") is None  # not more than the threshold
    assert QRSplit.build(tables, 300, 10, "mult") is None  # not more rows than m
    split = QRSplit.build(tables, 4, 100, "add")
    assert [t.name for t in split.tables] == ["a", "b", "b_rem"] and split.rows() == (250, 50 + 50 + 4)
    with pytest.raises(ValueError, match="a table 'b_rem' exists"):
        QRSplit.build([*tables, TableConfig("b_rem", 3, 4, (2,))], 4, 100, "mult")
    with pytest.raises(ValueError, match="expects 2"):
        split.split(SparseFeatures.from_dense_ids(torch.zeros(3, 4, dtype=torch.int64)))


@pytest.mark.parametrize("override,field", [("model.qr_collisions=1", "qr_collisions"),
                                            ("model.qr_collisions=-2", "qr_collisions"),
                                            ("model.qr_threshold=-1", "qr_threshold"),
                                            ('model.qr_operation="concat"', "qr_operation")])
def test_config_errors_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(None, [override])


def _train(data: Path, out: Path | None, extra: list[str]) -> dict:
    return train_steps(data, out, extra, base=SMALL)


def test_trains_and_checkpoints_resume_and_eval(tiny_dataset: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    """A QR model learns the tiny set's signal with 27% of the rows; a run cut at step 40 and resumed ends
    where an uninterrupted one does; `recstack eval` on its checkpoint scores as training did."""
    steps = ["train.batch_size=128", "train.max_steps=120", "train.checkpoint_every=40"]
    full = _train(tiny_dataset, None, ["train.batch_size=128", "train.max_steps=120"])
    qr = _train(tiny_dataset, tmp_path / "qr", [*QR, *steps])
    assert qr["auc"] > 0.5 + 0.8 * (full["auc"] - 0.5) and qr["logloss"] != full["logloss"]
    _train(tiny_dataset, tmp_path / "cut", [*QR, *steps[:2], "train.max_steps=40", "train.checkpoint_every=40"])
    cfg = small_config(tiny_dataset, [*QR, *steps], base=SMALL)
    resumed = Trainer(cfg, tmp_path / "cut", resume=True)
    assert resumed.step == 40
    assert resumed.train()["logloss"] == qr["logloss"]
    assert main(["eval", "--checkpoint", str(tmp_path / "qr"), "--data", str(tiny_dataset)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["num_examples"] == 20000


def test_memory_tiers_train_qr_tables_as_all_in_memory(tiny_dataset: Path, tmp_path: Path) -> None:
    """Budgets that leave the 250-row quotient table to a cache (prefetch on: the loader splits the ids it
    announces) change nothing."""
    run = [*QR, "train.batch_size=128", "train.max_steps=60"]
    plain = _train(tiny_dataset, None, run)
    tiered = _train(tiny_dataset, tmp_path, [*run, 'memory.device="2200"', 'memory.host="0"',
                                             f'memory.ssd_dir="{tmp_path / "ssd"}"'])
    assert tiered["logloss"] == pytest.approx(plain["logloss"], abs=1e-6)


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_torchrun_two_ranks_match_single(tiny_dataset: Path, tmp_path: Path, sharding: str) -> None:
    """The split tables are sharded like any other; the pipelined loader splits ids before routing them."""

    def run(cmd: list[str], out: Path, extra: list[str]) -> dict:
        options = [*SMALL, *QR, "train.max_steps=60", "train.eval_every=25", *extra]
        return cli_train(out, tiny_dataset, options, launcher=cmd)

    one = run(RECSTACK, tmp_path / "one", ["train.batch_size=128"])
    two = run(torchrun(2), tmp_path / "two", ["train.batch_size=64", f'dist.sharding="{sharding}"'])
    assert two["world_size"] == 2
    for k in ("auc", "logloss", "ne"):
        assert two[k] == pytest.approx(one[k], abs=1e-5), k


def test_planner_plans_the_split_tables(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", "criteo_kaggle", "--topology", "1x2", "--qr-collisions", "4",
                 "--out", str(out)]) == 0
    from recstack.data.prepare.criteo import KAGGLE_CARDINALITIES

    rows = {e["name"]: e["rows"] for e in json.loads(out.read_text())["tables"]}
    assert rows["C3"] == -(-KAGGLE_CARDINALITIES[2] // 4) and rows["C3_rem"] == 4
    assert rows["C20"] == KAGGLE_CARDINALITIES[19] and "C20_rem" not in rows  # 4 rows: below the threshold
    assert len(rows) == 26 + sum(n > 200 for n in KAGGLE_CARDINALITIES)
