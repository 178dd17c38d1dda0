"""The data augmentation service (DAS): a separate process that logs FM predictions for every example.

For each window, in order, the DAS reads the examples of every vertical it serves once, in parts of ``part_rows``
rows, and scores each part with the FM snapshot each feed needs: a feed is one store plus the staleness d
of the pipeline it serves, and window t of a feed is labelled by snapshot version
``staleness_version(t, d, publish_every)``. If that snapshot is not published yet the DAS waits for it
(the FM trains ahead in another process). What it writes, and why that is exactly once under a kill, is in
``recstack.exfm.store``.

Run as ``python -m recstack.exfm.das --job job.json``; the experiment runner starts it that way. The job
file holds a ``DasJob`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recstack.data.batch import Batch
from recstack.exfm.config import StreamConfig, StreamSourceSpec
from recstack.exfm.fm import load_snapshot, table_caps, wait_for_snapshot
from recstack.exfm.lifetime import exit_with_parent
from recstack.exfm.source import FeatureLayout
from recstack.exfm.store import DasStore
from recstack.exfm.stream_windows import open_windows
from recstack.exfm.windows import staleness_version
from recstack.models.dlrm import DLRM
from recstack.typed_toml import fill


@dataclass
class DasJob:
    """Everything one DAS process does. ``feeds``: [[store directory, staleness], ...]. The windows: those of
    the prepared set ``data`` under ``stream``, or with ``source.dir`` the partitions of a directory stream as
    the FM's ``manifest`` lists them."""

    data: str = ""
    source: StreamSourceSpec = field(default_factory=StreamSourceSpec)
    manifest: str = ""
    snapshots: str = ""
    feeds: list[list[Any]] = field(default_factory=list)
    stream: StreamConfig = field(default_factory=StreamConfig)
    first_window: int = 0
    verticals: list[int] = field(default_factory=list)  # the verticals whose VMs it serves; empty: all
    part_rows: int = 4096
    wait_s: float = 1800.0
    threads: int = 1
    part_delay_s: float = 0.0  # pause after each part (lets tests kill the process mid-window)
    crash_after_parts: int = 0  # > 0: SIGKILL itself right after writing this many parts (fault injection)

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @staticmethod
    def load(path: Path) -> DasJob:
        job = DasJob()
        fill(job, json.loads(Path(path).read_text()), str(path))
        return job


def part_name(vertical: int, chunk: int) -> str:
    return f"v{vertical:03d}-{chunk:05d}"


class _Scorer:
    """FM snapshots by version, loaded once and dropped when no feed needs them any more."""

    def __init__(self, snap_dir: Path, ds: FeatureLayout, wait_s: float) -> None:
        self.snap_dir, self.ds, self.wait_s = snap_dir, ds, wait_s
        self.models: dict[int, tuple[DLRM, torch.Tensor | None]] = {}

    def keep_only(self, versions: set[int]) -> None:
        for v in [v for v in self.models if v not in versions]:
            del self.models[v]

    @torch.no_grad()
    def score(self, version: int, batch: Batch, ids: torch.Tensor) -> np.ndarray:
        """FM logits [B] of ``batch`` under snapshot ``version``; ``ids`` are the batch's uncapped ids."""
        if version not in self.models:
            wait_for_snapshot(self.snap_dir, version, self.wait_s)
            model, spec = load_snapshot(self.snap_dir, version)
            self.models[version] = (model, table_caps(spec, self.ds))
        model, caps = self.models[version]
        s = batch.sparse
        s.ids = ids if caps is None else torch.remainder(ids, caps.repeat_interleave(
            s.lengths.view(s.num_features, -1).sum(1)))
        return model(batch).numpy()


def run_das(job: DasJob, log=print) -> dict[str, Any]:
    """Label every window from ``job.first_window`` on for every feed; -> counts. Resumes where a killed run
    stopped (committed windows and written parts are skipped)."""
    torch.set_num_threads(job.threads)
    source = open_windows(job.data, job.stream, job.source, job.manifest, job.wait_s)
    ds = source.data
    feeds = [(DasStore(root), int(d)) for root, d in job.feeds]
    scorer = _Scorer(Path(job.snapshots), source.features, job.wait_s)
    k = job.stream.publish_every
    written = scored_rows = 0
    t = job.first_window
    while (w := source.window(t)) is not None:  # a stream's next window is waited for
        t += 1
        todo = [(store, d) for store, d in feeds if not store.is_committed(w.index)]
        if not todo:
            continue
        t0 = time.perf_counter()
        plan_rows = {v: source.rows(w, v) for v in source.verticals() if not job.verticals or v in job.verticals}
        parts = {part_name(v, c // job.part_rows): len(rows[c : c + job.part_rows])
                 for v, rows in plan_rows.items() for c in range(0, len(rows), job.part_rows)}
        versions = {}
        for store, d in todo:
            version = staleness_version(w.index, d, k)
            if version is None:
                raise ValueError(f"window {w.index}: no FM snapshot is published yet at staleness {d} "
                                 f"(publish_every={k}); start the VMs' FM labels later")
            plan = store.begin_window(w.index, version, parts)  # a restart keeps its first plan
            if plan["parts"] != parts:
                raise RuntimeError(f"{store.window_dir(w.index)}: recorded parts differ from this job's "
                                   "(data or part_rows changed since the window was started)")
            versions[store.root] = int(plan["snapshot_version"])
            store.clean_temporary(w.index)
        scorer.keep_only(set(versions.values()))
        for v, rows in plan_rows.items():
            for c in range(0, len(rows), job.part_rows):
                name = part_name(v, c // job.part_rows)
                need = [(store, d) for store, d in todo if not store.has_part(w.index, name)]
                if not need:
                    continue
                chunk = rows[c : c + job.part_rows]
                batch = ds.gather(chunk, ("example_id",) if ds.has("example_id") else ())  # read once
                example_id = batch.extras["example_id"].numpy() if "example_id" in batch.extras else chunk
                ids = batch.sparse.ids.clone()
                for store, _ in need:
                    version = versions[store.root]
                    logits = scorer.score(version, batch, ids)
                    store.write_part(w.index, name, example_id, logits, version, np.full(len(chunk), v))
                    written += 1
                    scored_rows += len(chunk)
                    if job.crash_after_parts and written >= job.crash_after_parts:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if job.part_delay_s:
                        time.sleep(job.part_delay_s)
        for store, _ in todo:
            store.commit_window(w.index)
        log(json.dumps({"das_window": w.index, "rows": w.rows, "feeds": [[str(s.root), d] for s, d in todo],
                        "versions": {str(k_): v_ for k_, v_ in versions.items()},
                        "seconds": round(time.perf_counter() - t0, 3)}))
    return {"parts_written": written, "rows_scored": scored_rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recstack.exfm.das", description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True, help="DasJob JSON file")
    p.add_argument("--parent-pid", type=int, help="exit as soon as this process (the runner) is gone")
    args = p.parse_args(argv)
    if args.parent_pid:
        exit_with_parent(args.parent_pid)
    job = DasJob.load(Path(args.job))
    stats = run_das(job, log=lambda line: print(line, flush=True))
    print(json.dumps({"das_done": True, **stats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
