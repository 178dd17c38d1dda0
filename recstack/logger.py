"""Training and evaluation metrics written as JSON lines and TensorBoard scalars.

Each ``log`` call appends one line to ``<output_dir>/metrics.jsonl``::

    {"step": 1200, "kind": "eval", "time": 1718000000.5, "auc": 0.79, "ne": 0.86, ...}

The file is flushed after every line so a crashed or still-running job leaves a readable record (and
``recstack.plots`` can draw it live). Non-finite values (an AUC of NaN on a one-class slice, say) are written
as ``null`` because JSON has no NaN. The same values go to TensorBoard as ``<kind>/<key>`` scalars under
``<output_dir>/tb``.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    """

    def __init__(self, output_dir: Path | str | None, tensorboard: bool = True) -> None:
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self._file = None
        self._writer = None
        self._closed = False
        if self.output_dir is None:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.output_dir / METRICS_FILE, "a", encoding="utf-8")  # closed in close()
        if tensorboard:
            # Imported here: tensorboard is slow to import and unneeded when the logger is disabled.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.output_dir / TB_DIR))

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
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
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
