"""``bench/quality.py --tune``'s verdicts and inputs: the tuned configuration against the better FuxiCTR model,
a study's trials.csv read back, and earlier reports taken only for the split prepared now."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from quality_tune import TUNED, describe_study, saved_runs, tune_verdicts  # noqa: E402


def _stat(mean: float) -> dict:
    return {"mean": mean, "min": mean - 0.001, "max": mean + 0.001}


def _models(tuned_auc: float, tuned_ll: float) -> dict:
    return {TUNED: {"test_auc": _stat(tuned_auc), "test_logloss": _stat(tuned_ll)},
            "FuxiCTR DLRM": {"test_auc": _stat(0.70), "test_logloss": _stat(0.60)},
            "FuxiCTR DCNv2": {"test_auc": _stat(0.72), "test_logloss": _stat(0.50)},
            "recstack DLRM": {"test_auc": _stat(0.99), "test_logloss": _stat(0.10)}}  # the recipe: not a peer


@pytest.mark.parametrize(("auc", "logloss", "auc_met", "logloss_met"), [
    (0.7200, 0.5020, True, True),  # level AUC, logloss exactly at the peer's + 0.002
    (0.7199, 0.4000, False, True),
    (0.7300, 0.5021, True, False),
])
def test_verdicts_are_against_the_peer_with_the_better_mean_test_auc(auc: float, logloss: float, auc_met: bool,
                                                                      logloss_met: bool) -> None:
    v = tune_verdicts(_models(auc, logloss))
    assert v is not None and v["peer"] == "FuxiCTR DCNv2"
    assert (v["auc_met"], v["logloss_met"]) == (auc_met, logloss_met)
    assert v["diff_auc"] == pytest.approx(auc - 0.72, abs=1e-9)


def test_no_verdict_without_a_tuned_run_or_a_peer() -> None:
    models = _models(0.8, 0.4)
    assert tune_verdicts({k: v for k, v in models.items() if k != TUNED}) is None
    assert tune_verdicts({k: v for k, v in models.items() if not k.startswith("FuxiCTR")}) is None


def test_describe_study_reads_trials_csv(tmp_path: Path) -> None:
    (tmp_path / "trials.csv").write_text(
        "number,state,valid_auc,valid_logloss,evaluations,seconds,directory,model.dropout,optim.sparse_lr\n"
        "0,complete,0.70,0.6,4,10.0,t/0000,0.1,0.02\n"
        "1,pruned,0.75,,3,5.0,t/0001,0.2,0.05\n"  # pruned: never the best, whatever its running value
        "2,complete,0.72,0.6,4,11.0,t/0002,0.3,0.01\n"
        "3,fail,,,0,1.0,t/0003,,\n")
    study = describe_study(tmp_path)
    assert study["trials"] == 4 and study["outcomes"] == {"complete": 2, "pruned": 1, "fail": 1}
    assert study["best_trial"] == 2 and study["best_valid_auc"] == 0.72
    assert study["best_params"] == {"model.dropout": "0.3", "optim.sparse_lr": "0.01"}


def test_saved_runs_only_for_the_same_split(tmp_path: Path) -> None:
    rows = {"train": 80, "valid": 10, "test": 10}
    runs = [{"model": m, "seed": s, "test_auc": 0.7, "test_predictions": "/gone.npy"}
            for m in ("FuxiCTR DLRM", "recstack DLRM", "recstack DLRM (parity)") for s in (0, 1, 5)]
    report = tmp_path / "quality.json"
    report.write_text(json.dumps({"datasets": {"ml100k": {"rows": rows, "runs": runs}}}))
    kept = saved_runs([report], "ml100k", rows, [0, 1])
    assert {(r["model"], r["seed"]) for r in kept} == {(m, s) for m in ("FuxiCTR DLRM", "recstack DLRM")
                                                      for s in (0, 1)}
    assert all("test_predictions" not in r for r in kept)
    with pytest.raises(SystemExit, match="rows"):
        saved_runs([report], "ml100k", {**rows, "test": 11}, [0])
    with pytest.raises(SystemExit, match="no saved runs of data set adult"):
        saved_runs([report], "adult", rows, [0])
