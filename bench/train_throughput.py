"""Training throughput on the Criteo Kaggle reference DLRM: recstack against the per-table baseline and the
dense-only floor.

Model: embedding dim 16, bottom MLP 13-512-256-64-16, top MLP 512-256-1, dot interaction, 26 tables at the
Kaggle cardinalities capped at 1M rows (about 5.6M rows in all), one id per feature, SGD lr 0.1 for dense
and sparse parameters. Each (batch size, torch threads) configuration runs in a fresh subprocess so that
thread pools, allocator state and caches of one cannot disturb another. Inside it three steps are timed:

- ``recstack``: a ``Trainer`` (so ``build_model`` + ``build_dense_optimizer``) and its own ``train_step``;
- ``baseline``: ``bench/baseline_dlrm.py``, one sparse ``nn.EmbeddingBag`` per table and ``torch.optim.SGD``;
- ``floor``: recstack's MLPs and interaction on ready-made embeddings [B, 26, 16] (no lookup, no update).

Zipf-like ids, dense features and labels are generated before timing. After a warm-up, rounds of timed
windows (one per step kind, the order rotated every round so drifting load hits all kinds alike) give
step times; samples/s is the batch size over the median step time, and each ratio is the median of the
per-round ratios (paired within a round). Results go to stdout as JSON, a markdown table to stderr.

    python bench/train_throughput.py [--quick] [--out results.json] [--clock cpu]

On a shared machine, ``other load`` (other tasks wanting a CPU while a configuration ran, sampled from
/proc/loadavg) says how much to trust each row; ``--clock cpu`` times 1-thread runs by process CPU time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
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

from bench.baseline_dlrm import BaselineDLRM, make_optimizer, train_step  # noqa: E402
from recstack.config import Config  # noqa: E402
from recstack.data.batch import Batch, SparseFeatures  # noqa: E402
from recstack.data.format import SparseFeatureSpec, capped_table_sizes  # noqa: E402
from recstack.data.prepare.criteo import KAGGLE_CARDINALITIES  # noqa: E402
from recstack.data.prepared_writer import PreparedWriter  # noqa: E402
from recstack.training.trainer import Trainer  # noqa: E402

NUM_DENSE = 13
MAX_ROWS = 1_000_000
LR = 0.1
KINDS = ("recstack", "baseline", "floor")
# Targets from the project issue: min samples/s ratio to the baseline, max step-time ratio to the floor.
TARGETS: dict[int, dict[str, float]] = {128: {"vs_baseline": 1.5}, 2048: {"vs_baseline": 1.1, "vs_floor": 1.15}}
_PRIME = 2_147_483_647  # > every table size, so multiplying by it permutes the rows of any table


def kaggle_config() -> Config:
    """The Criteo Kaggle reference configuration."""
    cfg = Config()
    cfg.model.embedding_dim = 16
    cfg.model.bottom_mlp = [512, 256, 64, 16]
    cfg.model.top_mlp = [512, 256, 1]
    cfg.model.interaction = "dot"
    cfg.model.max_table_size = MAX_ROWS
    cfg.optim.dense, cfg.optim.dense_lr = "sgd", LR
    cfg.optim.sparse, cfg.optim.sparse_lr = "sgd", LR
    cfg.train.device = "cpu"
    cfg.train.progress = False
    return cfg


def make_trainer(cfg: Config, table_sizes: list[int], data_dir: Path) -> Trainer:
    """A real Trainer (so the timed step is its own ``train_step``) on a one-batch prepared set whose
    sparse features have ``table_sizes`` rows (capped by ``cfg.model.max_table_size`` as in training).
    The rows only give the Trainer its schema; the benchmark feeds its own batches. Sets ``cfg.data``."""
    n = cfg.train.batch_size
    rng = np.random.default_rng(0)
    specs = [SparseFeatureSpec(f"C{i + 1}", size) for i, size in enumerate(table_sizes)]
    with PreparedWriter(data_dir, [f"I{i + 1}" for i in range(NUM_DENSE)], specs) as w:
        w.write(
            (rng.random(n) < 0.25).astype(np.float32),
            rng.random((n, NUM_DENSE), dtype=np.float32),
            np.stack([rng.integers(0, size, n) for size in table_sizes], axis=1),
        )
    cfg.data.train, cfg.data.eval_fraction = str(data_dir), 0.0
    return Trainer(cfg)


def zipf_ids(sizes: list[int], batch: int, gen: torch.Generator) -> torch.Tensor:
    """-> ids [batch, T], P(rank k) ~ 1/k per table (log-uniform rank), ranks scattered over the rows."""
    n = torch.tensor(sizes, dtype=torch.float64)
    u = torch.rand(batch, len(sizes), generator=gen, dtype=torch.float64)
    rank = (n**u).floor().to(torch.int64) - 1  # in [0, n - 1]
    rank = torch.minimum(rank, torch.tensor(sizes) - 1)  # guards float rounding at u -> 1
    return (rank * _PRIME) % torch.tensor(sizes)


def make_data(sizes: list[int], batch: int, num_batches: int, seed: int) -> list[dict[str, Any]]:
    """Pre-built inputs of every step kind for ``num_batches`` distinct batches (built once, never timed)."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(batch, dtype=torch.int64)
    out = []
    for _ in range(num_batches):
        ids = zipf_ids(sizes, batch, gen)  # [B, T]
        dense = torch.rand(batch, NUM_DENSE, generator=gen).mul_(8.0).log1p_()  # like log(1 + count)
        labels = (torch.rand(batch, generator=gen) < 0.25).float()
        out.append({
            "batch": Batch(dense, SparseFeatures.from_dense_ids(ids), labels),
            "ids": [ids[:, t].contiguous() for t in range(len(sizes))],
            "offsets": [offsets] * len(sizes),
            "dense": dense,
            "labels": labels,
        })
    return out


