"""The throughput benchmark compares like with like: the per-table baseline computes the same model and the
same SGD step as recstack, and the benchmark's inputs are what it says they are."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.baseline_dlrm import BaselineDLRM, make_optimizer, train_step
from bench.train_throughput import DenseFloor, kaggle_config, make_data, make_trainer, zipf_ids
from recstack.training.trainer import Trainer

SIZES = [11, 3, 40, 7]


def _models(tmp: Path) -> tuple[Trainer, BaselineDLRM, torch.optim.Optimizer]:
    cfg = kaggle_config()
    cfg.model.embedding_dim = 4
    cfg.model.bottom_mlp = [8, 4]
    cfg.model.top_mlp = [6, 1]
    cfg.optim.dense_lr = cfg.optim.sparse_lr = 0.3
    cfg.train.batch_size = 16
    trainer = make_trainer(cfg, SIZES, tmp / "data")
    model = trainer.model
    base = BaselineDLRM(13, SIZES, 4, cfg.model.bottom_mlp, cfg.model.top_mlp)
    with torch.no_grad():  # same weights, so the two must agree step for step
        for t, bag in enumerate(base.emb_l):
            bag.weight.copy_(model.embeddings.table_weight(f"C{t + 1}"))
        base.bot_l.load_state_dict(model.bottom.state_dict())
        base.top_l.load_state_dict(model.top.state_dict())
    return trainer, base, make_optimizer(base, 0.3)


def test_baseline_trains_the_same_model_as_recstack(tmp_path: Path) -> None:
    trainer, base, base_opt = _models(tmp_path)
    model = trainer.model
    data = make_data(SIZES, batch=16, num_batches=3, seed=4)
    for d in data:  # repeated ids inside a batch: the small tables guarantee them
        with torch.no_grad():
            torch.testing.assert_close(base(d["dense"], d["ids"], d["offsets"]), model(d["batch"]))
        loss_r = trainer.train_step(d["batch"])
        loss_b = train_step(base, base_opt, d["dense"], d["ids"], d["offsets"], d["labels"])
        assert abs(loss_r - loss_b) < 1e-6
    for t, bag in enumerate(base.emb_l):
        torch.testing.assert_close(bag.weight, model.embeddings.table_weight(f"C{t + 1}"), rtol=1e-5, atol=1e-6)
    for p_b, p_r in zip(base.top_l.parameters(), model.top.parameters(), strict=True):
        torch.testing.assert_close(p_b, p_r, rtol=1e-5, atol=1e-6)


def test_floor_uses_copies_of_the_recstack_dense_layers(tmp_path: Path) -> None:
    model = _models(tmp_path)[0].model
    floor = DenseFloor(model, batch=8, num_features=len(SIZES), dim=4, seed=0)
    assert floor.top is not model.top
    assert floor.top.state_dict().keys() == model.top.state_dict().keys()
    d = make_data(SIZES, batch=8, num_batches=1, seed=0)[0]
    before = [p.clone() for p in floor.top.parameters()]
    floor.step(0, d["dense"], d["labels"])
    assert any(not torch.equal(a, b) for a, b in zip(before, floor.top.parameters(), strict=True))
    assert all(e.grad is None for e in floor.emb)


def test_zipf_ids_are_in_range_and_skewed() -> None:
    sizes = [1_000_000, 3, 500]
    ids = zipf_ids(sizes, 20_000, torch.Generator().manual_seed(0))
    assert ids.shape == (20_000, 3)
    for f, n in enumerate(sizes):
        assert int(ids[:, f].min()) >= 0 and int(ids[:, f].max()) < n
    counts = torch.bincount(ids[:, 0])
    assert counts.max() > 500  # the hottest of 1M rows: ~5% of draws, uniform would give ~0.02
    assert ids[:, 0].unique().numel() > 2_000  # but a long tail
