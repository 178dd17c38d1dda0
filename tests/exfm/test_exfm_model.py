"""ExFM vertical model: gradient isolation (beta, Student Adapter), label scaling, serving export size and
FLOPs, NE of a constant base-rate predictor."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from recstack.data.batch import Batch, SparseFeatures
from recstack.embedding.sparse_optim import SparseOptimizerConfig
from recstack.exfm.config import DistillConfig
from recstack.exfm.stream import StreamTrainer
from recstack.exfm.vm import FM_LOGIT, StudentAdapter, VerticalModel, forward_flops, parameter_count
from recstack.exfm.windows import Window
from recstack.metrics import BinaryMetrics
from recstack.models.build import build_model
from recstack.models.config import ModelConfig

SIZES = [40, 25, 60]


def _body(seed: int = 0):
    torch.manual_seed(seed)
    model = ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1])
    return build_model(model, SparseOptimizerConfig(), 3, SIZES, seed=seed)


def _batch(n: int = 32, seed: int = 1) -> Batch:
    g = np.random.default_rng(seed)
    ids = np.stack([g.integers(0, s, n) for s in SIZES], 1)
    return Batch(torch.from_numpy(g.random((n, 3)).astype(np.float32)), SparseFeatures.from_dense_ids(ids),
                 torch.from_numpy((g.random(n) < 0.4).astype(np.float32)),
                 {FM_LOGIT: torch.from_numpy(g.normal(size=n).astype(np.float32))})


def _vm(arm: str, **distill) -> VerticalModel:
    vm = VerticalModel(_body(), arm, DistillConfig(**distill))
    return vm.eval()  # eval: the fused tables do not update themselves inside backward, so grads can be compared


def _grads(vm: VerticalModel, batch: Batch, terms: tuple[str, ...], params) -> list[torch.Tensor]:
    loss = sum(v for k, v in vm.losses(batch).items() if k in terms)
    got = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(got, params, strict=True)]


def test_beta_scales_only_the_distillation_gradient_into_the_body() -> None:
    batch = _batch()
    results = {}
    for beta in (1.0, 0.25, 0.0):
        vm = _vm("aux", beta=beta, weight=2.0)
        body = [p for n, p in vm.named_parameters() if n.startswith("body.") and not n.startswith("body.top.")]
        head = list(vm.distill_head.parameters())
        serving_head = list(vm.body.top.parameters())
        out = vm.outputs(batch)
        serving_loss = F.binary_cross_entropy_with_logits(out["serving"], batch.labels)
        g_serv = torch.autograd.grad(serving_loss, out["features"])[0]
        g_dist = torch.autograd.grad(vm.losses(batch)["distill"], body + head + serving_head, allow_unused=True)
        results[beta] = {
            "serving_into_features": g_serv,
            "distill_into_body": g_dist[: len(body)],
            "distill_head": g_dist[len(body) : len(body) + len(head)],
            "distill_into_serving_head": g_dist[len(body) + len(head) :],
            "total_body": _grads(vm, batch, ("serving", "distill"), body),
            "serving_body": _grads(vm, batch, ("serving",), body),
        }
    full, quarter, zero = results[1.0], results[0.25], results[0.0]
    for b, q, z in zip(full["distill_into_body"], quarter["distill_into_body"], zero["distill_into_body"], strict=True):
        assert b.abs().sum() > 0
        torch.testing.assert_close(q, 0.25 * b, rtol=1e-5, atol=1e-7)
        assert z.abs().sum() == 0
    # the distillation head itself learns at full strength whatever beta is
    for a, c in zip(full["distill_head"], zero["distill_head"], strict=True):
        torch.testing.assert_close(a, c)
        assert a.abs().sum() > 0
    # the distillation loss never reaches the serving head; the serving gradient does not depend on beta
    assert all(g is None for g in full["distill_into_serving_head"])
    torch.testing.assert_close(full["serving_into_features"], zero["serving_into_features"])
    for t, s, tq in zip(full["total_body"], full["serving_body"], quarter["total_body"], strict=True):
        torch.testing.assert_close(tq, s + 0.25 * (t - s), rtol=1e-4, atol=1e-6)


def test_no_vm_loss_reaches_the_student_adapter() -> None:
    vm, batch = _vm("aux_sa", sa_weight=1.5), _batch()
    adapter = list(vm.adapter.parameters())
    others = [p for n, p in vm.named_parameters() if not n.startswith("adapter.")]
    for g in _grads(vm, batch, ("serving", "distill", "adapter_target"), adapter):
        assert g.abs().sum() == 0
    # the adapter's own loss trains the adapter only, and it does train it
    assert sum(float(g.abs().sum()) for g in _grads(vm, batch, ("adapter",), adapter)) > 0
    for g in _grads(vm, batch, ("adapter",), others):
        assert g.abs().sum() == 0
    # while the adapter's target does reach the VM's distillation head
    head = list(vm.distill_head.parameters())
    assert sum(float(g.abs().sum()) for g in _grads(vm, batch, ("adapter_target",), head)) > 0


def test_adapter_starts_as_identity_and_alpha_clips_the_target() -> None:
    f = torch.linspace(-4, 4, 9)
    torch.testing.assert_close(StudentAdapter([16])(f), f)
    batch = _batch()
    vm = _vm("distill", alpha=3.0, weight=1.0)
    p = torch.sigmoid(batch.extras[FM_LOGIT])
    want = F.binary_cross_entropy_with_logits(vm(batch), torch.clamp(3.0 * p, max=1.0))
    torch.testing.assert_close(vm.losses(batch)["distill"], want)
    assert bool((3.0 * p > 1.0).any())  # the clip is exercised


def test_single_head_adapter_arm_replaces_the_fm_label_with_the_adapter_output() -> None:
    vm, batch = _vm("distill_sa", weight=2.0), _batch()
    terms = vm.losses(batch)
    assert float(terms["distill"].detach()) == 0.0 and vm.distill_head is None
    # the adapter's output is the serving head's second target, at the single-head arm's weight
    with torch.no_grad():
        target = torch.sigmoid(vm.adapter(batch.extras[FM_LOGIT]))
    torch.testing.assert_close(terms["adapter_target"], 2.0 * F.binary_cross_entropy_with_logits(vm(batch), target))
    # no VM loss reaches the adapter; the adapter's own loss reaches only the adapter
    adapter = list(vm.adapter.parameters())
    others = [p for n, p in vm.named_parameters() if not n.startswith("adapter.")]
    for g in _grads(vm, batch, ("serving", "distill", "adapter_target"), adapter):
        assert g.abs().sum() == 0
    for g in _grads(vm, batch, ("adapter",), others):
        assert g.abs().sum() == 0
    serving_head = list(vm.body.top.parameters())
    assert sum(float(g.abs().sum()) for g in _grads(vm, batch, ("adapter_target",), serving_head)) > 0


def test_sa_fm_weight_sets_the_raw_fm_target_of_the_adapter_arm_only() -> None:
    batch = _batch()
    aux = _vm("aux", weight=2.0, sa_fm_weight=0.5).losses(batch)["distill"]
    with_sa = _vm("aux_sa", weight=2.0, sa_fm_weight=0.5).losses(batch)["distill"]
    default = _vm("aux_sa", weight=2.0).losses(batch)["distill"]
    # same body seed and head: only the weight differs
    torch.testing.assert_close(aux, default)
    torch.testing.assert_close(with_sa, 0.25 * default)
    assert float(_vm("aux_sa", weight=2.0, sa_fm_weight=0.0).losses(batch)["distill"].detach()) == 0.0


def test_distillation_arms_need_fm_labels() -> None:
    batch = _batch()
    del batch.extras[FM_LOGIT]
    with pytest.raises(ValueError, match="fm_logit"):
        _vm("aux").loss(batch)
    assert set(_vm("alone").losses(batch)) == {"serving"}


@pytest.mark.parametrize("arm", ["distill", "distill_sa", "aux", "aux_sa"])
def test_served_model_is_the_size_of_the_vm_alone(arm: str) -> None:
    alone, vm, batch = _vm("alone"), _vm(arm), _batch()
    served = vm.serving_model()
    assert parameter_count(served) == parameter_count(alone.serving_model())
    assert forward_flops(served, batch) == forward_flops(alone.serving_model(), batch) > 0
    assert served.state_dict().keys() == alone.body.state_dict().keys()
    torch.testing.assert_close(served(batch), vm(batch))
    if arm != "distill":
        assert parameter_count(vm) > parameter_count(served)  # the extra heads exist, they are just not served


def _constant_trainer(logit: float, labels: np.ndarray) -> StreamTrainer:
    const = torch.nn.Parameter(torch.tensor(logit))

    class Constant(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = const

        def forward(self, b: Batch) -> torch.Tensor:
            return self.c.expand(b.batch_size)

    model = Constant()
    n = len(labels)
    batch = Batch(torch.zeros(n, 0), SparseFeatures.from_dense_ids(np.zeros((n, 1), np.int64)),
                  torch.from_numpy(labels))

    def evaluate(w: Window) -> dict[str, BinaryMetrics]:
        m = BinaryMetrics()
        m.update(model(batch), batch.labels)
        return {"serving": m}

    return StreamTrainer(model, lambda b: model(b).sum() * 0, torch.optim.SGD(model.parameters(), lr=0.0),
                         [Window(0, 0, n)], lambda w: [], evaluate)


def test_ne_of_a_constant_base_rate_predictor_is_one() -> None:
    labels = (np.random.default_rng(3).random(5000) < 0.27).astype(np.float32)
    p = float(labels.mean())
    rec = _constant_trainer(math.log(p / (1 - p)), labels).run()[0]
    assert rec["serving"]["ne"] == pytest.approx(1.0, abs=1e-9)
    assert rec["serving"]["calibration"] == pytest.approx(1.0, abs=1e-6)
    off = _constant_trainer(math.log(p / (1 - p)) + 0.3, labels).run()[0]
    assert off["serving"]["ne"] > 1.0 + 1e-3
