"""recstack tune's inputs: search spaces (their form, and every key and value checked against the
typed config before any trial: one error line naming the file and the key, exit 2, no study
started), durations, and the complete configs a trial and best.toml are written as."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from recstack.cli.main import main
from recstack.config import load_config
from recstack.errors import ConfigError
from recstack.tune.space import Param, load_space, space_path
from recstack.tune.study import write_config
from recstack.typed_toml import to_toml
from recstack.units import parse_duration

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "configs" / "recipes"
GOOD = '[params]\n"optim.sparse_lr" = {low = 0.01, high = 0.3, log = true}\n'


def tune(
    tmp_path: Path, space: str | None, *extra: str, recipe: Path = RECIPES / "criteo_small.toml"
) -> list[str]:
    args = [
        "tune",
        "--config",
        str(recipe),
        "--output-dir",
        str(tmp_path / "run"),
        "--set",
        f"data.train={tmp_path}/train",
        "--set",
        f"data.eval={tmp_path}/valid",
        *extra,
    ]
    if space is not None:
        (tmp_path / "space.toml").write_text(space)
        args += ["--space", str(tmp_path / "space.toml")]
    return args


@pytest.mark.parametrize(
    "space,extra,expected",
    [
        ("[params]\n", (), "the search space is empty"),
        (
            GOOD,
            ("--set", "optim.sparse_lr=0.1"),
            "the search space is empty",
        ),  # --set pins the only key
        ('[params]\n"model.nope" = {choices = [1, 2]}\n', (), "space.toml: params.'model.nope'"),
        (
            '[params]\n"model.interaction" = {choices = ["dot", "dcnx"]}\n',
            (),
            "'dcnx' is not one of dot, cat, dcn",
        ),
        (
            '[params]\n"model.dropout" = {low = 0.0, high = 1.5}\n',
            (),
            "model.dropout: must be in [0, 1)",
        ),
        (
            '[params]\n"optim.sparse_lr" = {low = 0.01, high = 0.3, lgo = true}\n',
            (),
            "unknown field 'lgo'",
        ),
        (
            '[params]\n"optim.sparse_lr" = {low = 0.0, high = 0.3, log = true}\n',
            (),
            "log = true needs low > 0",
        ),
        ('[params]\n"optim.sparse_lr" = {low = 0.3, high = 0.01}\n', (), "low must be below high"),
        (
            '[params]\n"train.batch_size" = {choices = []}\n',
            (),
            "choices: expected a non-empty list",
        ),
        ('[param]\n"optim.sparse_lr" = {low = 0.01, high = 0.3}\n', (), "unknown key 'param'"),
        ('fixed = ["model.nope=1"]\n' + GOOD, (), "fixed: --set model.nope=1"),
        (GOOD, ("--time-budget", "0"), "--time-budget: must be more than 0"),
        (GOOD, ("--time-budget", "soon"), "--time-budget: 'soon' is not a duration"),
        (GOOD, ("--set", "model.nope=1"), "unknown key 'nope'"),
    ],
)
def test_bad_input_is_one_line_and_no_study(
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    space: str,
    extra: tuple[str, ...],
    expected: str,
) -> None:
    assert main(tune(tmp_path, space, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recstack tune: error: ") and "\n" not in err, err
    assert expected in err, err
    assert not (tmp_path / "run" / "study.db").exists()


def test_a_recipe_without_a_space_needs_one(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    recipe = shutil.copy(RECIPES / "categorical.toml", tmp_path / "mine.toml")
    assert main(tune(tmp_path, None, recipe=Path(recipe))) == 2
    assert (
        f"no search space beside it ({tmp_path / 'tune' / 'mine.toml'} not found)"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.toml")))
def test_every_recipe_has_a_space_the_config_accepts(recipe: str) -> None:
    from recstack.tune.space import check
    from recstack.tune.study import command_line_sets

    space = load_space(space_path(RECIPES / recipe))
    assert len(space.params) >= 4
    check(
        space, RECIPES / recipe, command_line_sets(0, [])[0]
    )  # each bound and choice, on the recipe


def test_choices_of_lists_and_tables_round_trip_through_optuna() -> None:
    tables = Param(
        "model",
        choices=(
            {"embedding_dim": 8, "bottom_mlp": [16, 8]},
            {"embedding_dim": 16, "bottom_mlp": [16, 16]},
        ),
    )
    stored = tables.labels()[1]
    assert isinstance(stored, str) and stored in tables.distribution().choices  # type: ignore[attr-defined]
    assert tables.value(stored) == {"embedding_dim": 16, "bottom_mlp": [16, 16]}
    assert tables.override(stored) == "model={ embedding_dim = 16, bottom_mlp = [16, 16] }"
    # the recipe's value holds a table choice when it has each of its keys at that value
    assert tables.stored({"embedding_dim": 16, "bottom_mlp": [16, 16], "top_mlp": [1]}) == stored
    assert tables.stored({"embedding_dim": 16, "bottom_mlp": [16, 8]}) is None
    lists = Param("model.top_mlp", choices=([256, 1], [400, 400, 1]))
    assert lists.value(lists.stored([400, 400, 1])) == [400, 400, 1]
    flag = Param("model.interaction_itself", choices=(False, True))
    assert flag.stored(0) is None and flag.stored(True) is True  # 0 is not the choice False
    ints = Param("train.batch_size", low=128, high=1024, step=128)
    assert ints.is_int and ints.stored(256) == 256 and ints.stored(2048) is None


def test_trial_config_is_complete_and_loads_as_the_recipe_with_overrides(tmp_path: Path) -> None:
    recipe = RECIPES / "categorical.toml"
    overrides = [
        'data.train="/d/train"',
        "train.early_stopping={patience=5}",
        "model.top_mlp=[400, 400, 1]",
        "model={ embedding_dim = 8, dropout = 0.2 }",
        "optim.sparse_lr=0.123",
    ]
    write_config(recipe, overrides, tmp_path / "c.toml")
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.to_dict() == load_config(recipe, overrides).to_dict()
    assert (
        cfg.train.early_stopping.metric == "auc" and cfg.train.early_stopping.patience == 5
    )  # merged
    values = {
        "model": {"top_mlp": [1], "table_dims": {"C1": 4}},
        "train": {"early_stopping": {"patience": 3}},
    }
    assert tomllib.loads(to_toml(values)) == values


def test_parse_duration() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "20m", "1.5h", "1d")] == [
        90,
        90,
        1200,
        5400,
        86400,
    ]
    for bad in ("", "-5m", "20 minutes", "m"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_check_names_the_key_of_a_choice_the_config_refuses(tmp_path: Path) -> None:
    from recstack.tune.space import check

    (tmp_path / "s.toml").write_text('[params]\n"train.batch_size" = {choices = [256, 0]}\n')
    with pytest.raises(
        ConfigError, match=r"s.toml: params.'train.batch_size': .*must be positive"
    ):
        check(load_space(tmp_path / "s.toml"), RECIPES / "categorical.toml", [])


def test_eval_tail_reads_complete_eval_lines_as_they_are_written(tmp_path: Path) -> None:
    from recstack.tune.trial_run import EvalTail

    path = tmp_path / "metrics.jsonl"
    tail = EvalTail(path)
    assert tail.read() == []  # not written yet
    line = '{"step": 2, "kind": "eval", "time": 1.0, "auc": 0.71}\n'
    path.write_text('{"step": 1, "kind": "train", "time": 0.5, "loss": 0.6}\n' + line[:20])
    assert tail.read() == []  # a train record, and an eval record still being written
    with path.open("a") as f:
        f.write(line[20:] + '{"step": 4, "kind": "eval", "time": 2.0, "auc": null}\n')
    assert tail.read() == [0.71, 0.5] and tail.read() == []
