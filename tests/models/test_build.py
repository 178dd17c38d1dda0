"""build_model from its config sections: the same dense layers whether the tables are built or left on meta."""

from __future__ import annotations

import torch

from recstack.embedding import FusedEmbeddingBagCollection
from recstack.embedding.sparse_optim import SparseOptimizerConfig, sparse_optimizer_config
from recstack.models.build import build_model
from recstack.models.config import ModelConfig
from recstack.training.config import OptimConfig

MODEL = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1])
SIZES = [40, 25, 60]


def _build(tables_on_meta: bool, model: ModelConfig = MODEL):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return build_model(model, SparseOptimizerConfig("rowwise_adagrad"), 3, SIZES, seed=2, tables_on_meta=tables_on_meta)


def test_tables_on_meta_keep_the_dense_layers_and_draw_no_rows() -> None:
    """A model for sharding gets its collection on "meta" (shapes only) and the same dense layers, drawn in the
    same order from torch's RNG, on the device; the tables a single process builds are the seeded ones."""
    for model in (MODEL, ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], interaction="dcn",
                                     dcn_layers=2, dcn_low_rank=3)):
        whole, meta = _build(False, model), _build(True, model)
        assert all(b.is_meta for b in meta.embeddings.buffers())
        assert [t.num_embeddings for t in meta.embeddings.tables] == SIZES
        dense = {k: v for k, v in whole.state_dict().items() if not k.startswith("embeddings.")}
        got = {k: v for k, v in meta.state_dict().items() if not k.startswith("embeddings.")}
        assert dense.keys() == got.keys() and all(torch.equal(dense[k], got[k]) for k in dense)
        assert not any(v.is_meta for v in got.values())
    ref = FusedEmbeddingBagCollection(_build(False).embeddings.tables, SparseOptimizerConfig("rowwise_adagrad"), seed=2)
    assert torch.equal(_build(False).embeddings.weight, ref.weight)


def test_sparse_optimizer_config_reads_the_optim_section() -> None:
    o = OptimConfig(sparse="rowwise_adagrad", sparse_lr=0.3, eps=1e-6, adagrad_init=0.5)
    assert sparse_optimizer_config(o) == SparseOptimizerConfig("rowwise_adagrad", 0.3, 1e-6, 0.5)


def test_embedding_init_bound_reaches_every_table() -> None:
    """model.embedding_init_bound is every table's init bound, on one process and in the sharded tables' configs
    (built on meta, drawn per shard from the same TableConfig); 0 keeps the reference's 1/sqrt(rows)."""
    bound = 1e-3
    model = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], embedding_init_bound=bound)
    small, ref = _build(False, model).embeddings, _build(False).embeddings
    assert small.weight.abs().max() <= bound < ref.weight.abs().max()
    assert all(t.init_bound == bound for t in _build(True, model).embeddings.tables)
    assert all(t.init_bound == 0.0 for t in ref.tables)
    qr = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], embedding_init_bound=bound,
                     qr_collisions=4, qr_threshold=10)  # every table split into quotient and remainder tables
    split = _build(False, qr).embeddings
    assert len(split.tables) == 6 and all(t.init_bound == bound for t in split.tables)
    assert split.weight.abs().max() <= bound
