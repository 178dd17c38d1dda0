"""Error-bounded lossy compression of embedding all-to-all messages (``eb``), with adaptive bounds.

``encode(x, bound)`` / ``decode(message)`` are the codec (``recstack.compression.eb``); ``EbCodec`` is the
all-to-all codec built on it (``recstack.compression.codec``). Names are imported on first use so that the
configuration (``recstack.compression.config``) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "encode": "eb", "decode": "eb", "encode_with_info": "eb", "describe": "eb", "lossless_copy": "eb",
    "EncodeInfo": "eb", "EbFormatError": "format", "EbCodec": "codec", "DualLevelBound": "bounds",
    "CompressionConfig": "config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recstack.compression' has no attribute {name!r}")
    return getattr(importlib.import_module(f"recstack.compression.{_EXPORTS[name]}"), name)
