"""The ``stream`` arm of ``bench/publish.py``: freshness through the real stream loop, real processes only.

A producer thread writes raw Criteo partitions (rows of ``criteo_kaggle_sample.tsv``) into a stream directory, one
every ``arrival_s`` seconds, each as a hidden temporary renamed to its final name (its arrival: the rename's
status-change time, what the stream source records). ``recstack train --stream DIR --stream-idle-s IDLE --publish
ROOT --publish-every-s T`` trains on them in a subprocess; a ``recstack serve ROOT --watch ROOT --watch-interval
0.5`` subprocess starts as soon as version 1 exists, and a poller reads its ``/metrics`` every ``poll_s`` seconds.
A partition is served at the first poll whose ``recstack_model_data_arrival_timestamp_seconds`` is >= its arrival
(the served version was trained on it or on a later one). Reported per partition: seconds from arrival to served;
their max and median; the verdict of the target "a partition is reflected in the served model within
--publish-every-s + 10 s"; and the bytes of each published version against its full artifact's (the trainer's
``publish`` records in ``metrics.jsonl``).

Partition 0's figure includes the trainer's start (the first publication waits for it) and the server's start
(it starts on version 1): a cold start, reported apart as ``first_partition_s``; so do the partitions that arrived
before the server answered. ``max_s_arrived_after_server_up`` is the max over the others.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# As tests/conftest.py: beside the checkout (../shared/data), or where RECSTACK_SHARED_DATA names it.
SHARED_DATA = Path(os.environ.get("RECSTACK_SHARED_DATA", ROOT.parent / "shared" / "data"))
ARRIVAL_GAUGE = "recstack_model_data_arrival_timestamp_seconds"
# The small model of tests/serving/test_stream_publish.py (dynamic ids on every table, a raw stream's default).
MODEL = ["model.embedding_dim=8", "model.bottom_mlp=[32, 8]", "model.top_mlp=[32, 1]", "train.batch_size=64",
         "train.threads=1", "train.progress=false", 'optim.sparse="rowwise_adagrad"']


@dataclass(frozen=True)
class StreamSpec:
    """The stream arm's settings: ``partitions`` of ``rows`` Criteo rows, one every ``arrival_s``; the trainer's
    ``publish_every_s`` and ``idle_s``; the server's ``watch_s``; the poller's ``poll_s``; ``timeout_s`` for the
    whole arm."""

    partitions: int = 16
    rows: int = 125
    arrival_s: float = 2.0
    publish_every_s: float = 5.0
    idle_s: float = 5.0
    watch_s: float = 0.5
    poll_s: float = 0.2
    timeout_s: float = 300.0


def criteo_lines(path: Path, spec: StreamSpec) -> list[list[str]]:
    """The partitions' lines: ``spec.rows`` consecutive rows each (the last one short if the file is)."""
    if not path.is_file():
        raise SystemExit(f"bench/publish.py stream arm: Criteo sample not found: {path} (set RECSTACK_SHARED_DATA "
                         f"to the directory holding criteo_kaggle_sample.tsv)")
    lines = path.read_text().splitlines(keepends=True)
    parts = [lines[i * spec.rows:(i + 1) * spec.rows] for i in range(spec.partitions)]
    if not parts[-1]:
        raise SystemExit(f"{path}: {len(lines)} rows, too few for {spec.partitions} partitions of {spec.rows}")
    return parts


def produce(directory: Path, parts: list[list[str]], every_s: float, arrivals: list[float],
            stop: threading.Event) -> None:
    """Write partition i at ``start + i * every_s`` as ``.part-i.tmp`` and rename it; append its arrival."""
    start = time.time()
    for i, lines in enumerate(parts):
        if stop.wait(max(0.0, start + i * every_s - time.time())):
            return
        tmp, final = directory / f".part-{i:05d}.tmp", directory / f"part-{i:05d}"
        tmp.write_text("".join(lines))
        tmp.rename(final)
        arrivals.append(os.stat(final).st_ctime)  # what DirectoryStream records as the partition's arrived_at


def served_arrival(client: httpx.Client) -> float | None:
    """The served model's data arrival time from /metrics (None: no answer yet, or no published version)."""
    try:
        text = client.get("/metrics").text
    except httpx.TransportError:
        return None
    for line in text.splitlines():
        if line.startswith(ARRIVAL_GAUGE + " "):
            value = float(line.rsplit(" ", 1)[1])
            return value if value > 0 else None
    return None


def _healthy(server: Any) -> bool:
    if server.proc.poll() is not None:
        raise RuntimeError(f"recstack serve exited {server.proc.returncode}")
    try:
        return bool(server.client.get("/healthz").status_code == 200)
    except httpx.TransportError:
        return False


