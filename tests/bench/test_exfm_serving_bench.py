"""bench/exfm_serving.py --quick: an ExFM run publishes its ``aux_sa`` VM while it trains, a real ``recstack serve
--watch`` follows it under wrk; the JSON gives the VM's NE gain (the ExFM report's) beside its served latency, and
the run's report carries the served p99 (the JSON's shape is checked here, not its timings)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_exfm_serving_bench(tmp_path: Path) -> None:
    out = tmp_path / "exfm_serving.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "exfm_serving.py"), "--quick", "--work",
                        str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert json.loads(out.read_text()) == res
    (vm,) = res["published"]
    assert (vm["vertical"], vm["arm"], vm["staleness"]) == (0, "aux_sa", 1)
    assert vm["versions"] >= 2 and vm["full_versions"] >= 1 and len(vm["version_bytes"]) == vm["versions"]
    assert vm["ne_gain"] == (vm["alone_ne"] - vm["ne"]) / vm["alone_ne"] * 100
    after = vm["after_training"]
    assert after["rps"] > 0 and 0 < after["p50_ms"] <= after["p99_ms"] and after["non_2xx"] == 0
    during = vm["while_training"]  # None when the stream ended before the server answered (a loaded machine)
    assert during is None or (during["rps"] > 0 and during["p99_ms"] == max(
        w["p99_ms"] for w in vm["windows_while_training"]))
    results = json.loads((tmp_path / "work" / "run" / "results.json").read_text())
    served = results["published_vm"]["served"]
    assert served["p99_ms"] == (during or after)["p99_ms"] and not math.isnan(served["p99_ms"])
    report = (tmp_path / "work" / "run" / "report.md").read_text()
    assert f"p99 {served['p99_ms']:.2f} ms" in report and f"NE gain {vm['ne_gain']:+.2f}%" in report
