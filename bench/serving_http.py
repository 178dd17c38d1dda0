"""The HTTP arm of ``bench/serving.py``: ``recstack serve`` against the server a user would
otherwise write (``bench/eager_server.py``: starlette + ``load_model``, eager PyTorch per request),
both with 1 worker and 1 torch thread, in the same run, under ``wrk`` (Debian's package) as the load
generator.

Model: the Criteo Kaggle reference DLRM (dim 16, bottom 13-512-256-64-16, top 512-256-1, dot) on
Criteo rows prepared with ``--max-ind-range`` hashing (26 tables of that many rows), step-0 weights
of a real ``Trainer`` checkpoint exported with fp32 tables (the eager server computes the same
model). Synthetic raw rows (random hex categoricals, some empty) give both request forms: raw Criteo
fields, and the encoded ids ``recstack``'s encoder makes of them (``"encoded": true``).

Cells: {raw, encoded} x {1 row, 1 user + 100 candidates} x {c = 1, 8, 32, 64}; per cell each
server's req/s and p50 / p99 (wrk ``--latency``), and the ratio. Also: a lone request's cost (c = 1,
1 encoded row, p50) against the model call alone (in process); the 100-candidate p99 at half the
saturation rate (open-loop client of ``bench/serving.py``); RSS and PSS of ``recstack serve`` with 1
and 2 workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 8, 32, 64)
SIZES = (1, 100)
FORMS = ("raw", "encoded")
WRK = shutil.which("wrk") or "/usr/bin/wrk"


def raw_rows(n: int, seed: int) -> list[list[str]]:
    """Criteo TSV fields [label, I1..I13, C1..C26]: small counts and Zipf-like hex categoricals,
    some empty."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        dense = ["" if rng.random() < 0.1 else str(int(rng.zipf(1.5)) - 1) for _ in range(13)]
        cats = [
            "" if rng.random() < 0.05 else f"{int(rng.zipf(1.2)) * 2654435761 % 2**32:08x}"
            for _ in range(26)
        ]
        out.append([str(int(rng.random() < 0.25)), *dense, *cats])
    return out


def build(tmp: Path, max_ind_range: int) -> dict[str, Any]:
    """raw TSV -> recstack data prepare (hashed) -> step-0 Trainer checkpoint -> fp32 artifact, and
    request rows of both forms -> {"run", "model", "raw", "encoded"}."""
    from bench.train_throughput import kaggle_config
    from recstack.serving.export import export_checkpoint
    from recstack.serving.model import ServingModel
    from recstack.training.trainer import Trainer

    tsv = tmp / "raw.tsv"
    fields = raw_rows(2048, seed=0)
    tsv.write_text("".join("\t".join(f) + "\n" for f in fields))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "recstack",
            "data",
            "prepare",
            str(tsv),
            "--out",
            str(tmp / "data"),
            "--max-ind-range",
            str(max_ind_range),
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    cfg = kaggle_config()
    cfg.model.max_table_size = max_ind_range
    cfg.train.batch_size = 64
    cfg.data.train, cfg.data.eval_fraction = str(tmp / "data"), 0.0
    trainer = Trainer(cfg, tmp / "run")
    trainer.save()
    trainer.close()
    model_dir, _ = export_checkpoint(tmp / "run", tmp / "model", tables="fp32")
    raw = [
        {
            **{f"I{j + 1}": int(v) if v else None for j, v in enumerate(f[1:14])},
            **{f"C{j + 1}": v or None for j, v in enumerate(f[14:40])},
        }
        for f in fields[:256]
    ]
    m = ServingModel.load(model_dir)
    b = m.encode(raw)
    ids = b.sparse.ids.view(26, len(raw))
    encoded = [
        {
            **{f"I{j + 1}": float(b.dense[i, j]) for j in range(13)},
            **{f"C{f + 1}": int(ids[f, i]) for f in range(26)},
        }
        for i in range(len(raw))
    ]
    return {"run": tmp / "run", "model": model_dir, "raw": raw, "encoded": encoded}


