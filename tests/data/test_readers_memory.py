"""Preparing a Parquet file larger than the memory the process may use: a subprocess whose address space is
capped (RLIMIT_AS) below the file's size prepares it completely, and its peak RSS grows by a fraction of
the decoded data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROWS = 1_300_000
CAP_MIB = 40  # address space the preparing process may add after its imports and a warm-up run

SCHEMA = """
[label]
column = "click"
[[dense]]
name = "price"
transform = "log1p"
[[dense]]
name = "score"
transform = "standardize"
[[sparse]]
name = "user"
encoding = "hash"
hash_size = 100000
[[sparse]]
name = "item"
encoding = "hash"
hash_size = 100000
[[sparse]]
name = "shop"
min_freq = 2
[[sparse]]
name = "tags"
multi_hot = true
encoding = "identity"
size = 5000
"""

# Runs in the capped process: warm up on a small file (library code and allocator pools are then resident
# and are not counted), cap the address space, prepare the big file, report.
SCRIPT = """
import json, re, resource, sys, time
from recstack.data.prepare.schema_prepare import prepare_dataset
from recstack.data.prepare.schema import load_schema
d = sys.argv[1]
schema = load_schema(d + "/s.toml")
prepare_dataset(schema, [d + "/small.parquet"], d + "/warm", progress=False, chunk_rows=16384)
def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
cap = status("VmSize") + int(sys.argv[2]) * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak RSS (VmHWM) to the current RSS
    f.write("5")
base = status("VmRSS")
t = time.perf_counter()
report = prepare_dataset(schema, [d + "/big.parquet"], d + "/out", progress=False, chunk_rows=16384)
print(json.dumps({"rows": report.total_rows, "growth_mib": (status("VmHWM") - base) / 2**20,
                  "seconds": time.perf_counter() - t}))
"""


def _table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 6, n)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return pa.table({
        "click": pa.array(rng.integers(0, 2, n).astype(np.int8)),
        "price": pa.array(rng.lognormal(2, 1, n)),
        "score": pa.array(rng.normal(0, 1, n)),
        "user": pc.cast(pa.array(rng.integers(0, 200_000, n)), pa.string()),
        "item": pc.cast(pa.array(rng.integers(0, 50_000, n)), pa.string()),
        "shop": pc.cast(pa.array(rng.integers(0, 1000, n)), pa.string()),
        "tags": pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 5000, int(lens.sum())))),
    })


def test_parquet_larger_than_the_memory_cap(tmp_path: Path) -> None:
    (tmp_path / "s.toml").write_text(SCHEMA)
    big = _table(ROWS, 0)
    pq.write_table(big, tmp_path / "big.parquet", row_group_size=25_000)
    pq.write_table(_table(20_000, 1), tmp_path / "small.parquet")
    file_mib = (tmp_path / "big.parquet").stat().st_size / 2**20
    decoded_mib = big.nbytes / 2**20
    assert file_mib > CAP_MIB and decoded_mib > 2 * CAP_MIB  # the whole file cannot fit in what is allowed

    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(CAP_MIB)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rows"] == ROWS
    assert result["growth_mib"] < decoded_mib / 3, (result, decoded_mib)
    print(f"prepared {ROWS:,} rows ({file_mib:.0f} MiB file, {decoded_mib:.0f} MiB decoded) under a "
          f"{CAP_MIB} MiB cap: peak RSS +{result['growth_mib']:.0f} MiB, {ROWS / result['seconds']:,.0f} rows/s")

    from recstack.data.prepared_dataset import PreparedDataset

    ds = PreparedDataset(tmp_path / "out")
    assert len(ds) == ROWS
    np.testing.assert_array_equal(ds.column("labels"), big.column("click").to_numpy().astype(np.float32))
    lengths = np.diff(np.asarray(ds.column("tags.offsets")))
    want = np.maximum(pc.list_value_length(big.column("tags")).to_numpy(), 1)  # an empty bag holds "missing"
    np.testing.assert_array_equal(lengths, want)
