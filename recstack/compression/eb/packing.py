"""Lossless stages of the error-bounded codec: duplicate-row removal, bit packing, zstd byte layouts.

Two families, chosen per message:

* device-side (any device, tensor ops only): codes bit-packed at ceil(log2 K) bits, row indices likewise;
* host-side (CPU): zstd (Huffman literals + LZ matches) over byte layouts that suit it: one byte per code,
  or, when most codes sit within 7 levels of the centre (gradients), two nibbles per byte with an
  escape symbol, which lets zstd's byte-wise Huffman code go below one bit per code.

Row deduplication hashes each row of codes into 64 bits, groups equal hashes, and then checks that the
grouped rows are really equal (a collision only switches deduplication off for that message).
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
import torch
import zstandard

from recstack.compression.eb.format import EbFormatError

ESCAPE = 15  # nibble symbol of the paired layout that says "the code is in the escape stream"
ZSTD_LEVEL = 1  # level 1 keeps Huffman-coded literals (negative levels store them raw) and runs fastest
ZSTD_MIN_MATCH = 7  # code streams have few long matches: 7 (level 1 uses 6) is ~10% faster and ~1% smaller
ZSTD_HASH_LOG = 12  # a smaller match table than level 1's: clearing it is much of a small frame's cost
_local = threading.local()

if sys.byteorder != "little":  # bit packing reads int64 words as bytes
    raise ImportError("recstack.compression needs a little-endian machine")


def zstd_contexts() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    if not hasattr(_local, "zc"):  # contexts are not thread-safe: one pair per thread
        params = zstandard.ZstdCompressionParameters.from_level(
            ZSTD_LEVEL, min_match=ZSTD_MIN_MATCH, hash_log=ZSTD_HASH_LOG, write_content_size=True)
        _local.zc = zstandard.ZstdCompressor(compression_params=params)
        _local.zd = zstandard.ZstdDecompressor()
    return _local.zc, _local.zd


def zstd_pack(a: np.ndarray) -> torch.Tensor:
    """Any contiguous numpy array -> zstd frame as uint8 tensor [bytes] (CPU)."""
    frame = zstd_contexts()[0].compress(np.ascontiguousarray(a).data)
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8) if frame else torch.zeros(0, dtype=torch.uint8)


def zstd_unpack(section: torch.Tensor | np.ndarray, nbytes: int, what: str, limit: int = 0) -> np.ndarray:
    """zstd frame (uint8 tensor) -> exactly ``nbytes`` bytes (or, with nbytes < 0, at most ``limit``) as a
    uint8 numpy array; anything else raises EbFormatError before a large buffer is allocated."""
    data = section if isinstance(section, np.ndarray) else section.cpu().numpy()  # read in place by zstd
    try:
        size = zstandard.frame_content_size(data.data)
        cap = nbytes if nbytes >= 0 else limit
        if size < 0 or size > cap or (nbytes >= 0 and size != nbytes):
            raise EbFormatError(f"eb: {what} stream declares {size} bytes, expected {nbytes if nbytes >= 0 else cap}")
        out = zstd_contexts()[1].decompress(data.data, max_output_size=max(cap, 1))
    except zstandard.ZstdError as e:
        raise EbFormatError(f"eb: {what} stream does not decompress ({e})") from e
    if len(out) != size:
        raise EbFormatError(f"eb: {what} stream holds {len(out)} bytes, declared {size}")
    return np.frombuffer(out, dtype=np.uint8)  # read-only: decoders only read it


# -- duplicate rows -----------------------------------------------------------------------------------------
_MULTIPLIERS: dict[tuple[int, str], torch.Tensor] = {}


def _row_words(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, D] uint8 or int32 -> [N, W] int64 words holding each row's bytes (zero padded)."""
    rows = codes.view(torch.uint8).reshape(codes.shape[0], -1) if codes.dtype != torch.uint8 else codes
    pad = (-rows.shape[1]) % 8
    if pad:
        rows = torch.cat([rows, rows.new_zeros(rows.shape[0], pad)], dim=1)
    return rows.contiguous().view(torch.int64)


MAX_DISTINCT_ROWS = 0xFFFF  # row tokens (0..U) travel as 16-bit byte planes in the zstd layouts


def dedup_pays(n: int, u: int, row_bits: float) -> bool:
    """Whether sending U distinct rows of ``row_bits`` bits plus an index of log2(U) bits per row beats
    sending all N rows (and the tokens fit in 16 bits)."""
    return u < n and u <= MAX_DISTINCT_ROWS and (n - u) * row_bits > n * math.log2(max(u, 2))