def body(rows: list[dict], form: str, size: int, seed: int) -> bytes:
    """One request: a row, or one user (I1..I13, C1..C13 of one row) with ``size`` candidates
    (C14..C26)."""
    rng = np.random.default_rng(seed)
    pick = [rows[i] for i in rng.integers(0, len(rows), size)]
    enc = form == "encoded"
    if size == 1:
        return json.dumps({"rows": pick, "encoded": enc}).encode()
    user = {k: v for k, v in pick[0].items() if k.startswith("I") or int(k[1:]) <= 13}
    cands = [{k: v for k, v in r.items() if k not in user} for r in pick]
    return json.dumps({"shared": user, "candidates": cands, "encoded": enc}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, probe: bytes, log: Path) -> subprocess.Popen:
    """Start a server and wait until it answers ``probe`` with 200."""
    import httpx

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.post(f"http://127.0.0.1:{port}/v1/score", content=probe).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]} not ready after 300 s")


def compile_args(tmp: Path, quick: bool) -> list[str]:
    """``recstack serve``'s compile flags: AOTInductor into a fresh cache of this run (the compile is
    timed), the graph only in a quick run (a smoke test: the compile has its own tests)."""
    if quick:
        return ["--compile", "none"]
    return ["--compile", "aoti", "--compile-cache", str(tmp / "compiled")]


def wait_compiled(port: int, quick: bool, timeout: float = 900) -> float | None:
    """Seconds until the server at ``port`` runs its compiled dense program (None: not asked for)."""
    import httpx

    if quick:
        return None
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        if re.search(r"^recstack_model_compiled(\{[^}]*\})? 1(\.0)?$", text, re.M):
            return round(time.monotonic() - start, 1)
        time.sleep(0.5)
    raise RuntimeError(f"recstack serve on port {port}: not compiled after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if m is None:
        return float("nan")
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]


def wrk(
    port: int, payload: bytes, connections: int, duration_s: float, tmp: Path
) -> dict[str, Any]:
    """One wrk run (1 thread, ``connections`` keep-alive connections, POST ``payload``, whole
    seconds) -> req/s, p50, p99."""
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(payload.decode())}\n"
    )
    cmd = [
        WRK,
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(duration_s))}s",
        "--latency",
        "--timeout",
        "30s",
        "-s",
        str(script),
        f"http://127.0.0.1:{port}/v1/score",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.M))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {
        "rps": float(rps.group(1)) if rps else 0.0,
        "p50_ms": _ms(lat.get("50", "")),
        "p99_ms": _ms(lat.get("99", "")),
        "non_2xx": int(bad.group(1)) if bad else 0,
        "socket_errors": errors.group(1).strip() if errors else None,
    }


def ratio(cell: dict[str, Any], key: str) -> float | None:
    """recstack's figure over the eager server's; None where either completed no request (a cell
    that says nothing, as on a machine too loaded to answer within wrk's run)."""
    r, e = cell["recstack"], cell["eager"]
    if not (r["rps"] > 0 and e["rps"] > 0 and r["p50_ms"] > 0 and e["p50_ms"] > 0):
        return None
    return round(r[key] / e[key], 2)


def model_call_ms(model_dir: Path, run: Path, rows: list[dict], cache: Path | None) -> dict[str, float]:
    """The median time of one model call on one encoded row: recstack's ServingModel (its graph, and
    the program the server compiled into ``cache``) and the eager model."""
    from recstack.data.batch import Batch, SparseFeatures
    from recstack.serving.compile import ensure_package, load_checked
    from recstack.serving.model import ServingModel
    from recstack.training.inference import load_model

    torch.set_num_threads(1)  # as both servers
    m = ServingModel.load(model_dir)
    batch = m.encode(rows[:1], ids=True)
    _, eager = load_model(run, "cpu")
    eb = Batch(
        batch.dense, SparseFeatures.from_dense_ids(batch.sparse.ids.view(1, -1)), torch.zeros(1)
    )
    calls = {"recstack_ms": lambda: m.score(batch), "eager_ms": lambda: eager(eb)}
    if cache is not None:
        compiled = ServingModel.load(model_dir)
        package = asyncio.run(ensure_package(compiled.program_path, compiled.device, cache))
        compiled.use_compiled(load_checked(package, compiled))
        calls["recstack_compiled_ms"] = lambda: compiled.score(batch)
    out = {}
    for name, call in calls.items():
        times = []
        with torch.inference_mode():
            for _ in range(600):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
        out[name] = round(statistics.median(times[100:]) * 1e3, 4)
    return out


