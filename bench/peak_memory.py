"""Peak resident memory per rank of sharded training: the Criteo Kaggle reference DLRM at its full table sizes
on ``--world`` gloo ranks, against the same model trained in one process.

Model: ``configs/criteo_kaggle.toml`` (dim 16, bottom 13-512-256-64-16, top 512-256-1, dot interaction, SGD)
with the 26 tables at the Kaggle cardinalities, uncapped (about 33.8M rows, 2.2 GB of fp32 rows in all).
The data is a small prepared set written here with ``PreparedWriter``: just enough rows for ``--steps``
global batches of ``--batch`` rows per rank, uniform random ids below each table's size, random dense
features and labels. Nothing is held out (``data.eval_fraction=0``), so a run is ``--steps`` training steps
and the final checkpoint that every run writes.

Every run goes through the public command line only, ``python -m recstack train --config ... --set ...
--output-dir ... --overwrite``, one thread per process:

- sharded: the ``--world`` ranks are started here as plain subprocesses with the env:// variables torchrun
  would set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
  ``MASTER_PORT`` a free port), ``dist.sharding`` from ``--sharding``, one node;
- single process: the same command as a world of one.

Each process is reaped with ``os.wait4``, whose ``ru_maxrss`` (KiB on Linux) is that process's own peak RSS
(its high-water mark, the checkpoint included), so no sampling can miss a short peak. The environment is
inherited (``PYTHONPATH`` picks the recstack that runs); the children start in the temporary directory, so
they import the same recstack as this script. The data and run directories are removed at the end.

    python bench/peak_memory.py [--world 2] [--steps 20] [--sharding table_wise] [--out results.json]

JSON goes to stdout (and ``--out``), a one-line summary per run to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

import recstack
from recstack.data.format import SparseFeatureSpec
from recstack.data.prepare.criteo import KAGGLE_CARDINALITIES
from recstack.data.prepared_writer import PreparedWriter

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "criteo_kaggle.toml"
NUM_DENSE = 13
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT")


def write_dataset(path: Path, rows: int, seed: int = 0) -> Path:
    """A prepared set of ``rows`` rows with the Kaggle table sizes: ids uniform below each table's size."""
    rng = np.random.default_rng(seed)
    specs = [SparseFeatureSpec(f"C{i + 1}", n) for i, n in enumerate(KAGGLE_CARDINALITIES)]
    with PreparedWriter(path, [f"I{i + 1}" for i in range(NUM_DENSE)], specs) as w:
        w.write(
            (rng.random(rows) < 0.25).astype(np.float32),
            rng.random((rows, NUM_DENSE), dtype=np.float32),
            np.stack([rng.integers(0, n, rows) for n in KAGGLE_CARDINALITIES], axis=1).astype(np.int32),
        )
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, args: list[str], run_dir: Path, threads: int, timeout_s: float) -> dict[str, Any]:
    """Start ``world`` processes of ``python -m recstack train ARGS`` (ranks 0..world-1 of one node) and reap
    each with ``os.wait4``. -> peak RSS per rank (MiB), wall seconds. Raises SystemExit when a rank fails."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("TORCHELASTIC_")}
    base.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "recstack", "train", *args, "--output-dir", str(run_dir / "run"), "--overwrite"]
    procs, logs = [], []
    t0 = time.perf_counter()
    for rank in range(world):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(run_dir / f"rank{rank}.log", "w+")  # closed in the finally below
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT))
    peak_kib: list[int | None] = [None] * world
    codes: list[int | None] = [None] * world
    failed_at = None  # when a rank first failed: the others get a few seconds to stop on their own
    try:
        while None in codes:
            for r, p in enumerate(procs):
                if codes[r] is not None:
                    continue
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid == 0:
                    continue
                codes[r] = p.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
                peak_kib[r] = usage.ru_maxrss
            now = time.perf_counter()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if (failed_at is not None and now - failed_at > 5) or now - t0 > timeout_s:
                break
            time.sleep(0.1)
    finally:
        for r, p in enumerate(procs):
            if codes[r] is None:  # a peer failed or the run timed out: the others would wait on it
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                codes[r] = p.returncode
        for log in logs:
            log.close()
    wall = time.perf_counter() - t0
    if any(c != 0 for c in codes):
        for r in range(world):
            tail = (run_dir / f"rank{r}.log").read_text(errors="replace")[-3000:]
            print(f"--- rank {r} (exit {codes[r]}) ---\n{tail}", file=sys.stderr)
        why = f"timed out after {timeout_s:.0f} s" if failed_at is None else f"after {wall:.0f} s"
        raise SystemExit(f"world {world}: ranks exited {codes} {why}")
    return {"peak_rss_mib": [round(k / 1024, 1) for k in peak_kib], "wall_s": round(wall, 1)}


def model_info(config: Path) -> dict[str, Any]:
    m = tomllib.loads(config.read_text()).get("model", {})
    dim = m.get("embedding_dim", 16)
    return {
        "config": str(config),
        "embedding_dim": dim,
        "bottom_mlp": [NUM_DENSE, *m.get("bottom_mlp", [])],
        "top_mlp": m.get("top_mlp", []),
        "interaction": m.get("interaction", "dot"),
        "tables": len(KAGGLE_CARDINALITIES),
        "rows_total": sum(KAGGLE_CARDINALITIES),
    }


def machine_info() -> dict[str, Any]:
    cpu, mem_kib = platform.processor(), None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except (OSError, ValueError):
        pass
    import torch

    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1) if mem_kib else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "recstack": str(Path(recstack.__file__).resolve().parent),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks of the sharded run (default 2)")
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    p.add_argument("--batch", type=int, default=128, help="batch size per rank (default 128)")
    p.add_argument("--sharding", default="table_wise", help="dist.sharding of the sharded run (default table_wise)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--config", type=Path, default=CONFIG, help="model config (default configs/criteo_kaggle.toml)")
    p.add_argument("--no-single", action="store_true", help="skip the single-process run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is stopped (default 1800)")
    p.add_argument("--tmp-dir", type=Path, help="where the data and runs go (default: the system's temp dir)")
    p.add_argument("--out", type=Path, help="also write the JSON results to this file")
    a = p.parse_args(argv)
    if a.world < 2:
        p.error("--world must be at least 2 (the single-process run is the world of one)")

    info = machine_info()
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="recstack-peak-memory-", dir=a.tmp_dir))
    try:
        data = write_dataset(tmp / "data", a.world * a.batch * a.steps)
        args = ["--config", str(a.config.resolve()),
                "--set", f"data.train={json.dumps(str(data))}", "--set", "data.eval_fraction=0.0",
                "--set", f"train.batch_size={a.batch}", "--set", f"train.max_steps={a.steps}",
                "--set", f"train.log_every={a.steps}", "--set", "train.eval_every=0",
                "--set", "train.checkpoint_every=0", "--set", f"train.threads={a.threads}",
                "--set", "train.device=cpu", "--set", "train.progress=false"]
        runs: dict[str, dict[str, Any]] = {}
        (tmp / "sharded").mkdir()
        runs["sharded"] = run_world(a.world, [*args, "--set", f"dist.sharding={json.dumps(a.sharding)}"],
                                    tmp / "sharded", a.threads, a.timeout)
        print(f"peak_memory: {a.world} ranks {a.sharding}: peak RSS {runs['sharded']['peak_rss_mib']} MiB "
              f"({runs['sharded']['wall_s']} s)", file=sys.stderr, flush=True)
        shutil.rmtree(tmp / "sharded")  # its checkpoint holds every table: free the disk before the next run
        if not a.no_single:
            (tmp / "single").mkdir()
            runs["single"] = run_world(1, args, tmp / "single", a.threads, a.timeout)
            print(f"peak_memory: single process: peak RSS {runs['single']['peak_rss_mib'][0]} MiB "
                  f"({runs['single']['wall_s']} s)", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    model = model_info(a.config.resolve())
    info["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    report = {
        "benchmark": "peak_memory",
        "world": a.world,
        "sharding": a.sharding,
        "backend": "gloo",
        "steps": a.steps,
        "batch_per_rank": a.batch,
        "threads_per_process": a.threads,
        "model": model,
        "per_rank_peak_rss_mib": runs["sharded"]["peak_rss_mib"],
        "single_process_peak_rss_mib": runs["single"]["peak_rss_mib"][0] if "single" in runs else None,
        "table_bytes_fp32": model["rows_total"] * model["embedding_dim"] * 4,
        "wall_s": {k: v["wall_s"] for k, v in runs.items()},
        "total_wall_s": round(time.perf_counter() - t0, 1),
        "machine": info,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
