"""``recstack tune``: search a recipe's options on the validation split with Optuna
(``recstack.tune``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recstack.cli.args import positive_int
from recstack.errors import ConfigError, TuneError
from recstack.io import check_writable
from recstack.units import parse_duration

DEFAULT_BUDGET = "20m"  # when neither --time-budget nor --trials says when to stop


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="search a recipe's options on your validation data (Optuna, real trials)",
        description="Each trial is a `recstack train` of the recipe with sampled options, early "
        "stopping on data.eval; the best is written to OUTPUT_DIR/best.toml. The test "
        "split is never read.",
    )
    p.add_argument("--config", required=True, help="the recipe (configs/recipes/*.toml)")
    p.add_argument(
        "--output-dir",
        required=True,
        help="the study (study.db), trials/NNNN, best.toml, "
        "trials.csv, history.png, importance.png",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config value every trial takes (data.train=DIR and data.eval=DIR at least); "
        "a key the "
        "space searches is then not searched",
    )
    p.add_argument(
        "--space", help="search space TOML (default: the recipe's, tune/<recipe name> beside it)"
    )
    p.add_argument(
        "--time-budget",
        metavar="DURATION",
        help=f"start no trial after this long, e.g. 20m, 1.5h (default {DEFAULT_BUDGET} "
        "when --trials "
        "is not given; the running trials finish)",
    )
    p.add_argument(
        "--trials",
        type=positive_int,
        help="stop when the study has this many finished trials "
        "(complete or pruned, earlier runs' included)",
    )
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="trials run at once, each in its own process with cores / JOBS threads (default 1)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the sampler's seed and every trial's train.seed (default 0)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        metavar="S",
        help="afterwards, retrain best.toml once per seed and report its validation AUC's mean "
        "[min, max]",
    )
    p.add_argument("--resume", action="store_true", help="continue the study in --output-dir")
    p.set_defaults(func=run)


def _budget(text: str | None, trials: int | None) -> float | None:
    if text is None:
        return None if trials is not None else parse_duration(DEFAULT_BUDGET)
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise ConfigError(f"--time-budget: {e}") from e
    if seconds <= 0:
        raise ConfigError(f"--time-budget: must be more than 0, got {text!r}")
    return seconds


def _overlap(key: str, given: str) -> bool:
    """Whether a --set of ``given`` sets (some of) the searched ``key``: the same key, or one
    inside the other (``model.embedding_dim`` and a searched ``model`` table)."""
    return key == given or key.startswith(given + ".") or given.startswith(key + ".")


def run(args: argparse.Namespace) -> None:
    from optuna.trial import TrialState

    from recstack.config import load_config
    from recstack.tune import report, space, study

    budget = _budget(args.time_budget, args.trials)
    if args.seed < 0:
        raise ConfigError(f"--seed: must be >= 0, got {args.seed}")
    recipe = Path(args.config)
    load_config(recipe, args.overrides)  # the recipe and the overrides alone, before the space
    space_file = Path(args.space) if args.space else space.space_path(recipe)
    if not args.space and not space_file.is_file():
        raise ConfigError(
            f"--config {recipe}: no search space beside it ({space_file} not found); give one "
            'with --space (see docs/training.md, "Tuning on your own data")'
        )
    searched = space.load_space(space_file)
    given = [s.split("=", 1)[0].strip() for s in args.overrides]
    pinned = [p.key for p in searched.params if any(_overlap(p.key, g) for g in given)]
    searched = searched.without(set(pinned))
    sets, half_epoch = study.command_line_sets(args.seed, args.overrides)
    space.check(searched, recipe, sets)
    out = Path(args.output_dir)
    check_writable(out, directory=True, inside=True)
    spec = study.TuneSpec(
        recipe,
        out,
        tuple(sets),
        searched,
        budget,
        args.trials,
        args.jobs,
        args.seed,
        args.resume,
        half_epoch,
    )
    base_sets = study.base_overrides(spec)
    base = load_config(recipe, base_sets).to_dict()
    the_study = study.open_study(spec, base)

    def log(line: str) -> None:
        print(line, flush=True)

    stop = [
        f"{args.trials} finished trials" if args.trials else "",
        f"{budget:g} s" if budget else "",
    ]
    log(
        f"tuning {recipe} on {base['data']['train']} "
        f"(validation: {base['data']['eval'] or 'eval_fraction'}): "
        f"{len(searched.params)} keys from {searched.source}"
        + (f" (pinned by --set: {', '.join(pinned)})" if pinned else "")
        + f"; {args.jobs} trial(s) at once; until {' or '.join(s for s in stop if s)}"
    )
    try:
        study.Tuner(spec, the_study, base_sets, log).run()
    except KeyboardInterrupt:
        raise TuneError(
            f"interrupted: the running trials were ended and marked failed; {out / 'study.db'} "
            "keeps the others (--resume continues the study)"
        ) from None
    if not the_study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        raise TuneError(f"no trial of the study in {out} completed")
    log(report.leaderboard(the_study, searched))
    report.write_trials_csv(the_study, searched, out / "trials.csv")
    best = report.write_best(the_study, spec, out / "best.toml")
    for note in report.plot_study(the_study, searched, out):
        log(note)
    model = best.user_attrs["directory"]
    log(
        f"best: trial {best.number}, validation AUC {best.value:.5f}; config {out / 'best.toml'}; "
        f"its model {model} (recstack eval --checkpoint {model} --data ...)"
    )
    if args.seeds:
        result = report.retrain_seeds(out / "best.toml", out / "seeds", args.seeds, args.jobs, log)
        log(
            f"best.toml over seeds {' '.join(map(str, args.seeds))}: "
            f"valid AUC mean {result['mean']:.5f} "
            f"[{result['min']:.5f}, {result['max']:.5f}]"
        )
        (out / "seeds.json").write_text(json.dumps(result, indent=2) + "\n")
