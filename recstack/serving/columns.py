"""Request values of the common forms read a column at a time, and one user's fields read once.

A request's rows arrive as Python dicts; what costs is touching each value from Python. The functions here
read every value of a kind through one list and one numpy array (C loops), and return ``None`` as soon as
anything is not of the common form (a wrong type, a value out of range, a malformed hex string): the caller
then takes its value-by-value path, which names the field at fault (``RequestError``) or handles the rarer
form. So nothing accepted here is refused there, and both give the same arrays.

"1 user + N candidates" requests (``ServingModel.encode_candidates``) are read in two parts: the shared fields
once (one row) and the candidates' fields over N rows, then broadcast into the [N, ...] matrices the model
takes. Before, every candidate was merged with the shared fields into a dict of all fields, and all of those
values were read N times (measured in docs/serving.md: 100 candidates of the Criteo reference model).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)
_NUMBER, _INT = {int, float}, {int}  # the exact types of encoded values (a bool is an int subclass: not one)
_DENSE_RAW = {int, type(None)}
_HEX_CHARS = 8  # Criteo categoricals: 1..8 hex digits
_HEX = re.compile(r"[0-9a-fA-F]{1,8}")
_SEP = ord(",")
# byte -> hex digit value; -1 for every other byte (the separator included)
_DIGIT = np.full(256, -1, np.int64)
for _c in "0123456789abcdefABCDEF":
    _DIGIT[ord(_c)] = int(_c, 16)
_FEW = 128  # fewer values are parsed by Python's int() (measured faster there: a lone row's 26)


def hex_values(texts: list[Any]) -> np.ndarray | None:
    """Criteo categoricals (1..8 hex digits; "" or None: missing) -> int64 [n] (missing: 0), or None when any
    value is anything else. Many values are parsed as one byte string: joined by commas (``join`` refuses a
    non-string, ``encode`` a non-ASCII one), each byte's digit looked up in a table and weighted by its place
    in its value, the values summed from a running total (1300 values: 0.19 ms, Python's ``int`` 0.35 ms)."""
    n = len(texts)
    if n < _FEW:
        try:
            return np.array([0 if v is None or v == "" else int(v, 16) if type(v) is str and _HEX.fullmatch(v)
                             else _not_hex() for v in texts], np.int64)
        except ValueError:
            return None
    try:
        joined = ",".join(texts if None not in texts else ["" if v is None else v for v in texts]).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        return None
    b = np.frombuffer(joined, np.uint8)
    sep = b == _SEP
    seps = np.flatnonzero(sep)
    digit = _DIGIT[b]
    if len(seps) != n - 1 or ((digit < 0) & ~sep).any():  # a comma inside a value, or a byte not a digit
        return None
    bounds = np.empty(n + 1, np.int64)  # value i holds bytes bounds[i] + 1 .. bounds[i + 1] - 1
    bounds[0], bounds[1:-1], bounds[-1] = -1, seps, len(b)
    if (np.diff(bounds) > _HEX_CHARS + 1).any():
        return None
    left = bounds[1:][np.cumsum(sep)] - np.arange(len(b)) - 1  # how many digits follow each byte in its value
    weighted = np.where(sep, 0, digit << (4 * np.maximum(left, 0)))
    total = np.zeros(len(b) + 1, np.int64)
    np.cumsum(weighted, out=total[1:])
    return total[bounds[1:]] - total[bounds[:-1] + 1]


def _not_hex() -> int:
    raise ValueError("not 1..8 hex digits")


def criteo_columns(rows: Sequence[dict[str, Any]], dense_names: Sequence[str],
                   sparse_names: Sequence[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """Raw Criteo fields of ``rows`` -> (dense float32 [n, len(dense_names)] = log(1 + max(x, 0)), missing
    0; raw categoricals int64 [n, len(sparse_names)]), or None when any value is not of its form (an integer
    of at most 18 digits or null; 1..8 hex digits, "" or null)."""
    n = len(rows)
    values = [r[name] for r in rows for name in dense_names]
    if not set(map(type, values)) <= _DENSE_RAW:  # exact types: no bool, no float
        return None
    try:
        # null -> NaN, dropped by fmax below. Through float64 as the reference transform (int64 -> float64) does:
        # both round an integer the same way; |x| < 1e18 as a float implies it of the integer.
        raw = np.array(values, np.float64).reshape(n, len(dense_names))
    except OverflowError:
        return None
    if (np.abs(raw) >= 1e18).any():  # NaN (null) compares False
        return None
    dense = np.log1p(np.fmax(raw, 0.0)).astype(np.float32)
    cats = hex_values([r[name] for r in rows for name in sparse_names])
    if cats is None:
        return None
    return dense, cats.reshape(n, len(sparse_names))


def id_columns(rows: Sequence[dict[str, Any]], dense_names: Sequence[str], feature_names: Sequence[str],
               table_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Encoded rows -> (dense float32 [n, len(dense_names)], ids int64 [len(feature_names), n]), or None when
    any value is not of the common form (a number within float32's range; one integer id within its table's
    ``table_rows`` [len(feature_names)])."""
    n = len(rows)
    values = [r[name] for r in rows for name in dense_names]
    if not set(map(type, values)) <= _NUMBER:  # exact types, checked in C: no bool, no str
        return None
    keys = [r[name] for r in rows for name in feature_names]
    if not set(map(type, keys)) <= _INT:
        return None
    try:
        dense = np.array(values, np.float64).reshape(n, len(dense_names))  # [B, d]
        ids = np.array(keys, np.int64).reshape(n, len(feature_names)).T  # [F, B]
    except OverflowError:  # an integer past int64 / float64
        return None
    if not (np.abs(dense) <= _F32_MAX).all():  # NaN fails this too
        return None
    if ((ids < 0) | (ids >= table_rows[:, None])).any():
        return None
    return dense.astype(np.float32), ids


def split_fields(shared: dict[str, Any], candidates: list[Any], fields: frozenset[str]) -> list[str] | None:
    """The fields the candidates carry, when ``shared`` and every candidate (each a dict with the same keys)
    hold ``fields`` between them, none in both; else None (the row-by-row path names what is wrong)."""
    first = candidates[0]
    if type(first) is not dict:
        return None
    own = first.keys()
    if shared.keys() & own or shared.keys() | own != fields:
        return None
    if not all(type(c) is dict and c.keys() == own for c in candidates):
        return None
    return list(own)


def broadcast_columns(names: Sequence[str], shared: np.ndarray, shared_names: Sequence[str],
                      own: np.ndarray, own_names: Sequence[str], n: int, axis: int) -> np.ndarray:
    """Columns of ``shared`` (one row) and ``own`` (n rows) into one [n, len(names)] (axis 1) or
    [len(names), n] (axis 0) array in the order of ``names``: the shared values repeated n times."""
    at = {name: i for i, name in enumerate(names)}
    shape = (n, len(names)) if axis == 1 else (len(names), n)
    out = np.empty(shape, own.dtype)
    if axis == 1:
        out[:, [at[k] for k in shared_names]] = shared
        out[:, [at[k] for k in own_names]] = own
    else:
        out[[at[k] for k in shared_names]] = shared
        out[[at[k] for k in own_names]] = own
    return out
