"""The error-bounded codec: the bound holds for every value, NaN/Inf are exact, messages describe themselves,
and corrupt or truncated messages raise the codec's own error. Every all-to-all codec decodes messages that
start at any byte of a receive buffer."""

from __future__ import annotations

import math
import struct
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from recstack.compression.base import Codec, CodecError
from recstack.compression.eb import core as eb_module
from recstack.compression.eb.codec import EbCodec
from recstack.compression.eb.core import decode, describe, encode, encode_with_info
from recstack.compression.eb.format import HEADER, HEADER_SIZE, EbFormatError, _message_checksum
from recstack.compression.eb.quantize import TIGHTEN
from recstack.compression.registry import get_codec
from recstack.distributed.comm import decode_chunks, encode_chunks

LAYOUTS = ("zstd", "bitpack")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def expected_bound(x: np.ndarray, bound: float, relative: bool) -> float:
    """What the caller is promised, computed independently of the codec."""
    if not relative:
        return bound
    fin = x[np.isfinite(x)].astype(np.float64)
    return bound * float(fin.max() - fin.min()) if fin.size else 0.0


def check_roundtrip(x: np.ndarray, bound: float, relative: bool, lossless: str) -> torch.Tensor:
    msg = encode(torch.from_numpy(x), bound, relative, lossless)
    y = decode(msg).numpy()
    assert y.shape == x.shape and y.dtype == np.float32
    eb = expected_bound(x, bound, relative)
    fin = np.isfinite(x)
    err = np.abs(y[fin].astype(np.float64) - x[fin].astype(np.float64))
    assert err.size == 0 or err.max() <= eb, f"max error {err.max()} > bound {eb}"
    # non-finite values come back bit for bit (NaN payloads included)
    assert np.array_equal(y[~fin].view(np.uint32), x[~fin].view(np.uint32))
    h = describe(msg)
    assert (h.rows, h.cols) == x.shape and h.eb_abs <= eb
    return msg


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
any32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
shapes = st.tuples(st.integers(0, 40), st.integers(0, 20))
bounds = st.sampled_from([0.0, 1e-6, 1e-3, 0.01, 0.03, 0.05, 0.2, 0.5, 1.0, 3.0])


@SETTINGS
@given(x=hnp.arrays(np.float32, shapes, elements=finite32), bound=bounds, relative=st.booleans(),
       lossless=st.sampled_from(LAYOUTS))
def test_bound_holds_on_arbitrary_finite_values(x, bound, relative, lossless):
    check_roundtrip(x, bound, relative, lossless)


@SETTINGS
@given(x=hnp.arrays(np.float32, shapes, elements=any32), bound=bounds, relative=st.booleans(),
       lossless=st.sampled_from(LAYOUTS))
def test_nan_inf_and_denormals_pass_exactly(x, bound, relative, lossless):
    check_roundtrip(x, bound, relative, lossless)


@SETTINGS
@given(rows=st.integers(1, 300), cols=st.integers(1, 70), scale=st.sampled_from([1e-30, 1e-6, 1e-2, 1.0, 1e4, 1e30]),
       offset=st.sampled_from([0.0, 1.0, -3.0, 1e3]), bound=st.sampled_from([1e-4, 0.01, 0.03, 0.05]),
       distinct=st.integers(1, 50), seed=st.integers(0, 2**16), lossless=st.sampled_from(LAYOUTS))
def test_bound_holds_on_embedding_like_batches(rows, cols, scale, offset, bound, distinct, seed, lossless):
    """Rows drawn from a few distinct vectors (as small tables give), over several scales and offsets."""
    rng = np.random.default_rng(seed)
    table = (rng.standard_normal((distinct, cols)) * scale + offset * scale).astype(np.float32)
    x = table[rng.integers(0, distinct, rows)]
    check_roundtrip(x, bound, True, lossless)
    check_roundtrip(x, bound * scale, False, lossless)


@SETTINGS
@given(rows=st.integers(1, 200), cols=st.integers(1, 40), distinct=st.integers(1, 60), seed=st.integers(0, 2**16),
       bound=st.sampled_from([0.005, 0.03, 0.2]), grad_like=st.booleans())
