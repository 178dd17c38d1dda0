"""How long the value scan before training (``recstack.data.integrity.check_values``) and the data fingerprint take.

Writes a Criteo-shaped prepared set (13 dense, 26 sparse features) of ``--rows`` rows into a temporary directory,
then times one scan (labels and dense inputs, 16 MiB of an array at a time) and one fingerprint, from the page
cache (the set was just written). Prints JSON.

    python bench/data_checks.py [--rows 4000000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from recstack.data.format import SparseFeatureSpec  # noqa: E402
from recstack.data.integrity import check_values, fingerprint  # noqa: E402
from recstack.data.prepared_dataset import PreparedDataset  # noqa: E402
from recstack.data.prepared_writer import PreparedWriter  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4_000_000)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data"
        specs = [SparseFeatureSpec(f"C{i + 1}", 1000) for i in range(26)]
        with PreparedWriter(path, [f"I{i + 1}" for i in range(13)], specs) as w:
            for start in range(0, args.rows, 1 << 20):
                n = min(1 << 20, args.rows - start)
                w.write((rng.random(n) < 0.25).astype(np.float32), rng.random((n, 13), dtype=np.float32),
                        rng.integers(0, 1000, (n, 26), dtype=np.int32))
        ds = PreparedDataset(path)
        t0 = time.perf_counter()
        check_values(ds)
        scan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fingerprint(ds)
        fingerprint_s = time.perf_counter() - t0
        scanned = sum((path / f"{name}.bin").stat().st_size for name in ("labels", "dense"))
    print(json.dumps({"rows": args.rows, "scanned_bytes": scanned, "scan_s": round(scan_s, 4),
                      "scan_mb_per_s": round(scanned / 1e6 / scan_s, 1),
                      "fingerprint_ms": round(fingerprint_s * 1e3, 2)}, indent=2))


if __name__ == "__main__":
    main()
