"""The 2-rank mode of the memory tiers bench end to end on tiny tables (a real torchrun launch of 2 gloo ranks,
the planner's plan with host- and ssd-cached shards, a few steps), so the script cannot rot silently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_memory_tiers_world2_smoke(tmp_path: Path) -> None:
    out = tmp_path / "world2.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "memory_tiers.py"), "--world", "2", "--quick", "--out", str(out),
         "--ssd-dir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["mode"] == "world2"
    assert report["same_losses"] and report["steps_compared"] > 0  # tiered shards change no value
    assert {t["tier"] for t in report["tiers"].values()} == {"host-cached", "ssd-cached"}
    assert all(0 < t["predicted_hit_rate"] < 1 for t in report["tiers"].values())
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:
        assert 0 < r["hit_rate"] < 1 and r["requests_per_step"] > 0, r
    assert report["samples_per_sec"] > 0 and report["in_memory_samples_per_sec"] > 0
    assert report["planner"]["predicted_step_seconds"] > 0
    assert report["scale"]["tables_vs_budget"] > 1.5  # the shards outgrow the per-rank budgets