def publish_records(metrics: Path) -> list[dict[str, Any]]:
    """The trainer's published versions from its ``publish`` records: bytes against the full artifact their chain
    starts from, the changed rows' fraction, seconds to publish."""
    out: list[dict[str, Any]] = []
    full_bytes = 0
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") != "publish":
            continue
        if r["full"]:
            full_bytes = r["publish_bytes"]
        out.append({"version": r["version"], "full": bool(r["full"]), "step": r["step"], "bytes": r["publish_bytes"],
                    "bytes_vs_full": round(r["publish_bytes"] / full_bytes, 4),
                    "changed_fraction": round(r["changed_fraction"], 5), "publish_s": round(r["publish_seconds"], 3)})
    return out


def stream_arm(tmp: Path, spec: StreamSpec, criteo: Path, server_cls: Any) -> dict[str, Any]:
    """Run the arm in ``tmp``; ``server_cls(root, log, watch_interval)``: bench/publish.py's ``Server`` (its
    ``proc``, ``client`` and ``stop()`` are used)."""
    parts = criteo_lines(criteo, spec)
    stream_dir, run, root = tmp / "stream-in", tmp / "stream-run", tmp / "stream-models"
    stream_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    sets = [a for s in MODEL for a in ("--set", s)]
    cmd = [sys.executable, "-m", "recstack", "train", "--output-dir", str(run), "--stream", str(stream_dir),
           "--stream-idle-s", f"{spec.idle_s:g}", "--publish", str(root), "--publish-every-s",
           f"{spec.publish_every_s:g}", *sets]
    arrivals: list[float] = []
    served: dict[int, float] = {}  # partition -> time.time() of the first poll that showed it served
    stop = threading.Event()
    t0 = time.time()
    with open(tmp / "stream-train.log", "wb") as log:
        trainer = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        producer = threading.Thread(target=produce, args=(stream_dir, parts, spec.arrival_s, arrivals, stop))
        producer.start()
        server = None
        try:
            while not (root / "1").is_dir():  # a version appears under its final name only when complete
                if trainer.poll() is not None:
                    raise RuntimeError(f"recstack train exited {trainer.returncode} before version 1:\n"
                                       + (tmp / "stream-train.log").read_text()[-3000:])
                if time.time() - t0 > spec.timeout_s:
                    raise RuntimeError(f"no version 1 after {spec.timeout_s:g} s")
                time.sleep(0.05)
            version_1_s = time.time() - t0
            server = server_cls(root, tmp / "stream-serve.log", spec.watch_s)
            while not _healthy(server):
                if time.time() - t0 > spec.timeout_s:
                    raise RuntimeError(f"recstack serve not answering /healthz after {spec.timeout_s:g} s")
                time.sleep(0.1)
            server_up_s = time.time() - t0
            trainer_done: float | None = None
            while len(served) < len(parts):
                now = time.time()
                if trainer_done is None and trainer.poll() is not None:
                    if trainer.returncode != 0:
                        raise RuntimeError(f"recstack train exited {trainer.returncode}:\n"
                                           + (tmp / "stream-train.log").read_text()[-3000:])
                    trainer_done = now
                # after the trainer's last version, the watcher needs a few polls to show it
                if now - t0 > spec.timeout_s or (trainer_done is not None and now - trainer_done > 30):
                    break
                arrived = served_arrival(server.client)
                if arrived is not None:
                    for i, a in enumerate(list(arrivals)):
                        if i not in served and arrived >= a:
                            served[i] = now
                time.sleep(max(0.0, now + spec.poll_s - time.time()))
            trainer.wait(max(1.0, spec.timeout_s - (time.time() - t0)))
        finally:
            stop.set()
            producer.join()
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
            if server is not None:
                server.stop()
    lags = [round(served[i] - a, 2) if i in served else None for i, a in enumerate(arrivals)]
    seen = [x for x in lags if x is not None]
    target = spec.publish_every_s + 10
    up = t0 + server_up_s  # partitions that arrived while the server was already up: no cold start in them
    warm = [x for x, a in zip(lags, arrivals, strict=True) if x is not None and a >= up]
    met = len(seen) == len(parts) and max(seen) <= target
    return {"partitions": len(parts), "rows_per_partition": [len(p) for p in parts], "arrival_every_s": spec.arrival_s,
            "publish_every_s": spec.publish_every_s, "stream_idle_s": spec.idle_s, "watch_interval_s": spec.watch_s,
            "poll_s": spec.poll_s, "version_1_after_start_s": round(version_1_s, 2),
            "server_up_after_start_s": round(server_up_s, 2), "arrival_to_served_s": lags,
            "first_partition_s": lags[0] if lags else None,
            "max_s": max(seen) if seen else None, "median_s": round(statistics.median(seen), 2) if seen else None,
            "max_s_arrived_after_server_up": max(warm) if warm else None, "arrived_after_server_up": len(warm),
            "target_s": target, "verdict": "met" if met else "missed",
            "versions": publish_records(run / "metrics.jsonl")}
