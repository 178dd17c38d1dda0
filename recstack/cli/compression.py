"""``recstack analyze-a2a``: what captured all-to-all payloads look like and how well each codec does.

Captured payloads come from ``recstack train --dump-a2a DIR``; raw little-endian float32 files (dumps from
other DLRM code) are read with ``--raw-shape NxD``. The figures are ``recstack.compression.analysis.analyze``'s:
the text report averages over the steps and ranks of each (direction, table); ``--json`` prints the per-file
figures.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np

from recstack.compression.analysis.analyze import DEFAULT_CODECS, analyze, report


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze-a2a", help="value range, distinct rows, entropy and codec ratios of captured "
                                           "all-to-all payloads (or raw float32 files)")
    p.add_argument("paths", nargs="+", help="capture directories (recstack train --dump-a2a) or payload files")
    p.add_argument("--bound", type=float, default=0.03, help="error bound (default 0.03, relative to range)")
    p.add_argument("--abs", dest="absolute", action="store_true", help="the bound is absolute")
    p.add_argument("--raw-shape", help="shape NxD of raw little-endian float32 files, e.g. 2048x64")
    p.add_argument("--codecs", help=f"comma-separated codecs (default: {','.join(DEFAULT_CODECS)} where installed)")
    p.add_argument("--direction", choices=["fwd", "bwd", "raw"], action="append", help="only these payloads")
    p.add_argument("--json", action="store_true", help="print the per-file figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    if not args.bound >= 0:
        raise ValueError(f"--bound must be >= 0, got {args.bound}")
    codecs = [c.strip() for c in args.codecs.split(",")] if args.codecs else None
    rows = analyze(args.paths, args.bound, not args.absolute, _parse_shape(args.raw_shape), codecs, args.direction)
    if args.json:  # JSON has no NaN: undefined figures (entropy of a constant payload) become null
        print(json.dumps(_json_safe(rows), indent=1))
    else:
        print(report(rows, args.bound, not args.absolute))


def _parse_shape(text: str | None) -> tuple[int, int] | None:
    """``--raw-shape NxD`` -> (N, D); N = 0 takes any number of rows."""
    if not text:
        return None
    try:
        n, d = (int(v) for v in text.lower().split("x"))
    except ValueError as e:
        raise ValueError(f"--raw-shape {text!r}: expected NxD, e.g. 2048x64 (N may be 0: any number of rows)") from e
    if n < 0 or d <= 0:
        raise ValueError(f"--raw-shape {text!r}: N must be >= 0 and D > 0")
    return n, d


def _json_safe(v: Any) -> Any:
    """Figures as JSON values: NaN and inf (JSON has neither) become null, NumPy scalars Python ones."""
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    if isinstance(v, float | np.floating):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, np.integer):
        return int(v)
    return v
