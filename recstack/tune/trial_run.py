"""One trial of ``recstack tune``: a real ``recstack train`` in its own process, watched while it
runs.

A process per trial contains a crash (a trial that diverges or dies fails alone) and lets
``--jobs K`` run K trials side by side, each with ``train.threads`` = cores // K. The study needs
each trial's evaluations while it runs (to prune): the trainer appends one flushed line per
evaluation to ``metrics.jsonl``, and ``EvalTail`` reads the complete lines added since its last
call. A trial's process is asked to die with the tuner (Linux's parent death signal), so a killed
``recstack tune`` leaves no trial training on behind it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from recstack.training.logger import METRICS_FILE

LOG_FILE = "train.log"  # the trial's stdout and stderr
CONFIG_FILE = "config.toml"  # the trial's complete config (best.toml is the best trial's)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """SIGKILL this process when the process that started it dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class EvalTail:
    """The validation AUCs a growing ``metrics.jsonl`` gains, read as the trainer appends to it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0  # bytes read so far

    def read(self) -> list[float]:
        """The AUCs of the ``eval`` records completed since the last call (a line still being
        written waits for the next call); an undefined AUC (one class in the validation rows) reads
        as 0.5, chance."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        records = [json.loads(line) for line in chunk[:end].splitlines()]
        return [
            0.5 if r.get("auc") is None else float(r["auc"])
            for r in records
            if r.get("kind") == "eval"
        ]


class TrialRun:
    """``recstack train --config DIR/config.toml --output-dir DIR`` started in the background.

    Args:
        directory: the trial's directory, holding its ``config.toml``; the run's outputs
            (checkpoints, metrics.jsonl, summary.json) and ``train.log`` go there too.
        threads: torch's intra-op threads for the trial (``train.threads``).
        sets: further ``--set`` overrides on the command line (not in config.toml), such as a seed.
    """

    def __init__(self, directory: Path, threads: int, sets: tuple[str, ...] = ()) -> None:
        self.directory = directory
        cmd = [
            sys.executable,
            "-m",
            "recstack",
            "train",
            "--config",
            str(directory / CONFIG_FILE),
            "--output-dir",
            str(directory),
        ]
        for s in (f"train.threads={threads}", "train.progress=false", *sets):
            cmd += ["--set", s]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with open(directory / LOG_FILE, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_die_with_parent,
            )
        self._evals = EvalTail(directory / METRICS_FILE)
        self.aucs: list[float] = []  # the validation AUC of every evaluation so far, in order

    def new_aucs(self) -> list[float]:
        """The validation AUCs of the evaluations logged since the last call."""
        new = self._evals.read()
        self.aucs += new
        return new

    def poll(self) -> int | None:
        """The exit status once the process has ended, else None."""
        return self.proc.poll()

    def stop(self) -> None:
        """End the trial now (pruned, or the tuner is stopping): SIGKILL, then reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def summary(self) -> dict[str, Any]:
        """The finished run's summary.json."""
        return json.loads((self.directory / "summary.json").read_text())

    def error_line(self) -> str:
        """Why a failed trial failed: the error line of its log (else its last line)."""
        try:
            lines = [
                ln.strip()
                for ln in (self.directory / LOG_FILE).read_text(errors="replace").splitlines()
            ]
        except OSError as e:
            return f"no log ({e})"
        lines = [ln for ln in lines if ln]
        errors = [ln for ln in lines if "error" in ln.lower()]
        status = self.proc.returncode
        why = (
            f"exit status {status}" if status >= 0 else f"killed by {signal.Signals(-status).name}"
        )
        return f"{(errors or lines or ['no output'])[-1]} ({why})"
