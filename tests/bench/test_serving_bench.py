"""bench/serving.py --quick runs every arm end to end (tiny tables, short windows, wrk at c = 1 and 8 against
both servers) and reports every target of the issues as met, missed or not measured."""

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
    h = res["http"]  # wrk against recstack serve and the hand-written eager server
    assert {(c["form"], c["candidates"], c["connections"]) for c in h["cells"]} == {
        (f, n, c) for f in ("raw", "encoded") for n in (1, 100) for c in (1, 8)}
    for cell in h["cells"]:
        for server in ("recstack", "eager"):
            assert cell[server]["rps"] > 0 and cell[server]["non_2xx"] == 0, cell
    assert h["lone_request"]["recstack_ms"] > 0 and h["half_saturation_100"]["errors"] == 0
    assert [m["workers"] for m in h["memory"]] == [1, 2] and all(m["pss_mb"] > 0 for m in h["memory"])
    targets = res["targets"].values()
    assert len(targets) == 5 + 4 and all(t["met"] in (True, False, None) for t in targets)
    assert res["targets"]["int8 model-only at batch 2048 >= TorchRec's quantized collection"]["met"] is None
    assert "| target | result |" in p.stderr
