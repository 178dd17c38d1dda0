"""Wire format of an error-bounded message: a fixed header, then length-prefixed sections.

Layout (all little-endian)::

    offset  size  field
    0       4     magic b"RSEB"
    4       1     format version (3; version 2 folded the header into the checksum modulo 2^61 - 1, version 1
                  paired codes by zigzag, not by offset)
    5       1     original dtype code (1 float32, 2 float16, 3 bfloat16)
    6       1     body kind (0 raw: lossless copy of the values, 1 quantized)
    7       1     flags (see FLAG_*)
    8       4     N rows (uint32)
    12      4     D columns (uint32)
    16      8     bound as requested (float64; relative or absolute, FLAG_REL says which)
    24      8     eb_abs: the guaranteed maximum absolute error of every finite value (float64)
    32      8     quantization step (float64; reconstruction is (code + qmin) * float32(step))
    40      4     qmin (int32), the smallest quantization index
    44      4     K, number of code levels (uint32)
    48      4     U, number of distinct code rows sent (uint32; N without deduplication)
    52      4     number of exact values (NaN, Inf and values the grid cannot hold; uint32)
    56      4     number of sections that follow (uint32)
    60      4     center code of the paired layout (uint32; zero otherwise)
    64      8     checksum of the header (with this field zero) and of every byte after it
    72      ...   sections: uint32 length, then that many bytes, for each section

A message that is too short, has another magic or version, inconsistent sizes, or a checksum that does not
match raises ``EbFormatError`` (a ``CodecError``) before anything is decoded, so a corrupt message never
turns into values. The checksum is computed with tensor ops so that messages on a GPU are checked there.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import torch

from recstack.compression.base import CodecError
from recstack.compression.eb import native

MAGIC = b"RSEB"
VERSION = 3
HEADER = struct.Struct("<4sBBBBIIdddiIIIII")  # everything before the checksum
HEADER_SIZE = HEADER.size + 8  # + uint64 checksum
_CHECKSUM = struct.Struct("<Q")
_LENGTH = struct.Struct("<i")
assert HEADER_SIZE == 72

RAW, QUANTIZED = 0, 1
FLAG_REL = 1  # the requested bound is relative to the value range of the message
FLAG_DEDUP = 2  # distinct code rows + one row index per original row
FLAG_ZSTD = 4  # sections are zstd frames (else bit-packed)
FLAG_PAIRS = 8  # codes as nibbles around the centre (15 = escape), then the escaped codes, in one zstd frame
FLAG_WIDE = 16  # codes are uint16 (K > 256)
FLAG_EXCEPTIONS = 32  # positions and exact values of the values kept as they are
KNOWN_FLAGS = 63

DTYPES = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
MAX_ELEMENTS = 1 << 31  # int32 positions of exact values, and a sanity limit on a corrupt header


class EbFormatError(CodecError):
    """An error-bounded message is truncated, corrupt, of another version, or not such a message at all."""


@dataclass
class Header:
    dtype_code: int
    kind: int
    flags: int
    rows: int
    cols: int
    bound: float
    eb_abs: float
    step: float
    qmin: int
    levels: int
    unique_rows: int
    exceptions: int
    sections: int
    center: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.dtype_code, self.kind, self.flags, self.rows, self.cols, self.bound,
                           self.eb_abs, self.step, self.qmin, self.levels, self.unique_rows, self.exceptions,
                           self.sections, self.center)


_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constant (as a signed int64) for position mixing
_MASK64 = 0xFFFFFFFFFFFFFFFF


def checksum(data: torch.Tensor) -> int:
    """64-bit checksum of a uint8 tensor [n] (any device): word sum and position-weighted word sum.

    Integer sums wrap modulo 2**64 and are order independent, so CPU and GPU give the same value. The
    tensor is read in place when it starts on a 4-byte boundary; a message received behind an odd-sized one
    does not, and its words are read from a copy.
    """
    n = data.numel()
    n4 = n - n % 4
    body = data[:n4]
    if body.storage_offset() % 4:
        body = body.clone()
    s1 = s2 = 0
    if n4:
        words = body.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [n / 4] unsigned 32-bit words
        pos = torch.arange(1, words.numel() + 1, device=data.device, dtype=torch.int64)
        s1, s2 = int(words.sum()), int((words * pos).sum())
    tail = int.from_bytes(bytes(data[n4:].cpu().numpy()), "little") if n4 < n else 0
    mixed = (s1 + (tail << 7) + n + s2 * _MIX) & _MASK64
    return mixed ^ (mixed >> 29)


def checksum_np(body: np.ndarray) -> int:
    """``checksum`` of a uint8 numpy array: the same value, computed on the host with less overhead."""
    n = body.size
    n4 = n - n % 4
    s1, s2 = native.word_sums(body)
    tail = int.from_bytes(body[n4:].tobytes(), "little") if n4 < n else 0
    mixed = (s1 + (tail << 7) + n + s2 * _MIX) & _MASK64
    return mixed ^ (mixed >> 29)


def _combine(head: bytes, body_sum: int) -> int:
    """The message checksum from its header bytes (a 64-bit BLAKE2b digest: any change of the header, however
    many bits, changes it but with probability 2^-64) and the body's checksum."""
    h = int.from_bytes(hashlib.blake2b(head[: HEADER.size], digest_size=8).digest(), "little")
    return (body_sum * 0x100000001B3 + h) & _MASK64


