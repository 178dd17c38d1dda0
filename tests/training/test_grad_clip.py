"""Gradient-norm clipping (``optim.max_grad_norm``) in one process: a DLRM whose tables update inside backward
against the same model in plain torch (the tables as dense ``nn.Parameter``s, the L2 term in the loss,
``torch.nn.utils.clip_grad_norm_`` over every parameter, torch's optimizers); the clip scale with the optimizers
that have no plain-torch counterpart; QR and mixed-dim tables; the config's checks."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import train_step
from torch import nn

from recstack.config import load_config
from recstack.data.batch import Batch, SparseFeatures
from recstack.embedding import FusedEmbeddingBagCollection, SparseOptimizerConfig, TableConfig
from recstack.embedding.sparse_optim import sparse_optimizer_config
from recstack.embedding.tiered.collection import TablePlacement, TieredEmbeddingCollection
from recstack.errors import ConfigError
from recstack.models.build import build_model
from recstack.models.dlrm import DLRM
from recstack.training.step import build_dense_optimizer

SIZES = [20, 30, 5]
DIM = 4
STEPS = 4


def _batch(seed: int, b: int = 32) -> Batch:
    """Bags of 0-3 ids (repeats within a batch: rows summed per distinct row), 3 dense features."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(SIZES), b), generator=g)
    ids = torch.cat([torch.randint(0, n, (int(lengths[f].sum()),), generator=g) for f, n in enumerate(SIZES)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.reshape(-1).cumsum(0)])
    return Batch(torch.rand(b, 3, generator=g), SparseFeatures(ids, offsets, len(SIZES)),
                 torch.randint(0, 2, (b,), generator=g).float())


def _recstack(overrides: list[str]) -> tuple[DLRM, torch.optim.Optimizer]:
    cfg = load_config(None, [f"model.embedding_dim={DIM}", "model.bottom_mlp=[8, 4]", "model.top_mlp=[16, 1]",
                             "optim.dense_lr=0.1", "optim.sparse_lr=0.05", *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model, sparse_optimizer_config(cfg.optim), 3, SIZES, seed=1)
    return model, build_dense_optimizer(cfg.optim, model.dense_parameters(), model.embeddings)


class PlainTables(nn.Module):
    """The fused collection's tables as one dense parameter [R, D], pooled by ``embedding_bag`` -> [B, F, D]."""

    def __init__(self, fused: FusedEmbeddingBagCollection) -> None:
        super().__init__()
        self.weight = nn.Parameter(fused.weight.detach().clone())
        self.fused = [fused]  # its row offsets (in a list: not a submodule)

    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        rows = self.fused[0].global_rows(sparse)
        pooled = F.embedding_bag(rows, self.weight, sparse.offsets, mode="sum", include_last_offset=True)
        return pooled.view(sparse.num_features, sparse.batch_size, DIM).transpose(0, 1)


def _reference(model: DLRM) -> tuple[DLRM, PlainTables]:
    ref = copy.deepcopy(model)
    assert isinstance(model.embeddings, FusedEmbeddingBagCollection)
    tables = PlainTables(model.embeddings)
    ref.embeddings = tables  # type: ignore[assignment]
    return ref, tables


def _reference_step(ref: DLRM, tables: PlainTables, opt: torch.optim.Optimizer, batch: Batch, max_norm: float,
                    wd: float, mode: str) -> float:
    """FuxiCTR's step: loss + the L2 term, backward, clip_grad_norm_ over every parameter, step -> the norm."""
    loss = F.binary_cross_entropy_with_logits(ref(batch), batch.labels)
    if wd:
        rows = (tables.fused[0].global_rows(batch.sparse).unique() if mode == "touched"
                else torch.arange(tables.weight.shape[0]))
        loss = loss + wd / 2 * tables.weight[rows].pow(2).sum()
    ref.zero_grad()  # the tables too: test_clip_scale_matches_plain_torch does not step them
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm))
    opt.step()
    return norm


def _assert_same(model: DLRM, ref: DLRM, tables: PlainTables, what: str) -> None:
    assert isinstance(model.embeddings, FusedEmbeddingBagCollection)
    torch.testing.assert_close(model.embeddings.weight, tables.weight.detach(), rtol=1e-5, atol=1e-6, msg=what)
    dense = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), dense[name].detach(), rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


