"""Column conversions shared by the encoder and ``recstack data inspect``: numbers, timestamps, bags of
sparse values, and a stable vectorised string hash.

Every function takes a pyarrow array of one chunk and returns numpy arrays plus a per-row "bad" mask, so the
caller can name the first bad row and column (or skip the rows) instead of failing on the whole chunk.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_PRIME = np.uint64(0x100000001B3)


def _splitmix(h: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: every input bit affects every output bit. uint64 [n] -> uint64 [n]."""
    h = h ^ (h >> np.uint64(30))
    h *= _MIX1
    h ^= h >> np.uint64(27)
    h *= _MIX2
    return h ^ (h >> np.uint64(31))


def as_text(values: pa.Array) -> pa.Array:
    """Any primitive array as strings (12 -> "12", 1.0 -> "1"), the canonical key for vocab and hashing,
    so a Parquet int64 column and a CSV text column of the same ids encode alike."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return values
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
        return values.cast(pa.large_string())
    return pc.cast(values, pa.string())


def hash_strings(values: pa.Array, seed: int = 0) -> np.ndarray:
    """Stable 64-bit hash of each string (the same on every machine and run). -> uint64 [n]; nulls hash
    like the empty string."""
    arr = as_text(values)
    if not pa.types.is_large_string(arr.type):
        arr = arr.cast(pa.large_string())
    n = len(arr)
    if n == 0:
        return np.zeros(0, np.uint64)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], np.int64)[arr.offset : arr.offset + n + 1]
    lengths = np.diff(offsets)
    if bufs[2] is None or offsets[-1] == offsets[0]:
        data = np.zeros(0, np.uint64)
    else:
        data = np.frombuffer(bufs[2], np.uint8)[offsets[0] : offsets[-1]].astype(np.uint64)
    # Polynomial hash sum((byte + 1) * P^(bytes after it)) mod 2^64 per string (uint64 arithmetic wraps),
    # then the splitmix finaliser over (that sum, length, seed).
    longest = int(lengths.max()) if n else 0
    powers = np.ones(max(longest, 1), np.uint64)
    if longest > 1:
        powers[1:] = _PRIME
        powers = np.cumprod(powers, dtype=np.uint64)
    h = np.zeros(n, np.uint64)
    if len(data):
        ends = np.repeat(offsets[1:] - offsets[0], lengths)  # end of each byte's string
        after = ends - 1 - np.arange(len(data))
        terms = (data + np.uint64(1)) * powers[after]
        nonempty = lengths > 0
        starts = (offsets[:-1] - offsets[0])[nonempty]
        h[nonempty] = np.add.reduceat(terms, starts)
    h ^= _splitmix(lengths.astype(np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64))
    return _splitmix(h)


def uniform_hash(a: np.ndarray, b: np.ndarray | int, seed: int) -> np.ndarray:
    """Deterministic uniform numbers in [0, 1) from two integer keys. -> float64 [n]."""
    h = _splitmix(np.asarray(a, np.int64).view(np.uint64) * _PRIME + np.uint64(seed % 2**63))
    h = _splitmix(h ^ np.asarray(b, np.int64).astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t)


def to_numbers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """-> (float64 [n] with NaN where missing, bad bool [n] where a value is not a number)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    if is_numeric(arr.type):
        return pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False), np.zeros(n, bool)
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        return np.full(n, np.nan), np.ones(n, bool)
    try:
        return pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False), np.zeros(n, bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    vals, bad = np.full(n, np.nan), np.zeros(n, bool)
    for i, s in enumerate(arr.to_pylist()):  # slow path, only for chunks that hold a bad value
        if s is None or not s.strip():
            continue
        try:
            vals[i] = float(s)
        except ValueError:
            bad[i] = True
    return vals, bad


_UNIT_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
# Text that ends in a zone designator: Z, +HH, +HHMM or +HH:MM after a time of day.
_ZONED = r"[T ]\d{2}(:?\d{2}(:?\d{2}([.,]\d+)?)?)?\s*(Z|z|[+-]\d{2}(:?\d{2})?)$"
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_SECOND = dt.timedelta(seconds=1)


def _floor_seconds(arr: pa.Array) -> np.ndarray:
    """A timestamp or date array -> int64 [n] whole seconds since the epoch (UTC), rounded down; nulls 0.

    The values are taken as integers in the column's own unit (UTC for zoned timestamps) and floor-divided,
    so sub-second precision (pandas' nanoseconds) is dropped instead of failing a strict cast."""
    t = arr.type
    if pa.types.is_date32(t):
        days = pc.fill_null(pc.cast(arr, pa.int32()), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        return days * 86400
    if pa.types.is_date64(t):
        ms = pc.fill_null(pc.cast(arr, pa.int64()), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        return ms // 1000
    raw = pc.fill_null(pc.cast(arr, pa.int64()), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return raw // _UNIT_PER_SECOND[t.unit]


def _text_seconds(arr: pa.Array) -> np.ndarray | None:
    """Vectorised text -> int64 seconds, or None when some value needs the one-at-a-time path.

    Integer text is seconds; decimal text is seconds rounded down (like float seconds in Parquet); ISO 8601
    date/times may have fractional seconds (rounded down) and a zone (Z, +HH:MM; converted to UTC), and
    are UTC without one."""
    try:
        return pc.fill_null(pc.cast(arr, pa.int64()), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    try:
        vals = pc.fill_null(pc.cast(arr, pa.float64()), 0.0).to_numpy(zero_copy_only=False)
        if (np.abs(vals) < 2.0**63).all():  # finite and within int64
            return np.floor(vals).astype(np.int64)
        return None
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    zoned = pc.fill_null(pc.match_substring_regex(arr, _ZONED), False).to_numpy(zero_copy_only=False)
    out = np.zeros(len(arr), np.int64)
    for mask, tz in ((~zoned, None), (zoned, "UTC")):
        if not mask.any():
            continue
        part = arr.filter(pa.array(mask))
        for unit in ("ns", "us", "s"):  # ns holds any fraction but only the years 1678..2261
            try:
                out[mask] = _floor_seconds(pc.cast(part, pa.timestamp(unit, tz=tz)))
                break
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue
        else:
            return None
    return out


def text_to_seconds(s: str) -> int:
    """One text timestamp -> whole seconds since the epoch (UTC), rounded down; ValueError if it is none.

    Integer or decimal seconds, or an ISO 8601 date/time (fractional seconds, a zone such as Z or +02:00;
    UTC when it has none)."""
    s = s.strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        v = float(s)
    except ValueError:
        pass
    else:
        if not math.isfinite(v):
            raise ValueError(f"{s!r} is not a finite number of seconds")
        return math.floor(v)
    t = dt.datetime.fromisoformat(s)
    t = t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t.astimezone(dt.UTC)
    return (t - _EPOCH) // _SECOND


def to_seconds(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Timestamps -> (int64 whole seconds since the epoch [n], rounded down; bad [n]). Timestamp and date
    columns keep their instant whatever their unit; numbers are seconds already; text is integer or decimal
    seconds or an ISO 8601 date/time (see :func:`text_to_seconds`). Missing values are bad (a row needs its
    time)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n, t = len(arr), arr.type
    missing = arr.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return _floor_seconds(arr), missing
    if is_numeric(t):
        vals = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
        bad = missing | ~(np.abs(vals) < 2.0**63)  # NaN, infinite or beyond int64
        return np.where(bad, 0, np.floor(np.where(bad, 0, vals))).astype(np.int64), bad
    fast = _text_seconds(arr)
    if fast is not None:
        return np.where(missing, 0, fast), missing
    out, bad = np.zeros(n, np.int64), missing.copy()
    for i, s in enumerate(arr.to_pylist()):  # mixed or bad values: one at a time
        if s is None:
            continue
        try:
            out[i] = text_to_seconds(s)
        except (TypeError, ValueError, OverflowError):
            bad[i] = True
    return out, bad


@dataclass
class Bag:
    """The values of one sparse column in a chunk, flattened: row r holds values[offsets[r]:offsets[r+1]].

    lengths int64 [n]; values: pyarrow array [sum(lengths)] (original type); weights float32 [sum] or None.
    ``too_many`` bool [n]: rows with more than one value in a single-valued column.
    """

    lengths: np.ndarray
    values: pa.Array
    weights: np.ndarray | None
    too_many: np.ndarray

    @property
    def rows(self) -> np.ndarray:
        """Row of each value, int64 [sum(lengths)]."""
        return np.repeat(np.arange(len(self.lengths)), self.lengths)


def to_bag(arr: pa.Array, multi_hot: bool, separator: str, weights: np.ndarray | None = None) -> Bag:
    """A sparse column (scalar, text with separators, or list) as a Bag. Nulls and empty strings are dropped
    from bags, so a missing value is an empty bag. ``weights``: float32, one per value of the flattened
    (split) column before anything is dropped."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    is_text = pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
    if multi_hot and is_text:
        arr = pc.split_pattern(arr, separator)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        flat, parents = pc.list_flatten(arr), pc.list_parent_indices(arr)
    else:
        flat, parents = arr, pa.array(np.arange(n))
    w = weights
    valid = pc.is_valid(flat)
    if pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type):
        valid = pc.and_kleene(valid, pc.greater(pc.utf8_length(flat), 0))  # null AND x: False, not null
    valid_np = valid.to_numpy(zero_copy_only=False)
    rows = parents.to_numpy(zero_copy_only=False).astype(np.int64)
    if not valid_np.all():
        flat, rows = flat.filter(valid), rows[valid_np]
        if w is not None:
            w = w[valid_np]
    lengths = np.bincount(rows, minlength=n).astype(np.int64)
    too_many = lengths > 1 if not multi_hot else np.zeros(n, bool)
    return Bag(lengths, flat, w, too_many)


def truncate(bag: Bag, max_length: int) -> Bag:
    """Keep the first ``max_length`` values of every bag."""
    if max_length <= 0 or not len(bag.lengths) or bag.lengths.max() <= max_length:
        return bag
    starts = np.cumsum(bag.lengths) - bag.lengths
    rank = np.arange(len(bag.values)) - np.repeat(starts, bag.lengths)
    keep = rank < max_length
    w = bag.weights[keep] if bag.weights is not None else None
    return Bag(np.minimum(bag.lengths, max_length), bag.values.filter(pa.array(keep)), w, bag.too_many)


def fmt_value(v: object) -> str:
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return str(int(v))
    return str(v)
