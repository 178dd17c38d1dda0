"""Dynamic id tables against hashed tables of the same memory and against unlimited memory, on a stream.

Data: the synthetic click log (known click model) with raw int64 ids and ``id_churn``: every window (a day of
the generator) a share of each table's ids leaves and as many new ids arrive, each new id with effects of its
own. Model: ``configs/demo.toml``'s DLRM (dim 16, dot interaction, Adam + row-wise Adagrad). The stream is
read once, window by window; each window is first scored (progressive validation, what streaming systems
report) and then trained on. Arms, all from the same seeds:

- ``dynamic``: ``model.dynamic_ids`` with ``capacity`` = 1/4 of each table's distinct ids over the stream
  (``--eviction``, ``--admit-after``);
- ``hashed``: ids modulo the same number of rows per table (``model.max_table_size`` style hashing);
- ``hashed_bytes``: hashed into as many rows as the dynamic arm's bytes, its id map counted (map entries,
  per-row metadata and candidates: the dynamic arm's real footprint, so the comparison cannot flatter it);
- ``unlimited``: dynamic tables of a capacity above every table's distinct ids (nothing is ever evicted).

Reported per arm: progressive AUC over windows 1.. (window 0 is scored by an untrained model), per-window AUC,
table rows and the largest rows in use over the run (within capacity), collisions (distinct ids of one window
sharing a row; by construction 0 for the dynamic arms, counted from the maps), and the verdict on the targets
(dynamic >= hashed, dynamic >= 0.99 x unlimited).

    python bench/dynamic_ids.py [--quick] [--out bench/results/dynamic_ids.json]
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

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recstack.config import load_config  # noqa: E402
from recstack.data.loader import BatchLoader  # noqa: E402
from recstack.data.prepared_dataset import PreparedDataset  # noqa: E402
from recstack.data.synth.generate import SynthConfig, generate  # noqa: E402
from recstack.embedding.dynamic import DynamicIdsConfig  # noqa: E402
from recstack.embedding.dynamic_stage import DynamicIds  # noqa: E402
from recstack.embedding.sparse_optim import SparseOptimizer, sparse_optimizer_config  # noqa: E402
from recstack.metrics import BinaryMetrics  # noqa: E402
from recstack.models.build import build_model  # noqa: E402
from recstack.training.step import build_dense_optimizer, seed_everything  # noqa: E402

TABLES = (40000, 20000, 8000, 3000, 1000, 300, 100, 30)
MAP_BYTES_PER_ROW = 8 * 5  # keys, key_rows, row_id, last_used, hits (int64 each)
CANDIDATE_BYTES = 8 * 3  # cand_keys, cand_count, cand_seen


def windows(ds: PreparedDataset) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of each day (rows are in time order)."""
    day = np.asarray(ds.arrays["timestamp"])
    cuts = np.flatnonzero(np.diff(day)) + 1
    edges = [0, *cuts.tolist(), len(day)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def distinct_ids(ds: PreparedDataset) -> list[int]:
    ids = np.asarray(ds.arrays["sparse"])
    return [int(np.unique(ids[:, f]).size) for f in range(ids.shape[1])]


def hashed_collisions(ds: PreparedDataset, wins: list[tuple[int, int]], caps: list[int]) -> int:
    """Distinct ids of a window that share a row with another id of that window, summed over windows and tables."""
    ids = np.asarray(ds.arrays["sparse"])
    total = 0
    for lo, hi in wins:
        for f, cap in enumerate(caps):
            u = np.unique(ids[lo:hi, f])
            rows, counts = np.unique(u % cap, return_counts=True)
            total += int(counts[counts > 1].sum())
    return total


def run_arm(ds: PreparedDataset, wins: list[tuple[int, int]], sizes: list[int], dyn: DynamicIdsConfig | None,
            seed: int, threads: int) -> dict[str, Any]:
    cfg = load_config(ROOT / "configs" / "demo.toml", [f"train.seed={seed}"])
    torch.set_num_threads(threads)
    seed_everything(seed)
    model = build_model(cfg.model, sparse_optimizer_config(cfg.optim), len(ds.dense_features), sizes, seed=seed,
                        names=ds.table_names, zero_rows=[1 if dyn else 0] * len(sizes))
    stage = DynamicIds(dyn, ds.table_names, model.embeddings, seed) if dyn is not None else None
    opt = build_dense_optimizer(cfg.optim, model.dense_parameters())
    caps = None if stage is not None else sizes  # hashed: ids modulo the table's rows
    progressive, per_window, in_use, remap_s, steps = BinaryMetrics(), [], 0.0, 0.0, 0
    t0 = time.perf_counter()
    for w, (lo, hi) in enumerate(wins):
        model.eval()
        m = BinaryMetrics()
        with torch.no_grad():
            for b in BatchLoader(ds, 8192, (lo, hi), drop_last=False, table_caps=caps, prefetch=0).iterate_epoch():
                b = stage.lookup_batch(b) if stage is not None else b
                logits = model(b).float()
                m.update(logits, b.labels)
                if w > 0:
                    progressive.update(logits, b.labels)
        per_window.append(m.compute()["auc"])
        model.train()
        loader = BatchLoader(ds, cfg.train.batch_size, (lo, hi), drop_last=False, table_caps=caps, prefetch=1)
        for b in loader.iterate_epoch():
            if stage is not None:
                r0 = time.perf_counter()
                b = stage.remap_batch(b)
                remap_s += time.perf_counter() - r0
            steps += 1
            loss = F.binary_cross_entropy_with_logits(model(b).float(), b.labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # also the fused embedding update
            opt.step()
        if stage is not None:
            in_use = max(in_use, max(mp.stats()["rows_in_use"] / (mp.capacity - 1) for mp in stage.maps.values()))
    out = {"progressive_auc": progressive.compute()["auc"], "window_auc": per_window,
           "rows": sum(sizes), "seconds": time.perf_counter() - t0, "steps": steps,
           "remap_ms_per_step": 1e3 * remap_s / max(steps, 1)}
    if stage is not None:
        st = stage.stats()
        out.update(max_share_of_capacity_in_use=in_use, collisions=int(st["dynamic_ids/collisions"]),
                   **{k.split("/")[1]: int(v) for k, v in st.items() if k != "dynamic_ids/collisions"})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--churn", type=float, default=0.25, help="share of each table's ids replaced per window")
    p.add_argument("--eviction", default="lru", choices=["lru", "lfu", "ttl"])
    p.add_argument("--ttl-steps", type=int, default=0)
    p.add_argument("--admit-after", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a small run (tests): 40k rows, 4 windows, one seed")
    p.add_argument("--data", type=Path, help="where the stream is generated (default: a temporary directory)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.windows, a.seeds = 40_000, 4, [0]
    with tempfile.TemporaryDirectory() as tmp:
        data = a.data or Path(tmp) / "stream"
        synth = SynthConfig(rows=a.rows, seed=0, table_sizes=TABLES, num_days=a.windows, id_churn=a.churn,
                            raw_ids=True, max_table_size=None)
        if not (data / "meta.json").is_file() or PreparedDataset(data).info.get("config") != synth.to_dict():
            generate(synth, data, progress=False, overwrite=True)
        ds = PreparedDataset(data)
        wins = windows(ds)
        distinct = distinct_ids(ds)
        quarter = [max(2, -(-n // 4)) for n in distinct]  # per table: 1/4 of its distinct ids
        names = list(ds.table_names)
        quarter = [max(2, -(-n // 4)) for n in distinct]  # per table: 1/4 of its distinct ids

        def dyn(capacity: list[int]) -> DynamicIdsConfig:
            return DynamicIdsConfig(enabled=True, admit_after=a.admit_after, eviction=a.eviction,
                                    ttl_steps=a.ttl_steps, table_capacity=dict(zip(names, capacity, strict=True)))

        row_bytes = 4 * (16 + SparseOptimizer(sparse_optimizer_config(load_config(
            ROOT / "configs" / "demo.toml").optim)).state_width(16))
        extra = (MAP_BYTES_PER_ROW + CANDIDATE_BYTES) / row_bytes
        unlimited = [n + 1 for n in distinct]
        arms: dict[str, tuple[list[int], DynamicIdsConfig | None]] = {
            "dynamic": (quarter, dyn(quarter)), "hashed": (quarter, None),
            "hashed_bytes": ([int(q * (1 + extra)) for q in quarter], None),
            "unlimited": (unlimited, dyn(unlimited))}
        results: dict[str, Any] = {}
        for name, (sizes, dcfg) in arms.items():
            runs = [run_arm(ds, wins, sizes, dcfg, s, a.threads) for s in a.seeds]
            r = runs[0] | {"progressive_auc": statistics.mean(x["progressive_auc"] for x in runs),
                           "progressive_auc_per_seed": [x["progressive_auc"] for x in runs]}
            if dcfg is None:
                r["collisions"] = hashed_collisions(ds, wins, sizes)
            results[name] = r
            print(f"{name}: progressive AUC {r['progressive_auc']:.5f} rows {r['rows']}", file=sys.stderr)
    d, h, u = (results[k]["progressive_auc"] for k in ("dynamic", "hashed", "unlimited"))
    report = {"config": {k: v for k, v in vars(a).items() if k not in ("out", "data")} | {"tables": TABLES},
              "distinct_ids": distinct, "capacity": quarter, "row_bytes": row_bytes,
              "map_bytes_per_row": MAP_BYTES_PER_ROW + CANDIDATE_BYTES, "arms": results,
              "verdict": {"dynamic_ge_hashed": d >= h, "dynamic_ge_hashed_bytes": d >= results["hashed_bytes"][
                  "progressive_auc"], "dynamic_over_unlimited": d / u, "dynamic_ge_0.99_unlimited": d >= 0.99 * u}}
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
