"""Served latency beside NE gain: an ExFM experiment publishes one vertical model while it trains
(``[experiment.publish_vm]``), ``recstack serve ROOT --watch ROOT`` follows its versions, and ``wrk`` loads the
server for as long as the experiment runs; then the same server, on the final version, with the experiment over
(the baseline of the same run: serving without training beside it).

The ExFM run: ``configs/exfm_publish.toml``, a synthetic click log with raw int64 ids and id churn (``raw_ids``,
``id_churn``), the FM hashing them (``fm.model.max_table_size``), the VMs on dynamic id tables
(``[vm.model.dynamic_ids]``), arms ``alone`` and the published one (``--arm``, ``--staleness``), one seed.
Requests: ``--rows`` rows of the published vertical's stream (raw ids, ``"encoded": true``) per request,
``--connections`` keep-alive connections, 1 wrk thread, windows of ``--window-s`` seconds.

Printed JSON (and ``--out``): per published VM its NE, NE gain % over the VM alone (from the ExFM report), the
versions published (full / delta, bytes, seconds) and, ``while_training`` and ``after_training``, req/s and p50 /
p99 ms (while training: the median window p50, the worst window p99, req/s over all windows). The served figures
are also written into the run's ``results.json`` / ``report.md`` (``recstack.exfm.report.add_served``).

    python bench/exfm_serving.py --out bench/results/exfm_serving.json        # about 2-4 minutes
    python bench/exfm_serving.py --quick                                       # the smoke test's size
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.serving_http import free_port, start, stop, wrk  # noqa: E402
from recstack.data.prepared_dataset import PreparedDataset  # noqa: E402
from recstack.exfm.report import add_served  # noqa: E402

CONFIG = ROOT / "configs" / "exfm_publish.toml"
# --quick: the same run on a tiny stream (the smoke test's size)
QUICK = ["data.synth.rows=4000", "data.synth.num_days=5", "data.synth.num_verticals=2",
         "data.synth.table_sizes=[300, 200]", "stream.vm_start=3", "fm.model.max_table_size=256",
         "vm.model.dynamic_ids.capacity=400"]


def request_body(data: Path, vertical: int, rows: int, seed: int = 0) -> bytes:
    """``rows`` rows of ``vertical``'s last day, raw ids as the data holds them, dense features by name."""
    ds = PreparedDataset(data)
    idx = np.flatnonzero(np.asarray(ds.column("vertical")) == vertical)[-2000:]
    pick = np.random.default_rng(seed).choice(idx, rows, replace=False)
    sparse, dense = np.asarray(ds.arrays["sparse"][pick], np.int64), np.asarray(ds.arrays["dense"][pick], np.float32)
    out = []
    for d, s in zip(dense, sparse, strict=True):
        row: dict[str, Any] = {name: float(v) for name, v in zip(ds.dense_features, d, strict=True)}
        row.update({f.name: int(v) for f, v in zip(ds.sparse_features, s, strict=True)})
        out.append(row)
    return json.dumps({"rows": out, "encoded": True}).encode()


