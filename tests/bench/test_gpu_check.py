"""The pieces of the device check (scripts/gpu_check.sh): its result lines, what it leaves in $OUT,
its bounds, and that it reaches no network. The check itself runs for minutes
(``GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh`` is its rehearsal on the CPU: docs/gpu.md), too
long for the suite."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "scripts" / "gpu_check.sh").read_text()
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import MAX_OUT_FILES, STEPS, out_files, result_line  # noqa: E402


def test_each_step_appends_one_json_line(tmp_path: Path) -> None:
    result_line(
        tmp_path, "parity", True, loss_trace_max_diff=1.23456789e-7, codecs={"fp16": 0.123456789}
    )
    result_line(tmp_path, "serve", False, error="boom")
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert lines == [
        {
            "step": "parity",
            "status": "pass",
            "loss_trace_max_diff": 1.23457e-7,
            "codecs": {"fp16": 0.123457},
        },
        {"step": "serve", "status": "fail", "error": "boom"},
    ]


def test_a_step_that_fails_or_is_unknown_still_writes_its_line(tmp_path: Path) -> None:
    """A step's own failure (here: a CUDA device asked for on a machine without one, or a step name
    that does not exist) is a fail line naming why; the shell's ``record`` writes the line of a
    step killed by its bound."""
    run = [sys.executable, str(ROOT / "scripts" / "gpu_check.py")]
    args = ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    p = subprocess.run(
        [*run, "record", "tiers", "exited", "124", *args],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert p.returncode == 1
    p = subprocess.run([*run, "nonesuch", *args], env=env, capture_output=True, timeout=120)
    assert p.returncode == 1
    lines = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": "tiers", "status": "fail", "error": "exited 124"}
    assert (
        lines[1]["step"] == "nonesuch"
        and lines[1]["status"] == "fail"
        and "unknown step" in lines[1]["error"]
    )
    assert [p.name for p in out_files(tmp_path / "out")] == ["results.jsonl"]


def test_the_script_writes_at_most_eight_files_to_out() -> None:
    """Every file the shell names under OUT_DIR (the steps write only results.jsonl there)."""
    named = set(re.findall(r"\$OUT_DIR/([\w.-]+)", SCRIPT))
    assert named == {"results.jsonl", "steps.log"} and len(named) <= MAX_OUT_FILES


def test_bounds_fit_seven_minutes_on_the_gpu() -> None:
    bounds = [int(s) for s in re.findall(r'^step \w+ "\$\(scale (\d+)\)"$', SCRIPT, re.M)]
    steps = re.findall(r"^step (\w+) ", SCRIPT, re.M)
    assert steps == list(STEPS) and len(bounds) == len(steps)
    assert sum(bounds) + 30 <= 7 * 60  # + the C extension's build (timeout 30)
    assert sum(2 * b for b in bounds) + 30 <= 14 * 60  # the CPU rehearsal's bounds


@pytest.mark.parametrize("name", ["gpu_check.sh", "gpu_check.py", "gpu_check_runs.py"])
def test_the_check_reaches_no_network_and_runs_no_make(name: str) -> None:
    text = (ROOT / "scripts" / name).read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\bmake\b", code)
    assert "pip download" not in code
    for install in re.findall(r"pip install[^\n]*", code):
        assert "--no-index" in install, install
