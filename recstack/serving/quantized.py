"""Row-wise quantized embedding tables and the inference collection that pools straight from them.

Widths (``WIDTHS``) and their per-element error bound against the float32 row x (derivation in
``docs/serving.md``):

* ``fp32``: the rows as trained; exact.
* ``fp16``: round to nearest half precision: |x^ - x| <= 2^-11 |x| (normal range), <= 2^-25 below 2^-14.
* ``int8`` / ``int4``: asymmetric per row, L = 255 / 15 levels. The row's bias b is its minimum rounded *down*
  to float16 and its scale s is (max - b) / L rounded *up* to float16, so every x of the row lies in
  [b, b + L s]; code q = round((x - b) / s) in [0, L] (computed in float64) and x^ = q s + b (float32), so
  |x^ - x| <= s / 2 + 2^-24 |x^| (the one float32 rounding of the dequantization). int4 codes are packed two
  a byte, the even column in the low nibble.

Scale and bias are float16 [rows, 2] (4 bytes a row), so a D-dimensional row takes D + 4 bytes in int8 and
ceil(D / 2) + 4 in int4 against 4 D in float32 (codes padded to whole 4-byte words: ``code_columns``).

``QuantizedEmbeddingCollection`` pools (sum, optional per-sample weights) like the training collection: for
each feature it gathers only the rows its ids name, dequantizes those, and one ``embedding_bag`` over the
gathered rows sums the bags in the same order as the training lookup (so fp32 tables give the same sums).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from recstack.data.batch import SparseFeatures
from recstack.io import reserve

WIDTHS = ("fp32", "fp16", "int8", "int4")
LEVELS = {"int8": 255, "int4": 15}
FP16_MAX = 65504.0
_CHUNK_ROWS = 1 << 18  # rows quantized at a time: bounded memory for any table size
GroupArrays = dict[str, tuple[np.ndarray, "np.ndarray | None"]]  # table group -> (codes [rows, cols], scale_bias)


def code_columns(width: str, dim: int) -> int:
    """Bytes of codes in an int8 / int4 row, padded to a multiple of 4 so that rows can be gathered as float32
    words (torch's fast row copy; gathering uint8 rows is several times slower)."""
    raw = dim if width == "int8" else (dim + 1) // 2
    return -(-raw // 4) * 4


def bytes_per_row(width: str, dim: int) -> int:
    """Bytes a row of ``dim`` values takes in ``width`` (scale and bias included)."""
    return {"fp32": 4 * dim, "fp16": 2 * dim}.get(width) or code_columns(width, dim) + 4


def _fp16_toward(x: np.ndarray, direction: float) -> np.ndarray:
    """float64 [n] -> float16 [n] rounded toward -inf (direction < 0) or +inf (direction > 0)."""
    h = x.astype(np.float16)
    off = (h.astype(np.float64) > x) if direction < 0 else (h.astype(np.float64) < x)
    h[off] = np.nextafter(h[off], np.float16(direction * np.inf))
    return h


def quantize_rows(rows: np.ndarray, width: str) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 [n, D] -> (data, scale_bias): fp32 / fp16 [n, D] and None, or codes uint8 [n, D] (int8) /
    [n, ceil(D / 2)] (int4) and float16 [n, 2] (scale, bias). Raises ValueError for values fp16 cannot hold."""
    if width not in WIDTHS:
        raise ValueError(f"table width {width!r}: expected one of {', '.join(WIDTHS)}")
    x = np.asarray(rows, np.float64)
    if not np.isfinite(x).all():
        raise ValueError("a row holds NaN or Inf")
    if width == "fp32":
        return np.asarray(rows, np.float32), None
    if width != "fp32" and np.abs(x).max(initial=0.0) > FP16_MAX / 2:
        raise ValueError(f"a value of magnitude {np.abs(x).max():g} does not fit float16 ({width} needs it)")
    if width == "fp16":
        return x.astype(np.float16), None
    levels = LEVELS[width]
    bias = _fp16_toward(x.min(axis=1, initial=np.inf) if x.shape[1] else np.zeros(len(x)), -1.0)
    b64 = bias.astype(np.float64)
    span = (x.max(axis=1, initial=-np.inf) if x.shape[1] else b64) - b64
    scale = _fp16_toward(span / levels, 1.0)
    scale[scale == 0] = np.float16(1.0)  # a constant row: every code is 0, any scale decodes it
    s64 = scale.astype(np.float64)
    codes: np.ndarray = np.clip(np.rint((x - b64[:, None]) / s64[:, None]), 0, levels).astype(np.uint8)
    if width == "int4":
        if codes.shape[1] % 2:
            codes = np.concatenate([codes, np.zeros((len(codes), 1), np.uint8)], axis=1)
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes, np.stack([scale, bias], axis=1)


def dequantize(data: torch.Tensor, scale_bias: torch.Tensor | None, width: str, dim: int) -> torch.Tensor:
    """Gathered rows of one width (codes [n, >= dim or >= ceil(dim / 2)] for int8 / int4, scale_bias [n, 2])
    -> float32 [n, dim]. q s is exact in float32 (8 + 11 significant bits), so q s + b rounds once."""
    if width == "fp32":
        return data
    if width == "fp16":
        return data.float()
    if width == "int4":
        q = torch.empty(data.shape[0], 2 * data.shape[1], dtype=torch.float32, device=data.device)
        q[:, 0::2] = data & 15
        q[:, 1::2] = data >> 4
        q = q[:, :dim]
    else:
        q = data[:, :dim].float()
    sb = scale_bias.float()  # type: ignore[union-attr]
    return q.mul_(sb[:, :1]).add_(sb[:, 1:])  # q is a fresh tensor in every case: in place is safe


def open_group(width: str, rows: int, dim: int, data_path: Path, sb_path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """Create the ``.npy`` files of one width group of ``rows`` rows (every table of that width, stacked):
    -> writable memory maps (data, scale_bias or None)."""
    dtype = {"fp32": np.float32, "fp16": np.float16, "int8": np.uint8, "int4": np.uint8}[width]
    cols = code_columns(width, dim) if width in LEVELS else dim  # padding bytes stay 0
    data = _mapped(data_path, dtype, (rows, cols))
    sb = _mapped(sb_path, np.float16, (rows, 2)) if width in LEVELS else None
    return data, sb


def _mapped(path: Path, dtype: type, shape: tuple[int, int]) -> np.ndarray:
    """A new ``.npy`` of ``shape`` as a writable memory map, its blocks allocated first
    (``reserve``): a full disk is then an OSError here, never a SIGBUS at a store into the map."""
    a = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)  # a sparse file so far
    reserve(path, path.stat().st_size)
    return a


def write_table(weight: torch.Tensor, width: str, data: np.ndarray, sb: np.ndarray | None, offset: int) -> None:
    """Quantize a float32 table [rows, D] chunk by chunk (bounded memory) into rows [offset, offset + rows) of
    its width group's memory maps."""
    for lo in range(0, weight.shape[0], _CHUNK_ROWS):
        q, s = quantize_rows(weight[lo : lo + _CHUNK_ROWS].detach().float().cpu().numpy(), width)
        data[offset + lo : offset + lo + len(q), : q.shape[1]] = q
        if sb is not None and s is not None:
            sb[offset + lo : offset + lo + len(s)] = s


def _tensor(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A read-only memory map as a tensor (never written to: torch's warning about that does not apply)."""
    if isinstance(a, torch.Tensor):
        return a
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class QuantizedRows:
    """The rows of every table of one width, stacked (a table is a row range), memory-mapped read-only (one
    page-cache copy for every process that maps the file) or copied to ``device``."""

    def __init__(self, width: str, dim: int, data: np.ndarray | torch.Tensor,
                 scale_bias: np.ndarray | torch.Tensor | None, device: torch.device | str = "cpu") -> None:
        if width not in WIDTHS:
            raise ValueError(f"width {width!r} is not one of {', '.join(WIDTHS)}")
        if (scale_bias is None) != (width not in LEVELS):
            raise ValueError(f"{width} rows {'need' if scale_bias is None else 'take no'} scale and bias")
        self.width, self.dim, self.num_rows = width, dim, int(data.shape[0])
        device = torch.device(device)
        self.data = _tensor(data).to(device)  # a tensor already there (a delta's new rows) is taken as it is
        self.scale_bias = None if scale_bias is None else _tensor(scale_bias).to(device)
        # Codes gathered as float32 words (bits copied, never computed on) when a row is whole words; the
        # (scale, bias) pair of a row is one float32 word.
        words = width in LEVELS and self.data.shape[1] % 4 == 0 and self.data.is_contiguous()
        self._code_words = self.data.view(torch.float32) if words else None
        sb = self.scale_bias
        self._sb_words = sb.contiguous().view(torch.float32).view(-1) if sb is not None else None

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n] int64 in [0, num_rows) -> dequantized float32 [n, D] (only these rows are read)."""
        if self._sb_words is None:
            return dequantize(self.data.index_select(0, rows), None, self.width, self.dim)
        n = rows.numel()
        sb = self._sb_words.index_select(0, rows).view(torch.float16).view(n, 2)
        codes = (self._code_words.index_select(0, rows).view(torch.uint8) if self._code_words is not None
                 else self.data.index_select(0, rows))
        return dequantize(codes, sb, self.width, self.dim)

    @property
    def nbytes(self) -> int:
        return self.num_rows * bytes_per_row(self.width, self.dim)


class QuantizedEmbeddingCollection:
    """Pooled (sum) lookups of F features into quantized tables: ``SparseFeatures`` (F features, batch B)
    -> [B, F, D] float32, as ``FusedEmbeddingBagCollection`` pools in eval mode; with ``flat`` (per-table dims:
    groups of several dims) [B, sum of feature dims] instead, each sample's features one after another, as
    ``MixedDimEmbeddingCollection`` pools.

    ``feature_group[f]``: the group (index into ``groups``, one per width, or per width and dim) holding feature
    f's table; ``feature_offset[f]``: the table's first row in it. A batch costs a constant number of kernels
    per group, not per feature: one gather of the rows its ids name, one dequantization, one ``embedding_bag``."""

    def __init__(self, groups: list[QuantizedRows], feature_group: list[int], feature_offset: list[int],
                 flat: bool = False) -> None:
        dims = {g.dim for g in groups}
        if len(dims) != 1 and not flat:
            raise ValueError(f"all tables need one embedding dim, got {sorted(dims)}")
        self.groups, self.flat = groups, flat
        # embedding_dim: the widest group's (rows narrower than it are gathered zero-padded to it)
        self.num_features, self.embedding_dim = len(feature_group), max(dims)
        self.feature_dims = [groups[g].dim for g in feature_group]  # [F]
        device = groups[0].data.device
        self.feature_group = torch.tensor(feature_group, dtype=torch.int64, device=device)
        self.feature_offset = torch.tensor(feature_offset, dtype=torch.int64, device=device)

    def __call__(self, sparse: SparseFeatures, one_id_per_bag: bool = False) -> torch.Tensor:
        """``one_id_per_bag``: every bag holds exactly one id (offsets 0..F*B), so a bag's sum is its row (times
        its weight): the rows are gathered in [F, B] order and no bags are summed."""
        if sparse.num_features != self.num_features:
            raise ValueError(f"got {sparse.num_features} sparse features, the collection has {self.num_features}")
        b, d, n = sparse.batch_size, self.embedding_dim, sparse.ids.numel()
        device = self.feature_offset.device
        if one_id_per_bag and len(self.groups) == 1 and not self.flat:
            ids = sparse.ids.to(device).view(self.num_features, b) + self.feature_offset[:, None]  # [F, B]
            rows = self.groups[0].lookup(ids.view(-1))  # [F * B, D]
            if sparse.weights is not None:
                rows = rows * sparse.weights.to(device)[:, None]
            return rows.view(self.num_features, b, d).transpose(0, 1).contiguous()  # [B, F, D]
        per_feature = sparse.ids_per_feature.to(device)
        ids = sparse.ids.to(device) + self.feature_offset.repeat_interleave(per_feature, output_size=n)
        if len(self.groups) == 1:
            rows = self.groups[0].lookup(ids)  # [N, D], the gathered rows in id order
        else:
            group = self.feature_group.repeat_interleave(per_feature, output_size=n)
            padded = any(qr.dim != d for qr in self.groups)  # zero columns add nothing to the bags' sums
            rows = (torch.zeros if padded else torch.empty)(n, d, dtype=torch.float32, device=device)
            for g, qr in enumerate(self.groups):
                pos = torch.nonzero(group == g).squeeze(1)
                rows[pos, : qr.dim] = qr.lookup(ids[pos])
        # Bag i sums rows[offsets[i] : offsets[i + 1]]: the positions of its ids, in order, as in training.
        pooled = F.embedding_bag(torch.arange(n, device=device), rows, sparse.offsets.to(device), mode="sum",
                                 per_sample_weights=sparse.weights, include_last_offset=True)
        by_feature = pooled.view(self.num_features, b, d)
        if self.flat:  # [F, B, D] -> [B, sum of feature dims], each feature's own columns
            return torch.cat([by_feature[f, :, :df] for f, df in enumerate(self.feature_dims)], dim=1)
        # [F * B, D] -> [B, F, D], contiguous: the exported program was traced on contiguous inputs, and
        # a reshape there is a view that a transposed input cannot take.
        return by_feature.transpose(0, 1).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes of all tables' rows (scale and bias included)."""
        return sum(g.nbytes for g in self.groups)
