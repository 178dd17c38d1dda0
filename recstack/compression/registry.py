"""Codecs by name: the one table of what ``dist.forward_codec`` / ``dist.backward_codec`` may name.

Each name maps to a factory; the codec is built the first time it is asked for and the same instance is
returned afterwards (codecs hold no per-run state unless configured, and the error-bounded one counts its
traffic). ``eb`` is built by importing ``recstack.compression.eb.codec`` only then: it loads the native
loops, which runs with plain casts never need. Nothing registers itself on import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recstack.compression.base import Codec
from recstack.compression.cast import CastCodec, Fp8RowwiseCodec, Int8RowwiseCodec


def _eb() -> Codec:
    from recstack.compression.eb.codec import EbCodec  # default bounds; a run configures its own (runtime.py)

    return EbCodec()


_FACTORIES: dict[str, Callable[[], Codec]] = {
    "fp32": lambda: CastCodec("fp32", torch.float32),
    "fp16": lambda: CastCodec("fp16", torch.float16),
    "bf16": lambda: CastCodec("bf16", torch.bfloat16),
    "fp8": Fp8RowwiseCodec,
    "int8": Int8RowwiseCodec,
    "eb": _eb,
}
_BUILT: dict[str, Codec] = {}


def get_codec(name: str | Codec) -> Codec:
    """The codec called ``name``; a Codec instance (configured by the caller) is returned as it is. Raises
    ValueError for a name not in the table."""
    if isinstance(name, Codec):
        return name
    if name not in _FACTORIES:
        raise ValueError(f"unknown communication codec {name!r} (known: {', '.join(sorted(_FACTORIES))})")
    if name not in _BUILT:
        _BUILT[name] = _FACTORIES[name]()
    return _BUILT[name]
