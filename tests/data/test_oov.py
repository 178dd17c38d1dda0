"""The rows a prepared set reserves for no known value (missing, out of vocabulary) start at zero in a new model;
rare training values (below ``min_freq``) train the out-of-vocabulary row, and serving scores an unseen value
with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMALL

from recstack.cli.main import main
from recstack.config import load_config
from recstack.data.prepare.schema import schema_from_dict, schema_to_toml
from recstack.data.prepared_dataset import PreparedDataset
from recstack.serving.model import ServingModel
from recstack.training.trainer import Trainer

FREQUENT = ["a", "b", "c", "d"]


def _write_csv(path: Path, rows: int = 1500, seed: int = 0) -> Path:
    """label, x (dense), cat: four frequent values and, on every 10th row, a value seen once."""
    rng = np.random.default_rng(seed)
    lines = ["label,x,cat"]
    for r in range(rows):
        cat = f"once{r}" if r % 10 == 0 else FREQUENT[int(rng.integers(4))]
        x = float(rng.random())
        p = 1 / (1 + np.exp(-(2 * x - 1 + (1.5 if cat in ("a", "b") else -1.0 if cat.startswith("once") else 0))))
        lines.append(f"{int(rng.random() < p)},{x:.5f},{cat}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _prepare(tmp: Path, min_freq: int) -> Path:
    schema = {"source": {"format": "csv"}, "label": {"column": "label"},
              "dense": [{"name": "x", "transform": "none"}],
              "sparse": [{"name": "cat", "encoding": "vocab", "min_freq": min_freq}]}
    (tmp / "schema.toml").write_text(schema_to_toml(schema_from_dict(schema)))
    out = tmp / "data"
    assert main(["data", "prepare", "--schema", str(tmp / "schema.toml"), str(_write_csv(tmp / "raw.csv")),
                 "--out", str(out), "--no-progress"]) == 0
    return out


def _trained(tmp: Path, data: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the table's rows before training, after 2 epochs); the run is in tmp / run."""
    cfg = load_config(None, [f'data.train="{data}"', *SMALL, "train.epochs=2", "data.eval_fraction=0",
                             "model.bottom_mlp=[8]"])
    trainer = Trainer(cfg, tmp / "run")
    try:
        before = trainer.model.embeddings.table_weight("cat").detach().clone()
        trainer.train()
        return before, trainer.model.embeddings.table_weight("cat").detach().clone()
    finally:
        trainer.close()


@pytest.mark.parametrize("min_freq", [1, 2])
def test_reserved_rows_start_at_zero_and_rare_values_train_the_oov_row(tmp_path: Path, min_freq: int) -> None:
    data = _prepare(tmp_path, min_freq)
    spec = PreparedDataset(data).sparse_features[0]
    assert spec.reserved_rows == 2  # 0 = missing, 1 = out of vocabulary
    before, after = _trained(tmp_path, data)
    assert torch.count_nonzero(before[:2]) == 0 and torch.count_nonzero(before[2:]) == before[2:].numel()
    assert torch.count_nonzero(after[0]) == 0  # no training row misses the value
    if min_freq == 1:  # every training value has its own row: nothing touches row 1, which stays zero
        assert spec.num_embeddings == 2 + 4 + 150 and torch.count_nonzero(after[1]) == 0
    else:  # the 150 values seen once map to row 1, which learns from them
        assert spec.num_embeddings == 2 + 4 and float(after[1].abs().max()) > 1e-3
    assert not torch.equal(after[2:], before[2:])

    # Served: an unseen value looks up row 1, as a rare training value does (min_freq 2).
    root = tmp_path / "models"
    root.mkdir()
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(root), "--tables", "fp32"]) == 0
    m = ServingModel.load(root / "1")
    rows = [{"x": 0.5, "cat": "never-seen"}, {"x": 0.5, "cat": "once10"}, {"x": 0.5, "cat": "a"}]
    batch = m.encode(rows)
    ids = batch.sparse.ids.tolist()
    assert ids[0] == 1 and ids[2] >= 2 and batch.oov_counts == {"cat": 1 if min_freq == 1 else 2}
    scores = m.score(batch).tolist()
    if min_freq == 2:
        assert ids[1] == 1 and scores[0] == pytest.approx(scores[1], abs=1e-6)  # the same inputs (up to rounding)
        assert abs(scores[0] - scores[2]) > 1e-3


def test_zero_rows_are_zero_on_every_placement_and_the_others_unchanged() -> None:
    """init_table, a chunked draw (tiered files) and a row shard's block (sharded tables) agree: rows [0, k) zero,
    every other row the value it had without reserved rows."""
    from recstack.embedding.collection import TableConfig, init_block, init_row_chunks, init_table

    plain, reserved = TableConfig("t", 50, 4, (0,)), TableConfig("t", 50, 4, (0,), zero_rows=2)
    want = init_table(plain, 3, 1)
    whole = init_table(reserved, 3, 1)
    assert torch.count_nonzero(whole[:2]) == 0 and torch.equal(whole[2:], want[2:])
    assert torch.equal(torch.cat(list(init_row_chunks(reserved, 3, 1, chunk_rows=1))), whole)
    assert torch.equal(init_block(reserved, 3, 1, (1, 30), (1, 3)), whole[1:30, 1:3])
