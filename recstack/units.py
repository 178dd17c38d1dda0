"""Byte sizes as people write them, and back: the one home of size parsing and formatting.

Two spellings are in use, each where its readers expect it:

* memory budgets in the config (``memory.device = "2GiB"``): ``parse_bytes`` takes a whole number of bytes or a
  number with a unit, any case: ``B``, ``KB``/``K`` ... ``TB``/``T`` (decimal) and ``KiB`` ... ``TiB`` (binary);
  ``format_bytes`` prints binary units (``1.5 GiB``), as operating systems report memory.
* the sharding planner's hardware (``--hbm 80GB``, ``--intra-bw 200Gb/s``): ``parse_quantity`` reads sizes and
  bandwidths with the prefixes ``k m g t p`` (decimal) or ``ki mi gi ti pi`` (binary), where ``B`` is a byte and
  ``b``/``bit``/``bits`` a bit (network gear is sold in bits), exactly (a Decimal); ``format_bytes(n,
  decimal=True)`` prints decimal units (``80.0 GB``), as device memory is sold.
* durations (``recstack tune --time-budget 20m``): ``parse_duration`` takes seconds, or a number with ``s``,
  ``m``, ``h`` or ``d``.

No torch here: the planner and the config use it without loading it.

Also the one bound on thread counts (``MAX_THREADS``): torch's OpenMP pool, asked for 100,000
threads, dies by SIGSEGV when it starts them, so every option that sets one (``train.threads``,
``experiment.threads``, ``serve --threads``) is checked against it.
"""

from __future__ import annotations

import re
from decimal import Decimal

_BUDGET_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                 "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

_PREFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
           "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_QUANTITY = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([kmgtp]i?)?(b|bit|bits)?(/s|ps)?\s*", re.IGNORECASE)

MAX_THREADS = 1024  # threads of one process's intra-op pool: far above any machine's useful count

_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_DECIMAL = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def parse_bytes(value: int | str) -> int | None:
    """A memory budget: ``2_000_000``, ``"512MB"``, ``"2GiB"``, ``"1.5 GB"`` -> bytes; ``""`` -> None (no budget).
    Raises ValueError for anything else (a negative number, an unknown unit, a bool)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if value.strip() == "":
        return None
    m = _BUDGET.match(value)
    if m is None or m.group(2).lower() not in _BUDGET_UNITS:
        raise ValueError(f"{value!r} is not a size (bytes, or a number with B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(float(m.group(1)) * _BUDGET_UNITS[m.group(2).lower()])


def parse_quantity(text: str, rate: bool = False) -> Decimal:
    """Planner hardware: bytes (or, with ``rate``, bytes per second, ``/s`` or ``ps``) as an exact decimal:
    ``"80GB"`` -> 8e10, ``"64GiB"`` -> 2**36, ``"4.1MB"`` -> 4,100,000 (binary floats give 4,099,999),
    ``"200Gb/s"`` -> 2.5e10. Raises ValueError for anything else, and for a rate where a size is expected."""
    m = _QUANTITY.fullmatch(text)
    if not m or (m.group(4) and not rate):
        kind = "bandwidth like 12.5GB/s" if rate else "size like 80GB"
        raise ValueError(f"{text!r} is not a {kind}")
    value = Decimal(m.group(1)) * _PREFIX[(m.group(2) or "").lower()]
    bits = m.group(3) not in (None, "B")  # 'b', 'bit', 'bits': network gear is sold in bits
    return value / 8 if bits else value


def format_bytes(n: float, decimal: bool = False) -> str:
    """Bytes with one decimal in the largest unit they reach: binary units (1536 -> '1.5 KiB'), or decimal ones
    with ``decimal`` (80e9 -> '80.0 GB'); whole bytes below a kilobyte ('512 B')."""
    for unit, scale in _DECIMAL if decimal else _BINARY:
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``"20m"``, ``"1.5h"``, ``"90s"``, ``"90"`` -> seconds. Raises ValueError for anything else."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a duration (seconds, or a number with s, m, h or d: 20m, 1.5h)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
