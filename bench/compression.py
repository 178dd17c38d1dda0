"""Compression ratio and one-thread speed of ``eb`` against SZ3, ZFP, fp16, int8 and zstd on quantized codes,
on all-to-all payloads captured from real training.

Sources (each trained with ``recstack train --dump-a2a``, payloads of the first and the last step):

- ``kaggle``: synthetic data with the 26 Criteo Kaggle table sizes (capped at 200k rows), DLRM dim 16,
  13-512-256-64-16 / 512-256-1, batch 2048;
- ``terabyte``: synthetic data with the Criteo Terabyte table sizes (capped at 100k rows), dim 64,
  13-512-256-64 / 512-512-256-1, batch 2048;
- ``criteo``: the real Criteo Kaggle sample (shared/data, 1,999 rows), dim 16, batch 512.

Every codec gets the same absolute bound per payload: ``--bound`` (default 0.03) times the payload's value
range. Ratios are geometric means over tables (forward and backward payloads apart); speed is total bytes
over total time, each payload's time the best of ``--repeats`` runs, measured as this thread's CPU time
(``--clock wall`` for wall time; CPU time is what one core delivers on a shared machine). SZ3 runs without
OpenMP. Results: JSON (``--out``), a markdown table on stdout, and a chart (``--plot``).

    python bench/compression.py [--quick] [--sources kaggle,terabyte,criteo] [--out FILE] [--plot FILE]

SZ3 and ZFP come from the optional ``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from recstack.compression.analysis.analyze import code_stats  # noqa: E402
from recstack.compression.analysis.baselines import available_baselines  # noqa: E402
from recstack.compression.analysis.capture import find_payloads  # noqa: E402
from recstack.data.prepare.criteo import KAGGLE_CARDINALITIES, TERABYTE_CARDINALITIES  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
CODECS = ["eb", "eb-bitpack", "sz3-nopred", "sz3", "zfp", "fp16", "int8", "zstd-q"]
TARGETS = {"eb_vs_best_sz3": 1.3, "encode_gbps": 0.5, "decode_gbps": 1.0}


def _sources(quick: bool) -> dict[str, dict[str, Any]]:
    steps = 20 if quick else 100
    rows = 2048 * (steps + 12)
    common = ["train.batch_size=2048", f"train.max_steps={steps}", "train.log_every=50", "train.progress=false",
              "train.threads=2", "data.eval_fraction=0.05"]
    return {
        "kaggle": {"steps": steps, "overrides": common + [
            f"data.synth={{rows={rows}, seed=0, table_sizes={list(KAGGLE_CARDINALITIES)}, max_table_size=200000}}",
            "model.embedding_dim=16", "model.bottom_mlp=[512, 256, 64, 16]", "model.top_mlp=[512, 256, 1]"]},
        "terabyte": {"steps": steps, "overrides": common + [
            f"data.synth={{rows={rows}, seed=0, table_sizes={list(TERABYTE_CARDINALITIES)}, max_table_size=100000}}",
            "model.embedding_dim=64", "model.bottom_mlp=[512, 256, 64]", "model.top_mlp=[512, 512, 256, 1]"]},
        "criteo": {"steps": 30, "prepare": SHARED / "criteo_kaggle_sample.tsv", "overrides": [
            "train.batch_size=512", "train.max_steps=30", "train.epochs=20", "train.log_every=10",
            "train.progress=false", "train.threads=2", "model.embedding_dim=16",
            "model.bottom_mlp=[512, 256, 64, 16]", "model.top_mlp=[512, 256, 1]"]},
    }


def capture(name: str, spec: dict[str, Any], work: Path) -> Path:
    """Train the source and dump its payloads (once; reused when the capture exists)."""
    out = work / name / "payloads"
    if (out / "meta.json").is_file():
        return out
    overrides = list(spec["overrides"])
    if "prepare" in spec:
        data = work / name / "data"
        if not (data / "meta.json").is_file():
            subprocess.run([sys.executable, "-m", "recstack", "data", "prepare", str(spec["prepare"]), "--out",
                            str(data), "--overwrite"], check=True, capture_output=True)
        overrides.append(f'data.train="{data}"')
    cmd = [sys.executable, "-m", "recstack", "train", "--output-dir", str(work / name / "run"), "--overwrite",
           "--dump-a2a", str(out), "--dump-steps", f"1,{spec['steps']}"]
    for o in overrides:
        cmd += ["--set", o]
    print(f"capturing {name} ...", file=sys.stderr)
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def _best(fn, repeats: int, clock) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(repeats):
        t0 = clock()
        out = fn()
        best = min(best, clock() - t0)
    return best, out


def measure(payload_dir: Path, bound: float, repeats: int, clock, codecs: list) -> list[dict[str, Any]]:
    rows = []
    for p in find_payloads([payload_dir]):
        a = p.load()
        fin = a[np.isfinite(a)]
        eb_abs = bound * float(fin.max() - fin.min()) if fin.size else 0.0
        row: dict[str, Any] = {"file": p.path.name, "direction": p.direction, "table": p.table, "rows": p.rows,
                               "step": p.step, "shape": list(a.shape), "eb_abs": eb_abs, "codecs": {}}
        row.update(code_stats(a, eb_abs))
        for b in codecs:
            if not eb_abs > 0 and b.bounded:
                continue
            t_enc, enc = _best(lambda b=b, a=a, e=eb_abs: b.encode(a, e), repeats, clock)
            t_dec, y = _best(lambda b=b, enc=enc, a=a: b.decode(enc, a.shape), repeats, clock)
            err = float(np.abs(y.astype(np.float64) - a.astype(np.float64)).max()) if a.size else 0.0
            n = b.size(enc)
            row["codecs"][b.name] = {"bytes": n, "ratio": a.nbytes / n, "max_error": err, "encode_s": t_enc,
                                     "decode_s": t_dec, "within_bound": err <= eb_abs if b.bounded else None}
        rows.append(row)
    return rows


def _geomean(v: list[float]) -> float:
    v = [x for x in v if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for direction in ("fwd", "bwd"):
        rs = [r for r in rows if r["direction"] == direction]
        if not rs:
            continue
        names = list(dict.fromkeys(n for r in rs for n in r["codecs"]))
        per: dict[str, Any] = {}
        for n in names:
            got = [r["codecs"][n] for r in rs if n in r["codecs"]]
            raw = sum(r["shape"][0] * r["shape"][1] * 4 for r in rs if n in r["codecs"])
            per[n] = {"ratio_geomean": _geomean([g["ratio"] for g in got]),
                      "encode_gbps": raw / max(sum(g["encode_s"] for g in got), 1e-12) / 1e9,
                      "decode_gbps": raw / max(sum(g["decode_s"] for g in got), 1e-12) / 1e9,
                      "bound_violations": sum(1 for g in got if g["within_bound"] is False), "payloads": len(got)}
        sz3 = [per[n]["ratio_geomean"] for n in ("sz3-nopred", "sz3") if n in per]
        summary = {"codecs": per, "payloads": len(rs),
                   "distinct_rows_median": statistics.median(r["distinct_rows"] for r in rs)}
        if sz3 and "eb" in per:
            summary["eb_vs_best_sz3"] = per["eb"]["ratio_geomean"] / max(sz3)
        out[direction] = summary
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = []
    for source, res in results["sources"].items():
        for direction, s in res["summary"].items():
            vs = s.get("eb_vs_best_sz3")
            lines.append(f"\n**{source}, {direction}** ({s['payloads']} payloads"
                         + (f"; eb / best SZ3 = {vs:.2f}x" if vs else "") + ")\n")
            lines.append("| codec | ratio (geomean) | encode GB/s | decode GB/s | bound violations |")
            lines.append("|---|---|---|---|---|")
            for n, c in s["codecs"].items():
                lines.append(f"| {n} | {c['ratio_geomean']:.2f} | {c['encode_gbps']:.2f} | {c['decode_gbps']:.2f} "
                             f"| {c['bound_violations']} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(results["sources"])
    fig, axes = plt.subplots(2, len(sources), figsize=(3.4 * len(sources), 6.4), sharey=True, squeeze=False)
    for row, direction in enumerate(("fwd", "bwd")):
        for col, source in enumerate(sources):
            ax = axes[row][col]
            per = results["sources"][source]["summary"].get(direction, {}).get("codecs", {})
            names = list(per)
            ax.bar(names, [per[n]["ratio_geomean"] for n in names],
                   color=["tab:red" if n == "eb" else "tab:gray" for n in names])
            ax.set_yscale("log")
            ax.set_title(f"{source}, {'forward' if direction == 'fwd' else 'backward'}", fontsize=9)
            ax.tick_params(axis="x", rotation=70, labelsize=7)
        axes[row][0].set_ylabel(f"ratio at bound {results['bound']:g}\n(geomean over tables)", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rounded(v: Any) -> Any:
    """Floats to 4 significant digits, so that the per-payload record stays small."""
    if isinstance(v, float):
        return float(f"{v:.4g}") if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short trainings (20 steps), 2 repeats")
    p.add_argument("--sources", default="kaggle,terabyte,criteo")
    p.add_argument("--bound", type=float, default=0.03)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--work", default="/tmp/recstack-bench-compression", help="captures are kept here")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "compression.json"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "compression.png"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one core: the codec's own speed, not the machine's
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    repeats = 2 if args.quick else args.repeats
    codecs = [b for b in available_baselines() if b.name in CODECS]
    specs = _sources(args.quick)
    results: dict[str, Any] = {"bound": args.bound, "clock": args.clock, "repeats": repeats, "targets": TARGETS,
                               "codecs": [b.name for b in codecs], "sources": {}}
    for name in args.sources.split(","):
        if name == "criteo" and not specs[name]["prepare"].is_file():
            print(f"skipping criteo: {specs[name]['prepare']} not found", file=sys.stderr)
            continue
        payloads = capture(name, specs[name], Path(args.work))
        rows = measure(payloads, args.bound, repeats, clock, codecs)
        results["sources"][name] = {"summary": summarize(rows), "payloads": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(_rounded(results), separators=(",", ":")))
    plot(results, Path(args.plot))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
