"""bench/serving.py --quick runs every arm end to end (tiny tables, short windows, one worker) and reports every
target of the issue as met, missed or not measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_serving_bench(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "serving.py"), "--quick", "--torchrec-python", "none",
                        "--out", str(out)], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert json.loads(out.read_text()) == res
    sps = res["model"]["samples_per_s"]
    assert set(sps) == {"1", "64", "512", "2048"}
    for arms in sps.values():
        assert set(arms) == {"eager_fp32", "fp32", "int8", "int4"} and all(v > 0 for v in arms.values())
    assert res["torchrec"] == {"skipped": "--torchrec-python none"}
    (h,) = res["http"]
    assert h["workers"] == 1
    for kind in ("1", "100"):
        assert h[kind]["sweep"] and all(r["requests"] >= 1 and r["errors"] == 0 for r in h[kind]["sweep"])
    targets = res["targets"].values()
    assert len(targets) == 5 + len(res["http"]) and all(t["met"] in (True, False, None) for t in targets)
    assert res["targets"]["int8 model-only at batch 2048 >= TorchRec's quantized collection"]["met"] is None
    assert "| target | result |" in p.stderr
