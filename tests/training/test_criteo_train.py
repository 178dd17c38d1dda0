"""Both real Criteo samples go through `recstack data prepare` and `recstack train` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recstack.cli.main import main


@pytest.mark.parametrize("name,rows", [("criteo_kaggle_sample.tsv", 1999), ("criteo_kaggle_raw1000.tsv", 1000)])
@pytest.mark.parametrize("mapping", [["--max-ind-range", "5000"], []])
def test_prepare_and_train_real_criteo(shared_data: Path, tmp_path: Path, name: str, rows: int,
                                       mapping: list[str]) -> None:
    prepared = tmp_path / "prepared"
    assert main(["data", "prepare", str(shared_data / name), "--out", str(prepared), *mapping]) == 0
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["num_rows"] == rows
    out = tmp_path / "run"
    code = main(["train", "--output-dir", str(out), "--set", f'data.train="{prepared}"',
                 "--set", "data.eval_fraction=0.2", "--set", "train.batch_size=64", "--set", "train.epochs=2",
                 "--set", "train.progress=false", "--set", "model.embedding_dim=8",
                 "--set", "model.bottom_mlp=[32, 8]", "--set", "model.top_mlp=[32, 1]"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_examples"] == int(rows * 0.2)
    assert 0.0 <= summary["auc"] <= 1.0 and summary["logloss"] > 0
    assert summary["train_samples"] == 2 * (rows - int(rows * 0.2))  # every training row, each epoch
