"""Reader for the raw Criteo Kaggle / Terabyte click logs (``criteo_prepare`` converts them to the prepared format).

Raw layout: one row per line, TAB separated, 40 fields: label (``0``/``1``), 13 integer features I1..I13,
26 categorical features C1..C26 (32-bit hashes written as 8 lowercase hex digits). An empty field is a
missing value. Accepted quirks seen in public copies: rows whose trailing empty fields were stripped (any
row with 14..39 fields: label and I1..I13 present, the absent categoricals missing) and a last line without
a final newline. Plain and gzipped files are accepted (gzip is detected by its magic bytes, not the name).

Field rules (a violation raises :class:`CriteoFormatError` naming file, line, field and value):

* label: exactly ``0`` or ``1``;
* dense: empty, or an optional ``-`` followed by 1..18 decimal digits (fits int64);
* categorical: empty, or 1..8 hex digits (either case). More than 8 digits is rejected: the values are
  32-bit hashes, so a longer field means a damaged file (e.g. two fields run together), and keeping values
  below 2**32 lets the vocabulary pass store them in 4 bytes.

Parsing is vectorised: a block of bytes is split into fields with one ``flatnonzero`` over separator bytes,
then each field's first 8 bytes are loaded as one little-endian uint64 and decoded with SWAR bit tricks
(all 26 categoricals of a few hundred rows in a few dozen numpy operations). Only lines that the fast path
flags (a bad field, or a dense field longer than 8 characters) go through the per-line Python parser, which
is the authority on what is valid and produces the error message. Reading (and gzip decompression) runs in
a background thread, overlapping with parsing.
"""

from __future__ import annotations

import gzip
import queue
import re
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from recstack.errors import RecstackError

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
MIN_FIELDS = 1 + NUM_DENSE
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]

# Per-table embedding sizes DLRM uses (facebookresearch/dlrm tools/visualize.py; the Terabyte sizes are for
# --max-ind-range=10000000, i.e. capped). Order C1..C26. Reference values for configs and benchmarks.
KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
TERABYTE_CARDINALITIES = [
    9980333, 36084, 17217, 7378, 20134, 3, 7112, 1442, 61, 9758201, 1333352, 313829, 10,
    2208, 11156, 122, 4, 970, 14, 9994222, 7267859, 9946608, 415421, 12420, 101, 36,
]  # fmt: skip

DENSE_TRANSFORM = "missing -> 0, negative -> 0, then log(1 + x)"
MAX_DENSE_DIGITS = 18
MAX_HEX_DIGITS = 8
PARSE_LINES = 384  # lines per vectorised parse step (see CriteoReader._blocks)
MAX_LINE_BYTES = 1 << 20  # a real row is ~250 bytes; a longer "line" means this is not a Criteo TSV


class CriteoFormatError(RecstackError, ValueError):
    """A raw Criteo file breaks the format; the message names file, 1-based line, field and value."""

    def __init__(
        self, file: str | Path, line: int | None, field: str | None, value: str | None, reason: str
    ) -> None:
        self.file, self.line, self.field, self.value, self.reason = str(file), line, field, value, reason
        super().__init__(_location(self.file, line, field, value, reason))


@dataclass(frozen=True)
class BadRow:
    """Where a skipped row was and why it was rejected."""

    file: str
    line: int
    field: str | None
    value: str | None
    reason: str

    def __str__(self) -> str:
        return _location(self.file, self.line, self.field, self.value, self.reason)


def _location(file: str, line: int | None, field: str | None, value: str | None, reason: str) -> str:
    parts = [file if line is None else f"{file}:{line}"]
    if field is not None:
        parts.append(f"field {field}")
    parts.append(reason if value is None else f"{reason} (got {value!r})")
    return ": ".join(parts)


