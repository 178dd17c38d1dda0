"""``[memory]``: embedding memory budgets (which tables get cached tiers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from recstack.errors import ConfigError
from recstack.units import parse_bytes


@dataclass
class MemoryConfig:
    """Embedding memory budgets (of the process; under torchrun of each rank: see docs/memory_tiers.md). Sizes
    are bytes or strings such as ``"512MB"`` or ``"2GiB"``; ``""`` = no budget. With a budget set, tables that do
    not fit in ``device`` memory get a cache there over their rows in host memory (``host`` budget) or, past
    that, in a file in ``ssd_dir``."""

    device: int | str = ""
    host: int | str = ""
    ssd_dir: str = ""
    cache_policy: Literal["lru", "lfu"] = "lru"
    prefetch: bool = True  # fetch the next batch's rows while the current batch computes

    def validate(self) -> None:
        """``device`` and ``host`` are sizes; a ConfigError names the field."""
        for name in ("device", "host"):
            try:
                parse_bytes(getattr(self, name))
            except ValueError as e:
                raise ConfigError(f"memory.{name}: {e}") from e
