"""The dense optimizer asks for torch's fused kernels only where the installed torch has them for
the parameters' device (torch 2.11's fused Adagrad is CPU-only: ``optim.dense = "adagrad"`` on CUDA
raised at the first step)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from recstack.training.config import OptimConfig
from recstack.training.step import build_dense_optimizer, fused_kernel_runs


@pytest.fixture(autouse=True)
def _fresh_answers() -> Iterator[None]:
    fused_kernel_runs.cache_clear()
    yield
    fused_kernel_runs.cache_clear()


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_fused_on_the_cpu_where_torch_has_the_kernels(kind: str) -> None:
    assert fused_kernel_runs(kind, "cpu")
    # no fused kernel there: torch refuses at the first step
    assert not fused_kernel_runs(kind, "meta")
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_dense_optimizer(OptimConfig(dense=kind), [p])
    assert opt.param_groups[0]["fused"] is True


class _AdagradWithoutFusedKernel(torch.optim.Adagrad):
    """torch 2.11's Adagrad as it behaves on CUDA: constructed with fused=True, it raises at the
    first step."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        if any(g["fused"] for g in self.param_groups):
            raise RuntimeError(
                "`fused=True` requires all the params to be floating point Tensors of supported "
                "devices: ['cpu'] but torch.float32 and cpu"
            )
        return super().step(closure)


def test_without_the_fused_kernel_the_optimizer_falls_back_and_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.optim, "Adagrad", _AdagradWithoutFusedKernel)
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_dense_optimizer(OptimConfig(dense="adagrad", dense_lr=0.5), [p])
    assert opt.param_groups[0]["fused"] is None
    p.grad = torch.ones(3)
    opt.step()  # the unfused update: 1 - 0.5 * g / (sqrt(g^2) + eps)
    assert torch.allclose(p.detach(), torch.full((3,), 0.5), atol=1e-6)
