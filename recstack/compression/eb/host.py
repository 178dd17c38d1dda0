"""Host fast path of the error-bounded codec: the same format as ``eb``'s tensor path, written with numpy.

For CPU tensors with the zstd stage (the default there) every step runs on numpy arrays: numpy's per-call
cost is a fraction of torch's, which matters for messages of 100 KB and less (one Kaggle-sized table of a
2048-sample batch). The arithmetic is the same IEEE float32 arithmetic as the tensor path, so both write
and read the same messages; tests check that each decodes the other's.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from recstack.compression.eb import native
from recstack.compression.eb import packing as pk
from recstack.compression.eb.format import (
    FLAG_DEDUP,
    FLAG_PAIRS,
    FLAG_WIDE,
    FLAG_ZSTD,
    HEADER_SIZE,
    Header,
    message_checksum_np,
)
from recstack.compression.eb.quantize import (
    FLOAT32_MAX,
    MAX_INDEX,
    MAX_LEVELS,
    SAFE_RATIO,
    TIGHTEN,
    is_safe,
    usable_bound,
)

_MULT = np.random.default_rng(0x5EB).integers(1, 2**63, 64, dtype=np.uint64) | np.uint64(1)


_LENGTH = struct.Struct("<I")


def assemble(header: Header, sections: list[bytes]) -> bytearray:
    """Header + length-prefixed sections -> one checksummed message (a writable buffer)."""
    header.sections = len(sections)
    parts = [bytes(HEADER_SIZE)]
    for s in sections:
        parts += (_LENGTH.pack(len(s)), s)
    out = bytearray().join(parts)
    head = header.pack()
    head += struct.pack("<Q", message_checksum_np(head, np.frombuffer(out, np.uint8, offset=HEADER_SIZE)))
    out[:HEADER_SIZE] = head
    return out


def dedup_rows(codes: np.ndarray, row_bits: float) -> tuple[np.ndarray, np.ndarray] | None:
    """``packing.dedup_rows`` in numpy: (distinct rows in order of first occurrence, row tokens [N]) or None
    when the rows saved (``row_bits`` each) would not pay for an index of log2(U) bits per row."""
    n, d = codes.shape
    if n < 2 or d == 0:
        return None
    exact = native.dedup_rows(codes)
    if exact is not None:
        first, tokens, u = exact
        return (codes[first], tokens) if pk.dedup_pays(n, u, row_bits) else None
    rows = codes.view(np.uint8).reshape(n, -1)
    pad = (-rows.shape[1]) % 8
    if pad:
        rows = np.concatenate([rows, np.zeros((n, pad), np.uint8)], axis=1)
    words = np.ascontiguousarray(rows).view(np.uint64)  # [N, W]
    if words.shape[1] <= _MULT.size:  # elementwise beats numpy's integer matmul for these few words
        h = words[:, 0] * _MULT[0]
        for j in range(1, words.shape[1]):
            h += words[:, j] * _MULT[j]
    else:
        h = words.sum(1)
    # Count first with a plain sort (several times faster than an argsort): most gradients stop here.
    hs = np.sort(h)
    if not pk.dedup_pays(n, 1 + int(np.count_nonzero(hs[1:] != hs[:-1])), row_bits):
        return None
    order = np.argsort(h)
    hs = h[order]
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(hs[1:], hs[:-1], out=new[1:])
    same = ~new[1:]  # neighbours in hash order with equal hashes must be equal rows (else: a collision)
    for j in range(words.shape[1]):  # column by column: 1-D gathers are much cheaper than row gathers
        col = words[:, j][order]
        if not np.all((col[1:] == col[:-1]) | ~same):
            return None
    starts = np.flatnonzero(new)
    first = np.minimum.reduceat(order, starts)  # the first row of each group (the sort is not stable)
    gid = np.empty(n, np.int64)
    gid[order] = np.cumsum(new) - 1  # hash group of every row
    # distinct rows in order of first occurrence; token 0 = "the next new row", else 1 + its position
    is_first = np.zeros(n, bool)
    is_first[first] = True
    rank = np.cumsum(is_first)[first] - 1  # group -> position among the distinct rows
    tokens = rank[gid] + 1
    tokens[is_first] = 0
    return codes[np.flatnonzero(is_first)], tokens


@dataclass
class HostBody:
    """A quantized message body in a zstd layout, written on the host."""

    eb_abs: float
    step: float
    qmin: int
    levels: int
    flags: int
    unique: int  # distinct rows sent
    center: int
    sections: list[bytes]  # zstd frames
    layout: str  # bytes | pairs
    codes: np.ndarray  # [N, D] every code (for the reconstruction)


def encode_fused(x: np.ndarray, bound: float, relative: bool, pairs_max_escapes: float
                 ) -> tuple[tuple[float, float, bool], HostBody | None] | None:
    """x [N, D] float32 -> ((lo, hi, all finite), the body of ``encode_composed``, or None where that path
    has to decide), built by one C call and the zstd frames; None without the C loops."""
    front = native.encode_front(x, bound, relative, TIGHTEN, SAFE_RATIO, pairs_max_escapes, pk.MAX_DISTINCT_ROWS)
    if front is None or front[1] is None:
        return None if front is None else (front[0], None)
    f = front[1]
    flags = FLAG_ZSTD | (FLAG_PAIRS if f.pairs else 0)
    sections = [_frame(f.stream)]
    if f.tokens is not None:
        flags |= FLAG_DEDUP
        sections.append(_frame(f.tokens))
    return front[0], HostBody(f.eb_abs, f.step, f.qmin, f.levels, flags, f.unique, f.center, sections,
                              "pairs" if f.pairs else "bytes", f.codes)


def encode_composed(x: np.ndarray, eb_abs: float, lo: float, hi: float, pairs_max_escapes: float
                    ) -> HostBody | None:
    """Finite x [N, D] float32 with range [lo, hi] -> its body at eb_abs, or None when the tensor path has to
    handle it (see ``quantize_safe``)."""
    r = quantize_safe(x, eb_abs, lo, hi)
    if r is None:
        return None
    codes, step, qmin, levels, counts = r
    flags, unique, center, sections, layout = encode_body(codes, qmin, levels, pairs_max_escapes, counts)
    return HostBody(eb_abs, step, qmin, levels, flags, unique, center, sections, layout, codes)


def quantize_safe(x: np.ndarray, eb_abs: float, lo: float, hi: float
                  ) -> tuple[np.ndarray, float, int, int, np.ndarray | None] | None:
    """Finite x whose grid needs no value check (see quantize.SAFE_RATIO) -> (codes, step, qmin, levels, the
    code counts of ``code_profile``'s sample or None above 256 levels), or None when the tensor path has to
    handle it (checks, exact values, constants)."""
    if not usable_bound(eb_abs) or max(abs(lo), abs(hi)) > SAFE_RATIO * eb_abs:
        return None
    step = 2.0 * eb_abs * TIGHTEN
    if step > FLOAT32_MAX:
        return None
    step32 = float(np.float32(step))
    if not (math.isfinite(step32) and is_safe(lo, hi, eb_abs, step32)):
        return None
    inv32, qmin, qmax = native.grid(lo, hi, step32)  # rint(x * inv) is monotone: the extremes bound the codes
    levels = qmax - qmin + 1
    if max(abs(qmin), abs(qmax)) >= MAX_INDEX or levels > MAX_LEVELS or levels < 2:
        return None
    codes, counts = native.quantize(x, inv32, qmin, qmax)
    return codes, step, qmin, levels, counts


def encode_body(codes: np.ndarray, qmin: int, levels: int, pairs_max_escapes: float,
                counts: np.ndarray | None = None) -> tuple[int, int, int, list[bytes], str]:
    """codes [N, D] -> (flags, distinct rows, centre, sections, layout) of the zstd layouts. ``counts``: the
    codes of ``code_profile``'s sample counted already (by ``quantize_safe``)."""
    wide = levels > 256
    flags = FLAG_ZSTD | (FLAG_WIDE if wide else 0)
    center = -qmin if qmin <= 0 < qmin + levels else levels // 2  # the code of 0.0
    if wide:
        bits, escapes = math.log2(levels), 1.0
    elif counts is not None:
        bits, escapes = pk.profile_from_counts(counts, center)
    else:
        bits, escapes = pk.code_profile(codes, levels, center)
    rows = dedup_rows(codes, codes.shape[1] * max(bits, 1.0))
    c, index = rows if rows is not None else (codes, None)
    sections: list[bytes] = []
    layout = "bytes"
    if 1 < levels <= 128 and escapes <= pairs_max_escapes:
        sections.append(_frame(native.pair_stream(c, center)))
        flags |= FLAG_PAIRS
        layout = "pairs"
    else:
        center = 0
        sections.append(_frame(pk.byte_planes(c, wide)))
    if index is not None:
        flags |= FLAG_DEDUP
        sections.append(_frame(pk.byte_planes(index, c.shape[0] + 1 > 256)))
    return flags, c.shape[0], center, sections, layout


def _frame(a: np.ndarray) -> bytes:
    return pk.zstd_contexts()[0].compress(np.ascontiguousarray(a).data)
