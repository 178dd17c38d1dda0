"""The DAS store: FM predictions logged once per example, as Parquet files, exactly once under crashes.

Why Parquet rather than DuckDB: the writer (the DAS process) and the readers (every VM trainer, in other
processes) run at the same time, and a DuckDB database file admits one read-write process and no other
process while it is open; Parquet files that appear by atomic rename can be read by any number of
processes at any moment, need no server and no new dependency (pyarrow is already one), and are the format
a warehouse would hold such a log in. Exactly-once then comes from deterministic part names:

    <root>/w<window>/_window.json      the window's plan, fixed on first start: snapshot version, part
                                       names and the number of rows in each
    <root>/w<window>/<part>.parquet    example_id int64, fm_logit float32, snapshot_version int32,
                                       window int32, vertical int16
    <root>/w<window>/_COMMITTED        written last: the window is complete

A part is written to ``<part>.parquet.tmp``, fsynced and renamed, so it exists whole or not at all; a
restarted DAS keeps the recorded plan (same snapshot, same parts), skips the parts that exist and redoes the
rest. A killed DAS can thus leave neither a duplicate (a part is never written twice under two names) nor a
gap (the window is not committed until every planned part exists). Readers only trust committed windows,
and check the example ids of a window are unique when they read it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recstack.io import atomic_path, atomic_write_text

COMMITTED = "_COMMITTED"
PLAN = "_window.json"
SCHEMA = pa.schema(
    [("example_id", pa.int64()), ("fm_logit", pa.float32()), ("snapshot_version", pa.int32()),
     ("window", pa.int32()), ("vertical", pa.int16())]
)


class MissingFMLabels(RuntimeError):
    """Examples a VM is about to train on have no FM prediction in the store (yet)."""


@dataclass
class WindowLabels:
    """One committed window: example_id [n] sorted ascending, fm_logit [n], snapshot_version (one per window)."""

    example_id: np.ndarray
    fm_logit: np.ndarray
    snapshot_version: int
    vertical: np.ndarray


class DasStore:
    """A directory of logged FM predictions, one sub-directory per window."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._cache: dict[int, WindowLabels] = {}

    def window_dir(self, window: int) -> Path:
        return self.root / f"w{window:06d}"

    # ------------------------------------------------------------------------------------------ writer
    def begin_window(self, window: int, snapshot_version: int, parts: dict[str, int]) -> dict[str, Any]:
        """Record the window's plan unless one exists; -> the plan in force (a restart keeps the first one)."""
        d = self.window_dir(window)
        d.mkdir(parents=True, exist_ok=True)
        plan_file = d / PLAN
        if plan_file.is_file():
            return json.loads(plan_file.read_text())
        plan = {"window": window, "snapshot_version": snapshot_version, "parts": parts,
                "rows": int(sum(parts.values()))}
        atomic_write_text(plan_file, json.dumps(plan, indent=1))
        return plan

    def has_part(self, window: int, part: str) -> bool:
        return (self.window_dir(window) / f"{part}.parquet").is_file()

    def write_part(self, window: int, part: str, example_id: np.ndarray, fm_logit: np.ndarray,
                   snapshot_version: int, vertical: np.ndarray) -> Path:
        """Write one part atomically: example_id [n] int64, fm_logit [n], vertical [n]."""
        n = len(example_id)
        table = pa.table(
            {"example_id": np.asarray(example_id, np.int64), "fm_logit": np.asarray(fm_logit, np.float32),
             "snapshot_version": np.full(n, snapshot_version, np.int32), "window": np.full(n, window, np.int32),
             "vertical": np.asarray(vertical, np.int16)},
            schema=SCHEMA,
        )
        final = self.window_dir(window) / f"{part}.parquet"
        with atomic_path(final) as tmp:
            pq.write_table(table, tmp)
        return final

    def commit_window(self, window: int) -> None:
        """Mark the window complete once every planned part exists (checked here)."""
        d = self.window_dir(window)
        plan = json.loads((d / PLAN).read_text())
        missing = [p for p in plan["parts"] if not self.has_part(window, p)]
        if missing:
            raise RuntimeError(f"{d}: cannot commit, parts {missing} are not written")
        done = {"rows": plan["rows"], "snapshot_version": plan["snapshot_version"]}
        atomic_write_text(d / COMMITTED, json.dumps(done, indent=1))

    def clean_temporary(self, window: int) -> int:
        """Remove half-written files a killed writer left behind; -> how many."""
        d = self.window_dir(window)
        stale = list(d.glob("*.tmp")) if d.is_dir() else []
        for p in stale:
            p.unlink(missing_ok=True)
        return len(stale)

    # ------------------------------------------------------------------------------------------ reader
    def is_committed(self, window: int) -> bool:
        return (self.window_dir(window) / COMMITTED).is_file()

    def committed_windows(self) -> list[int]:
        return sorted(int(p.parent.name[1:]) for p in self.root.glob(f"w*/{COMMITTED}"))

    def read_window(self, window: int, partial: bool = False) -> WindowLabels:
        """The window's labels, sorted by example id. Committed windows only, unless ``partial`` (then the
        parts written so far). Raises on a duplicate example id, naming the window and the id."""
        if window in self._cache:
            return self._cache[window]
        d = self.window_dir(window)
        committed = self.is_committed(window)
        if not committed and not partial:
            raise MissingFMLabels(f"{d}: window {window} is not committed yet")
        plan_file = d / PLAN
        if not plan_file.is_file():
            empty = np.zeros(0, np.int64)
            return WindowLabels(empty, np.zeros(0, np.float32), -1, empty.astype(np.int16))
        plan = json.loads(plan_file.read_text())
        files = [d / f"{p}.parquet" for p in plan["parts"] if (d / f"{p}.parquet").is_file()]
        tables = [pq.read_table(f, schema=SCHEMA) for f in files]
        t = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
        ids = t.column("example_id").to_numpy()
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        dup = np.flatnonzero(ids[1:] == ids[:-1])
        if len(dup):
            raise RuntimeError(f"{d}: example id {ids[dup[0]]} is logged {int((ids == ids[dup[0]]).sum())} times")
        labels = WindowLabels(ids, t.column("fm_logit").to_numpy()[order], int(plan["snapshot_version"]),
                              t.column("vertical").to_numpy()[order])
        if committed:
            if len(ids) != plan["rows"]:
                raise RuntimeError(f"{d}: committed with {plan['rows']} rows planned, {len(ids)} found")
            self._cache[window] = labels
        return labels

    def wait_committed(self, window: int, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait up to ``timeout_s`` for the window's commit; -> whether it is committed."""
        deadline = time.monotonic() + timeout_s
        while not self.is_committed(window):
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
            poll_s = min(poll_s * 1.5, 1.0)
        return True

    def lookup(self, window: int, example_ids: np.ndarray, wait_s: float = 0.0,
               partial: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
        """FM logits of ``example_ids`` [n] in ``window`` -> (fm_logit [n] float32, found [n] bool, version).

        Waits up to ``wait_s`` for the window to be committed. Without ``partial`` an uncommitted window or
        an id without a label raises ``MissingFMLabels``; with it, what is there is returned and ``found``
        says which ids have a label.
        """
        committed = self.wait_committed(window, wait_s)
        if not committed and not partial:
            raise MissingFMLabels(
                f"{self.window_dir(window)}: the DAS has not finished window {window} after {wait_s:.0f} s; "
                "its examples have no FM labels"
            )
        labels = self.read_window(window, partial=not committed)
        ids = np.asarray(example_ids, np.int64)
        n = len(labels.example_id)
        if n == 0:
            found, logits = np.zeros(len(ids), bool), np.zeros(len(ids), np.float32)
        else:
            pos = np.minimum(np.searchsorted(labels.example_id, ids), n - 1)
            found = labels.example_id[pos] == ids
            logits = np.where(found, labels.fm_logit[pos], 0.0).astype(np.float32)
        if not partial and not found.all():
            miss = ids[~found]
            raise MissingFMLabels(
                f"{self.window_dir(window)}: {len(miss)} of {len(ids)} examples have no FM label "
                f"(first: example id {miss[0]})"
            )
        return logits, found, labels.snapshot_version

    def verify(self, expected: dict[int, np.ndarray]) -> dict[str, int]:
        """Check windows {window: expected example ids} against what is committed: counts of duplicates
        (ids logged more than once), missing ids and unexpected ids, over all windows."""
        dups = missing = extra = 0
        for window, want in expected.items():
            d = self.window_dir(window)
            files = sorted(d.glob("*.parquet"))
            ids = (np.concatenate([pq.read_table(f, columns=["example_id"]).column(0).to_numpy() for f in files])
                   if files else np.zeros(0, np.int64))
            uniq, counts = np.unique(ids, return_counts=True)
            dups += int((counts - 1).sum())
            want = np.unique(np.asarray(want, np.int64))
            missing += int(len(np.setdiff1d(want, uniq)))
            extra += int(len(np.setdiff1d(uniq, want)))
        return {"duplicates": dups, "missing": missing, "unexpected": extra}
