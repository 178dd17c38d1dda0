"""Lazy Adam on the embedding rows and the all-rows (FuxiCTR) weight decay, against torch's dense optimizers
and a few lines of reference arithmetic on the same sequence of batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recstack.config import load_config, validate
from recstack.data.batch import SparseFeatures
from recstack.embedding import FusedEmbeddingBagCollection, TableConfig
from recstack.embedding.sparse_optim import SparseOptimizer, SparseOptimizerConfig
from recstack.errors import ConfigError

ROWS, DIM, LR, BETAS, EPS = 30, 4, 0.05, (0.8, 0.95), 1e-8


def _batches(steps: int, ids_per_step: int, rows: int = ROWS - 5, seed: int = 0):
    """Ids of the first ``rows`` rows only: the last 5 are never touched."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randint(0, rows, (ids_per_step,), generator=gen), torch.randn(ids_per_step, DIM, generator=gen)


def _lazy_adam_reference(w0: np.ndarray, batches, wd: float) -> np.ndarray:
    """Per distinct row of a step: its summed gradient (+ wd * w), m and v per element, k = the steps that
    touched it, w -= lr * m_hat / (sqrt(v_hat) + eps). Untouched rows keep their weight and state."""
    w = w0.astype(np.float64).copy()
    m, v, k = np.zeros_like(w), np.zeros_like(w), np.zeros(len(w))
    b1, b2 = BETAS
    for rows, grads in batches:
        g = np.zeros_like(w)
        np.add.at(g, rows.numpy(), grads.numpy().astype(np.float64))
        for r in np.unique(rows.numpy()):
            gr = g[r] + wd * w[r]
            k[r] += 1
            m[r] = b1 * m[r] + (1 - b1) * gr
            v[r] = b2 * v[r] + (1 - b2) * gr**2
            w[r] -= LR * (m[r] / (1 - b1 ** k[r])) / (np.sqrt(v[r] / (1 - b2 ** k[r])) + EPS)
    return w


def _run(opt: SparseOptimizer, w0: torch.Tensor, batches) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    weight = w0.clone()
    state = opt.new_state(weight.shape[0], weight.shape[1], "cpu")
    for rows, grads in batches:
        opt.step(weight, state, rows, grads)
    return weight, state


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lazy_adam_matches_the_reference_with_rare_and_repeated_rows(wd: float) -> None:
    w0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    opt = SparseOptimizer(SparseOptimizerConfig("adam", LR, EPS, weight_decay=wd, betas=BETAS))
    weight, state = _run(opt, w0, _batches(20, 12))  # 12 ids of 30 rows: repeats, and rows left out
    ref = _lazy_adam_reference(w0.numpy(), _batches(20, 12), wd)
    np.testing.assert_allclose(weight.numpy(), ref, rtol=1e-5, atol=1e-6)
    touched = torch.zeros(ROWS)
    for rows, _ in _batches(20, 12):
        touched[rows.unique()] += 1
    assert torch.equal(state["row_step"], touched)  # each row's own step count
    never = touched == 0
    assert never.any() and torch.equal(weight[never], w0[never])  # lazy: untouched rows do not move
    assert opt.state_width(DIM) == 2 * DIM + 1


