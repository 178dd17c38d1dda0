"""ExFM's helper processes under faults, as real processes: a DAS that dies ends the experiment with one clear
error (exit code 3) instead of a traceback or the vertical models waiting ``das_wait_s`` for labels; a runner
that is killed leaves no DAS or task worker running on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_exfm_run import TINY

# More rows than the end-to-end test: the FM trains long enough for the helpers to be caught at work.
LONGER = TINY.replace("rows = 3000", "rows = 60000")


def _children(pid: int) -> dict[int, str]:
    """The child processes of ``pid`` -> their command lines."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    found = {}
    for child in map(int, out):
        try:
            found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass  # ended meanwhile
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, ended and waiting to be reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start(tmp_path: Path, config: str = LONGER) -> subprocess.Popen[str]:
    cfg = tmp_path / "exfm.toml"
    cfg.write_text(config)
    return subprocess.Popen([sys.executable, "-m", "recstack", "exfm", "run", "--config", str(cfg),
                             "--output-dir", str(tmp_path / "run")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen[str], want: str, count: int = 1, timeout: float = 120) -> list[int]:
    """Child pids of ``proc`` whose command line holds ``want``, once there are ``count`` of them."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = [pid for pid, cmd in _children(proc.pid).items() if want in cmd]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {count} {want!r} children of the runner (exit status {proc.poll()})")


def _kill_helper(tmp_path: Path, want: str, config: str) -> str:
    """Run the experiment ``config``, SIGKILL its first helper whose command line holds ``want``:
    the runner must exit 3 with one error line and no traceback -> that line."""
    proc = _start(tmp_path, config)
    try:
        (helper, *_) = _wait_for(proc, want)
        os.kill(helper, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("recstack exfm: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


def test_a_dead_das_is_one_clear_error(tmp_path: Path) -> None:
    # (the runner ends far sooner than experiment.das_wait_s, 1800 s: no waiting on the dead DAS)
    error = _kill_helper(tmp_path, "recstack.exfm.das", LONGER)
    assert "the data augmentation service (DAS) of seed 0 died (signal 9)" in error
    assert str(tmp_path / "run" / "seed0" / "das.log") in error


def test_a_killed_runner_leaves_no_helper_running(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    try:
        _wait_for(proc, "recstack.exfm.das")
        _wait_for(proc, "multiprocessing.spawn")  # a task worker (training the FM)
        helpers = _children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()  # not communicate(): a helper left running would hold the stderr pipe open
        assert proc.stderr is not None
        proc.stderr.close()
        # Each helper checks its parent every 0.5 s; the FM alone trains for far longer than this wait.
        deadline = time.time() + 10
        while time.time() < deadline and any(map(_alive, helpers)):
            time.sleep(0.1)
        left = {pid: cmd for pid, cmd in helpers.items() if _alive(pid)}
    finally:
        for pid in helpers if "helpers" in locals() else {}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert left == {}, left


def test_a_killed_task_worker_is_one_clear_error(tmp_path: Path) -> None:
    """SIGKILL of a task worker (the OOM killer's way): one line naming the death and the tasks it
    ran, exit 3 (a helper process failed), no ``BrokenProcessPool`` traceback."""
    # Killed as soon as it is there: a worker exists only while a task is handed to it, and
    # importing torch alone takes it longer than finding it here.
    error = _kill_helper(tmp_path, "multiprocessing.spawn", TINY)
    assert "an ExFM task worker ended abruptly (killed by a signal" in error, error
    assert "fm/s0" in error and "rerun the same command to continue" in error, error


def test_a_damaged_task_result_is_named_and_the_task_runs_again(tmp_path: Path) -> None:
    """A task's ``result.json`` cut short (a full disk, a crash while an older recstack wrote it):
    the rerun names the file, sets it aside and runs that task again (resuming from its last window
    checkpoint), reusing the others; the report is the one of the first run. It used to stop every
    rerun with a JSON error that named no file."""
    cfg = tmp_path / "exfm.toml"
    cfg.write_text(TINY.replace("rows = 3000", "rows = 2000"))
    out = tmp_path / "run"
    args = [sys.executable, "-m", "recstack", "exfm", "run", "--config", str(cfg), "--output-dir",
            str(out), "--set", 'experiment.arms=["alone", "aux"]',
            "--set", "experiment.verticals=[0]", "--set", "experiment.workers=1"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())["summary"]
    (result,) = [p for p in (out / "seed0" / "vm" / "v0").glob("*/result.json")
                 if json.loads(p.read_text())["job"]["arm"] == "aux"]
    result.write_text(result.read_text()[:100])
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert f"exfm: {result}: damaged result (JSONDecodeError: " in again.stdout, again.stdout
    assert "4 tasks (3 reused from an earlier run of the same config, 1 to run)" in again.stdout
    assert result.with_name("result.json.damaged").is_file()
    assert json.loads(result.read_text())["summary"]
    assert json.loads((out / "results.json").read_text())["summary"] == summary
