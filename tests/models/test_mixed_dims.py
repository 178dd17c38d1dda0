"""Per-table embedding dims (``model.table_dims``): the small tables have their stated dims, the model
trains, the default model is unchanged, bad keys and dims are ConfigErrors naming them."""

from __future__ import annotations

import pytest
import torch
from conftest import train_step

from recstack.data.batch import Batch, SparseFeatures
from recstack.embedding import FusedEmbeddingBagCollection, SparseOptimizerConfig
from recstack.embedding.mixed import MixedDimEmbeddingCollection
from recstack.errors import ConfigError
from recstack.models.build import build_model
from recstack.models.config import ModelConfig

SIZES = [20, 30, 5, 7]
NAMES = ["a", "b", "c", "d"]


def _model(**fields):
    torch.manual_seed(0)
    cfg = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[16, 1], **fields)
    cfg.validate()
    return build_model(cfg, SparseOptimizerConfig("sgd", 0.1), 3, SIZES, seed=1, names=NAMES)


def _batch(b: int = 16) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(0, n, (b,), generator=g) for n in SIZES])
    return Batch(torch.rand(b, 3, generator=g), SparseFeatures(ids, torch.arange(len(SIZES) * b + 1), len(SIZES)),
                 torch.randint(0, 2, (b,), generator=g).float())


def test_tables_have_their_dims_and_the_model_trains() -> None:
    net = _model(table_dims={"c": 2, "b": 3})
    emb = net.embeddings
    assert isinstance(emb, MixedDimEmbeddingCollection)
    assert [t.embedding_dim for t in emb.tables] == [4, 3, 2, 4]
    assert [tuple(emb.table_weight(n).shape) for n in NAMES] == [(20, 4), (30, 3), (5, 2), (7, 4)]
    rows = sum(b.numel() for n, b in net.named_buffers() if n.endswith("weight"))
    assert rows == 20 * 4 + 30 * 3 + 5 * 2 + 7 * 4  # memory shrinks with the dims
    assert [tuple(p.shape) for p in net.projection.weights] == [(3, 4), (2, 4)]
    batch = _batch()
    opt = torch.optim.SGD(net.dense_parameters(), lr=0.1)
    before = [p.detach().clone() for p in net.projection.weights]
    losses = [float(train_step(net, opt, batch)) for _ in range(5)]
    assert losses[-1] < losses[0]
    assert all(not torch.equal(a, p) for a, p in zip(before, net.projection.weights, strict=True))


def test_default_is_unchanged() -> None:
    net, ref = _model(), _model(table_dims={})
    assert isinstance(net.embeddings, FusedEmbeddingBagCollection) and net.projection is None
    for (k, a), (_, b) in zip(net.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_rows_match_the_same_tables_at_one_dim() -> None:
    """A table keeps its initial rows whatever the other tables' dims (drawn per table)."""
    mixed, plain = _model(table_dims={"b": 3}), _model()
    for n in ("a", "c", "d"):
        assert torch.equal(mixed.embeddings.table_weight(n), plain.embeddings.table_weight(n))


@pytest.mark.parametrize(("dims", "key"), [({"zz": 2}, "model.table_dims.zz"), ({"b": 0}, "model.table_dims.b"),
                                           ({"b": -1}, "model.table_dims.b")])
def test_bad_table_dims_name_the_key(dims: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        _model(table_dims=dims)


def test_export_scores_equal_offline_predict(tiny_dataset, tmp_path) -> None:
    """fp32 tables of several dims: the served scores are the offline model's, exactly."""
    from conftest import train_steps

    from recstack.data.prepared_dataset import PreparedDataset
    from recstack.serving.export import export_checkpoint
    from recstack.serving.model import EncodedBatch, ServingModel
    from recstack.training.inference import load_model

    run = tmp_path / "run"
    train_steps(tiny_dataset, run, ["train.max_steps=10", "model.table_dims={C3=2, C1=4}"])
    path, _ = export_checkpoint(run, tmp_path / "art")
    served = ServingModel.load(path)
    assert {t["name"]: t["dim"] for t in served.manifest["tables"]} == {"C1": 4, "C2": 8, "C3": 2, "C4": 8}
    _, net = load_model(run, "cpu")
    batch = PreparedDataset(tiny_dataset).batch(0, 64)
    with torch.no_grad():
        offline = net(batch)
    assert torch.equal(served.score(EncodedBatch(batch.dense, batch.sparse)), offline)
