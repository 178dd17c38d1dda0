"""recstack tune end to end on real data (the shipped Criteo sample, prepared as bench/quality.py
prepares it: train and validation splits; the tune command is never given the test split): real
`recstack tune` processes whose trials are real `recstack train` processes. A small study with two
trials at once, whose best.toml retrains to the best trial's validation AUC; a study killed
mid-trial and resumed; a recipe failing its first trial."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from bench.quality import CRITEO_SAMPLE, prepare
from recstack.cli.main import main
from recstack.config import load_config
from recstack.tune.trial_run import cpu_cores
from tests.conftest import RECSTACK, REPO, run_cli

RECIPE = REPO / "configs" / "recipes" / "criteo_small.toml"
# A small model and 3 epochs keep each trial to seconds of CPU; the embedding dim moves with the
# bottom MLP's end.
SPACE = """fixed = ["model.bottom_mlp=[16, 16]", "model.top_mlp=[16, 1]", "train.epochs=3"]
[params]
"optim.sparse_lr" = {low = 0.01, high = 0.3, log = true}
"model" = {choices = [{embedding_dim = 16, bottom_mlp = [16, 16]},
                      {embedding_dim = 4, bottom_mlp = [16, 4]}]}
"""
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def criteo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Criteo sample's prepared train/valid/test splits (1,599 / 200 / 200 rows, in row
    order)."""
    if not CRITEO_SAMPLE.is_file():
        pytest.skip(f"real Criteo sample not found at {CRITEO_SAMPLE}")
    work = tmp_path_factory.mktemp("quality")
    prepare("criteo_sample", work)
    return work / "criteo_sample" / "recstack"


def tune_args(data: Path, run: Path, space: Path, *extra: str) -> list[str]:
    return [
        "tune",
        "--config",
        str(RECIPE),
        "--output-dir",
        str(run),
        "--space",
        str(space),
        "--set",
        f"data.train={data / 'train'}",
        "--set",
        f"data.eval={data / 'valid'}",
        *extra,
    ]


def space_file(tmp_path: Path, text: str = SPACE) -> Path:
    (tmp_path / "space.toml").write_text(text)
    return tmp_path / "space.toml"


def load(run: Path) -> optuna.Study:
    return optuna.load_study(study_name="recstack-tune", storage=f"sqlite:///{run / 'study.db'}")


def states(study: optuna.Study) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


def test_small_study_two_jobs_best_toml_retrains_to_the_best_trial(
    criteo: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    res = run_cli(
        tune_args(
            criteo, run, space_file(tmp_path), "--trials", "3", "--jobs", "2", "--seeds", "0"
        ),
        timeout=1200,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    study = load(run)
    assert states(study).get("FAIL", 0) == 0
    assert sum(states(study).get(s, 0) for s in ("COMPLETE", "PRUNED")) == 3
    trials = study.get_trials(deepcopy=False)
    assert trials[0].params["optim.sparse_lr"] == 0.05  # trial 0: the recipe's own value
    # one progress line per trial, then the leaderboard
    progress = [ln for ln in res.stdout.splitlines() if ln.startswith("trial ")]
    assert len(progress) == 3 and all(
        " best " in ln and "optim.sparse_lr=" in ln for ln in progress
    )
    assert "leaderboard (" in res.stdout
    # --jobs 2: two trials at once, each with half the cores' threads
    assert trials[1].datetime_start < trials[0].datetime_complete
    for t in trials:
        config = json.loads((Path(t.user_attrs["directory"]) / "config.json").read_text())
        assert config["train"]["threads"] == max(1, cpu_cores() // 2)
        assert config["data"]["eval"] == str(
            criteo / "valid"
        )  # validation only; tune has no test path
    rows = list(csv.DictReader((run / "trials.csv").open()))
    assert [int(r["number"]) for r in rows] == [0, 1, 2] and rows[0]["optim.sparse_lr"] == "0.05"
    for png in ("history.png", "importance.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # best.toml: complete (data paths included), the best trial's config; --seeds 0 trained it as
    # is (the study's seed is 0) to the best trial's validation AUC, digit for digit
    best = study.best_trial
    cfg = load_config(run / "best.toml")
    assert cfg.data.train == str(criteo / "train") and cfg.data.eval == str(criteo / "valid")
    assert cfg.optim.sparse_lr == best.params["optim.sparse_lr"]
    assert (
        f"trial {best.number}, validation AUC {best.value:.5f}" in (run / "best.toml").read_text()
    )
    seeds = json.loads((run / "seeds.json").read_text())
    assert seeds["valid_auc"] == [best.value], (seeds, best.value)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (FileNotFoundError, IndexError):
        return True


def test_sigkill_mid_trial_then_resume_completes_the_study(
    criteo: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run, space = tmp_path / "run", space_file(tmp_path)
    args = tune_args(criteo, run, space, "--trials", "2")
    proc = subprocess.Popen(
        [*RECSTACK, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = run / "trials" / "0001" / "metrics.jsonl"
    deadline = time.time() + 900
    while proc.poll() is None and time.time() < deadline:  # trial 1 has evaluated once: mid-trial
        if metrics.is_file() and '"kind": "eval"' in metrics.read_text():
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    trainers = _children(proc.pid)
    assert trainers
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    deadline = time.time() + 60
    while not all(_dead(p) for p in trainers) and time.time() < deadline:
        time.sleep(0.2)
    assert all(_dead(p) for p in trainers), "a trial trained on after its tuner was killed"
    killed = load(run).get_trials(deepcopy=False)[1]
    assert killed.state == TrialState.RUNNING  # as the kill left it

    # without --resume the study is not started over; with another space it is not resumed
    assert main(args) == 2  # without --resume the study is not started over
    assert "holds a study" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    other = space_file(tmp_path / "other", SPACE.replace("0.3, log", "0.5, log"))
    assert main([*tune_args(criteo, run, other, "--trials", "2"), "--resume"]) == 2
    err = capsys.readouterr().err.strip()  # with another space it is not resumed
    assert "the search space differs" in err and "optim.sparse_lr" in err and "\n" not in err, err

    res = run_cli([*args, "--resume"], timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resume: trial 1 was running when the study stopped" in res.stdout
    study = load(run)
    assert states(study) == {"COMPLETE": 2, "FAIL": 1} or states(study) == {
        "COMPLETE": 1,
        "PRUNED": 1,
        "FAIL": 1,
    }
    trials = study.get_trials(deepcopy=False)
    assert trials[1].state == TrialState.FAIL
    assert (
        trials[2].params == trials[1].params and trials[2].user_attrs["rerun_of"] == 1
    )  # asked again
    assert (run / "best.toml").is_file() and len(
        list(csv.DictReader((run / "trials.csv").open()))
    ) == 3
    assert os.path.isdir(run / "trials" / "0002")


def test_recipe_failing_its_first_trial_is_one_error(criteo: Path, tmp_path: Path) -> None:
    # the recipe's bottom MLP ends in 16: an embedding dim of 8 fails when the model is built on
    # the data
    space = space_file(
        tmp_path, '[params]\n"optim.sparse_lr" = {low = 0.01, high = 0.3, log = true}\n'
    )
    res = run_cli(
        tune_args(
            criteo, tmp_path / "run", space, "--trials", "5", "--set", "model.embedding_dim=8"
        ),
        timeout=600,
    )
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    err = res.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(
        "recstack tune: error: trial 0 failed before any trial of the study finished: "
        "recstack train: error: model.bottom_mlp"
    )
    assert [p.name for p in (tmp_path / "run" / "trials").iterdir()] == [
        "0000"
    ]  # not a stack of failed trials
