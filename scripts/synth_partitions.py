"""Replay a synthetic click log (``recstack data synth``) as a directory stream: one CSV partition per day, each
written to a hidden temporary and renamed into place, ``--every-s`` seconds apart, plus the schema that reads
them (``identity`` tables of the log's sizes; ``vertical``, ``example_id`` and ``day`` as its ``[columns]``).

    python scripts/synth_partitions.py runs/synth-log runs/stream-in --schema runs/stream.toml --every-s 2

The partitions feed ``recstack exfm run --stream runs/stream-in --schema runs/stream.toml`` (docs/streaming.md)
or ``recstack train --stream``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from recstack.data.prepared_dataset import PreparedDataset


def schema_text(ds: PreparedDataset) -> str:
    """The schema of the partitions ``write_partitions`` makes from ``ds``."""
    parts = ['[source]\nformat = "csv"\n\n[label]\ncolumn = "label"\n']
    parts += [f'[[dense]]\nname = "{name}"\n' for name in ds.dense_features]
    parts += [f'[[sparse]]\nname = "{s.name}"\nencoding = "identity"\nsize = {s.num_embeddings}\n'
              for s in ds.sparse_features]
    parts.append('[columns]\nexample_id = "example_id"\ntimestamp = "day"\nvertical = "vertical"\n')
    return "\n".join(parts)


def write_partitions(ds: PreparedDataset, out: Path, every_s: float) -> None:
    """One ``part-<day>.csv`` per day of ``ds`` into ``out``, ``every_s`` seconds apart."""
    cols = {k: np.asarray(ds.column(k)) for k in ("labels", "dense", "sparse", "vertical", "example_id",
                                                  "timestamp")}
    header = ",".join(["label", *ds.dense_features, *(s.name for s in ds.sparse_features), "vertical",
                       "example_id", "day"])
    days = np.unique(cols["timestamp"])
    for i, day in enumerate(days):
        rows = np.flatnonzero(cols["timestamp"] == day)
        lines = [header] + [",".join([str(int(cols["labels"][r])), *(repr(float(x)) for x in cols["dense"][r]),
                                      *(str(int(x)) for x in cols["sparse"][r]), f"v{cols['vertical'][r]}",
                                      str(int(cols["example_id"][r])), str(int(day))]) for r in rows]
        name = f"part-{int(day):05d}.csv"
        tmp = out / f".{name}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, out / name)  # a reader sees the whole file or none of it
        print(f"{out / name}: {len(rows)} rows", flush=True)
        if i + 1 < len(days):
            time.sleep(every_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="a prepared synthetic log (recstack data synth --out DATA)")
    p.add_argument("out", help="the stream's directory (created)")
    p.add_argument("--schema", required=True, help="where to write the partitions' schema (TOML)")
    p.add_argument("--every-s", type=float, default=0.0, help="seconds between partitions")
    args = p.parse_args()
    ds = PreparedDataset(args.data)
    if any(s.multi_hot for s in ds.sparse_features) or not ds.has("timestamp"):
        raise SystemExit(f"{args.data}: not a synthetic log of recstack data synth (one id per feature, days)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.schema).write_text(schema_text(ds))
    write_partitions(ds, out, args.every_s)


if __name__ == "__main__":
    main()
