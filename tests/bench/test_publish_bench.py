"""bench/publish.py --quick publishes a full version, a delta after 5% of the rows changed, a trained delta, a
forced full version and a short stream of partitions to a real watching server, and reports each one's bytes and
times, each partition's arrival-to-served seconds and the targets; its stream arm runs ``recstack train --stream
--publish`` and ``recstack serve --watch`` as processes on 3 raw Criteo partitions (the JSON's shape is checked
here, not its timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_publish_bench(shared_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "publish.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), RECSTACK_SHARED_DATA=str(shared_data))
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
    s = res["stream"]  # every partition served (a number of seconds each), the trainer's versions reported
    assert s["partitions"] == 3 and s["rows_per_partition"] == [250, 250, 250] and s["publish_every_s"] == 2.0
    lags = s["arrival_to_served_s"]
    assert len(lags) == 3 and all(isinstance(x, float) and x > 0 for x in lags), s
    assert s["max_s"] == max(lags) and s["first_partition_s"] == lags[0] and min(lags) <= s["median_s"] <= s["max_s"]
    assert s["target_s"] == 12.0 and s["verdict"] in ("met", "missed")
    assert res["target"]["stream_partition_served_within_publish_every_s_plus_10s"] == (s["verdict"] == "met")
    versions = s["versions"]
    assert [r["version"] for r in versions] == list(range(1, len(versions) + 1)) and len(versions) >= 2
    assert versions[0]["full"] is True and versions[0]["bytes_vs_full"] == 1.0
    assert all(r["bytes"] > 0 and r["publish_s"] > 0 for r in versions)
    assert all(0 < r["bytes_vs_full"] < 1 for r in versions[1:] if not r["full"])
