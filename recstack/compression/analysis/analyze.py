"""What captured all-to-all payloads look like and how well each codec does (``recstack analyze-a2a``).

Per file: shape, value range, distinct rows (exact, and after quantization at the bound), order-0 entropy
of the quantization codes, and for each codec the ratio and the largest error it made; ``report`` averages
them over the steps and ranks of each (direction, table). Captured payloads come from ``recstack train
--dump-a2a DIR``; raw little-endian float32 files (dumps from other DLRM code) are read with a given shape.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

DEFAULT_CODECS = ["eb", "fp16", "int8", "zstd-q", "sz3-nopred", "sz3", "zfp"]


def code_stats(a: np.ndarray, eb_abs: float) -> dict[str, float]:
    """Distinct rows (exact and of quantization codes) and the codes' order-0 entropy in bits."""
    fin = np.isfinite(a).all(axis=1)
    exact = len(np.unique(a[fin].view(np.uint32), axis=0)) if fin.any() else 0
    if not eb_abs > 0 or not fin.any():
        return {"distinct_rows": exact, "distinct_code_rows": exact, "code_entropy_bits": float("nan")}
    q = np.rint(a[fin].astype(np.float64) / (2.0 * eb_abs)).astype(np.int64)
    _, counts = np.unique(q, return_counts=True)
    p = counts / counts.sum()
    return {"distinct_rows": exact, "distinct_code_rows": len(np.unique(q, axis=0)),
            "code_entropy_bits": float(-(p * np.log2(p)).sum())}


def analyze_array(a: np.ndarray, bound: float, relative: bool, codecs: list) -> dict[str, Any]:
    """Figures of one payload [N, D] at ``bound`` (relative to its finite range, or absolute)."""
    from recstack.compression.analysis.baselines import run_baseline

    fin = a[np.isfinite(a)]
    lo, hi = (float(fin.min()), float(fin.max())) if fin.size else (math.nan, math.nan)
    eb_abs = bound * (hi - lo) if relative else bound
    out: dict[str, Any] = {"shape": list(a.shape), "min": lo, "max": hi, "range": hi - lo, "eb_abs": eb_abs,
                           "non_finite": int(a.size - fin.size)}
    out.update(code_stats(a, eb_abs))
    results = {}
    for b in codecs:
        r = run_baseline(b, a, eb_abs)
        if r is not None:
            if "max_error" in r and b.bounded:
                r["within_bound"] = bool(r["max_error"] <= eb_abs)
            results[b.name] = r
    out["codecs"] = results
    return out


def analyze(paths: list[str], bound: float, relative: bool, raw_shape: tuple[int, int] | None,
            codec_names: list[str] | None, directions: list[str] | None = None) -> list[dict[str, Any]]:
    """-> one dict per payload file (see ``analyze_array``) with its file, direction, table, step and rank."""
    from recstack.compression.analysis.baselines import available_baselines  # torch and the codecs: only when run
    from recstack.compression.analysis.capture import find_payloads

    payloads = [p for p in find_payloads(paths) if not directions or p.direction in directions]
    if not payloads:
        raise ValueError(f"{', '.join(paths)}: no payload files found")
    names = codec_names if codec_names else None
    codecs = available_baselines(names) if names else [b for b in available_baselines() if b.name in DEFAULT_CODECS]
    rows = []
    for p in payloads:
        row = {"file": str(p.path), "direction": p.direction, "table": p.table, "feature": p.feature,
               "table_rows": p.rows, "step": p.step, "rank": p.rank}
        row.update(analyze_array(p.load(raw_shape), bound, relative, codecs))
        rows.append(row)
    return rows


def _geomean(values: list[float]) -> float:
    v = [x for x in values if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")


def report(rows: list[dict[str, Any]], bound: float, relative: bool) -> str:
    """Text table: one line per (direction, table), averaged over steps and ranks, plus geometric means."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["direction"], r["table"])].append(r)
    names = list(dict.fromkeys(n for r in rows for n in r["codecs"]))
    kind = "relative" if relative else "absolute"
    head = f"{'dir':4} {'table':>10} {'rows':>9} {'range':>9} {'distinct':>9} {'H bits':>6} " + " ".join(
        f"{n:>10}" for n in names)
    lines = [f"bound {bound:g} ({kind}); ratio per codec (x = exceeded the bound)", head, "-" * len(head)]
    per_codec: dict[str, list[float]] = defaultdict(list)
    for (direction, table), rs in sorted(groups.items()):
        cells = []
        for n in names:
            got = [r["codecs"][n] for r in rs if n in r["codecs"] and "ratio" in r["codecs"][n]]
            if not got:
                cells.append(f"{'-':>10}")
                continue
            ratio = _geomean([g["ratio"] for g in got])
            per_codec[n].append(ratio)
            bad = any(g.get("within_bound") is False for g in got)
            cells.append(f"{ratio:>9.2f}{'x' if bad else ' '}")
        mean = {k: float(np.mean([r[k] for r in rs])) for k in ("range", "distinct_rows", "code_entropy_bits")}
        n_rows = f"{rs[0]['shape'][0]:.0f}"
        lines.append(f"{direction:4} {table:>10} {rs[0]['table_rows']:>9} {mean['range']:>9.3g} "
                     f"{mean['distinct_rows']:>4.0f}/{n_rows:<4} {mean['code_entropy_bits']:>6.2f} " + " ".join(cells))
    lines.append("geometric mean over tables: " + ", ".join(f"{n} {_geomean(v):.2f}" for n, v in per_codec.items()))
    return "\n".join(lines)
