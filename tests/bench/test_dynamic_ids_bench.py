"""``bench/dynamic_ids.py`` on a tiny stream: every arm runs, the dynamic arms stay within capacity without a
collision, the hashed ones collide, and the report is what the script wrote."""

from __future__ import annotations

import json
from pathlib import Path

from bench.dynamic_ids import main


def test_bench_reports_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = main(["--rows", "6000", "--windows", "3", "--seeds", "0", "--data", str(tmp_path / "stream"),
              "--out", str(out)])
    assert set(r["arms"]) == {"dynamic", "hashed", "hashed_bytes", "unlimited"}
    dyn, unl = r["arms"]["dynamic"], r["arms"]["unlimited"]
    assert dyn["collisions"] == 0 and dyn["evictions"] > 0 and dyn["max_share_of_capacity_in_use"] <= 1.0
    assert unl["evictions"] == 0 and unl["collisions"] == 0
    assert r["arms"]["hashed"]["collisions"] > 0 and r["arms"]["hashed"]["rows"] == dyn["rows"]
    assert len(dyn["window_auc"]) == 3 and 0.5 < dyn["progressive_auc"] < 1.0
    assert json.loads(out.read_text())["verdict"] == r["verdict"]
