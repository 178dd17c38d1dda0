"""The 2-rank mode of ``bench/memory_tiers.py``: tiered embedding shards under torchrun (gloo, CPU) against the
same sharded run with every shard in memory, and the planner's predicted step against the measured one.

Tables: ``--tables`` x ``--rows`` x 64 (row-wise Adagrad, 260 B a row), table-wise over 2 ranks. Ids come from
the synthetic generator (``[data.synth]``, Zipf exponent ``--zipf``), one id per feature; the model is the
single-process bench's DLRM (bottom 13-256-64, top 256-128-1), batch ``--batch`` per rank.

1. ``recstack plan --tables FILE --topology 1x2 --hbm DEVICE --ddr 2xHOST --ssd 2xSSD --force-sharding
   table_wise`` plans the tiers per shard, with the per-rank budgets (device: ``--device-fraction`` of a
   rank's shard bytes; host: ``--host-fraction``; together about half a rank's shards) and predicts the step
   time and each shard's hit rate.
2. ``torchrun --nproc_per_node 2 bench/memory_tiers_dist.py --worker SPEC`` builds two real ``Trainer``s in the
   same two processes: ``tiered`` (``dist.plan`` = that plan, whose ``storage`` entries put every shard
   host- or ssd-cached, plus the same ``[memory]`` budgets per rank) and ``in-memory`` (the same plan without
   ``storage``). Both train with ``dist.pipeline`` (rows prefetched a batch ahead) on the same batches, in
   alternating windows (order swapped every round, a barrier around each window), so load from other
   processes hits both alike. The throughput ratio is the median of the per-round ratios; the hit rates are
   each rank's cache counters over the timed steps; ``same_losses`` compares the two runs' losses step for step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORLD = 2
DIM = 64
ROW_BYTES = 4 * (DIM + 1)  # weights and the row-wise Adagrad accumulator


def _config(spec: dict[str, Any], name: str, plan: str, tiered: bool) -> Any:
    from recstack.config import Config

    cfg = Config()
    cfg.data.synth = {"rows": spec["data_rows"], "seed": 0, "table_sizes": [spec["rows"]] * spec["tables"],
                      "max_table_size": spec["rows"], "zipf_exponent": spec["zipf"]}
    cfg.data.train, cfg.data.eval_fraction = str(Path(spec["tmp"]) / "data"), 0.0
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = DIM, [256, 64], [256, 128, 1]
    cfg.optim.sparse, cfg.optim.sparse_lr = "rowwise_adagrad", 0.05
    cfg.optim.dense, cfg.optim.dense_lr = "sgd", 0.05
    cfg.train.batch_size, cfg.train.threads, cfg.train.progress, cfg.train.seed = spec["batch"], 1, False, 0
    cfg.train.log_every, cfg.train.eval_every, cfg.train.checkpoint_every = 10**9, 0, 0
    cfg.train.output_dir = str(Path(spec["tmp"]) / name)
    cfg.dist.sharding, cfg.dist.plan, cfg.dist.pipeline, cfg.dist.timeout_s = "table_wise", plan, True, 600.0
    if tiered:
        cfg.memory.device, cfg.memory.host = spec["device_bytes"], spec["host_bytes"]
        cfg.memory.ssd_dir, cfg.memory.cache_policy = str(Path(spec["tmp"]) / "ssd"), spec["policy"]
    return cfg


def worker(spec: dict[str, Any]) -> None:
    """One rank: build both trainers, warm up, time alternating windows; rank 0 writes the result file."""
    import torch
    import torch.distributed as dist

    from bench.dist_worker import Case, RecstackModel

    torch.set_num_threads(1)
    case = Case("recstack", "d64", "table_wise", "fp32", True)
    models, build_s = {}, {}
    for name, plan, tiered in (("in-memory", spec["plan_memory"], False), ("tiered", spec["plan_tiers"], True)):
        t0 = time.perf_counter()
        models[name] = RecstackModel(_config(spec, name, plan, tiered))
        build_s[name] = time.perf_counter() - t0
    rank = dist.get_rank()
    cursor = dict.fromkeys(models, 0)  # each model reads the same batches in the same order
    losses: dict[str, list[float]] = {n: [] for n in models}
    n_batches = len(models["tiered"].trainer.train_ds) // (spec["batch"] * WORLD)

    def window(name: str, n: int) -> tuple[float, dict[str, float]]:
        """-> (seconds per step over n timed steps after 2 untimed ones that fill the pipeline, cache counters)."""
        m = models[name]
        if cursor[name] + n + 2 > n_batches:
            raise RuntimeError(f"the data set has {n_batches} global batches: raise --data-rows")
        it = m.steps(case, cursor[name], n + 2)
        cursor[name] += n + 2
        losses[name] += [next(it), next(it)]
        m.trainer.model.embeddings.pop_counters()
        dist.barrier()
        t0 = time.perf_counter()
        losses[name] += [next(it) for _ in range(n)]
        dist.barrier()
        dt = time.perf_counter() - t0
        for _ in it:  # lets the loader's prefetch thread finish
            pass
        return dt / n, m.trainer.model.embeddings.pop_counters()

    for name in models:
        window(name, spec["warmup"])
    times: dict[str, list[float]] = {n: [] for n in models}
    counters: dict[str, float] = {}
    for r in range(spec["rounds"]):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            dt, c = window(name, spec["window"])
            times[name].append(dt)
            if name == "tiered":
                for k, v in c.items():
                    if k.startswith("cache_"):
                        counters[k] = counters.get(k, 0.0) + v
    per_rank: list[Any] = [None] * WORLD
    dist.all_gather_object(per_rank, {"rank": rank, "counters": counters, "build_s": build_s})
    # A barrier before tearing down: gloo's worker thread releases the all-gather's tensors (it needs the GIL for
    # that) before the main thread, holding the GIL, joins it in the process group's destructor.
    dist.barrier()
    for m in models.values():
        m.trainer.close()
    models.clear()  # the DDP reducers go while the process group still exists
    dist.destroy_process_group()
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"times": times, "per_rank": per_rank,
                                                 "same_losses": losses["tiered"] == losses["in-memory"],
                                                 "steps_compared": len(losses["tiered"])}))


def _plan(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run ``recstack plan`` for the bench's tables and budgets; write the tiered plan and the same plan without
    storage. -> the command, its printed plan and the plan's predicted cost."""
    tables = [{"name": f"C{i + 1}", "rows": spec["rows"], "dim": DIM} for i in range(spec["tables"])]
    (tmp / "tables.json").write_text(json.dumps(tables))
    cmd = ["-m", "recstack", "plan", "--tables", str(tmp / "tables.json"), "--topology", f"1x{WORLD}",
           "--batch-size", str(spec["batch"]), "--hbm", str(spec["device_bytes"]),
           "--ddr", str(WORLD * spec["host_bytes"]), "--ssd", str(WORLD * spec["ssd_bytes"]),
           "--zipf", str(spec["zipf"]), "--cache-policy", spec["policy"], "--force-sharding", "table_wise",
           "--out", str(tmp / "plan_tiers.json")]
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"recstack plan failed:\n{proc.stderr[-3000:]}")
    plan = json.loads((tmp / "plan_tiers.json").read_text())
    memory = {**plan, "tables": [{k: v for k, v in t.items() if k != "storage"} for t in plan["tables"]]}
    (tmp / "plan_memory.json").write_text(json.dumps(memory))
    tiers = {t["name"]: next(iter(t.get("storage", {}).values()), {"tier": "device"}) for t in plan["tables"]}
    for line in proc.stdout.splitlines():  # the printed table's last column: the predicted hit rate
        words = line.split()
        if words and words[0] in tiers and tiers[words[0]]["tier"] != "device":
            tiers[words[0]]["predicted_hit_rate"] = float(words[-1])
    return {"command": "recstack " + " ".join(cmd[2:]).replace(str(tmp) + "/", ""), "text": proc.stdout,
            "cost": plan["cost"], "tiers": tiers}


