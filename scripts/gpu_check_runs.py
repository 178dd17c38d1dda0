"""The device check's steps that run recstack as a user does (``recstack train`` alone and under
torchrun, ``export``, ``serve``) and the throughput step (``scripts/gpu_check.py`` runs them;
docs/gpu.md).

Runs on the device and their CPU references start together where they do not depend on each other
(a GPU machine has cores to spare), and every run trains the test suite's tiny data set and small
model (``tests/conftest.py``), so the budgets of the memory-tier tests apply as they are.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_check import ROOT, STEP_BOUND, Timer, device_of

sys.path.insert(0, str(ROOT / "tests"))
from conftest import (  # noqa: E402
    RECSTACK,
    SMALL,
    free_port,
    torchrun,
    train_args,
    write_tiny_dataset,
)

# 2 ranks against 2 ranks on the CPU: fp16 / eb messages are close, not equal (as
# tests/distributed/test_torchrun)
TWO_RANK_BOUND = 5e-3
# tests/training/test_tiered_train.py's budgets
MIXED_TIERS = ['memory.device="4392"', 'memory.host="10800"']


def _plain(device: str) -> list[str]:
    """The one-process run of the tiers step (in memory; the model the serve step exports)."""
    return [*SMALL, "train.max_steps=30", "train.log_every=15", f'train.device="{device}"']


def _data(work: Path) -> Path:
    path = work / "data"
    if not (path / "meta.json").exists() and not path.exists():
        write_tiny_dataset(path)
    return path


def _start(args: list[str], log: Path, launcher: list[str] = RECSTACK) -> subprocess.Popen:
    """``recstack ARGS`` started with ``launcher``, its output to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open(log, "w")  # noqa: SIM115 (closed with the process: see _wait)
    proc = subprocess.Popen([*launcher, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    proc.log = f  # type: ignore[attr-defined]
    return proc


def _wait(*procs: subprocess.Popen) -> None:
    for p in procs:
        rc = p.wait()
        p.log.close()  # type: ignore[attr-defined]
        if rc != 0:
            tail = Path(p.log.name).read_text()[-1500:]  # type: ignore[attr-defined]
            raise RuntimeError(f"{' '.join(map(str, p.args[-6:]))} exited {rc}: {tail}")


def _summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


def _diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(abs(a[k] - b[k]) for k in ("auc", "logloss"))


def step_two_ranks(a: argparse.Namespace) -> dict[str, Any]:
    """Two ranks on one device through gloo (CUDA tensors on a GPU): row-wise fp16 pipelined and
    table-wise eb not pipelined, each against the same 2-rank run on the CPU; and a DCP checkpoint
    resumed (stopped at its step-10 checkpoint)."""
    data, runs = _data(a.work), a.work / "two_ranks"
    steps = ["train.max_steps=20", "train.log_every=10", "train.checkpoint_every=10"]
    base = [*SMALL, *steps, "train.eval_every=10"]
    variants = {
        "rw_fp16_pipelined": [
            'dist.sharding="row_wise"',
            'dist.forward_codec="fp16"',
            'dist.backward_codec="fp16"',
            "dist.pipeline=true",
        ],
        "tw_eb": [
            'dist.sharding="table_wise"',
            'dist.forward_codec="eb"',
            'dist.backward_codec="eb"',
            "dist.pipeline=false",
        ],
    }
    two = torchrun(2)
    procs = []
    for name, opts in variants.items():
        # the CPU reference once where the device is the CPU
        for dev in dict.fromkeys([a.device, "cpu"]):
            args = train_args(
                runs / f"{name}_{dev}", data, [*base, *opts, f'train.device="{dev}"']
            )
            procs.append(_start(args, runs / f"{name}_{dev}.log", two))
    half = [*base, *variants["rw_fp16_pipelined"], f'train.device="{a.device}"']
    resumed = runs / "resumed"
    procs.append(
        # stopped after its first checkpoint (step 10), resumed below to step 20
        _start(train_args(resumed, data, [*half, "train.max_steps=10"]), runs / "resume1.log", two)
    )
    _wait(*procs)
    _wait(_start(train_args(resumed, data, half, "--resume"), runs / "resume2.log", two))
    out: dict[str, Any] = {"bound": TWO_RANK_BOUND}
    ok = True
    for name in variants:
        got, ref = _summary(runs / f"{name}_{a.device}"), _summary(runs / f"{name}_cpu")
        d = _diff(got, ref)
        ok &= d <= TWO_RANK_BOUND and got["world_size"] == 2
        out[name] = {"auc": got["auc"], "logloss": got["logloss"], "max_diff_vs_cpu": d}
    straight = _summary(runs / f"rw_fp16_pipelined_{a.device}")
    d = _diff(_summary(resumed), straight)
    out["resume_max_diff"] = d
    return {"ok": ok and d <= STEP_BOUND, **out}


def step_tiers(a: argparse.Namespace) -> dict[str, Any]:
    """One process on the device: tables in memory against tables in tiers (device caches over host
    memory and SSD files); the in-memory run is the model the serve step exports."""
    data, runs = _data(a.work), a.work / "tiers"
    base = _plain(a.device)
    tiered = [*base, *MIXED_TIERS, f'memory.ssd_dir="{runs / "ssd"}"']
    _wait(
        _start(train_args(runs / "plain", data, base), runs / "plain.log"),
        _start(train_args(runs / "tiered", data, tiered), runs / "tiered.log"),
    )
    plain, tier = _summary(runs / "plain"), _summary(runs / "tiered")
    plan = (runs / "tiered.log").read_text()
    placed = "host-cached" in plan and "ssd-cached" in plan
    d = _diff(plain, tier)
    return {
        "ok": placed and d <= STEP_BOUND,
        "tiers_placed": placed,
        "auc": tier["auc"],
        "max_diff_vs_in_memory": d,
        "bound": STEP_BOUND,
    }


def _serve_and_compare(
    model: Path, dev: str, rows: list[dict[str, Any]], log: Path
) -> dict[str, float]:
    """``recstack serve MODEL --device DEV``: the served logits of ``rows`` against the artifact
    scored on the CPU in this process, and request latencies."""
    import httpx

    from recstack.serving.model import ServingModel

    offline = ServingModel.load(model, device="cpu")
    want = offline.score(offline.encode(rows, ids=True)).numpy()
    port = free_port()
    proc = _start(["serve", str(model), "--port", str(port), "--device", dev], log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"recstack serve --device {dev} did not get ready: {log.read_text()[-1500:]}"
                )
            time.sleep(0.2)
        lat = []
        body = {"rows": rows, "encoded": True, "return_logit": True}
        for _ in range(50):
            t0 = time.perf_counter()
            r = httpx.post(f"http://127.0.0.1:{port}/v1/score", json=body, timeout=10)
            lat.append(time.perf_counter() - t0)
            r.raise_for_status()
        got = np.array(r.json()["logits"], dtype=np.float32)
    finally:
        proc.terminate()
        proc.wait(30)
        proc.log.close()  # type: ignore[attr-defined]
    return {
        "max_abs_logit_diff": float(np.abs(got - want).max()),
        "p50_ms": 1e3 * float(np.median(lat)),
    }


def step_serve(a: argparse.Namespace) -> dict[str, Any]:
    """Export (the tiers step's in-memory run, and a QR model trained and exported on the CPU) and
    ``serve --device``: served = offline within the bound."""
    data, runs = _data(a.work), a.work / "serve"
    plain = a.work / "tiers" / "plain"
    qr = [
        *SMALL,
        "train.max_steps=20",
        'train.device="cpu"',
        "model.qr_collisions=4",
        "model.qr_threshold=100",
    ]
    procs = [_start(train_args(runs / "qr", data, qr), runs / "qr_train.log")]
    if not (plain / "summary.json").exists():  # the tiers step did not leave its run
        procs.append(
            _start(
                train_args(plain, data, _plain(a.device)),
                runs / "plain_train.log",
            )
        )
    _wait(*procs)
    _wait(
        _start(
            ["export", "--checkpoint", str(plain), "--out", str(runs / "model")],
            runs / "export.log",
        ),
        _start(
            ["export", "--checkpoint", str(runs / "qr"), "--out", str(runs / "model_qr")],
            runs / "export_qr.log",
        ),
    )
    rng = np.random.default_rng(0)
    sizes = [50, 300, 7, 1000]
    rows = [
        {f"I{i + 1}": float(rng.random()) for i in range(13)}
        | {f"C{i + 1}": int(rng.integers(0, n)) for i, n in enumerate(sizes)}
        for _ in range(64)
    ]
    res = {
        "plain": _serve_and_compare(runs / "model", a.device, rows, runs / "serve.log"),
        "qr_exported_on_cpu": _serve_and_compare(
            runs / "model_qr", a.device, rows, runs / "serve_qr.log"
        ),
    }
    ok = all(r["max_abs_logit_diff"] <= STEP_BOUND for r in res.values())
    return {"ok": ok, "bound": STEP_BOUND, **res}


def _syncs(fn: Any, dev: torch.device) -> int | None:
    """Host-device synchronizations of one call of ``fn`` (torch's sync debug mode; None on the
    CPU)."""
    if dev.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in seen)


def _throughput_at(batch: int, dev: torch.device, timed: int, max_rows: int) -> dict[str, Any]:
    """bench/train_throughput.py's three models at ``batch`` on ``dev``, TF32 off then on:
    samples/s, step ms and (a GPU) peak memory per kind; host syncs of one recstack step."""
    from bench.train_throughput import StepKinds
    from recstack.training.step import set_tf32

    cuda = dev.type == "cuda"
    kinds = StepKinds(batch, device=dev, max_rows=max_rows, num_batches=4)
    step = kinds.step
    row: dict[str, Any] = {}
    for tf32 in (False, True):
        set_tf32(tf32)
        for kind in ("recstack", "baseline", "floor"):
            for i in range(2 if cuda else 1):  # warm-up
                step(kind, i)
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            timer = Timer(dev)
            timer.start()
            for i in range(timed):
                step(kind, i)
            s = timer.stop() / timed
            rec = {"samples_per_s": round(batch / s, 1), "step_ms": round(1e3 * s, 3)}
            if cuda:
                rec["peak_mem_mb"] = round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
            row[f"{kind}_tf32_{'on' if tf32 else 'off'}"] = rec
    set_tf32(False)
    row["recstack_syncs_per_step"] = _syncs(lambda: step("recstack", 0), dev)
    return row


def step_throughput(a: argparse.Namespace) -> dict[str, Any]:
    """Training samples/s at batch 2048 and 16384 (the rehearsal: 256 and 2048) of the Criteo
    Kaggle DLRM (bench/train_throughput.py's models: recstack's Trainer step, the per-table
    baseline, the dense floor, in this process), TF32 off and on; host syncs per recstack step and
    peak device memory per kind."""
    dev = device_of(a.device)
    cuda = dev.type == "cuda"
    # the CPU rehearsal only shows that the steps run: batches / 8, tables capped at 10k rows, 1
    # timed step
    timed, max_rows, batches = (10, 1_000_000, (2048, 16384)) if cuda else (1, 10_000, (256, 2048))
    out: dict[str, Any] = {}
    for batch in batches:
        out[f"batch_{batch}"] = _throughput_at(batch, dev, timed, max_rows)
        if cuda:  # the models of this batch size are gone: their memory back for the next
            gc.collect()
            torch.cuda.empty_cache()
    ok = all(
        r["samples_per_s"] > 0 for row in out.values() for r in row.values() if isinstance(r, dict)
    )
    timer = "cuda events" if cuda else "perf_counter"
    return {"ok": ok, "timed_steps": timed, "max_rows": max_rows, "timer": timer, **out}


RUN_STEPS = {
    "two_ranks": step_two_ranks,
    "tiers": step_tiers,
    "serve": step_serve,
    "throughput": step_throughput,
}
