"""The distributed throughput bench's own recstack path, end to end in smoke mode (2 real gloo ranks, tiny
tables, a few steps; no TorchRec), so the script cannot rot silently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

SHARDINGS = {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"}
CODECS = ("fp32", "fp16", "bf16", "fp8", "int8")


def test_dist_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "dist.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "dist_throughput.py"), "--quick", "--smoke", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report  # the same JSON on stdout
    assert report["mode"] == "smoke" and report["world_size"] == 2
    assert "torchrec" not in {c["impl"] for c in report["cases"]}

    timed = {c["sharding"] for c in report["cases"] if c["impl"] == "recstack" and c["codec"] == "fp32"}
    assert timed == SHARDINGS
    for c in report["cases"]:
        assert c["samples_per_s"] > 0 and c["cpu_ms_per_step"] > 0, c["name"]
        assert len(c["samples_per_s_rounds"]) == report["rounds"]
    if report["pipeline_available"]:
        assert any(c["pipeline"] for c in report["cases"])

    matrix = {(m["model"], m["sharding"], m["codec"]): m for m in report["bytes_matrix"]}
    assert {(s, c) for _, s, c in matrix} == {(s, c) for s in SHARDINGS for c in CODECS}
    for (model, sharding, codec), m in matrix.items():
        b = m["bytes_per_step"]
        fp32 = matrix[(model, sharding, "fp32")]["bytes_per_step"]
        assert b["fwd_a2a"] > 0 and b["bwd_a2a"] > 0, (model, sharding, codec)
        assert b["input_dist"] == fp32["input_dist"]  # the codec never touches the ids
        # Fixed-size codecs send no per-chunk header and no size exchange: the ratio is the per-row one
        # (the report rounds it to 3 decimals). Column-wise rows are half as wide, so its ratio is checked
        # against the row ratio of dim/2.
        row = m["row_ratio_vs_fp32"]
        if sharding == "column_wise":
            d = 8 if model == "d16" else 32
            per_row = {"fp32": 4 * d, "fp16": 2 * d, "bf16": 2 * d, "fp8": d + 4, "int8": d + 8}
            row = 4 * d / per_row[codec]
        assert m["a2a_ratio_vs_fp32"] == pytest.approx(row, abs=1e-3), (model, sharding, codec, row)
    checks = report["checks"]
    assert checks["d16_table_wise_fp16_a2a_bytes_ratio"] == pytest.approx(2.0, abs=1e-3)
    assert checks["d16_table_wise_int8_a2a_bytes_ratio"] == pytest.approx(64 / 24, abs=1e-3)
    assert checks["d64_table_wise_int8_a2a_bytes_ratio"] == pytest.approx(256 / 72, abs=1e-3)
