"""Typed TOML: fill dataclasses from TOML files and ``--set section.key=value`` overrides, checking every key
and type (``Literal[...]`` fields: the value is one of the choices). Errors name the file (or override) and the
key; unknown keys are never silently ignored."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from recstack.errors import ConfigError
from recstack.io import read_text


def _check_type(value: Any, tp: Any, where: str) -> Any:
    """Return ``value`` converted to ``tp`` (int -> float allowed) or raise ConfigError naming ``where``. A
    ``Literal[...]`` field takes one of its choices only (``model.interaction: 'x' is not one of dot, cat, dcn``)."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        # Compared with the type too: True == 1 and 1 == 1.0, but neither is the choice 1.
        if not any(type(value) is type(c) and value == c for c in choices):
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is types.NoneType:
        if value is not None:
            raise ConfigError(f"{where}: expected None, got {type(value).__name__} {value!r}")
        return value
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return [_check_type(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple and typing.get_args(tp)[-1] is Ellipsis:  # tuple[X, ...]: a list in TOML
        item_tp = typing.get_args(tp)[0]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_check_type(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__} {value!r}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        for alt in typing.get_args(tp):
            try:
                return _check_type(value, alt, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} matches none of {tp}")
    return value


def fill(obj: Any, values: dict[str, Any], where: str) -> None:
    """Set the fields of dataclass ``obj`` (nested dataclasses recursively) from ``values``, checking every key
    and type; errors name ``where`` and the key (``config.toml.model.embedding_dim: expected int ...``)."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"{where}: unknown key {key!r} (valid: {', '.join(sorted(names))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}.{key}: expected a table")
            fill(current, value, f"{where}.{key}")
        else:
            setattr(obj, key, _check_type(value, hints[key], f"{where}.{key}"))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"model.embedding_dim=32"`` -> (["model", "embedding_dim"], 32). Values are TOML literals; anything
    that is not one (``train.device=cpu``) is taken as a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    except RecursionError:  # arrays nested thousands deep: tomllib recurses once per level
        raise ConfigError(f"override {key.strip()}: the value is nested too deeply") from None
    return key.strip().split("."), value


def read_toml(path: str | Path, what: str, error: type[Exception]) -> dict[str, Any]:
    """The table of the TOML file at ``path``; a missing file or invalid TOML raises ``error`` naming the file
    (``what``: how the message calls it, e.g. "config file")."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {p} not found")
    text = read_text(p, error)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{p}: invalid TOML: {e}") from e
    except RecursionError:  # nested thousands deep: tomllib recurses once per level
        raise error(f"{p}: invalid TOML: nested too deeply") from None


def load_into(cfg: Any, path: str | Path | None, overrides: list[str] | None) -> Any:
    """Fill the config dataclass ``cfg`` from the TOML file at ``path``, then from each ``section.key=value``
    override in order; returns ``cfg``. An override that reaches into a free-form table (a ``dict`` field such
    as ``data.synth``) sets that one key and keeps the table's others."""
    if path is not None:
        fill(cfg, read_toml(path, "config file", ConfigError), str(path))
    for text in overrides or []:
        keys, value = parse_override(text)
        if not _set_in_table(cfg, keys, value, text):
            nested: dict[str, Any] = {keys[-1]: value}
            for k in reversed(keys[:-1]):
                nested = {k: nested}
            fill(cfg, nested, f"--set {text}")
    return cfg


def _set_in_table(cfg: Any, keys: list[str], value: Any, text: str) -> bool:
    """Apply an override whose path runs through a ``dict`` field; False when it does not."""
    obj = cfg
    for i, k in enumerate(keys[:-1]):
        if not dataclasses.is_dataclass(obj) or not hasattr(obj, k):
            return False
        current = getattr(obj, k)
        if isinstance(current, dict):
            table = current
            for sub in keys[i + 1 : -1]:
                table = table.setdefault(sub, {})
                if not isinstance(table, dict):
                    raise ConfigError(f"--set {text}: {sub!r} is not a table")
            table[keys[-1]] = value
            return True
        obj = current
    return False


# ------------------------------------------------------------------------------------------------ writing
_BARE_KEY = re.compile(r"^[A-Za-z0-9_\-]+$")


def toml_value(v: Any) -> str:
    """``v`` (bool, int, float, str, list, dict) as a TOML literal; a dict is an inline table."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\t", "\\t").replace("\n", "\\n") + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def toml_key(k: str) -> str:
    """A key as TOML writes it: bare when it can be, else quoted."""
    return k if _BARE_KEY.match(k) else toml_value(k)


def to_toml(values: dict[str, Any]) -> str:
    """TOML text of a config-shaped dict that ``tomllib`` reads back equal: top-level tables as ``[section]``
    (a table inside one as an inline table), other top-level values first; empty tables are left out."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in values.items() if not isinstance(v, dict)]
    for section, table in values.items():
        if isinstance(table, dict) and table:
            lines += ["", f"[{toml_key(section)}]"]
            lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines).lstrip("\n") + "\n"