class DenseFloor:
    """recstack's MLPs and interaction (copies) trained on ready-made embeddings: the cost of the dense part."""

    def __init__(self, model: torch.nn.Module, batch: int, num_features: int, dim: int, seed: int,
                 device: torch.device | str = "cpu") -> None:
        self.bottom = copy.deepcopy(model.bottom)
        self.interaction = copy.deepcopy(model.interaction)
        self.top = copy.deepcopy(model.top)
        params = [*self.bottom.parameters(), *self.top.parameters(), *self.interaction.parameters()]
        self.optimizer = torch.optim.SGD(params, lr=LR)
        gen = torch.Generator().manual_seed(seed)
        self.emb = [
            (torch.randn(batch, num_features, dim, generator=gen) * 0.05).to(device).requires_grad_()
            for _ in range(4)
        ]  # [B, F, D] leaves, so backward reaches the embedding input as in the full models

    def step(self, i: int, dense: torch.Tensor, labels: torch.Tensor) -> float:
        emb = self.emb[i % len(self.emb)]
        logits = self.top(self.interaction(self.bottom(dense), emb)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        emb.grad = None
        return loss.item()


class StepKinds:
    """The three timed models at one batch size on ``device`` (tables capped at ``max_rows``), and their
    inputs on that device: ``step(kind, i)`` runs step ``i`` of ``kind`` (one of ``KINDS``)."""

    def __init__(self, batch: int, seed: int = 0, device: torch.device | str = "cpu", max_rows: int = MAX_ROWS,
                 threads: int = 0, num_batches: int | None = None) -> None:
        sizes = capped_table_sizes(KAGGLE_CARDINALITIES, max_rows)
        cfg = kaggle_config()
        cfg.train.batch_size, cfg.train.threads, cfg.train.seed = batch, threads, seed
        cfg.train.device, cfg.model.max_table_size = str(device), max_rows
        with tempfile.TemporaryDirectory(prefix="recstack-bench-") as tmp:
            self.trainer = make_trainer(cfg, KAGGLE_CARDINALITIES, Path(tmp) / "data")
        self.trainer.model.train()
        torch.manual_seed(seed)
        self.base = BaselineDLRM(NUM_DENSE, sizes, cfg.model.embedding_dim, cfg.model.bottom_mlp,
                                 cfg.model.top_mlp).to(device)
        self.base.train()
        self.base_opt = make_optimizer(self.base, LR)
        self.floor = DenseFloor(self.trainer.model, batch, len(sizes), cfg.model.embedding_dim, seed, device)
        data = make_data(sizes, batch, num_batches or max(8, 65536 // batch), seed + 1)
        self.data = [{k: (v.to(device) if not isinstance(v, list) else [t.to(device) for t in v])
                      for k, v in d.items()} for d in data]

    def step(self, kind: str, i: int) -> None:
        d = self.data[i % len(self.data)]
        if kind == "recstack":
            self.trainer.train_step(d["batch"])
        elif kind == "baseline":
            train_step(self.base, self.base_opt, d["dense"], d["ids"], d["offsets"], d["labels"])
        else:
            self.floor.step(i, d["dense"], d["labels"])


def run_config(
    batch: int, threads: int, rounds: int, window_s: float, seed: int = 0, clock: str = "wall"
) -> dict[str, Any]:
    """Times the three step kinds for one configuration in this process. -> per-kind step times and ratios.

    ``clock="cpu"`` times with this process's CPU time instead of wall time: steadier on a busy machine with
    one thread, meaningless with several (waiting threads spin).
    """
    now = time.perf_counter if clock == "wall" else time.process_time
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    kinds = StepKinds(batch, seed, threads=threads)
    build_s = time.perf_counter() - t0

    counters = dict.fromkeys(KINDS, 0)

    def one(kind: str) -> None:
        counters[kind] += 1
        kinds.step(kind, counters[kind] - 1)

    # Warm-up, then size each window so that it lasts about ``window_s`` for every kind.
    steps: dict[str, int] = {}
    for kind in KINDS:
        for _ in range(3):
            one(kind)
        t = now()
        n = 0
        while n < 2 or now() - t < min(0.5, window_s):
            one(kind)
            n += 1
        steps[kind] = max(1, round(window_s * n / (now() - t)))  # one step when a step outlasts the window

    per_round: dict[str, list[float]] = {k: [] for k in KINDS}  # seconds per step
    for r in range(rounds):
        for kind in KINDS[r % len(KINDS):] + KINDS[: r % len(KINDS)]:
            t = now()
            for _ in range(steps[kind]):
                one(kind)
            per_round[kind].append((now() - t) / steps[kind])

    step_s = {k: statistics.median(v) for k, v in per_round.items()}
    rs, bl, fl = per_round["recstack"], per_round["baseline"], per_round["floor"]
    return {
        "batch_size": batch,
        "threads": threads,
        "clock": clock,
        "torch_threads": torch.get_num_threads(),
        "build_s": round(build_s, 2),
        "steps_per_window": steps,
        "step_ms": {k: round(v * 1e3, 3) for k, v in step_s.items()},
        "step_ms_rounds": {k: [round(x * 1e3, 3) for x in v] for k, v in per_round.items()},
        "samples_per_s": {k: round(batch / v, 1) for k, v in step_s.items()},
        # recstack samples/s over the baseline's (higher is better)
        "speedup_vs_baseline": round(statistics.median(b / a for a, b in zip(rs, bl, strict=True)), 3),
        # recstack step time over the floor's (1.0 = embeddings cost nothing)
        "time_vs_floor": round(statistics.median(a / f for a, f in zip(rs, fl, strict=True)), 3),
        # the floor's samples/s over the baseline's: the most any embedding work could give (the ceiling of
        # speedup_vs_baseline while the dense part is the floor's)
        "floor_vs_baseline": round(statistics.median(b / f for f, b in zip(fl, bl, strict=True)), 3),
    }


def _runnable() -> int | None:
    """Tasks running or waiting for a CPU right now, machine-wide (4th field of /proc/loadavg), or None."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def run_worker(cmd: list[str], env: dict[str, str], threads: int) -> tuple[int, str, str, float | None]:
    """Runs one configuration; meanwhile samples how many other tasks want a CPU (this sampler and the
    worker's ``threads`` excluded), the noise that every number of that configuration carries.
    -> (exit code, stdout, stderr, mean other runnable tasks or None where /proc is missing)."""
    samples: list[int] = []
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        while proc.poll() is None:
            n = _runnable()
            if n is not None:
                samples.append(max(0, n - 1 - threads))
            time.sleep(0.25)
        out.seek(0)
        err.seek(0)
        others = round(statistics.mean(samples), 2) if samples else None
        return proc.returncode, out.read(), err.read(), others


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mkl": torch.backends.mkl.is_available(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def check_targets(res: dict[str, Any]) -> dict[str, bool]:
    t = TARGETS.get(res["batch_size"], {})
    out = {}
    if "vs_baseline" in t:
        out[f"speedup_vs_baseline >= {t['vs_baseline']}"] = res["speedup_vs_baseline"] >= t["vs_baseline"]
    if "vs_floor" in t:
        out[f"time_vs_floor <= {t['vs_floor']}"] = res["time_vs_floor"] <= t["vs_floor"]
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| batch | threads | recstack samples/s | baseline samples/s | floor samples/s | recstack / baseline "
        "| recstack time / floor time | floor / baseline (ceiling) | other load | targets |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        s = r["samples_per_s"]
        targets = ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in r["targets"].items())
        load = "n/a" if r.get("other_runnable") is None else f"{r['other_runnable']:.1f}"
        lines.append(
            f"| {r['batch_size']} | {r['threads']} | {s['recstack']:,.0f} | {s['baseline']:,.0f} | "
            f"{s['floor']:,.0f} | {r['speedup_vs_baseline']:.2f}x | {r['time_vs_floor']:.2f}x | "
            f"{r['floor_vs_baseline']:.2f}x | {load} | {targets} |"
        )
    lines.append("")
    lines.append(
        "other load: mean number of other tasks wanting a CPU while the configuration ran. Above about 0.5 on a "
        "2-core machine the numbers are contended, the 2-thread ones most (every parallel region waits for the "
        "second core)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter windows (about a minute in all)")
    p.add_argument("--out", type=Path, help="also write the JSON results to this file")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, help="timed rounds per configuration (default 12, quick 5)")
    p.add_argument("--window", type=float, help="seconds per timed window (default 1.2, quick 0.5)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time (default) or process CPU time (steadier on a shared machine, 1 thread only)")
    p.add_argument("--worker", nargs=2, type=int, metavar=("BATCH", "THREADS"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    rounds = a.rounds or (5 if a.quick else 12)
    window = a.window or (0.5 if a.quick else 1.2)

    if a.worker:  # one configuration, in its own process
        print(json.dumps(run_config(a.worker[0], a.worker[1], rounds, window, clock=a.clock)))
        return 0

    info = machine_info()
    results = []
    t0 = time.perf_counter()
    for batch in a.batch_sizes:
        for threads in a.threads:
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(batch), str(threads),
                   "--rounds", str(rounds), "--window", str(window), "--clock", a.clock]
            code, out, err, others = run_worker(cmd, env, threads)
            if code != 0:
                sys.stderr.write(err)
                raise SystemExit(f"configuration batch={batch} threads={threads} failed (exit {code})")
            res = json.loads(out.strip().splitlines()[-1])
            res["other_runnable"] = others
            res["targets"] = check_targets(res)
            results.append(res)
            print(f"batch {batch} threads {threads}: {res['samples_per_s']}", file=sys.stderr, flush=True)
    info["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    report = {
        "benchmark": "train_throughput",
        "model": "DLRM Criteo Kaggle: dim 16, bottom 13-512-256-64-16, top 512-256-1, dot, 26 tables <= 1M rows",
        "rows_total": sum(capped_table_sizes(KAGGLE_CARDINALITIES, MAX_ROWS)),
        "rounds": rounds,
        "window_s": window,
        "clock": a.clock,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": info,
        "results": results,
        "all_targets_met": all(all(r["targets"].values()) for r in results),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(markdown(results), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
