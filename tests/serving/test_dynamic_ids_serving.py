"""Dynamic id tables through export and a real server: the artifact carries each dynamic table's id map
(checksummed), and ``recstack serve`` maps raw ids with it, unknown ids to the default row, scoring exactly as
the offline prediction (``recstack predict`` for the data's rows, the loaded model for rows of unknown ids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recstack.cli.main import main
from recstack.data.batch import Batch, SparseFeatures
from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.synth.generate import SynthConfig, generate
from recstack.serving.artifact import ArtifactError, read_manifest
from recstack.serving.model import ServingModel
from recstack.training.inference import load_model
from tests.serving.server_helpers import running

CONFIG = """
[data]
train = "{data}"
eval_fraction = 0.1
[model]
embedding_dim = 4
bottom_mlp = [8, 4]
top_mlp = [8, 1]
[model.dynamic_ids]
enabled = true
capacity = 120
admit_after = 2
eviction = "lfu"
[optim]
sparse = "rowwise_adagrad"
sparse_lr = 0.05
[train]
batch_size = 128
epochs = 1
eval_every = 0
checkpoint_every = 100000
progress = false
"""


def test_served_scores_match_offline_for_known_and_unknown_ids(tmp_path: Path) -> None:
    cfg = SynthConfig(rows=4000, num_dense=2, table_sizes=(600, 150, 20), num_days=2, id_churn=0.3, raw_ids=True,
                      calibration_rows=2048)
    data = generate(cfg, tmp_path / "data", progress=False)
    (tmp_path / "c.toml").write_text(CONFIG.format(data=data))
    run, models = tmp_path / "run", tmp_path / "models"
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--output-dir", str(run)]) == 0
    assert main(["predict", "--checkpoint", str(run), "--data", str(data), "--out", str(tmp_path / "p.npy")]) == 0
    models.mkdir()
    assert main(["export", "--checkpoint", str(run), "--out", str(models)]) == 0
    manifest = read_manifest(models / "1")
    maps = manifest["dynamic_ids"]
    assert set(maps) == {"C1", "C2", "C3"}
    assert 0 < maps["C1"]["count"] <= 119  # within capacity (row 0 is the default)
    assert all(f"dynamic_ids/{t}.{k}.npy" in manifest["files"] for t in maps for k in ("ids", "rows"))

    ds = PreparedDataset(data)
    n = 40
    raw = np.array(ds.arrays["sparse"][:n], np.int64)  # [n, 3] raw ids of the data
    dense = np.array(ds.arrays["dense"][:n], np.float32)
    unknown = raw.copy()
    unknown[:, 0] = np.arange(n) + 7  # ids no row ever held: the default row
    unknown[::2, 1] = np.arange(0, n, 2) + 11

    def rows(ids: np.ndarray) -> list[dict]:
        return [{"I1": float(d[0]), "I2": float(d[1]), **{f"C{j + 1}": int(v) for j, v in enumerate(r)}}
                for d, r in zip(dense, ids, strict=True)]

    _, model = load_model(run)
    assert model.dynamic_ids is not None

    def offline(ids: np.ndarray) -> np.ndarray:
        batch = Batch(torch.from_numpy(dense), SparseFeatures.from_dense_ids(torch.from_numpy(ids)), torch.zeros(n))
        with torch.no_grad():
            return torch.sigmoid(model(model.dynamic_ids.lookup_batch(batch))).double().numpy()

    predicted = np.load(tmp_path / "p.npy")[:n]
    assert np.abs(offline(raw) - predicted).max() <= 1e-6
    known = model.dynamic_ids.maps["C1"].lookup(torch.from_numpy(raw[:, 0]))
    assert (known > 0).any()  # some of the rows' ids have rows of their own
    with running([str(models)], tmp_path / "serve.log") as server:
        for ids, want in ((raw, predicted), (unknown, offline(unknown))):
            r = server.score({"rows": rows(ids), "encoded": True})
            assert r.status_code == 200, r.text
            assert np.abs(np.array(r.json()["scores"]) - want).max() <= 1e-6
    assert not np.allclose(offline(unknown), predicted)  # the unknown ids did change the scores
    # a damaged id map is refused, naming the file
    damaged = models / "1" / "dynamic_ids" / "C1.ids.npy"
    damaged.write_bytes(damaged.read_bytes()[:-8] + b"\x00" * 8)
    with pytest.raises(ArtifactError, match="C1.ids.npy"):
        ServingModel.load(models / "1")
