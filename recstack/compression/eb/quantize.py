"""Quantization stage of the error-bounded codec: a uniform grid centred on zero, checked value by value.

A value x gets the index q = round(x / step) with step just under 2 * eb_abs (no prediction: embedding rows
have no spatial smoothness to exploit), and decodes to float32(q) * float32(step). The encoder computes that
reconstruction exactly as the decoder will and compares it with x: every value whose error could exceed
eb_abs (float32 rounding near the grid's limits, NaN, Inf) is kept exactly instead, as an "exact value"
(its flat position and its float32 bits). So the bound holds for every value by construction, not by
argument. All work is tensor ops on the input's device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from recstack.compression.eb import native

TIGHTEN = 1.0 - 2.0**-12  # step = 2 * eb_abs * TIGHTEN: a value on a bin edge still decodes within the bound
CHECK = 1.0 - 2.0**-22  # float32 |x - x'| <= eb_abs * CHECK implies the exact difference is <= eb_abs
MAX_LEVELS = 1 << 16  # codes fit in 16 bits; a finer grid is sent losslessly instead
MAX_INDEX = 1 << 24  # float32 holds every integer below 2**24, so q and code + qmin stay exact
# With max|x| <= SAFE_RATIO * eb_abs and a normal step, float32 rounding in x * (1/step), round and
# q * step adds at most 3 * 2**-24 * max|x| < eb_abs * 2**-12 to the half step, which TIGHTEN leaves free
# (worked through in docs/compression.md). Then the value-by-value check is provably redundant and skipped.
SAFE_RATIO = 256.0
MIN_NORMAL32 = 2.0**-126
FLOAT32_MAX = float(np.finfo(np.float32).max)


def usable_bound(eb_abs: float) -> bool:
    """Whether a grid may be built for eb_abs: finite and at least the smallest normal float32. Below it the
    float32 check limit rounds past eb_abs, and a thread that flushes subnormals to zero (torch's
    ``set_flush_denormal``) would quantize a subnormal x to 0 with an error above eb_abs; at or above it such
    an x errs by less than eb_abs. Finer bounds are met by a lossless copy."""
    return MIN_NORMAL32 <= eb_abs and math.isfinite(eb_abs)


def is_safe(lo: float, hi: float, eb_abs: float, step32: float) -> bool:
    """Whether the grid provably keeps every value of [lo, hi] within eb_abs (see SAFE_RATIO): a normal
    step, values within SAFE_RATIO bounds of zero, and no reconstruction beyond float32's range."""
    m = max(abs(lo), abs(hi))
    return step32 >= MIN_NORMAL32 and m <= SAFE_RATIO * eb_abs and m + step32 <= FLOAT32_MAX * (1 - 2.0**-20)


@dataclass
class Grid:
    """The quantization grid of one message: value = float32(code + qmin) * step32 for code in [0, levels)."""

    eb_abs: float
    step: float
    step32: float
    qmin: int
    levels: int


@dataclass
class Quantized:
    codes: torch.Tensor  # [N, D] uint8 when levels <= 256, else int32
    grid: Grid
    exc_pos: torch.Tensor  # [E] int64 flat positions of the values kept exactly
    exc_val: torch.Tensor  # [E] float32 their values
    recon: torch.Tensor | None  # [N, D] float32: what the decoder will return (when asked for)


def finite_range(x: torch.Tensor) -> tuple[float, float, bool]:
    """-> (min, max) over the finite values of x (nan, nan when there are none), and whether all are finite."""
    if x.numel() == 0:
        return math.nan, math.nan, True
    if x.device.type == "cpu" and x.dtype == torch.float32:
        fast = native.finite_range(x.numpy())  # one pass, and a fraction of aminmax's call overhead
        if fast is not None:
            return fast
    lo, hi = torch.aminmax(x)
    lo_f, hi_f = float(lo), float(hi)
    if math.isfinite(lo_f) and math.isfinite(hi_f):  # NaN propagates through aminmax, Inf shows as a bound
        return lo_f, hi_f, True
    fin = x[torch.isfinite(x)]
    if fin.numel() == 0:
        return math.nan, math.nan, False
    lo, hi = torch.aminmax(fin)
    return float(lo), float(hi), False


