"""``recstack tune``'s study: Optuna's TPE sampler proposes configs, real ``recstack train`` runs
score them.

Each trial is the recipe, the space's ``fixed`` overrides, the command line's ``--set``, an
evaluation every half epoch of the trial's batch size, and the sampled values, written whole to
``RUN/trials/NNNN/config.toml`` and trained there in a process of its own (``trial_run``) with the
recipe's early stopping on the validation split; its score is the validation AUC of the checkpoint
it keeps. While it runs, the running best of its validation AUCs is reported to Optuna's median
pruner at each evaluation (the evaluation's number is the step, so trials of other batch sizes
compare at the same fraction of an epoch), and a pruned trial's process is ended.

The study lives in ``RUN/study.db`` (Optuna's SQLite storage), written at every ask and tell:
``--resume`` continues it, and after a SIGKILL the trials that were running (left RUNNING there)
are marked failed and asked again with the same values. What a resumed study must find unchanged
(the recipe with every override, the space) is stored in the study and compared. The first trial of
a new study is the recipe's own values (where the space holds them), so the study's best is never
below the recipe on the validation split.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from recstack.config import load_config
from recstack.errors import ConfigError, TuneError
from recstack.tune.space import SearchSpace
from recstack.tune.trial_run import CONFIG_FILE, LOG_FILE, TrialRun, cpu_cores
from recstack.typed_toml import parse_override, read_toml, to_toml

STUDY_DB = "study.db"
STUDY_NAME = "recstack-tune"
TRIALS_DIR = "trials"
MAX_FAILED_IN_A_ROW = 5
_POLL_S = 0.5


@dataclass(frozen=True)
class TuneSpec:
    """What ``recstack tune`` was asked: the recipe, where the study lives, the overrides every
    trial takes (``sets``: the command line's), the space, and when to stop (``time_budget_s``
    and/or ``trials``: finished trials in the study, earlier sessions' included)."""

    recipe: Path
    output_dir: Path
    sets: tuple[str, ...]
    space: SearchSpace
    time_budget_s: float | None
    trials: int | None
    jobs: int = 1
    seed: int = 0
    resume: bool = False
    half_epoch_eval: bool = True  # else every trial evaluates at the sets' train.eval_every


def command_line_sets(seed: int, overrides: list[str]) -> tuple[list[str], bool]:
    """The overrides every trial takes from the command line: ``--seed`` as train.seed (a --set of
    it wins), then ``overrides`` -> (them, whether trials evaluate every half epoch). Unless
    ``overrides`` give train.eval_every, each trial's is half an epoch at its batch size
    (``half_epoch_eval``); until then a placeholder stands in, so that early stopping, which needs
    an interval, is checked as trials run it."""
    half_epoch = not any(o.split("=", 1)[0].strip() == "train.eval_every" for o in overrides)
    return [
        f"train.seed={seed}",
        *(["train.eval_every=1"] if half_epoch else []),
        *overrides,
    ], half_epoch


def base_overrides(spec: TuneSpec) -> list[str]:
    """The overrides on top of the recipe that every trial takes, the data paths made absolute
    (best.toml trains from any directory). The training data must be a prepared directory."""
    sets = [*spec.space.fixed, *spec.sets]
    cfg = load_config(spec.recipe, sets)
    if not cfg.data.train:
        raise ConfigError(
            "data.train: recstack tune needs the prepared training directory "
            "(--set data.train=DIR)"
        )
    for key in ("train", "eval"):
        path = getattr(cfg.data, key)
        if path and not Path(path).is_absolute():
            sets.append(f"data.{key}={json.dumps(str(Path(path).resolve()))}")
    return sets


def half_epoch_eval(spec: TuneSpec, sets: list[str]) -> int:
    """Steps in half an epoch at the batch size ``sets`` give: every trial evaluates twice an
    epoch."""
    from recstack.data.prepared_dataset import PreparedDataset

    cfg = load_config(spec.recipe, sets)
    rows = len(PreparedDataset(cfg.data.train))
    if not cfg.data.eval:
        rows -= int(rows * cfg.data.eval_fraction)
    return max(1, rows // cfg.train.batch_size // 2)


def write_config(recipe: Path, overrides: list[str], path: Path) -> None:
    """The recipe's TOML with ``overrides`` applied, written to ``path`` as a complete config that
    ``recstack train --config`` takes as is; checked to load as the recipe with the overrides
    does."""
    values = read_toml(recipe, "config file", ConfigError)
    for text in overrides:
        keys, value = parse_override(text)
        table = values
        for k in keys[:-1]:
            table = table.setdefault(k, {})
        old = table.get(keys[-1])
        table[keys[-1]] = (
            {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
        )
    path.write_text(to_toml(values))
    if load_config(path).to_dict() != load_config(recipe, overrides).to_dict():
        raise TuneError(f"{path}: the written config differs from {recipe} with {overrides}")


def _differs(a: Any, b: Any, where: str = "") -> str | None:
    """The first dotted key where two JSON-like values differ, as "key: a != b"; None when
    equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _differs(a.get(k), b.get(k), f"{where}.{k}" if where else k)
            if d is not None:
                return d
        return None
    return None if a == b else f"{where}: {a!r} != {b!r}"


def open_study(spec: TuneSpec, base: dict[str, Any]) -> optuna.Study:
    """Create the study in RUN/study.db, or load it with ``resume`` (refused when the recipe, the
    overrides or the space differ from the study's); a resumed study's trials left running are
    failed and asked again."""
    db = spec.output_dir / STUDY_DB
    if db.exists() and not spec.resume:
        raise ConfigError(
            f"--output-dir {spec.output_dir} holds a study ({db}): pass --resume to continue it, "
            "or tune into another --output-dir"
        )
    if spec.resume and not db.exists():
        raise ConfigError(
            f"--resume: --output-dir {spec.output_dir} holds no study ({db} not found)"
        )
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the tuner prints its own line per trial
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    study = optuna.create_study(
        storage=f"sqlite:///{db}",
        study_name=STUDY_NAME,
        direction="maximize",
        load_if_exists=spec.resume,
        sampler=optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=5),
        # From the third evaluation (1.5 epochs) on, once 3 trials have finished: below the median
        # of the others' running best at the same evaluation.
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2),
    )
    found = {"config": base, "space": spec.space.to_dict()}
    if not spec.resume:
        for key, value in found.items():
            study.set_user_attr(key, value)
        _enqueue_recipe(study, spec.space, base)
        return study
    for key, what in (
        ("config", "the recipe with its overrides (--config, --set, the space's fixed)"),
        ("space", "the search space"),
    ):
        diff = _differs(study.user_attrs.get(key), found[key])
        if diff is not None:
            raise ConfigError(
                f"--resume: {what} differs from the study's in {spec.output_dir} ({diff}); "
                "resume with the same ones, or tune into another --output-dir"
            )
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(
            t.number, state=TrialState.FAIL
        )  # killed with the tuner: asked again, not counted
        study.enqueue_trial(t.params, user_attrs={"rerun_of": t.number})
        print(
            f"resume: trial {t.number} was running when the study stopped; "
            "marked failed, asked again"
        )
    return study


def _enqueue_recipe(study: optuna.Study, space: SearchSpace, base: dict[str, Any]) -> None:
    """Trial 0: the recipe's own value of every searched key the space holds."""
    params = {}
    for p in space.params:
        value: Any = base
        for k in p.key.split("."):
            value = value.get(k) if isinstance(value, dict) else None
        stored = p.stored(value)
        if stored is not None:
            params[p.key] = stored
    if params:
        study.enqueue_trial(params, user_attrs={"recipe": True})


def finished(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


class Tuner:
    """Runs the study: up to ``jobs`` trials at once, until ``trials`` have finished or the time
    budget has passed (no trial starts after it; the running ones finish)."""

    def __init__(self, spec: TuneSpec, study: optuna.Study, sets: list[str], log: Any) -> None:
        self.spec, self.study, self.sets, self.log = spec, study, sets, log
        self.threads = max(1, cpu_cores() // spec.jobs)
        self.running: dict[int, tuple[optuna.Trial, TrialRun, float]] = {}
        self.failed_in_a_row = 0
        self.distributions = {p.key: p.distribution() for p in spec.space.params}

    def run(self) -> None:
        deadline = (
            None if self.spec.time_budget_s is None else time.monotonic() + self.spec.time_budget_s
        )
        try:
            while True:
                while len(self.running) < self.spec.jobs and self._more(deadline):
                    self._start()
                if not self.running:
                    return
                time.sleep(_POLL_S)
                for number in list(self.running):
                    self._check(number)
        except (
            BaseException
        ):  # an error, Ctrl-C: no trial trains on, none is left RUNNING in the study
            for trial, run, _ in self.running.values():
                run.stop()
                self.study.tell(trial, state=TrialState.FAIL)
            raise

    def _more(self, deadline: float | None) -> bool:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        return (
            self.spec.trials is None or finished(self.study) + len(self.running) < self.spec.trials
        )

    def _start(self) -> None:
        trial = self.study.ask(self.distributions)
        directory = self.spec.output_dir / TRIALS_DIR / f"{trial.number:04d}"
        directory.mkdir(parents=True, exist_ok=True)
        trial.set_user_attr("directory", str(directory))
        sampled = [p.override(trial.params[p.key]) for p in self.spec.space.params]
        overrides = [*self.sets, *sampled]
        if self.spec.half_epoch_eval:
            overrides.insert(
                len(self.sets), f"train.eval_every={half_epoch_eval(self.spec, overrides)}"
            )
        write_config(self.spec.recipe, overrides, directory / CONFIG_FILE)
        self.running[trial.number] = (trial, TrialRun(directory, self.threads), time.monotonic())

    def _check(self, number: int) -> None:
        trial, run, started = self.running[number]
        status = run.poll()  # before reading: every evaluation of an ended run is in the file
        first = len(run.aucs) + 1
        for i, _ in enumerate(run.new_aucs(), first):
            trial.report(max(run.aucs[:i]), i)  # the running best: what early stopping would keep
            if status is None and trial.should_prune():
                run.stop()
                self._finish(number, TrialState.PRUNED, max(run.aucs), started)
                return
        if status is None:
            return
        if status != 0:
            self._failed(number, run, started)
            return
        summary = run.summary()
        kept = summary.get("best") or summary
        if kept.get("auc") is None:
            self._failed(
                number, run, started, "no validation AUC (no evaluation rows, or one class only)"
            )
            return
        trial.set_user_attr("best_step", summary.get("best_step", summary.get("steps")))
        trial.set_user_attr("valid_logloss", kept.get("logloss"))
        self._finish(number, TrialState.COMPLETE, float(kept["auc"]), started)

    def _finish(self, number: int, state: TrialState, value: float, started: float) -> None:
        trial, run, _ = self.running.pop(number)
        trial.set_user_attr("evaluations", len(run.aucs))
        self.study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
        self.failed_in_a_row = 0
        self.log(
            progress_line(
                self.study, number, state, value, time.monotonic() - started, self.spec.space
            )
        )

    def _failed(self, number: int, run: TrialRun, started: float, why: str | None = None) -> None:
        trial, _, _ = self.running.pop(number)
        why = why or run.error_line()
        trial.set_user_attr("error", why)
        self.study.tell(trial, state=TrialState.FAIL)
        self.failed_in_a_row += 1
        self.log(
            progress_line(
                self.study,
                number,
                TrialState.FAIL,
                None,
                time.monotonic() - started,
                self.spec.space,
                why,
            )
        )
        log = run.directory / LOG_FILE
        if finished(self.study) == 0:
            raise TuneError(
                f"trial {number} failed before any trial of the study finished: {why} "
                f"(log: {log}); "
                "fix the recipe, the data or the space first"
            )
        if self.failed_in_a_row >= MAX_FAILED_IN_A_ROW:
            raise TuneError(
                f"{self.failed_in_a_row} trials failed in a row, the last: {why} (log: {log})"
            )


def show(value: Any) -> str:
    """A config value in a line: floats to 3 significant digits, strings bare, else JSON."""
    if isinstance(value, float):
        return f"{value:.3g}"
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def format_params(space: SearchSpace, params: dict[str, Any]) -> str:
    """``key=value`` of every searched key."""
    return " ".join(
        f"{p.key}={show(p.value(params[p.key]))}" for p in space.params if p.key in params
    )


def progress_line(
    study: optuna.Study,
    number: int,
    state: TrialState,
    value: float | None,
    seconds: float,
    space: SearchSpace,
    why: str | None = None,
) -> str:
    """One line per finished trial: number, outcome, validation AUC, the best so far, time,
    parameters."""
    trial = study.get_trials(deepcopy=False)[number]
    what = {TrialState.COMPLETE: "valid AUC", TrialState.PRUNED: "pruned, valid AUC so far"}.get(
        state, ""
    )
    score = f"{what} {value:.5f}" if value is not None else f"failed: {why}"
    try:
        best = f"best {study.best_value:.5f} (trial {study.best_trial.number})"
    except ValueError:  # no complete trial yet
        best = "best -"
    params = format_params(space, trial.params)
    return f"trial {number:>3}  {score}  {best}  {seconds:5.0f} s  {params}"
