"""Regularisation: dropout and normalisation in the MLPs, L2 on the touched embedding rows (single process,
tiered tables, 2 gloo ranks against one process), dense weight decay; a model without dense features needs no
bottom-MLP setting."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import train_step, train_steps
from torch import nn

from recstack.config import load_config
from recstack.data.batch import Batch, SparseFeatures
from recstack.embedding import FusedEmbeddingBagCollection, SparseOptimizer, SparseOptimizerConfig, TableConfig
from recstack.embedding.sparse_optim import sparse_optimizer_config
from recstack.errors import ConfigError
from recstack.models.build import build_model
from recstack.models.config import ModelConfig
from recstack.models.fused_mlp import MLP
from recstack.training.step import build_dense_optimizer

SIZES = [20, 30, 5]
DIM = 4


def _model(num_dense: int = 3, **fields) -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(embedding_dim=DIM, bottom_mlp=[8, DIM], top_mlp=[16, 8, 1], **fields)
    cfg.validate()
    return build_model(cfg, SparseOptimizerConfig("sgd", 0.1), num_dense, SIZES, seed=1)


def _batch(b: int = 32, num_dense: int = 3, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, n, (b,), generator=g) for n in SIZES])
    offsets = torch.arange(len(SIZES) * b + 1)
    return Batch(torch.rand(b, num_dense, generator=g), SparseFeatures(ids, offsets, len(SIZES)),
                 torch.randint(0, 2, (b,), generator=g).float())


# -- dropout and normalisation ---------------------------------------------------------------------------------
def test_defaults_build_todays_mlps() -> None:
    net = _model()
    for m in (net.bottom, net.top):
        assert isinstance(m, MLP) and m._plain  # Linear/ReLU only: the fused training step
        assert all(isinstance(x, (nn.Linear, nn.ReLU)) for x in m)


@pytest.mark.parametrize("norm", ["none", "batch", "layer"])
def test_norm_and_dropout_sit_in_the_hidden_layers_only(norm: str) -> None:
    net = _model(dropout=0.3, mlp_norm=norm)
    kind = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm, "none": ()}[norm]
    # bottom [3 -> 8 -> 4] (ReLU after the last), top [in -> 16 -> 8 -> 1]: nothing after the last Linear but
    # the bottom MLP's ReLU
    for m, hidden in ((net.bottom, 1), (net.top, 2)):
        assert not m._plain
        assert sum(isinstance(x, nn.Dropout) for x in m) == hidden
        assert sum(isinstance(x, kind) for x in m) == (hidden if norm != "none" else 0)
        last = max(i for i, x in enumerate(m) if isinstance(x, nn.Linear))
        assert all(isinstance(x, nn.ReLU) for x in list(m)[last + 1 :])
    # the Linear layers are drawn as without regularisation: same values, in the same order
    plain = _model()
    lin = [p for n, p in net.named_parameters() if not n.startswith("embeddings.") and p.dim() == 2]
    ref = [p for n, p in plain.named_parameters() if not n.startswith("embeddings.") and p.dim() == 2]
    assert len(lin) == len(ref) and all(torch.equal(a, b) for a, b in zip(lin, ref, strict=True))


def test_dropout_is_on_in_training_and_off_in_eval() -> None:
    net, plain, batch = _model(dropout=0.5), _model(), _batch()
    net.eval()
    plain.eval()
    with torch.no_grad():
        a, b = net(batch), net(batch)
        assert torch.equal(a, b)  # eval: deterministic
        assert torch.equal(a, plain(batch))  # and exactly the model without dropout (same weights)
    net.train()
    torch.manual_seed(5)
    with torch.no_grad():  # training mode without gradients (the plain modules run): masks drawn
        c, d = net(batch), net(batch)
    assert not torch.equal(c, d) and not torch.equal(c, a)
    net.embeddings.eval()  # keep the tables still: only the dense part trains here
    loss = nn.functional.binary_cross_entropy_with_logits(net(batch), batch.labels)
    loss.backward()  # training with gradients: autograd through the dropout modules
    assert all(p.grad is not None for p in net.dense_parameters())


@pytest.mark.parametrize("norm", ["batch", "layer"])
def test_norm_trains_and_is_deterministic_in_eval(norm: str) -> None:
    net = _model(mlp_norm=norm)
    opt = build_dense_optimizer(load_config(None, []).optim, net.dense_parameters())
    before = net(_batch()).detach()
    for step in range(3):
        batch = _batch(seed=step)
        loss = nn.functional.binary_cross_entropy_with_logits(net(batch), batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    norms = [m for m in net.top if isinstance(m, (nn.BatchNorm1d, nn.LayerNorm))]
    assert norms and all(not torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)  # trained
    if norm == "batch":
        assert not torch.equal(norms[0].running_mean, torch.zeros_like(norms[0].running_mean))
    net.eval()
    with torch.no_grad():
        x, y = net(_batch(seed=9)), net(_batch(seed=9))
    assert torch.equal(x, y) and not torch.equal(net(_batch()).detach(), before)


def test_regularised_run_trains_and_evaluates(tiny_dataset: Path, tmp_path: Path) -> None:
    """Every option at once through the trainer and its checkpoint; ``recstack eval`` / ``predict`` load the
    model in eval mode (no dropout: the same scores twice)."""
    from recstack.data.loader import BatchLoader
    from recstack.data.prepared_dataset import PreparedDataset
    from recstack.training.inference import load_model

    summary = train_steps(tiny_dataset, tmp_path / "run", [
        "train.max_steps=30", "model.dropout=0.2", 'model.mlp_norm="batch"', "optim.sparse_weight_decay=1e-4",
        "optim.dense_weight_decay=1e-5"])
    assert math.isfinite(summary["auc"]) and summary["auc"] > 0.5
    cfg, model = load_model(tmp_path / "run")
    assert cfg.model.dropout == 0.2 and not model.training
    batch = next(BatchLoader(PreparedDataset(tiny_dataset), 256, (0, 256), prefetch=0).iterate_epoch())
    with torch.no_grad():
        assert torch.equal(model(batch), model(batch))


@pytest.mark.parametrize("field", ["model.dropout=1.0", "model.dropout=-0.1", 'model.mlp_norm="group"',
                                   "optim.sparse_weight_decay=-1.0", "optim.dense_weight_decay=inf",
                                   "model.embedding_init_bound=-0.1", "model.embedding_init_bound=inf"])
def test_out_of_range_options_name_their_field(field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field.split("=")[0])):
        load_config(None, [field])


# -- L2 on the touched embedding rows ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_sparse_weight_decay_moves_only_touched_rows_once_each(kind: str) -> None:
    lr, wd, eps = 0.1, 0.5, 1e-8
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 3, generator=g)
    acc = torch.full((10,), 0.1) if kind == "rowwise_adagrad" else None
    before, acc0 = weight.clone(), acc.clone() if acc is not None else None
    rows = torch.tensor([2, 7, 2, 2, 5])  # row 2 three times in the batch
    grads = torch.randn(5, 3, generator=g)
    state = {"accumulator": acc} if acc is not None else {}
    SparseOptimizer(SparseOptimizerConfig(kind, lr, eps, 0.1, weight_decay=wd)).step(weight, state, rows, grads)
    for r in range(10):
        g_r = grads[rows == r].sum(0)
        if r not in (2, 5, 7):
            assert torch.equal(weight[r], before[r])  # untouched: neither decayed nor moved
            continue
        g_r = g_r + wd * before[r]  # decayed once, however often the row occurs
        if kind == "sgd":
            want = before[r] - lr * g_r
        else:
            a = acc0[r] + g_r.pow(2).mean()
            torch.testing.assert_close(acc[r], a)
            want = before[r] - lr * g_r / (a.sqrt() + eps)
        torch.testing.assert_close(weight[r], want)


def test_sparse_weight_decay_with_zero_gradients_shrinks_touched_rows() -> None:
    weight = torch.ones(4, 2)
    rows = torch.tensor([1, 1, 3])
    SparseOptimizer(SparseOptimizerConfig("sgd", 0.1, weight_decay=0.5)).step(weight, {}, rows, torch.zeros(3, 2))
    assert torch.equal(weight, torch.tensor([[1.0, 1.0], [0.95, 0.95], [1.0, 1.0], [0.95, 0.95]]))


def test_sparse_weight_decay_is_read_from_the_optim_section() -> None:
    optim = load_config(None, ["optim.sparse_weight_decay=0.25"]).optim
    assert sparse_optimizer_config(optim).weight_decay == 0.25
    assert sparse_optimizer_config(load_config(None, []).optim).weight_decay == 0.0


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_sparse_weight_decay_is_bit_identical_with_tiered_tables(kind: str, tmp_path: Path) -> None:
    """The tiered collection updates its compute buffer with the same SparseOptimizer step: a row lives in one
    buffer slot, so it decays once per step there too, whichever tier it came from."""
    from recstack.embedding.tiered.collection import TablePlacement, TieredEmbeddingCollection

    tables = [TableConfig("a", 50, 8, (0,)), TableConfig("b", 300, 8, (1, 2))]
    opt = SparseOptimizerConfig(kind, 0.1, 1e-8, 0.01, weight_decay=0.3)
    ref = FusedEmbeddingBagCollection(tables, opt, seed=3)
    cached = TablePlacement("host-cached", 40, "lru")
    tc = TieredEmbeddingCollection(tables, opt, [TablePlacement("device"), cached], seed=3,
                                   ssd_dir=tmp_path / "ssd", prefetch=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        lengths = torch.randint(0, 4, (3, 16), generator=g)
        ids = torch.cat([(torch.rand(int(lengths[f].sum()), generator=g) ** 3 * n).long()
                         for f, n in enumerate([50, 300, 300])])
        sparse = SparseFeatures(ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.reshape(-1).cumsum(0)]), 3)
        coef = torch.randn(16, 3, 8, generator=g)
        out_ref, out = ref(sparse), tc(sparse)
        assert torch.equal(out_ref, out)
        (out_ref * coef).sum().backward()
        (out * coef).sum().backward()
    for t in tables:
        assert torch.equal(tc.table_state(t.name)[0], ref.table_weight(t.name)), t.name
    tc.close()


def _sharded_cases(rank: int, world: int) -> dict:
    """A sharded collection (every sharding) and one process on the same global batches with the same upstream
    gradient, weight decay on; ids repeat within a rank's samples and across ranks."""
    from recstack.distributed.sharded_collection import ShardedEmbeddingCollection

    tables = [TableConfig("a", 9, DIM, (0,)), TableConfig("b", 7, DIM, (1, 2)), TableConfig("c", 6, DIM, (3,)),
              TableConfig("d", 5, DIM, (4,))]
    rows = [9, 7, 7, 6, 5]
    layouts = {
        "sgd": ("sgd", [("row_wise", [0, 1]), ("table_wise", [1]), ("column_wise", [1, 0]),
                        ("data_parallel", [0, 1])]),
        "adagrad": ("rowwise_adagrad", [("row_wise", [0, 1]), ("table_wise", [1]), ("table_wise", [0]),
                                        ("data_parallel", [0, 1])]),
    }
    results = {}
    for name, (kind, placements) in layouts.items():
        cfg = SparseOptimizerConfig(kind, lr=0.1, weight_decay=0.5)
        ref = FusedEmbeddingBagCollection(tables, cfg, seed=3)
        sharded = ShardedEmbeddingCollection(tables, cfg, placements, 3, "cpu")
        gen = torch.Generator().manual_seed(11)
        b = 8  # per rank
        for _ in range(4):
            lens = torch.randint(1, 3, (len(rows), b * world), generator=gen)
            ids = torch.cat([torch.randint(0, n, (int(lens[f].sum()),), generator=gen) for f, n in enumerate(rows)])
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.reshape(-1).cumsum(0)])
            coef = torch.randn(b * world, len(rows), DIM, generator=gen)
            (ref(SparseFeatures(ids, offsets, len(rows))) * coef).sum().div(world).backward()  # DDP's mean
            # this rank's samples [rank * b, (rank + 1) * b) of every feature
            mine_lens = lens[:, rank * b : (rank + 1) * b]
            first = [f * b * world + rank * b for f in range(len(rows))]  # bag of this rank's first sample
            mine_ids = torch.cat([ids[int(offsets[i]) : int(offsets[i + b])] for i in first])
            local = SparseFeatures(mine_ids, torch.cat([torch.zeros(1, dtype=torch.int64),
                                                        mine_lens.reshape(-1).cumsum(0)]), len(rows))
            (sharded(local) * coef[rank * b : (rank + 1) * b]).sum().backward()
        results[name] = [(sharded.table_weight(t.name), ref.table_weight(t.name).clone()) for t in tables]
    return results


