"""Codecs to compare ``eb`` with, all behind one interface: encode a float32 [N, D] numpy array at an
absolute bound, decode it back, count bytes.

* ``eb``: this package (relative bound given as the equivalent absolute one, so every codec sees the same);
* ``fp16``, ``bf16``, ``int8`` (row-wise, FBGEMM-style), ``fp8`` (row-wise e4m3): the fixed-rate all-to-all
  codecs of ``recstack.compression.cast`` (no bound: their measured error is reported);
* ``zstd-q``: the same quantization codes as ``eb``, as plain bytes through zstd (no deduplication, no
  layout choice): what the stages after quantization add;
* ``sz3-nopred``, ``sz3``: SZ3 (``pysz``) in absolute-bound mode without prediction and with its default
  interpolation + Lorenzo predictor; ``zfp``: ZFP (``zfpy``) fixed-accuracy mode. These are optional
  (``pip install recstack[bench]``) and left out when not installed.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from recstack.compression.eb import packing as pk
from recstack.compression.eb.core import decode, encode
from recstack.compression.registry import get_codec


@dataclass
class Baseline:
    name: str
    encode: Callable[[np.ndarray, float], Any]  # (values [N, D], eb_abs) -> compressed object (codec's own type)
    decode: Callable[[Any, tuple[int, int]], np.ndarray]
    size: Callable[[Any], int]
    bounded: bool  # honours eb_abs (else a fixed-rate format whose error is only measured)


def _torch_codec(name: str) -> Baseline:
    codec = get_codec(name)
    return Baseline(name, lambda a, eb: codec.encode(torch.from_numpy(a)),
                    lambda p, shape: codec.decode(p, shape).numpy(), lambda p: p.numel(), False)


def _eb(lossless: str) -> Baseline:
    def enc(a: np.ndarray, eb_abs: float) -> torch.Tensor:
        return encode(torch.from_numpy(a), eb_abs, relative=False, lossless=lossless)

    return Baseline("eb" if lossless == "auto" else f"eb-{lossless}", enc, lambda p, shape: decode(p).numpy(),
                    lambda p: p.numel(), True)


def _zstd_codes_encode(a: np.ndarray, eb_abs: float) -> tuple[bytes, float, int, int]:
    step = 2.0 * eb_abs * (1.0 - 2.0**-12)
    q = np.rint(a.astype(np.float64) / step) if step > 0 else np.zeros(a.shape)
    qmin = int(q.min()) if q.size else 0
    codes = (q - qmin).astype(np.uint16 if q.size and q.max() - qmin > 255 else np.uint8)
    return pk.zstd_contexts()[0].compress(codes.tobytes()), step, qmin, codes.dtype.itemsize


def _zstd_codes_decode(p: tuple[bytes, float, int, int], shape: tuple[int, int]) -> np.ndarray:
    data, step, qmin, itemsize = p
    codes = np.frombuffer(pk.zstd_contexts()[1].decompress(data), dtype=np.uint16 if itemsize == 2 else np.uint8)
    return ((codes.astype(np.float64) + qmin) * step).astype(np.float32).reshape(shape)


def _sz3(algorithm: str) -> Baseline:
    from pysz import sz, szAlgorithm, szConfig, szErrorBoundMode

    def enc(a: np.ndarray, eb_abs: float) -> np.ndarray:
        c = szConfig()
        c.errorBoundMode = szErrorBoundMode.ABS
        c.absErrorBound = float(eb_abs)
        c.cmprAlgo = getattr(szAlgorithm, algorithm)
        c.openmp = False
        return sz.compress(np.ascontiguousarray(a), c)[0]

    name = "sz3-nopred" if algorithm == "NOPRED" else "sz3"
    return Baseline(name, enc, lambda p, shape: sz.decompress(p, np.float32, shape)[0].reshape(shape),
                    lambda p: p.size, True)


def _zfp() -> Baseline:
    import zfpy

    return Baseline("zfp", lambda a, eb: zfpy.compress_numpy(np.ascontiguousarray(a), tolerance=float(eb)),
                    lambda p, shape: zfpy.decompress_numpy(p).reshape(shape), len, True)


def available_baselines(names: list[str] | None = None) -> list[Baseline]:
    """The baselines that can run here (SZ3 and ZFP only when installed), optionally only ``names``."""
    out = [_eb("auto"), _eb("bitpack"), _torch_codec("fp16"), _torch_codec("bf16"), _torch_codec("int8"),
           _torch_codec("fp8"), Baseline("zstd-q", _zstd_codes_encode, _zstd_codes_decode, lambda p: len(p[0]), True)]
    if importlib.util.find_spec("pysz") is not None:
        out += [_sz3("NOPRED"), _sz3("INTERP_LORENZO")]
    if importlib.util.find_spec("zfpy") is not None:
        out.append(_zfp())
    if names:
        unknown = set(names) - {b.name for b in out}
        if unknown:
            raise ValueError(f"unknown or unavailable codecs {sorted(unknown)} (here: {[b.name for b in out]})")
        out = [b for b in out if b.name in names]
    return out


def run_baseline(b: Baseline, a: np.ndarray, eb_abs: float) -> dict[str, float] | None:
    """-> {"ratio", "max_error", "bytes"} for one payload, None when the codec refuses it (zero bound)."""
    if b.bounded and not eb_abs > 0 and b.name.startswith(("sz3", "zfp", "zstd")):
        return None
    try:
        p = b.encode(a, eb_abs)
        y = b.decode(p, a.shape)
    except (RuntimeError, ValueError) as e:  # e.g. SZ3 rejecting a shape
        return {"error": str(e)}  # type: ignore[dict-item]
    fin = np.isfinite(a)
    err = float(np.abs(y[fin].astype(np.float64) - a[fin].astype(np.float64)).max()) if fin.any() else 0.0
    n = b.size(p)
    return {"ratio": a.nbytes / n if n else math.inf, "max_error": err, "bytes": n}