def test_host_and_tensor_paths_write_the_same_values(rows, cols, distinct, seed, bound, grad_like):
    """The numpy host path (CPU default) and the tensor path (any device) quantize identically, and each
    reads the other's messages."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((distinct, cols)).astype(np.float32)
    x = table[rng.integers(0, distinct, rows)]
    if grad_like:  # peaked at zero, as gradients are: the paired layout
        x = (x * rng.exponential(1.0, (rows, 1)) ** 4).astype(np.float32)
    t = torch.from_numpy(x)
    fast = encode(t, bound, lossless="zstd")
    with mock.patch.object(eb_module, "_host_message", return_value=None):
        slow = encode(t, bound, lossless="zstd")
        packed = encode(t, bound, lossless="bitpack")
    assert torch.equal(decode(fast), decode(slow)) and describe(fast).kind == describe(slow).kind
    quantized = [m for m in (fast, packed) if describe(m).kind == 1]  # tiny inputs may be sent as they are
    for m in (fast, packed):
        if describe(m).kind == 0:
            assert torch.equal(decode(m), t)
    if len(quantized) == 2:
        assert torch.equal(decode(fast), decode(packed))


@SETTINGS
@given(x=st.one_of(hnp.arrays(np.float32, shapes, elements=any32), hnp.arrays(np.float32, shapes, elements=finite32)),
       bound=bounds, lossless=st.sampled_from(LAYOUTS))
def test_reconstruction_for_error_feedback_is_what_decode_returns(x, bound, lossless):
    msg, info = encode_with_info(torch.from_numpy(x), bound, lossless=lossless, want_recon=True)
    torch.testing.assert_close(info.recon, decode(msg), rtol=0, atol=0, equal_nan=True)  # exact (0.0 == -0.0)


@pytest.mark.parametrize("lossless", LAYOUTS)
def test_constant_empty_and_special_tensors(lossless):
    for x in (np.full((7, 5), 3.25, np.float32), np.zeros((4, 4), np.float32), np.zeros((0, 8), np.float32),
              np.zeros((5, 0), np.float32), np.full((3, 3), np.nan, np.float32),
              np.array([[np.inf, -np.inf, 1.0, np.nan]], np.float32),
              np.array([[1e-45, -1e-45, 0.0, -0.0]], np.float32),
              np.array([[3.4e38, -3.4e38, 1.0, 0.0]], np.float32)):
        for relative in (True, False):
            check_roundtrip(x, 0.03, relative, lossless)
    # a constant tensor under a relative bound (range 0) must come back exactly
    x = np.full((64, 16), -0.7, np.float32)
    assert np.array_equal(decode(encode(torch.from_numpy(x), 0.05, True, lossless)).numpy(), x)


def test_message_describes_itself_and_is_small_for_embedding_rows():
    rng = np.random.default_rng(0)
    table = rng.uniform(-0.05, 0.05, (40, 64)).astype(np.float32)
    x = torch.from_numpy(table[rng.integers(0, 40, 2048)])
    msg, info = encode_with_info(x, 0.03)
    h = describe(msg)
    assert (h.rows, h.cols, h.unique_rows, h.bound) == (2048, 64, 40, 0.03)
    assert h.eb_abs == pytest.approx(0.03 * float(x.max() - x.min()), rel=1e-12)
    assert info.layout in ("bytes", "pairs") and info.nbytes == msg.numel()
    assert x.numel() * 4 / msg.numel() > 50  # 40 distinct rows out of 2048


@pytest.mark.parametrize("lossless", LAYOUTS)
def test_more_distinct_rows_than_16_bit_tokens_hold(lossless):
    """70,000 distinct rows repeated to 200,000: deduplication would pay, but its row tokens are 16-bit in
    the zstd layouts, so the encoder must not use it there (it once wrapped the tokens and decoded garbage)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 4, (70_000, 16), generator=g).float()
    x = base[torch.cat([torch.arange(70_000), torch.randint(0, 70_000, (130_000,), generator=g)])]
    msg, info = encode_with_info(x, 0.1, lossless=lossless)
    assert float((decode(msg) - x).abs().max()) <= info.eb_abs

