"""Loading throughput of the epoch orders (``train.shuffle``): how many samples a second ``BatchLoader`` reads
from a prepared set in file order, in shuffled blocks, in a row permutation and in shuffled windows.

Contiguous orders (``none``, ``blocks``) copy one slice of each memory-mapped column per batch; ``rows`` and
``window`` gather each batch's rows by index (sorted, so the map is read in file order). A row permutation
touches pages all over the files; the set is read warm (one untimed pass first), as a set that fits in the page
cache is in training after its first epoch. Each mode reads about ``--rows`` rows in batches of each
``--batch-size`` after a warm-up batch (prefetch off: the loading itself is timed, on the calling thread), and
the index setup of an epoch (the permutation) is timed separately. Output: one JSON object, samples/s per
batch size and mode (``vs_none``: the fraction of file order's rate).

    python -m recstack data synth --out /tmp/synth2m --rows 2000000
    python bench/data_order.py --data /tmp/synth2m [--batch-size 128 4096] [--window 65536 1048576]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recstack.data.loader import BatchLoader  # noqa: E402
from recstack.data.order import SHUFFLES, EpochOrder  # noqa: E402
from recstack.data.prepared_dataset import PreparedDataset  # noqa: E402


def measure(ds: PreparedDataset, mode: str, batch: int, batches: int, window: int, seed: int) -> dict[str, Any]:
    """-> samples/s of ``batches`` batches of ``mode`` read in epoch order, and the epoch's index setup time."""
    t0 = time.perf_counter()
    EpochOrder(mode, 0, len(ds), batch, seed, 0, window)
    setup = time.perf_counter() - t0
    loader = BatchLoader(ds, batch, shuffle=mode, seed=seed, drop_last=False, prefetch=0, shuffle_window=window)
    it = loader.iterate_epoch(limit=batches + 1)
    next(it)  # warm-up: the epoch's order is built
    t0 = time.perf_counter()
    n = 0
    for b in it:
        n += b.batch_size
    seconds = time.perf_counter() - t0
    return {"samples_per_sec": n / seconds, "batches": batches, "epoch_setup_s": setup}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a prepared set (recstack data synth --rows 2000000)")
    ap.add_argument("--batch-size", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--rows", type=int, default=800_000, help="rows read per measurement (whole batches)")
    ap.add_argument("--window", type=int, nargs="+", default=[65536, 1 << 20], help="rows per window (window mode)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ds = PreparedDataset(args.data)
    cases = [(m, 0) for m in SHUFFLES if m != "window"] + [("window", w) for w in args.window]
    results: dict[str, Any] = {}
    for bs in args.batch_size:
        batches = max(1, min(args.rows, len(ds) - bs) // bs)
        per: dict[str, Any] = {}
        for mode, window in cases:
            name = f"window_{window}" if mode == "window" else mode
            measure(ds, mode, bs, batches, window, args.seed)  # untimed: the pages this mode reads are cached
            per[name] = measure(ds, mode, bs, batches, window, args.seed)
        base = per["none"]["samples_per_sec"]
        for r in per.values():
            r["vs_none"] = round(r["samples_per_sec"] / base, 3)
            r["samples_per_sec"] = round(r["samples_per_sec"])
        results[str(bs)] = per
    out = {"bench": "data_order", "rows": len(ds), "dense": len(ds.dense_features),
           "sparse": len(ds.sparse_features), "threads": args.threads,
           "machine": platform.machine(), "cpus": os.cpu_count(), "by_batch_size": results}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
