"""Training and evaluation metrics written as JSON lines and TensorBoard scalars.

Each ``log`` call appends one line to ``<output_dir>/metrics.jsonl``::

    {"step": 1200, "kind": "eval", "time": 1718000000.5, "auc": 0.79, "ne": 0.86, ...}

The file is flushed after every line so a crashed or still-running job leaves a readable record (and
``recstack.training.plots`` can draw it live). Non-finite values (an AUC of NaN on a one-class slice, say) are written
as ``null`` because JSON has no NaN. The same values go to TensorBoard as ``<kind>/<key>`` scalars under
``<output_dir>/tb``.

A resumed run opens the logger with ``resume_step``: the file is first rewritten (a temporary file renamed over
it) to hold only the complete records up to that step, which the checkpoint it resumes from has seen, and
TensorBoard hides the events after it, so the steps a killed run logged past its checkpoint are not repeated.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recstack.io import atomic_write_text, writing

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
_RESERVED = ("step", "kind", "time")


def _json_value(key: str, value: Any) -> int | float | None:
    """A JSON-safe number: ints and bools stay exact, other numbers become float, non-finite becomes None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        f = float(value)  # numbers, numpy scalars and one-element tensors
    except (TypeError, ValueError) as e:
        raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__} ({value!r})") from e
    return f if math.isfinite(f) else None


class MetricsLogger:
    """Append-only metrics log. With ``output_dir=None`` every method is a no-op (e.g. non-zero ranks).

    Args:
        output_dir: run directory; created if missing. ``metrics.jsonl`` is appended to, so a resumed run
            continues the same file.
        tensorboard: also write TensorBoard event files to ``output_dir / "tb"``.
        resume_step: the step a resumed run continues from. Records after it (logged by the run that was
            stopped, after its checkpoint) and an incomplete last line are dropped first; TensorBoard hides
            the events after it.
    """

    def __init__(self, output_dir: Path | str | None, tensorboard: bool = True,
                 resume_step: int | None = None) -> None:
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self._file = None
        self._writer = None
        self._closed = False
        self.kept: list[dict[str, Any]] = []  # with resume_step: the records kept from before the resume
        if self.output_dir is None:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self.kept = truncate_jsonl(self.output_dir / METRICS_FILE, resume_step)
        self._file = open(self.output_dir / METRICS_FILE, "a", encoding="utf-8")  # closed in close()
        if tensorboard:
            # Imported here: tensorboard is slow to import and unneeded when the logger is disabled.
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else int(resume_step) + 1  # events from here on are hidden
            self._writer = SummaryWriter(log_dir=str(self.output_dir / TB_DIR), purge_step=purge)

    @property
    def path(self) -> Path | None:
        """The JSONL file, or None when logging is disabled."""
        return None if self.output_dir is None else self.output_dir / METRICS_FILE

    def log(self, step: int, kind: str, values: Mapping[str, Any]) -> None:
        """Record ``values`` (name -> number) of one ``kind`` ("train", "eval", ...) at ``step``."""
        if self.output_dir is None:
            return
        if self._closed:
            raise RuntimeError(f"{self.path}: log() called after close()")
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind must be a non-empty string, got {kind!r}")
        clash = [k for k in values if k in _RESERVED]
        if clash:
            raise ValueError(f"metric name(s) {clash} clash with the reserved fields {list(_RESERVED)}")
        clean = {str(k): _json_value(str(k), v) for k, v in values.items()}
        record = {"step": int(step), "kind": kind, "time": time.time(), **clean}
        assert self._file is not None
        # allow_nan=False guards the "null for non-finite" promise: a NaN slipping through would fail here.
        line = json.dumps(record, allow_nan=False) + "\n"
        with writing(self.output_dir / METRICS_FILE):  # a full disk: a DiskError naming the file
            self._file.write(line)
            self._file.flush()
        if self._writer is not None:
            with writing(self.output_dir / TB_DIR):  # the event writer's thread re-raises its OSError here
                for key, value in clean.items():
                    if value is not None:  # TensorBoard plots NaN as a gap at best; leave the point out
                        self._writer.add_scalar(f"{kind}/{key}", value, global_step=int(step))
                self._writer.flush()

    def close(self) -> None:
        """Flush and close both outputs; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file, in file order. Blank lines are skipped.

    A last line without its newline that does not parse is taken to be a write still in progress and is
    ignored; any other malformed line raises ValueError naming the file and line.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines):  # no trailing newline: the writer has not finished this line
                break
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def truncate_jsonl(path: Path | str, step: int) -> list[dict[str, Any]]:
    """Rewrite a metrics JSONL file to hold only its complete records with ``step <= step`` -> those records.

    Lines that do not parse as a record (an incomplete last line of a killed writer, or one that a later
    append ran into) are dropped. The new file is written beside the old one, fsynced and renamed over it, so
    a crash here leaves one or the other. A missing file stays missing.
    """
    path = Path(path)
    if not path.is_file():
        return []
    kept: list[dict[str, Any]] = []
    lines: list[str] = []
    for line in path.read_text(encoding="utf-8", errors="replace").split("\n"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(record)
            lines.append(line.strip() + "\n")
    atomic_write_text(path, "".join(lines), sync_dir=False)
    return kept


class MetricsWindow:
    """The training figures between two log lines: mean loss, samples/s, loader wait and step time per step.

    ``samples_per_step``: global rows of a full step (batch size x world size), the samples/s numerator.
    Time spent outside the steps is left out of ``time_data_wait`` by ``exclude_pause`` (a checkpoint: still in
    samples/s) or ``restart_clock`` (an evaluation: out of samples/s too)."""

    def __init__(self, samples_per_step: int) -> None:
        self.samples_per_step = samples_per_step
        self.loss, self.n, self.wait, self.step_time = 0.0, 0, 0.0, 0.0
        self.t0 = self.tick = time.perf_counter()

    def add(self, loss: float, started: float) -> float:
        """One step that began (the loader's batch in hand) at ``started`` (perf_counter) and just ended with
        ``loss`` -> its seconds since the previous step ended (data wait + step: the run's training time)."""
        now = time.perf_counter()
        spent = now - self.tick
        self.wait += started - self.tick  # waiting for the loader
        self.step_time += now - started
        self.tick = now
        self.loss += loss
        self.n += 1
        return spent

    def exclude_pause(self) -> None:
        """The time since the last step (a checkpoint) is not the next step's data wait."""
        self.tick = time.perf_counter()

    def restart_clock(self) -> None:
        """As ``exclude_pause``, and samples/s starts counting from now (after an evaluation)."""
        self.t0 = self.tick = time.perf_counter()

    def take(self) -> tuple[dict[str, float], int]:
        """-> (the window's figures, its steps), and a new window starts. Call after at least one ``add``."""
        now, n = time.perf_counter(), self.n
        values = {"loss": self.loss / n, "samples_per_sec": n * self.samples_per_step / max(now - self.t0, 1e-9),
                  "time_data_wait": self.wait / n, "time_step": self.step_time / n}
        self.loss, self.n, self.wait, self.step_time, self.t0 = 0.0, 0, 0.0, 0.0, now
        return values, n
