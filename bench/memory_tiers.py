"""Embedding tables larger than memory: throughput and cache hit rate of cached tiers against all-in-memory.

A DLRM (8 tables of dim 64, row-wise Adagrad, one id per feature, bottom MLP 13-256-64, top MLP 256-128-1)
trains on Zipf-distributed ids (exponent ``--zipf``, popular ranks scattered over the table by a keyed
permutation). Batches come from the project's ``BatchLoader`` over a generated stand-in data set, so the loader
thread announces each batch to the collection exactly as in training and the next batch's rows are prefetched
while the current one computes. Every configuration runs in a fresh subprocess, so its peak resident memory
(VmHWM) is its own:

- ``all-in-memory``: ``FusedEmbeddingBagCollection`` (the baseline);
- ``host-cached`` and ``ssd-cached`` with a cache of 1%, 5%, 20% and 100% of each table's rows;
- ``larger-than-RAM``: ssd-cached tables totalling several times ``--ram-budget`` with a 5% cache, whose peak
  RSS is checked against the budget.

After ``--warmup`` steps, ``--steps`` steps are timed; samples/s is their samples over their wall time and the hit
rate is over the rows they requested. Output: JSON (``--out``) and a chart (``--chart``).

    python bench/memory_tiers.py [--quick] [--out docs/memory_tiers.json] [--chart docs/memory_tiers.png]

``--world 2`` runs the 2-rank mode instead (tiered shards under torchrun against the same run in memory, the
planner's prediction against the measured step; ``bench/memory_tiers_dist.py``):

    python bench/memory_tiers.py --world 2 [--quick] [--out bench/results/memory_tiers_world2.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recstack.config import Config  # noqa: E402
from recstack.data.batch import Batch, SparseFeatures  # noqa: E402
from recstack.data.loader import BatchLoader  # noqa: E402
from recstack.data.synth.zipf import IdPermutation, keyed, scalar_key, uniform, zipf_ranks  # noqa: E402
from recstack.embedding import FusedEmbeddingBagCollection  # noqa: E402
from recstack.embedding.sparse_optim import sparse_optimizer_config  # noqa: E402
from recstack.embedding.tiered.collection import TablePlacement, TieredEmbeddingCollection  # noqa: E402
from recstack.embedding.tiered.placement import format_plan, plan_placement  # noqa: E402
from recstack.embedding.tiered.store import record_width  # noqa: E402
from recstack.models.build import table_configs  # noqa: E402
from recstack.models.dlrm import DLRM  # noqa: E402
from recstack.training.step import build_dense_optimizer  # noqa: E402
from recstack.units import format_bytes, parse_bytes  # noqa: E402

NUM_DENSE = 13
FRACTIONS = (0.01, 0.05, 0.20, 1.0)


class ZipfDataset:
    """Stand-in for a PreparedDataset: row i's ids, dense features and label are pure functions of (seed, i), so
    batches cost no storage. Only what ``BatchLoader`` calls is provided."""

    def __init__(self, rows: int, table_rows: list[int], exponent: float, seed: int) -> None:
        self.rows, self.table_rows, self.exponent = rows, table_rows, exponent
        self.perms = [IdPermutation(n, scalar_key(seed, 1, t)) for t, n in enumerate(table_rows)]
        self.keys = [scalar_key(seed, 2, t) for t in range(len(table_rows))]
        self.dense_key, self.label_key = scalar_key(seed, 3), scalar_key(seed, 4)

    def __len__(self) -> int:
        return self.rows

    def has(self, name: str) -> bool:
        return False

    def batch(self, start: int, end: int, extras: tuple[str, ...] = ()) -> Batch:
        r = np.arange(start, end)
        ids = np.stack([p.forward(zipf_ranks(uniform(keyed(k, r)), n, self.exponent))
                        for p, k, n in zip(self.perms, self.keys, self.table_rows, strict=True)], 1)
        dense = uniform(keyed(self.dense_key, r[:, None], np.arange(NUM_DENSE)[None, :])).astype(np.float32)
        labels = (uniform(keyed(self.label_key, r)) < 0.25).astype(np.float32)
        return Batch(torch.from_numpy(dense), SparseFeatures.from_dense_ids(ids), torch.from_numpy(labels))


def _config() -> Config:
    cfg = Config()
    cfg.model.embedding_dim = 64
    cfg.model.bottom_mlp = [256, 64]
    cfg.model.top_mlp = [256, 128, 1]
    cfg.optim.sparse, cfg.optim.sparse_lr = "rowwise_adagrad", 0.05
    cfg.optim.dense, cfg.optim.dense_lr = "sgd", 0.05
    cfg.train.seed = 0
    return cfg


def _vm_hwm() -> int:
    """Peak resident set of this process in bytes (VmHWM: anonymous and file-backed pages alike)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class _Run:
    """One model with its optimizer and its own loader thread (announcing batches to the collection)."""

    def __init__(self, spec: dict[str, Any], rows: int, tier: str) -> None:
        cfg = _config()
        self.sizes = [rows] * spec["tables"]
        tables = table_configs(self.sizes, cfg.model.embedding_dim)
        opt = sparse_optimizer_config(cfg.optim)
        self.row_bytes = 4 * record_width(cfg.model.embedding_dim, True)
        t0 = time.perf_counter()
        if tier == "all-in-memory":
            self.emb: torch.nn.Module = FusedEmbeddingBagCollection(tables, opt, seed=0)
            self.plan = "all tables in memory"
        else:
            host = None if tier == "host-cached" else 0
            if spec.get("from_budget"):  # the placement the [memory] budgets give: the leftover device memory
                device_budget = int(sum(self.sizes) * self.row_bytes * spec["fraction"])  # is all cache
                placements = plan_placement(tables, self.row_bytes, device_budget, host, spec["ssd_dir"],
                                            spec["policy"])
            else:  # the sweep names the cache size (a budget of 100% would keep every table in memory)
                device_budget = None
                placements = [TablePlacement(tier, max(1, int(spec["fraction"] * rows)), spec["policy"])
                              for _ in tables]
            self.plan = format_plan(tables, placements, self.row_bytes, device_budget, host, spec["ssd_dir"])
            self.emb = TieredEmbeddingCollection(tables, opt, placements, seed=0, ssd_dir=spec["ssd_dir"] or None)
        self.build_seconds = time.perf_counter() - t0
        torch.manual_seed(0)
        self.model = DLRM(cfg.model, NUM_DENSE, self.emb)
        self.optimizer = build_dense_optimizer(cfg.optim, self.model.dense_parameters())
        b = spec["batch"]
        n_steps = spec["warmup"] + spec["window"] * (2 * spec["rounds"] + 2)
        hook = getattr(self.emb, "next_batch_hook", lambda: None)()
        loader = BatchLoader(ZipfDataset(n_steps * b, self.sizes, spec["zipf"], seed=1), b, transform=hook)
        self.batches = loader.iterate_epoch()
        self.batch_size, self.losses = b, []

    def steps(self, n: int) -> float:
        """Train n steps -> their wall time in seconds (loading included, as in training)."""
        t0 = time.perf_counter()
        for _ in range(n):
            batch = next(self.batches)
            loss = F.binary_cross_entropy_with_logits(self.model(batch), batch.labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.losses.append(loss.item())
        return time.perf_counter() - t0

    @property
    def tiered(self) -> TieredEmbeddingCollection | None:
        return self.emb if isinstance(self.emb, TieredEmbeddingCollection) else None


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this process: build it, warm up, time a window alone and record the peak RSS;
    then (for cached tiers) build the all-in-memory model on tables that fit and time the two in alternating
    windows, so that load from other processes hits both alike. -> a result row."""
    torch.set_num_threads(spec["threads"])
    k, b = spec["window"], spec["batch"]
    run = _Run(spec, spec["rows"], spec["tier"])
    run.steps(spec["warmup"])
    if run.tiered is not None:
        run.tiered.reset_cache_stats()
    solo = run.steps(k)
    out: dict[str, Any] = {
        **{key: spec[key] for key in ("name", "tier", "fraction", "policy", "tables", "rows", "batch", "zipf")},
        "table_bytes": sum(run.sizes) * run.row_bytes,
        "peak_rss_bytes": _vm_hwm(),  # build, warm-up and a timed window, before anything else is built
        "build_seconds": run.build_seconds,
        "samples_per_sec_alone": k * b / solo,
        "plan": run.plan,
    }
    if spec["tier"] != "all-in-memory":
        base = _Run(spec, spec["base_rows"], "all-in-memory")
        base.steps(spec["warmup"])
        mine, theirs = [], []
        for r in range(spec["rounds"]):
            pair = [(run, mine), (base, theirs)]
            for who, times in pair if r % 2 == 0 else pair[::-1]:
                times.append(who.steps(k))
        ratios = sorted(t / m for m, t in zip(mine, theirs, strict=True))
        out.update(samples_per_sec=k * b / float(np.median(mine)),
                   all_in_memory_samples_per_sec=k * b / float(np.median(theirs)),
                   vs_all_in_memory=float(np.median(ratios)),
                   vs_all_in_memory_range=[ratios[0], ratios[-1]],
                   same_losses=base.losses[: len(run.losses)] == run.losses[: len(base.losses)])
        tot = run.tiered.counters.totals()
        out.update(hit_rate=tot["hit_rate"], staged=tot["staged"], late=tot["late"],
                   cache_bytes=sum(x["capacity"] for x in run.tiered.cache_stats().values()) * run.row_bytes,
                   fetch_ms_per_step=1e3 * tot["fetch_seconds"] / len(run.losses),
                   prefetch_ms_per_step=1e3 * tot["prefetch_seconds"] / len(run.losses))
        run.tiered.close()
    else:
        times = [run.steps(k) for _ in range(spec["rounds"])]
        out.update(samples_per_sec=k * b / float(np.median(times)), vs_all_in_memory=1.0)
    return out


def _spawn(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['name']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def chart(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    base = next(r for r in results if r["tier"] == "all-in-memory")
    for tier, marker in (("host-cached", "o"), ("ssd-cached", "s")):
        rows = sorted((r for r in results if r["tier"] == tier and r["name"] != "larger-than-RAM"),
                      key=lambda r: r["fraction"])
        xs = [100 * r["fraction"] for r in rows]
        ys = [100 * r["vs_all_in_memory"] for r in rows]
        err = [[y - 100 * r["vs_all_in_memory_range"][0] for y, r in zip(ys, rows, strict=True)],
               [100 * r["vs_all_in_memory_range"][1] - y for y, r in zip(ys, rows, strict=True)]]
        ax1.errorbar(xs, ys, yerr=err, marker=marker, capsize=3, label=tier)
        ax2.plot(xs, [100 * r["hit_rate"] for r in rows], marker=marker, label=tier)
    ax1.axhline(100, color="k", ls="--", lw=1, label="all-in-memory, same process")
    ax1.axhline(50, color="grey", ls=":", lw=1, label="50%")
    for r in (r for r in results if r["name"] == "larger-than-RAM"):
        label = f"ssd-cached, tables {r['table_bytes'] / r['ram_budget_bytes']:.1f}x the RAM budget"
        ax1.scatter([100 * r["fraction"]], [100 * r["vs_all_in_memory"]], marker="*", s=180, color="C3", label=label,
                    zorder=3)
        ax2.scatter([100 * r["fraction"]], [100 * r["hit_rate"]], marker="*", s=180, color="C3", label=label, zorder=3)
    for ax, name in ((ax1, "throughput, % of all-in-memory (paired windows)"), (ax2, "cache hit rate (%)")):
        ax.set_xscale("log")
        ax.set_xticks([1, 5, 20, 100], ["1%", "5%", "20%", "100%"])
        ax.set_xlabel("cache size (% of each table's rows)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylim(bottom=0)
    fig.suptitle(f"DLRM, {base['tables']} tables x {base['rows']:,} rows x 64, row-wise Adagrad, Zipf {base['zipf']}, "
                 f"batch {base['batch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _world2(args: argparse.Namespace) -> None:
    """The 2-rank mode, with its own defaults: 8 tables x 150K rows (312 MB), batch 1024 per rank, Zipf 1.1 (the
    synthetic generator's), 10 warm-up steps, 16 rounds of 30-step windows per run (1.1M synthetic rows: 537
    global batches, each run reads 524)."""
    from bench.memory_tiers_dist import run

    defaults = {"rows": (500_000, 150_000), "batch": (2048, 1024), "zipf": (1.05, 1.1), "warmup": (40, 10),
                "window": (10, 30), "rounds": (12, 16)}
    for name, (single, world2) in defaults.items():
        if getattr(args, name) == single:
            setattr(args, name, world2)
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
              "args": {k: v for k, v in vars(args).items() if k not in ("child", "chart")}, **run(args)}
    out = Path(args.out or "bench/results/memory_tiers_world2.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    r = report
    print(f"2 ranks: {r['samples_per_sec']:,.0f} samples/s tiered, {r['in_memory_samples_per_sec']:,.0f} in memory "
          f"({100 * r['vs_in_memory']:.0f}%); hit rates "
          + ", ".join(f"rank {x['rank']} {100 * (x['hit_rate'] or 0):.1f}%" for x in r["ranks"])
          + f"; step {1e3 * r['step_seconds']['tiered']:.1f} ms measured, "
          f"{1e3 * r['planner']['predicted_step_seconds']:.2f} ms predicted (load {r['loadavg'][0]:.1f})",
          file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="tiny tables and few steps (a smoke run)")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=500_000, help="rows per table in the sweep (tables that fit)")
    p.add_argument("--big-rows", type=int, default=2_500_000, help="rows per table in the larger-than-RAM run")
    p.add_argument("--ram-budget", default="1GiB", help="RAM budget of the larger-than-RAM run")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--window", type=int, default=10, help="steps per timed window")
    p.add_argument("--rounds", type=int, default=12, help="timed windows per model")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the prefetch thread is extra)")
    p.add_argument("--policy", default="lru")
    p.add_argument("--ssd-dir", default="", help="where table files go (default: a temporary directory)")
    p.add_argument("--out", default=None, help="JSON (default docs/memory_tiers.json; with --world 2 "
                                                 "bench/results/memory_tiers_world2.json)")
    p.add_argument("--chart", default="docs/memory_tiers.png")
    w = p.add_argument_group("--world 2: tiered shards under torchrun (bench/memory_tiers_dist.py)")
    w.add_argument("--world", type=int, default=1, choices=(1, 2), help="2: the 2-rank torchrun mode")
    w.add_argument("--data-rows", type=int, default=1_100_000, help="synthetic rows generated for --world 2")
    w.add_argument("--device-fraction", type=float, default=0.05,
                   help="per-rank device budget as a share of the rank's shard bytes (--world 2)")
    w.add_argument("--host-fraction", type=float, default=0.5,
                   help="per-rank host budget as a share of the rank's shard bytes (--world 2)")
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    if args.world == 2:
        _world2(args)
        return
    args.out = args.out or "docs/memory_tiers.json"
    if args.quick:
        args.rows, args.big_rows, args.ram_budget = 20_000, 60_000, "1GiB"
        args.warmup, args.window, args.rounds, args.batch = 5, 3, 3, 512
    ssd_root = Path(args.ssd_dir) if args.ssd_dir else Path(tempfile.mkdtemp(prefix="memory-tiers-"))
    common = {"tables": args.tables, "batch": args.batch, "zipf": args.zipf, "warmup": args.warmup,
              "window": args.window, "rounds": args.rounds, "threads": args.threads, "policy": args.policy,
              "ssd_dir": str(ssd_root), "base_rows": args.rows}
    specs = [{**common, "name": "all-in-memory", "tier": "all-in-memory", "fraction": 1.0, "rows": args.rows}]
    for tier in ("host-cached", "ssd-cached"):
        for f in FRACTIONS:
            specs.append({**common, "name": f"{tier} {100 * f:g}%", "tier": tier, "fraction": f, "rows": args.rows})
    budget = parse_bytes(args.ram_budget)
    specs.append({**common, "name": "larger-than-RAM", "tier": "ssd-cached", "fraction": 0.05,
                  "rows": args.big_rows, "from_budget": True})
    results = []
    for spec in specs:
        r = _spawn(spec)
        r["loadavg_after"] = os.getloadavg()[0]
        if spec["name"] == "larger-than-RAM":
            r.update(ram_budget_bytes=budget, within_budget=r["peak_rss_bytes"] <= budget)
        results.append(r)
        print(f"{r['name']:<18} {r['samples_per_sec']:>8,.0f} samples/s  {100 * r['vs_all_in_memory']:5.1f}% of "
              f"all-in-memory  hit rate {100 * r.get('hit_rate', 1):5.1f}%  peak RSS "
              f"{format_bytes(r['peak_rss_bytes'])}  (load {r['loadavg_after']:.1f})", file=sys.stderr, flush=True)
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    chart(results, Path(args.chart))


if __name__ == "__main__":
    main()
