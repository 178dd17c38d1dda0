"""The plain codecs: dtype casts (fp32, fp16, bf16) and row-wise scaled fp8 and int8. Every payload has a size
known from the chunk's shape alone (``payload_bytes``), so the all-to-all skips its size exchange for them."""

from __future__ import annotations

import torch

from recstack.compression.base import Codec, view_bytes_as


class CastCodec(Codec):
    """Plain dtype cast: fp32 (lossless), fp16, bf16."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.limit = torch.finfo(dtype).max

    def payload_bytes(self, shape: tuple[int, int]) -> int:
        return shape[0] * shape[1] * self.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.dtype)
        # A finite value beyond the format's range (a gradient above 65504 in fp16) saturates at its largest
        # finite value: the plain cast would make it an infinity, which turns the table row it updates into NaN.
        # Inf and NaN stay what they are. On the host the fix-up runs only when some value lies outside the range
        # or is NaN (one fp32 min/max pass instead of three passes per message); on a device it always runs (no
        # sync for the check).
        if x.dtype != self.dtype and torch.finfo(x.dtype).max > self.limit and x.numel() and (
                x.device.type != "cpu" or not self._within(x)):
            y = torch.where(x.isinf(), x, x.clamp(-self.limit, self.limit)).to(self.dtype)
        return y.contiguous().view(-1).view(torch.uint8)

    def _within(self, x: torch.Tensor) -> bool:
        """Every value of ``x`` (non-empty) in [-limit, limit]; False with a NaN (min and max are NaN then)."""
        lo, hi = torch.aminmax(x)
        return bool((lo >= -self.limit) & (hi <= self.limit))

    def decode(self, payload: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        self._check(payload, shape[0] * shape[1] * self.itemsize)
        return view_bytes_as(payload, self.dtype).view(shape).to(torch.float32)


class Fp8RowwiseCodec(Codec):
    """fp8 e4m3 with one fp32 scale per row (the row's largest finite magnitude maps to e4m3's largest finite
    value, 448). NaN arrives as NaN, and so does an infinity (e4m3fn has none); the row's other values keep
    their precision."""

    name = "fp8"
    _MAX = 448.0

    def payload_bytes(self, shape: tuple[int, int]) -> int:
        return shape[0] * (4 + shape[1])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1)  # [N, 1]
        # A NaN or Inf must not set (or void) the scale of its row: the scale then comes from the finite values.
        # On the host only when some row max is not finite (amax carries a NaN); on a device always (no sync).
        finite = x.isfinite() if x.device.type != "cpu" or not bool(amax.isfinite().all()) else None
        if finite is not None and x.shape[1]:
            amax = torch.where(finite, x, 0.0).abs().amax(dim=1, keepdim=True)
        # At least the smallest normal float32: amax / 448 of a row of tiny (subnormal) values rounds to 0 or
        # to a few bits, and x / scale would be NaN or beyond e4m3's range (a row of zeros gets it too).
        scale = (amax / self._MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [N, 1]
        q = x / scale
        if finite is not None:  # the e4m3fn cast saturates an infinity to 448 (a finite value): NaN instead
            q = torch.where(finite, q, torch.nan)
        q = q.to(torch.float8_e4m3fn)
        return torch.cat([scale.reshape(-1).view(torch.uint8), q.reshape(-1).view(torch.uint8)])

    def decode(self, payload: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        n, d = shape
        self._check(payload, n * 4 + n * d)
        scale = view_bytes_as(payload[: n * 4], torch.float32).view(n, 1)
        q = payload[n * 4 :].view(torch.float8_e4m3fn).view(n, d)
        return q.to(torch.float32) * scale


class Int8RowwiseCodec(Codec):
    """Row-wise asymmetric int8: per row min and scale (fp32), codes uint8 in [0, 255] (FBGEMM-style). A row
    holding a NaN or an infinity arrives as a row of NaN (a code has no room for it)."""

    name = "int8"

    def payload_bytes(self, shape: tuple[int, int]) -> int:
        return shape[0] * (8 + shape[1])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 0:
            lo = x.new_zeros(x.shape[0], 1)
            hi = lo
        else:
            lo = x.amin(dim=1, keepdim=True)
            hi = x.amax(dim=1, keepdim=True)
        scale = torch.where(hi > lo, (hi - lo) / 255.0, torch.ones_like(lo))  # [N, 1]
        q = torch.round((x - lo) / scale).clamp_(0, 255).to(torch.uint8)
        head = torch.cat([lo, scale], dim=1).reshape(-1).view(torch.uint8)  # [N * 8]
        return torch.cat([head, q.reshape(-1)])

    def decode(self, payload: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        n, d = shape
        self._check(payload, n * 8 + n * d)
        head = view_bytes_as(payload[: n * 8], torch.float32).view(n, 2)
        q = payload[n * 8 :].view(n, d)
        return q.to(torch.float32) * head[:, 1:2] + head[:, 0:1]