def summarize_windows(windows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Windows of wrk -> the median p50, the worst p99, req/s over all of them (None: no window)."""
    done = [w for w in windows if w["rps"] > 0]
    if not done:
        return None
    seconds = sum(w["seconds"] for w in done)
    return {"p50_ms": statistics.median(w["p50_ms"] for w in done), "p99_ms": max(w["p99_ms"] for w in done),
            "rps": sum(w["rps"] * w["seconds"] for w in done) / seconds, "windows": len(done), "seconds": seconds,
            "non_2xx": sum(w["non_2xx"] for w in done)}


def run(quick: bool, arm: str, staleness: int, window_s: float, connections: int, rows: int,
        work: Path) -> dict[str, Any]:
    overrides = [*(QUICK if quick else []), f"experiment.arms=['alone', '{arm}']",
                 f"experiment.staleness=[{staleness}]", f"experiment.publish_vm.arm={arm}",
                 f"experiment.publish_vm.staleness={staleness}"]
    run_dir, root = work / "run", work / "run" / "published"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "recstack", "exfm", "run", "--config", str(CONFIG), "--output-dir", str(run_dir)]
    exfm = subprocess.Popen(cmd + [a for o in overrides for a in ("--set", o)],
                            stdout=open(work / "exfm.log", "wb"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
                            cwd=ROOT)
    server = None
    try:
        while not (root / "1" / "manifest.json").is_file():  # the VM's first version
            if exfm.poll() is not None:
                raise RuntimeError(f"exfm run exited {exfm.returncode} before publishing: "
                                   f"{(work / 'exfm.log').read_text()[-2000:]}")
            time.sleep(0.2)
        first_version_s = time.monotonic() - t0
        data = next((run_dir / "data").iterdir())
        body = request_body(data, 0, rows)
        port = free_port()
        server = start([sys.executable, "-m", "recstack", "serve", str(root), "--watch", str(root),
                        "--watch-interval", "0.5", "--port", str(port),
                        "--compile", "none"],  # the graph while training and after alike: one program compared
                       port, body, work / "serve.log")
        during: list[dict[str, Any]] = []
        while exfm.poll() is None:
            ts = time.monotonic()
            cell = wrk(port, body, connections, window_s, work)
            cell["seconds"] = time.monotonic() - ts
            if exfm.poll() is None:  # a window that ended after training did is neither figure
                during.append(cell)
        if exfm.returncode != 0:
            raise RuntimeError(f"exfm run exited {exfm.returncode}: {(work / 'exfm.log').read_text()[-2000:]}")
        after = []
        for _ in range(1 if quick else 2):
            ts = time.monotonic()
            cell = wrk(port, body, connections, window_s, work)
            after.append({**cell, "seconds": time.monotonic() - ts})
    finally:
        if exfm.poll() is None:
            exfm.kill()
            exfm.wait()
        if server is not None:
            stop(server)
    what = f"wrk 1 thread, {connections} connection(s), {rows} row(s) a request, while the VM trained"
    while_training = summarize_windows(during)
    base = summarize_windows(after)
    pub = add_served(run_dir, {**(while_training or base or {"p50_ms": float("nan"), "p99_ms": float("nan"),
                                                             "rps": 0.0}),
                               "what": what if while_training else what.replace("while", "after")})
    versions = pub["versions"]
    return {
        "quick": quick, "connections": connections, "rows_per_request": rows, "window_s": window_s,
        "first_version_s": first_version_s, "run_s": time.monotonic() - t0, "config": str(CONFIG),
        "overrides": overrides,
        "published": [{
            **{k: pub[k] for k in ("seed", "vertical", "arm", "staleness", "ne", "alone_ne", "ne_gain")},
            "versions": len(versions), "full_versions": sum(1 for v in versions if v["full"]),
            "version_bytes": [v["publish_bytes"] for v in versions],
            "publish_s": [round(v["publish_seconds"], 3) for v in versions],
            "while_training": while_training, "after_training": base,
            "p99_vs_after_training": (while_training["p99_ms"] / base["p99_ms"]
                                      if while_training and base else None),
            "windows_while_training": during,
        }],
        "report": str(run_dir / "report.md"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny stream (the smoke test)")
    ap.add_argument("--arm", default="aux_sa", help="the published VM's arm (default aux_sa)")
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--window-s", type=float, default=0.0, help="seconds of one wrk window (default 3; quick 1)")
    ap.add_argument("--connections", type=int, default=1)
    ap.add_argument("--rows", type=int, default=1, help="rows a request")
    ap.add_argument("--work", help="keep the run here (default: a temporary directory)")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()
    window_s = a.window_s or (1.0 if a.quick else 3.0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work) if a.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        res = run(a.quick, a.arm, a.staleness, window_s, a.connections, a.rows, work)
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
