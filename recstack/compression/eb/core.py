"""Error-bounded lossy compression of a float matrix [N, D]: ``encode`` -> self-describing uint8 message,
``decode`` -> float32 [N, D] with |decoded - x| <= eb_abs for every finite value and NaN/Inf exact.

Stages (chosen from the payload analysis in docs/compression.md): quantization on a zero-centred grid
(``quantize``), removal of duplicate code rows (small tables send a handful of distinct rows per batch),
then a lossless stage: zstd over a byte layout on the host, or bit packing on any device. A message that
would not be smaller than the values themselves is sent as a lossless copy instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from recstack.compression.base import view_bytes_as
from recstack.compression.config import LOSSLESS
from recstack.compression.eb import host, native
from recstack.compression.eb import packing as pk
from recstack.compression.eb.format import (
    DTYPE_CODES,
    FLAG_DEDUP,
    FLAG_EXCEPTIONS,
    FLAG_PAIRS,
    FLAG_REL,
    FLAG_WIDE,
    FLAG_ZSTD,
    HEADER_SIZE,
    QUANTIZED,
    RAW,
    EbFormatError,
    Header,
    assemble,
    parse,
)
from recstack.compression.eb.quantize import (
    MAX_INDEX,
    MAX_LEVELS,
    Grid,
    absolute_bound,
    dequantize,
    finite_range,
    quantize,
)

FLOAT32_MAX = float(np.finfo(np.float32).max)
PAIRS_MAX_ESCAPES = 0.02  # the paired layout is used when at most this share of codes needs an escape


@dataclass
class EncodeInfo:
    """What one ``encode`` did (for statistics and error feedback)."""

    nbytes: int  # message size
    raw_bytes: int  # the values as float32
    eb_abs: float  # guaranteed absolute error (0: lossless copy)
    layout: str  # raw | bytes | pairs | bitpack
    levels: int
    unique_rows: int
    exceptions: int
    recon: torch.Tensor | None = None  # [N, D] float32 what decode will return (when asked for)


def _as_matrix(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    if x.dim() != 2:
        raise ValueError(f"eb: expected a matrix [N, D], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPE_CODES:
        raise ValueError(f"eb: expected float32, float16 or bfloat16 values, got {x.dtype}")
    if x.numel() >= 1 << 31:
        raise ValueError(f"eb: {x.numel()} values exceed the 2**31 a message can hold")
    if x.dtype == torch.float32 and x.is_contiguous() and not x.requires_grad:
        return x, DTYPE_CODES[x.dtype]  # detach() alone costs a microsecond or two per message
    return x.detach().to(torch.float32).contiguous(), DTYPE_CODES[x.dtype]


def encode(x: torch.Tensor, bound: float, relative: bool = True, lossless: str = "auto") -> torch.Tensor:
    """x [N, D] -> uint8 message [bytes] on x's device. ``bound``: relative to the finite value range of x
    (eb_abs = bound * (max - min)) or absolute. ``lossless``: auto (zstd for CPU tensors, bit packing on
    accelerators, where it stays on the device), zstd or bitpack."""
    return encode_with_info(x, bound, relative, lossless)[0]


def encode_with_info(x: torch.Tensor, bound: float, relative: bool = True, lossless: str = "auto",
                     want_recon: bool = False) -> tuple[torch.Tensor, EncodeInfo]:
    """As ``encode``, also -> EncodeInfo (with the decoded values when ``want_recon``)."""
    if lossless not in LOSSLESS:
        raise ValueError(f"eb: lossless stage {lossless!r} is not one of {', '.join(LOSSLESS)}")
    if not (bound >= 0 and math.isfinite(bound)):
        raise ValueError(f"eb: the error bound must be finite and >= 0, got {bound}")
    x32, dtype_code = _as_matrix(x)
    n, d = x32.shape
    raw_bytes = n * d * 4
    flags = FLAG_REL if relative else 0
    host_x = x32.numpy() if x32.numel() and x32.is_cpu and lossless != "bitpack" else None
    # The host path: one C call where it can (encode_fused), else numpy and the C loops one by one.
    front = host.encode_fused(host_x, bound, relative, PAIRS_MAX_ESCAPES) if host_x is not None else None
    body = front[1] if front is not None else None
    lo, hi, all_finite = front[0] if front is not None else finite_range(x32)
    eb_abs = absolute_bound(bound, relative, lo, hi)
    if body is None and host_x is not None and all_finite:
        body = host.encode_composed(host_x, eb_abs, lo, hi, PAIRS_MAX_ESCAPES)
    if body is not None:
        done = _host_message(body, n, d, bound, dtype_code, flags, want_recon)
        if done is not None:
            return done
    qz = quantize(x32, eb_abs, lo, hi, all_finite, want_recon) if x32.numel() else None
    if qz is not None:
        use_zstd = lossless == "zstd" or (lossless == "auto" and x32.device.type == "cpu")
        header, sections, layout = _quantized_body(qz, n, d, use_zstd)
        header.dtype_code, header.flags, header.bound = dtype_code, header.flags | flags, float(bound)
        size = HEADER_SIZE + sum(4 + s.numel() for s in sections)
        if size < HEADER_SIZE + 4 + raw_bytes:
            msg = assemble(header, sections, x32.device)
            info = EncodeInfo(msg.numel(), raw_bytes, qz.grid.eb_abs, layout, qz.grid.levels, header.unique_rows,
                              int(qz.exc_pos.numel()), qz.recon if want_recon else None)
            return msg, info
    header = Header(dtype_code, RAW, flags, n, d, float(bound), 0.0, 0.0, 0, 0, n, 0, 1)
    msg = assemble(header, [x32.view(-1).view(torch.uint8)], x32.device)
    return msg, EncodeInfo(msg.numel(), raw_bytes, 0.0, "raw", 0, n, 0, x32 if want_recon else None)


def _host_message(b: host.HostBody, n: int, d: int, bound: float, dtype_code: int, flags: int, want_recon: bool
                  ) -> tuple[torch.Tensor, EncodeInfo] | None:
    """A host body -> (message, info); None when it would not be smaller than the values (the general path
    then sends a lossless copy)."""
    size = HEADER_SIZE + sum(4 + len(s) for s in b.sections)
    if size >= HEADER_SIZE + 4 + n * d * 4:
        return None
    header = Header(dtype_code, QUANTIZED, b.flags | flags, n, d, float(bound), b.eb_abs, b.step, b.qmin, b.levels,
                    b.unique, 0, 0, b.center)
    msg = torch.frombuffer(host.assemble(header, b.sections), dtype=torch.uint8)
    recon = None
    if want_recon:  # what decode will return (error feedback): one C pass where the codes are bytes
        step32, codes = np.float32(b.step), b.codes.reshape(-1)
        if b.levels <= 256:
            values = native.decode_rows(codes, None, n, d, n, "bytes", 0, b.qmin, step32, b.levels)
        else:
            values = native.dequantize(codes, b.qmin, step32, b.levels).reshape(n, d)
        recon = torch.from_numpy(values)
    return msg, EncodeInfo(msg.numel(), n * d * 4, b.eb_abs, b.layout, b.levels, b.unique, 0, recon)


def lossless_copy(x: torch.Tensor) -> torch.Tensor:
    """x [N, D] -> a message holding the values exactly (what ``encode`` falls back to), without analysis."""
    x32, dtype_code = _as_matrix(x)
    n, d = x32.shape
    header = Header(dtype_code, RAW, 0, n, d, 0.0, 0.0, 0.0, 0, 0, n, 0, 1)
    return assemble(header, [x32.view(-1).view(torch.uint8)], x32.device)


def _quantized_body(qz, n: int, d: int, use_zstd: bool) -> tuple[Header, list[torch.Tensor], str]:
    g: Grid = qz.grid
    wide = g.levels > 256
    flags = FLAG_WIDE if wide else 0
    center = -g.qmin if g.qmin <= 0 < g.qmin + g.levels else g.levels // 2  # the code of 0.0
    bits, escapes = float(pk.bits_for(g.levels)), 1.0
    if use_zstd and not wide:  # a sample on the host tells the entropy coder's rate and the escape share
        bits, escapes = pk.code_profile(qz.codes.cpu().numpy(), g.levels, center)
    rows = pk.dedup_rows(qz.codes, d * max(bits, 1.0))
    codes, index = rows if rows is not None else (qz.codes, None)
    u = codes.shape[0]
    sections: list[torch.Tensor] = []
    if use_zstd:
        flags |= FLAG_ZSTD
        c = codes.cpu().numpy()
        layout = "bytes"
        if 1 < g.levels <= 128 and escapes <= PAIRS_MAX_ESCAPES:
            sections.append(pk.zstd_pack(native.pair_stream(c, center)))
            flags |= FLAG_PAIRS
            layout = "pairs"
        else:
            center = 0
            sections.append(pk.zstd_pack(pk.byte_planes(c, wide)))
        if index is not None:
            sections.append(pk.zstd_pack(pk.byte_planes(index.cpu().numpy(), u + 1 > 256)))
    else:
        layout, center = "bitpack", 0
        sections.append(pk.bitpack(codes, pk.bits_for(g.levels)))
        if index is not None:
            sections.append(pk.bitpack(index, pk.bits_for(u + 1)))
    if index is not None:
        flags |= FLAG_DEDUP
    e = int(qz.exc_pos.numel())
    if e:
        flags |= FLAG_EXCEPTIONS
        sections += [qz.exc_pos.to(torch.int32).view(torch.uint8), qz.exc_val.contiguous().view(torch.uint8)]
    header = Header(0, QUANTIZED, flags, n, d, 0.0, g.eb_abs, g.step, g.qmin, g.levels, u, e, 0, center)
    return header, sections, layout


def _decode_zstd(h: Header, secs: list, u: int, d: int, wide: bool) -> tuple[torch.Tensor, int]:
    """The zstd layouts, decoded on the host -> (values [N, D] float32 on the CPU, next section)."""
    n, m = h.rows, u * d
    if h.flags & FLAG_PAIRS:  # nibbles, then escaped codes
        layout, stream = "pairs", pk.zstd_unpack(secs[0], -1, "code", limit=(m + 1) // 2 + m)
    else:
        layout, stream = ("wide" if wide else "bytes"), pk.zstd_unpack(secs[0], m * (2 if wide else 1), "code")
    tokens = None
    if h.flags & FLAG_DEDUP:
        tokens = pk.zstd_unpack(secs[1], n * (2 if u + 1 > 256 else 1), "row index")
    # np.float32(step): the same float32 arithmetic as ``dequantize``
    values = native.decode_rows(stream, tokens, n, d, u, layout, h.center, h.qmin, np.float32(h.step), h.levels)
    return torch.from_numpy(values), 1 + (tokens is not None)


def _view(section: torch.Tensor, dtype: torch.dtype, count: int, what: str) -> torch.Tensor:
    """Section bytes -> [count] of ``dtype`` (copied when the bytes are not aligned for it)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if section.numel() != count * size:
        raise EbFormatError(f"eb: {what} section of {section.numel()} bytes, expected {count * size}")
    return view_bytes_as(section, dtype)  # messages start at any byte of a receive buffer


