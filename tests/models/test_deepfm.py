"""DeepFM (model.interaction = "fm"): the FM logit against its pairwise definition, the tables' extra column,
the DNN beside it, a short training run, and the settings it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import train_steps
from torch import nn

from recstack.config import load_config
from recstack.data.batch import Batch, SparseFeatures
from recstack.embedding import SparseOptimizerConfig
from recstack.errors import ConfigError
from recstack.models.build import build_model
from recstack.models.interaction import FMInteraction

SIZES, D = [7, 9, 5], 4


def test_fm_logit_is_bias_first_order_and_every_pair() -> None:
    fm = FMInteraction(len(SIZES), D, dense_dim=2)
    with torch.no_grad():
        fm.bias.fill_(0.3)
    g = torch.Generator().manual_seed(0)
    dense, emb = torch.randn(6, 2, generator=g), torch.randn(6, len(SIZES), D + 1, generator=g)
    out = fm(dense, emb)
    assert out.shape == (6, 2 + len(SIZES) * D + 1) == (6, fm.out_dim)
    v, w = emb[..., :D], emb[..., D]
    pairs = sum((v[:, i] * v[:, j]).sum(1) for i in range(len(SIZES)) for j in range(i + 1, len(SIZES)))
    torch.testing.assert_close(out[:, -1], 0.3 + w.sum(1) + pairs)
    torch.testing.assert_close(out[:, :-1], torch.cat([dense, v.flatten(1)], 1))


def _model(interaction: str = "fm"):
    torch.manual_seed(0)
    cfg = load_config(None, [f"model.embedding_dim={D}", f"model.bottom_mlp=[8, {D}]", "model.top_mlp=[16, 1]",
                             f'model.interaction="{interaction}"']).model
    return build_model(cfg, SparseOptimizerConfig("adam", 0.01), 3, SIZES, seed=1)


def test_deepfm_adds_the_fm_logit_to_the_dnn() -> None:
    net = _model()
    assert all(t.embedding_dim == D + 1 for t in net.embeddings.tables)  # the first-order weight's column
    assert net.projection is None
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(0, n, (5,), generator=g) for n in SIZES])
    batch = Batch(torch.rand(5, 3, generator=g), SparseFeatures(ids, torch.arange(16), len(SIZES)), torch.zeros(5))
    net.eval()
    with torch.no_grad():
        feats = net.forward_features(batch)
        dnn = nn.Sequential(*net.top)(feats[:, :-1])  # the plain layers of the top MLP
        torch.testing.assert_close(net(batch), (dnn + feats[:, -1:]).squeeze(1))
    assert feats.shape[1] == D + len(SIZES) * D + 1  # bottom output, vectors, FM logit


def test_deepfm_trains(tiny_dataset: Path) -> None:
    out = train_steps(tiny_dataset, None, ['model.interaction="fm"', "model.top_mlp=[16, 1]", 'optim.sparse="adam"',
                                           "optim.sparse_lr=0.01", 'optim.sparse_weight_decay_mode="all_rows"',
                                           "optim.sparse_weight_decay=1e-4", "train.max_steps=30"])
    assert 0.5 < out["auc"] <= 1.0 and out["logloss"] < 0.7


@pytest.mark.parametrize("setting", ["model.table_dims={C1 = 4}", "model.qr_collisions=4"])
def test_deepfm_refuses_per_table_dims_and_qr(setting: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.(table_dims|qr_collisions): not supported with "
                                          r"model\.interaction = 'fm'"):
        load_config(None, ['model.interaction="fm"', setting])


def test_deepfm_exports_for_serving(tmp_path: Path) -> None:
    from recstack.serving.export import DenseProgram, export_program

    net = _model().eval()
    export_program(net, tmp_path / "dense.pt2")
    program = torch.export.load(tmp_path / "dense.pt2").module()
    g = torch.Generator().manual_seed(2)
    pooled, dense = torch.randn(3, len(SIZES), D + 1, generator=g), torch.randn(3, 3, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(program(pooled, dense, torch.arange(3)), DenseProgram(net)(pooled, dense))
