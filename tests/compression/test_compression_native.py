"""The C loops of the eb host path give exactly what their numpy twins give, and messages are the same
bytes with or without them."""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recstack.compression.eb import core as eb
from recstack.compression.eb import host, native
from recstack.compression.eb import packing as pk
from recstack.compression.eb.format import EbFormatError
from recstack.compression.eb.quantize import finite_range

needs_native = pytest.mark.skipif(not native.available(), reason="the C host kernels are not built here")
SETTINGS = settings(max_examples=60, deadline=None)


def numpy_only(fn, *args):
    """fn(*args) with native's functions on their numpy branch."""
    saved, native._c = native._c, None
    try:
        return fn(*args)
    finally:
        native._c = saved


def test_kernels_are_built_where_a_compiler_exists() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the numpy loops are used")
    if os.environ.get("RECSTACK_NO_NATIVE") == "1":
        pytest.skip("RECSTACK_NO_NATIVE=1 switches the C loops off")
    assert native.available(), "a C compiler exists but recstack.compression._ebhost was not built (pip install -e .)"


@needs_native
@SETTINGS
@given(n=st.integers(0, 3000), levels=st.integers(2, 256), seed=st.integers(0, 2**16))
def test_grid_pairs_and_decoder_match_numpy(n, levels, seed) -> None:
    """(C quantization is compared with numpy's through the whole encoder: see the fused-front test.)"""
    rng = np.random.default_rng(seed)
    step = np.float32(0.01)
    inv = np.float32(1.0) / step
    qmin = int(rng.integers(-levels + 1, 1))
    codes_true = rng.integers(0, levels, n)
    x = ((codes_true + qmin) * step + rng.uniform(-0.45, 0.45, n) * step).astype(np.float32).reshape(-1, 1)
    got, _ = native.quantize(x, inv, qmin, qmin + levels - 1)
    assert np.array_equal(got.reshape(-1), codes_true)
    center = int(rng.integers(0, levels))
    packed, escaped = pk.pair_encode(got, center)
    assert np.array_equal(native.pair_stream(got, center), np.concatenate([packed, escaped]))
    lo, hi, step32 = -rng.uniform(0, 10), rng.uniform(0, 10), float(np.float32(rng.uniform(1e-3, 1)))
    assert tuple(map(float, native.grid(lo, hi, step32))) == tuple(map(float, numpy_only(native.grid, lo, hi, step32)))
    for layout, stream in (("pairs", np.concatenate([packed, escaped])), ("bytes", got.reshape(-1))):
        args = (stream, None, n, 1, n, layout, center, qmin, step, levels)
        assert native.decode_rows(*args).tobytes() == numpy_only(native.decode_rows, *args).tobytes()


@needs_native
@SETTINGS
@given(n=st.integers(2, 600), d=st.integers(1, 40), distinct=st.integers(1, 80), wide=st.booleans(),
       seed=st.integers(0, 2**16))
def test_dedup_matches_numpy(n, d, distinct, wide, seed) -> None:
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 5000 if wide else 256, (distinct, d)).astype(np.int32 if wide else np.uint8)
    codes = np.ascontiguousarray(table[rng.integers(0, distinct, n)])
    for row_bits in (1.0, 64.0, 4096.0):  # dedup that never, sometimes and always pays
        got = host.dedup_rows(codes, row_bits)
        want = numpy_only(host.dedup_rows, codes, row_bits)
        assert (got is None) == (want is None)
        if got is not None:
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
            assert np.array_equal(got[0][pk.rows_from_tokens_np(got[1], len(got[0]))], codes)


@needs_native
@SETTINGS
@given(n=st.integers(1, 700), u=st.integers(1, 300), d=st.integers(1, 20), seed=st.integers(0, 2**16),
       corrupt=st.booleans())
def test_expand_matches_numpy_and_rejects_bad_tokens(n, u, d, seed, corrupt) -> None:
    rng = np.random.default_rng(seed)
    u = min(u, n)
    values = rng.normal(size=(u, d)).astype(np.float32)
    new = np.sort(rng.choice(n, u, replace=False))  # where each distinct row first appears
    new[0] = 0 if rng.random() < 0.9 else new[0]  # mostly valid streams: a repeat before any row is not
    seen = np.cumsum(np.isin(np.arange(n), new))
    tokens = np.where(np.isin(np.arange(n), new), 0, rng.integers(0, 1 << 30, n) % np.maximum(seen, 1) + 1)
    if corrupt:
        tokens[rng.integers(0, n)] = rng.integers(0, u + 2)
    wide = u + 1 > 256
    raw = pk.byte_planes(tokens, wide)
    try:
        want = numpy_only(native.expand_rows, values, raw, n, wide)
    except EbFormatError:
        with pytest.raises(EbFormatError, match="row tokens"):
            native.expand_rows(values, raw, n, wide)
        return
    assert native.expand_rows(values, raw, n, wide).tobytes() == want.tobytes()
    codes = rng.integers(0, 16, (u, d)).astype(np.uint8)  # the same tokens through the fused decoder
    args = (codes.reshape(-1), raw, n, d, u, "bytes", 0, -3, np.float32(0.5), 16)
    assert native.decode_rows(*args).tobytes() == numpy_only(native.decode_rows, *args).tobytes()