def _message_checksum(head: bytes, body: torch.Tensor) -> int:
    """Checksum of a message: the header up to the checksum field (on the host), then the body."""
    if body.device.type == "cpu":
        return _combine(head, checksum_np(body.numpy()))
    return _combine(head, checksum(body))


def message_checksum_np(head: bytes, body: np.ndarray) -> int:
    return _combine(head, checksum_np(body))


def assemble(header: Header, sections: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Header + length-prefixed uint8 sections -> one checksummed uint8 message [bytes] on ``device``."""
    header.sections = len(sections)
    total = HEADER_SIZE + sum(4 + s.numel() for s in sections)
    msg = torch.empty(total, dtype=torch.uint8, device=device)
    lengths = torch.tensor([s.numel() for s in sections], dtype=torch.int32).view(torch.uint8).to(device)
    pos = HEADER_SIZE
    for i, s in enumerate(sections):
        msg[pos : pos + 4] = lengths[4 * i : 4 * i + 4]
        msg[pos + 4 : pos + 4 + s.numel()] = s.reshape(-1)
        pos += 4 + s.numel()
    head = header.pack()
    head += struct.pack("<Q", _message_checksum(head, msg[HEADER_SIZE:]))
    msg[:HEADER_SIZE] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    return msg


def parse(message: torch.Tensor, host_views: bool = False) -> tuple[Header, list]:
    """Check a message and split it -> (header, sections as uint8 views of ``message``: tensors, or numpy
    arrays when ``host_views``, the message is on the host and its layout is one the host decodes with
    numpy alone (zstd, no exact values), which saves that decoder a tensor op per section)."""
    if message.dtype != torch.uint8 or message.dim() != 1:
        raise EbFormatError(f"eb: a message is a 1-D uint8 tensor, got {message.dtype} of shape {tuple(message.shape)}")
    message = message.contiguous()  # a strided view of the bytes (buf[::2]) reads as the bytes themselves
    n = message.numel()
    if n < HEADER_SIZE:
        raise EbFormatError(f"eb: message of {n} bytes is shorter than the {HEADER_SIZE}-byte header (truncated?)")
    on_host = message.is_cpu
    buf = message.numpy() if on_host else None  # the host reads headers and lengths without tensor ops
    head = buf[:HEADER_SIZE].tobytes() if buf is not None else bytes(message[:HEADER_SIZE].cpu().numpy())
    fields = HEADER.unpack_from(head)
    if fields[0] != MAGIC:
        raise EbFormatError(f"eb: bad magic {fields[0]!r} (expected {MAGIC!r}): not an error-bounded message")
    if fields[1] != VERSION:
        raise EbFormatError(f"eb: message format version {fields[1]}, this build reads version {VERSION}")
    stored = _CHECKSUM.unpack_from(head, HEADER.size)[0]
    body_sum = checksum_np(buf[HEADER_SIZE:]) if buf is not None else checksum(message[HEADER_SIZE:])
    if _combine(head, body_sum) != stored:
        raise EbFormatError(f"eb: checksum mismatch in a {n}-byte message (corrupt or truncated)")
    h = Header(*fields[2:16])
    if h.dtype_code not in DTYPES or h.kind not in (RAW, QUANTIZED) or h.flags & ~KNOWN_FLAGS:
        raise EbFormatError(f"eb: unknown dtype {h.dtype_code}, body kind {h.kind} or flags {h.flags:#x}")
    if (max(h.rows, h.cols, h.rows * h.cols) >= MAX_ELEMENTS or h.unique_rows > h.rows or h.exceptions > h.rows * h.cols
            or h.center >= max(h.levels, 1)):
        raise EbFormatError(f"eb: inconsistent sizes N={h.rows} D={h.cols} U={h.unique_rows} "
                            f"exact={h.exceptions}")
    if h.kind == QUANTIZED and h.rows * h.cols == 0:  # the encoder sends no values as a lossless copy
        raise EbFormatError(f"eb: a quantized message of N={h.rows} x D={h.cols} values")
    if h.sections > 8:
        raise EbFormatError(f"eb: {h.sections} sections; a message has at most 6")
    zstd_only = h.kind == QUANTIZED and h.flags & (FLAG_ZSTD | FLAG_EXCEPTIONS) == FLAG_ZSTD
    numpy_views = on_host and host_views and zstd_only
    sections, pos = [], HEADER_SIZE
    for i in range(h.sections):
        if pos + 4 > n:
            raise EbFormatError(f"eb: section {i} length runs past the end of a {n}-byte message")
        if buf is not None:
            length = _LENGTH.unpack_from(buf.data, pos)[0]
        else:
            length = struct.unpack("<i", bytes(message[pos : pos + 4].cpu().numpy()))[0]
        pos += 4
        if length < 0 or pos + length > n:
            raise EbFormatError(f"eb: section {i} of {length} bytes runs past the end of a {n}-byte message")
        sections.append(buf[pos : pos + length] if numpy_views and buf is not None else message[pos : pos + length])
        pos += length
    if pos != n:
        raise EbFormatError(f"eb: {n - pos} trailing bytes after the last section")
    return h, sections
