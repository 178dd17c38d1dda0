"""The search space of ``recstack tune``: which config keys a study samples, and over what.

A space is a TOML file: the recipe's own is ``tune/<recipe name>`` beside it
(``configs/recipes/tune/categorical.toml`` for ``configs/recipes/categorical.toml``);
``recstack tune --space FILE`` replaces it::

    # --set overrides every trial takes, after the recipe and before the command line's --set
    fixed = ['train.early_stopping={metric="auc", patience=3}']

    [params]  # config key -> a range or choices
    "optim.sparse_lr" = {low = 0.01, high = 0.3, log = true}   # floats, log scale
    "train.batch_size" = {low = 128, high = 1024, step = 128}  # integers when low and high are
    "model.top_mlp" = {choices = [[256, 128, 1], [400, 400, 400, 1]]}  # any TOML values
    # a section's key with tables as choices sets several keys together (the dot interaction
    # needs the bottom MLP to end in the embedding dim)
    "model" = {choices = [{embedding_dim = 8, bottom_mlp = [64, 8]},
                          {embedding_dim = 16, bottom_mlp = [64, 16]}]}

Every key and value is checked against the typed config before the first trial (``check``): a key
the config does not have, or a bound or choice it would refuse, is a ConfigError naming the file
and the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recstack.config import load_config
from recstack.errors import ConfigError
from recstack.typed_toml import read_toml, toml_value

if TYPE_CHECKING:  # optuna: imported by the study, not when a space is only read and checked
    import optuna

SPACE_DIR = "tune"  # a recipe's space: <recipe dir>/tune/<recipe file name>
_RANGE_FIELDS = {"low", "high", "log", "step"}


@dataclass(frozen=True)
class Param:
    """One searched config key: ``choices`` (any TOML values), or a range [``low``, ``high``] of
    floats (of integers when both bounds are) on a ``log`` scale or in ``step``s."""

    key: str
    choices: tuple[Any, ...] = ()
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None

    @property
    def is_int(self) -> bool:
        return not self.choices and isinstance(self.low, int) and isinstance(self.high, int)

    def labels(self) -> list[bool | int | float | str]:
        """The choices as optuna stores them: scalars as they are, lists and tables as their TOML
        text."""
        return [
            c if isinstance(c, bool | int | float | str) else toml_value(c) for c in self.choices
        ]

    def distribution(self) -> optuna.distributions.BaseDistribution:
        from optuna.distributions import (
            CategoricalDistribution,
            FloatDistribution,
            IntDistribution,
        )

        if self.choices:
            return CategoricalDistribution(self.labels())
        if self.is_int:
            return IntDistribution(
                int(self.low), int(self.high), log=self.log, step=int(self.step or 1)
            )
        return FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def value(self, stored: Any) -> Any:
        """The config value of what optuna stored for this key (a choice's label back to the
        choice)."""
        if self.choices:
            return self.choices[self.labels().index(stored)]
        return stored

    def stored(self, value: Any) -> Any | None:
        """What optuna stores for the config value ``value``; None when the space does not hold
        it."""
        if self.choices:
            found = [i for i, c in enumerate(self.choices) if _holds(value, c)]
            return self.labels()[found[0]] if found else None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not self.low <= value <= self.high
        ):
            return None
        return int(value) if self.is_int else float(value)

    def override(self, stored: Any) -> str:
        """The ``--set`` a trial takes for what optuna stored."""
        return f"{self.key}={toml_value(self.value(stored))}"

    def extremes(self) -> list[Any]:
        """The values checked against the config before any trial: both bounds, or every choice."""
        return list(self.choices) if self.choices else [self.low, self.high]

    def to_dict(self) -> dict[str, Any]:
        if self.choices:
            return {"choices": list(self.choices)}
        return {"low": self.low, "high": self.high, "log": self.log, "step": self.step}


@dataclass(frozen=True)
class SearchSpace:
    """The searched keys (``params``, in file order), the overrides every trial takes (``fixed``)
    and the file they come from (``source``, for messages)."""

    params: tuple[Param, ...]
    fixed: tuple[str, ...]
    source: str

    def to_dict(self) -> dict[str, Any]:
        """What a resumed study must find unchanged."""
        return {"fixed": list(self.fixed), "params": {p.key: p.to_dict() for p in self.params}}

    def without(self, keys: set[str]) -> SearchSpace:
        """The space less ``keys`` (those the command line's --set pins)."""
        return SearchSpace(
            tuple(p for p in self.params if p.key not in keys), self.fixed, self.source
        )


def _holds(value: Any, choice: Any) -> bool:
    """Whether the config value ``value`` is ``choice``: equal and of the same type, or for a table
    choice (several keys of a section at once), a table holding each of its keys at its value."""
    if isinstance(choice, dict):
        return isinstance(value, dict) and all(_holds(value.get(k), v) for k, v in choice.items())
    return type(value) is type(choice) and value == choice


def space_path(recipe: str | Path) -> Path:
    """Where the search space of the recipe at ``recipe`` lives."""
    recipe = Path(recipe)
    return recipe.parent / SPACE_DIR / recipe.name


def load_space(path: str | Path) -> SearchSpace:
    """Read a space file; every mistake of form is a ConfigError naming the file and the key."""
    where = str(path)
    table = read_toml(path, "search space", ConfigError)
    unknown = sorted(set(table) - {"fixed", "params"})
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (valid: fixed, params)")
    fixed = table.get("fixed", [])
    if not isinstance(fixed, list) or not all(isinstance(f, str) and "=" in f for f in fixed):
        raise ConfigError(f'{where}: fixed: expected a list of "section.key=value" strings')
    params = table.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(
            f"{where}: params: expected a table of config key -> {{low, high}} or {{choices}}"
        )
    return SearchSpace(
        tuple(_param(key, spec, f"{where}: params.{key!r}") for key, spec in params.items()),
        tuple(fixed),
        where,
    )


def _param(key: str, spec: Any, where: str) -> Param:
    if isinstance(spec, dict) and any(isinstance(v, dict) for v in spec.values()):
        raise ConfigError(
            f'{where}: a table of tables; quote the dotted config key ("{key}.KEY" = {{...}})'
        )
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"{where}: expected {{low = ..., high = ...}} or {{choices = [...]}}")
    if "choices" in spec:
        extra = sorted(set(spec) - {"choices"})
        if extra:
            raise ConfigError(f"{where}: {extra[0]!r} does not go with choices")
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}: choices: expected a non-empty list")
        return Param(key, choices=tuple(choices))
    unknown = sorted(set(spec) - _RANGE_FIELDS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown field {unknown[0]!r} (valid: low, high, log, step; or choices)"
        )
    low, high = spec.get("low"), spec.get("high")
    for name, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ConfigError(f"{where}: {name}: expected a finite number, got {v!r}")
    assert isinstance(low, int | float) and isinstance(high, int | float)
    if not low < high:
        raise ConfigError(f"{where}: low must be below high, got {low} and {high}")
    log, step = spec.get("log", False), spec.get("step")
    if not isinstance(log, bool):
        raise ConfigError(f"{where}: log: expected true or false, got {log!r}")
    if log and low <= 0:
        raise ConfigError(f"{where}: log = true needs low > 0, got {low}")
    if step is not None and (
        isinstance(step, bool) or not isinstance(step, int | float) or step <= 0 or log
    ):
        raise ConfigError(f"{where}: step: expected a number > 0 (and no log scale), got {step!r}")
    return Param(key, low=low, high=high, log=log, step=step)


def check(space: SearchSpace, recipe: str | Path, sets: list[str]) -> None:
    """Every fixed override, and every key at each of its bounds or choices, on top of the recipe
    and the command line's ``sets``, must make a config the typed config accepts; else a
    ConfigError naming the space's file and the key. An empty space is an error too."""
    if not space.params:
        raise ConfigError(
            f"{space.source}: the search space is empty: no key of [params] is left to search "
            "(a key the command line's --set gives is not searched)"
        )
    try:
        load_config(recipe, [*space.fixed, *sets])
    except ConfigError as e:
        raise ConfigError(f"{space.source}: fixed: {e}") from e
    for p in space.params:
        for v in p.extremes():
            try:
                load_config(recipe, [*space.fixed, *sets, f"{p.key}={toml_value(v)}"])
            except ConfigError as e:
                raise ConfigError(f"{space.source}: params.{p.key!r}: {e}") from e
