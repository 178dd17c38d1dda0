"""configs/parity/: each FuxiCTR setting that bench/quality.py runs, expressed in recstack's keys, checked key by
key against the SETTINGS the FuxiCTR side is given (so neither can drift alone); the parity verdict."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

from recstack.config import load_config

sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "scripts"))
from quality import SETTINGS  # noqa: E402
from quality_parity import PARITY_MODELS, parity_config, verdicts  # noqa: E402


@pytest.mark.parametrize("layout", ["movielens", "criteo"])
@pytest.mark.parametrize("model", PARITY_MODELS)
def test_parity_config_says_what_fuxictr_is_given(layout: str, model: str) -> None:
    s = SETTINGS[layout][model]
    cfg = load_config(REPO / parity_config(layout, model))
    m, o, t = cfg.model, cfg.optim, cfg.train
    assert (m.embedding_dim, t.batch_size, t.epochs) == (s["embedding_dim"], s["batch_size"], s["epochs"])
    assert o.dense == o.sparse == "adam" and o.dense_lr == o.sparse_lr == s["learning_rate"]
    assert (o.sparse_weight_decay, o.sparse_weight_decay_mode) == (s["embedding_regularizer"], "all_rows")
    assert o.dense_weight_decay == s["net_regularizer"]
    assert (t.early_stopping.metric, t.early_stopping.patience) == (s["monitor"].lower(), s["patience"])
    assert (o.plateau_factor, o.plateau_patience) == (0.1, 1)  # FuxiCTR: lr / 10 at every non-improving evaluation
    assert t.shuffle == "rows" and s["shuffle"]
    assert m.mlp_norm == ("batch" if s["batch_norm"] else "none")
    assert m.embedding_init_bound == pytest.approx(1e-4 * 3**0.5, rel=1e-4)  # normal(0, 1e-4)'s std
    assert o.max_grad_norm == s["max_gradient_norm"] == 10.0  # FuxiCTR clips every gradient's norm (fit)
    assert m.mlp_bias_init == "zero"  # FuxiCTR's reset_parameters: every nn.Linear's bias at 0
    if model == "DLRM":
        assert m.interaction == s["interaction_op"]
        assert m.top_mlp == [*s["top_mlp_units"], 1] and m.dropout == s["top_mlp_dropout"]
        if s["bottom_mlp_units"] and layout == "criteo":  # MovieLens has no dense feature: no bottom MLP
            assert m.bottom_mlp == [*s["bottom_mlp_units"], m.embedding_dim]
            assert m.bottom_dropout == s["bottom_mlp_dropout"]
    else:
        assert (m.interaction, m.dcn_structure, m.dcn_layers) == ("dcn", s["model_structure"], s["num_cross_layers"])
        assert m.dcn_low_rank == 0 and not s["use_low_rank_mixture"]
        assert m.dcn_parallel_mlp == s["parallel_dnn_hidden_units"] and m.top_mlp == [1]
        assert m.dropout == s["net_dropout"] and s["dnn_activations"] == "relu"


def _stats(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def test_verdict_is_the_overlap_of_the_seeds_ranges() -> None:
    def models(ours: list[float], peer: list[float]) -> dict:
        return {"recstack DLRM (parity)": {"seeds": list(range(len(ours))), "test_auc": _stats(ours),
                                           "test_logloss": _stats([0.4] * len(ours))},
                "FuxiCTR DLRM": {"seeds": list(range(len(peer))), "test_auc": _stats(peer),
                                 "test_logloss": _stats([0.4] * len(peer))}}

    assert verdicts(models([0.80, 0.81, 0.82], [0.815, 0.83, 0.84]))["DLRM"]["within_spread"] is True
    far = verdicts(models([0.80, 0.81, 0.805], [0.815, 0.83, 0.84]))["DLRM"]
    assert far["within_spread"] is False and far["diff_auc"] == pytest.approx(0.805 - 0.8283333, abs=1e-5)
    assert verdicts(models([0.80], [0.80]))["DLRM"]["within_spread"] is None  # one seed: no spread
    assert verdicts(models([0.80], [0.80])).keys() == {"DLRM"}  # DCNv2 not run: no verdict
