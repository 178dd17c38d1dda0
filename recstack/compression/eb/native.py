"""The C loops of the host path (``_ebkernels.c``, bound by ``_ebhost.c``), with the numpy code they replace
as the fallback.

Every function here returns what its numpy twin returns (tests compare them on random inputs), so a
machine without the compiled module writes and reads the same messages, only slower (the C entropy
estimate inside ``encode_front`` may differ from numpy's in the last bits, which could only move a layout
decision that sits exactly on its threshold). Two calls do a whole message's work where they can:
``encode_front`` (its twin is ``host.encode_composed``, the C loops one by one) and ``decode_rows``.
``RECSTACK_NO_NATIVE=1`` switches the C loops off, for comparisons. Inputs are checked by the callers:
arrays of the stated dtypes, codes within 256 levels.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

try:
    from recstack.compression.eb import _ebhost as _c  # type: ignore[attr-defined]  # a C extension, no stub
except ImportError:  # built without a compiler: the numpy loops below
    _c = None
if os.environ.get("RECSTACK_NO_NATIVE") == "1":
    _c = None

PROFILE_SAMPLE = 4096  # codes the entropy profile looks at (packing.code_profile)
NATIVE_MAX_INDEX = 1 << 21  # the C rounding is exact while |x / step| < 2**22


def available() -> bool:
    return _c is not None


def finite_range(x: np.ndarray) -> tuple[float, float, bool] | None:
    """float32 array -> ``quantize.finite_range`` of it; None without the C loops."""
    if _c is None:
        return None
    return _c.minmax(np.ascontiguousarray(x))


def grid(lo: float, hi: float, step32: float) -> tuple[np.float32, int, int]:
    """A normal float32 step -> (inv32 = 1 / step32, rint(float32(lo) * inv32), rint(float32(hi) * inv32)),
    each rounded to float32 as numpy scalars round."""
    if _c is None:
        inv32 = np.float32(1.0) / np.float32(step32)
        return inv32, int(np.rint(np.float32(lo) * inv32)), int(np.rint(np.float32(hi) * inv32))
    inv, qmin, qmax = _c.grid(lo, hi, step32)
    return np.float32(inv), int(qmin), int(qmax)


def quantize(x: np.ndarray, inv32: np.float32, qmin: int, qmax: int) -> tuple[np.ndarray, np.ndarray | None]:
    """x [N, D] float32 on the grid [qmin, qmax] -> (codes [N, D] = rint(x * inv) - qmin, uint8 up to 256
    levels and int32 above; counts [256] int64 of the even sample of codes that ``packing.code_profile``
    takes, None above 256 levels). numpy only: with the C loops, ``encode_front`` quantizes every grid of
    up to 256 levels in C (``eb_quantize``), so only wide grids and machines without them come here."""
    q = np.multiply(x, inv32)
    np.rint(q, out=q)
    q -= np.float32(qmin)
    if qmax - qmin >= 256:
        return q.astype(np.int32), None
    codes = q.astype(np.uint8)
    return codes, np.bincount(codes.reshape(-1)[:: max(1, x.size // PROFILE_SAMPLE)], minlength=256)


class Front(NamedTuple):
    """What ``encode_front`` built: the grid, every code [N, D] uint8, the layout's bytes of the distinct rows
    (``stream``: nibble pairs then escapes when ``pairs``, else one byte per code) and the row tokens' byte
    planes (None when deduplication does not pay)."""

    eb_abs: float
    step: float
    qmin: int
    levels: int
    center: int
    unique: int
    codes: np.ndarray
    stream: np.ndarray
    tokens: np.ndarray | None
    pairs: bool


def encode_front(x: np.ndarray, bound: float, relative: bool, tighten: float, safe_ratio: float,
                 pairs_max_escapes: float, max_distinct: int) -> tuple[tuple[float, float, bool], Front | None] | None:
    """``host.encode_composed`` for x [N, D] float32 (N, D >= 1) in one C call -> ((lo, hi, all finite), Front,
    or None where the composed path has to decide: values not all finite, a grid that is not safe, more than
    256 levels). None without the C loops. The constants are the callers' (quantize, packing)."""
    if _c is None:
        return None
    n, d = x.shape
    codes = np.empty((n, d), np.uint8)
    stream = np.empty(n * d + (n * d + 1) // 2, np.uint8)
    tokens = np.empty(2 * n, np.uint8)
    r = _c.encode_front(x, n, d, bound, relative, tighten, safe_ratio, NATIVE_MAX_INDEX, PROFILE_SAMPLE,
                        pairs_max_escapes, max_distinct, codes, stream, tokens)
    if len(r) == 3:
        return r, None
    lo, hi, finite, eb_abs, step, qmin, levels, center, u, stream_len, tokens_len, pairs = r
    return (lo, hi, finite), Front(eb_abs, step, qmin, levels, center, u, codes, stream[:stream_len],
                                   tokens[:tokens_len] if tokens_len else None, pairs)


def pair_stream(codes: np.ndarray, center: int) -> np.ndarray:
    """``packing.pair_encode`` as one stream: the packed nibbles [ceil(n / 2)], then the escaped codes."""
    if _c is None:
        from recstack.compression.eb.packing import pair_encode as numpy_pair_encode

        return np.concatenate(numpy_pair_encode(codes, center))
    flat = np.ascontiguousarray(codes).reshape(-1)
    half = (flat.size + 1) // 2
    out = np.empty(half + flat.size, np.uint8)
    e = _c.pair_pack(flat, int(center), out[:half], out[half:])
    return out[: half + e]


def decode_rows(stream: np.ndarray, tokens: np.ndarray | None, n: int, d: int, u: int, layout: str, center: int,
                qmin: int, step32: np.float32, levels: int) -> np.ndarray:
    """The zstd layouts after zstd -> values [N, D] float32: ``stream`` holds the codes of the U distinct rows
    (layout ``pairs``: nibble pairs then escaped codes; ``bytes``: a byte per code; ``wide``: low then high
    byte planes), ``tokens`` the row tokens' byte planes (None: no deduplication, U = N). EbFormatError for
    escapes that do not match, a code outside the levels, a short stream or tokens that do not describe U
    rows."""
    m = u * d
    if _c is not None and layout != "wide":  # one C call
        out = np.empty((n, d), np.float32)
        status = _c.decode_rows(stream, _EMPTY if tokens is None else tokens, n, d, u, layout == "pairs", center,
                                qmin, float(step32), levels, out)
        if status:
            _check(status, stream.size - (m + 1) // 2, levels=u if status == -4 else levels, n=m, size=stream.size)
        return out
    if layout == "pairs":
        half = (m + 1) // 2
        if stream.size < half:
            _check(-3, 0, n=m, size=stream.size)
        values = pair_dequantize(stream[:half], stream[half:], m, center, qmin, step32, levels)
    else:
        from recstack.compression.eb.packing import from_planes

        values = dequantize(from_planes(stream, m, layout == "wide"), qmin, step32, levels)
    values = values.reshape(u, d)
    return values if tokens is None else expand_rows(values, tokens, n, u + 1 > 256)


def pair_dequantize(packed: np.ndarray, escaped: np.ndarray, n: int, center: int, qmin: int, step32: np.float32,
                    levels: int) -> np.ndarray:
    """Nibble pairs + escaped codes -> float32 values [n] ((code + qmin) * step), in numpy; EbFormatError for
    an escape count that does not match or a code outside the levels."""
    from recstack.compression.eb.packing import pair_decode

    return dequantize(pair_decode(packed, escaped, n, center), qmin, step32, levels)


def dequantize(codes: np.ndarray, qmin: int, step32: np.float32, levels: int) -> np.ndarray:
    """Codes [n] (uint8, or int32 above 256 levels) -> float32 values [n] ((code + qmin) * step, in float32),
    in numpy; EbFormatError for a code outside the levels."""
    if codes.size and int(codes.max()) >= levels:
        _check(-2, 0, levels)
    values = codes.astype(np.float32)
    if qmin:
        values += np.float32(qmin)
    values *= step32
    return values


def dedup_rows(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
    """codes [N, D] (C-contiguous) -> (first [U] row of each distinct row in order of first occurrence, row
    tokens [N] as ``packing.dedup_rows`` defines them, U), exact (rows are compared, not only hashed); None
    without the C loops (``host.dedup_rows`` then hashes and sorts in numpy)."""
    if _c is None:
        return None
    n = codes.shape[0]
    first = np.empty(n, np.int64)
    tokens = np.empty(n, np.int64)
    u = _c.dedup(np.ascontiguousarray(codes), n, codes.nbytes // max(n, 1), first, tokens)
    return first[:u], tokens, u


def expand_rows(values: np.ndarray, raw_tokens: np.ndarray, n: int, wide: bool) -> np.ndarray:
    """Distinct rows [U, D] float32 + row tokens as byte planes (``packing.byte_planes``) -> rows [N, D];
    EbFormatError unless the tokens introduce exactly U rows and only repeat rows introduced before."""
    from recstack.compression.eb import packing as pk
    u, d = values.shape
    if _c is None:
        return values[pk.rows_from_tokens_np(pk.from_planes(raw_tokens, n, wide), u)]
    out = np.empty((n, d), np.float32)
    if _c.expand(np.ascontiguousarray(values), d, raw_tokens, n, u, int(wide), out):
        _check(-4, 0, levels=u)
    return out


_POS = np.zeros(0, np.uint64)
_EMPTY = np.zeros(0, np.uint8)


def word_sums(body: np.ndarray) -> tuple[int, int]:
    """uint8 [n] -> (sum of its whole little-endian uint32 words, sum of word * position from 1), mod 2**64."""
    global _POS
    if _c is not None:
        return _c.word_sums(body)
    n4 = body.size - body.size % 4
    words = (body[:n4] if body.ctypes.data % 4 == 0 else body[:n4].copy()).view(np.uint32).astype(np.uint64)
    if words.size > _POS.size:
        _POS = np.arange(1, max(words.size, 1 << 16) * 2 + 1, dtype=np.uint64)
    s1 = int(words.sum(dtype=np.uint64)) if words.size else 0
    s2 = int(np.dot(words, _POS[: words.size])) if words.size else 0  # uint64 arithmetic wraps like int64
    return s1, s2


def _check(status: int, escapes: int, levels: int = 0, n: int = 0, size: int = 0) -> None:
    if not status:
        return
    from recstack.compression.eb.format import EbFormatError  # here: format imports this module

    if status == -1:
        raise EbFormatError(f"eb: the escape symbols do not match the {escapes} escaped codes")
    if status == -2:
        raise EbFormatError(f"eb: a code is outside the {levels} levels")
    if status == -4:
        raise EbFormatError(f"eb: row tokens do not describe {levels} distinct rows")
    if status == -3:
        raise EbFormatError(f"eb: {size} packed bytes cannot hold {n} codes")
