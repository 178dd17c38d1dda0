"""The hand-written training steps of MLP and DotInteraction against plain autograd on the same math."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recstack.models.fused_mlp import MLP, _weight_grad_transposed, mlp_layers
from recstack.models.interaction import DotInteraction


def _plain_mlp(sizes: list[int], last_activation: bool) -> nn.Sequential:
    """nn.Sequential with the same layers and init order as MLP, run by autograd."""
    return nn.Sequential(*mlp_layers(sizes, last_activation))


def _pair(sizes: list[int], last: bool, seed: int = 0) -> tuple[MLP, nn.Sequential]:
    torch.manual_seed(seed)
    fused = MLP(sizes, last)
    torch.manual_seed(seed)
    return fused, _plain_mlp(sizes, last)


# 13 and 37 are not multiples of 16: with batch 160 their weight gradients take the transposed product.
@pytest.mark.parametrize(
    "sizes,last", [([13, 40, 24, 16], True), ([37, 32, 1], False), ([16, 32, 8], True), ([32, 5], False)]
)
@pytest.mark.parametrize("input_grad", [False, True])
@pytest.mark.parametrize("batch", [20, 160])
def test_mlp_matches_autograd(sizes: list[int], last: bool, input_grad: bool, batch: int) -> None:
    fused, plain = _pair(sizes, last)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, sizes[0], generator=gen)
    x1, x2 = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
    g = torch.randn(batch, sizes[-1], generator=gen)
    y1, y2 = fused(x1), plain(x2)
    torch.testing.assert_close(y1, y2)
    if last:
        assert (y1 == 0).any(), "the test should exercise clipped ReLU units"
    y1.backward(g)
    y2.backward(g)
    if input_grad:
        torch.testing.assert_close(x1.grad, x2.grad)
    for (name, p1), p2 in zip(fused.named_parameters(), plain.parameters(), strict=True):
        assert p1.grad is not None, name
        assert p1.grad.shape == p1.shape and p1.grad.is_contiguous(), name
        torch.testing.assert_close(p1.grad, p2.grad, msg=name)


def test_transposed_weight_gradient_rule() -> None:
    cpu = torch.device("cpu")
    assert _weight_grad_transposed(128, 13, cpu)  # narrow odd input: always
    assert not _weight_grad_transposed(128, 367, cpu)  # wide odd input, small batch: the copy costs more
    assert _weight_grad_transposed(2048, 367, cpu)
    assert not _weight_grad_transposed(2048, 512, cpu)  # aligned: MKL is fast either way
    assert not _weight_grad_transposed(2048, 13, torch.device("meta"))  # CPU only


def test_mlp_is_a_sequential_with_the_same_state() -> None:
    fused, plain = _pair([13, 8, 4], True)
    assert isinstance(fused, nn.Sequential)
    assert list(fused.state_dict()) == list(plain.state_dict())
    for k, v in plain.state_dict().items():
        assert torch.equal(fused.state_dict()[k], v), k
    x = torch.randn(5, 13)
    train_out = fused(x.requires_grad_())
    with torch.no_grad():
        torch.testing.assert_close(fused(x), train_out.detach())


def test_mlp_modified_after_build_falls_back_to_autograd() -> None:
    fused, plain = _pair([6, 8, 3], False)
    fused.append(nn.Tanh())
    plain.append(nn.Tanh())
    x = torch.randn(7, 6)
    y1, y2 = fused(x), plain(x)
    torch.testing.assert_close(y1, y2)
    # Tanh <- Linear: the layers ran under autograd, not as one fused node
    assert type(y1.grad_fn.next_functions[0][0]).__name__ == "AddmmBackward0"
    y1.sum().backward()
    y2.sum().backward()
    for p1, p2 in zip(fused.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p2.grad)


def _reference_dot(dense: torch.Tensor | None, emb: torch.Tensor, itself: bool) -> torch.Tensor:
    """The DLRM reference formulation: bmm of all vectors, lower triangle read by advanced indexing."""
    t = torch.cat([dense.unsqueeze(1), emb], dim=1) if dense is not None else emb
    n = t.shape[1]
    li, lj = torch.tril_indices(n, n, offset=0 if itself else -1)
    pairs = torch.bmm(t, t.transpose(1, 2))[:, li, lj]
    return torch.cat([dense, pairs], dim=1) if dense is not None else pairs


@pytest.mark.parametrize("has_dense", [True, False])
@pytest.mark.parametrize("itself", [False, True])
def test_dot_interaction_matches_reference(has_dense: bool, itself: bool) -> None:
    b, f, d = 6, 5, 4
    gen = torch.Generator().manual_seed(2)
    dense = torch.randn(b, d, generator=gen, dtype=torch.float64)
    emb_fm = torch.randn(f, b, d, generator=gen, dtype=torch.float64)  # feature-major, as collections return
    inter = DotInteraction(f, d, has_dense, itself)
    leaves = [dense.clone().requires_grad_(), emb_fm.clone().requires_grad_()]
    ref_leaves = [dense.clone().requires_grad_(), emb_fm.clone().requires_grad_()]
    out = inter(leaves[0] if has_dense else None, leaves[1].transpose(0, 1))
    ref = _reference_dot(ref_leaves[0] if has_dense else None, ref_leaves[1].transpose(0, 1), itself)
    assert out.shape == (b, inter.out_dim)
    torch.testing.assert_close(out, ref)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(g)
    ref.backward(g)
    for x, r in zip(leaves, ref_leaves, strict=True):
        if r.grad is not None:
            torch.testing.assert_close(x.grad, r.grad)
    assert leaves[1].grad is not None


@pytest.mark.parametrize("itself", [False, True])
def test_dot_interaction_gradcheck(itself: bool) -> None:
    inter = DotInteraction(3, 2, True, itself)
    dense = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    emb = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(inter, (dense, emb))