@pytest.mark.parametrize(("sparse", "dense", "wd", "mode"), [
    ("sgd", "sgd", 0.0, "touched"), ("sgd", "sgd", 0.02, "touched"), ("sgd", "sgd", 0.02, "all_rows"),
    ("adam", "adam", 0.01, "all_rows"),  # FuxiCTR's: Adam on every row with its embedding_regularizer
])
def test_clipped_training_matches_plain_torch(sparse: str, dense: str, wd: float, mode: str) -> None:
    max_norm = 0.05
    model, opt = _recstack([f'optim.sparse="{sparse}"', f'optim.dense="{dense}"', f"optim.sparse_weight_decay={wd}",
                            f'optim.sparse_weight_decay_mode="{mode}"', f"optim.max_grad_norm={max_norm}"])
    ref, tables = _reference(model)
    lrs = [{"params": [p for n, p in ref.named_parameters() if n != "embeddings.weight"], "lr": 0.1},
           {"params": [tables.weight], "lr": 0.05}]
    ref_opt = torch.optim.SGD(lrs) if sparse == "sgd" else torch.optim.Adam(lrs)
    unclipped, _ = _recstack([f'optim.sparse="{sparse}"', f'optim.dense="{dense}"',
                              f"optim.sparse_weight_decay={wd}", f'optim.sparse_weight_decay_mode="{mode}"'])
    for step in range(STEPS):
        batch = _batch(step)
        train_step(model, opt, batch)
        norm = _reference_step(ref, tables, ref_opt, batch, max_norm, wd, mode)
        assert norm > 2 * max_norm  # every step is clipped
        _assert_same(model, ref, tables, f"step {step}")
    assert isinstance(unclipped.embeddings, FusedEmbeddingBagCollection)
    assert not torch.allclose(unclipped.embeddings.weight, tables.weight, atol=1e-4)  # the clip made a difference


@pytest.mark.parametrize("sparse", ["rowwise_adagrad", "adam"])
def test_clip_scale_matches_plain_torch(sparse: str) -> None:
    """Row-wise Adagrad and lazy Adam have no plain-torch optimizer: the tables are copied into the reference
    after each step, and the dense parameters (SGD), which move by exactly scale x their gradient, must agree."""
    max_norm = 0.05
    model, opt = _recstack([f'optim.sparse="{sparse}"', "optim.sparse_weight_decay=0.01",
                            f"optim.max_grad_norm={max_norm}"])
    ref, tables = _reference(model)
    ref_opt = torch.optim.SGD([p for n, p in ref.named_parameters() if n != "embeddings.weight"], lr=0.1)
    assert isinstance(model.embeddings, FusedEmbeddingBagCollection)
    for step in range(STEPS):
        batch = _batch(step)
        train_step(model, opt, batch)
        assert _reference_step(ref, tables, ref_opt, batch, max_norm, 0.01, "touched") > 2 * max_norm
        with torch.no_grad():
            tables.weight.copy_(model.embeddings.weight)
        _assert_same(model, ref, tables, f"step {step}")


@pytest.mark.parametrize("model_keys", [['model.table_dims={t1 = 2}'], ["model.qr_collisions=4",
                                                                         "model.qr_threshold=10"]])
def test_mixed_dims_and_qr_tables_defer_and_clip(model_keys: list[str]) -> None:
    """A clip that never binds (scale 1) leaves training as without the option (up to the order of float sums:
    deferred SGD sums per distinct row first); a binding one moves every table less."""
    runs = {}
    for norm in (0.0, 1e9, 0.01):
        model, opt = _recstack([*model_keys, f"optim.max_grad_norm={norm}"])
        start = copy.deepcopy(model.embeddings.state_dict())
        for step in range(STEPS):
            train_step(model, opt, _batch(step))
        runs[norm] = {k: (v - start[k]).norm() for k, v in model.embeddings.state_dict().items()
                      if k.endswith("weight")}
    assert len(runs[0.0]) == (2 if "model.table_dims={t1 = 2}" in model_keys else 1)
    for k, moved in runs[0.0].items():
        torch.testing.assert_close(runs[1e9][k], moved)
        assert 0 < runs[0.01][k] < moved / 2, k


def test_off_leaves_the_embeddings_applying_in_backward() -> None:
    model, _ = _recstack([])
    assert not model.embeddings.optimizer.defer
    model, _ = _recstack(["optim.max_grad_norm=1.0"])
    assert model.embeddings.optimizer.defer


@pytest.mark.parametrize(("overrides", "keys"), [
    (["optim.max_grad_norm=-1.0"], ["optim.max_grad_norm"]),
    (["optim.max_grad_norm=inf"], ["optim.max_grad_norm"]),
    (["optim.max_grad_norm=10.0", 'memory.device="1MiB"'], ["optim.max_grad_norm", "memory.device"]),
])
def test_bad_values_name_their_keys(overrides: list[str], keys: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for key in keys:
        assert re.search(re.escape(key), str(e.value)), (key, str(e.value))


def test_cached_tiers_refuse_to_defer() -> None:
    """A plan can place shards in cached tiers without [memory] budgets: the collection refuses on its own."""
    tables = [TableConfig("a", 40, DIM, (0,)), TableConfig("b", 30, DIM, (1,))]
    tiered = TieredEmbeddingCollection(tables, SparseOptimizerConfig("sgd"), [TablePlacement(),
                                                                             TablePlacement("host-cached", 8)])
    with pytest.raises(ConfigError, match=r"optim\.max_grad_norm.*memory tiers"):
        tiered.defer_updates()
    tiered.close()
