"""bench/serving_candidates.py runs end to end on small tables (its graph, a few repetitions): every arm
timed, both request forms, the shared path's scores checked against the whole rows' by the script itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serving_candidates_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "candidates.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "serving_candidates.py"), "--max-ind-range", "1000",
                        "--reps", "5", "--out", str(out)], capture_output=True, text=True, env=env, timeout=600,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["compiled"] is False and "one_row_call" not in res
    arms = ["encode_rows", "encode_shared", "score_rows", "score_shared", "request_rows", "request_shared"]
    for form in ("raw", "encoded"):
        assert all(res[form][f"{a}_ms"] > 0 for a in arms), res[form]
        assert res[form]["max_logit_diff"] <= 1e-5
    assert res["raw"]["encode_rows_python_ms"] > 0
