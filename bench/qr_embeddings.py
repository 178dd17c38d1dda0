"""Quotient-remainder tables against full tables and against hashing into the same number of rows.

Data: the synthetic Criteo-shaped click log (known click model, so the best possible AUC is known), the 26
Kaggle table sizes capped at ``--max-rows``, generated once. Model and training: ``configs/demo.toml``
(dim 16, dot interaction, Adam + row-wise Adagrad, one epoch). Arms, each for every ``--seeds`` model seed:

- ``full``: every table whole;
- ``qr-mult`` / ``qr-add``: tables above 200 rows split with m = ``--collisions`` (``model.qr_collisions``);
- ``hash``: every table capped (ids modulo the cap, ``model.max_table_size``) at the cap that gives the same
  total rows as the QR arms (the reference's ``--max-ind-range`` at equal memory).

Reported per arm: embedding rows, AUC / logloss on the held-out tail (mean over seeds), the share of the AUC
gap to the click model's oracle that the arm closes, and training samples/s relative to ``full`` (same run).

    python bench/qr_embeddings.py [--quick] [--out bench/results/qr_embeddings.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recstack.config import load_config  # noqa: E402
from recstack.data.prepared_dataset import PreparedDataset  # noqa: E402
from recstack.embedding.qr import split_rows  # noqa: E402
from recstack.models.config import ModelConfig  # noqa: E402
from recstack.training.trainer import Trainer  # noqa: E402


def equal_rows_cap(sizes: list[int], rows: int) -> int:
    """The largest cap C with sum(min(n, C)) <= rows."""
    lo, hi = 1, max(sizes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(min(n, mid) for n in sizes) <= rows else (lo, mid - 1)
    return lo


def run_arm(data: Path, overrides: list[str], seed: int, threads: int) -> dict[str, Any]:
    cfg = load_config(ROOT / "configs" / "demo.toml", [
        f'data.train="{data}"', f"train.seed={seed}", "train.progress=false", "train.eval_every=0",
        "train.checkpoint_every=0", f"train.threads={threads}", *overrides])
    cfg.data.synth = {}  # the data generated here, not the demo's own [data.synth]
    trainer = Trainer(cfg, None)
    rows = sum(t.num_embeddings for t in trainer.model.embeddings.tables)
    t0 = time.perf_counter()
    s = trainer.train()
    wall = time.perf_counter() - t0
    return {"rows": rows, "auc": s["auc"], "logloss": s["logloss"], "oracle_auc": s.get("oracle_auc"),
            "samples_per_s": s["samples_per_sec"] or s["train_samples"] / wall}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=600_000, help="synthetic rows (600,000)")
    p.add_argument("--max-rows", type=int, default=100_000, help="cap of the generated tables (100,000)")
    p.add_argument("--collisions", type=int, default=4, help="m of the QR arms (4)")
    p.add_argument("--seeds", default="0,1", help="model seeds (0,1)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="60,000 rows, one seed")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.seeds = 60_000, "0"
    seeds = [int(s) for s in a.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        from recstack.data.synth.generate import SynthConfig, generate

        generate(SynthConfig(rows=a.rows, seed=0, max_table_size=a.max_rows), data, progress=False)
        sizes = PreparedDataset(data).table_sizes
        threshold = ModelConfig().qr_threshold
        qr_rows = sum(sum(r) if (r := split_rows(n, a.collisions, threshold)) else n for n in sizes)
        cap = equal_rows_cap(sizes, qr_rows)
        qr = [f"model.qr_collisions={a.collisions}", f"model.qr_threshold={threshold}"]
        arms = {"full": [], "qr-mult": [*qr, 'model.qr_operation="mult"'], "qr-add": [*qr, 'model.qr_operation="add"'],
                "hash": [f"model.max_table_size={cap}"]}
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in arms}
        for seed in seeds:
            for name, overrides in arms.items():
                runs[name].append(run_arm(data, overrides, seed, a.threads))
                r = runs[name][-1]
                print(f"seed {seed} {name:8s} rows {r['rows']:>9,}  AUC {r['auc']:.4f}  logloss {r['logloss']:.4f}  "
                      f"{r['samples_per_s']:,.0f} samples/s", file=sys.stderr)
    full_speed = [r["samples_per_s"] for r in runs["full"]]
    results = []
    for name, rs in runs.items():
        oracle = rs[0]["oracle_auc"]
        auc = statistics.mean(r["auc"] for r in rs)
        results.append({
            "arm": name, "rows": rs[0]["rows"], "rows_vs_full": rs[0]["rows"] / runs["full"][0]["rows"],
            "auc": auc, "auc_per_seed": [r["auc"] for r in rs],
            "logloss": statistics.mean(r["logloss"] for r in rs),
            "auc_gap_closed": (auc - 0.5) / (oracle - 0.5) if oracle else None,
            "speed_vs_full": statistics.mean(r["samples_per_s"] / f for r, f in zip(rs, full_speed, strict=True)),
        })
    out = {"benchmark": "qr_embeddings", "rows": a.rows, "max_table_rows": a.max_rows, "collisions": a.collisions,
           "hash_cap": cap, "seeds": seeds, "oracle_auc": runs["full"][0]["oracle_auc"], "results": results}
    print("| arm | embedding rows | vs full | AUC (mean) | logloss | AUC gap closed | samples/s vs full |",
          file=sys.stderr)
    print("|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in results:
        print(f"| {r['arm']} | {r['rows']:,} | {r['rows_vs_full']:.2f} | {r['auc']:.4f} | {r['logloss']:.4f} | "
              f"{r['auc_gap_closed']:.3f} | {r['speed_vs_full']:.2f}x |", file=sys.stderr)
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