def _sharded_worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = _sharded_cases(rank, world)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def test_sparse_weight_decay_sharded_matches_one_process(tmp_path: Path) -> None:
    """Row-, table-, column-wise and replicated tables on 2 gloo ranks apply the decay of one process: each
    owner updates its rows once per step with every rank's ids."""
    out = tmp_path / "res.pt"
    mp.spawn(_sharded_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    results = torch.load(out, weights_only=False)
    for name, tables in results.items():
        for i, (got, want) in enumerate(tables):
            torch.testing.assert_close(got, want, msg=f"{name}: table {i} differs")


# -- dense weight decay --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dense", ["sgd", "adagrad", "adam"])
def test_dense_weight_decay_reaches_the_optimizer(dense: str) -> None:
    optim = load_config(None, [f'optim.dense="{dense}"', "optim.dense_weight_decay=0.01"]).optim
    p = nn.Parameter(torch.ones(3))
    opt = build_dense_optimizer(optim, [p])
    assert opt.param_groups[0]["weight_decay"] == 0.01
    p.grad = torch.zeros(3)
    opt.step()
    assert bool((p < 1).all())  # a zero gradient still shrinks the weights
    assert build_dense_optimizer(load_config(None, []).optim, [p]).param_groups[0]["weight_decay"] == 0.0


# -- data without dense features ----------------------------------------------------------------------------
def test_embedding_dim_without_dense_features_needs_no_bottom_mlp() -> None:
    cfg = load_config(None, ["model.embedding_dim=8"])  # the default bottom MLP ends in 16: not checked here
    torch.manual_seed(0)
    net = build_model(cfg.model, sparse_optimizer_config(cfg.optim), 0, SIZES, seed=0)
    assert net.bottom is None
    batch = _batch(num_dense=0)
    assert net(Batch(batch.dense[:, :0], batch.sparse, batch.labels)).shape == (32,)
    with pytest.raises(ConfigError, match="model.bottom_mlp: the dot interaction needs it to end in embedding_dim=8"):
        build_model(cfg.model, sparse_optimizer_config(cfg.optim), 3, SIZES, seed=0)  # with dense features it is


def test_batch_norm_is_refused_under_torchrun() -> None:
    """Every rank would keep running statistics of its own samples: wrap_ddp stops before any collective."""
    from recstack.distributed.parallelize import wrap_ddp

    with pytest.raises(ConfigError, match="model.mlp_norm"):
        wrap_ddp(_model(mlp_norm="batch"), torch.device("cpu"))


REGULARISED = ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", 'model.mlp_norm="layer"',
               'optim.sparse="rowwise_adagrad"', "optim.sparse_lr=0.05", "optim.dense_lr=0.05",
               "optim.sparse_weight_decay=0.01", "optim.dense_weight_decay=0.01"]