def test_lazy_adam_on_rows_touched_every_step_is_torch_adam() -> None:
    """Every row in every batch: the per-row step count is the global one, and the update is dense Adam's."""
    w0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.cat([torch.randperm(ROWS, generator=gen), torch.randint(0, ROWS, (7,), generator=gen)]),
                torch.randn(ROWS + 7, DIM, generator=gen)) for _ in range(15)]
    weight, _ = _run(SparseOptimizer(SparseOptimizerConfig("adam", LR, EPS, betas=BETAS)), w0, batches)
    p = torch.nn.Parameter(w0.clone())
    dense = torch.optim.Adam([p], lr=LR, betas=BETAS, eps=EPS)
    for rows, grads in batches:
        p.grad = torch.zeros_like(p).index_add_(0, rows, grads)
        dense.step()
    torch.testing.assert_close(weight, p.detach())


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_all_rows_decay_is_the_l2_term_over_whole_tables(kind: str) -> None:
    """FuxiCTR's embedding_regularizer: loss + (wd / 2) * ||W||^2 over every row, every step, and a dense
    optimizer over the table (torch's, with the gradient of that loss; Adagrad row-wise by hand)."""
    wd = 0.3
    w0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(4))
    cfg = SparseOptimizerConfig(kind, LR, EPS, weight_decay=wd, betas=BETAS, weight_decay_mode="all_rows")
    weight, _ = _run(SparseOptimizer(cfg), w0, _batches(10, 6))  # 6 ids a step: most rows untouched
    p = torch.nn.Parameter(w0.clone())
    dense = (torch.optim.Adam([p], lr=LR, betas=BETAS, eps=EPS) if kind == "adam"
             else torch.optim.SGD([p], lr=LR))
    acc = torch.zeros(ROWS)
    for rows, grads in _batches(10, 6):
        loss = (p.index_select(0, rows) * grads).sum() + wd / 2 * p.pow(2).sum()  # the gradient is grads per id
        p.grad = None
        loss.backward()
        if kind == "rowwise_adagrad":
            with torch.no_grad():
                acc += p.grad.pow(2).mean(1)
                p -= LR * p.grad / (acc.sqrt() + EPS).unsqueeze(1)
        else:
            dense.step()
    torch.testing.assert_close(weight, p.detach())
    assert not torch.equal(weight, w0)


def test_touched_decay_leaves_untouched_rows_alone_and_all_rows_decays_them() -> None:
    w0 = torch.ones(5, 2)
    rows, grads = torch.tensor([1]), torch.zeros(1, 2)
    out = {}
    for mode in ("touched", "all_rows"):
        weight = w0.clone()
        SparseOptimizer(SparseOptimizerConfig("sgd", 0.5, weight_decay=0.2, weight_decay_mode=mode)).step(
            weight, {}, rows, grads)
        out[mode] = weight
    assert torch.equal(out["touched"][1], torch.full((2,), 0.9))  # 1 - 0.5 * 0.2
    assert torch.equal(out["touched"][[0, 2, 3, 4]], torch.ones(4, 2))
    assert torch.equal(out["all_rows"], torch.full((5, 2), 0.9))


def test_fused_collection_keeps_adam_state_with_its_rows() -> None:
    """State dict: the weight and Adam's parts (no accumulator); a reload continues bit for bit."""
    tables = [TableConfig("a", 7, DIM, (0,)), TableConfig("b", 5, DIM, (1,))]
    cfg = SparseOptimizerConfig("adam", LR, EPS, betas=BETAS)

    def step(ec: FusedEmbeddingBagCollection, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.cat([torch.randint(0, 7, (6,), generator=gen), torch.randint(0, 5, (6,), generator=gen)])
        sparse = SparseFeatures(ids, torch.arange(0, 13, 1), 2)  # 6 samples x 2 features, one id each
        (ec(sparse) * torch.randn(6, 2, DIM, generator=gen)).sum().backward()

    ec = FusedEmbeddingBagCollection(tables, cfg, seed=3)
    assert sorted(ec.state_dict()) == ["exp_avg", "exp_avg_sq", "row_step", "weight"]
    assert ec.exp_avg.shape == (12, DIM) and ec.row_step.shape == (12,)
    for s in range(3):
        step(ec, s)
    resumed = FusedEmbeddingBagCollection(tables, cfg, seed=99)
    resumed.load_state_dict(ec.state_dict())
    for s in range(3, 6):
        step(ec, s)
        step(resumed, s)
    assert torch.equal(ec.weight, resumed.weight) and torch.equal(ec.exp_avg_sq, resumed.exp_avg_sq)
    assert int(ec.row_step.max()) >= 2


@pytest.mark.parametrize("setting", ['optim.sparse="adam"', 'optim.sparse_weight_decay_mode="all_rows"'])
def test_memory_tiers_refuse_adam_and_all_rows_naming_the_keys(setting: str) -> None:
    with pytest.raises(ConfigError, match=r"optim\.sparse.*memory tiers.*memory\.device='1MB'"):
        load_config(None, [setting, 'memory.device="1MB"'])  # (checked as it is loaded)
    validate(load_config(None, [setting]), check_device=False)  # without budgets: fine


def test_sparse_betas_are_checked() -> None:
    for bad in ("[0.9]", "[0.9, 1.0]"):
        with pytest.raises(ConfigError, match="optim.sparse_betas"):
            load_config(None, [f"optim.sparse_betas={bad}"])
