"""Distributed training throughput: 2 ranks on gloo, 1 thread each, per sharding type, communication precision
and pipelining, against TorchRec's DistributedModelParallel (table-wise) in the same run.

Model: the Criteo Kaggle reference DLRM (dim 16, bottom 13-512-256-64-16, top 512-256-1, dot interaction,
26 tables at the Kaggle cardinalities capped at 1M rows, SGD lr 0.1 dense and sparse), and for the bytes of
int8 at a wider row the same tables at dim 64 with the Terabyte MLPs (bottom 13-512-256-64, top 512-512-256-1).
Ids are Zipf-like, written once into a prepared data set that every step reads through the trainer's own
``BatchLoader`` (per-rank batch ``--batch``, 1024 by default).

Each recstack model is a real ``recstack.training.trainer.Trainer`` built under the distributed launch (sharding from
``dist.sharding`` or a plan, DDP for the dense part); a step is ``Trainer.train_step``. Precision is switched
on the sharded collection (``forward_codec``/``backward_codec``, both directions alike); pipelining uses the
trainer's own loader transform (``dist.pipeline``: the prefetch thread distributes the next batch's ids on
a process group of its own while the current batch computes). ``data_parallel`` replicates only the tables
of at most ``--dp-max-rows`` rows (the others stay table-wise): replicating the 1M-row tables would all-reduce
their whole dense gradient (5.6M x 16 floats, 360 MB) every step. With 2 ranks on one node
``table_row_wise`` is row-wise over both ranks, i.e. the same placement as ``row_wise``.

Timing: after a warm-up and a calibration of the steps per window, ``--rounds`` rounds each run one window
of about ``--window`` seconds per case, in an order rotated every round; windows start and end with a
barrier. Samples/s (global) = 2 x batch / median step time; ratios are medians of per-round ratios, so
drifting load on a shared machine hits both sides of a ratio alike. CPU ms/step (process CPU time of both
ranks, all threads) is reported beside it: the work done, steadier than wall time when the machine is shared.
Bytes per step come from a separate exact pass (two non-pipelined steps per model and codec) through the
collection's ``CommStats``. The ranks run ``bench/dist_worker.py``; the TorchRec model is
``bench/torchrec_dlrm.py``.

    python bench/dist_throughput.py [--quick] [--out results.json]      # make bench-dist: with TorchRec

JSON goes to stdout (and ``--out``), a markdown table to stderr. TorchRec rows need torchrec/fbgemm-gpu-cpu
(``make bench-dist`` installs them into ``.venv-bench``); without them the bench says so and skips the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.dist_worker import CODECS, SHARDINGS, Case  # noqa: E402
from bench.train_throughput import machine_info, zipf_ids  # noqa: E402
from recstack.data.format import SparseFeatureSpec, capped_table_sizes  # noqa: E402
from recstack.data.prepare.criteo import KAGGLE_CARDINALITIES, SPARSE_NAMES  # noqa: E402
from recstack.data.prepared_writer import PreparedWriter  # noqa: E402

WORLD = 2
NUM_DENSE = 13


def write_dataset(path: Path, sizes: list[int], rows: int, seed: int = 0) -> Path:
    """A prepared data set of ``rows`` rows: Zipf-like ids per table, log-count-like dense features,
    25% positives. Written in chunks so memory stays small."""
    gen = torch.Generator().manual_seed(seed)
    specs = [SparseFeatureSpec(name, n) for name, n in zip(SPARSE_NAMES, sizes, strict=True)]
    with PreparedWriter(path, [f"I{i}" for i in range(1, NUM_DENSE + 1)], specs, overwrite=True) as w:
        done = 0
        while done < rows:
            n = min(65536, rows - done)
            ids = zipf_ids(sizes, n, gen).numpy().astype(np.int32)  # [n, 26]
            dense = torch.rand(n, NUM_DENSE, generator=gen).mul_(8.0).log1p_().numpy()
            labels = (torch.rand(n, generator=gen) < 0.25).float().numpy()
            w.write(labels, dense, ids)
            done += n
    return path


REFERENCE = Case("recstack", "d16", "table_wise", "fp32", False)
TORCHREC = Case("torchrec", "d16", "table_wise", "fp32", False)
ROW_BYTES = {"fp32": lambda d: 4 * d, "fp16": lambda d: 2 * d, "bf16": lambda d: 2 * d,
             "fp8": lambda d: d + 4, "int8": lambda d: d + 8}  # wire bytes of one pooled row of dim d


def build_cases(reduced: bool, pipeline: bool, torchrec: bool) -> list[Case]:
    """The timed cases, in build order (the TorchRec model borrows the table-wise trainer's loader)."""
    pipes = (False, True) if pipeline else (False,)
    if reduced:
        cases = [Case("recstack", "d16", s, "fp32", False) for s in SHARDINGS]
        cases += [Case("recstack", "d16", "table_wise", "fp32", True)] if pipeline else []
        cases += [Case("recstack", "d16", "table_wise", c, False) for c in ("fp16", "int8")]
        cases += [Case("recstack", "d64", "table_wise", c, False) for c in ("fp32", "int8")]
        return cases + ([TORCHREC] if torchrec else [])
    cases = [Case("recstack", "d16", s, "fp32", p) for s in SHARDINGS for p in pipes]
    cases += [Case("recstack", "d16", "table_wise", c, p) for c in CODECS[1:] for p in pipes]
    cases += [Case("recstack", "d16", "row_wise", c, False) for c in ("fp16", "int8")]
    cases += [Case("recstack", "d64", "table_wise", c, False) for c in ("fp32", "fp16", "int8")]
    if torchrec:
        cases += [TORCHREC, Case("torchrec", "d16", "table_wise", "fp32", True),
                  Case("torchrec", "d16", "table_wise", "fp16", False)]
    return cases


def _paired(mine: list[float], other: list[float]) -> float:
    """Median over rounds of other's step time / mine: > 1 means this case is faster."""
    return round(statistics.median(o / m for m, o in zip(mine, other, strict=True)), 3)


def _bytes_total(per_rank: list[dict[str, float]]) -> dict[str, int]:
    """Bytes per step summed over ranks, by phase (``bytes_fwd_a2a`` -> ``fwd_a2a``)."""
    out: dict[str, int] = {}
    for stats in per_rank:
        for k, v in stats.items():
            out[k.removeprefix("bytes_")] = out.get(k.removeprefix("bytes_"), 0) + round(v)
    return out


def summarize(res: dict[str, Any], cases: list[Case], batch: int) -> dict[str, Any]:
    """Rank 0's raw results -> rows with samples/s, paired ratios and bytes, the bytes matrix and the checks."""
    dims = {"d16": 16, "d64": 64}
    matrix = []
    for key, per_rank in res["bytes"].items():
        model, sharding, codec = key.split()
        b = _bytes_total(per_rank)
        fp32 = _bytes_total(res["bytes"][f"{model} {sharding} fp32"])
        a2a, a2a32 = b.get("fwd_a2a", 0) + b.get("bwd_a2a", 0), fp32.get("fwd_a2a", 0) + fp32.get("bwd_a2a", 0)
        d = dims[model]
        matrix.append({"model": model, "sharding": sharding, "codec": codec, "bytes_per_step": b,
                       "a2a_ratio_vs_fp32": round(a2a32 / a2a, 3) if a2a else None,
                       "total_ratio_vs_fp32": round(sum(fp32.values()) / max(1, sum(b.values())), 3),
                       "row_ratio_vs_fp32": round(ROW_BYTES["fp32"](d) / ROW_BYTES[codec](d), 3)})
    by_bytes = {(m["model"], m["sharding"], m["codec"]): m for m in matrix}
    raw = {c["name"]: c for c in res["cases"]}
    rows = []
    for case in cases:
        r = raw[case.name]
        st = r["step_s_rounds"]
        row: dict[str, Any] = {
            "name": case.name, **asdict(case), "steps_per_window": r["steps_per_window"],
            "step_ms": round(statistics.median(st) * 1e3, 2),
            "samples_per_s": round(WORLD * batch / statistics.median(st), 1),
            "samples_per_s_rounds": [round(WORLD * batch / x, 1) for x in st],
            # CPU seconds per step of both ranks (all threads): the work, steadier than wall time when shared
            "cpu_ms_per_step": round(statistics.median(r["cpu_s_rounds"]) * 1e3, 2),
            "time_breakdown_ms": {k.removeprefix("time_"): round(v * 1e3, 3) for k, v in r["time_breakdown"].items()},
            "vs_recstack_table_wise_fp32": _paired(st, raw[REFERENCE.name]["step_s_rounds"]),
        }
        if TORCHREC.name in raw:
            row["vs_torchrec_table_wise_fp32"] = _paired(st, raw[TORCHREC.name]["step_s_rounds"])
        twin = Case(case.impl, case.model, case.sharding, case.codec, False).name
        if case.pipeline and twin in raw:
            row["vs_not_pipelined"] = _paired(st, raw[twin]["step_s_rounds"])
        m = by_bytes.get((case.model, case.sharding, case.codec)) if case.impl == "recstack" else None
        if m:
            row["bytes_per_step"], row["a2a_ratio_vs_fp32"] = m["bytes_per_step"], m["a2a_ratio_vs_fp32"]
        rows.append(row)
    checks: dict[str, Any] = {}
    if TORCHREC.name in raw:
        v = next(r["vs_torchrec_table_wise_fp32"] for r in rows if r["name"] == REFERENCE.name)
        checks["recstack_tw_fp32_over_torchrec_tw_fp32"] = {"ratio": v, "at_least_1": v >= 1.0}
    for model, codec in (("d16", "fp16"), ("d16", "int8"), ("d64", "fp16"), ("d64", "int8")):
        m = by_bytes.get((model, "table_wise", codec))
        if m:
            checks[f"{model}_table_wise_{codec}_a2a_bytes_ratio"] = m["a2a_ratio_vs_fp32"]
    return {"cases": rows, "bytes_matrix": matrix, "checks": checks, "build_s": res["build_s"]}


def markdown(report: dict[str, Any]) -> str:
    has_tr = any("vs_torchrec_table_wise_fp32" in r for r in report["cases"])
    head = "| case | global samples/s | step ms | vs recstack tw fp32 |" + (" vs TorchRec tw fp32 |" if has_tr else "")
    lines = [head + " pipelined vs not | CPU ms/step | embedding a2a KB/step | a2a bytes vs fp32 |",
             "|---|---:|---:|---:|" + ("---:|" if has_tr else "") + "---:|---:|---:|---:|"]
    for r in report["cases"]:
        b = r.get("bytes_per_step")
        a2a = f"{(b.get('fwd_a2a', 0) + b.get('bwd_a2a', 0)) / 1024:,.0f}" if b else "n/a"
        cells = [r["name"], f"{r['samples_per_s']:,.0f}", f"{r['step_ms']:.1f}",
                 f"{r['vs_recstack_table_wise_fp32']:.2f}x"]
        if has_tr:
            cells.append(f"{r['vs_torchrec_table_wise_fp32']:.2f}x")
        cells += [f"{r['vs_not_pipelined']:.2f}x" if "vs_not_pipelined" in r else "", f"{r['cpu_ms_per_step']:.0f}",
                  a2a, f"{r['a2a_ratio_vs_fp32']:.2f}x" if r.get("a2a_ratio_vs_fp32") else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Bytes sent per step, all ranks (forward + backward pooled all-to-all; ratio to fp32):", "",
              "| model | sharding | " + " | ".join(CODECS) + " | input dist KB | all-reduce KB |",
              "|---|---|" + "---:|" * (len(CODECS) + 2)]
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for m in report["bytes_matrix"]:
        groups.setdefault((m["model"], m["sharding"]), {})[m["codec"]] = m
    for (model, sharding), by_codec in groups.items():
        cells = [model, sharding]
        for c in CODECS:
            m = by_codec.get(c)
            b = m["bytes_per_step"] if m else {}
            kb = (b.get("fwd_a2a", 0) + b.get("bwd_a2a", 0)) / 1024
            cells.append(f"{kb:,.0f} ({m['a2a_ratio_vs_fp32']:.2f}x)" if m and m["a2a_ratio_vs_fp32"] else "n/a")
        b32 = by_codec["fp32"]["bytes_per_step"]
        ar = b32.get("allreduce_dense", 0) + b32.get("allreduce_emb", 0)
        cells += [f"{b32.get('input_dist', 0) / 1024:,.0f}", f"{ar / 1024:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"other load: {report['other_runnable']} other runnable tasks on average during the run "
              f"({report['machine']['logical_cpus']} logical CPUs); TorchRec: {report['torchrec']}"]
    return "\n".join(lines)


def _other_load() -> int | None:
    """Tasks running or waiting for a CPU machine-wide (4th field of /proc/loadavg), or None."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def launch(spec: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """Start WORLD gloo processes running ``bench.dist_worker.worker`` and wait, sampling the machine's load.
    -> (rank 0's results, mean number of other runnable tasks or None)."""
    from bench.dist_worker import worker

    with tempfile.TemporaryDirectory(prefix="dist_bench_") as tmp:
        out = Path(tmp) / "result.json"
        os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # children inherit: 1 thread per rank
        ctx = mp.start_processes(worker, args=(WORLD, spec, str(out), str(Path(tmp) / "init")), nprocs=WORLD,
                                 join=False, start_method="spawn")
        samples: list[int] = []
        while not ctx.join(timeout=0.5):
            n = _other_load()
            if n is not None:
                samples.append(max(0, n - 1 - WORLD))  # this sampler and the two ranks excluded
        load = round(statistics.mean(samples), 2) if samples else None
        return json.loads(out.read_text()), load


def _torchrec_status(disabled: bool) -> tuple[bool, str]:
    """-> (run the TorchRec rows, a note for the report); says so on stderr when TorchRec cannot run here."""
    if disabled:
        return False, "disabled (--no-torchrec)"
    from bench.torchrec_dlrm import available

    ok, why = available()
    if ok:
        return True, f"torchrec {why}"
    note = f"not importable here ({why}); TorchRec rows skipped. `make bench-dist` installs it."
    print(f"dist_throughput: TorchRec {note}", file=sys.stderr, flush=True)
    return False, note


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer cases, rounds and shorter windows (about 2 min)")
    p.add_argument("--smoke", action="store_true", help="tiny tables and batches, a few steps (tests)")
    p.add_argument("--out", type=Path, help="also write the JSON results to this file")
    p.add_argument("--batch", type=int, default=1024, help="per-rank batch size (default 1024)")
    p.add_argument("--rounds", type=int, help="timed rounds (default 8, quick 3, smoke 1)")
    p.add_argument("--window", type=float, help="seconds per timed window (default 1.0, quick 0.6)")
    p.add_argument("--max-rows", type=int, default=1_000_000, help="cap on every table's rows")
    p.add_argument("--dp-max-rows", type=int, default=20_000,
                   help="data_parallel case: replicate the tables up to this many rows, the rest table-wise")
    p.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec rows even if it imports")
    p.add_argument("--only", nargs="+", metavar="TEXT",
                   help="time only the cases whose name contains one of these (the reference case always runs)")
    a = p.parse_args(argv)
    if a.smoke:
        a.max_rows, a.batch, a.dp_max_rows = min(a.max_rows, 2000), min(a.batch, 64), min(a.dp_max_rows, 500)
        a.no_torchrec = True
    rounds = a.rounds or (1 if a.smoke else 3 if a.quick else 8)
    window = a.window or (0.2 if a.smoke else 0.6 if a.quick else 1.0)

    use_torchrec, torchrec_note = _torchrec_status(a.no_torchrec)
    from recstack.distributed.config import DistConfig

    pipeline_ready = "pipeline" in DistConfig.__dataclass_fields__
    if not pipeline_ready:
        print("dist_throughput: this recstack has no dist.pipeline; pipelined rows skipped", file=sys.stderr)
    cases = build_cases(a.quick or a.smoke, pipeline_ready, use_torchrec)
    if a.only:
        cases = [c for c in cases if c == REFERENCE or any(t in c.name for t in a.only)]
    sizes = capped_table_sizes(KAGGLE_CARDINALITIES, a.max_rows)
    data_batches = 24 if a.smoke else 96  # global batches in the data set; windows cycle through them
    info = machine_info()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dist_bench_data_") as tmp:
        data = write_dataset(Path(tmp) / "data", sizes, data_batches * a.batch * WORLD)
        spec = {
            "data": str(data), "batch": a.batch, "max_rows": a.max_rows, "dp_max_rows": a.dp_max_rows,
            "rounds": rounds, "window_s": window, "warmup": 1 if a.smoke else 2, "data_batches": data_batches,
            "cases": [asdict(c) for c in cases],
        }
        res, load = launch(spec)
    summary = summarize(res, cases, a.batch)
    report = {
        "benchmark": "dist_throughput",
        "world_size": WORLD,
        "backend": "gloo",
        "threads_per_rank": 1,
        "batch_per_rank": a.batch,
        "global_batch": a.batch * WORLD,
        "model": "DLRM Criteo Kaggle: dim 16, bottom 13-512-256-64-16, top 512-256-1, dot, 26 tables; "
                 "dim64: same tables, bottom 13-512-256-64, top 512-512-256-1",
        "max_rows": a.max_rows,
        "rows_total": sum(sizes),
        "dp_max_rows": a.dp_max_rows,
        "rounds": rounds,
        "window_s": window,
        "mode": "smoke" if a.smoke else "quick" if a.quick else "full",
        "torchrec": torchrec_note,
        "pipeline_available": pipeline_ready,
        "other_runnable": load,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": info,
        **summary,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(markdown(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