def _train_regularised(data: Path, rank: int, world: int, placements: list | None) -> tuple[list[float], list]:
    """20 steps of a global batch of 64 with layer norm and both weight decays -> (losses, full tables)."""
    from recstack.data.loader import BatchLoader
    from recstack.data.prepared_dataset import PreparedDataset
    from recstack.distributed.parallelize import shard_model, wrap_ddp

    cfg = load_config(None, REGULARISED)
    ds = PreparedDataset(data)
    torch.manual_seed(0)
    model = build_model(cfg.model, sparse_optimizer_config(cfg.optim), 13, ds.table_sizes, seed=0,
                        names=[s.name for s in ds.sparse_features], tables_on_meta=placements is not None)
    net: nn.Module = model
    if placements is not None:
        model = shard_model(model, placements, 0, torch.device("cpu"))
        net = wrap_ddp(model, torch.device("cpu"))
    opt = build_dense_optimizer(cfg.optim, model.dense_parameters())
    it = BatchLoader(ds, 64 // world, (0, len(ds)), rank=rank, world_size=world, prefetch=0).iterate_epoch()
    losses = []
    for _ in range(20):
        loss = train_step(net, opt, next(it)).clone()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(float(loss))
    return losses, [model.embeddings.table_weight(t.name) for t in model.embeddings.tables]


def _model_worker(rank: int, world: int, init_file: str, data: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {name: _train_regularised(Path(data), rank, world, [(name, [0, 1] if name == "row_wise" else [t % 2])
                                                                      for t in range(4)])
                   for name in ("row_wise", "table_wise")}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def test_regularised_model_under_two_ranks_matches_one_process(tiny_dataset: Path, tmp_path: Path) -> None:
    """Layer norm, dense and sparse weight decay: 2 gloo ranks (row- and table-wise tables, DDP) train as one
    process on the same global batches."""
    torch.set_num_threads(1)
    ref_losses, ref_tables = _train_regularised(tiny_dataset, 0, 1, None)
    out = tmp_path / "model.pt"
    mp.spawn(_model_worker, args=(2, str(tmp_path / "init"), str(tiny_dataset), str(out)), nprocs=2, join=True)
    for name, (losses, tables) in torch.load(out, weights_only=False).items():
        assert losses == pytest.approx(ref_losses, abs=1e-5), name
        for t, r in zip(tables, ref_tables, strict=True):
            torch.testing.assert_close(t, r, atol=1e-5, rtol=1e-4, msg=f"{name}: tables differ")
    assert ref_losses[-1] < ref_losses[0]


def test_libfm_data_trains_with_only_embedding_dim_changed(tmp_path: Path) -> None:
    """The reported case: a Frappe-layout libFM set (categorical fields only) prepared with the repo's schema,
    then `--set model.embedding_dim=8` and nothing about the bottom MLP."""
    from conftest import REPO

    from recstack.cli.main import main
    from recstack.data.examples import frappe_like, write_libfm

    labels, idx, _ = frappe_like(2000, seed=1)
    train = write_libfm(tmp_path / "train.libfm", labels, idx)
    assert main(["data", "prepare", "--schema", str(REPO / "configs" / "schemas" / "frappe_libfm.toml"), str(train),
                 "--out", str(tmp_path / "data"), "--no-progress"]) == 0
    summary = train_steps(tmp_path / "data", None, ["model.embedding_dim=8", "train.max_steps=5"],
                          base=["train.threads=1", "train.progress=false"])
    assert summary["steps"] == 5