def test_half_precision_inputs_and_bad_arguments():
    x = torch.randn(16, 8).to(torch.float16)
    y = decode(encode(x, 0.01))
    assert y.dtype == torch.float32 and describe(encode(x, 0.01)).dtype_code == 2
    assert (y - x.float()).abs().max() <= 0.01 * float(x.float().max() - x.float().min())
    with pytest.raises(ValueError, match="matrix"):
        encode(torch.zeros(3), 0.1)
    with pytest.raises(ValueError, match="bound"):
        encode(torch.zeros(3, 3), -1.0)
    with pytest.raises(ValueError, match="float32"):
        encode(torch.zeros(3, 3, dtype=torch.int64), 0.1)


# -- corrupt messages ----------------------------------------------------------------------------------------
def _sample_messages() -> list[torch.Tensor]:
    rng = np.random.default_rng(1)
    fwd = rng.uniform(-0.1, 0.1, (30, 16)).astype(np.float32)[rng.integers(0, 30, 256)]
    grad = (rng.standard_normal((256, 16)) * rng.exponential(1.0, (256, 1)) ** 3).astype(np.float32)
    odd = np.array([[np.nan, 1.0, 2.0], [np.inf, 1e30, -2.0]], np.float32)
    out = []
    for x in (fwd, grad, odd, rng.standard_normal((32, 8)).astype(np.float32)):
        for lossless in LAYOUTS:
            out.append(encode(torch.from_numpy(x), 0.03, True, lossless))
    out.append(encode(torch.from_numpy(grad), 0.0, True))  # lossless copy
    return out


MESSAGES = _sample_messages()


@SETTINGS
@given(which=st.integers(0, len(MESSAGES) - 1), data=st.data())
def test_any_flipped_byte_raises_codec_error(which, data):
    msg = MESSAGES[which].clone()
    pos = data.draw(st.integers(0, msg.numel() - 1))
    msg[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(EbFormatError):
        decode(msg)


@SETTINGS
@given(which=st.integers(0, len(MESSAGES) - 1), data=st.data())
def test_truncated_or_extended_messages_raise_codec_error(which, data):
    msg = MESSAGES[which]
    cut = data.draw(st.integers(0, msg.numel() - 1))
    with pytest.raises(EbFormatError):
        decode(msg[:cut].clone())
    extra = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=9)), dtype=torch.uint8)
    with pytest.raises(EbFormatError):
        decode(torch.cat([msg, extra]))


@SETTINGS
@given(blob=st.binary(max_size=300))
def test_random_bytes_raise_codec_error(blob):
    with pytest.raises(CodecError):  # EbFormatError is a CodecError: the all-to-all path catches one type
        decode(torch.tensor(list(blob), dtype=torch.uint8))


def _rechecksum(msg: torch.Tensor) -> torch.Tensor:
    head = bytes(msg[: HEADER.size].numpy())
    msg[HEADER.size : HEADER_SIZE] = torch.tensor(
        list(struct.pack("<Q", _message_checksum(head, msg[HEADER_SIZE:]))), dtype=torch.uint8)
    return msg


@SETTINGS
@given(which=st.integers(0, len(MESSAGES) - 1), data=st.data())
def test_corruption_behind_a_valid_checksum_never_crashes(which, data):
    """Mutations that also fix the checksum (what a buggy sender could produce): decode either raises the
    codec's error or returns a float32 tensor of the declared shape, never another exception or a hang."""
    msg = MESSAGES[which].clone()
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(4, msg.numel() - 1))  # keep the magic so the checks behind it run
        msg[pos] = data.draw(st.integers(0, 255))
    msg = _rechecksum(msg)
    try:
        h = describe(msg)
        y = decode(msg)
    except EbFormatError:
        return
    assert y.dtype == torch.float32 and tuple(y.shape) == (h.rows, h.cols)


def test_wrong_version_and_magic_are_named():
    msg = MESSAGES[0].clone()
    msg[4] = 9
    with pytest.raises(EbFormatError, match="version 9"):
        decode(_rechecksum(msg))
    with pytest.raises(EbFormatError, match="magic"):
        decode(torch.zeros(100, dtype=torch.uint8))
    assert math.isfinite(describe(MESSAGES[0]).eb_abs)


