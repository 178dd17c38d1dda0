"""What ``recstack tune`` leaves in RUN: the leaderboard, ``trials.csv``, ``best.toml``, the plots
(``history.png``, ``importance.png``), and with ``--seeds`` the best config retrained per seed."""

from __future__ import annotations

import csv
import json
import math
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from optuna.trial import FrozenTrial, TrialState

from recstack.errors import TuneError
from recstack.io import atomic_path, atomic_write_text
from recstack.tune.space import SearchSpace
from recstack.tune.study import TuneSpec, format_params
from recstack.tune.trial_run import CONFIG_FILE, TrialRun, cpu_cores


def _complete(study: optuna.Study) -> list[FrozenTrial]:
    """Complete trials, best first (ties: the earlier trial)."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return sorted(trials, key=lambda t: (-(t.value or 0.0), t.number))


def leaderboard(study: optuna.Study, space: SearchSpace, top: int = 10) -> str:
    """The best ``top`` complete trials, and the count of trials per outcome."""
    counts = {
        s: len(study.get_trials(deepcopy=False, states=(s,)))
        for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    }
    lines = [
        f"leaderboard ({counts[TrialState.COMPLETE]} complete, "
        f"{counts[TrialState.PRUNED]} pruned, "
        f"{counts[TrialState.FAIL]} failed):",
        "rank  trial  valid AUC  evals     time  parameters",
    ]
    for rank, t in enumerate(_complete(study)[:top], 1):
        secs = t.duration.total_seconds() if t.duration else float("nan")
        lines.append(
            f"{rank:>4}  {t.number:>5}  {t.value:.5f}  {t.user_attrs.get('evaluations', 0):>5}  "
            f"{secs:5.0f} s  {format_params(space, t.params)}"
            + ("  (the recipe)" if t.user_attrs.get("recipe") else "")
        )
    return "\n".join(lines)


def write_trials_csv(study: optuna.Study, space: SearchSpace, path: Path) -> None:
    """One row per trial: its outcome, validation AUC (a pruned trial's: its running best when
    pruned), evaluations, seconds, directory, then one column per searched key (its config
    value)."""
    keys = [p.key for p in space.params]
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "number",
                "state",
                "valid_auc",
                "valid_logloss",
                "evaluations",
                "seconds",
                "directory",
                *keys,
            ]
        )
        for t in study.get_trials(deepcopy=False):
            value = (
                t.value
                if t.state == TrialState.COMPLETE
                else (max(t.intermediate_values.values()) if t.intermediate_values else None)
            )
            row = [
                t.number,
                t.state.name.lower(),
                value,
                t.user_attrs.get("valid_logloss"),
                t.user_attrs.get("evaluations"),
                round(t.duration.total_seconds(), 1) if t.duration else None,
                t.user_attrs.get("directory"),
            ]
            by_key = {p.key: p for p in space.params}
            row += [_cell(by_key[k].value(t.params[k])) if k in t.params else None for k in keys]
            w.writerow(row)


def _cell(value: Any) -> Any:
    """A config value in trials.csv: numbers and strings as they are, lists and tables as JSON."""
    return (
        value
        if isinstance(value, bool | int | float | str)
        else json.dumps(value, separators=(",", ":"))
    )


def write_best(study: optuna.Study, spec: TuneSpec, path: Path) -> FrozenTrial:
    """``best.toml``: the best trial's complete config (data paths included), and where its
    model is."""
    best = _complete(study)[0]
    directory = Path(best.user_attrs["directory"])
    header = [
        f"# recstack tune: the best of {len(_complete(study))} complete trials on {spec.recipe}: "
        "trial "
        f"{best.number}, validation AUC {best.value:.5f}.",
        f"# Its model (the best checkpoint, in checkpoints/best): {directory}",
        f"#   recstack eval --checkpoint {directory} --data TEST_DIR",
        "# Retrain it: recstack train --config best.toml --output-dir RUN_DIR",
    ]
    atomic_write_text(path, "\n".join(header) + "\n" + (directory / CONFIG_FILE).read_text())
    return best


def plot_study(study: optuna.Study, space: SearchSpace, out: Path) -> list[str]:
    """``history.png`` (every trial's validation AUC and the best so far) and ``importance.png``
    (each searched key's importance, Optuna's PED-ANOVA); -> notes on what could not be drawn."""
    notes: list[str] = []
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    done = [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
    ]
    complete = [t for t in done if t.state == TrialState.COMPLETE]
    pruned = [t for t in done if t.state == TrialState.PRUNED and t.intermediate_values]
    ax.scatter(
        [t.number for t in complete],
        [t.value or 0.0 for t in complete],
        label="complete",
        zorder=3,
    )
    ax.scatter(
        [t.number for t in pruned],
        [max(t.intermediate_values.values()) for t in pruned],
        marker="x",
        color="grey",
        label="pruned (its best when pruned)",
    )
    best, xs, ys = -math.inf, [], []
    for t in sorted(complete, key=lambda t: t.number):
        best = max(best, t.value or -math.inf)
        xs.append(t.number)
        ys.append(best)
    ax.step(xs, ys, where="post", color="C1", label="best so far")
    ax.set(xlabel="trial", ylabel="validation AUC", title="recstack tune: optimisation history")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="best")
    _save(fig, out / "history.png")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            imp = optuna.importance.get_param_importances(
                study, evaluator=optuna.importance.PedAnovaImportanceEvaluator()
            )
    except (ValueError, RuntimeError) as e:  # too few trials for the estimate
        return [*notes, f"importance.png: not drawn ({e})"]
    fig = Figure(figsize=(7, 1 + 0.4 * max(1, len(imp))))
    ax = fig.add_subplot()
    names = list(imp)[::-1]
    ax.barh(names, [imp[n] for n in names])
    ax.set(xlabel="importance (PED-ANOVA)", title="recstack tune: parameter importance")
    fig.tight_layout()
    _save(fig, out / "importance.png")
    return notes


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def retrain_seeds(
    best_toml: Path, out: Path, seeds: list[int], jobs: int, log: Any
) -> dict[str, Any]:
    """Train ``best_toml`` once per seed into ``out/<seed>`` (up to ``jobs`` at once) -> the
    validation AUCs of the models they keep, with their mean, min and max."""
    threads = max(1, cpu_cores() // jobs)
    pending, running, aucs = list(seeds), dict[int, TrialRun](), dict[int, float]()
    while pending or running:
        while pending and len(running) < jobs:
            seed = pending.pop(0)
            directory = out / str(seed)
            if directory.exists():
                shutil.rmtree(directory)
            directory.mkdir(parents=True)
            shutil.copy(best_toml, directory / CONFIG_FILE)
            running[seed] = TrialRun(directory, threads, (f"train.seed={seed}",))
        time.sleep(0.5)
        for seed, run in list(running.items()):
            status = run.poll()
            if status is None:
                continue
            del running[seed]
            if status != 0:
                for other in running.values():
                    other.stop()
                raise TuneError(
                    f"the retrain of best.toml with seed {seed} failed: {run.error_line()} "
                    f"(log: {run.directory / 'train.log'})"
                )
            summary = run.summary()
            aucs[seed] = float((summary.get("best") or summary)["auc"])
            log(f"seed {seed}: valid AUC {aucs[seed]:.5f}  ({run.directory})")
    values = [aucs[s] for s in seeds]
    return {
        "seeds": seeds,
        "valid_auc": values,
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
    }