def run(args: Any) -> dict[str, Any]:
    """The 2-rank bench: plan, one torchrun launch, the report (JSON-ready). The synthetic data, the plans and the
    ranks' SSD files go to ``--ssd-dir``, or to a temporary directory removed afterwards."""
    if args.quick:
        args.rows, args.data_rows, args.batch, args.warmup, args.window, args.rounds = 20_000, 24_000, 256, 2, 2, 2
    if args.ssd_dir:
        Path(args.ssd_dir).mkdir(parents=True, exist_ok=True)
        return _measure(args, Path(args.ssd_dir))
    with tempfile.TemporaryDirectory(prefix="memory-tiers-world2-") as tmp:
        return _measure(args, Path(tmp))


def _measure(args: Any, tmp: Path) -> dict[str, Any]:
    shard_bytes = args.tables // WORLD * args.rows * ROW_BYTES  # per rank, table-wise
    spec = {"tables": args.tables, "rows": args.rows, "data_rows": args.data_rows, "batch": args.batch,
            "zipf": args.zipf, "policy": args.policy, "warmup": args.warmup, "window": args.window,
            "rounds": args.rounds, "tmp": str(tmp), "out": str(tmp / "result.json"),
            "device_bytes": int(args.device_fraction * shard_bytes),
            "host_bytes": int(args.host_fraction * shard_bytes),
            "ssd_bytes": shard_bytes, "plan_tiers": str(tmp / "plan_tiers.json"),
            "plan_memory": str(tmp / "plan_memory.json")}
    load_before = list(os.getloadavg())
    plan = _plan(spec, tmp)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
              str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.run(launch, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"the torchrun launch failed:\n{proc.stderr[-4000:]}")
    res = json.loads(Path(spec["out"]).read_text())
    tiered, memory = res["times"]["tiered"], res["times"]["in-memory"]
    ratios = sorted(m / t for t, m in zip(tiered, memory, strict=True))  # throughput ratio per round
    global_batch = WORLD * args.batch
    ranks = []
    for r in sorted(res["per_rank"], key=lambda x: x["rank"]):
        c = r["counters"]
        req = c.get("cache_requests", 0.0)
        ranks.append({"rank": r["rank"], "hit_rate": c.get("cache_hits", 0.0) / req if req else None,
                      "late_fraction": c.get("cache_late", 0.0) / req if req else None,
                      "requests_per_step": req / (args.rounds * args.window), "build_seconds": r["build_s"]})
    step_tiered, step_memory = statistics.median(tiered), statistics.median(memory)
    cost = plan["cost"]
    return {
        "mode": "world2", "world_size": WORLD, "backend": "gloo", "device": "cpu",
        "scale": {"tables": args.tables, "rows_per_table": args.rows, "dim": DIM, "row_bytes": ROW_BYTES,
                  "table_bytes": args.tables * args.rows * ROW_BYTES, "shard_bytes_per_rank": shard_bytes,
                  "budget_per_rank": {"device": spec["device_bytes"], "host": spec["host_bytes"]},
                  "tables_vs_budget": shard_bytes / (spec["device_bytes"] + spec["host_bytes"]),
                  "batch_per_rank": args.batch, "zipf": args.zipf, "policy": args.policy,
                  "data_rows": args.data_rows},
        "timing": {"warmup": args.warmup, "window": args.window, "rounds": args.rounds},
        "tiers": plan["tiers"],
        "samples_per_sec": global_batch / step_tiered,
        "in_memory_samples_per_sec": global_batch / step_memory,
        "vs_in_memory": statistics.median(ratios), "vs_in_memory_range": [ratios[0], ratios[-1]],
        "step_seconds": {"tiered": step_tiered, "in_memory": step_memory,
                         "tiered_rounds": tiered, "in_memory_rounds": memory},
        "ranks": ranks, "same_losses": res["same_losses"], "steps_compared": res["steps_compared"],
        "planner": {"command": plan["command"], "predicted_step_seconds": cost["max"],
                    "predicted_cache_miss_seconds": max(cost["breakdown"]["cache_miss"]),
                    "measured_over_predicted": step_tiered / cost["max"],
                    "measured_tiered_minus_in_memory_seconds": step_tiered - step_memory,
                    "plan": plan["text"]},
        "wall_seconds": time.perf_counter() - t0,
        "loadavg_before": load_before, "loadavg": list(os.getloadavg()),
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        sys.exit("run bench/memory_tiers.py --world 2")
