"""bench/publish.py --quick publishes a full version, a delta after 5% of the rows changed, a trained delta, a
forced full version and a short stream of partitions to a real watching server, and reports each one's bytes and
times, each partition's arrival-to-served seconds and the targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_publish_bench(tmp_path: Path) -> None:
    out = tmp_path / "publish.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "publish.py"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert json.loads(out.read_text()) == res
    v = res["versions"]
    assert [(r["name"], r["version"], r["full"]) for r in v] == [
        ("full", 1, True), ("changed_5pct", 2, False), ("trained_2steps", 3, False), ("full_again", 4, True)]
    assert all(r["publish_s"] > 0 and r["publish_to_served_s"] > 0 for r in v)
    # exactly 5% of every table's rows, and the rows the one training step touched
    assert 0.05 <= v[1]["changed_fraction"] < 0.2 and v[1]["bytes"] < v[0]["bytes"]
    f = res["freshness"]  # 3 partitions, each reflected in a served version
    assert len(f["arrival_to_served_s"]) == 3 and 0 < f["max_s"] == max(f["arrival_to_served_s"])
    assert isinstance(res["target"]["partition_served_within_every_s_plus_10s"], bool)
    assert v[3]["bytes_vs_full"] == 1.0 and isinstance(res["target"]["delta_under_20pct_of_full_below_10pct_rows"],
                                                       bool)