def dedup_rows(codes: torch.Tensor, row_bits: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """codes [N, D] -> (distinct rows [U, D] in order of first occurrence, row tokens [N] int64), or None when
    the index would cost more than the repeated rows (``row_bits`` bits each) it saves. Token 0 means "the
    next distinct row" (its first occurrence), token t > 0 repeats distinct row t - 1: popular rows come
    early, so tokens are small and the many first occurrences cost almost nothing (see ``rows_from_tokens``)."""
    n = codes.shape[0]
    if n < 2 or codes.shape[1] == 0:
        return None
    words = _row_words(codes)  # [N, W]
    key = (words.shape[1], str(words.device))
    if key not in _MULTIPLIERS:
        g = torch.Generator().manual_seed(0x5EB)
        m = torch.randint(-(2**62), 2**62, (words.shape[1],), generator=g) | 1  # odd: every word matters
        _MULTIPLIERS[key] = m.to(words.device)
    h = (words * _MULTIPLIERS[key]).sum(1)  # [N] wrapping 64-bit hash
    uniq, inv = torch.unique(h, return_inverse=True)
    u = uniq.numel()
    if not dedup_pays(n, u, row_bits):
        return None
    first = torch.full((u,), n, dtype=torch.int64, device=codes.device)
    first.scatter_reduce_(0, inv, torch.arange(n, device=codes.device), reduce="amin")  # [U] a row of each
    if not torch.equal(words.index_select(0, first).index_select(0, inv), words):
        return None  # a hash collision: send the rows as they are
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(u, device=codes.device)
    tokens = rank[inv] + 1
    tokens[first] = 0
    return codes.index_select(0, first[order]), tokens


def rows_from_tokens(tokens: torch.Tensor, u: int) -> torch.Tensor:
    """Row tokens [N] -> distinct-row index [N]; EbFormatError unless exactly ``u`` rows are introduced and
    every repeat names a row introduced before it."""
    new = tokens == 0
    seen = torch.cumsum(new, 0)  # distinct rows introduced up to and including each position
    if tokens.numel() and (int(seen[-1]) != u or bool(((tokens > seen) & ~new).any())):
        raise EbFormatError(f"eb: row tokens do not describe {u} distinct rows")
    return torch.where(new, seen - 1, tokens - 1)


def rows_from_tokens_np(tokens: np.ndarray, u: int) -> np.ndarray:
    """``rows_from_tokens`` for a numpy array of tokens [N] -> int64 index [N]."""
    new = tokens == 0
    seen = np.cumsum(new)
    if tokens.size and (int(seen[-1]) != u or bool(((tokens > seen) & ~new).any())):
        raise EbFormatError(f"eb: row tokens do not describe {u} distinct rows")
    return np.where(new, seen - 1, tokens.astype(np.int64) - 1)


# -- bit packing (device side) -----------------------------------------------------------------------------
def bits_for(levels: int) -> int:
    """Bits per code for ``levels`` distinct values (0 for one level)."""
    return max(levels - 1, 0).bit_length()


def bitpack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values [n] integers in [0, 2**bits), bits <= 16 -> uint8 [ceil(n / 8) * bits] (little-endian groups of
    8 values; above 8 bits the low byte plane comes first, then the high bits packed)."""
    values = values.reshape(-1)
    if bits == 0 or values.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=values.device)
    if bits > 8:
        v = values.to(torch.int32)
        return torch.cat([bitpack(v & 0xFF, 8), bitpack(v >> 8, bits - 8)])
    if bits == 8:
        return values.to(torch.uint8)
    n = values.numel()
    m = -(-n // 8)
    v = values.to(torch.int64)
    if m * 8 != n:
        v = torch.cat([v, v.new_zeros(m * 8 - n)])
    shifts = torch.arange(0, 8 * bits, bits, device=v.device, dtype=torch.int64)
    words = (v.view(m, 8) << shifts).sum(1)  # [m] each holds 8 codes in its low 8 * bits bits
    return words.view(torch.uint8).view(m, 8)[:, :bits].reshape(-1)


def packed_size(n: int, bits: int) -> int:
    if bits > 8:
        return packed_size(n, 8) + packed_size(n, bits - 8)
    if bits == 8:
        return n
    return -(-n // 8) * bits if bits else 0


def bitunpack(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of bitpack -> int64 [n]."""
    if data.numel() != packed_size(n, bits):
        raise EbFormatError(f"eb: {data.numel()} packed bytes for {n} values of {bits} bits, "
                            f"expected {packed_size(n, bits)}")
    if bits == 0:
        return torch.zeros(n, dtype=torch.int64, device=data.device)
    if bits > 8:
        lo = bitunpack(data[:n], 8, n)
        return lo | (bitunpack(data[n:], bits - 8, n) << 8)
    if bits == 8:
        return data.to(torch.int64)
    m = -(-n // 8)
    w = torch.zeros(m, 8, dtype=torch.uint8, device=data.device)
    w[:, :bits] = data.view(m, bits)
    words = w.view(torch.int64)  # [m, 1]
    shifts = torch.arange(0, 8 * bits, bits, device=data.device, dtype=torch.int64)
    return ((words >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]


# -- zstd byte layouts (host side) ------------------------------------------------------------------------
def byte_planes(v: np.ndarray, wide: bool) -> np.ndarray:
    """Values < 2**16 -> one byte each (narrow) or the low-byte plane followed by the high-byte plane."""
    if not wide:
        return v.astype(np.uint8, copy=False).reshape(-1)
    v16 = v.astype(np.uint16, copy=False).reshape(-1)
    return np.concatenate([(v16 & 0xFF).astype(np.uint8), (v16 >> 8).astype(np.uint8)])


def from_planes(b: np.ndarray, n: int, wide: bool) -> np.ndarray:
    if not wide:
        return b
    return b[:n].astype(np.int32) | (b[n:].astype(np.int32) << 8)


def code_profile(codes: np.ndarray, levels: int, center: int, sample: int = 4096) -> tuple[float, float]:
    """-> (order-0 entropy in bits per code, share of codes the paired layout would escape), both estimated
    on an even sample of the codes (what an entropy coder can reach; whether the paired layout fits)."""
    flat = codes.reshape(-1)
    if flat.size == 0:
        return 0.0, 0.0
    return profile_from_counts(np.bincount(flat[:: max(1, flat.size // sample)], minlength=levels), center)


def profile_from_counts(counts: np.ndarray, center: int) -> tuple[float, float]:
    """``code_profile`` from the code counts of the sample."""
    counts = counts.astype(np.float64)
    total = counts.sum()
    if total == 0:
        return 0.0, 0.0
    p = counts[counts > 0] / total
    bits = float(-(p * np.log2(p)).sum()) if p.size > 1 else 0.0
    near = counts[max(center - 7, 0) : center + 8].sum()
    return bits, float(1.0 - near / total)


def pair_encode(codes: np.ndarray, center: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 codes (K <= 128) -> (two nibbles per byte [ceil(n / 2)], escaped codes [E] uint8).

    Nibble = code - center + 7 for the 15 codes around the centre (0..14); 15 marks an escape, whose code
    goes to the escape stream. The entropy coder does not care which nibble a code gets, only that the
    mapping is fixed: an offset costs two passes where a zigzag cost five. Computed in 8 bits, where the
    wrap-around sends every code outside the window to 15 or above."""
    flat = codes.reshape(-1)
    t = flat - np.uint8((center - 7) & 0xFF)
    if flat.size and int(t.max()) >= ESCAPE:
        escaped = flat[t >= ESCAPE]
        np.minimum(t, ESCAPE, out=t)
    else:
        escaped = flat[:0]
    if t.size % 2:
        t = np.concatenate([t, np.zeros(1, np.uint8)])
    p = t.view(np.uint16)  # little-endian: the first code of each pair is the low byte, both < 16
    return (p | (p >> 4)).astype(np.uint8), escaped


def pair_decode(packed: np.ndarray, escaped: np.ndarray, n: int, center: int) -> np.ndarray:
    """Inverse of pair_encode -> uint8 codes [n]; the escape count must match."""
    if packed.size * 2 < n:
        raise EbFormatError(f"eb: {packed.size} packed bytes cannot hold {n} codes")
    p = packed.astype(np.uint16)
    p |= p << 4
    p &= 0x0F0F  # low byte: first nibble, high byte: second
    z = p.view(np.uint8)[:n]
    esc = z == ESCAPE if escaped.size or (z.size and int(z.max()) >= ESCAPE) else None
    found = int(np.count_nonzero(esc)) if esc is not None else 0
    if found != escaped.size:
        raise EbFormatError(f"eb: {found} escape symbols but {escaped.size} escaped codes")
    codes = z + np.uint8((center - 7) & 0xFF)
    if esc is not None and escaped.size:
        codes[esc] = escaped
    return codes
