"""Row aggregation and the in-backward sparse updates, against per-id reference loops."""

from __future__ import annotations

import pytest
import torch

from recstack.data.batch import SparseFeatures
from recstack.embedding import FusedEmbeddingBagCollection, TableConfig
from recstack.embedding.sparse_optim import SparseOptimizer, SparseOptimizerConfig, aggregate_rows


def _sequential_sums(rows: torch.Tensor, grads: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per distinct row, its gradients added one by one in input order."""
    out: dict[int, torch.Tensor] = {}
    for r, g in zip(rows.tolist(), grads, strict=True):
        out[r] = out[r] + g if r in out else g.clone()
    return out


@pytest.mark.parametrize("offset", [0, 2**33])  # ids beyond int32 take the 64-bit sort
def test_aggregate_rows_sums_in_input_order(offset: int) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 40, (300,), generator=gen) * 7 + offset
    grads = torch.randn(300, 5, generator=gen)
    uniq, summed = aggregate_rows(rows, grads)
    ref = _sequential_sums(rows, grads)
    assert uniq.dtype == torch.int64
    assert uniq.tolist() == sorted(ref)
    for u, s in zip(uniq.tolist(), summed, strict=True):
        assert torch.equal(s, ref[u]), u  # same adds in the same order: bitwise equal


def test_aggregate_rows_empty_and_distinct() -> None:
    uniq, summed = aggregate_rows(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3))
    assert uniq.shape == (0,) and summed.shape == (0, 3)
    rows = torch.tensor([5, 1, 3])
    grads = torch.arange(9.0).view(3, 3)
    uniq, summed = aggregate_rows(rows, grads)
    assert uniq.tolist() == [1, 3, 5]
    assert torch.equal(summed, grads[[1, 2, 0]])


def test_sgd_step_with_repeated_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(50, 4, generator=gen)
    w0 = weight.clone()
    rows = torch.tensor([3, 7, 3, 3, 49, 7, 0])
    grads = torch.randn(7, 4, generator=gen)
    SparseOptimizer(SparseOptimizerConfig("sgd", lr=0.5)).step(weight, {}, rows, grads)
    expected = w0.clone()
    for r, g in _sequential_sums(rows, grads).items():
        expected[r] -= 0.5 * g
    torch.testing.assert_close(weight, expected)
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(weight[untouched], w0[untouched])


def test_rowwise_adagrad_uses_the_summed_gradient() -> None:
    weight = torch.zeros(4, 2)
    acc = torch.zeros(4)
    rows = torch.tensor([2, 2])
    grads = torch.tensor([[1.0, 3.0], [1.0, 1.0]])  # summed: [2, 4], mean square 10
    opt = SparseOptimizer(SparseOptimizerConfig("rowwise_adagrad", lr=1.0, eps=0.0))
    opt.step(weight, {"accumulator": acc}, rows, grads)
    torch.testing.assert_close(acc, torch.tensor([0.0, 0.0, 10.0, 0.0]))
    torch.testing.assert_close(weight[2], -torch.tensor([2.0, 4.0]) / 10.0**0.5)
    assert torch.equal(weight[[0, 1, 3]], torch.zeros(3, 2))


def test_jagged_bags_with_as_many_ids_as_bags() -> None:
    """Bags [2 ids, empty, 1, 1]: 4 ids in 4 bags, but id 1 belongs to bag 0, not bag 1."""
    ec = FusedEmbeddingBagCollection([TableConfig("t", 6, 3, (0,))], SparseOptimizerConfig("sgd", lr=1.0))
    w0 = ec.weight.clone()
    sparse = SparseFeatures(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2, 2, 3, 4]), 1)
    grad = torch.arange(12.0).view(4, 1, 3)  # bag b's output gradient
    (ec(sparse) * grad).sum().backward()
    expected = w0.clone()
    for row, bag in [(1, 0), (2, 0), (3, 2), (4, 3)]:
        expected[row] -= grad[bag, 0]
    torch.testing.assert_close(ec.weight, expected)
