"""Publishing while training: bytes of a delta against a full artifact, time to publish, time to served.

A model with ``--tables`` tables of ``--rows`` rows each (dim ``--dim``, fp32 or ``--width``) is built by a
Trainer on generated prepared data, trained a few steps and published into a versions directory that a real
``recstack serve ROOT --watch ROOT --watch-interval 0.1`` process follows. Then, in one run:

- ``full``: version 1, a full artifact (the baseline every delta is compared against);
- ``changed_<p>pct``: exactly p% of every table's rows changed (a random set, a small step added: what a fused
  optimizer does to the rows a batch touched), one training step for the dense part, published as a delta;
- ``trained_<k>steps``: k real training steps, published as a delta (the rows they touched, as found);
- ``full_again``: a forced full version, so that the served times of a full load and of a delta apply are
  measured on the same server;
- ``freshness``: a stream of ``--partitions`` partitions of ``--partition-steps`` batches, one every
  ``--arrival-s`` seconds, handed to a ``Publisher(every_s=--every-s)`` (a full version, then deltas): the seconds
  from each partition's arrival to the first served version trained on it, against the target of
  ``--publish-every-s`` + 10 s (the stream source's own wait for a file is not part of it).
- ``stream``: the same freshness through the real stream loop, real processes only (``bench/publish_stream.py``): a
  producer writes ``--stream-partitions`` raw Criteo partitions of ``--stream-rows`` rows one every
  ``--stream-arrival-s`` seconds, ``recstack train --stream DIR --publish ROOT --publish-every-s
  --stream-publish-every-s`` trains on them and ``recstack serve ROOT --watch ROOT --watch-interval 0.5`` (started
  when version 1 exists) serves them; per partition the seconds from its arrival to the first ``/metrics`` scrape
  (every 0.2 s) whose data arrival time reaches it, max, median, the verdict against ``--stream-publish-every-s``
  + 10 s, and the published versions' bytes against their full artifact's (the trainer's ``publish`` records).

Per version: its bytes and their ratio to the full artifact's, the changed rows' fraction, seconds to publish
(quantize, compare, trace the dense program, write, fsync, rename), seconds from the rename to the server
answering with it (``/readyz``; the watcher polls every 0.1 s), seconds of ``ServingModel.load`` alone in this
process (a full artifact read and verified, or a delta applied to the previous version), and the target
"delta < 20% of a full artifact at < 10% of rows changed".

    python bench/publish.py [--quick] [--out bench/results/publish.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.publish_stream import SHARED_DATA, StreamSpec, stream_arm  # noqa: E402
from recstack.config import load_config  # noqa: E402
from recstack.data.format import SparseFeatureSpec  # noqa: E402
from recstack.data.prepared_writer import PreparedWriter  # noqa: E402
from recstack.serving.artifact import list_versions  # noqa: E402
from recstack.serving.model import ServingModel  # noqa: E402
from recstack.serving.publish import Publisher, PublishSpec  # noqa: E402
from recstack.training.hooks import PartitionInfo  # noqa: E402
from recstack.training.trainer import Trainer  # noqa: E402


def write_data(path: Path, rows: int, tables: int, table_rows: int, seed: int = 0) -> Path:
    """13 dense features and ``tables`` sparse ones of ``table_rows`` ids (Zipf-distributed, as click logs)."""
    rng = np.random.default_rng(seed)
    dense = rng.random((rows, 13)).astype(np.float32)
    sparse = (rng.zipf(1.2, (rows, tables)) - 1) % table_rows
    labels = (rng.random(rows) < 1 / (1 + np.exp(-(2 * dense[:, 0] - 1)))).astype(np.float32)
    specs = [SparseFeatureSpec(f"C{i + 1}", table_rows) for i in range(tables)]
    with PreparedWriter(path, [f"I{i + 1}" for i in range(13)], specs) as w:
        w.write(labels, dense, sparse)
    return path


class Server:
    """``recstack serve ROOT --watch ROOT`` in a subprocess on a free port."""

    def __init__(self, root: Path, log: Path, watch_interval: float = 0.1) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log = open(log, "wb")  # noqa: SIM115 (closed by stop)
        self.proc = subprocess.Popen([sys.executable, "-m", "recstack", "serve", str(root), "--watch", str(root),
                                      "--watch-interval", f"{watch_interval:g}", "--port", str(port),
                                      # the graph: the swap-in times measured before --compile existed
                                      "--compile", "none"], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    def version(self) -> int | None:
        try:
            return self.client.get("/readyz").json().get("model_version")
        except (httpx.TransportError, ValueError):
            return None

    def wait(self, version: int, since: float, timeout: float = 300) -> float:
        """Seconds from ``since`` (time.time()) until the server answers with ``version``."""
        while time.time() - since < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}")
            if self.version() == version:
                return time.time() - since
            time.sleep(0.02)
        raise RuntimeError(f"version {version} not served after {timeout} s")

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def _up(server: Server) -> bool:
    if server.proc.poll() is not None:
        raise RuntimeError(f"server exited {server.proc.returncode}")
    try:
        return server.client.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


def stream(trainer: Trainer, pub: Publisher, server: Server, steps: Any, partitions: int, partition_steps: int,
           arrival_s: float) -> dict[str, Any]:
    """Partitions of ``partition_steps`` batches arriving every ``arrival_s`` seconds (or when the trainer is ready
    for the next one, if later), each handed to the publisher after it was trained on; a published version is
    waited for at the server. -> the seconds from each partition's arrival to the first served version trained
    on it."""
    arrivals: list[float] = []
    reflected: list[float] = []
    t0, first = time.time(), max(list_versions(pub.root), default=0) + 1
    for i in range(partitions):
        time.sleep(max(0.0, t0 + i * arrival_s - time.time()))
        arrivals.append(time.time())
        steps(partition_steps)
        before = max(list_versions(pub.root), default=0)
        pub.after_partition(trainer, PartitionInfo(f"part-{i:05d}", i, arrivals[-1], 64 * partition_steps,
                                                   trainer.step))
        if (version := max(list_versions(pub.root), default=0)) > before:
            server.wait(version, time.time())
            served_at = time.time()
            reflected += [served_at - a for a in arrivals[len(reflected):]]
    before = max(list_versions(pub.root), default=0)
    pub.close(trainer)
    if (version := max(list_versions(pub.root), default=0)) > before:
        server.wait(version, time.time())
    served_at = time.time()
    reflected += [served_at - a for a in arrivals[len(reflected):]]
    return {"every_s": pub.every_s, "partitions": partitions, "steps_per_partition": partition_steps,
            "arrival_every_s": arrival_s, "versions": max(list_versions(pub.root)) - first + 1,
            "arrival_to_served_s": [round(x, 2) for x in reflected], "max_s": round(max(reflected), 2)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=50000, help="rows per table (default 50000)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--width", default="fp32", help="table width of the artifacts (fp32, fp16, int8, int4)")
    ap.add_argument("--percents", type=float, nargs="+", default=[1.0, 5.0, 10.0])
    ap.add_argument("--steps", type=int, default=10, help="training steps of the trained_<k>steps delta")
    ap.add_argument("--every-s", type=float, default=5.0, help="publishing cadence of the freshness stream")
    ap.add_argument("--partitions", type=int, default=20, help="partitions of the freshness stream")
    ap.add_argument("--arrival-s", type=float, default=1.0, help="seconds between the stream's partitions")
    ap.add_argument("--partition-steps", type=int, default=10, help="batches of 64 rows per partition")
    # 16 of 125 rows: the 2,000 rows of the sample over 30 s, so that partitions arrive after the server's start too
    ap.add_argument("--stream-partitions", type=int, default=16, help="partitions of the stream arm (default 16)")
    ap.add_argument("--stream-rows", type=int, default=125, help="Criteo rows per stream arm partition (default 125)")
    ap.add_argument("--stream-arrival-s", type=float, default=2.0, help="seconds between the stream arm's partitions")
    ap.add_argument("--stream-publish-every-s", type=float, default=5.0,
                    help="the stream arm's recstack train --publish-every-s (default 5)")
    ap.add_argument("--criteo", type=Path, default=SHARED_DATA / "criteo_kaggle_sample.tsv",
                    help="raw Criteo TSV of the stream arm (default: criteo_kaggle_sample.tsv of the shared data)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a small model, for the test of this script")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.tables, args.rows, args.percents, args.steps = 2, 2000, [5.0], 2
        args.every_s, args.partitions, args.partition_steps, args.arrival_s = 1.0, 3, 2, 0.5
        args.stream_partitions, args.stream_rows, args.stream_arrival_s, args.stream_publish_every_s = 3, 250, 1.0, 2.0
    sspec = StreamSpec(partitions=args.stream_partitions, rows=args.stream_rows, arrival_s=args.stream_arrival_s,
                       publish_every_s=args.stream_publish_every_s, idle_s=2.0 if args.quick else 5.0)
    if not args.criteo.is_file():  # now, not after the other arms
        ap.error(f"--criteo: {args.criteo} not found (set RECSTACK_SHARED_DATA to the directory holding "
                 f"criteo_kaggle_sample.tsv, or name a raw Criteo TSV)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp_s:
        tmp = Path(tmp_s)
        data = write_data(tmp / "data", 64 * (20 + args.steps + args.partitions * args.partition_steps),
                          args.tables, args.rows)
        cfg = load_config(None, [f'data.train="{data}"', f"model.embedding_dim={args.dim}",
                                 f"model.bottom_mlp=[64, {args.dim}]", "model.top_mlp=[64, 1]", "train.batch_size=64",
                                 "train.progress=false", "train.eval_every=0", "train.checkpoint_every=0",
                                 f"train.threads={args.threads}", 'optim.sparse="sgd"', "data.eval_fraction=0.0"])
        trainer = Trainer(cfg, tmp / "run")
        batch_no = [0]

        def steps(n: int) -> None:
            for _ in range(n):
                i = batch_no[0]
                trainer.train_step(trainer.train_ds.batch(64 * i, 64 * (i + 1)))
                trainer.progress.step += 1
                batch_no[0] += 1

        steps(5)
        root = tmp / "models"
        pub = Publisher(root, every_s=0.0, spec=PublishSpec(tables=args.width, max_delta_fraction=0.5))
        results: list[dict[str, Any]] = []
        server = Server(root, tmp / "serve.log")  # up and watching the empty root before version 1
        while not _up(server):
            time.sleep(0.1)

        loaded: list[ServingModel] = []

        def publish(name: str, full: bool = False) -> dict[str, Any]:
            p = pub.publish(trainer, full=full)
            renamed = time.time()
            served = server.wait(p.version, renamed)
            t0 = time.perf_counter()  # the server's load, here alone: a full read or a delta applied
            loaded[:] = [ServingModel.load(p.path, base=None if p.full else loaded[0])]
            r = {"name": name, "version": p.version, "full": p.full, "bytes": p.bytes,
                 "changed_fraction": round(p.delta_fraction, 5), "publish_s": round(p.seconds, 3),
                 "publish_to_served_s": round(served, 3), "load_s": round(time.perf_counter() - t0, 3)}
            results.append(r)
            print(json.dumps(r), file=sys.stderr)
            return r

        rng = np.random.default_rng(1)
        emb = trainer.model.embeddings
        try:
            full = publish("full")
            for pct in args.percents:
                with torch.no_grad():
                    for t in emb.tables:
                        w = emb.table_weight(t.name)
                        idx = torch.from_numpy(rng.choice(t.num_embeddings, round(t.num_embeddings * pct / 100),
                                                          replace=False))
                        w[idx] += 1e-3
                steps(1)  # the dense part changes every step (and the rows of this one batch)
                publish(f"changed_{pct:g}pct")
            steps(args.steps)
            publish(f"trained_{args.steps}steps")
            publish("full_again", full=True)
            freshness = stream(trainer, Publisher(root, args.every_s, PublishSpec(tables=args.width)), server,
                               steps, args.partitions, args.partition_steps, args.arrival_s)
        finally:
            server.stop()
        streamed = stream_arm(tmp, sspec, args.criteo, Server)
    for r in results:
        r["bytes_vs_full"] = round(r["bytes"] / full["bytes"], 4)
    deltas = [r for r in results if not r["full"] and r["changed_fraction"] < 0.1]
    out = {"model": {"tables": args.tables, "rows_per_table": args.rows, "dim": args.dim, "width": args.width,
                     "table_bytes": args.tables * args.rows * args.dim * 4 if args.width == "fp32" else None},
           "versions": results,
           "freshness": freshness,
           "stream": streamed,
           "target": {"delta_under_20pct_of_full_below_10pct_rows": bool(deltas)
                      and all(r["bytes_vs_full"] < 0.2 for r in deltas),
                      "partition_served_within_every_s_plus_10s": freshness["max_s"] <= args.every_s + 10,
                      "stream_partition_served_within_publish_every_s_plus_10s": streamed["verdict"] == "met"},
           "torch_threads": args.threads, "cpu_count": os.cpu_count()}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