@pytest.mark.parametrize("lossless", LAYOUTS)
def test_header_bit_flips_that_cancel_modulo_a_prime_are_caught(lossless):
    """Header bits k and k + 61 flipped in opposite directions: equal modulo 2^61 - 1, so a header folded in by
    that modulus kept its checksum; here it is a bit of qmin (which shifts every value) and a bit of step."""
    msg = encode(torch.rand(256, 16, generator=torch.Generator().manual_seed(0)), 0.03, lossless=lossless)
    b = bytearray(msg.numpy().tobytes())
    bit = lambda k: (b[k // 8] >> (k % 8)) & 1  # noqa: E731
    a = next(320 + i for i in range(2, 12) if bit(320 + i) != bit(259 + i))  # qmin bit, its partner in step
    for k in (a, a - 61):
        b[k // 8] ^= 1 << (k % 8)
    with pytest.raises(EbFormatError, match="checksum"):
        decode(torch.frombuffer(b, dtype=torch.uint8))


@pytest.mark.parametrize("lossless", LAYOUTS)
@pytest.mark.parametrize("flush", [False, True])
def test_bounds_below_the_smallest_normal_float_hold_also_when_subnormals_flush(lossless, flush):
    """eb_abs under 2^-126: the float32 check limit would round past it, and with flush-to-zero a subnormal
    quantizes to 0. Such bounds get a lossless copy; at 2^-126 and above a flushed subnormal errs less."""
    tiny = 2.0**-126
    x = np.zeros((64, 16), np.float32)
    x[:, 0], x[:, 1], x[:, 2] = 0.9 * tiny, 100 * tiny, -100 * tiny
    # Values whose float32 error on the grid of this bound lies between the bound and float32(bound x CHECK).
    fine = 1.8367097830299777e-39
    step32 = np.float32(2 * fine * TIGHTEN)
    near = np.array([3.672525001245085e-33, 3.672521327825239e-33, 3.672528674664931e-33], np.float32)
    y = np.concatenate([near, (np.arange(10**6, 10**6 + 4093, dtype=np.float32) * step32)]).reshape(64, 64)
    torch.set_flush_denormal(flush)  # returns whether the CPU supports it, not the previous mode (off by default)
    try:
        msgs = [(encode(torch.from_numpy(v), b, relative=False, lossless=lossless), v, b)
                for v, b in ((x, 0.6 * tiny), (y, fine), (x, tiny), (x, 3 * tiny))]
    finally:
        torch.set_flush_denormal(False)
    for msg, v, b in msgs:
        err = np.abs(v.astype(np.float64) - decode(msg).numpy().astype(np.float64)).max()
        assert err <= b, (b, err)
    assert describe(msgs[0][0]).kind == 0 and describe(msgs[3][0]).kind == 1  # raw below 2^-126, quantized above


def test_a_quantized_header_of_no_columns_is_refused_before_any_work():
    """N = 2^30 rows of D = 0 passes N x D < 2^31; the message would make the decoder expand 2^30 row tokens."""
    from recstack.compression.eb.format import FLAG_DEDUP, FLAG_ZSTD, QUANTIZED, Header, assemble

    header = Header(1, QUANTIZED, FLAG_ZSTD | FLAG_DEDUP, 1 << 30, 0, 0.0, 0.0, 1.0, 0, 1, 1, 0, 0, 0)
    msg = assemble(header, [torch.zeros(9, dtype=torch.uint8), torch.zeros(9, dtype=torch.uint8)], torch.device("cpu"))
    with pytest.raises(EbFormatError, match="N=1073741824 x D=0"):
        decode(msg)
    wide = Header(1, QUANTIZED, FLAG_ZSTD, 1, 1 << 31, 0.0, 0.0, 1.0, 0, 1, 1, 0, 0, 0)
    with pytest.raises(EbFormatError, match="inconsistent sizes"):
        decode(assemble(wide, [torch.zeros(9, dtype=torch.uint8)], torch.device("cpu")))


@pytest.mark.parametrize("lossless", LAYOUTS)
def test_a_message_in_a_strided_tensor_decodes(lossless):
    x = torch.randn(128, 16)
    msg = encode(x, 0.03, lossless=lossless)
    spread = torch.zeros(2 * msg.numel(), dtype=torch.uint8)
    spread[::2] = msg
    assert torch.equal(decode(spread[::2]), decode(msg)) and describe(spread[::2]) == describe(msg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_tensors_stay_on_the_device():
    x = torch.randn(512, 64, device="cuda")
    msg = encode(x, 0.03)
    assert msg.is_cuda and describe(msg).flags & 4 == 0  # bit packing, no zstd (host) stage
    y = decode(msg)
    assert y.is_cuda and float((y - x).abs().max()) <= 0.03 * float(x.max() - x.min())
    assert torch.equal(decode(msg.cpu()), y.cpu())  # the same bytes decode the same anywhere


# -- messages at any byte offset of a receive buffer ----------------------------------------------------------
def _codec(name: str) -> Codec:
    return EbCodec(0.03, lossless="bitpack") if name == "eb-bitpack" else get_codec(name)


OFFSET_CODECS = ("fp32", "fp16", "bf16", "fp8", "int8", "eb", "eb-bitpack")
ODD_SHAPES = [(3, 5), (1, 7), (5, 3), (0, 4), (2, 1), (7, 9)]  # odd N * D: fp8/int8 payloads of odd size


def _odd_chunks(name: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randn(n, d, generator=g) for n, d in ODD_SHAPES]
    if name.startswith("eb"):  # exact values: int32 positions and float32 values in sections of their own
        chunks[-1][1, 2], chunks[-1][4, 0] = math.nan, -math.inf
    return chunks


def _at_offset(message: torch.Tensor, offset: int) -> torch.Tensor:
    """``message`` as a slice starting at byte ``offset`` of a larger buffer (what a receive buffer holds
    behind an odd-sized message from another rank)."""
    buf = torch.full((offset + message.numel() + 5,), 0xA5, dtype=torch.uint8)
    buf[offset : offset + message.numel()] = message
    return buf[offset : offset + message.numel()]


@pytest.mark.parametrize("name", OFFSET_CODECS)
def test_every_codec_decodes_messages_at_any_byte_offset(name):
    codec = _codec(name)
    chunks = _odd_chunks(name)
    message = encode_chunks(codec, chunks)
    want = decode_chunks(codec, message.clone(), ODD_SHAPES)  # an aligned copy
    for offset in range(1, 9):
        got = decode_chunks(codec, _at_offset(message, offset), ODD_SHAPES)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    payload = codec.encode(chunks[0])
    for offset in range(1, 5):  # a single payload, decoded on its own
        torch.testing.assert_close(codec.decode(_at_offset(payload, offset), ODD_SHAPES[0]),
                                   codec.decode(payload, ODD_SHAPES[0]), rtol=0, atol=0)


def test_aligned_fp32_payloads_are_decoded_without_a_copy():
    codec = get_codec("fp32")
    payload = _at_offset(codec.encode(torch.randn(3, 5)), 8)
    assert codec.decode(payload, (3, 5)).data_ptr() == payload.data_ptr()


@pytest.mark.parametrize("name", OFFSET_CODECS)
def test_truncated_or_corrupt_messages_at_odd_offsets_raise_codec_error(name):
    codec = _codec(name)
    chunks = _odd_chunks(name)
    message = encode_chunks(codec, chunks)
    payload = codec.encode(chunks[-1])
    for offset in (1, 2, 3, 5):
        with pytest.raises(CodecError):
            decode_chunks(codec, _at_offset(message[:-1], offset), ODD_SHAPES)
        with pytest.raises(CodecError):
            decode_chunks(codec, _at_offset(message[:5], offset), ODD_SHAPES)  # not even a header
        with pytest.raises(CodecError):
            codec.decode(_at_offset(payload[:-1], offset), ODD_SHAPES[-1])
        with pytest.raises(CodecError):
            codec.decode(_at_offset(torch.cat([payload, payload[:3]]), offset), ODD_SHAPES[-1])
        with pytest.raises(CodecError):
            codec.decode(_at_offset(payload, offset), (ODD_SHAPES[-1][0] + 1, ODD_SHAPES[-1][1]))
        if name.startswith("eb"):  # checksummed: any flipped byte is caught, wherever the message starts
            bad = payload.clone()
            bad[bad.numel() // 2] ^= 0x10
            with pytest.raises(CodecError):
                codec.decode(_at_offset(bad, offset), ODD_SHAPES[-1])