def absolute_bound(bound: float, relative: bool, lo: float, hi: float) -> float:
    """eb_abs = bound * (max - min) for a relative bound (range in float64), else the bound itself."""
    if not relative:
        return float(bound)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return 0.0
    return float(bound) * (hi - lo)


def to_uint8(t: torch.Tensor) -> torch.Tensor:
    """Integer-valued float tensor in [0, 255] -> uint8 (numpy's cast is several times faster on CPU)."""
    if t.device.type == "cpu":
        return torch.from_numpy(t.numpy().astype(np.uint8))
    return t.to(torch.uint8)


def quantize(x: torch.Tensor, eb_abs: float, lo: float, hi: float, all_finite: bool,
             want_recon: bool = False) -> Quantized | None:
    """x [N, D] float32 contiguous -> codes on a grid with error <= eb_abs, or None when no grid pays off
    (zero or non-finite bound on varying data, more than MAX_LEVELS levels, indices beyond 2**24).
    ``lo``, ``hi``, ``all_finite``: from ``finite_range(x)``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None  # nothing finite to quantize
    if lo == hi and not usable_bound(eb_abs):
        # Constant data with a zero (or too fine) bound: one level that decodes to the constant exactly (1 * lo).
        grid = Grid(0.0, lo, lo, 1, 1)
        q = torch.ones_like(x)
    else:
        if not usable_bound(eb_abs):
            return None
        step = 2.0 * eb_abs * TIGHTEN
        if step > FLOAT32_MAX:
            return None
        step32 = float(np.float32(step))
        if not (step32 > 0 and math.isfinite(step32)):
            return None
        with np.errstate(over="ignore"):  # a subnormal step: the inverse overflows and the grid is refused
            inv32 = float(np.float32(1.0) / np.float32(step32))
        if not math.isfinite(inv32):
            return None
        q = torch.mul(x, inv32).round_()  # [N, D]
        qlo, qhi = torch.aminmax(q if all_finite else q[torch.isfinite(x)])
        qmin_f, qmax_f = float(qlo), float(qhi)
        if not (math.isfinite(qmin_f) and math.isfinite(qmax_f)):
            return None
        if max(abs(qmin_f), abs(qmax_f)) >= MAX_INDEX or qmax_f - qmin_f + 1 > MAX_LEVELS:
            return None
        grid = Grid(eb_abs, step, step32, int(qmin_f), int(qmax_f - qmin_f) + 1)
    safe = all_finite and grid.levels > 1 and is_safe(lo, hi, grid.eb_abs, grid.step32)
    if safe:
        recon = torch.mul(q, grid.step32) if want_recon else None
        q.sub_(float(grid.qmin))
        codes = to_uint8(q) if grid.levels <= 256 else q.to(torch.int32)
        empty = torch.zeros(0, dtype=torch.int64, device=x.device)
        return Quantized(codes, grid, empty, x.new_zeros(0), recon)
    recon = torch.mul(q, grid.step32)  # exactly the decoder's float32(code + qmin) * step32
    err = torch.sub(x, recon).abs_()
    limit = float(np.float32(grid.eb_abs * CHECK))
    worst = float(err.max()) if err.numel() else 0.0  # NaN when x has NaN: falls to the slow path
    if worst <= limit:
        exc_pos = torch.zeros(0, dtype=torch.int64, device=x.device)
    else:
        exc_pos = (~(err <= limit)).view(-1).nonzero().squeeze(1)
        q.view(-1)[exc_pos] = float(grid.qmin)  # any valid code; the exact value overrides it
        recon.view(-1)[exc_pos] = x.view(-1)[exc_pos]
    exc_val = x.view(-1)[exc_pos]
    q.sub_(float(grid.qmin))
    codes = to_uint8(q) if grid.levels <= 256 else q.to(torch.int32)
    return Quantized(codes, grid, exc_pos, exc_val, recon)


def dequantize(codes: torch.Tensor, grid: Grid) -> torch.Tensor:
    """codes [U, D] (uint8 or int32) -> float32 values on the grid (before exact values are put back)."""
    out = codes.to(torch.float32)
    if grid.qmin:
        out.add_(float(grid.qmin))
    return out.mul_(grid.step32)
