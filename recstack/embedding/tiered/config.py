"""``[memory]``: embedding memory budgets (which tables get cached tiers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryConfig:
    """Embedding memory budgets (single process; see docs/memory_tiers.md). Sizes are bytes or strings such as
    ``"512MB"`` or ``"2GiB"``; ``""`` = no budget. With a budget set, tables that do not fit in ``device`` memory
    get a cache there over their rows in host memory (``host`` budget) or, past that, in a file in ``ssd_dir``."""

    device: int | str = ""
    host: int | str = ""
    ssd_dir: str = ""
    cache_policy: str = "lru"  # lru | lfu
    prefetch: bool = True  # fetch the next batch's rows while the current batch computes
