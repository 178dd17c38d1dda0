"""DCNv2's structures (FuxiCTR's model_structure), the full-rank cross network, the DNNs' batch norm and
dropout, and the bottom MLP's own dropout, against the formulas; a short training run of each structure."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import train_steps
from torch import nn

from recstack.config import load_config
from recstack.errors import ConfigError
from recstack.models.fused_mlp import MLP
from recstack.models.interaction import DCNv2Interaction

F, D, DENSE = 3, 4, 2
N = DENSE + F * D  # 14: the cross network's width


def _inputs(b: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, DENSE, generator=g), torch.randn(b, F, D, generator=g)


def _cross(net: DCNv2Interaction, x0: torch.Tensor) -> torch.Tensor:
    """x_{l+1} = x0 * (W_l x_l + b_l) + x_l with W_l = U_l V_l (or U_l alone at full rank)."""
    x = x0
    for v, u in zip(net.v, net.u, strict=True):
        w = u.weight @ v.weight if isinstance(v, nn.Linear) else u.weight
        x = x0 * (x @ w.t() + u.bias) + x
    return x


def test_full_rank_cross_network_is_one_n_by_n_matrix_per_layer() -> None:
    net = DCNv2Interaction(F, D, DENSE, layers=2, low_rank=0)
    assert [tuple(u.weight.shape) for u in net.u] == [(N, N)] * 2
    assert all(float(u.bias.abs().sum()) == 0 for u in net.u)  # FuxiCTR's init: Xavier normal, bias 0
    assert 0.7 < float(torch.cat([u.weight.flatten() for u in net.u]).std()) * N**0.5 < 1.3  # std 1 / sqrt(n)
    assert sorted(net.state_dict()) == ["u.0.bias", "u.0.weight", "u.1.bias", "u.1.weight"]
    dense, emb = _inputs()
    x0 = torch.cat([dense, emb.flatten(1)], 1)
    torch.testing.assert_close(net(dense, emb), _cross(net, x0))
    assert net.out_dim == N


def test_stacked_is_todays_low_rank_network() -> None:
    torch.manual_seed(3)
    net = DCNv2Interaction(F, D, DENSE, layers=2, low_rank=3)
    assert sorted(net.state_dict()) == ["u.0.bias", "u.0.weight", "u.1.bias", "u.1.weight",
                                        "v.0.weight", "v.1.weight"]
    dense, emb = _inputs()
    torch.testing.assert_close(net(dense, emb), _cross(net, torch.cat([dense, emb.flatten(1)], 1)))


@pytest.mark.parametrize("structure", ["parallel", "stacked_parallel"])
def test_parallel_structures_concatenate_the_dnns(structure: str) -> None:
    net = DCNv2Interaction(F, D, DENSE, layers=2, low_rank=0, structure=structure, parallel_mlp=[8, 6],
                           stacked_mlp=[5], dropout=0.2, norm="batch").eval()
    dense, emb = _inputs()
    x0 = torch.cat([dense, emb.flatten(1)], 1)
    cross = _cross(net, x0)
    assert net.parallel is not None
    if structure == "stacked_parallel":
        assert net.stacked is not None
        cross = net.stacked(cross)
    else:
        assert net.stacked is None
    torch.testing.assert_close(net(dense, emb), torch.cat([cross, net.parallel(x0)], 1))
    assert net.out_dim == (5 if structure == "stacked_parallel" else N) + 6
    # every DNN layer is Linear -> BatchNorm -> ReLU -> Dropout, the last one too (FuxiCTR's MLP block)
    kinds = [type(m) for m in net.parallel]
    assert kinds == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Dropout] * 2
    assert all(m.p == 0.2 for m in net.parallel if isinstance(m, nn.Dropout))


def test_bottom_dropout_is_its_own_rate() -> None:
    from recstack.embedding import SparseOptimizerConfig
    from recstack.models.build import build_model

    cfg = load_config(None, ["model.embedding_dim=4", "model.bottom_mlp=[8, 4]", "model.top_mlp=[8, 1]",
                             "model.dropout=0.2", "model.bottom_dropout=0.0"]).model
    net = build_model(cfg, SparseOptimizerConfig(), 3, [5, 6], seed=0)
    assert not any(isinstance(m, nn.Dropout) for m in net.bottom)
    assert [m.p for m in net.top if isinstance(m, nn.Dropout)] == [0.2]
    cfg.bottom_dropout = -1.0  # the default: model.dropout's rate in both
    net = build_model(cfg, SparseOptimizerConfig(), 3, [5, 6], seed=0)
    assert [m.p for m in net.bottom if isinstance(m, nn.Dropout)] == [0.2]


@pytest.mark.parametrize("structure", ["parallel", "stacked_parallel"])
def test_zero_bias_init_starts_every_mlp_bias_at_zero_with_the_same_weights(structure: str) -> None:
    """``model.mlp_bias_init = "zero"`` (FuxiCTR's reset_parameters): every MLP bias (bottom, the DCNv2 DNNs, the
    top's logit) starts at 0 and every weight is the value "normal" draws; "normal" (default) starts the logit
    N(0, 1) off, so the model's first predictions of all-zero inputs differ from 0.5."""
    from recstack.embedding import SparseOptimizerConfig
    from recstack.models.build import build_model

    stacked = ["model.dcn_stacked_mlp=[8]"] if structure == "stacked_parallel" else []
    sets = ["model.embedding_dim=4", "model.bottom_mlp=[8, 4]", "model.top_mlp=[1]", 'model.interaction="dcn"',
            "model.dcn_low_rank=0", f'model.dcn_structure="{structure}"', "model.dcn_parallel_mlp=[16, 16]", *stacked]
    nets = {}
    for init in ("normal", "zero"):
        torch.manual_seed(5)  # the MLPs draw from torch's global RNG
        nets[init] = build_model(load_config(None, [*sets, f'model.mlp_bias_init="{init}"']).model,
                                 SparseOptimizerConfig(), 3, [5, 6], seed=0)
    mlps = [net for net in nets["zero"].modules() if isinstance(net, MLP)]
    assert len(mlps) == 3 + len(stacked)  # bottom, parallel DNN, [stacked DNN], top
    normal = dict(nets["normal"].named_parameters())
    for name, p in nets["zero"].named_parameters():
        if name.endswith(".bias") and not name.startswith("interaction.u."):  # the cross network's are 0 anyway
            assert p.detach().abs().max().item() == 0.0, name
            assert normal[name].detach().abs().max().item() > 0.0, name
        else:
            assert torch.equal(p, normal[name]), name
    x = torch.zeros(4, nets["zero"].interaction.out_dim)
    with torch.no_grad():  # the top MLP [1] on a zero input: its logit bias alone
        assert torch.equal(nets["zero"].top(x), torch.zeros(4, 1))
        torch.testing.assert_close(nets["normal"].top(x), nets["normal"].top[0].bias.expand(4, 1))


@pytest.mark.parametrize(("sets", "message"), [
    (['model.dcn_structure="parallel"'], r"model\.dcn_parallel_mlp: .*needs its hidden units"),
    (['model.dcn_structure="stacked_parallel"', "model.dcn_parallel_mlp=[8]"],
     r"model\.dcn_stacked_mlp: .*needs"),
    (["model.dcn_parallel_mlp=[8]"], r"model\.dcn_parallel_mlp: not used with model\.dcn_structure = 'stacked'"),
    (['model.interaction="dot"', "model.dcn_stacked_mlp=[8]"], r"model\.dcn_stacked_mlp: not used with model"),
    (["model.bottom_dropout=1.5"], r"model\.bottom_dropout"),
    (["model.dcn_low_rank=-1"], r"model\.dcn_low_rank"),
    (['model.mlp_bias_init="zeros"'], r"model\.mlp_bias_init: 'zeros' is not one of normal, zero"),
])
def test_bad_dcn_settings_name_the_key(sets: list[str], message: str) -> None:
    base = [] if any("interaction" in s for s in sets) else ['model.interaction="dcn"']
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*base, *sets])


@pytest.mark.parametrize("structure", ["parallel", "stacked_parallel"])
def test_each_structure_trains(tiny_dataset: Path, structure: str) -> None:
    """FuxiCTR's DCNv2 BARS shape, small: full rank, a parallel DNN with batch norm and dropout, fc = [1]."""
    stacked = ["model.dcn_stacked_mlp=[8]"] if structure == "stacked_parallel" else []
    out = train_steps(tiny_dataset, None, ['model.interaction="dcn"', "model.dcn_layers=2", "model.dcn_low_rank=0",
                                           f'model.dcn_structure="{structure}"', "model.dcn_parallel_mlp=[16, 16]",
                                           *stacked, 'model.mlp_norm="batch"', "model.dropout=0.1",
                                           "model.top_mlp=[1]", 'optim.sparse="adam"', "optim.sparse_lr=0.01",
                                           "train.max_steps=30"])
    assert 0.5 < out["auc"] <= 1.0 and out["logloss"] < 0.7