@needs_native
@SETTINGS
@given(values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=50))
def test_finite_range_matches_torch(values) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    got = finite_range(x)
    want = numpy_only(finite_range, x)
    assert got[2] == want[2]
    assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got[:2], want[:2], strict=True))


@needs_native
@SETTINGS
@given(data=st.binary(min_size=0, max_size=5000), offset=st.integers(0, 7))
def test_word_sums_match_numpy_at_any_alignment(data, offset) -> None:
    buf = np.frombuffer(bytes(offset) + data, np.uint8)[offset:]
    assert native.word_sums(buf) == numpy_only(native.word_sums, buf)


@needs_native
@pytest.mark.parametrize("kernels", [True, False])
def test_decoders_reject_bad_escapes_and_codes(kernels) -> None:
    def rows(stream, n, levels, layout="pairs"):
        args = (stream, None, n, 1, n, layout, 3, 0, np.float32(1), levels)
        return native.decode_rows(*args) if kernels else numpy_only(native.decode_rows, *args)

    packed, escaped = pk.pair_encode(np.array([3, 40, 3, 3], np.uint8), 3)
    with pytest.raises(EbFormatError, match="escape"):
        rows(packed, 4, 64)
    with pytest.raises(EbFormatError, match="escape"):
        rows(np.concatenate([packed, escaped, escaped]), 4, 64)
    with pytest.raises(EbFormatError, match="outside the 40 levels"):
        rows(np.concatenate([packed, escaped]), 4, 40)
    with pytest.raises(EbFormatError, match="outside the 3 levels"):
        rows(np.array([0, 1, 3], np.uint8), 3, 3, "bytes")
    many = np.full(40, 90, np.uint8)  # 40 escapes: counts beyond any small field
    packed, escaped = pk.pair_encode(many, 3)
    assert rows(np.concatenate([packed, escaped]), 40, 128).ravel().tolist() == [90.0] * 40
    with pytest.raises(EbFormatError, match="cannot hold"):
        rows(packed[:1], 4, 64)


@needs_native
@pytest.mark.parametrize("kind", ["embedding", "gradient"])
def test_messages_are_the_same_bytes_without_the_kernels(kind) -> None:
    rng = np.random.default_rng(7)
    if kind == "embedding":
        x = rng.normal(size=(300, 16))[rng.integers(0, 300, 2048)]
    else:
        x = rng.normal(size=(2048, 16)) * rng.exponential(1.0, (2048, 1)) ** 4
    t = torch.from_numpy(x.astype(np.float32))
    fast = eb.encode(t, 0.03)
    slow = numpy_only(eb.encode, t, 0.03)
    assert torch.equal(fast, slow)
    assert torch.equal(eb.decode(fast), numpy_only(eb.decode, fast))


@needs_native
@SETTINGS
@given(n=st.integers(1, 700), d=st.integers(1, 40), distinct=st.integers(1, 400), peaked=st.booleans(),
       bound=st.sampled_from([0.001, 0.005, 0.03, 0.2]), relative=st.booleans(), nan=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fused_front_writes_what_the_composed_path_writes(n, d, distinct, peaked, bound, relative, nan, seed) -> None:
    """encode_fused (one C call) against encode_composed (the C loops one by one): the same grid, layout,
    distinct rows and bytes; where it declines (NaN, more than 256 levels) the composed path decides."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(distinct, d)).astype(np.float32)[rng.integers(0, distinct, n)]
    if peaked:  # gradient-like: most codes at the centre, a few far out (escapes, the paired layout)
        x = (x * rng.exponential(1.0, (n, 1)) ** 4).astype(np.float32)
    if nan:
        x[rng.integers(0, n), rng.integers(0, d)] = np.nan
    fin = x[np.isfinite(x)]
    if not relative and fin.size:
        bound *= float(fin.max() - fin.min()) or 1.0
    (lo, hi, finite), body = host.encode_fused(x, bound, relative, eb.PAIRS_MAX_ESCAPES)
    expect = finite_range(torch.from_numpy(x))
    assert finite == expect[2] and np.array_equal(np.float32([lo, hi]), np.float32(expect[:2]), equal_nan=True)
    eb_abs = bound * (hi - lo) if relative else bound
    composed = host.encode_composed(x, eb_abs, lo, hi, eb.PAIRS_MAX_ESCAPES) if finite else None
    if body is None:
        assert nan or composed is None or composed.levels > 256
        return
    assert composed is not None
    for field in ("eb_abs", "step", "qmin", "levels", "flags", "unique", "center", "layout"):
        assert getattr(body, field) == getattr(composed, field), field
    assert np.array_equal(body.codes, composed.codes)
    assert body.sections == composed.sections