@dataclass
class CriteoChunk:
    """Parsed rows: labels float32 [n]; dense float32 [n, 13] transformed (int64 raw values when the reader
    has ``transform=False``); sparse int64 [n, 26] raw hash values (missing -> 0, so a literal ``00000000``
    is indistinguishable from missing, as in the reference preprocessing)."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


# ------------------------------------------------------------------------------------------- slow path
class _RowError(Exception):
    def __init__(self, field: str | None, value: bytes | None, reason: str) -> None:
        self.field, self.value, self.reason = field, value, reason


_DENSE_RE = re.compile(rb"-?[0-9]{1,%d}" % MAX_DENSE_DIGITS)
_HEX_RE = re.compile(rb"[0-9a-fA-F]{1,%d}" % MAX_HEX_DIGITS)


def _parse_fields(fields: list[bytes]) -> tuple[float, list[int], list[int]]:
    """One split line -> (label, 13 raw dense ints, 26 raw categorical ints); raises _RowError."""
    if not MIN_FIELDS <= len(fields) <= NUM_FIELDS:
        raise _RowError(
            None,
            None,
            f"line has {len(fields)} TAB-separated fields; expected {NUM_FIELDS} (label, I1..I13, C1..C26), "
            f"or {MIN_FIELDS}..{NUM_FIELDS - 1} when trailing empty categoricals are stripped",
        )
    if fields[0] not in (b"0", b"1"):
        raise _RowError("label", fields[0], "label must be 0 or 1")
    dense = []
    for name, s in zip(DENSE_NAMES, fields[1:MIN_FIELDS], strict=True):
        if s and not _DENSE_RE.fullmatch(s):
            why = "integer has more than 18 digits" if re.fullmatch(rb"-?[0-9]+", s) else "not an integer"
            raise _RowError(name, s, why + _crlf_hint(s))
        dense.append(int(s) if s else 0)
    cats = []
    for name, s in zip(SPARSE_NAMES, fields[MIN_FIELDS:], strict=False):
        if s and not _HEX_RE.fullmatch(s):
            why = f"not a categorical value of 1..{MAX_HEX_DIGITS} hex digits"
            raise _RowError(name, s, why + _crlf_hint(s))
        cats.append(int(s, 16) if s else 0)
    cats += [0] * (NUM_SPARSE - len(cats))
    return float(fields[0] == b"1"), dense, cats


def _crlf_hint(s: bytes) -> str:
    return " (Windows line endings?)" if s.endswith(b"\r") else ""


# ------------------------------------------------------------------------------------------- fast path
# Each field's first 8 bytes are one little-endian uint64 "word" (first character in the low byte); the
# operations below treat its 8 bytes as independent lanes. Arithmetic is done in place on purpose: fresh
# temporaries of this size cost several times more than the operation itself.
_U = np.uint64
_ONES = _U(0x0101010101010101)
_HIGH = _U(0x8080808080808080)
_NIBBLES = _U(0x0F0F0F0F0F0F0F0F)
_BIT5 = _U(0x2020202020202020)
_M16 = _U(0x00FF00FF00FF00FF)
_M32 = _U(0x0000FFFF0000FFFF)
_M64 = _U(0x00000000FFFFFFFF)


def _swar_decode(x: np.ndarray, n: np.ndarray, hex_digits: bool) -> tuple[np.ndarray, np.ndarray]:
    """Decode up to 8 (hex) digits per word.

    x: uint64 [...] words, modified in place; n: uint64 [...] in 0..8, the number of characters to use.
    Returns (value int64 [...], ok bool [...]); ok is False where a used character is not a digit of the
    base (hex accepts a-f and A-F). n == 0 gives value 0 and ok True.
    """
    bits = n * _U(8)
    keep = np.left_shift(_U(1), bits)  # numpy defines 1 << 64 as 0, so n == 8 keeps all bytes
    keep -= _U(1)
    x &= keep
    d = x & _NIBBLES
    if hex_digits:  # a-f / A-F have bit 6 set and low nibble 1..6: value = low nibble + 9
        t = x >> _U(6)
        t &= _ONES
        t *= _U(9)
        d += t
    # Validate by re-encoding each lane value as its canonical character and comparing: the decode above
    # maps every byte to some 0..24, so only real digits survive the round trip (plus the range check).
    limit = 0x70 if hex_digits else 0x76  # adding this sets bit 7 where the lane is > 15 (> 9 for decimal)
    over = d + _U(limit * 0x0101010101010101)
    over &= _HIGH
    enc = d + _U(0x30 * 0x0101010101010101)
    if hex_digits:
        t = d + _U(0x76 * 0x0101010101010101)  # bit 7 set where the lane is >= 10 -> letter
        t >>= _U(7)
        t &= _ONES
        t *= _U(0x27)  # '0' + 10 + 0x27 == 'a'
        enc += t
        t = x >> _U(1)  # fold A-F onto a-f: copy bit 6 (set for letters) into bit 5
        t &= _BIT5
        x |= t
    enc &= keep
    ok = enc == x
    ok &= over == _U(0)
    np.left_shift(d, _U(64) - bits, out=d)  # right-align; the last used character lands in the top lane
    b = _U(16 if hex_digits else 10)
    # Combine lane pairs: bytes -> 16-bit -> 32-bit -> 64-bit; the lower address is more significant.
    for mask, shift, mult in ((_M16, 8, b), (_M32, 16, b * b), (_M64, 32, b**4)):
        t = d >> _U(shift)
        d &= mask
        d *= mult
        t &= mask
        d += t
    return d.view(np.int64), ok


@dataclass
class _Block:
    labels: np.ndarray  # float32 [n]
    dense: np.ndarray  # int64 [n, 13] raw (float32 once transformed)
    sparse: np.ndarray  # int64 [n, 26] raw
    bad: list[tuple[int, _RowError]]  # (line index in block, error), in line order


def _parse_block(buf: bytes) -> _Block:
    """buf: complete lines, each ending in b'\\n'. Bad lines are dropped and listed in ``bad``."""
    a = np.frombuffer(buf, dtype=np.uint8)
    is_sep = a == 9
    is_sep |= a == 10
    seps = np.flatnonzero(is_sep)  # position of every field's terminating TAB or newline
    nl = np.flatnonzero(a[seps] == 10)  # index into seps of each line's newline
    n = len(nl)
    nf = np.diff(nl, prepend=-1)  # fields per line
    starts = np.empty_like(seps)
    starts[0] = 0
    np.add(seps[:-1], 1, out=starts[1:])
    lens = (seps - starts).view(np.uint64)
    if (nf == NUM_FIELDS).all():
        S, L = starts.reshape(n, NUM_FIELDS), lens.reshape(n, NUM_FIELDS)
    else:  # stripped or malformed rows: scatter each field to its column
        # Absent fields become empty and point at the block's final newline, so no byte test on them can
        # mistake a neighbour's character for their content.
        S = np.full((n, NUM_FIELDS), len(buf) - 1, np.int64)
        L = np.zeros((n, NUM_FIELDS), np.uint64)
        line = np.repeat(np.arange(n), nf)
        col = np.arange(len(seps)) - np.repeat(nl - nf + 1, nf)
        keep = col < NUM_FIELDS
        S[line[keep], col[keep]] = starts[keep]
        L[line[keep], col[keep]] = lens[keep]
    slow = (nf < MIN_FIELDS) | (nf > NUM_FIELDS)

    lab = a[S[:, 0]]
    slow |= (L[:, 0] != 1) | ((lab != 0x30) & (lab != 0x31))
    labels = (lab == 0x31).astype(np.float32)

    # The word starting at every byte (unaligned view; 8 zero bytes of padding so the last ones exist).
    words = np.ndarray((len(buf) + 1,), dtype="<u8", buffer=buf + bytes(8), strides=(1,))

    x, ld = words[S[:, 1:MIN_FIELDS]], L[:, 1:MIN_FIELDS]
    neg = (x & _U(0xFF)) == _U(0x2D)  # a leading '-': drop it from the word and the length
    np.right_shift(x, _U(8), out=x, where=neg)
    nd = ld - neg
    dense, ok = _swar_decode(x, np.minimum(nd, _U(8)), hex_digits=False)
    ok &= ld <= _U(8)  # longer fields (valid up to 18 digits and a sign) are left to the per-line parser
    ok &= ~neg | (nd > _U(0))  # a lone '-'
    slow |= ~ok.all(axis=1)
    np.negative(dense, out=dense, where=neg)

    lc = L[:, MIN_FIELDS:]
    sparse, ok = _swar_decode(words[S[:, MIN_FIELDS:]], np.minimum(lc, _U(8)), hex_digits=True)
    ok &= lc <= _U(MAX_HEX_DIGITS)
    slow |= ~ok.all(axis=1)

    bad: list[tuple[int, _RowError]] = []
    keep_rows = ~slow
    for i in np.flatnonzero(slow).tolist():
        lo = int(seps[nl[i - 1]]) + 1 if i else 0
        try:
            lab_i, dense_i, sparse_i = _parse_fields(buf[lo : int(seps[nl[i]])].split(b"\t"))
        except _RowError as e:
            bad.append((i, e))
            continue
        labels[i], dense[i], sparse[i] = lab_i, dense_i, sparse_i
        keep_rows[i] = True
    if bad:
        labels, dense, sparse = labels[keep_rows], dense[keep_rows], sparse[keep_rows]
    return _Block(labels, dense, sparse, bad)


def transform_dense(raw: np.ndarray, *, in_place: bool = False) -> np.ndarray:
    """Reference dense transform: int [n, 13] -> float32 [n, 13] = log(1 + max(x, 0)) (missing is 0).

    Computed in float64 and rounded once to float32. ``in_place`` lets it clamp ``raw`` itself.
    """
    clamped = np.maximum(raw, 0, out=raw if in_place else None)
    f = clamped.astype(np.float64)
    np.log1p(f, out=f)
    return f.astype(np.float32)


# ------------------------------------------------------------------------------------------- reader
def open_criteo(path: str | Path) -> BinaryIO:
    """Open a raw file for binary reading; gzip is recognised by its magic bytes."""
    f = open(path, "rb")
    if f.read(2) == b"\x1f\x8b":
        f.close()  # a GzipFile never closes a file object it was given, so let it open its own
        return gzip.open(path, "rb")  # type: ignore[return-value]
    f.seek(0)
    return f


def _read_ahead(path: Path, size: int, lines_done: Callable[[], int]) -> Iterator[bytes]:
    """Yield the file's (decompressed) bytes in reads of ``size``; a thread reads the next two meanwhile.

    zlib and file reads release the GIL, so decompressing a gzipped day file overlaps with parsing.
    """
    q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=2)
    stop = threading.Event()

    def put(item: bytes | BaseException | None) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work(f: BinaryIO) -> None:
        try:
            while (data := f.read(size)) and put(data):
                pass
            put(None)
        except BaseException as e:  # handed to the consumer, which raises it with the file's name
            put(e)

    with open_criteo(path) as f:
        thread = threading.Thread(target=work, args=(f,), daemon=True, name=f"read {path.name}")
        thread.start()
        try:
            while (item := q.get()) is not None:
                if isinstance(item, (EOFError, OSError, zlib.error)):  # BadGzipFile is an OSError
                    why = f"corrupt or truncated gzip data after line {lines_done()} ({item})"
                    raise CriteoFormatError(path, None, None, None, why) from item
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join()


class CriteoReader:
    """Stream one raw Criteo file as :class:`CriteoChunk` s of ``chunk_rows`` rows (the last may be shorter).

    Memory is bounded whatever the file size: about 270 bytes a row of ``chunk_rows`` for the chunk being
    assembled, plus three reads of ``block_bytes`` (one being parsed, two read ahead). Without
    ``skip_bad_rows`` the first bad row raises :class:`CriteoFormatError`; with it, bad rows are dropped,
    counted in ``skipped`` and the first ``max_bad_rows`` kept in ``bad_rows``. After iteration ``rows`` is
    the number of rows yielded and ``lines`` the number of lines read. ``transform=False`` yields the raw
    dense integers (int64 [n, 13]) instead of the transformed floats.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        chunk_rows: int = 262144,
        skip_bad_rows: bool = False,
        max_bad_rows: int = 100,
        block_bytes: int = 8 << 20,
        transform: bool = True,
    ) -> None:
        if chunk_rows < 1 or block_bytes < 1:
            raise ValueError(f"chunk_rows ({chunk_rows}) and block_bytes ({block_bytes}) must be >= 1")
        self.path = Path(path)
        self.chunk_rows, self.block_bytes = chunk_rows, block_bytes
        self.skip_bad_rows, self.max_bad_rows, self.transform = skip_bad_rows, max_bad_rows, transform
        self.rows = self.lines = self.skipped = 0
        self.bad_rows: list[BadRow] = []

    def _raw_blocks(self) -> Iterator[memoryview | bytes]:
        """Runs of whole lines, each ending in a newline (one is added to an unterminated last line).

        A line cut by a read boundary is joined with the start of the next read as its own small piece, so
        the large reads are never copied.
        """
        tail = b""  # an unfinished line from the previous read
        seen_any = False
        for data in _read_ahead(self.path, self.block_bytes, lambda: self.lines):
            seen_any = True
            first = data.find(b"\n") + 1
            if not first:
                tail += data
            else:
                if tail:
                    yield tail + data[:first]
                cut = data.rfind(b"\n") + 1
                if cut > first or not tail:
                    yield memoryview(data)[0 if not tail else first : cut]
                tail = data[cut:]
            if len(tail) > MAX_LINE_BYTES:
                why = f"line longer than {MAX_LINE_BYTES} bytes (not a Criteo TSV file?)"
                raise CriteoFormatError(self.path, self.lines + 1, None, None, why)
        if not seen_any:
            raise CriteoFormatError(self.path, None, None, None, "empty file (no rows)")
        if tail:
            yield tail + b"\n"

    def _blocks(self) -> Iterator[_Block]:
        for raw in self._raw_blocks():
            # Parse a few hundred lines at a time: the per-field temporaries then stay small enough for the
            # allocator to recycle them instead of mapping fresh pages for every operation.
            ends = np.flatnonzero(np.frombuffer(raw, dtype=np.uint8) == 10)
            for first in range(0, len(ends), PARSE_LINES):
                lo = int(ends[first - 1]) + 1 if first else 0
                hi = int(ends[min(first + PARSE_LINES, len(ends)) - 1]) + 1
                block = _parse_block(bytes(raw[lo:hi]))
                self._record_bad(block, self.lines + first)
                if self.transform:  # here, while the block is small and in cache
                    block.dense = transform_dense(block.dense, in_place=True)
                yield block
            self.lines += len(ends)

    def _record_bad(self, block: _Block, lines_before: int) -> None:
        for i, err in block.bad:
            value = None if err.value is None else err.value[:64].decode("utf-8", "replace")
            bad = BadRow(str(self.path), lines_before + i + 1, err.field, value, err.reason)
            if not self.skip_bad_rows:
                raise CriteoFormatError(bad.file, bad.line, bad.field, bad.value, bad.reason)
            self.skipped += 1
            if len(self.bad_rows) < self.max_bad_rows:
                self.bad_rows.append(bad)

    def __iter__(self) -> Iterator[CriteoChunk]:
        self.rows = self.lines = self.skipped = 0
        self.bad_rows = []
        out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        have = 0  # rows filled in out
        for block in self._blocks():
            cols, pos, m = (block.labels, block.dense, block.sparse), 0, len(block.labels)
            while pos < m:
                if out is None:  # np.empty only reserves address space; pages appear as rows are filled
                    k, dense_type = self.chunk_rows, np.float32 if self.transform else np.int64
                    out = (np.empty(k, np.float32), np.empty((k, NUM_DENSE), dense_type),
                           np.empty((k, NUM_SPARSE), np.int64))  # fmt: skip
                take = min(m - pos, self.chunk_rows - have)
                for dst, src in zip(out, cols, strict=True):
                    dst[have : have + take] = src[pos : pos + take]
                have, pos = have + take, pos + take
                if have == self.chunk_rows:
                    yield self._emit(*out)
                    out, have = None, 0
        if out is not None:
            yield self._emit(*(a[:have] for a in out))

    def _emit(self, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> CriteoChunk:
        self.rows += len(labels)
        return CriteoChunk(labels, dense, sparse)