def memory(model_dir: Path, workers: int, probe: bytes, tmp: Path, quick: bool) -> dict[str, Any]:
    """RSS and PSS (MB, summed over the server's processes) of ``recstack serve --workers N`` after
    a few requests (compiled programs from the run's cache, loaded by every worker)."""
    port = free_port()
    proc = start(
        [
            sys.executable,
            "-m",
            "recstack",
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--workers",
            str(workers),
            *compile_args(tmp, quick),
        ],
        port,
        probe,
        tmp / f"mem_{workers}.log",
    )
    try:
        import httpx

        for _ in range(50):  # fresh connections: each worker takes some
            httpx.post(f"http://127.0.0.1:{port}/v1/score", content=probe)
        for _ in range(workers):  # each worker answers /metrics for itself
            wait_compiled(port, quick, timeout=120)
        pids = [proc.pid] + [
            int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        ]
        rss = pss = 0
        for pid in pids:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        return {
            "workers": workers,
            "processes": len(pids),
            "rss_mb": round(rss / 1024, 1),
            "pss_mb": round(pss / 1024, 1),
        }
    finally:
        stop(proc)


def run(duration_s: float, max_ind_range: int, quick: bool) -> dict[str, Any]:
    """Build the model, run every cell on both servers, and the extra measurements -> results."""
    from bench.serving import offer

    with tempfile.TemporaryDirectory(prefix="recstack-bench-http-") as d:
        tmp = Path(d)
        built = build(tmp, max_ind_range)
        probe = body(built["raw"], "raw", 1, seed=0)
        ports = {"recstack": free_port(), "eager": free_port()}
        cmds = {
            "recstack": [
                sys.executable,
                "-m",
                "recstack",
                "serve",
                str(built["model"]),
                "--port",
                str(ports["recstack"]),
                "--threads",
                "1",
                *compile_args(tmp, quick),
            ],
            "eager": [
                sys.executable,
                str(ROOT / "bench" / "eager_server.py"),
                str(built["run"]),
                str(max_ind_range),
                str(ports["eager"]),
            ],
        }
        procs = {k: start(cmds[k], ports[k], probe, tmp / f"{k}.log") for k in cmds}
        compile_s = wait_compiled(ports["recstack"], quick)
        cells = []
        try:
            for form in FORMS:
                for size in SIZES:
                    payload = body(built[form], form, size, seed=size)
                    for c in (1, 8) if quick else CONCURRENCY:
                        cell: dict[str, Any] = {"form": form, "candidates": size, "connections": c}
                        for name in ("recstack", "eager") if c % 2 else ("eager", "recstack"):
                            wrk(ports[name], payload, c, 1.0, tmp)  # warm-up, each server alike
                            cell[name] = wrk(ports[name], payload, c, duration_s, tmp)
                        cell["rps_ratio"] = ratio(cell, "rps")
                        cell["p99_ratio"] = ratio(cell, "p99_ms")
                        cells.append(cell)
                        r, e = cell["recstack"], cell["eager"]
                        print(
                            f"wrk {form} x{size} c={c}: recstack {r['rps']:.0f} req/s p99 "
                            f"{r['p99_ms']:.2f} ms, eager {e['rps']:.0f} req/s p99 "
                            f"{e['p99_ms']:.2f} ms",
                            file=sys.stderr,
                            flush=True,
                        )
            sat = max(
                c["recstack"]["rps"]
                for c in cells
                if c["form"] == "encoded" and c["candidates"] == 100
            )
            payloads = [body(built["encoded"], "encoded", 100, seed=s) for s in range(16)]
            half = asyncio.run(
                offer(
                    f"http://127.0.0.1:{ports['recstack']}",
                    payloads,
                    max(1.0, sat / 2),
                    duration_s * 2,
                    procs["recstack"].pid,
                )
            )
        finally:
            for p in procs.values():
                stop(p)
        lone = model_call_ms(built["model"], built["run"], built["encoded"],
                             None if quick else tmp / "compiled")
        lone_cell = next(
            c
            for c in cells
            if c["form"] == "encoded" and c["candidates"] == 1 and c["connections"] == 1
        )
        lone["recstack_request_p50_ms"] = lone_cell["recstack"]["p50_ms"]
        lone["eager_request_p50_ms"] = lone_cell["eager"]["p50_ms"]
        served_call = lone.get("recstack_compiled_ms", lone["recstack_ms"])  # what the server ran
        lone["recstack_overhead_ms"] = (
            round(lone["recstack_request_p50_ms"] - served_call, 3)
            if lone_cell["recstack"]["rps"] > 0
            else None
        )
        mem = [memory(built["model"], w, probe, tmp, quick) for w in (1, 2)]
    return {
        "max_ind_range": max_ind_range,
        "duration_s": duration_s,
        "compile_s": compile_s,
        "cells": cells,
        "lone_request": lone,
        "half_saturation_100": {"saturation_rps": sat, **half},
        "memory": mem,
    }