def describe(message: torch.Tensor) -> Header:
    """The checked header of a message (shape, dtype, bound, layout) without decoding the values."""
    return parse(message)[0]


def decode(message: torch.Tensor) -> torch.Tensor:
    """uint8 message -> float32 [N, D] on the message's device. Raises EbFormatError (a CodecError) for a
    truncated, corrupt or foreign message."""
    h, secs = parse(message, host_views=True)
    n, d = h.rows, h.cols
    if h.kind == RAW:
        if h.flags & ~FLAG_REL or len(secs) != 1:
            raise EbFormatError(f"eb: a lossless copy has flags {h.flags:#x} and {len(secs)} sections")
        return _view(secs[0], torch.float32, n * d, "values").view(n, d).clone()
    f = h.flags
    want = 1 + bool(f & FLAG_DEDUP) + 2 * bool(f & FLAG_EXCEPTIONS)
    if len(secs) != want:
        raise EbFormatError(f"eb: flags {f:#x} need {want} sections, the message has {len(secs)}")
    if not (1 <= h.levels <= MAX_LEVELS and bool(f & FLAG_WIDE) == (h.levels > 256)
            and max(abs(h.qmin), abs(h.qmin + h.levels - 1)) < MAX_INDEX and abs(h.step) <= FLOAT32_MAX):
        raise EbFormatError(f"eb: invalid grid (levels {h.levels}, qmin {h.qmin}, step {h.step})")
    if f & FLAG_PAIRS and not (f & FLAG_ZSTD and h.levels <= 128):
        raise EbFormatError("eb: the paired layout needs zstd and at most 128 levels")
    if bool(f & FLAG_EXCEPTIONS) != (h.exceptions > 0):
        raise EbFormatError(f"eb: {h.exceptions} exact values but flags {f:#x}")
    u = h.unique_rows if f & FLAG_DEDUP else n
    if u != h.unique_rows or (n and not u) or (f & FLAG_DEDUP and f & FLAG_ZSTD and u > pk.MAX_DISTINCT_ROWS):
        raise EbFormatError(f"eb: {h.unique_rows} distinct rows for {n} rows")
    wide = bool(f & FLAG_WIDE)
    if f & FLAG_ZSTD:
        values, pos = _decode_zstd(h, secs, u, d, wide)
        if not message.is_cpu:
            values = values.to(message.device)
    else:
        grid = Grid(h.eb_abs, h.step, float(np.float32(h.step)), h.qmin, h.levels)
        codes = pk.bitunpack(secs[0], pk.bits_for(h.levels), u * d).view(u, d)
        if codes.numel() and int(codes.max()) >= h.levels:
            raise EbFormatError(f"eb: a code is outside the {h.levels} levels")
        values, pos = dequantize(codes, grid), 1
        if f & FLAG_DEDUP:
            index = pk.rows_from_tokens(pk.bitunpack(secs[pos], pk.bits_for(u + 1), n), u)
            values, pos = values.index_select(0, index), pos + 1
    if f & FLAG_EXCEPTIONS:
        e = h.exceptions
        where = _view(secs[pos], torch.int32, e, "exact-value position").long()
        exact = _view(secs[pos + 1], torch.float32, e, "exact value")
        if int(where.min()) < 0 or int(where.max()) >= n * d:
            raise EbFormatError(f"eb: an exact-value position is outside the {n}x{d} values")
        values.view(-1)[where] = exact
    return values if values.shape == (n, d) else values.view(n, d)