def targets(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The issue's serving targets -> {target: {"met", "value", "note"}}."""
    measured = [c for c in res["cells"] if c["rps_ratio"] is not None]
    blank = len(res["cells"]) - len(measured)
    lone = res["lone_request"]
    half = res["half_saturation_100"]
    where = "{form} x{candidates} c={connections}"

    def every_cell(key: str, worst: Any, ok: Any, what: str) -> dict[str, Any]:
        if not measured:
            return {"met": None, "note": "no cell completed requests on both servers"}
        c = worst(measured, key=lambda c: c[key])
        note = f"{what}: " + where.format(**c)
        if blank:
            note += f"; {blank} cell(s) not measured"
        return {"met": ok(c[key]) and not blank, "value": c[key], "note": note}

    overhead = lone["recstack_overhead_ms"]
    return {
        "recstack >= 1.5x the eager server's req/s in every cell": every_cell(
            "rps_ratio", min, lambda v: v >= 1.5, "lowest"
        ),
        "recstack p99 <= the eager server's in every cell": every_cell(
            "p99_ratio", max, lambda v: v <= 1.0, "highest p99 ratio"
        ),
        "a lone request (c=1, 1 row) costs <= the model call + 0.3 ms": {
            "met": None if overhead is None else overhead <= 0.3,
            "value": lone["recstack_overhead_ms"],
            "note": f"p50 {lone['recstack_request_p50_ms']} ms, "
            f"model call {lone.get('recstack_compiled_ms', lone['recstack_ms'])} ms "
            "(wrk's client and HTTP in the p50)",
        },
        "1 user + 100 candidates: p99 <= 10 ms at half the saturation rate": {
            "met": half["p99_ms"] <= 10 and not half["errors"],
            "value": half["p99_ms"],
            "note": f"{half['offered_rps']:.0f} req/s offered, "
            f"saturation {half['saturation_rps']:.0f}",
        },
    }


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "| request | c | recstack req/s | eager req/s | ratio | recstack p99 ms | eager p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in res["cells"]:
        r, e = c["recstack"], c["eager"]
        ratio_text = "-" if c["rps_ratio"] is None else f"{c['rps_ratio']:.2f}x"
        lines.append(
            f"| {c['form']}, {'1 row' if c['candidates'] == 1 else '1 user + 100 candidates'} | "
            f"{c['connections']} | {r['rps']:,.0f} | {e['rps']:,.0f} | {ratio_text} | "
            f"{r['p99_ms']:.2f} | {e['p99_ms']:.2f} |"
        )
    lines += [
        "",
        f"lone request: {res['lone_request']}",
        f"half saturation: {res['half_saturation_100']}",
        f"memory: {res['memory']}",
    ]
    return "\n".join(lines)
